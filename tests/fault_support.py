"""Helpers for the fault-injection and bad-input tests: forked CLI runs, fault points, invariants.

Every release under test runs in a FORKED child process (``run_cli``): the child runs
``dpops.cli.main.main(argv)`` and a fault point can SIGKILL it for real (no ``finally``,
no rollback in Python). Forking from a parent that already imported Beam and dpops
makes one killed run cost ~1 s instead of ~8 s for a fresh interpreter. These tests
never run a pipeline in the parent; forking after other test files ran Beam in-process
was checked to work, and ``run_cli``'s timeout turns a stuck child into a failure.

Fault points (``dpops.testing.faults.fault_point``) are installed in the child by wrapping
functions of ``dpops.release``, ``dpops.storage``, ``dpops.ledger`` and the pipeline
(``install_fault_points``), plus the ledger's own in-transaction test hook, so no
module owned by someone else needs a change. ``FAULT_POINTS`` lists them in run order.

Run as a script it is the driver for a fresh interpreter:
``DPOPS_FAULT=beam.noise=pause python tests/fault_support.py release run ...``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from dpops.testing.faults import fault_point

INTERVAL = "2024-01-01/2024-01-02"
SLUG = "20240101T000000Z_20240102T000000Z"
RELEASE = "faults"
SCOPE = "shop"

# (point, where it is, state the ledger is left in by a kill there)
FAULT_POINTS: list[tuple[str, str, str]] = [
    ("prepare.after", "spec/input checked, nothing written", "none"),
    ("ledger.reserve:locked", "reserve transaction, scope locked, before the insert", "none"),
    ("ledger.reserve:before_commit", "reserve transaction, rows written, before COMMIT", "none"),
    ("reserve.after", "step boundary reserve -> compute", "reserved"),
    ("ledger.started:before_commit", "start transaction, before COMMIT", "reserved"),
    ("start.after", "started, before the pipeline", "started"),
    ("beam.noise", "inside the Beam job (SelectNoiseWrite, 2nd shard)", "started"),
    ("pipeline.after", "pipeline done, output not sealed", "started"),
    ("stage.after", "step boundary compute -> publish (sealed)", "started"),
    ("manifest.after", "manifest written (before publishing), nothing visible yet", "started"),
    ("ledger.committed:locked", "commit transaction, buckets updated, before the entry", "started"),
    ("ledger.committed:before_commit", "commit transaction, before COMMIT", "started"),
    ("commit.after", "committed in the ledger, files not visible yet", "committed"),
    ("publish.before_pointer", "publish: version dir in place, current pointer not moved", "committed"),
    ("publish.after", "published and committed, before the step returns", "committed"),
]


def _after(point: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        out = fn(*a, **k)
        fault_point(point)
        return out
    return wrapper


def _before(point: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        fault_point(point)
        return fn(*a, **k)
    return wrapper


def install_fault_points() -> None:
    """Wrap the run's steps with fault points (call in the forked child only)."""
    from dpops import release
    from dpops.ledger import backend
    from dpops.ledger.store import Ledger
    from dpops.release import computation, execute, manifests
    from dpops.storage import ReleaseStore
    from pipelines import release_pipeline as rp

    # prepare and reserve are looked up in dpops.release.execute by execute_release/execute_restatement,
    # and on the package by `dpops ledger reserve`: one wrapper, patched at both.
    execute.prepare = release.prepare = _after("prepare.after", execute.prepare)
    execute.reserve = release.reserve = _after("reserve.after", execute.reserve)
    manifests.write_manifest_before_publish = _after("manifest.after", manifests.write_manifest_before_publish)
    Ledger.start = _after("start.after", Ledger.start)
    Ledger.commit = _after("commit.after", Ledger.commit)
    real_load = computation._load_run_release
    computation._load_run_release = lambda: _after("pipeline.after", real_load())
    ReleaseStore.finish_staging = _after("stage.after", ReleaseStore.finish_staging)
    ReleaseStore.publish = _after("publish.after", ReleaseStore.publish)
    ReleaseStore._point_current = staticmethod(_before("publish.before_pointer", ReleaseStore._point_current))
    real_process = rp.SelectNoiseWrite.process

    def process(self, element):
        fault_point("beam.noise")
        yield from real_process(self, element)

    rp.SelectNoiseWrite.process = process
    backend.set_test_hook(lambda point: fault_point(f"ledger.{point}"))


# --------------------------------------------------------------------------- forked CLI runs


@dataclass
class CliRun:
    rc: int  # exit code, or -signal number
    out: str
    err: str
    seconds: float

    @property
    def killed(self) -> bool:
        return self.rc == -signal.SIGKILL

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err

    def json(self) -> Any:
        return json.loads(self.out)


def warm_imports() -> None:
    """Import everything a run needs in the parent, so forked children start warm."""
    import dpops.cli.ledger  # noqa: F401
    import dpops.cli.release  # noqa: F401
    import dpops.manifest.run_hook  # noqa: F401
    import dpops.release_plan  # noqa: F401
    import pipelines.release_pipeline  # noqa: F401


