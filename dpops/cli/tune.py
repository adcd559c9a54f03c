"""``dpops tune SPEC --sample PATH``: evaluate candidate settings on a sample; write a spec patch and a page.

Not differentially private (see ``dpops.analysis.tuning``, ``dpops.analysis.sample_access`` and
``dpops.release.private_reads``): the sample must be under the operator's public roots, or the operator
passes ``--i-understand-this-reads-private-data`` with ``--reason``, and the ledger records the access first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import yaml

from dpops.analysis.sample_access import PRIVATE_FLAG
from dpops.cli.common import echo_ok, echo_wrapped, json_option, ledger_option, open_cli_ledger, print_table, say
from dpops.errors import InvalidParameter


def _load_grid(path: str) -> dict[str, Any]:
    text = Path(path).read_text(encoding="utf-8")
    try:
        doc = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        kind = "JSON" if path.endswith(".json") else "YAML"
        raise InvalidParameter(f"--grid {path}: not valid {kind} ({exc})") from None
    if not isinstance(doc, dict):
        raise InvalidParameter(f"--grid {path}: expected a mapping with l0, linf, bounds and/or split")
    return doc


def _ints(raw: str | None, what: str) -> list[int] | None:
    if raw is None:
        return None
    try:
        return [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise InvalidParameter(f"{what}: a comma-separated list of integers, got {raw!r}") from None


@click.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False))
@click.option("--sample", "sample", required=True, help="parquet or CSV sample (under $DPOPS_PUBLIC_ROOTS)")
@click.option("--grid", "grid_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="YAML/JSON grid: {l0: [..], linf: [..], bounds: {column: [[lo, hi], ..]}, split: [{..}, ..]}")
@click.option("--l0", "l0", default=None, help="comma-separated L0 values (instead of the default grid's)")
@click.option("--linf", "linf", default=None, help="comma-separated Linf values")
@click.option("--loss", "loss", type=click.Choice(["targets", "mean_relative_rmse", "max_relative_rmse"]),
              default=None, help="what the recommendation minimises (default: targets if the spec has any)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="tune-out", show_default=True,
              help="directory for patch.yaml, tune.html and results.json (not under an output or public root)")
@click.option(PRIVATE_FLAG, "allow_private", is_flag=True,
              help="allow a sample under a private data root; the ledger records the access (needs --reason)")
@click.option("--reason", default=None, help="with the private flag: why the private data must be read")
@click.option("--key-file", "key_file", envvar="DPOPS_NOISE_KEY_FILE", default=None,
              help="with the private flag: key for the input fingerprint recorded in the ledger")
@click.option("--actor", default=None, help="who the ledger records (default dpops:<OS user>)")
@click.option("--seed", type=int, default=None,
              help="make the bounding's random choices (which rows and partitions a unit keeps) reproducible; "
                   "default: fresh randomness, as a release's")
@click.option("--runner", default="FnApiRunner", show_default=True,
              help="with the private flag: the Beam runner of the read (FnApiRunner in process; PortableRunner with "
                   "--runner-option --job_endpoint=... --environment_type=EXTERNAL ... for isolated workers)")
@click.option("--runner-option", "runner_options", multiple=True,
              help="with the private flag: a Beam pipeline option for the runner, repeatable")
@click.option("--staging", default=None,
              help="with the private flag: a private location the workers and this process both reach (a local "
                   "directory or an s3:// prefix) for the read's scratch files; default: a 0700 temporary directory")
@click.option("--buckets", type=click.IntRange(1, 1 << 16), default=64, show_default=True,
              help="with the private flag: unit- and partition-hash buckets of the read (a worker holds about 1/N of "
                   "the rows; the result does not depend on it)")
@ledger_option
@json_option
def cli(spec_path: str, sample: str, grid_path: str | None, l0: str | None, linf: str | None, loss: str | None,
        out_dir: str, allow_private: bool, reason: str | None, key_file: str | None, actor: str | None,
        seed: int | None, runner: str, runner_options: tuple[str, ...], staging: str | None, buckets: int,
        as_json: bool) -> None:
    """Evaluate a grid of L0, Linf, value bounds and epsilon splits on a sample in one pass; recommend one.

    A public sample is read in this process; a flagged private one by Beam workers (``--runner``), only its
    statistics coming back (``dpops.release.tuning``)."""
    from dpops.analysis import load
    from dpops.analysis.sample_access import is_private_path, private_twin
    from dpops.analysis.tune_output import html_page, patch_yaml
    from dpops.analysis.tuning import default_grid, grid_from_doc, prepare_tune, tune
    from dpops.dataroots import check_analysis_out
    from dpops.release.context import default_actor
    from dpops.release.private_reads import open_sample

    spec = load(spec_path)
    if grid_path is not None:
        grid = grid_from_doc(spec, _load_grid(grid_path), source=f"--grid {grid_path}")
    elif l0 is not None or linf is not None:
        doc: dict[str, Any] = {}
        if l0 is not None:
            doc["l0"] = _ints(l0, "--l0")
        if linf is not None:
            doc["linf"] = _ints(linf, "--linf")
        grid = grid_from_doc(spec, doc, source="--l0/--linf")
    else:
        grid = default_grid(spec)
    check_analysis_out(out_dir, "--out", source=spec.source, output_root=spec.output_root,
                       what="tune's results (exact functions of the sample's rows)")  # before the read is recorded
    if allow_private and (is_private_path(spec, sample) or private_twin(spec, str(Path(sample).resolve()))):
        from dpops.keyref import resolve_key

        if not key_file:
            raise InvalidParameter(f"{PRIVATE_FLAG} needs --key-file (or $DPOPS_NOISE_KEY_FILE): the ledger records "
                                   "the sample's keyed fingerprint")
        from dpops.release.estimation import EstimationEngine
        from dpops.release.tuning import check_private_engine, tune_private

        engine = EstimationEngine("beam", runner, tuple(runner_options), staging, buckets)
        check_private_engine(spec, engine, key_file)  # a bad --staging fails before the ledger entry
        with open_cli_ledger() as led:
            setup = prepare_tune(spec, grid=grid, loss=loss)  # a bad grid or loss fails before the ledger entry
            access = open_sample(spec, sample, allow_private=True, ledger=led, actor=actor or default_actor(),
                                 reason=reason, fingerprint_key=resolve_key(key_file), key_path=key_file)
        result = tune_private(spec, access, seed=seed, setup=setup, engine=engine)
    else:
        access = open_sample(spec, sample, allow_private=False, key_path=key_file)
        result = tune(spec, access, grid=grid, loss=loss, seed=seed)  # the checked access, not a path to check again
    prov = access.provenance()
    results = {"recommended": result.recommended.label, "loss": result.loss, "candidates": result.candidates,
               "rows": result.rows, "not_evaluated": result.not_evaluated, "sample_rows": result.sample_rows,
               "boundings": result.boundings, "data": prov, "seed": seed, "warnings": result.warnings()}
    from dpops.cli.common import dumps
    from dpops.dataroots import write_analysis_files

    # checked again on the opened directory, each file renamed into place (never written through a planted link)
    written = write_analysis_files(
        out_dir, {"patch.yaml": patch_yaml(result, prov).encode("utf-8"),
                  "tune.html": html_page(result, prov).encode("utf-8"), "results.json": dumps(results).encode("utf-8")},
        "--out", source=spec.source, output_root=spec.output_root,
        what="tune's results (exact functions of the sample's rows)")
    files = {"patch": written["patch.yaml"], "html": written["tune.html"], "results": written["results.json"]}
    if as_json:
        echo_ok({**results, "files": files})
        return
    if access.private:
        say(f"WARNING: {prov['statement']}; recorded in the ledger as entry {access.entry_id}", err=True)
    cols = ["candidate", "loss", "rows dropped L0", "rows dropped Linf", "partitions kept"]
    print_table("dpops tune: candidates (not differentially private)", cols,
                [[c["candidate"], f"{c['loss']:.4g}", f"{c['rows_dropped_l0']:.1%}", f"{c['rows_dropped_linf']:.1%}",
                  f"{c['expected_partitions_kept']:.1f}"] for c in result.candidates], keep=["candidate"])
    say(f"recommended: {result.recommended.label}")
    for w in result.warnings():
        echo_wrapped(f"WARNING: {w}")
    if result.not_evaluated:
        say(f"not evaluated by tune: {', '.join(result.not_evaluated)}")
    say(f"wrote {files['patch']}, {files['html']}, {files['results']}")
