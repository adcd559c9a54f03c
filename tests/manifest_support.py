"""Shared helpers for the manifest and report tests: a SQLite ledger and synthetic runs."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dpops.events import Gaussian, Laplace
from dpops.ledger import RunKey, ScopeDefinition, open_ledger
from dpops.manifest import build_manifest
from dpops.spec import load_spec

EXAMPLE_SPEC = Path(__file__).resolve().parent.parent / "examples" / "daily_purchases.yaml"
ACTOR = "test"


def fp(text: str) -> str:
    # a stand-in for a keyed input fingerprint (tests never see private data)
    return "hmac-sha256:" + hashlib.sha256(text.encode()).hexdigest()


def day(i: int) -> tuple[str, str]:
    return (f"2024-01-{i + 1:02d}T00:00:00Z", f"2024-01-{i + 2:02d}T00:00:00Z") if i < 30 else \
        (f"2024-02-{i - 29:02d}T00:00:00Z", f"2024-02-{i - 28:02d}T00:00:00Z")


def make_ledger(tmp_path: Path, accountant: str = "rdp/1", epsilon: float = 1.0, delta: float = 1e-7,
                scope: str = "purchases"):
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.create_scope(ScopeDefinition(name=scope, unit="a user's purchases on one day", unit_column="user_id",
                                        epsilon=epsilon, delta=delta, rho=None, accountant=accountant,
                                        population=1_000_000, adjacency="add_remove"), actor=ACTOR)
    return ledger


def run_key(release: str, i: int, spec_hash: str = "a" * 64, variant: str = "", key_id: str = "k1") -> RunKey:
    s, e = day(i)
    return RunKey(release=release, spec_hash=spec_hash, interval_start=s, interval_end=e,
                  input_fingerprint=fp(f"{release}/{i}/{variant}"), key_id=key_id)


def synthetic_events(sigma: float = 40.0):
    return [Gaussian(sigma=sigma, l2_sensitivity=1.0), Laplace(scale=200.0, l1_sensitivity=1.0)]


def synthetic_manifest(outcome: str = "published", key: RunKey | None = None, **kw) -> dict:
    """A schema-valid manifest that does not need the mechanisms (release plan stubbed)."""
    spec = load_spec(EXAMPLE_SPEC)
    key = key or run_key(spec.name, 0, spec_hash=spec.spec_hash)
    args = dict(
        run_key=key.to_dict(), spec_document=spec.canonical_document(),
        release_plan={"schema": "stub", "metrics": []}, events=synthetic_events(), accountant="rdp/1",
        outcome=outcome, randomness_mode="keyed", validation={"checks": [{"name": "input_schema", "passed": True}],
                                                              "proceeded": True},
        timings={"started_at": "2024-01-02T00:00:00Z", "steps_seconds": {"compute": 3.4}},
        output={"uri": "file:///out/x", "fingerprints": {"data.parquet": fp("out")}} if outcome == "published" else None,
    )
    args.update(kw)
    return build_manifest(**args)