def run_cli(argv: list[str], *, fault: str | None = None, env: dict[str, str] | None = None,
            cwd: str | Path | None = None, timeout: float = 120.0, on_start=None) -> CliRun:
    """``dpops <argv>`` in a forked child; ``fault`` sets ``DPOPS_FAULT`` there. ``on_start(pid, done)``
    runs in the parent while the child works (``done()`` says whether it exited)."""
    import tempfile

    from dpops.cli.main import main

    outdir = Path(tempfile.mkdtemp(prefix="dpops-cli-"))
    t0 = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child: never returns
        rc = 98
        try:
            out_fd = os.open(outdir / "out", os.O_WRONLY | os.O_CREAT)
            err_fd = os.open(outdir / "err", os.O_WRONLY | os.O_CREAT)
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            os.environ.pop("DPOPS_FAULT", None)
            os.environ.update(env or {})
            if fault:
                os.environ["DPOPS_FAULT"] = fault
            if cwd:
                os.chdir(cwd)
            install_fault_points()
            rc = main(list(argv))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - an escaped exception is a crash the test must see
            traceback.print_exc()
            rc = 99
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(rc)
    status = None

    def done() -> bool:
        nonlocal status
        if status is None:
            got, st = os.waitpid(pid, os.WNOHANG)
            if got:
                status = st
        return status is not None

    try:
        if on_start is not None:
            on_start(pid, done)
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"dpops {' '.join(argv)} did not finish within {timeout}s")
            time.sleep(0.02)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return CliRun(rc, (outdir / "out").read_text(), (outdir / "err").read_text(), time.monotonic() - t0)
    finally:
        if not done():  # a failed test or a timeout: never leave the child behind
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.rmtree(outdir, ignore_errors=True)


# --------------------------------------------------------------------------- a small release to break


SPEC_DOC: dict[str, Any] = {
    "name": RELEASE,
    "input": {"path": "data/{start:%Y-%m-%d}.parquet", "format": "parquet",
              "columns": {"user_id": "string", "region": "string", "amount": "float"}},
    "privacy_unit": {"column": "user_id", "description": "a user's purchases on one day", "adjacency": "add_remove"},
    "budget": {"scope": SCOPE, "epsilon": 1.0, "delta": 0},
    "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 2},
    "partitions": {"columns": ["region"], "public": ["north", "south", "east", "west"]},
    "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 100]}],
}


def write_events(path: Path, n: int = 300, seed: int = 3, users: int = 100) -> None:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "user_id": [f"u{i}" for i in rng.integers(0, users, n)],
        "region": rng.choice(["north", "south", "east"], n).tolist(),
        "amount": rng.uniform(0, 120, n),
    }), path)


@dataclass
class ReleaseEnv:
    """One release directory (spec, input, key, output root) and its ledger."""

    root: Path
    ledger_url: str
    key_file: Path
    spec: Path = field(init=False)

    def __post_init__(self) -> None:
        self.spec = self.root / "spec.yaml"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def run_args(self, *extra: str, publish: bool = True) -> list[str]:
        args = ["release", "run", str(self.spec), "--interval", INTERVAL, "--ledger", self.ledger_url,
                "--key-file", str(self.key_file), "--no-gx-checks", "--json"]
        return args + (["--publish"] if publish else []) + list(extra)

    def restate_args(self) -> list[str]:
        return ["release", "restate", str(self.spec), "--interval", INTERVAL, "--ledger", self.ledger_url,
                "--key-file", str(self.key_file), "--no-gx-checks", "--json"]

    def recover_args(self) -> list[str]:
        return ["ledger", "--ledger", self.ledger_url, "recover", "--older-than", "0"]

    def ledger(self):
        from dpops.ledger import open_ledger

        return open_ledger(self.ledger_url)


def make_env(root: Path, ledger_url: str, key_file: Path, *, spec_doc: dict | None = None, cap: float = 3.0,
             rows: int = 300, users: int = 100) -> ReleaseEnv:
    """A spec + a day of input + a fresh scope ``shop`` (basic accountant, cap ``cap``) on ``ledger_url``."""
    from dpops.ledger import ScopeDefinition

    root.mkdir(parents=True, exist_ok=True)
    env = ReleaseEnv(root, ledger_url, key_file)
    env.spec.write_text(yaml.safe_dump(spec_doc or SPEC_DOC))
    write_events(root / "data/2024-01-01.parquet", rows, users=users)
    with env.ledger() as led:
        led.create_scope(ScopeDefinition(name=SCOPE, unit="a user's purchases on one day", unit_column="user_id",
                                         epsilon=cap, delta=1e-6, rho=None, accountant="basic/1",
                                         adjacency="add_remove"), actor="test")
    return env


def postgres_schema_url(base: str) -> tuple[str, str]:
    """A URL of a fresh, empty schema on the shared test database, and the schema name."""
    schema = f"faults_{secrets.token_hex(5)}"
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}schema={schema}", schema


