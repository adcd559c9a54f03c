"""Step 1, ``prepare``: load and check everything a run needs, and write nothing.

Load the spec, refuse an interval that is not one period / one schedule interval, resolve and
check the input, fingerprint it (keyed), build the run key and the plan. No ledger write, so bad
input costs nothing: every refusal here happens before any budget is reserved. The Airflow DAG
re-runs ``prepare`` in every task (it is deterministic), so no task trusts a context handed over
by another.

The noise key is loaded here, once per run, from a file or a key reference, never from the
environment (``DPOPS_NOISE_KEY`` is refused: environments leak into process listings, crash dumps
and child processes). os mode needs the key too: the input fingerprint is keyed (semantics.md
section 5), so a fingerprint in the ledger or a manifest does not let a reader confirm guesses.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dpops.errors import InputDataError, InvalidParameter, SpecError
from dpops.inputs import (
    HmacKey,
    Interval,
    TestFingerprintKey,
    check_input,
    input_fingerprint,
    input_stat_snapshot,
    parse_interval,
    public_file_rows,
    resolve_input_paths,
    snapshot_locations,
)
from dpops.release.context import (
    RANDOMNESS,
    IntervalBound,
    NoiseKeyLike,
    Progress,
    RunContext,
    default_actor,
    report_stage,
)
from dpops.run_interval import requested_interval
from dpops.spec import ReleaseSpec, interval_problems, load_spec
from dpops.storage import Sealer, open_store
from dpops.storage.location import Location, is_uri

if TYPE_CHECKING:
    from dpops.ledger import Ledger
    from dpops.noise.randomness import NoiseKey
    from dpops.release.estimation import EstimationEngine
    from dpops.release_plan import ReleasePlan

def named_interval(spec: ReleaseSpec, interval_start: IntervalBound, interval_end: IntervalBound = None) -> Interval:
    """The interval the Python API is given, named as on the command line: ``(START, END)``, ``"START/END"``, or one
    ``START`` (``"2024-01-03"``, alone) for the spec's period starting there (``requested_interval``), so
    ``execute_release(spec, "2024-01-03", ...)`` releases the day ``dpops release run --interval 2024-01-03`` does."""
    if interval_end is None and isinstance(interval_start, str):
        return requested_interval(spec, interval_start)
    return parse_interval(interval_start, interval_end)


REMOVED_KEY_ENV = "DPOPS_NOISE_KEY"
# Builds the run's plan from its spec (default ``dpops.release_plan.plan_release``; tests inject their own).
Planner = Callable[[ReleaseSpec], "ReleasePlan"]
log = logging.getLogger("dpops.release")


def _refuse_key_in_env() -> None:
    """The key VALUE in the environment is refused before anything is reserved: environments leak
    (process listings, crash dumps, every child process, Airflow task metadata)."""
    if REMOVED_KEY_ENV in os.environ:
        raise InvalidParameter(
            f"the environment variable {REMOVED_KEY_ENV} is set, but dpops no longer reads a noise key from the "
            "environment (it leaks into process listings and child processes): put the key in a file "
            "(dpops key generate PATH), pass --key-file PATH or set DPOPS_NOISE_KEY_FILE, and unset "
            f"{REMOVED_KEY_ENV}; nothing was reserved"
        )


def _load_key(key_path: str | None) -> NoiseKey:
    """Load the noise key once per run (``randomness.load_key`` keeps it for the in-process pipeline).

    ``key_path`` is a key reference (``dpops.keyref``): a file path, file:PATH, or a secret-manager
    reference that the pipeline's workers resolve themselves."""
    from dpops.keyref import FileKeyProvider, resolve_key, scheme_of
    from dpops.noise.randomness import load_key  # lazy: owned by the mechanisms module

    if not key_path:
        raise InvalidParameter("no noise key file given: pass --key-file PATH or set DPOPS_NOISE_KEY_FILE "
                               "(create a key with dpops key generate PATH)")
    if scheme_of(key_path) == "file":
        return load_key(FileKeyProvider().path(key_path))
    return resolve_key(key_path)


def _key_ref(key_path: str | None) -> str | None:
    """The key reference the workers get: a file path made absolute, any other reference as given."""
    from dpops.keyref import FileKeyProvider, scheme_of

    if not key_path:
        return None
    if scheme_of(key_path) == "file":
        return str(Path(FileKeyProvider().path(key_path)).resolve())
    return key_path


def _sealer(randomness: str, noise_key: NoiseKeyLike | None) -> Sealer | None:
    """The key that seals this run's staged output (dpops.storage): the noise key in keyed and os mode
    (both always load it), the public test seal key in test mode (never publishable anyway)."""
    if randomness == "test":
        from dpops.noise.randomness import test_seal_key

        return test_seal_key()
    return noise_key


def _default_planner(spec: ReleaseSpec) -> ReleasePlan:
    from dpops.release_plan import plan_release

    return plan_release(spec)


