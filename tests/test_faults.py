"""Fault injection over whole release runs, on both ledger backends (issue #7).

A real ``dpops release run --publish`` (real plan, Beam FnApiRunner, 300 rows) is SIGKILLed at
every step boundary and inside the ledger transactions, the Beam job and the publish; then it is
retried (``dpops release run`` again) or closed with the documented recovery
(``dpops ledger recover``) and retried. After every case ``check_invariants`` asserts: the ledger
verifies, the interval is published at most once and with the very values of an uncrashed run,
every drawn noise stays charged, nothing is left dangling after recovery, staged/published/ledger/
manifest agree. The fault matrix (point x backend -> outcome) is printed at the end of the module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fault_support import (FAULT_POINTS, RELEASE, SLUG, check_invariants, drop_schema, make_env,
                           postgres_schema_url, published_table, run_cli, warm_imports)

pytestmark = pytest.mark.timeout(300)

MATRIX: list[tuple[str, str, str, str]] = []  # (point, fault, backend, outcome)
# Storage and Beam points do not depend on the ledger backend: PostgreSQL runs the ledger
# transactions and the step boundaries around each ledger call (keeps the matrix ~3 min).
POSTGRES_POINTS = {"ledger.reserve:before_commit", "ledger.started:before_commit", "commit.after",
                   "ledger.committed:before_commit"}
KILL_CASES = [pytest.param(point, where, left, backend, id=f"{point}-{backend}",
                           marks=[pytest.mark.postgres] if backend == "postgres" else [])
              for point, where, left in FAULT_POINTS for backend in ("sqlite", "postgres")
              if backend == "sqlite" or point in POSTGRES_POINTS]
RECOVER_CASES = [pytest.param(p, b, id=f"{p}-{b}", marks=[pytest.mark.postgres] if b == "postgres" else [])
                 for p, b in [("reserve.after", "sqlite"), ("beam.noise", "sqlite"), ("commit.after", "sqlite"),
                              ("publish.before_pointer", "sqlite"), ("start.after", "postgres")]]


@pytest.fixture(scope="module", autouse=True)
def fault_matrix(request):
    warm_imports()
    yield
    if not MATRIX:
        return
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    w = max(len(p) for p, *_ in MATRIX)
    wf = max(len(f) for _, f, *_ in MATRIX)
    lines = ["", "fault matrix (step x fault x backend -> outcome):"]
    lines += [f"  {p:<{w}}  {f:<{wf}}  {b:<10} -> {o}" for p, f, b, o in MATRIX]
    with capman.global_and_fixture_disabled():  # shown even without -s
        print("\n".join(lines), flush=True)
    MATRIX.clear()  # test_faults_env shares this list and prints its own rows


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    from dpops.noise.randomness import NoiseKey

    path = tmp_path_factory.mktemp("key") / "noise.key"
    NoiseKey.generate(path)
    return path


@pytest.fixture
def ledger_url(request, tmp_path, backend):
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite'}"
        return
    base = request.getfixturevalue("postgres_url")
    url, schema = postgres_schema_url(base)
    try:
        yield url
    finally:
        drop_schema(base, schema)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, key_file):
    """The published table of an uncrashed run: same spec, input and key => every retry must equal it."""
    root = tmp_path_factory.mktemp("reference")
    env = make_env(root, f"sqlite:///{root / 'ledger.sqlite'}", key_file)
    r = run_cli(env.run_args())
    assert r.rc == 0, r.err
    MATRIX.append(("(no fault)", "-", "sqlite", f"published in {r.seconds:.1f}s"))
    return published_table(env)


def _ledger_states(env) -> list[str]:
    with env.ledger() as led:
        return sorted(r.state for r in led.runs(release=RELEASE))


def _fault(point: str) -> str:
    return "beam.noise@2=kill" if point == "beam.noise" else f"{point}=kill"


@pytest.mark.parametrize("point,where,left,backend", KILL_CASES)
def test_sigkill_then_retry(tmp_path, ledger_url, key_file, reference, point, where, left, backend):
    env = make_env(tmp_path / "rel", ledger_url, key_file)
    killed = run_cli(env.run_args(), fault=_fault(point))
    assert killed.killed, f"fault point {point} was not reached: rc={killed.rc}\n{killed.err}"
    assert _ledger_states(env) == ([] if left == "none" else [left]), f"kill at {point} ({where})"
    check_invariants(env, settled=False)  # the crash itself leaves a consistent state
    retry = run_cli(env.run_args())
    assert retry.rc == 0 and not retry.traceback, retry.err
    out = retry.json()
    assert out["state"] in ("published", "already_published")
    # keyed noise: charged once in total, whichever invocation reserved it
    assert out["epsilon_charged"] == (0 if left != "none" else pytest.approx(1.0))
    try:
        summary = check_invariants(env, reference=reference)
    except AssertionError as exc:
        MATRIX.append((point, "SIGKILL+retry", backend, f"{left} -> INVARIANT BROKEN: {exc}"))
        raise
    assert summary["states"] == ["committed"] and summary["charged"] == pytest.approx(1.0)
    assert summary["versions"] == 1 and summary["manifests"] == 1
    MATRIX.append((point, "SIGKILL+retry", backend, f"{left} -> {out['state']}, charged once, same values "
                   f"(kill {killed.seconds:.1f}s, retry {retry.seconds:.1f}s)"))


def test_fault_point_hook(monkeypatch, tmp_path):
    from dpops.testing import faults

    assert faults.parse_fault("beam.noise@3=raise") == ("beam.noise", 3, "raise")
    assert faults.parse_fault("ledger.reserve:locked") == ("ledger.reserve:locked", 1, "kill")
    for bad in ("", "=kill", "x=explode", "x@0", "x@two"):
        with pytest.raises(ValueError):
            faults.parse_fault(bad)
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.fault_point("p")  # unset: a no-op
    monkeypatch.setenv(faults.ENV, "p@2=raise")
    faults.fault_point("other")
    faults.fault_point("p")  # first hit: not yet
    with pytest.raises(faults.InjectedFault, match="injected fault at p"):
        faults.fault_point("p")


def test_fault_points_cover_every_step():
    """Every ledger state a crash can leave is exercised, and the list has no typo'd duplicates."""
    names = [p for p, *_ in FAULT_POINTS]
    assert len(names) == len(set(names))
    assert {left for *_, left in FAULT_POINTS} == {"none", "reserved", "started", "committed"}


