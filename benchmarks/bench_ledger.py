"""Ledger speed: reserve+start+commit latency with 10 and 10,000 prior entries in the scope, and
throughput with 8 concurrent client processes, on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/bench_ledger.py            # full sizes
    .venv/bin/python benchmarks/bench_ledger.py --quick    # small sizes while developing
    .venv/bin/python benchmarks/bench_ledger.py --backends sqlite --json out.json

Goal (issue #3): p50 under 20 ms, and no slower at 10,000 entries than at 10.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone

from dpops.events import Laplace
from dpops.ledger import RunKey, ScopeDefinition, open_ledger

PG_BASE = os.environ.get("DPOPS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
BASE_TIME = datetime(2000, 1, 1, tzinfo=timezone.utc)
EVENTS = [Laplace(scale=10.0, l1_sensitivity=1.0)]


def run_key(release: str, i: int) -> RunKey:
    start = BASE_TIME + timedelta(minutes=i)
    return RunKey(release, "bench", start.isoformat(), (start + timedelta(minutes=1)).isoformat(), "fp", "k")


def cycle(led, scope: str, release: str, i: int) -> float:
    t0 = time.perf_counter()
    rec = led.reserve(run_key(release, i), scope, EVENTS, actor="bench")
    led.start(rec.run_id, actor="bench")
    led.commit(rec.run_id, output_uri=f"file:///bench/{i}", actor="bench")
    return time.perf_counter() - t0


def make_scope(led, name: str, accountant: str) -> None:
    led.create_scope(ScopeDefinition(name=name, unit="a synthetic user", unit_column="user_id", epsilon=1e9,
                                     delta=1e-9, rho=None, accountant=accountant), actor="bench")


def latency(url: str, big: int, samples: int, accountant: str, owner_url: str | None = None) -> dict[int, dict]:
    """Scopes with ~10 and ~``big`` prior entries, sampled alternately so machine load hits both alike.

    ``owner_url``: where scopes are created (the ledger owner), when ``url`` is an application role's."""
    led = open_ledger(url)
    owner = open_ledger(owner_url) if owner_url else led
    scopes = {}
    for prior in (10, big):
        scope = f"lat{prior}_{uuid.uuid4().hex[:6]}"
        make_scope(owner, scope, accountant)
        for i in range(max(0, (prior - 1) // 3)):  # scope_created + 3 entries per run
            cycle(led, scope, f"{scope}-prefill", i)
        scopes[prior] = scope
    times: dict[int, list[float]] = {p: [] for p in scopes}
    for i in range(samples):
        for prior, scope in scopes.items():
            times[prior].append(cycle(led, scope, f"{scope}-measured", i))
    led.close()
    out = {}
    for prior, ts in times.items():
        ts.sort()
        out[prior] = {"prior_entries": 1 + 3 * ((prior - 1) // 3), "samples": samples,
                      "p50_ms": 1000 * statistics.median(ts), "p99_ms": 1000 * ts[int(0.99 * (len(ts) - 1))]}
    return out


def _client(args) -> int:
    url, scope, worker, n = args
    led = open_ledger(url)
    for i in range(n):
        cycle(led, scope, f"{scope}-worker{worker}", i)
    led.close()
    return n


def throughput(url: str, clients: int, per_client: int, accountant: str, owner_url: str | None = None) -> dict:
    led = open_ledger(owner_url or url)
    scope = f"tp_{uuid.uuid4().hex[:6]}"
    make_scope(led, scope, accountant)
    with mp.get_context("fork").Pool(clients) as pool:
        pool.map(_client, [(url, scope, 100 + w, 1) for w in range(clients)], chunksize=1)  # warm-up
        t0 = time.perf_counter()
        done = sum(pool.map(_client, [(url, scope, w, per_client) for w in range(clients)], chunksize=1))
        wall = time.perf_counter() - t0
    report = led.verify()
    led.close()
    return {"clients": clients, "cycles": done, "seconds": wall, "cycles_per_s": done / wall, "verify_ok": report.ok}


def _app_role_ledger(schema: str) -> tuple[str, str, list[str]]:
    """A ledger in ``schema`` set up as deploy/ does: fresh owner and app roles, the database's cap check
    installed by the superuser, ``ledger init --app-role`` as the owner. Returns (owner URL, app URL, roles)."""
    import psycopg

    from dpops.ledger.backend import postgres_target
    from dpops.ledger.db_cap import install
    from dpops.ledger.roles import grant_app_role

    tag = uuid.uuid4().hex[:8]
    owner, app = f"bench_owner_{tag}", f"bench_app_{tag}"
    with psycopg.connect(PG_BASE, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{owner}" LOGIN')
        conn.execute(f'CREATE ROLE "{app}" LOGIN NOINHERIT')
        conn.execute(f'GRANT CREATE, CONNECT ON DATABASE "{PG_BASE.rsplit("/", 1)[1]}" TO "{owner}", "{app}"')
    install(postgres_target(f"{PG_BASE}?schema={schema}")[0], schema=schema, owner_role=owner)
    owner_url = PG_BASE.replace("postgres@", f"{owner}@") + f"?schema={schema}"
    with open_ledger(owner_url) as led:
        grant_app_role(led, app)
    return owner_url, PG_BASE.replace("postgres@", f"{app}@") + f"?schema={schema}", [app, owner]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1,000 instead of 10,000 prior entries; fewer samples")
    ap.add_argument("--backends", default="sqlite,postgres,postgres-app",
                    help="comma list of sqlite, sqlite-normal, postgres (the owner role: no database-side cap "
                         "check), postgres-app (an application role: every reservation also checked by the "
                         "database, schema version 5)")
    ap.add_argument("--accountant", default="basic")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    big = 1000 if args.quick else 10_000
    samples = 50 if args.quick else 300
    per_client = 20 if args.quick else 100
    tmp = tempfile.mkdtemp(prefix="bench-ledger-")
    results = []
    for backend in args.backends.split(","):
        if backend == "sqlite":
            url = f"sqlite:///{tmp}/bench.sqlite"
        elif backend == "sqlite-normal":  # fsync only at checkpoints: shows the cost without the disk
            url = f"sqlite:///{tmp}/bench-normal.sqlite?synchronous=normal"
        else:
            schema = f"bench_{uuid.uuid4().hex[:8]}"
            url = f"{PG_BASE}?schema={schema}"
        owner_url = None
        if backend == "postgres-app":
            owner_url, url, roles = _app_role_ledger(schema)
        row = {"backend": backend, "accountant": args.accountant}
        for prior, stats in latency(url, big, samples, args.accountant, owner_url).items():
            row[f"latency_{prior}"] = stats
        row["throughput"] = throughput(url, 8, per_client, args.accountant, owner_url)
        results.append(row)
        if backend.startswith("postgres"):
            import psycopg

            with psycopg.connect(PG_BASE, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                for role in (roles if backend == "postgres-app" else ()):
                    conn.execute(f'DROP OWNED BY "{role}"')
                    conn.execute(f'DROP ROLE "{role}"')
        lat_small, lat_big, tp = row["latency_10"], row[f"latency_{big}"], row["throughput"]
        print(f"{backend:13s} reserve+start+commit  prior={lat_small['prior_entries']:>6}: p50 {lat_small['p50_ms']:6.2f} ms"
              f"  p99 {lat_small['p99_ms']:6.2f} ms")
        print(f"{'':13s} reserve+start+commit  prior={lat_big['prior_entries']:>6}: p50 {lat_big['p50_ms']:6.2f} ms"
              f"  p99 {lat_big['p99_ms']:6.2f} ms")
        print(f"{'':13s} 8 clients: {tp['cycles']} cycles in {tp['seconds']:.2f} s = {tp['cycles_per_s']:.0f} "
              f"cycles/s ({3 * tp['cycles_per_s']:.0f} transactions/s), verify ok={tp['verify_ok']}")
        sys.stdout.flush()
    if args.json_out:
        with open(args.json_out, "w") as fp:
            json.dump(results, fp, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
