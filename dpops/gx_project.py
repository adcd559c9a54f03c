"""A file-backed Great Expectations project per deployment: team suites and Data Docs on the NOISY output.

``$DPOPS_GX_PROJECT`` names the project directory (created 0700 on first use; GX's layout under
``<dir>/gx``). For each release ``R``, at publish, dpops runs one checkpoint ``dpops.R`` on the noisy
output with:

* the suite ``dpops.output.R``: dpops' own output expectations (every public partition exactly once,
  no nulls unless suppression is on, ``ci95_low <= ci95_high``, ``std >= 0``);
* every team suite in ``gx/expectations/output/R/**.json`` (suite ``output.R.<name>``) and
  ``gx/expectations/output/all/**.json`` (``output.all.<name>``), each validated first against
  ``dpops.gx_suites`` (an allow-list of expectation types and their keyword arguments, no row
  conditions): one bad file refuses the run (``SpecError``, exit 3, naming file, expectation index and
  field). The check runs in :func:`preflight` before any budget is reserved and again at publish.

Suites are code to GX (issue 19 item 5), so dpops never opens the project with GX in the publishing
process (``great_expectations.yml`` names modules GX imports, ``plugins/`` holds code) and never lets GX
evaluate a team suite there. The checkpoint runs in a child process (``dpops.sandbox``) confined by
Landlock to the Python installation and a scratch directory (and, as root, under uid 65534), with an
environment and file descriptors of its own: it receives a copy of the noisy output table (already
post-processed and publishable) and the validated suites, and cannot open the noise key, the data roots,
the staging or state directories, nor reach any network (its own empty network namespace and a seccomp
filter that allows only AF_INET/AF_INET6 sockets: no UDP or TCP peer, no Unix socket such as the ledger's
PostgreSQL socket; ``dpops.sandbox.isolate_network``). Its validation results and Data Docs are
copied back (regular files only) into ``gx/uncommitted/validations`` and
``gx/uncommitted/data_docs/local_site``; earlier results are copied into the child so the Data Docs index
keeps the history; the index itself is dpops' offline one (``dpops.gx_docs``). Team suites are refused,
not run unconfined, on a kernel without Landlock or a host that cannot build the network isolation.

Privacy reason: these suites see only the noisy, already-private output, so any verdict is
post-processing and may block a publish freely (semantics.md section 6); the private input is checked
only at schema level (``dpops.release.gx_checks.check_input_schema``). A failed suite raises
``IntegrityError`` naming the suite and expectation; it quotes no values.

A suite that appears or changes after the reservation is checked at publish: a bad one refuses the
publish (exit 3); the run stays ``started`` (charged, staged, nothing published) and a retry after
the suite is fixed publishes the same keyed output with no new charge.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from dpops.errors import IntegrityError, SpecError
from dpops.gx_suites import TeamSuite, check_project_tree, load_team_suites, validate_suite
from dpops.sandbox import landlock_abi, network_isolation_available, run_confined, write_result

if TYPE_CHECKING:
    from dpops.spec import ReleaseSpec

PROJECT_ENV = "DPOPS_GX_PROJECT"
SANDBOX_TIMEOUT_SECONDS = 600.0
_lock = threading.Lock()
_VALIDATIONS = ("gx", "uncommitted", "validations")
_DOCS = ("gx", "uncommitted", "data_docs", "local_site")


@dataclass
class CheckpointResult:
    """What the checkpoint ran and found; ``checks`` are ``<suite>: <expectation>`` names for the manifest."""

    checkpoint: str
    success: bool
    suites: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    data_docs: str | None = None  # local path of the Data Docs index
    confinement: str = ""


def project_root(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The configured project directory (``root`` or ``$DPOPS_GX_PROJECT``), or None."""
    value = root if root is not None else os.environ.get(PROJECT_ENV)
    return Path(value) if value else None


def ensure_project(root: str | os.PathLike[str]) -> Path:
    """Create the project directory 0700 if absent, then check it belongs to the operator (``SpecError``)."""
    path = Path(root)
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask
    check_project_tree(path)
    return path


def open_project(root: str | os.PathLike[str]) -> Any:
    """The project's GX ``FileDataContext`` for TEAM TOOLING (writing suites with GX's API); created 0700.

    dpops itself never calls this while it holds the key: opening a project imports what its
    ``great_expectations.yml`` names."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ensure_project(root)
    ctx = gx.get_context(mode="file", project_root_dir=str(root))
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    return ctx


def data_docs_index(root: str | os.PathLike[str]) -> Path:
    """Where the project's Data Docs index is."""
    return Path(root).joinpath(*_DOCS, "index.html")


