"""Issue 13 edge: two ledgers sharing one output root. A run under the second ledger finds the
first ledger's sealed output of the same run; it must refund its reservation and say what to do,
never leave it reserved (stuck) forever."""

from __future__ import annotations

import pytest

from dpops import release
from dpops.errors import DpopsError, LedgerError
from dpops.ledger import ScopeDefinition, open_ledger
from test_runs import IV, FakeKey, env, ledger_url, planner, published_bytes  # noqa: F401 - fixtures


def test_second_ledger_on_same_output_root_refunds_and_explains(env, tmp_path):
    first = env.run()
    assert first.state == "published" and env.pipe.calls == 1
    before = published_bytes(env.tmp)
    other = open_ledger(f"sqlite:///{tmp_path}/other.sqlite")
    other.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                       epsilon=1.2, delta=1e-6, rho=None, accountant="basic/1", unit_period="day",
                                       adjacency="add_remove"), actor="test")

    def run_other():
        return release.execute_release(env.spec, *IV, ledger=other, key=FakeKey(), run_release=env.pipe, planner=planner)

    with pytest.raises(LedgerError, match="another ledger shares this output root") as err:
        run_other()
    assert "refunded" in str(err.value) and "one ledger per output root" in str(err.value)
    recs = other.runs()
    assert [r.state for r in recs] == ["released"]
    assert "another ledger" in other.history()[-1].data["reason"]
    assert other.status("shop").total == 0.0
    # a retry charges nothing and leaves nothing open
    with pytest.raises(DpopsError):
        run_other()
    assert other.status("shop").total == 0.0
    assert not other.runs(states=["reserved", "started"])
    assert other.verify().ok and env.ledger.verify().ok
    # the first ledger's publication is untouched and no noise was drawn again
    assert env.pipe.calls == 1 and published_bytes(env.tmp) == before
    assert env.ledger.run(first.run_id).state == "committed"
    other.close()