@pytest.mark.parametrize("point,backend", RECOVER_CASES)
def test_sigkill_then_documented_recovery(tmp_path, ledger_url, key_file, reference, point, backend):
    """``dpops ledger recover`` closes whatever a crash left open: a reservation is refunded (released),
    a started run stays charged (spent_unpublished), a committed run is untouched; nothing dangles
    afterwards. A retry then: after a refund, reserves a new attempt (one fresh charge, the same
    noise label, so the same values); after spent_unpublished, is refused with a clear message
    (exit 6): keyed noise that was charged but not published is never charged or published again
    silently; a committed run is served."""
    env = make_env(tmp_path / "rel", ledger_url, key_file)
    assert run_cli(env.run_args(), fault=_fault(point)).killed
    before = _ledger_states(env)
    rec = run_cli(env.recover_args())
    assert rec.rc == 0 and "recovered" in rec.out, rec.err
    try:
        # a committed run whose files are not visible yet is completed by the retry, not by recover
        summary = check_invariants(env, recovered=True, settled=before[0] != "committed")
    except AssertionError as exc:
        MATRIX.append((point, "SIGKILL+recover", backend, f"{before[0]} -> INVARIANT BROKEN: {exc}"))
        raise
    want = {"reserved": "released", "started": "spent_unpublished", "committed": "committed"}[before[0]]
    assert summary["states"] == [want]
    assert summary["charged"] == pytest.approx(0.0 if want == "released" else 1.0)
    retry = run_cli(env.run_args())
    assert not retry.traceback, retry.err
    if want == "spent_unpublished":
        assert retry.rc == 6 and "is spent_unpublished" in retry.err, retry.err
        outcome = "refused exit 6 (charged, never re-published silently)"
        after = check_invariants(env, recovered=True)
        assert after["charged"] == pytest.approx(1.0) and after["versions"] == 0
    else:
        assert retry.rc == 0, retry.err
        outcome = retry.json()["state"]
        after = check_invariants(env, recovered=True, reference=reference)
        assert after["charged"] == pytest.approx(1.0) and after["versions"] == 1
        assert sorted(after["states"]) == (["committed", "released"] if want == "released" else ["committed"])
    MATRIX.append((point, "SIGKILL+recover", backend, f"{before[0]} -> {want}; retry {outcome}"))