def preflight(root: str | os.PathLike[str], release: str) -> list[TeamSuite]:
    """Check the project and every team suite of ``release`` (no GX, no key): ``SpecError`` on the first problem.

    Called before the reservation (``dpops.release.preparation.prepare``) and again at publish."""
    path = Path(root)
    if not os.path.lexists(path):
        return []
    suites = load_team_suites(path, release)
    if suites and not landlock_abi():
        raise SpecError(f"GX project {path}: team suites ({', '.join(s.name for s in suites)}) run only in the "
                        "Landlock sandbox, and this kernel offers no Landlock (Linux >= 5.13 with landlock in its "
                        "LSM list; a container's seccomp profile must allow the landlock syscalls). Remove the "
                        "suites or run on a host with Landlock")
    if suites:
        # Landlock mediates only TCP: without its own network namespace and socket-family filter the child
        # could reach UDP and Unix sockets (the ledger's PostgreSQL socket). Refused here, before anything is
        # reserved, never run with an open network (issue 25 item 11).
        why = network_isolation_available()
        if why is not None:
            raise SpecError(f"GX project {path}: team suites ({', '.join(s.name for s in suites)}) run only in a "
                            f"sandbox without network, and this host cannot build one: {why}. Remove the suites or "
                            "run where unshare(CLONE_NEWNET) and seccomp are allowed (root, or user namespaces)")
    return suites


# ------------------------------------------------------------------------- file copies


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy regular files of ``src`` into ``dst`` (merged): no symlink, device or dotfile is followed or copied."""
    if not src.is_dir() or src.is_symlink():
        return
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        rel = Path(dirpath).relative_to(src)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not os.path.islink(os.path.join(dirpath, d))]
        target_dir = dst / rel
        target_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name in filenames:
            source = Path(dirpath) / name
            if name.startswith(".") or not stat.S_ISREG(os.lstat(source).st_mode):
                continue
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as fin:
                out = os.open(target_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(out, "wb") as fout:
                    shutil.copyfileobj(fin, fout)


def _replace_tree(src: Path, dst: Path) -> None:
    """``dst`` becomes a copy of ``src`` (built beside it, then swapped in)."""
    if not src.is_dir():
        return
    new, old = dst.with_name(dst.name + ".new"), dst.with_name(dst.name + ".old")
    for p in (new, old):
        shutil.rmtree(p, ignore_errors=True)
    _copy_tree(src, new)
    if dst.exists():
        os.rename(dst, old)
    os.rename(new, dst)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- parent side


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    ok: bool
    error: str | None = None
    checkpoint: str = ""
    success: bool = False
    suites: list[str] = []
    checks: list[str] = []
    failures: list[str] = []
    data_docs: bool = False


def run_output_checkpoint(root: str | os.PathLike[str], spec: ReleaseSpec, data_file: str | os.PathLike[str], *,
                          run_id: str) -> CheckpointResult:
    """Run the release's checkpoint on the noisy output file in the sandbox; copy its Data Docs; raise on failure."""
    project = ensure_project(root)
    suites = preflight(project, spec.name)
    with _lock, tempfile.TemporaryDirectory(prefix="dpops-gx-") as tmp:
        scratch = Path(tmp)
        os.chmod(scratch, 0o700)
        (scratch / "input").mkdir(mode=0o700)
        try:
            shutil.copyfile(data_file, scratch / "input" / "data.parquet")
        except OSError:
            raise IntegrityError(f"release output {data_file}: cannot be read; not publishing") from None
        _copy_tree(project.joinpath(*_VALIDATIONS), scratch / "history" / "validations")
        _copy_tree(project.joinpath(*_DOCS), scratch / "history" / "local_site")
        payload = {"release": spec.name, "run_id": run_id, "partition_columns": list(spec.partitions.columns),
                   "public_partitions": spec.public_partitions(),
                   "allow_null": spec.postprocess.suppress_below is not None,
                   "suites": [s.as_payload() for s in suites]}
        child = run_confined(__name__, json.dumps(payload, default=str).encode(), scratch,
                             timeout=SANDBOX_TIMEOUT_SECONDS, require_landlock=bool(suites))
        try:
            answer = _Answer.model_validate_json(child.stdout[: 16 << 20])
        except ValidationError:
            answer = _Answer(ok=False, error=f"exit status {child.returncode}")
        if not answer.ok:
            child.show_stderr_if_debug()
            raise IntegrityError(f"{data_file}: the Great Expectations checkpoint of {spec.name} could not run in its "
                                 f"sandbox ({answer.error}); not publishing. Set DPOPS_DEBUG=1 to see its output")
        built = scratch / "project"
        _copy_tree(built.joinpath(*_VALIDATIONS), project.joinpath(*_VALIDATIONS))
        if answer.data_docs:
            _replace_tree(built.joinpath(*_DOCS), project.joinpath(*_DOCS))
    index = data_docs_index(project)
    out = CheckpointResult(checkpoint=answer.checkpoint, success=answer.success, suites=answer.suites,
                           checks=answer.checks, failures=answer.failures,
                           data_docs=str(index) if index.is_file() else None,
                           confinement=child.confinement.describe())
    if not out.success:
        raise IntegrityError(
            f"{data_file}: the noisy output failed Great Expectations checkpoint {out.checkpoint} "
            f"({len(out.failures)} expectation(s): {'; '.join(out.failures[:5])}); not publishing. Data Docs: "
            f"{out.data_docs or 'not built'}")
    return out


