"""``dpops report``: the reviewer's self-contained HTML report of one budget scope."""

from __future__ import annotations

import os

import click

from dpops.cli.common import (
    attach,
    echo_ok,
    json_option,
    key_file_option,
    ledger_option,
    ledger_url,
    load_keys,
    previous_keys_option,
    say,
)


@click.command("report")
@click.option("--scope", required=True, help="budget scope name")
@click.option("--from", "start", default=None, help="only runs whose interval starts at or after this (ISO-8601)")
@click.option("--to", "end", default=None, help="only runs whose interval ends at or before this (ISO-8601)")
@click.option("--spec", "specs", multiple=True, type=click.Path(dir_okay=False),
              help="release spec whose backfill gaps to list (repeatable; see dpops gaps)")
@ledger_option
@json_option
@click.option("--manifests", "manifests", envvar="DPOPS_MANIFESTS_DIR", type=str, metavar="DIR|URI",
              default=None, help="directory or object-store prefix (s3://bucket/manifests) holding the run manifests "
                                 "(refusals are known only from these)")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="HTML file to write")
@key_file_option("also check the published files' keyed fingerprints (without a key the manifests are "
                 "'verified (partly)')")
@previous_keys_option
@click.option("--public-key", "public_key", envvar="DPOPS_MANIFEST_PUBLIC_KEY",
              type=click.Path(dir_okay=False, exists=True), default=None,
              help="Ed25519 public key (PEM): check the manifests' signatures (default $DPOPS_MANIFEST_PUBLIC_KEY)")
@click.option("--gx-project", "gx_project", envvar="DPOPS_GX_PROJECT", type=click.Path(file_okay=False), default=None,
              help="the deployment's GX project: link its Data Docs (default $DPOPS_GX_PROJECT)")
def cli(scope: str, start: str | None, end: str | None, specs: tuple[str, ...], manifests: str | None, out: str,
        key_file: str | None, previous_key_files: tuple[str, ...], public_key: str | None, gx_project: str | None,
        as_json: bool) -> None:
    """Write one self-contained HTML report (no network) for a budget scope.

    Every manifest is verified against the ledger first; one that fails is shown as FAILED and its
    numbers are not used."""
    from dpops.ledger import open_ledger

    key = load_keys(key_file, previous_key_files)  # with previous keys: every rotation's files are checked
    from dpops.errors import IntegrityError
    from dpops.report import build_report, write_html

    ledger = open_ledger(ledger_url())
    try:
        text, data = build_report(ledger, scope, out, manifests_dir=manifests, start=start, end=end, key=key,
                                  public_key=public_key, gx_project=gx_project, specs=specs)
        path = write_html(text, out)
    finally:
        ledger.close()
    failed = [c for c in data.checks.values() if not c.ok]
    ledger_ok = data.provenance.get("ledger_verify", {}).get("ok", False)
    doc = {"report": path, "scope": scope, "manifests_failed": [c.path for c in failed], "ledger_verified": ledger_ok,
           "gaps": data.backfill_gaps, "warnings": data.warnings}
    if not as_json:
        say(f"report written: {path}")
    elif not failed and ledger_ok:
        echo_ok(doc)
    if failed or not ledger_ok:
        # The report is written (it shows what failed); the exit status tells automation it is not clean.
        raise attach(IntegrityError(
            f"{path}: " + ("the ledger's hash chain does not verify; " if not ledger_ok else "")
            + (f"{len(failed)} manifest(s) failed verification, first {os.path.basename(failed[0].path)}: "
               f"{(failed[0].problems or ['?'])[0]}" if failed else "").rstrip("; ")), doc)
