"""A read of private data that no epsilon describes (``dpops tune --i-understand-this-reads-private-data``).

Tuning is not differentially private (``dpops.analysis.sample_access``): its output is an exact function of
the rows it reads. A flagged read of the spec's private input is allowed, but only after the ledger records
a ``private_access`` entry on the spec's scope (who, when, the keyed input fingerprint, why), so the fact is
durable and reviewable; the spec patch then says so. This module is that gate. It lives with the release
steps because it writes the ledger before private data is read, which ``dpops.analysis`` never does; the
path checks it applies are the pure ones of ``dpops.analysis.sample_access``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dpops.analysis.sample_access import (
    FIELD,
    PRIVATE_FLAG,
    PrivateSample,
    SampleAccess,
    check_private_sample,
    classify_sample,
    refuse_private,
)
from dpops.errors import InvalidParameter

if TYPE_CHECKING:
    from dpops.inputs import HmacKey
    from dpops.ledger import Ledger
    from dpops.spec import ReleaseSpec


def open_sample(spec: ReleaseSpec, path: str | os.PathLike[str], *, allow_private: bool = False,
                ledger: Ledger | None = None, actor: str | None = None, reason: str | None = None,
                fingerprint_key: HmacKey | None = None,
                key_path: str | os.PathLike[str] | None = None) -> SampleAccess:
    """Check ``path`` for tuning; for private data (allowed explicitly) record the access first.

    Order (each refusal before anything is recorded): public or private (``classify_sample``); a private one
    without ``allow_private`` is refused; then the release's input checks and "one of the spec's own input
    files" (``check_private_sample``); then a ledger, key, actor and reason must be given; only then the entry,
    whose own time is the read's date of record (``manifest verify --ledger`` compares the two)."""
    checked = classify_sample(spec, path, key_path=key_path)
    if isinstance(checked, SampleAccess):
        return checked
    assert isinstance(checked, PrivateSample)
    if not allow_private:
        raise refuse_private(checked)
    resolved = check_private_sample(spec, checked, key_path=key_path)
    if ledger is None or fingerprint_key is None or not actor:
        raise InvalidParameter(f"reading private data for tuning needs a ledger, a fingerprint key (--key-file) "
                               f"and an actor, so that the access is recorded ({PRIVATE_FLAG})")
    if not reason or not reason.strip():
        raise InvalidParameter(f"{PRIVATE_FLAG} needs --reason: why the private data must be looked at "
                               "(kept in the ledger forever)")
    from dpops.errors import InputDataError
    from dpops.inputs import input_fingerprint, input_stat_snapshot

    # The snapshot before the fingerprint, compared after it (and after the read, ``dpops.release.tuning``): the
    # fingerprint the ledger records, and a patch carries as its provenance, is of the bytes that were read.
    stats = input_stat_snapshot([resolved])
    fp = "hmac-sha256:" + input_fingerprint([resolved], fingerprint_key)
    if stats is not None and input_stat_snapshot([resolved]) != stats:
        raise InputDataError(f"{FIELD} ({resolved}): the sample changed while it was fingerprinted; nothing was read "
                             "or recorded. Tune on a file that is no longer being written")
    eid = ledger.record_private_access(spec.budget.scope, actor=actor, fingerprint=fp, reason=reason,
                                       purpose=f"tune {spec.name}")
    # the entry's own time is the read's date of record (manifest verify --ledger compares the two)
    ts = next(e.ts for e in reversed(ledger.history(spec.budget.scope)) if int(e.id) == int(eid))
    return SampleAccess(resolved, True, ts, fp, eid, spec.budget.scope, stats=stats)


__all__ = ["open_sample"]
