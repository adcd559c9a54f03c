"""A "year in the life" of a dpops deployment (issue 21, "Proof"), driven through the documented CLI.

Every step is a ``dpops`` command as README.md / docs/runbook.md write it, run in a forked child
(``tests/fault_support.run_cli``: the real ``dpops.cli.main.main``, a fault point can SIGKILL it),
on a SQLite ledger and the embedded in-process Beam runner, with synthetic input (``dpops spec synth``).

Two scopes:

- ``daily``: day-bucketed (user-day unit, ``--unit-period day --time-column ts``), ``days`` daily
  intervals released one by one like scheduled runs, with on the way: a restatement of one day with a
  corrected input, a refunded run (killed after the reservation, before any mechanism ->
  ``ledger recover`` -> released again), a spent run (killed after the noise -> ``ledger recover`` ->
  ``spent_unpublished`` -> ``--fresh-attempt --reason`` -> published), a key rotation mid-way (new key
  file, new ``DPOPS_NOISE_KEY_ID`` pin), and days left unreleased on purpose (one in the middle, the
  last one).
- ``users``: user-level (no period), a backfill of a few days across its cap (the last ones refused,
  exit 5), a cap raise by the owner (``ledger cap``) and a re-release of the refused days.

At the end: ``dpops report`` (per scope) with no FAILED and no warning, ``dpops ledger verify`` ok and
``dpops gaps`` listing exactly the days left open. ``run(days)`` returns the summary; the script prints it.
Privacy reason for the checks: a report or gap list that is wrong either hides a spend (a silent
breach of the promise) or cries wolf (operators learn to ignore it).

    PYTHONPATH=. python benchmarks/year_in_the_life.py --days 60
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fault_support import run_cli, warm_imports  # noqa: E402

START = date(2024, 1, 1)
USER_DAYS = 5  # user-level scope: a backfill of 5 days against a cap of 3 runs
DAILY_EPS = 1.0
DAILY_CAP = 2.0  # per day bucket: room for one restatement or one fresh attempt
USER_EPS = 1.0
USER_CAP = 3.0


def _spec(name: str, scope: str, eps: float, period: str | None) -> dict:
    unit: dict = {"column": "user_id", "description": "a user's purchases on one day" if period else "a user",
                  "adjacency": "add_remove"}
    if period:
        unit["period"] = period
    return {
        "name": name,
        "schedule": "0 0 * * *",
        "input": {"path": f"data/{name}/{{start:%Y-%m-%d}}.parquet", "format": "parquet",
                  "columns": {"user_id": "string", "region": "string", "amount": "float", "ts": "timestamp"},
                  "time_column": "ts"},
        "privacy_unit": unit,
        "budget": {"scope": scope, "epsilon": eps, "delta": 0},
        "contribution": {"max_partitions_per_unit": 2, "max_rows_per_unit_per_partition": 2},
        "partitions": {"columns": ["region"], "public": ["north", "south", "east", "west"]},
        "metrics": [{"type": "count"}, {"type": "sum", "column": "amount", "bounds": [0, 100]}],
        "output": {"root": "out"},
    }


@dataclass
class Year:
    """The deployment's directory, environment and command log."""

    root: Path
    days: int
    log: list[tuple[str, int, float]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ledger(self) -> str:
        """The SQLite ledger URL."""
        return f"sqlite:///{self.root / 'ledger.sqlite'}"

    def dpops(self, *argv: str, expect: int | tuple[int, ...] = 0, fault: str | None = None) -> str:
        """``dpops <argv>`` in a forked child; fail unless it exits ``expect``; return its stdout."""
        args = list(argv)
        r = run_cli(args, fault=fault, env=self.env, cwd=self.root, timeout=300)
        self.log.append((" ".join(args[:2]), r.rc, r.seconds))
        ok = (expect,) if isinstance(expect, int) else expect
        if r.rc not in ok:
            raise AssertionError(f"dpops {' '.join(args)} exited {r.rc} (expected {expect})\n"
                                 f"stdout: {r.out[-3000:]}\nstderr: {r.err[-3000:]}")
        return r.out

    def run_day(self, spec: str, day: date, *extra: str, expect: int | tuple[int, ...] = 0,
                fault: str | None = None) -> str:
        """``dpops release run SPEC --interval DAY --publish`` (the runbook's "Releasing a given day")."""
        return self.dpops("release", "run", spec, "--interval", day.isoformat(), "--publish", "--no-progress",
                          *extra, expect=expect, fault=fault)


def run(days: int = 60, workdir: str | Path | None = None) -> dict:
    """Script ``days`` daily intervals (>= 12 keeps every event) plus the user scope; return the summary."""
    if days < 12:
        raise ValueError("days must be >= 12 to keep every event type")
    t0 = time.monotonic()
    warm_imports()
    root = Path(workdir or tempfile.mkdtemp(prefix="dpops-year-"))
    root.mkdir(parents=True, exist_ok=True)
    y = Year(root, days)
    y.env = {"DPOPS_LEDGER_URL": y.ledger, "DPOPS_NOISE_KEY_FILE": str(root / "keys/noise_key"),
             "DPOPS_STATE_DIR": str(root / "state")}
    (root / "keys").mkdir(mode=0o700)
    (root / "state").mkdir(mode=0o700)
    for name, scope, eps, period in (("daily", "daily", DAILY_EPS, "day"), ("users", "users", USER_EPS, None)):
        (root / f"{name}.yaml").write_text(yaml.safe_dump(_spec(name, scope, eps, period), sort_keys=False))

    end = START + timedelta(days=days)
    y.dpops("key", "generate", str(root / "keys/noise_key"))
    key1 = y.dpops("key", "id", str(root / "keys/noise_key")).strip().split()[-1]
    y.env["DPOPS_NOISE_KEY_ID"] = key1
    y.dpops("ledger", "init")
    y.dpops("ledger", "scope", "create", "daily", "--unit", "a user's purchases on one day",
            "--unit-column", "user_id", "--adjacency", "add_remove", "--unit-period", "day",
            "--bucket", "day", "--time-column", "ts",
            "--epsilon", str(DAILY_CAP), "--delta", "1e-6", "--accountant", "basic")
    y.dpops("ledger", "scope", "create", "users", "--unit", "a user", "--unit-column", "user_id",
            "--adjacency", "add_remove", "--time-column", "ts", "--epsilon", str(USER_CAP), "--delta", "1e-6",
            "--accountant", "basic")
    y.dpops("spec", "synth", "daily.yaml", "--from", START.isoformat(), "--to", end.isoformat(),
            "--rows", "400", "--users", "120")
    y.dpops("spec", "synth", "users.yaml", "--from", START.isoformat(),
            "--to", (START + timedelta(days=USER_DAYS)).isoformat(), "--rows", "400", "--users", "120")

    # which daily interval gets which event (all distinct, all inside [START, end))
    d = lambda i: START + timedelta(days=i)  # noqa: E731
    restated, refunded, spent = d(2), d(4), d(6)
    rotation_at = days // 2
    open_days = {d(days // 2 + 2), d(days - 1)}  # left unreleased on purpose
    summary: dict = {"days": days, "published": 0, "restated": 0, "refunded_then_published": 0,
                     "spent_then_published": 0, "refused_then_published": 0,
                     "key_rotated_at": d(rotation_at).isoformat()}

    for i in range(days):
        day = d(i)
        if i == rotation_at:  # runbook "Key rotation": new key file, declared by the new pin
            y.dpops("key", "generate", str(root / "keys/noise_key.new"))
            key2 = y.dpops("key", "id", str(root / "keys/noise_key.new")).strip().split()[-1]
            assert key2 != key1
            # the undeclared rotation is refused, nothing reserved
            y.run_day("daily.yaml", day, "--key-file", str(root / "keys/noise_key.new"), expect=3)
            (root / "keys/noise_key").replace(root / "keys/noise_key.old")  # kept (runbook step 1)
            (root / "keys/noise_key.new").replace(root / "keys/noise_key")
            y.env["DPOPS_NOISE_KEY_ID"] = key2
            summary["key_ids"] = [key1, key2]
        if day in open_days:
            continue
        if day == refunded:  # killed after the reservation, before any mechanism
            y.run_day("daily.yaml", day, expect=-9, fault="reserve.after=kill")
            y.dpops("ledger", "recover", "--older-than", "0")
            y.run_day("daily.yaml", day)
            summary["refunded_then_published"] += 1
        elif day == spent:  # killed after the noise was drawn
            y.run_day("daily.yaml", day, expect=-9, fault="stage.after=kill")
            y.dpops("ledger", "recover", "--older-than", "0")
            y.run_day("daily.yaml", day, expect=(6, 7))  # a plain retry never publishes a spent run
            y.run_day("daily.yaml", day, "--fresh-attempt", "--reason", "node lost during compute, ticket OPS-7")
            summary["spent_then_published"] += 1
        else:
            y.run_day("daily.yaml", day)
        summary["published"] += 1
        if i in (0, refunded.toordinal() - START.toordinal(), spent.toordinal() - START.toordinal(), days - 2):
            y.run_day("daily.yaml", day)  # a repeat is served, free (checked by the charge totals)

    # restatement: corrected input for one day; the plain run refuses, restate publishes a new version
    y.dpops("spec", "synth", "daily.yaml", "--from", restated.isoformat(),
            "--to", (restated + timedelta(days=1)).isoformat(), "--rows", "400", "--users", "120", "--seed", "7")
    # "already published ... and the input changed": exit 6 (a conflicting state), nothing charged
    y.run_day("daily.yaml", restated, expect=6)
    y.dpops("release", "restate", "daily.yaml", "--interval", restated.isoformat(), "--no-progress")
    # the restated day has v1 under the old key and v2 under the new one: `release status` should say ok
    st = run_cli(["release", "status", "daily.yaml", "--interval", restated.isoformat()], env=y.env, cwd=root)
    summary["findings"] = [] if st.rc == 0 else [
        f"release status of the restated day {restated} exits {st.rc} after the key rotation: "
        + st.err.strip().splitlines()[-1]]
    summary["restated"] += 1

    # user scope: a backfill across its cap, the owner raises it, the refused days are re-released
    refused: list[date] = []
    for i in range(USER_DAYS):
        out = y.run_day("users.yaml", d(i), "--json", expect=(0, 5))
        if json.loads(out)["exit_code"] == 5:
            refused.append(d(i))
    assert len(refused) == USER_DAYS - int(USER_CAP / USER_EPS), refused
    y.dpops("ledger", "status", "users")
    y.dpops("ledger", "cap", "users", "--epsilon", str(USER_EPS * USER_DAYS),
            "--reason", "approved by the privacy board, ticket DP-42", "--actor", "alice")
    for day in refused:
        y.run_day("users.yaml", day)
    summary["refused_then_published"] = len(refused)
    summary["users_published"] = USER_DAYS

    # end state
    verify = y.dpops("ledger", "verify")
    gaps = json.loads(y.dpops("gaps", "daily.yaml", "--from", START.isoformat(), "--to", end.isoformat(), "--json"))
    ugaps = json.loads(y.dpops("gaps", "users.yaml", "--from", START.isoformat(),
                               "--to", (START + timedelta(days=USER_DAYS)).isoformat(), "--json"))
    reports = {}
    for name in ("daily", "users"):
        html = root / f"report-{name}.html"
        rep = run_cli(["report", "--scope", name, "--spec", f"{name}.yaml", "--manifests", f"out/manifests/{name}",
                       "--out", str(html)], env=y.env, cwd=root, timeout=300)
        y.log.append(("report", rep.rc, rep.seconds))
        if rep.rc != 0:
            summary["findings"].append(f"report {name} exits {rep.rc}: {rep.err.strip().splitlines()[-1]}")
        reports[name] = (rep.out, html.read_text() if html.exists() else "")
    status = {name: json.loads(y.dpops("ledger", "status", name, "--json")) for name in ("daily", "users")}
    per: dict[str, list[float]] = {}
    for cmd, _rc, secs in y.log:
        per.setdefault(cmd, []).append(secs)
    summary.update(wall_s=round(time.monotonic() - t0, 1), commands=len(y.log),
                   seconds_per_command={k: [len(v), round(sum(v) / len(v), 2)] for k, v in per.items()},
                   verify=verify.strip().splitlines()[0] if verify.strip() else "",
                   gaps=gaps, users_gaps=ugaps, status=status, root=str(root),
                   reports={k: str(root / f"report-{k}.html") for k in reports},
                   report_texts=reports, open_days=sorted(x.isoformat() for x in open_days))
    return summary


def findings(summary: dict) -> list[str]:
    """What is wrong with the end state (empty: the proof holds)."""
    bad: list[str] = list(summary.get("findings", []))
    for name, (out, html) in summary["report_texts"].items():
        for text, where in ((out, "output"), (html, "HTML")):
            # the report prints "0 FAILED" in its tables; a finding is any nonzero count or a FAILED status
            for m in re.finditer(r"FAILED", text):
                before = text[max(0, m.start() - 40):m.start()]
                if not re.search(r"(?:^|[^0-9])0 (?:</?span[^>]*>)?$", before):
                    ctx = text[max(0, m.start() - 120):m.end() + 60]
                    bad.append(f"report {name}: FAILED in its {where}: ...{ctx}...")
                    break
            if where == "output" and re.search(r"(?i)warning", text):
                bad.append(f"report {name}: a warning in its output: {text.strip()[:300]}")
        # the declared rotation is the one true warning; anything else is a false one
        keys = summary.get("key_ids", [])
        rotation = f"the noise key changed from {keys[0]} to {keys[1]}" if len(keys) == 2 else None
        for w in re.findall(r"<div class='warn'>(.*?)</div>", html, flags=re.S):
            if rotation is None or rotation not in w:
                bad.append(f"report {name}: warning {re.sub('<[^>]+>', '', w)[:300]!r}")
    return bad


def main() -> int:
    """Run the year, print the summary and the findings; exit 1 if there is any."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=int, default=60)
    ap.add_argument("--workdir")
    a = ap.parse_args()
    s = run(a.days, a.workdir)
    texts = s.pop("report_texts")
    s["report_texts"] = texts
    print(json.dumps({k: v for k, v in s.items() if k != "report_texts"}, indent=1, default=str))
    bad = findings(s)
    for b in bad:
        print("FINDING:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
