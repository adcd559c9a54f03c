"""Accountants behind one interface, looked up by ``name`` or ``name/version``.

Classes are imported on first use: ``pld`` pulls in dp_accounting (seconds of import),
which planning and Beam workers never need, so ``get_accountant("basic")`` stays cheap.
"""

from __future__ import annotations

import importlib

from dpops.accounting.base import Accountant, State
from dpops.errors import InvalidParameter

# ref -> "module:Class", in registration order (a later version of a name is its "latest").
_BUILTIN = {
    "basic/1": "dpops.accounting.basic:BasicAccountant",
    "zcdp/1": "dpops.accounting.zcdp:ZcdpAccountant",
    "rdp/1": "dpops.accounting.rdp:RdpAccountant",
    "pld/1": "dpops.accounting.pld:PldAccountant",
    "basic/2": "dpops.accounting.basic2:ExactBasicAccountant",
}
_REGISTRY: dict[str, type[Accountant] | str] = dict(_BUILTIN)
_LATEST: dict[str, str] = {ref.split("/")[0]: ref for ref in _BUILTIN}
# The bare name "basic" stays basic/1: scripts that create a scope with ``--accountant basic`` on every start
# (deploy/ledger-init.sh) would otherwise, after an upgrade, ask for their scope at basic/2 while it is
# pinned at basic/1, and be refused as a conflict, and every report or test that compares "basic" would change
# its numbers. basic/2 is chosen by pinning it (``budget.accountant: basic/2``, ``--accountant basic/2``).
_LATEST["basic"] = "basic/1"


def register(cls: type[Accountant]) -> type[Accountant]:
    """Add an accountant class under ``name/version``; a third-party accountant registers itself this way.

    The last version registered for a name becomes what the bare name resolves to, so register
    older versions first. Returns the class, so it can be used as a decorator.
    """
    ref = f"{cls.name}/{cls.version}"
    _REGISTRY[ref] = cls
    # "latest" is by registration order: register older versions first.
    _LATEST[cls.name] = ref
    return cls


def _load(ref: str) -> type[Accountant]:
    entry = _REGISTRY[ref]
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = getattr(importlib.import_module(module), name)
        _REGISTRY[ref] = entry
    return entry


def get_accountant(ref: str) -> Accountant:
    """``"rdp"`` gives the latest version (``"basic"`` gives basic/1, see ``_LATEST``); ``"rdp/1"`` pins one."""
    if not isinstance(ref, str) or not ref:
        raise InvalidParameter(f"accountant must be a name like 'rdp' or 'rdp/1', got {ref!r}")
    full = ref if "/" in ref else _LATEST.get(ref, "")
    if full not in _REGISTRY:
        raise InvalidParameter(f"unknown accountant {ref!r}; known: {sorted(_REGISTRY)}")
    return _load(full)()


def known_accountants() -> list[str]:
    """Every registered ``name/version``, sorted (for error messages, manifest checks and the CLI)."""
    return sorted(_REGISTRY)


__all__ = ["Accountant", "State", "get_accountant", "known_accountants", "register"]
