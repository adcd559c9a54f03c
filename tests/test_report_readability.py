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
