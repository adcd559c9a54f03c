"""``dpops account``: what a list of privacy events costs under an accountant."""

from __future__ import annotations

import json
import math
import sys

import click

from dpops.accounting import get_accountant, known_accountants
from dpops.cli.common import say
from dpops.errors import InvalidParameter
from dpops.events import PrivacyEvent, event_from_dict

HELP = """Compose the privacy events in EVENTS_JSON and print epsilon at --delta
(or delta at --epsilon).

EVENTS_JSON is a file (or - for stdin) holding a JSON list of events, each an
object with a "kind" and its parameters (schema dpops.event/1), e.g.

\b
  [{"kind": "gaussian", "sigma": 8.0, "l2_sensitivity": 1.0},
   {"kind": "laplace", "scale": 2.0, "l1_sensitivity": 1.0},
   {"kind": "discrete_laplace", "scale": 2.0, "l1_sensitivity": 1.0, "resolution": 1.0},
   {"kind": "discrete_gaussian", "sigma": 4.0, "l2_sensitivity": 1.0, "resolution": 1.0},
   {"kind": "pure_dp", "epsilon": 0.1, "mechanism": "exponential"},
   {"kind": "approx_dp", "epsilon": 0.1, "delta": 1e-9, "mechanism": "partition_selection"},
   {"kind": "zcdp", "rho": 0.01},
   {"kind": "self_composed", "count": 30, "event": {"kind": "gaussian", "sigma": 8.0, "l2_sensitivity": 1.0}},
   {"kind": "composed", "events": [ ... ]}]

Sensitivities are in the noise's units. Accountants: basic, zcdp, rdp, pld
(latest version), or pinned as name/version (e.g. rdp/1).
"""


def read_events(path: str) -> list[PrivacyEvent]:
    """Parse the events file; every error names the file and the event's position."""
    where = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as exc:
        raise InvalidParameter(f"{where}: cannot read the events file: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidParameter(f"{where}: not valid JSON ({exc}); expected a list of privacy events") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InvalidParameter(f"{where}: expected a JSON list of privacy events, got {type(data).__name__}")
    events = []
    for i, item in enumerate(data):
        try:
            events.append(event_from_dict(item))
        except InvalidParameter as exc:
            raise InvalidParameter(f"{where}: event #{i} (0-based): {exc}") from None
    return events


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _latest_refs() -> list[str]:
    """One ref per accountant name, its latest version, in a stable order."""
    names = dict.fromkeys(r.split("/")[0] for r in known_accountants())
    return [get_accountant(n).ref for n in names]


@click.command("account", help=HELP)
@click.argument("events_json", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--accountant", "accountant_ref", default="rdp", show_default=True, help="Accountant name or name/version.")
@click.option("--delta", type=float, default=None, help="Report epsilon at this delta (in [0, 1)).")
@click.option("--epsilon", type=float, default=None, help="Report delta at this epsilon (> 0).")
@click.option("--compare", is_flag=True, help="Also show the result under every registered accountant.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def cli(events_json: str, accountant_ref: str, delta: float | None, epsilon: float | None, compare: bool, as_json: bool) -> None:
    if (delta is None) == (epsilon is None):
        raise click.UsageError("give exactly one of --delta D (to get epsilon) or --epsilon E (to get delta)")
    accountant = get_accountant(accountant_ref)
    events = read_events(events_json)
    refs = [accountant.ref] + ([r for r in _latest_refs() if r != accountant.ref] if compare else [])
    rows = []
    for ref in refs:
        acc = get_accountant(ref)
        value = acc.epsilon(events, delta) if delta is not None else acc.delta(events, epsilon)
        rows.append({"accountant": ref, "value": value, "describe": acc.describe()})
    asked, given = ("epsilon", delta) if delta is not None else ("delta", epsilon)
    if as_json:
        out = {
            "events": len(events),
            "given": {"delta" if delta is not None else "epsilon": given},
            "accountant": rows[0]["accountant"],
            asked: _finite(rows[0]["value"]),
            "describe": rows[0]["describe"],
        }
        if compare:
            out["compare"] = [{"accountant": r["accountant"], asked: _finite(r["value"])} for r in rows]
        from dpops.cli.common import echo_ok

        echo_ok(out)
        return
    label = f"delta = {given:g}" if delta is not None else f"epsilon = {given:g}"
    for i, r in enumerate(rows):
        v = r["value"]
        shown = f"{v:.6g}" if math.isfinite(v) else "inf (no finite epsilon: delta is not above the events' own delta)"
        prefix = "" if i == 0 else "  "
        say(f"{prefix}{r['accountant']}: {asked} = {shown} at {label} ({len(events)} event(s))")
        if i == 0 and compare and len(rows) > 1:
            say("compared with:")