@pytest.mark.parametrize("point", ["beam.noise", "manifest.after"])
def test_os_randomness_kill_then_retry(tmp_path, key_file, point):
    """Fresh OS noise cannot be reproduced. Killed before the output was sealed, the attempt's noise may
    exist somewhere: the next invocation closes it as spent_unpublished (exit 6, saying so) and the one
    after reserves attempt 2 with a fresh charge. Killed after sealing, the retry publishes the sealed
    output under the first charge."""
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    args = env.run_args("--randomness", "os")
    assert run_cli(args, fault=_fault(point)).killed
    check_invariants(env, settled=False)
    first = run_cli(args)
    assert not first.traceback, first.err
    if point == "beam.noise":
        assert first.rc == 6 and "spent_unpublished" in first.err and "fresh charge" in first.err, first.err
        second = run_cli(args)
        assert second.rc == 0 and second.json()["state"] == "published", second.err
        summary = check_invariants(env, max_charge=2.0)
        assert summary["states"] == ["committed", "spent_unpublished"] and summary["charged"] == pytest.approx(2.0)
        outcome = "started -> exit 6 (spent_unpublished) -> attempt 2 published, charged twice"
    else:
        assert first.rc == 0 and first.json()["state"] == "published", first.err
        summary = check_invariants(env)
        assert summary["states"] == ["committed"] and summary["charged"] == pytest.approx(1.0)
        outcome = "started -> sealed output published, charged once"
    MATRIX.append((point, "SIGKILL+retry (os)", "sqlite", outcome))


@pytest.mark.parametrize("ledger_url,backend", [("sqlite", "sqlite"), ("postgres", "postgres")],
                         indirect=["ledger_url"], ids=["sqlite", "postgres"])
def test_recover_itself_killed_mid_transaction(tmp_path, ledger_url, key_file, backend):
    """The recovery command is crash-safe too: killed inside its spent_unpublished transaction it
    changes nothing, and running it again closes the run."""
    env = make_env(tmp_path / "rel", ledger_url, key_file)
    assert run_cli(env.run_args(), fault="start.after=kill").killed
    assert run_cli(env.recover_args(), fault="ledger.spent_unpublished:before_commit=kill").killed
    assert _ledger_states(env) == ["started"]
    check_invariants(env, settled=False)
    again = run_cli(env.recover_args())
    assert again.rc == 0 and "recovered 1 run(s)" in again.out, again.err
    summary = check_invariants(env, recovered=True)
    assert summary["states"] == ["spent_unpublished"] and summary["charged"] == pytest.approx(1.0)
    MATRIX.append(("ledger.spent_unpublished:before_commit", "SIGKILL recover", backend,
                   "started kept -> recover again -> spent_unpublished"))


@pytest.mark.parametrize("point", ["beam.noise", "publish.before_pointer", "ledger.committed:before_commit"])
def test_sigkill_during_a_restatement_then_retry(tmp_path, key_file, reference, point):
    """A corrected input restated over a published interval, killed midway and restated again: v1 stays
    byte-identical, v2 is published once and points back at v1, each version charged exactly once."""
    import pyarrow.parquet as pq

    from fault_support import write_events

    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    first = run_cli(env.run_args())
    assert first.rc == 0, first.err
    v1_bytes = (env.out / "published" / RELEASE / SLUG / "v1" / "data.parquet").read_bytes()
    write_events(env.root / "data/2024-01-01.parquet", 320, seed=4)  # late data: a new input
    assert run_cli(env.restate_args(), fault=_fault(point)).killed
    retry = run_cli(env.restate_args())
    # killed after the ledger commit (publish.before_pointer), the retry completes the publication
    want = "already_published" if point == "publish.before_pointer" else "published"
    assert retry.rc == 0 and retry.json()["state"] == want, retry.err
    again = run_cli(env.restate_args())  # and once more: served, nothing new
    assert again.rc == 0 and again.json()["state"] == "already_published" and again.json()["epsilon_charged"] == 0
    from dpops.storage import ReleaseStore

    with env.ledger() as led:
        assert led.verify().ok
        runs = {r.run_id: r for r in led.runs(release=RELEASE)}
        total = led.status("shop").total
    store = ReleaseStore(env.out, RELEASE)
    versions = store.versions(SLUG)
    assert [v.version for v in versions] == [1, 2] and store.current(SLUG).version == 2
    v1, v2 = versions
    assert (v1.directory / "data.parquet").read_bytes() == v1_bytes  # never overwritten
    assert pq.read_table(v1.directory / "data.parquet").equals(reference)
    assert v2.restates == v1.run_id and runs[v2.run_id].restates == v1.run_id
    assert sorted(r.state for r in runs.values()) == ["committed", "committed"]
    assert total == pytest.approx(2.0)  # two inputs, two charges, no more
    MATRIX.append((point, "SIGKILL restate", "sqlite", "v1 kept, v2 published once, charged once each"))


