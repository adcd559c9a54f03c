"""The accountant interface shared by the ledger, the manifests and the CLI.

An accountant has a ``name`` and an immutable ``version``; the pair is recorded
with every scope and manifest. A version's meaning never changes: a better
algorithm is a new version registered beside the old one (semantics.md section 4).

Accountants also keep a *running state*: a small JSON-serializable dict that the
ledger stores next to each scope and updates in the same transaction as a
reservation, so that checking a cap costs the same at 10 and at 10,000 entries.
``state_epsilon(add_events(empty_state(), history), delta)`` must equal
``epsilon(history, delta)`` (up to numerical tolerance): ``verify`` checks it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from dpops.events import PrivacyEvent

State = dict[str, Any]


class Accountant(abc.ABC):
    """A composition rule for privacy events, identified by an immutable ``name/version``.

    Subclasses implement the four running-state methods; the one-shot ``epsilon``/``delta`` are
    defined through them, so the ledger's cached state and a fresh replay can never disagree.
    """

    name: str
    version: str

    @property
    def ref(self) -> str:
        """``name/version``, the string recorded in scopes and manifests."""
        return f"{self.name}/{self.version}"

    # --- one-shot composition -------------------------------------------------
    def epsilon(self, events: Sequence[PrivacyEvent], delta: float) -> float:
        """Smallest epsilon this accountant certifies for the composition at ``delta``."""
        return self.state_epsilon(self.add_events(self.empty_state(), events), delta)

    def delta(self, events: Sequence[PrivacyEvent], epsilon: float) -> float:
        """Smallest delta this accountant certifies for the composition at ``epsilon``."""
        return self.state_delta(self.add_events(self.empty_state(), events), epsilon)

    # --- running state (the ledger's per-scope cache) ------------------------
    @abc.abstractmethod
    def empty_state(self) -> State:
        """The state of an empty history (nothing spent)."""

    @abc.abstractmethod
    def add_events(self, state: State, events: Sequence[PrivacyEvent]) -> State:
        """Return a new state with ``events`` composed in; ``state`` is not modified."""

    @abc.abstractmethod
    def state_epsilon(self, state: State, delta: float) -> float:
        """Smallest epsilon certified at ``delta`` for the history ``state`` summarises (inf if none is)."""

    @abc.abstractmethod
    def state_delta(self, state: State, epsilon: float) -> float:
        """Smallest delta certified at ``epsilon`` for the history ``state`` summarises (1.0 if none is)."""

    def describe(self) -> dict[str, Any]:
        """Name, version and the library versions that computed the numbers."""
        return {"name": self.name, "version": self.version}
