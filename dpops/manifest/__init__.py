"""Versioned run manifests: build, write/read (validated, atomic, immutable), sign, verify.

Public API::

    build_manifest(...) -> dict                 # dpops.manifest.build
    write_manifest(manifest, directory) -> str  # validate + atomic write; never overwrites
    read_manifest(path) -> dict                 # upgrade to the current version + validate
    sign_manifest(manifest, private_key_path) -> dict
    verify_signature(manifest, public_key_path) -> str
    verify_manifest(manifest, ledger=None, public_key=None) -> VerificationResult
    write_run_manifest(ctx, ledger, outcome, *, manifests_dir, ...) -> str   # the run orchestration's hook
    manifest_schema() -> dict; SCHEMA_VERSION
"""

from dpops.manifest.build import build_manifest, code_version
from dpops.manifest.io import find_manifest, manifest_filename, read_manifest, write_manifest
from dpops.manifest.run_hook import write_run_manifest
from dpops.manifest.schema import SCHEMA_VERSION, manifest_schema, upgrade
from dpops.manifest.scope import scope_position
from dpops.manifest.sign import sign_manifest, verify_signature
from dpops.manifest.verify import VerificationResult, verify_manifest

__all__ = [
    "SCHEMA_VERSION", "VerificationResult", "build_manifest", "code_version", "find_manifest", "manifest_filename",
    "manifest_schema", "read_manifest", "scope_position", "sign_manifest", "upgrade", "verify_manifest",
    "verify_signature", "write_manifest", "write_run_manifest",
]