def _fingerprint_while(work: Callable[[], object], paths: list[str], key: HmacKey,
                      public_rows: list[list[object]] | None, digests: dict[str, tuple[int, str]]) -> str:
    """``input_fingerprint`` computed on a second thread while this one runs ``work``: hashlib releases the GIL
    while it hashes a chunk (``dpops.inputs`` reads 1 MiB at a time into one buffer), so a 10M-row input's
    ~0.5 s of hashing overlaps the pipeline's import instead of preceding it. ``digests`` gets each file's
    (size, sha256), as ``input_fingerprint`` gives them."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpops-fingerprint") as pool:
        future = pool.submit(input_fingerprint, paths, key, public_rows, digests=digests)
        try:
            work()
        except Exception:  # noqa: BLE001 - a warm-up only: the real import and its error come later, checked
            log.debug("warm-up while hashing failed; it is done again later", exc_info=True)
        return future.result()


def prepare(spec_path: str | os.PathLike[str], interval_start: IntervalBound, interval_end: IntervalBound = None, *,
            randomness: str = "keyed", key_path: str | None = None, test_seed: int | None = None,
            key: NoiseKeyLike | None = None, planner: Planner | None = None,
            actor: str | None = None, progress: Progress | None = None, ledger: Ledger | None = None,
            for_estimation: bool = False, estimation: str = "run", restate: bool = False,
            while_hashing: Callable[[], object] | None = None,
            estimation_engine: EstimationEngine | None = None) -> RunContext:
    """Load and check everything a run needs, without touching the ledger.

    ``while_hashing``: work for this thread while another hashes the input for its fingerprint (the release
    imports its Beam pipeline there: ``dpops.release.execute.execute_release``). The hashing thread runs only
    hashlib on local files (it imports nothing, so no module is imported from two threads at once); the
    fingerprint is the same. Its errors are ignored: what it prepares is done again, checked, later.

    ``key`` (an object with ``key_id`` and ``hmac(bytes)``) overrides ``key_path`` (tests, embedding);
    ``planner`` overrides ``dpops.release_plan.plan_release``.

    A spec with ``bounds: estimate`` is the one exception to "writes nothing": given the ``ledger``,
    ``prepare`` first runs (or, once committed, serves) the interval's bound estimation through
    ``dpops.release.estimation.run_estimation``, the steps ``dpops estimate`` runs, and the context's spec is
    ``spec.with_estimated_bounds``: the declared bounds replaced by the charged estimate, ``estimated_from``
    set, the release's epsilon the declared total minus the estimation's share. Without a ledger such a
    spec is refused (its bounds are not known yet). ``estimation="serve"``: only a committed estimation is
    used, none is started (steps that must never charge: abandon, the DAG's tasks after reserve, failure
    lines); no committed one is a LedgerError. ``estimation_engine``: where that estimation reads
    (``dpops.release.estimation.release_estimation_engine``; default Beam in this process). ``for_estimation``:
    the estimation's own prepare (the spec as written, at its fallback bounds). ``restate``: the run
    is an explicit restatement (``release restate``, the DAG's restate=true), the one case in which a published
    interval may get a new estimation.
    """
    if randomness not in RANDOMNESS:
        raise InvalidParameter(f"randomness must be one of {RANDOMNESS}, got {randomness!r}")
    if estimation not in ("run", "serve"):
        raise InvalidParameter(f"estimation must be 'run' or 'serve', got {estimation!r}")
    _refuse_key_in_env()
    noise_key: NoiseKeyLike | None = None
    fp_key: HmacKey
    if randomness == "test":
        if test_seed is None:
            raise InvalidParameter("randomness 'test' needs a test seed")
        fp_key = TestFingerprintKey()
        key_id = f"test/seed-{int(test_seed)}"
    else:
        if test_seed is not None:
            raise InvalidParameter(f"a test seed is allowed only with randomness 'test', not {randomness!r}")
        # os mode also needs the key: the input fingerprint is keyed (semantics.md section 5).
        noise_key = key if key is not None else _load_key(key_path)
        fp_key = noise_key
        key_id = fp_key.key_id
        from dpops.keyref import check_pinned_key_id

        check_pinned_key_id(key_id, key_path)  # the operator's $DPOPS_NOISE_KEY_ID, before anything is reserved
    spec = load_spec(spec_path)
    named = named_interval(spec, interval_start, interval_end)  # one START, as the CLI takes it
    interval_start, interval_end = named.start, named.end
    estimated: dict[str, tuple[float, float]] | None = None
    estimation_charged = 0.0
    if spec.estimated_metric_keys and not for_estimation:
        spec, estimated, estimation_charged = _estimated_spec(
            spec, spec_path, interval_start, interval_end, ledger=ledger, randomness=randomness, key_path=key_path,
            test_seed=test_seed, planner=planner, actor=actor, serve_only=estimation == "serve", restate=restate,
            engine=estimation_engine)
    interval = parse_interval(interval_start, interval_end)
    # Before anything is read or reserved: a period-scoped release covers exactly one period and a
    # scheduled one exactly one schedule interval (issue 11 item 2; see dpops.spec.interval_problems).
    misaligned = interval_problems(spec, interval.start, interval.end, spec_path=str(spec_path))
    if misaligned:
        raise SpecError("\n".join(f"{spec.source}: {m}" for m in misaligned) + "\nnothing was reserved")
    paths = resolve_input_paths(spec, interval.start, interval.end, key_path=key_path)
    report_stage(progress, "fingerprint")
    # The snapshot is taken BEFORE the input checks and compared again after the fingerprint pass: the file the
    # checks passed is the file the fingerprint (so the run key) names. Taken after the checks, as it was, a file
    # rewritten between the two (other columns, another format) got a run key of its own and passed the check
    # before ``start`` (snapshot and hash both of the new file), so the pipeline read, after the charge, a file
    # no check had seen. Local and S3 inputs (``input_stat_snapshot``: None for other object stores).
    snapshot_of = snapshot_locations(spec, paths)  # the inputs and the public partition file, if any
    stats = input_stat_snapshot(snapshot_of)
    check_input(spec, paths)
    public_rows = public_file_rows(spec)
    all_local = all(not is_uri(p) or Location.parse(p).is_local for p in paths)
    digests: dict[str, tuple[int, str]] = {}  # each file's (size, sha256): in memory, for the after-read check
    if while_hashing is not None and stats is not None and all_local:  # object stores hash through imports
        fingerprint = _fingerprint_while(while_hashing, paths, fp_key, public_rows, digests)
    else:
        fingerprint = input_fingerprint(paths, fp_key, public_rows, digests=digests)
    if stats is not None and input_stat_snapshot(snapshot_of) != stats:
        raise InputDataError(f"{spec.source}: the input files changed while they were checked and fingerprinted "
                             f"({interval}); nothing was reserved. Run again when the input is final")
    plan = (planner or _default_planner)(spec)
    if not list(plan.events):
        raise SpecError(f"{spec.source}: the plan has no privacy events; nothing to release")
    from dpops.manifest.run_hook import check_signing_key

    check_signing_key()  # a configured manifest signing key must load before anything is reserved
    gx_project = os.environ.get("DPOPS_GX_PROJECT")
    if gx_project:  # team GX suites are untrusted: a bad one is refused before anything is reserved
        from dpops.gx_project import preflight

        preflight(gx_project, spec.name)
    from dpops.keyref import previous_key_paths

    return RunContext(
        spec_path=str(Path(spec_path).resolve()), spec=spec, interval=interval, input_paths=paths,
        input_fingerprint=fingerprint, randomness=randomness, key_id=key_id, plan=plan,
        store=open_store(spec.output_root, spec.name, sealer=_sealer(randomness, noise_key)),
        key_path=_key_ref(key_path),
        test_seed=test_seed, actor=actor or default_actor(), fingerprint_key=fp_key, estimated_bounds=estimated,
        input_stats=stats, input_digests=digests,
        estimation_charged=estimation_charged, previous_key_paths=previous_key_paths(),
    )


def _estimated_spec(spec: ReleaseSpec, spec_path: str | os.PathLike[str], interval_start: IntervalBound,
                    interval_end: IntervalBound, *, ledger: Ledger | None, randomness: str, key_path: str | None,
                    test_seed: int | None, planner: Planner | None, actor: str | None,
                    serve_only: bool = False, restate: bool = False,
                    engine: EstimationEngine | None = None
                    ) -> tuple[ReleaseSpec, dict[str, tuple[float, float]], float]:
    """``bounds: estimate``: run or serve the interval's estimation, return the spec with its result.

    The estimation is ``dpops estimate``'s own charged, keyed run (run key ``<name>__estimate``, epsilon
    the declared share): a retry serves the committed one and charges nothing. The release's events
    (planned at the fallback bounds: they do not depend on value bounds) go along so that nothing is
    reserved unless both fit the scope. Returns the spec, the bounds and what this call charged."""
    from dpops.analysis.estimate import option_config
    from dpops.release.estimation import EstimationEngine, run_estimation

    if ledger is None:
        raise InvalidParameter(f"{spec.source}: metric(s) {spec.estimated_metric_keys} have bounds: estimate, so "
                               "the run first estimates them in the ledger; this step was called without a ledger")
    if randomness == "os":
        raise InvalidParameter(f"{spec.source}: bounds: estimate needs keyed randomness (its estimation must be "
                               "free to retry); os randomness cannot reproduce it; nothing was reserved")
    release_events = list((planner or _default_planner)(spec).events)
    # the estimation's own prepare: the spec as written, at its fallback bounds (nothing is written here)
    est_ctx = prepare(spec_path, interval_start, interval_end, randomness=randomness, key_path=key_path,
                      test_seed=test_seed, actor=actor, for_estimation=True)
    est = run_estimation(est_ctx, option_config(spec), ledger, then_charges=release_events, serve_only=serve_only,
                         for_release=not restate, engine=engine or EstimationEngine())
    assert est.run_id is not None  # estimate returns a committed (or served) run
    bounds = {c: est.bounds[c] for c in spec.estimated_columns}
    return spec.with_estimated_bounds(est.run_id, bounds), bounds, float(est.epsilon_charged)
