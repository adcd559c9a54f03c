"""Tables at 60, 80, 100 and 200 columns never split a date, a run id or a URI (issue 21 item 15).

Every table command goes through ``dpops.cli.common.print_table``. The checker collects every token
that an operator copies (interval dates, entry times, run ids, entry hashes, output URIs, each word
of a refusal reason) from the data itself and requires each to appear whole on one output line; a
line wider than ``COLUMNS`` is allowed only when it is one label and one token that cannot fit.
"""

from __future__ import annotations

import re
import string

import pytest
from cli_support import make_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from fuzz_support import examples
from test_runs import write_input

from dpops.cli.common import print_table
from dpops.events import Laplace
from dpops.ledger import RunKey, open_ledger

WIDTHS = (60, 80, 100, 200)
LONG_REASON = ("operator raised the cap after the quarterly review of 2024-01-03T00:00:00Z; see ticket "
               "s3://audit-bucket/reviews/2024/q1/cap-raise-approval-0001.pdf for the signed approval")


def check_whole(out: str, tokens: set[str], width: int, *, summary: bool = False) -> None:
    """Each token on one line of ``out``; no line wider than ``width`` unless it is a label and one unbreakable token
    (``summary``: the last line is a sentence after the table, not part of it)."""
    lines = out.splitlines()
    for tok in tokens:
        assert any(tok in line for line in lines), f"{tok!r} is split (or missing) at {width} columns:\n{out}"
    for line in lines[:-1] if summary else lines:
        if len(line) > width:
            words = line.split()
            assert len(words) <= 2 and max(map(len, words)) > width - 12, (
                f"line of {len(line)} > {width} columns that could have wrapped:\n{line}")


def tokens_of(text: str) -> set[str]:
    return {w for w in text.split() if len(w) >= 8}


@pytest.fixture
def world(tmp_path, monkeypatch, capsys):
    """Two published days, one refused (long reason), runs with s3:// URIs, a cap change with a long reason."""
    env = make_env(tmp_path, monkeypatch, cap=1.2)
    u = ["--ledger", env.url]
    for day in ("2024-01-01", "2024-01-02", "2024-01-03"):
        write_input(tmp_path, day)
        env.run(capsys, "release", "run", str(env.spec), *env.base(day), *u, "--publish", "--no-gx-checks")
    with open_ledger(env.url) as led:
        for day in range(10, 13):
            key = RunKey("purchases_daily_by_region_and_category", "h" * 64, f"2024-02-{day}T00:00:00Z",
                         f"2024-02-{day + 1}T00:00:00Z", "fp", "k")
            rec = led.reserve(key, "shop", [Laplace(scale=100.0, l1_sensitivity=1.0)], actor="airflow-scheduler")
            led.start(rec.run_id, actor="airflow-scheduler")
            if day != 12:  # a started run stays in flight
                led.commit(rec.run_id, actor="airflow-scheduler",
                           output_uri=f"s3://dpops-releases-production/purchases_daily_by_region_and_category/"
                                      f"interval=2024-02-{day}T00:00:00Z/v1/part-00000-of-00001.parquet")
        led.change_cap("shop", epsilon=2.5, reason=LONG_REASON, actor="alice@example.org")
        tokens: dict[str, set[str]] = {"ledger runs": set(), "ledger history": tokens_of(LONG_REASON)}
        for r in led.runs():
            tokens["ledger runs"] |= {r.run_id, r.key.interval_start, r.key.interval_end, r.output_uri or r.run_id}
        for e in led.history():
            tokens["ledger history"] |= {e.ts[:19], e.hash[:16], e.run_id or e.hash[:16],
                                         e.data.get("output_uri") or e.hash[:16]}
    code, doc, _ = env.json(capsys, "gaps", str(env.spec), "--from", "2024-01-01", "--to", "2024-01-06", *u, "--json",
                            "--all")
    assert code == 0 and any(i["status"] == "refused" for i in doc["items"]), doc
    gap_tokens: dict[str, set[str]] = {"gaps": set(), "gaps only": set()}
    for i in doc["items"]:
        these = {i["interval_start"], i["interval_end"]} | tokens_of(i["detail"] or "")
        these |= {i["run_id"]} if i.get("run_id") else set()
        gap_tokens["gaps"] |= these
        if i["status"] != "published":
            gap_tokens["gaps only"] |= these
    return env, tokens, gap_tokens