def drop_schema(base: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# --------------------------------------------------------------------------- invariants


def published_table(env: ReleaseEnv) -> pa.Table | None:
    f = env.out / "published" / RELEASE / SLUG / "current" / "data.parquet"
    return pq.read_table(f) if f.exists() else None


def check_invariants(env: ReleaseEnv, *, settled: bool = True, recovered: bool = False,
                     reference: pa.Table | None = None, max_charge: float = 1.0) -> dict:
    """Assert the crash-safety invariants; return a summary (ledger states, charge, versions).

    - the ledger verifies (hash chain, state machine, totals);
    - the interval is published at most once (one version, one committed run, no restatement here),
      and with the reference values when given (keyed noise: a retry reproduces, never redraws);
    - every run that started ends committed or spent_unpublished, never released (its noise is charged);
    - after the documented recovery (``recovered``) no run is left reserved or started;
    - the scope's charge is exactly what the non-released runs reserved, at most ``max_charge`` (one run's
      epsilon in keyed mode: retries are free);
    - the published version is byte-identical to its run's sealed staged output, and its marker names a
      committed run whose output_uri points at it (``settled=False`` right after a crash: the run may
      still be started, killed between the publish and the ledger commit, until it is retried);
    - a manifest exists only for a committed run and names that run's ledger entries and output.
    """
    from dpops.storage import ReleaseStore

    with env.ledger() as led:
        report = led.verify()
        assert report.ok, f"ledger does not verify: {report.problems}"
        runs = led.runs(release=RELEASE)
        history = led.history(SCOPE)
        status = led.status(SCOPE)
    kinds: dict[str, list[str]] = {}
    for e in history:
        if e.run_id:
            kinds.setdefault(e.run_id, []).append(e.kind)
    states = {r.run_id: r.state for r in runs}
    for r in runs:
        if "started" in kinds.get(r.run_id, []):
            assert r.state in ("started", "committed", "spent_unpublished"), \
                f"run {r.run_id} drew noise but is {r.state}: its charge was refunded"
        if recovered:
            assert r.state not in ("reserved", "started"), f"run {r.run_id} left {r.state} after recovery"
    committed = [r for r in runs if r.state == "committed"]
    assert len(committed) <= 1, f"interval committed twice: {[r.run_id for r in committed]}"
    charged = sum(r.epsilon for r in runs if r.state != "released")
    assert abs(status.total - charged) < 1e-9, f"scope total {status.total} != charged runs {charged}"
    assert charged <= max_charge + 1e-9, f"charged {charged}: more than {max_charge} for one interval"

    from dpops.noise.randomness import NoiseKey

    store = ReleaseStore(env.out, RELEASE, sealer=NoiseKey.from_file(env.key_file))
    versions = store.versions(SLUG)
    assert len(versions) <= 1, f"interval published {len(versions)} times"
    current = store.current(SLUG)
    if versions:
        v = versions[0]
        # settled=False: killed between the version rename and the pointer move, readers see nothing yet
        assert (current is not None and current.version == v.version) or (not settled and current is None), \
            "published version without current pointer"
        staged = store.verify_staged(SLUG, v.run_id)
        assert v.hashes["data.parquet"] == staged.hashes["data.parquet"], "published data differs from staged"
        allowed = ("committed",)  # the ledger commits before the files become visible
        assert states.get(v.run_id) in allowed, f"published run {v.run_id} is {states.get(v.run_id)} in the ledger"
        rec = next(r for r in runs if r.run_id == v.run_id)
        assert rec.state != "committed" or rec.output_uri == v.uri, f"ledger output {rec.output_uri} != published {v.uri}"
        if reference is not None:
            assert pq.read_table(v.directory / "data.parquet").equals(reference), "published values differ"
    else:
        # right after a crash between the ledger commit and the file publish; any retry completes it
        assert not committed or not settled, "a committed run but nothing published"
    manifests = sorted((env.out / "manifests" / RELEASE).glob("*.json")) if (env.out / "manifests").exists() else []
    for m in manifests:
        # written right before the publish (semantics.md section 5), so it may precede the commit
        doc = json.loads(m.read_text())
        rec = next((r for r in runs if r.run_id == doc["run_id"]), None)
        assert rec is not None, f"manifest {m.name} names no run of the ledger"
        assert doc["ledger"]["entry_ids"] == rec.entry_ids[: len(doc["ledger"]["entry_ids"])], \
            f"manifest {m.name} names entries {doc['ledger']['entry_ids']}, the run has {rec.entry_ids}"
        if rec.state == "committed":
            assert doc["output"]["uri"] == rec.output_uri, f"manifest {m.name} points elsewhere than the ledger"
            link = rec.details.get("commit", {}).get("manifest")
            if link:
                assert link["sha256"] == hashlib.sha256(m.read_bytes()).hexdigest(), f"{m.name} changed after commit"
        elif settled:
            assert doc["outcome"]["state"] != "published" or rec.state not in ("released", "spent_unpublished"), \
                f"manifest {m.name} says published but the run is {rec.state}"
    return {"states": sorted(states.values()), "charged": charged, "versions": len(versions),
            "manifests": len(manifests)}


if __name__ == "__main__":  # driver: `python tests/fault_support.py <dpops args>` with DPOPS_FAULT set
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    install_fault_points()
    from dpops.cli.main import main as _main

    sys.exit(_main(sys.argv[1:]))
