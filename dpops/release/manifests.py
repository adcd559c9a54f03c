"""Where a release's manifests live, and writing a published run's manifest.

The manifest of a published run is written BEFORE anything becomes visible (semantics.md section
5): it fingerprints the staged files, and the published copies are verified byte-identical. The
fingerprints are keyed (HMAC with the noise key): a plain hash would let a manifest reader confirm
guesses about the output. A retry finds the existing manifest and writes nothing new.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dpops.release.context import RunContext, RunOutcome
from dpops.spec import ReleaseSpec
from dpops.storage import PUBLISHED_FILES, Location, as_location, files, is_uri

if TYPE_CHECKING:
    from dpops.ledger import Ledger


def manifests_dir(ctx: RunContext) -> Path | Location:
    """``$DPOPS_MANIFESTS_DIR`` or ``<output root>/manifests/<release>`` (the DAG uses the same rule)."""
    return spec_manifests_dir(ctx.spec)


def spec_manifests_dir(spec: ReleaseSpec) -> Path | Location:
    """A local ``Path``, or a ``Location`` under an object-store output root (or a URI in the env var)."""
    env = os.environ.get("DPOPS_MANIFESTS_DIR")
    if env:
        return Location.parse(env) if is_uri(env) else Path(env)
    root = spec.output_root
    if root.is_local:
        return root.local_path / "manifests" / spec.name
    return root.join("manifests", spec.name)


def output_fingerprints(ctx: RunContext, directory: Path | Location) -> dict[str, str]:
    """Keyed fingerprints of the published files (a plain hash would let a manifest reader confirm guesses)."""
    out: dict[str, str] = {}
    loc = as_location(directory)
    if ctx.fingerprint_key is None or not files.exists(loc):
        return out
    for name in PUBLISHED_FILES:
        f = loc / name
        if files.is_file(f):
            data = files.read_bytes(f)
            assert data is not None
            out[name] = "hmac-sha256:" + ctx.fingerprint_key.hmac(data).hex()
    return out


def write_manifest_before_publish(ctx: RunContext, ledger: Ledger, output_uri: str, staged_dir: Path | Location,
                                  checks: Sequence[str] = ()) -> str | None:
    """Write the published run's manifest from its staged files; a retry finds the existing one."""
    if not ctx.write_manifest:
        return None
    folder = manifests_dir(ctx)
    from dpops.manifest.io import manifest_exists

    existing = manifest_exists(folder, f"{ctx.run_id}.published.json")
    if existing is not None:
        return existing
    from dpops.manifest.run_hook import write_run_manifest

    validation = {"checks": [{"name": c, "passed": True} for c in checks], "proceeded": True} if checks else None
    return write_run_manifest(
        ctx, ledger, {"state": "published", "output_uri": output_uri}, manifests_dir=folder,
        validation=validation, output_fingerprints=output_fingerprints(ctx, staged_dir),
    )


def ensure_manifest(ctx: RunContext, ledger: Ledger, outcome: RunOutcome, checks: Sequence[str] = ()) -> str | None:
    """Write the run's manifest once (a retry finds the existing one). Only for published runs."""
    if outcome.state not in ("published", "already_published") or outcome.run_id != ctx.run_id:
        return None
    folder = manifests_dir(ctx)
    from dpops.manifest.io import manifest_exists

    existing = manifest_exists(folder, f"{ctx.run_id}.published.json")
    if existing is not None:
        return existing
    from dpops.manifest.run_hook import write_run_manifest

    published = ctx.store.current(ctx.interval.slug)
    directory = next((v.location for v in ctx.store.versions(ctx.interval.slug) if v.run_id == ctx.run_id),
                     published.location if published else None)
    validation = {"checks": [{"name": c, "passed": True} for c in checks], "proceeded": True} if checks else None
    return write_run_manifest(
        ctx, ledger, {"state": "published", "output_uri": outcome.output_uri}, manifests_dir=folder,
        validation=validation, output_fingerprints=output_fingerprints(ctx, directory) if directory else {},
    )
