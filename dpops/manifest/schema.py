"""The manifest's JSON Schema (shipped as ``dpops/schemas/manifest-v1.json``) and the version upgrade path.

Readers know exactly one current version. An older document is brought up to it
by a chain of pure functions ``upgrade_vN_to_vN+1`` registered in ``UPGRADES``
(none yet: v1 is the first). A document from a *newer* dpops is refused, never
guessed at: a reviewer must not see a claim this code cannot recompute.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator

from dpops.errors import IntegrityError

SCHEMA_VERSION = "dpops.manifest/1"
SCHEMA_RESOURCE = "manifest-v1.json"

# version string -> (next version string, pure function old-doc -> new-doc).
# A v2 adds e.g. UPGRADES["dpops.manifest/1"] = ("dpops.manifest/2", upgrade_v1_to_v2).
UPGRADES: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {}


@lru_cache(maxsize=1)
def manifest_schema() -> dict[str, Any]:
    """The v1 JSON Schema as a dict (the file shipped inside the package as package data)."""
    text = resources.files("dpops").joinpath("schemas", SCHEMA_RESOURCE).read_text(encoding="utf-8")
    return json.loads(text)


@lru_cache(maxsize=1)
def manifest_validator() -> Draft202012Validator:
    """The v1 schema's validator, built once per process (checking the schema itself costs ~0.1 s: the release
    builds it while another thread hashes its input, ``dpops.release.execute``)."""
    schema = manifest_schema()
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _path(error: Any) -> str:
    parts: list[str] = []
    for p in error.absolute_path:
        parts.append(f"[{p}]" if isinstance(p, int) else ("." if parts else "") + str(p))
    return "".join(parts) or "<document>"


def schema_problems(doc: Any) -> list[str]:
    """Every schema violation as ``field.path: message`` (sorted by path, so messages are stable)."""
    out = []
    errors = manifest_validator().iter_errors(doc)
    for err in sorted(errors, key=lambda e: (list(map(str, e.absolute_path)), e.message)):
        msg = err.message
        if err.validator == "additionalProperties":
            msg = (f"{msg} (a v1 manifest may not carry extra fields: statistics about the input belong to "
                   "the internal run log)")
        elif err.validator == "required":
            msg = f"required field missing: {msg}"
        out.append(f"{_path(err)}: {msg}")
    return out


def check_manifest(doc: Any, *, source: str = "manifest", error: type[Exception] = IntegrityError) -> dict[str, Any]:
    """Validate against the v1 schema; raise ``error`` listing each bad field, else return the document."""
    if not isinstance(doc, dict):
        raise error(f"{source}: a manifest must be a JSON object, got {type(doc).__name__}")
    problems = schema_problems(doc)
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise error(f"{source}: not a valid {SCHEMA_VERSION} manifest:\n  " + "\n  ".join(shown) + more)
    return doc


def upgrade(doc: dict[str, Any], *, source: str = "manifest") -> dict[str, Any]:
    """Bring a manifest of any known older version up to ``SCHEMA_VERSION``; refuse unknown versions."""
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    seen = set()
    while version != SCHEMA_VERSION:
        if version not in UPGRADES or version in seen:
            raise IntegrityError(
                f"{source}: schema_version {version!r} is not readable by this dpops (it reads {SCHEMA_VERSION!r}"
                + (f" and upgrades {sorted(UPGRADES)}" if UPGRADES else "")
                + "); use the dpops version that wrote it, or a newer dpops"
            )
        seen.add(version)
        version, step = UPGRADES[version]
        doc = step(doc)
    return doc