def test_private_partition_selection_kill_then_retry(tmp_path, key_file):
    """Private partition selection (truncated geometric) is part of the keyed noise: a run killed inside
    the Beam job and retried selects the very same partitions with the same values as an uncrashed run."""
    from fault_support import SPEC_DOC, published_table

    doc = {**SPEC_DOC, "budget": {**SPEC_DOC["budget"], "delta": 1e-8},
           "partitions": {"columns": ["region"], "private": {"strategy": "truncated_geometric"}}}
    # 2000 units over 3 regions (~600 kept units each, far above the selection threshold of about
    # ln(1/delta)/eps ~ 10^2 units: a miss is astronomically unlikely under any key); "west" has no data
    # and can never be selected
    data = dict(spec_doc=doc, rows=3000, users=2000)
    clean = make_env(tmp_path / "clean", f"sqlite:///{tmp_path / 'clean.sqlite'}", key_file, **data)
    assert run_cli(clean.run_args()).rc == 0
    want = published_table(clean)
    assert 0 < want.num_rows <= 3 and "west" not in want.column("region").to_pylist()
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file, **data)
    assert run_cli(env.run_args(), fault="beam.noise@2=kill").killed
    retry = run_cli(env.run_args())
    assert retry.rc == 0 and retry.json()["state"] == "published", retry.err
    check_invariants(env, reference=want)
    MATRIX.append(("beam.noise", "SIGKILL+retry (private)", "sqlite",
                   f"started -> published, same {want.num_rows} selected partitions and values"))


def test_kill_with_great_expectations_checks_on(tmp_path, key_file, reference):
    """The CLI default (GX output checks before publishing): killed after the checks and the manifest,
    right before the ledger commit, retried."""
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    args = [a for a in env.run_args() if a != "--no-gx-checks"]
    assert run_cli(args, fault="manifest.after=kill").killed
    retry = run_cli(args)
    assert retry.rc == 0 and retry.json()["state"] == "published", retry.err
    check_invariants(env, reference=reference)
    MATRIX.append(("manifest.after", "SIGKILL+retry (GX)", "sqlite", "started -> published, charged once"))


def test_external_sigkill_of_a_fresh_interpreter(tmp_path, key_file, reference):
    """The whole path without fork tricks: a fresh ``python`` (the driver installs the fault points,
    then runs the CLI) pauses inside the Beam job and the TEST kills it from outside."""
    env = make_env(tmp_path / "rel", f"sqlite:///{tmp_path / 'ledger.sqlite'}", key_file)
    support = Path(__file__).resolve().parent / "fault_support.py"
    cue = tmp_path / "cue"
    cue.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(support), *env.run_args()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "DPOPS_FAULT": "beam.noise=pause", "DPOPS_FAULT_DIR": str(cue)},
    )
    try:
        deadline = time.monotonic() + 120
        while not (cue / "beam.noise.reached").exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the run never reached the Beam job"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert _ledger_states(env) == ["started"]
    check_invariants(env, settled=False)
    retry = run_cli(env.run_args())
    assert retry.rc == 0 and retry.json()["state"] == "published"
    check_invariants(env, reference=reference)
    MATRIX.append(("beam.noise", "external SIGKILL", "sqlite", "started -> published, charged once, same values"))
