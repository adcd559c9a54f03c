"""``dpops estimate SPEC --interval I --epsilon E``: private bound estimation, charged like a release.

Estimates L0, Linf and each bounded column's value bounds under differential privacy
(the mechanisms of ``dpops.analysis.estimate``, run as the release kind ``dpops.release.estimation``), charges
the spec's budget scope in the ledger (reserved, started, committed),
writes the estimation's manifest and a spec patch carrying ``estimated_from: <run id>``. The same request
again serves the committed result and charges nothing.
"""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from dpops.cli.common import dumps, echo_ok, json_option, key_file_option, ledger_option, open_cli_ledger, say
from dpops.errors import InvalidParameter


@click.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False))
@click.option("--interval", required=True,
              help="data interval START/END (ISO-8601 UTC) or the start of one period, as for dpops release run")
@click.option("--epsilon", "epsilon", type=float, required=True,
              help="the estimation's own epsilon, charged to the spec's budget scope (split equally over its "
                   "mechanisms)")
@click.option("--method", type=click.Choice(["error/1", "quantile/1"]), default="error/1", show_default=True,
              help="error/1: the bounds minimising the release's predicted error at its own epsilon, from noisy "
                   "histograms (public partitions); quantile/1: each bound at --quantile, whatever the release's "
                   "epsilon (the rule before issue 26)")
@click.option("--quantile", type=float, default=0.99, show_default=True,
              help="quantile/1: share of units (L0, Linf) and of bounded rows (value bounds) the bounds keep whole")
@click.option("--contribution/--no-contribution", default=True, show_default=True,
              help="also estimate L0 and Linf (max_partitions_per_unit, max_rows_per_unit_per_partition)")
@click.option("--column", "columns", multiple=True,
              help="bounded column to estimate, repeatable (default: every bounded column of the spec)")
@click.option("--max-l0", type=int, default=256, show_default=True, help="largest L0 candidate (public)")
@click.option("--max-linf", type=int, default=256, show_default=True, help="largest Linf candidate (public)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="estimate-out", show_default=True,
              help="directory for patch.yaml and result.json")
@click.option("--spec-out", "spec_out", type=click.Path(dir_okay=False), default=None,
              help="also write the patched spec here, as dpops spec apply-patch would (relative paths in it start "
                   "at its own directory: write it next to SPEC)")
@click.option("--engine", type=click.Choice(["beam", "driver"]), default="beam", show_default=True,
              help="where the private read runs: beam (a Beam pipeline; only public-grid counts reach this process, "
                   "so its memory does not grow with the input) or driver (every row of the interval read into this "
                   "process: the reference the tests compare Beam with, for small inputs). Both choose the same "
                   "bounds")
@click.option("--runner", default="FnApiRunner", show_default=True,
              help="--engine beam: the Beam runner (FnApiRunner in process; PortableRunner with --runner-option "
                   "--job_endpoint=... for a cluster, as dpops release run)")
@click.option("--runner-option", "runner_options", multiple=True,
              help="--engine beam: a Beam pipeline option for the runner, repeatable (e.g. --job_endpoint=HOST:PORT)")
@click.option("--staging", default=None,
              help="--engine beam: a private location (local directory or s3:// prefix) that the workers and this "
                   "process both reach, for the workers' scratch files and the exact counts (removed after each "
                   "pass; it must lie apart from every data, public and output root); default a fresh 0700 temporary "
                   "directory here, which only in-process workers see")
@click.option("--buckets", type=click.IntRange(1, 1 << 16), default=64, show_default=True,
              help="--engine beam: unit-hash buckets between the read and the count (a worker holds about 1/N of "
                   "the rows; each work item writes up to N scratch files: fewer suit small inputs on S3)")
@click.option("--randomness", type=click.Choice(["keyed", "test"]), default="keyed", show_default=True,
              help="keyed: the noise key's CSPRNG stream (retries free); test: seeded, never for publication")
