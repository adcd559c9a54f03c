"""A file-backed Great Expectations project per deployment: checkpoints and Data Docs on the NOISY output.

``$DPOPS_GX_PROJECT`` names the project directory (created on first use; GX keeps its files under
``<dir>/gx``). For each release ``R`` the project holds:

* the suite ``dpops.output.R``: dpops' own output expectations (every public partition exactly once,
  no nulls unless suppression is on, ``ci95_low <= ci95_high``, ``std >= 0``), rewritten on each run;
* any suites a team adds named ``output.R.<anything>`` or ``output.all.<anything>`` (through GX's
  own API or JSON files under ``gx/expectations/output/...``): they run on every publish of ``R``;
* the checkpoint ``dpops.R`` running all of them, with an ``UpdateDataDocsAction``, so every release
  has Data Docs under ``gx/uncommitted/data_docs/local_site``.

Privacy reason: these suites see only the noisy, already-private output, so any expectation is
post-processing and may block a publish freely (semantics.md section 6); the private input is still
checked only at schema level (``dpops.release.gx_checks.check_input_schema``). The Data Docs and validation
results therefore hold published values only. A failed suite raises ``IntegrityError`` naming the
suite and expectation; it quotes no values.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dpops.errors import IntegrityError

PROJECT_ENV = "DPOPS_GX_PROJECT"
_lock = threading.Lock()


@dataclass
class CheckpointResult:
    checkpoint: str
    success: bool
    suites: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # "<suite>: <expectation>" names, for the manifest
    failures: list[str] = field(default_factory=list)
    data_docs: str | None = None  # local path of the Data Docs index


def project_root(root: str | os.PathLike[str] | None = None) -> Path | None:
    value = root if root is not None else os.environ.get(PROJECT_ENV)
    return Path(value) if value else None


def open_project(root: str | os.PathLike[str]) -> Any:
    """The project's ``FileDataContext`` (created if absent), progress bars off."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    Path(root).mkdir(parents=True, exist_ok=True)
    ctx = gx.get_context(mode="file", project_root_dir=str(root))
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    return ctx


def data_docs_index(root: str | os.PathLike[str]) -> Path:
    return Path(root) / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html"


def _dpops_expectations(df: Any, partition_columns: Sequence[str], public_partitions: Sequence[Any] | None,
                        allow_null: bool) -> tuple[Any, list[Any]]:
    """dpops' output suite: the very expectations ``dpops.release.gx_checks.check_release_output`` runs."""
    from dpops.release.gx_checks import output_expectations

    return output_expectations(df, partition_columns, public_partitions, allow_null, "release output")


def _describe(cfg: Any) -> str:
    kw = {k: v for k, v in cfg.kwargs.items() if k in ("column", "column_A", "column_B")}
    return cfg.type + (f"({', '.join(f'{k}={v}' for k, v in sorted(kw.items()))})" if kw else "")


def run_output_checkpoint(root: str | os.PathLike[str], spec: Any, data_file: str | os.PathLike[str], *,
                          run_id: str) -> CheckpointResult:
    """Run the release's checkpoint on the noisy output file; build its Data Docs; raise on failure."""
    import great_expectations as gx
    import pandas as pd
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.core.run_identifier import RunIdentifier

    release = spec.name
    try:
        df = pd.read_parquet(data_file)
    except Exception:  # noqa: BLE001 - the file name is enough; the reader's text may quote content
        raise IntegrityError(f"release output {data_file}: cannot read it as Parquet; not publishing") from None
    df, dpops_exp = _dpops_expectations(df, spec.partitions.columns, spec.public_partitions(),
                                        spec.postprocess.suppress_below is not None)
    with _lock:
        ctx = open_project(root)
        ds = ctx.data_sources.add_or_update_pandas("dpops")
        try:
            asset = ds.get_asset(release)
        except LookupError:
            asset = ds.add_dataframe_asset(release)
        try:
            batch = asset.get_batch_definition("noisy_output")
        except (KeyError, LookupError):
            batch = asset.add_batch_definition_whole_dataframe("noisy_output")
        own = ctx.suites.add_or_update(gx.ExpectationSuite(name=f"dpops.output.{release}", expectations=dpops_exp))
        suites = [own] + sorted((s for s in ctx.suites.all()
                                 if s.name.startswith((f"output.{release}.", "output.all."))), key=lambda s: s.name)
        vds = [ctx.validation_definitions.add_or_update(gx.ValidationDefinition(name=f"{release}:{s.name}", data=batch,
                                                                                 suite=s)) for s in suites]
        cp = ctx.checkpoints.add_or_update(gx.Checkpoint(
            name=f"dpops.{release}", validation_definitions=vds,
            actions=[UpdateDataDocsAction(name="update_data_docs")]))
        res = cp.run(batch_parameters={"dataframe": df}, run_id=RunIdentifier(run_name=run_id))
    out = CheckpointResult(checkpoint=cp.name, success=bool(res.success), suites=[s.name for s in suites],
                           data_docs=str(data_docs_index(root)) if data_docs_index(root).is_file() else None)
    for vr in res.run_results.values():
        suite = vr.suite_name
        for r in vr.results:
            name = f"{suite}: {_describe(r.expectation_config)}"
            out.checks.append(name)
            if not r.success:
                out.failures.append(name)
    if not out.success:
        raise IntegrityError(
            f"{data_file}: the noisy output failed Great Expectations checkpoint {cp.name} "
            f"({len(out.failures)} expectation(s): {'; '.join(out.failures[:5])}); not publishing. Data Docs: "
            f"{out.data_docs or 'not built'}")
    return out
