"""Accountants behind one interface, looked up by ``name`` or ``name/version``."""

from __future__ import annotations

from dpops.accounting.base import Accountant, State
from dpops.accounting.basic import BasicAccountant
from dpops.accounting.pld import PldAccountant
from dpops.accounting.rdp import RdpAccountant
from dpops.accounting.zcdp import ZcdpAccountant
from dpops.errors import InvalidParameter

_REGISTRY: dict[str, type[Accountant]] = {}
_LATEST: dict[str, str] = {}


def register(cls: type[Accountant]) -> type[Accountant]:
    ref = f"{cls.name}/{cls.version}"
    _REGISTRY[ref] = cls
    # "latest" is by registration order: register older versions first.
    _LATEST[cls.name] = ref
    return cls


register(BasicAccountant)
register(ZcdpAccountant)
register(RdpAccountant)
register(PldAccountant)


def get_accountant(ref: str) -> Accountant:
    """``"rdp"`` gives the latest version; ``"rdp/1"`` pins one."""
    if not isinstance(ref, str) or not ref:
        raise InvalidParameter(f"accountant must be a name like 'rdp' or 'rdp/1', got {ref!r}")
    full = ref if "/" in ref else _LATEST.get(ref, "")
    cls = _REGISTRY.get(full)
    if cls is None:
        raise InvalidParameter(f"unknown accountant {ref!r}; known: {sorted(_REGISTRY)}")
    return cls()


def known_accountants() -> list[str]:
    return sorted(_REGISTRY)


__all__ = ["Accountant", "State", "get_accountant", "known_accountants", "register"]