# ----------------------------------------------------------------------------- child side


def _describe(cfg: Any) -> str:
    kw = {k: v for k, v in cfg.kwargs.items() if k in ("column", "column_A", "column_B")}
    return str(cfg.type) + (f"({', '.join(f'{k}={v}' for k, v in sorted(kw.items()))})" if kw else "")


def _child_checkpoint(payload: dict[str, Any], scratch: Path) -> dict[str, object]:
    """Inside the sandbox: a fresh file project in ``scratch``, the dpops suite plus the team suites, Data Docs."""
    import great_expectations as gx
    import pandas as pd
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.base import ProgressBarsConfig
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    from dpops.release.gx_checks import output_expectations

    release, run_id = str(payload["release"]), str(payload["run_id"])
    df = pd.read_parquet(scratch / "input" / "data.parquet")
    df, dpops_exp = output_expectations(df, payload["partition_columns"], payload["public_partitions"],
                                        bool(payload["allow_null"]), "release output")
    ctx = gx.get_context(mode="file", project_root_dir=str(scratch / "project"))
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    _copy_tree(scratch / "history" / "validations", scratch.joinpath("project", *_VALIDATIONS))
    _copy_tree(scratch / "history" / "local_site", scratch.joinpath("project", *_DOCS))
    suites = [ctx.suites.add(gx.ExpectationSuite(name=f"dpops.output.{release}", expectations=dpops_exp))]
    for doc in payload["suites"]:  # validated by the parent; checked again so GX never sees an unchecked suite
        team = validate_suite(doc, f"suite {doc.get('name')!r}")
        exps = [ExpectationConfiguration(type=e.type, kwargs=dict(e.kwargs)).to_domain_obj() for e in team.expectations]
        suites.append(ctx.suites.add(gx.ExpectationSuite(name=team.name, expectations=exps)))
    batch = ctx.data_sources.add_pandas("dpops").add_dataframe_asset(release).add_batch_definition_whole_dataframe(
        "noisy_output")
    vds = [ctx.validation_definitions.add(gx.ValidationDefinition(name=f"{release}:{s.name}", data=batch, suite=s))
           for s in suites]
    cp = ctx.checkpoints.add(gx.Checkpoint(name=f"dpops.{release}", validation_definitions=vds,
                                           actions=[UpdateDataDocsAction(name="update_data_docs")]))
    res = cp.run(batch_parameters={"dataframe": df}, run_id=RunIdentifier(run_name=run_id))
    checks, failures = [], []
    for vr in res.run_results.values():
        for r in vr.results:
            name = f"{vr.suite_name}: {_describe(r.expectation_config)}"
            checks.append(name)
            if not r.success:
                failures.append(name)
    docs = scratch.joinpath("project", *_DOCS, "index.html").is_file()
    if docs:  # GX's index needs CDN assets; dpops' own one renders offline (dpops.gx_docs)
        from dpops.gx_docs import write_offline_index

        write_offline_index(scratch.joinpath("project", *_VALIDATIONS), scratch.joinpath("project", *_DOCS))
    return {"ok": True, "checkpoint": cp.name, "success": bool(res.success), "suites": [s.name for s in suites],
            "checks": checks, "failures": failures, "data_docs": docs}


def _child_main() -> None:
    try:
        payload = json.loads(sys.stdin.buffer.read())
        answer = _child_checkpoint(payload, Path.cwd())
    except Exception as exc:  # noqa: BLE001 - the parent gets the class only; DPOPS_DEBUG shows stderr
        import traceback

        traceback.print_exc()
        answer = {"ok": False, "error": type(exc).__name__}
    write_result(answer)


if __name__ == "__main__":
    _child_main()