@click.option("--test-seed", "test_seed", type=int, default=None, help="the seed of --randomness test")
@key_file_option("keys the estimation's randomness and the input's fingerprint")
@click.option("--actor", default=None, help="who the ledger records (default dpops:<OS user>)")
@ledger_option
@json_option
def cli(spec_path: str, interval: str, epsilon: float, method: str, quantile: float, contribution: bool,
        columns: tuple[str, ...], max_l0: int, max_linf: int, out_dir: str, spec_out: str | None, engine: str,
        runner: str, runner_options: tuple[str, ...], staging: str | None, buckets: int, randomness: str,
        test_seed: int | None,
        key_file: str | None, actor: str | None, as_json: bool) -> None:
    """Estimate contribution and value bounds under DP; charge the scope; write a spec patch."""
    from dpops.analysis.estimate import EstimateConfig, patch_document
    from dpops.analysis.tune_output import apply_patch_document
    from dpops.release.estimation import EstimationEngine
    from dpops.release.execute import estimate
    from dpops.release.preparation import requested_interval
    from dpops.spec import load_spec, parse_spec, read_spec_document

    if randomness == "test" and test_seed is None:
        raise InvalidParameter("--randomness test needs --test-seed N")
    if spec_out is not None and load_spec(spec_path).estimated_metric_keys:
        raise InvalidParameter(f"{spec_path}: its metrics say bounds: estimate, so each release estimates them at run "
                               "time (dpops release run); a patched spec would need that option and its "
                               "budget.split share removed by hand: --spec-out is refused, nothing was charged")
    config = EstimateConfig(epsilon=epsilon, quantile=quantile, contribution=contribution,
                            columns=tuple(columns) or None, max_l0=max_l0, max_linf=max_linf, method=method)
    iv = requested_interval(spec_path, interval)
    with open_cli_ledger() as led:
        est = estimate(spec_path, iv.start, iv.end, config=config, ledger=led, randomness=randomness,
                       key_path=key_file, test_seed=test_seed if randomness == "test" else None, actor=actor,
                       engine=EstimationEngine(engine, runner, tuple(runner_options), staging, buckets))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = patch_document(est)
    head = (f"# dpops estimate: private bound estimation run {est.run_id} (epsilon {epsilon:g} charged to scope "
            f"{est.spec.budget.scope}).\n# Apply with: dpops spec apply-patch SPEC THIS_FILE (mappings merge, lists "
            "replace); the release then names this estimation in its manifest.\n")
    (out / "patch.yaml").write_text(head + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    (out / "result.json").write_text(dumps(est.to_dict()) + "\n", encoding="utf-8")
    files = {"patch": str(out / "patch.yaml"), "result": str(out / "result.json")}
    if spec_out is not None:  # what `dpops spec apply-patch SPEC patch.yaml --out SPEC_OUT` writes
        src = read_spec_document(Path(spec_path))
        patched = apply_patch_document(src, doc, source=str(out / "patch.yaml"))
        parse_spec(patched, source=str(spec_out), base_dir=Path(spec_out).resolve().parent)  # validates
        Path(spec_out).write_text(yaml.safe_dump(patched, sort_keys=False), encoding="utf-8")
        load_spec(spec_out)
        files["spec"] = spec_out
    if as_json:
        echo_ok({**est.to_dict(), "files": files})
        return
    charged = ("nothing charged: served the committed estimation" if est.state == "already_committed"
               else f"charged epsilon={est.epsilon_charged:g} to scope {est.spec.budget.scope}")
    say(f"estimation run {est.run_id}: {charged}")
    if est.state == "test_only":
        say("  test mode (seeded noise): never published, no manifest written; a release naming it is "
                   "refused unless it runs in test mode too")
    r = est.result()
    if r["max_partitions_per_unit"] is not None:
        say(f"  max_partitions_per_unit (L0): {r['max_partitions_per_unit']}")
        say(f"  max_rows_per_unit_per_partition (Linf): {r['max_rows_per_unit_per_partition']}")
    for col, (lo, hi) in r["bounds"].items():
        say(f"  bounds of {col}: [{lo:g}, {hi:g}]")
    if est.choice is not None:
        say(f"  chosen by {est.config.method}: rows kept {est.choice['kept_row_share']:.1%}; predicted RMSE "
            + ", ".join(f"{k} {v:.4g}" for k, v in est.choice["predicted_rmse"].items()))
    targets = est.targets()
    if targets:
        met = sum(1 for t in targets if t["met"])
        say(f"  accuracy targets with these bounds, at the release's epsilon: {met} of {len(targets)} met")
        for t in targets:
            pred = "inf" if t["predicted"] is None else f"{t['predicted']:.4g}"
            say(f"    [{'met' if t['met'] else 'NOT MET'}] {t['description']} (predicted {pred})")
    else:
        say("  accuracy targets: the spec declares none")
    say(f"wrote {', '.join(files.values())}" + (f"; manifest {est.manifest}" if est.manifest else ""))
