"""The neighbour-isolation properties of ``tests/test_reader_isolation.py``, run for longer.

``make test`` runs them derandomized with a few hundred examples; this script runs each property with
a large budget and a fresh random seed (printed, so a failure reproduces with ``--seed``), and reports
how many examples ran and what failed:

    python benchmarks/fuzz_reader.py --examples 5000 [--seed N] [--only NAME ...]

NAME: csv, csv_int, csv_time, reference, reference_int, reference_time, parquet, cells.

Each property: any one unit's lines (arbitrary bytes, quotes, separators, CR/LF, BOM, NUL, invalid
UTF-8, huge cells, wrong types) inserted anywhere in a file of other units' lines add exactly their
own rows through the real reader (``iter_record_batches`` + ``prepare_batch``) and change no other
unit's bounded rows (``bound_contributions``, ``aggregate_bucket``), and nothing raises. The
``reference*`` properties hold the fast reader equal to ``pipelines/reference_reader.py`` (each line read
alone) for attacker lines inserted anywhere; a failure found here becomes an explicit ``@example`` there.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(argv: list[str] | None = None) -> int:
    """Run every property (or ``--only`` ones) with ``--examples`` each; exit 1 if any failed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--only", action="append", default=[])
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)

    import numpy as np
    import test_reader_isolation as t
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    tmp = Path(tempfile.mkdtemp(prefix="fuzz-reader-"))
    counter = {"n": 0}

    def csv_prop(types):
        def run(case):
            counter["n"] += 1
            clean, adv, pos, limits = case
            d = Path(tempfile.mkdtemp(dir=tmp))
            t.check_csv(d, clean, adv, pos, limits, types)
        return run

    def ref_prop(types):
        def run(case):
            counter["n"] += 1
            victims, adv, pos, limits = case
            t.check_against_reference(Path(tempfile.mkdtemp(dir=tmp)), victims, adv, pos, limits, types)
        return run

    def pq_prop(case):
        counter["n"] += 1
        clean, adv, pos = case
        d = Path(tempfile.mkdtemp(dir=tmp))
        r0 = t.read_rows(t.pq_write(d, "without.parquet", clean), "parquet", batch_rows=3)
        r1 = t.read_rows(t.pq_write(d, "with.parquet", clean[:pos] + adv + clean[pos:]), "parquet", batch_rows=5)
        ra = t.read_rows(t.pq_write(d, "alone.parquet", adv), "parquet")
        assert t.multiset(r1) == sorted(t.multiset(r0) + t.multiset(ra))

    def cells_prop(args_):
        counter["n"] += 1
        cells, want = args_
        import pyarrow as pa

        import pipelines.io as pio

        def convert(values):
            arr, bad = pio._convert_column(pa.array([v.encode() for v in values], pa.binary()), want)
            return [None if b or (isinstance(x, float) and not np.isfinite(x)) else x
                    for x, b in zip(arr.to_pylist(), bad, strict=True)]

        assert convert(cells) == [convert([c])[0] for c in cells] == convert(cells + ["not a number"])[:-1]

    props = {
        "csv": (t.csv_case(), csv_prop(t.TYPES)),
        "csv_int": (t.csv_case(), csv_prop({**t.TYPES, "amount": "int"})),
        "csv_time": (t.csv_case(t.timed_line), csv_prop({**t.TYPES, "note": "timestamp"})),
        "reference": (t.differential_case(), ref_prop(t.TYPES)),
        "reference_int": (t.differential_case(), ref_prop({**t.TYPES, "amount": "int"})),
        "reference_time": (t.differential_case(times=True), ref_prop({**t.TYPES, "note": "timestamp"})),
        "parquet": (t.parquet_case(), pq_prop),
        "cells": (st.tuples(st.lists(t.num_text, min_size=1, max_size=6), st.sampled_from(["int", "float"])),
                  cells_prop),
    }
    failures = 0
    print(f"seed {seed}, {args.examples} examples per property")
    for name, (strategy, prop) in props.items():
        if args.only and name not in args.only:
            continue
        counter["n"] = 0
        t0 = time.time()
        test = hseed(seed)(settings(max_examples=args.examples, deadline=None, database=None,
                                    suppress_health_check=list(HealthCheck))(given(strategy)(prop)))
        try:
            test()
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - report and go on with the next property
            failures += 1
            notes = "\n".join(getattr(exc, "__notes__", []))  # Hypothesis puts the falsifying example here
            status = f"FAILED: {type(exc).__name__}: {str(exc)[:2000]}\n{notes[:4000]}"
        print(f"{name}: {counter['n']} executions in {time.time() - t0:.0f}s: {status}", flush=True)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
