"""Issue 21 item 12, end to end through the CLI: days committed at the same moment show their own "scope total
after it" in ``dpops report`` (the ledger's order), not the same figure.

Two ``dpops release run --publish`` of the CLI, interleaved the way two Airflow runs overlap: the second day's
whole run (reserve, compute, commit) happens while the first day's run is computing (reserved and started,
charged). Both manifests' scope snapshots are read at commit, when both charges were in the ledger, so both say
1.0; the ledger reserved day 1 first. The report, the Privacy budget page model and ``dpops ledger status``
must agree: day 1's total after it is 0.5, day 2's is 1.0, the scope total is 1.0.
"""

from __future__ import annotations

import json
import re

from cli_support import DAYS, make_env

from dpops.cli.main import main
from dpops.ledger import open_ledger
from dpops.manifest.io import read_manifest
from dpops.release import computation


def test_report_totals_follow_the_ledger_order_for_runs_committed_together(tmp_path, monkeypatch, capsys):
    env = make_env(tmp_path, monkeypatch, cap=1.2)
    mdir = tmp_path / "manifests"
    monkeypatch.setenv("DPOPS_MANIFESTS_DIR", str(mdir))
    nested: list[int] = []
    computing: list[str] = []

    def overlapping(req):  # the first compute runs the second day's whole release, then finishes its own
        computing.append("x")
        if len(computing) == 1:
            nested.append(main(["release", "run", str(env.spec), *env.base(DAYS[1]), "--ledger", env.url,
                                "--no-progress", "--publish"]))
        return env.pipe(req)

    monkeypatch.setattr(computation, "_load_run_release", lambda: overlapping)
    code = main(["release", "run", str(env.spec), *env.base(DAYS[0]), "--ledger", env.url, "--no-progress",
                 "--publish"])
    assert (code, nested) == (0, [0])
    capsys.readouterr()

    with open_ledger(env.url) as led:
        by_day = {r.key.interval_start[:10]: r for r in led.runs(scope="shop", states=["committed"])}
        assert sorted(by_day) == [DAYS[0], DAYS[1]]
        day1, day2 = by_day[DAYS[0]], by_day[DAYS[1]]
        assert min(day1.entry_ids) < min(day2.entry_ids), "day 1 was reserved first"
        # The symptom: both manifests' snapshots (read at commit) show the same total.
        snap = {d: max(b["total"] for b in read_manifest(next(mdir.glob(f"{r.run_id}.*.json")))
                       ["privacy"]["scope"]["buckets"]) for d, r in by_day.items()}
        assert round(snap[DAYS[0]], 9) == round(snap[DAYS[1]], 9) == 1.0, snap

    code = main(["report", "--scope", "shop", "--ledger", env.url, "--key-file", str(env.key), "--out",
                 str(tmp_path / "report.html"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["manifests_failed"] == [], doc
    html = (tmp_path / "report.html").read_text()
    shown = {}
    for run_id, block in re.findall(r"<div class='release' data-run='([0-9a-f]{32})' data-trusted='true'>(.*?)</ul>",
                                    html, re.S):
        total = re.search(r"data-field='scope_total_after'>(.*?)</span> \(", block, re.S).group(1)
        shown[run_id] = re.sub(r"<[^>]+>", "", total).strip()
    assert shown == {day1.run_id: "0.5", day2.run_id: "1"}, shown

    code = main(["ledger", "--ledger", env.url, "status", "shop", "--json"])
    status = json.loads(capsys.readouterr().out)
    assert code == 0 and round(status["total"], 9) == 1.0
    from dpops.budget_view import budget_page

    with open_ledger(env.url) as led:
        points = budget_page(led, mdir, [str(env.spec)]).spend["shop"]
    assert [(p.run_id, round(p.total, 9)) for p in points] == [(day1.run_id, 0.5), (day2.run_id, 1.0)]
