"""``dpops ledger import`` speed: a SQLite ledger of N entries exported, imported into PostgreSQL, and back.

    .venv/bin/python benchmarks/bench_ledger_import.py                    # 1,000 and 10,000 entries
    .venv/bin/python benchmarks/bench_ledger_import.py --entries 3000 --json out.json

Per direction it times: verifying the export from the file alone (``read_export``), then the import
(one transaction: insert, walk the chain head, rebuild the caches, verify before commit, verify again
after), and a plain ``ledger verify`` of the result for comparison. The source history is reserve +
start + commit cycles spread over two scopes (one with per-day buckets).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta

from dpops.events import Laplace
from dpops.ledger import RunKey, ScopeDefinition, TimeRule, open_ledger
from dpops.ledger.transfer import import_export, read_export

PG_BASE = os.environ.get("DPOPS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
BASE_TIME = datetime(2000, 1, 1, tzinfo=UTC)
EVENTS = [Laplace(scale=1e6, l1_sensitivity=1.0)]


def build(url: str, entries: int) -> str:
    """A ledger of about ``entries`` entries; returns its export text."""
    with open_ledger(url) as led:
        for name, bucket in (("flat", None), ("perday", "day")):
            led.create_scope(ScopeDefinition(name=name, unit="a synthetic user-day", unit_column="user_id",
                                             epsilon=1e9, delta=1e-9, rho=None, accountant="basic", bucket=bucket,
                                             unit_period=bucket, adjacency="add_remove",
                                             time_rule=TimeRule("ts") if bucket else None), actor="bench")
        for i in range((entries - 2) // 3):
            start = BASE_TIME + timedelta(hours=6 * i)
            key = RunKey("bench", "h", start.isoformat(), (start + timedelta(hours=6)).isoformat(), "fp", "k")
            rec = led.reserve(key, "perday" if i % 2 else "flat", EVENTS, actor="bench")
            led.start(rec.run_id, actor="bench")
            led.commit(rec.run_id, output_uri=f"file:///bench/{i}", actor="bench")
        buf = io.StringIO()
        led.export(buf)
    return buf.getvalue()


def timed_import(text: str, url: str) -> dict:
    """Verify the export, import it into the empty ledger at ``url``, verify; check the export round-trips."""
    lines = text.splitlines()
    t0 = time.perf_counter()
    export = read_export(lines, "bench")
    t1 = time.perf_counter()
    with open_ledger(url) as led:
        result = import_export(led, export)
        t2 = time.perf_counter()
        assert led.verify().ok
        t3 = time.perf_counter()
        buf = io.StringIO()
        led.export(buf)
    assert buf.getvalue() == text, "the import changed the export"
    return {"entries": result.entries, "verify_export_s": t1 - t0, "import_s": t2 - t1, "verify_s": t3 - t2,
            "entries_per_s": result.entries / (t2 - t1)}


def main(argv: list[str] | None = None) -> int:
    """Build, export and import each size both ways; print one line per direction."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", default="1000,10000", help="comma list of history sizes")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    import psycopg

    tmp = tempfile.mkdtemp(prefix="bench-import-")
    results = []
    for n in (int(x) for x in args.entries.split(",")):
        # the source is built without fsync per commit: it is scaffolding, not what is measured
        text = build(f"sqlite:///{tmp}/src-{n}.sqlite?synchronous=normal", n)
        schema = f"bench_import_{uuid.uuid4().hex[:8]}"
        pg = f"{PG_BASE}?schema={schema}"
        back = f"sqlite:///{tmp}/back-{n}.sqlite"
        try:
            open_ledger(pg).close()
            open_ledger(back).close()
            for direction, target in (("sqlite->postgres", pg), ("postgres->sqlite", back)):
                row = {"direction": direction, **timed_import(text, target)}
                results.append(row)
                print(f"{direction:17s} {row['entries']:>6} entries: verify export {row['verify_export_s']:.2f} s, "
                      f"import {row['import_s']:.2f} s ({row['entries_per_s']:.0f} entries/s, incl. 2 verifies), "
                      f"ledger verify after {row['verify_s']:.2f} s")
                sys.stdout.flush()
        finally:
            with psycopg.connect(PG_BASE, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    if args.json_out:
        with open(args.json_out, "w") as fp:
            json.dump(results, fp, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