COMMANDS = {
    "ledger status": lambda e: ["ledger", "status", "shop", "--ledger", e.url],
    "ledger history": lambda e: ["ledger", "history", "--ledger", e.url],
    "ledger runs": lambda e: ["ledger", "runs", "--ledger", e.url],
    "ledger scope show": lambda e: ["ledger", "scope", "show", "--ledger", e.url],
    "gaps": lambda e: ["gaps", str(e.spec), "--from", "2024-01-01", "--to", "2024-01-06", "--all", "--ledger", e.url],
    "gaps only": lambda e: ["gaps", str(e.spec), "--from", "2024-01-01", "--to", "2024-01-06", "--ledger", e.url],
    "manifest show": lambda e: ["manifest", "show", str(next((e.root / "out" / "manifests").rglob("*.published.json")))],
    "plan": lambda e: ["plan", str(e.spec), "--from", "2024-01-01", "--to", "2024-01-06", "--ledger", e.url],
    "release status": lambda e: ["release", "status", str(e.spec), "--interval", "2024-01-02", "--ledger", e.url,
                                 "--key-file", str(e.key)],
}
# Commands whose layout fits 80 columns as a table (issue 21 item 15: short status words, reasons under the
# row, the cost in the title): no fall back to `column: value` blocks from 80 columns on.
TABLE_AT_80 = ("plan", "release status", "gaps", "gaps only", "ledger runs")


@pytest.mark.parametrize("columns", WIDTHS)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_table_command_keeps_ids_dates_and_uris_whole(world, capsys, monkeypatch, command, columns):
    env, tokens, gap_tokens = world
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = env.run(capsys, *COMMANDS[command](env))
    assert code == 0, err
    if command in ("ledger history", "ledger runs"):
        expect = tokens[command]
    elif command in ("gaps", "gaps only"):  # dates, run ids and every long word of the reasons
        expect = gap_tokens[command]
    elif command == "plan":
        expect = {t for t in gap_tokens["gaps"] if re.fullmatch(r"\d{4}-.*Z", t)}
    elif command == "release status":
        code, doc, _ = env.json(capsys, *COMMANDS[command](env), "--json")
        assert code == 0 and doc["versions"] and doc["output_uri"], doc
        expect = {doc["output_uri"], doc["published_run"], *(v["published_at"] for v in doc["versions"]),
                  *(r["run_id"] for r in doc["runs"]), *(r["key_id"] for r in doc["runs"])}
    elif command == "manifest show":
        expect = {COMMANDS[command](env)[-1], *(t for t in tokens["ledger runs"] if t.startswith("file://"))}
        expect = {t for t in expect if t.endswith(".json")}
    else:
        expect = set()
    assert command != "ledger runs" or any(t.startswith("s3://") for t in expect)
    check_whole(out, expect, columns, summary=command == "plan")
    if command in TABLE_AT_80 and columns >= 80:  # a table (the │ separator), never the per-row blocks
        assert "│" in out and "\n  interval start: " not in out and "\n  run: " not in out, out
    if command == "plan":  # status and action words are never cut into statu/s, publi/shed
        assert "published" in out and "REFUSED" in out, out
    if command == "ledger history":  # kinds are whole words, never res/erv/ed
        assert all(k in out for k in ("reserve", "commit", "cap")), out


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    width=st.integers(min_value=40, max_value=220),
    rows=st.lists(st.tuples(
        st.sampled_from(["2024-01-01T00:00:00Z", "2026-11-30T00:00:00Z"]),
        st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
        st.builds(lambda p: f"s3://bucket-name/{p}/part-00000.parquet",
                  st.text(alphabet=string.ascii_lowercase + "/=-", min_size=1, max_size=60)),
        st.lists(st.sampled_from(["budget", "refused", "2024-01-03T00:00:00Z", "cap", "of", "ε=0.5", "remaining",
                                  "scope", "would", "exceed"]), min_size=0, max_size=40).map(" ".join),
        st.sampled_from(["published", "spent unpublished", "refused", "never run"]),
    ), min_size=1, max_size=4),
)
def test_print_table_never_splits_a_token(width, rows, capsys, monkeypatch):
    """Any dates, ids, URIs and reasons at any width: every token is whole on one line (the base commit's rich
    table folded dates and ids in the free-text columns and hard-wrapped URIs)."""
    monkeypatch.setenv("COLUMNS", str(width))
    print_table("t", ["interval start", "run", "output", "why", "status"], [list(r) for r in rows],
                keep=("interval start", "run"))
    out = capsys.readouterr().out  # read (and reset) for each example
    tokens = {t for r in rows for cell in r for t in cell.split()}
    check_whole(out, tokens, width)
