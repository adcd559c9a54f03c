"""``dpops simulate SPEC --sample FILE --draws N``: seeded test-mode releases on a public sample, scored.

Predicted against observed std, coverage and keep rate per metric and partition-size bucket
(``dpops.release.simulation``, ``dpops.analysis.simulation``). Never charged, never publishable: the sample must be
under ``$DPOPS_PUBLIC_ROOTS`` (there is no private flag), the randomness is the test seed, no ledger is opened and
nothing is written under an output or public root.

Exit code 0 when every prediction holds within its statistical band (family-wise false-failure rate ``--alpha``),
7 (verification failed, as ``dpops audit``) when any does not; refusals are 3.
"""

from __future__ import annotations

import click

from dpops.cli.common import attach, echo_ok, echo_wrapped, json_option, print_table, say
from dpops.errors import IntegrityError


def _num(v: object, pct: bool = False) -> str:
    if v is None:
        return "-"
    assert isinstance(v, (int, float))
    return f"{v:.1%}" if pct else f"{v:.4g}"


@click.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False))
@click.option("--sample", "sample", required=True,
              help="parquet or CSV sample under $DPOPS_PUBLIC_ROOTS (public or synthetic data; no private flag)")
@click.option("--draws", type=int, default=1000, show_default=True, help="seeded releases drawn on the sample")
@click.option("--seed", type=int, default=0, show_default=True,
              help="the test seed of the bounding and of every draw: the same seed gives the same numbers")
@click.option("--randomness", type=click.Choice(["test", "keyed", "os"]), default="test", show_default=True,
              help="only test is accepted: a simulation is seeded and never publishable")
@click.option("--alpha", type=float, default=1e-3, show_default=True,
              help="family-wise false-failure rate of the checks (Bonferroni over every check)")
@click.option("--confidence", type=float, default=None,
              help="confidence of the predicted intervals (default the spec's accuracy.confidence, else 0.95)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="simulate-out", show_default=True,
              help="directory for simulation.json, .png and .html (not under an output or public root)")
@json_option
def cli(spec_path: str, sample: str, draws: int, seed: int, randomness: str, alpha: float, confidence: float | None,
        out_dir: str, as_json: bool) -> None:
    """Draw N seeded test-mode releases on a public sample; predicted against observed accuracy."""
    from dpops.analysis.loading import load
    from dpops.analysis.simulation import MARKER
    from dpops.release.simulation import check_out_dir, simulate, write_outputs

    spec = load(spec_path)
    check_out_dir(spec, out_dir)  # before anything is read
    sim = simulate(spec, sample, draws=draws, seed=seed, randomness=randomness, confidence=confidence,
                   alpha=alpha)
    files = write_outputs(sim, out_dir)
    doc = {**sim.to_dict(), "files": files}
    failed = sim.score.failed()
    error = None
    if failed:
        error = IntegrityError(
            f"simulate: {len(failed)} of {len(sim.score.checks)} checks outside their band (family-wise "
            f"false-failure rate {alpha:g}): " + "; ".join(
                f"{c.metric} {c.bucket} {c.what} observed {c.observed:.4g}, predicted {c.predicted:.4g} "
                f"(band {c.low:.4g}..{c.high:.4g})" for c in failed[:5])
            + (" ..." if len(failed) > 5 else "") + f"; see {files['html']}")
    if as_json:
        if error is not None:
            raise attach(error, doc)
        echo_ok(doc)
        return
    say(f"WARNING: {MARKER}", err=True)
    def pair(a: object, b: object, pct: bool = False) -> str:
        return "-" if a is None and b is None else f"{_num(a, pct)}/{_num(b, pct)}"

    cols = ["metric", "units", "parts", "std pred/obs", "coverage pred/obs", "keep pred/obs", "rank error pred/obs",
            "bounding bias"]
    print_table(f"dpops simulate {sim.spec.name}: {draws} draws, seed {seed}", cols,
                [[r.metric, r.bucket, str(r.partitions), pair(r.predicted_std, r.observed_std),
                  pair(r.predicted_coverage, r.observed_coverage, True), pair(r.predicted_keep, r.observed_keep, True),
                  pair(r.predicted_rank_error, r.observed_rank_error), _num(r.bounding_bias)]
                 for r in sim.score.rows],
                keep=["metric", "units"])
    b = sim.bounding
    say(f"bounding: {b['rows_kept']} of {b['rows_to_bounding']} checked rows kept (L0 dropped {b['rows_dropped_l0']}, "
        f"Linf {b['rows_dropped_linf']}), {b['values_clamped']} values clamped; {b['rows_dropped_by_checks']} rows "
        "dropped by the input checks")
    if sim.score.not_scored:
        say("not scored (a probability at a stated lead, not a law at the sample's counts): "
            + ", ".join(sim.score.not_scored))
    say(f"wrote {files['json']}, {files['png']}, {files['html']}")
    if error is not None:
        raise error
    echo_wrapped(f"predictions hold: {len(sim.score.checks)} checks within their bands (family-wise false-failure "
                 f"rate {alpha:g})")
