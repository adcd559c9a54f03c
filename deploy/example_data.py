"""Write synthetic input for the compose stack's example release (never real data).

Run by the one-shot compose service ``example-data`` (as uid 50000, on the ``dpops-data``
volume) so that a fresh stack has input for ``dpops_example_daily``:

    python /opt/dpops/deploy/example_data.py [--days 7] [--root /data/input/example_daily]

It writes one Parquet file per UTC day for the ``days`` days ending yesterday (the latest
interval the scheduler runs), with ``dpops.testing.synthetic.generate_events`` (the shipped
generator: power-law users, regions p0..pN, an event-time column). Days whose file exists
are left alone: the noise of a published interval is keyed on its input fingerprint, so
rewriting an already released day would turn a free re-run into a charged restatement.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from dpops.testing.synthetic import generate_events

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/data/input/example_daily", help="directory of the day files")
    ap.add_argument("--days", type=int, default=7, help="number of days ending yesterday (UTC)")
    ap.add_argument("--rows", type=int, default=2000, help="rows per day")
    ap.add_argument("--partitions", type=int, default=4, help="regions p0..p(N-1); the spec lists them")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None, help="the output root: its published/ and manifests/ are created (0755) "
                                                "so the api-server can mount exactly those two, read-only")
    args = ap.parse_args(argv)
    if args.out:
        for sub in ("published", "manifests"):
            d = Path(args.out) / sub
            d.mkdir(parents=True, exist_ok=True, mode=0o755)
            d.chmod(0o755)

    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    written = 0
    for back in range(args.days, 0, -1):
        day = today - timedelta(days=back)
        target = root / f"{day:%Y-%m-%d}.parquet"
        if target.exists():
            continue
        # One seed per day: the same command on another machine writes the same bytes.
        generate_events(str(target), n_rows=args.rows, n_users=max(50, args.rows // 5),
                        n_partitions=args.partitions, days=1, seed=args.seed + day.toordinal(),
                        start=day.date().isoformat())
        written += 1
    print(f"example_data: {written} new day file(s) in {root} ({args.days - written} already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
