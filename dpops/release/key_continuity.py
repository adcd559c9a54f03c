"""A run's noise key must be the key its scope has been using, unless the operator declared a rotation.

Issue 19 item 9. The key reference can be chosen by less trusted parties (an Airflow Variable, a task's
arguments); a run published under another key is a release the operator never approved: its keyed
fingerprints and noise are not reproducible with the scope's key, and a key chosen by the attacker lets
them recompute the noise. So, before anything is reserved:

- the key id must equal the operator's pin ``$DPOPS_NOISE_KEY_ID`` when it is set (checked in ``prepare``,
  ``dpops.keyref.check_pinned_key_id``);
- a keyed run's key id must equal the key id of the most recent keyed run of the run's budget scope, as
  the ledger records it (``<id>`` or ``<id>/retry-N``), unless ``$DPOPS_NOISE_KEY_ID`` pins exactly the new
  id: setting the pin in the deployment is how the operator declares a rotation (docs/runbook.md "Key
  rotation"). Test-mode runs (never publishable) and os-mode runs (their run key records the attempt,
  ``os/attempt-N``, not the key) are neither checked nor counted; the pin applies to both production modes.

The ledger's run records are the memory here (each run key carries its key id), so no new ledger table is
needed; a scope with no production run yet accepts its first key (pin it to be strict from the start).
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from dpops.errors import InvalidParameter
from dpops.keyref import KEY_ID_ENV, noise_key_id, pinned_key_id

if TYPE_CHECKING:
    from dpops.ledger import Ledger
    from dpops.release.context import RunContext

def check_key_continuity(ctx: RunContext, ledger: Ledger) -> None:
    """Refuse a keyed run whose key id is not the scope's last one, unless the pin declares the rotation."""
    if ctx.randomness != "keyed":
        return  # test: never publishable; os: no key id in the ledger to compare with (the pin still applies)
    current = str(ctx.key_id)
    scope = ctx.spec.budget.scope
    previous = [(r, k) for r in ledger.runs(scope=scope) if (k := noise_key_id(r.key.key_id)) is not None]
    if not previous:
        return
    last, last_id = previous[-1]
    if hmac.compare_digest(last_id, current):
        return
    pinned = pinned_key_id()
    if pinned is not None and hmac.compare_digest(pinned, current):
        return  # the operator declared the rotation by pinning the new key id in the deployment
    raise InvalidParameter(
        f"{ctx.spec.name} {ctx.interval}: the noise key has id {current}, but the last keyed run of scope "
        f"{scope!r} ({last.run_id}) used key id {last_id}: a different key is refused unless the operator "
        f"declares the rotation by setting {KEY_ID_ENV}={current} in the deployment (docs/runbook.md, "
        "Key rotation); if the key reference was changed by mistake, point it back at the scope's key; nothing "
        "was reserved")


__all__ = ["check_key_continuity", "noise_key_id"]
