"""Issue 13 edge: two ledgers sharing one output root. A run under the second ledger finds the first
ledger's publication of the same run: it must say what to do and never leave anything reserved (stuck)
forever; since issue 25 item 10 it refuses before reserving (a version its ledger never committed)."""

from __future__ import annotations

import pytest

from dpops import release
from dpops.errors import DpopsError, IntegrityError
from dpops.ledger import ScopeDefinition, open_ledger
from test_runs import IV, FakeKey, env, ledger_url, planner, published_bytes  # noqa: F401 - fixtures


def test_second_ledger_on_same_output_root_is_refused_and_explained(env, tmp_path):
    first = env.run()
    assert first.state == "published" and env.pipe.calls == 1
    before = published_bytes(env.tmp)
    other = open_ledger(f"sqlite:///{tmp_path}/other.sqlite")
    other.create_scope(ScopeDefinition(name="shop", unit="a user's purchases", unit_column="user_id",
                                       epsilon=1.2, delta=1e-6, rho=None, accountant="basic/1", unit_period="day",
                                       adjacency="add_remove"), actor="test")

    def run_other():
        return release.execute_release(env.spec, *IV, ledger=other, key=FakeKey(), run_release=env.pipe, planner=planner)

    # Since issue 25 item 10 the second ledger refuses before it reserves anything: storage holds a version
    # this ledger never committed (once, it reserved, computed nothing and refunded at publish).
    with pytest.raises(IntegrityError, match="nothing reserved") as err:
        run_other()
    assert "one ledger per output root" in str(err.value) and "not committed in the ledger" in str(err.value)
    assert other.runs() == []
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
