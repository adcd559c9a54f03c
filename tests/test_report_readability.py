"""The report reads right (issue 21 item 12): no false key-change warning for a retry attempt, "n/a" with
a reason instead of ``inf`` on a pure-DP scope, interval cells that never wrap, totals in ledger order."""

from __future__ import annotations

from manifest_support import ACTOR, make_ledger, run_key

from dpops.events import Laplace
from dpops.report import build_report


def test_pure_dp_scope_with_a_retry_attempt(tmp_path):
    ledger = make_ledger(tmp_path, accountant="basic/1", epsilon=10.0, delta=0.0)
    for i, kid in enumerate(["68f3c6951f1d6911", "68f3c6951f1d6911/retry-2", "68f3c6951f1d6911"]):
        rec = ledger.reserve(run_key("daily_a", i, key_id=kid), "purchases",
                             [Laplace(scale=2.0, l1_sensitivity=1.0)], actor=ACTOR)
        ledger.start(rec.run_id, actor=ACTOR)
        ledger.commit(rec.run_id, output_uri=f"file:///out/{i}", actor=ACTOR)
    text, data = build_report(ledger, "purchases", tmp_path / "r.html")
    assert not [w for w in data.warnings if "noise key changed" in w], data.warnings
    comparison = text.split("id='comparison'")[1].split("</table>")[0]
    assert ">inf<" not in comparison and "n/a (pure ε-DP" in comparison, comparison
    assert "td.iv{white-space:nowrap}" in text and "<td class='iv'>[" in text
    # a real key change still warns
    rec = ledger.reserve(run_key("daily_a", 5, key_id="0123456789abcdef"), "purchases",
                         [Laplace(scale=2.0, l1_sensitivity=1.0)], actor=ACTOR)
    ledger.start(rec.run_id, actor=ACTOR)
    ledger.commit(rec.run_id, output_uri="file:///out/5", actor=ACTOR)
    _, data = build_report(ledger, "purchases", tmp_path / "r.html")
    assert [w for w in data.warnings if "noise key changed from 68f3c6951f1d6911 to 0123456789abcdef" in w]
    ledger.close()


def test_runs_committed_in_the_same_second_keep_the_ledgers_order():
    """Charge order is the ledger's entry order: a shared timestamp (or run ids that sort the other way)
    must not swap two runs, or both would show the same "scope total after it"."""
    from dpops.report.data import RunRow
    from dpops.report.plots import charge_order, cumulative_series

    def row(run_id: str, entry_id: int) -> RunRow:
        return RunRow(run_id=run_id, release="r", interval_start="2024-01-01T00:00:00Z",
                      interval_end="2024-01-02T00:00:00Z", state="committed", epsilon=0.5, restates=None,
                      created_at="2024-01-02T00:00:05Z", updated_at="", buckets=[],
                      events=[Laplace(scale=2.0, l1_sensitivity=1.0)], entry_id=entry_id)

    runs = sorted([row("aaaa", 9), row("zzzz", 2)], key=charge_order)
    assert [r.run_id for r in runs] == ["zzzz", "aaaa"]
    totals = [eps for _, eps in cumulative_series(runs, "basic/1", 0.0)["all"]]
    assert totals == [0.5, 1.0]  # two different totals after the two runs
