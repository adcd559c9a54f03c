"""``dpops manifest``: print the schema, show a manifest, verify a manifest's claim.

``verify`` exits 7 (IntegrityError) on any mismatch and names the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import click

from dpops.cli.common import (
    HelpGroup,
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
from dpops.errors import IntegrityError
from dpops.ledger.budget import format_budget


def _load(run_or_file: str, manifests: str | None, spec: str | None = None) -> tuple[str, dict, str]:
    """A manifest file, or RUN_ID looked up in --manifests / $DPOPS_MANIFESTS_DIR, else in the default
    directory of --spec (``<output.root>/manifests/<release>``, where runs write them): its path, the document
    and the sha256 of the bytes parsed (one read: verify checks the digest of the document it shows)."""
    from dpops.manifest.io import find_manifest, read_manifest_and_digest

    where = manifests
    if where is None and spec is not None:
        from dpops.release import spec_manifests_dir
        from dpops.spec import load_spec

        where = spec_manifests_dir(load_spec(spec))
    path = find_manifest(run_or_file, where)
    m, digest = read_manifest_and_digest(path)
    return str(path), m, digest


def _folder_of(path: str) -> Any:
    """The directory holding a manifest (local path or object-store location): where the manifests of the
    runs it depends on (an estimation) are looked up."""
    from dpops.storage import is_uri
    from dpops.storage.location import Location

    if is_uri(path):
        loc = Location.parse(path)
        return str(loc.local_path.parent) if loc.is_local else loc.parent
    return os.path.dirname(os.path.abspath(path))


def _spec_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--spec", "spec", type=click.Path(dir_okay=False), default=None,
                        help="release spec: look RUN_ID up in its manifests directory (<output.root>/manifests/"
                             "<release>) when neither --manifests nor $DPOPS_MANIFESTS_DIR is given")(fn)


@click.group("manifest", cls=HelpGroup)
def cli() -> None:
    """Run manifests: the reviewer-safe record of each run's privacy claim."""


@cli.command("schema")
def schema_cmd() -> None:
    """Print the JSON Schema (Draft 2020-12) of dpops.manifest/1."""
    from dpops.manifest.schema import manifest_schema

    click.echo(json.dumps(manifest_schema(), indent=2))


@cli.command("keygen")
@click.argument("private_key", type=click.Path(dir_okay=False))
@click.argument("public_key", type=click.Path(dir_okay=False))
def keygen_cmd(private_key: str, public_key: str) -> None:
    """Create an Ed25519 manifest signing key pair (private file mode 0600, never overwritten).

    Runs sign their manifests when $DPOPS_MANIFEST_SIGNING_KEY names PRIVATE_KEY; reviewers check
    them with `dpops manifest verify --public-key PUBLIC_KEY --require-signature`."""
    from dpops.manifest.sign import generate_signing_key

    kid = generate_signing_key(private_key, public_key)
    say(f"wrote signing key {private_key} and public key {public_key} (public key id {kid})")


@cli.command("show")
@click.argument("run_or_file")
@click.option("--manifests", "manifests", envvar="DPOPS_MANIFESTS_DIR", type=click.Path(file_okay=False),
              help="directory to look a run id up in (default: $DPOPS_MANIFESTS_DIR)")
@_spec_option
@click.option("--json", "as_json", is_flag=True, help="print the manifest as JSON")
def show_cmd(run_or_file: str, manifests: str | None, spec: str | None, as_json: bool) -> None:
    """Print a readable summary of a manifest (RUN_ID or FILE)."""
    path, m, _digest = _load(run_or_file, manifests, spec)
    if as_json:
        click.echo(json.dumps(m, indent=2, sort_keys=True))
        return
    import re

    from dpops.cli.common import print_table, terminal_width, wrap_words
    from dpops.ledger.text import printable
    from dpops.manifest.build import sensitivity_not_charged
    from dpops.manifest.scope import GROUPS

    width = terminal_width()

    def show(text: str) -> None:
        # $COLUMNS wide, wrapped at spaces only: a run id, a date or a path longer than the line stays whole
        # (escaped like every table cell: a manifest is read from storage another party may write)
        for line in wrap_words(printable(re.sub(r"\[/?(bold|red)\]", "", text)), width):
            click.echo(line)

    k, p, u, c = m["run_key"], m["privacy"], m["privacy_unit"], m["contribution_bounds"]
    show(f"[bold]{k['release']}[/bold]  [{k['interval_start']}, {k['interval_end']})  run {m['run_id']}")
    show(f"file: {path}")
    show(f"outcome: [bold]{m['outcome']['state']}[/bold] ({_ledger_words(m)})"
                  + (f" - {m['outcome']['reason']}" if m["outcome"]["reason"] else ""))
    if m["restates"]:
        show(f"restates run {m['restates']['run_id']}")
    if m.get("replaces_spent"):
        fresh = m["replaces_spent"]
        # why the interval was charged twice (the spent run's charge stays): issue 28 item 10
        show(f"fresh attempt: replaces the spent_unpublished run {fresh['run_id']} (fresh noise, charged again); "
            f"reason: {fresh.get('reason') or 'none recorded'}")
    show(f"protects: {u['description']} (unit column {u['column']}, adjacency {u['adjacency']}"
                  f"{', record-level' if u['record_level'] else ''})")
    show(f"contribution: at most {c['max_partitions_per_unit']} partitions per unit, "
                  f"{c['max_rows_per_unit_per_partition']} rows per unit per partition; value bounds {m['value_bounds']}")
    for key, own in (c.get("per_metric") or {}).items():
        show(f"  {key}: its own bounds, at most {own['max_partitions_per_unit']} partitions per unit, "
             f"{own['max_rows_per_unit_per_partition']} rows per unit per partition")
    eps = p["run"]["epsilon"]
    show(f"privacy: this run eps={_fmt(eps)} at delta={p['run']['delta']:g} with {m['accountant']['ref']} "
                  f"(requested eps={p['requested']['epsilon']:g}, delta={p['requested']['delta']:g}; "
                  f"charged: {p['run']['charged']})")
    if p["scope"]:
        s = p["scope"]
        for b in s["buckets"]:
            # every group the total composes (dpops.manifest.scope.GROUPS), so the parts account for the total
            parts = ", ".join(f"{g.replace('_', ' ')} {_cap(b[g], s)}" for g in GROUPS if g in b)
            show(f"scope {s['name']} [{b['bucket']}]: cap {s['cap']['unit']}={s['cap']['value']:g}, "
                f"total {_cap(b['total'], s)} composing {parts} (each group alone), remaining "
                f"{_cap(b['remaining'], s)}")
    r = m["randomness"]
    show(f"randomness: {r['mode']} (key id {r['key_id']}){'  [red]TEST MODE[/red]' if r['test_mode'] else ''}")
    rows = []
    for metric in m["release_plan"].get("metrics", []):
        for v in metric.get("vectors") or []:
            rows.append([metric["key"], v["name"], v["mechanism"], _fmt(v["scale"]), _fmt(v["std"]),
                         *(sensitivity_not_charged(v.get(f), v["mechanism"], norm) or _fmt(v.get(f))
                           for f, norm in (("l1_sensitivity_charged", "L1"), ("l2_sensitivity_charged", "L2")))])
        if not metric.get("vectors"):
            rows.append([metric["key"], "-", metric.get("mechanism", "?"),
                         f"eps/run {_fmt(metric.get('epsilon_per_run'))}", "-", "-", "-"])
    print_table("mechanisms", ["metric", "vector", "mechanism", "scale", "std", "L1 charged", "L2 charged"], rows,
                keep=("metric", "vector", "mechanism"))
    if m["validation"]:
        checks = ", ".join(f"{c['name']}:{'ok' if c['passed'] else 'FAILED'}" for c in m["validation"]["checks"])
        show(f"checks: {checks or 'none'}; proceeded: {m['validation']['proceeded']}")
    show(f"code: dpops {m['code']['dpops']} ({m['code']['git_commit'] or 'no git commit'})")


def _ledger_words(m: dict) -> str:
    """The manifest's ledger state, said as what it is: the state when the manifest was written. A publication's
    manifest is written just before its ledger commit, so it says "started" for a run that is committed now;
    "ledger: started" beside "published" read as a run published but never committed (issue 28 item 14)."""
    st = m["outcome"]["ledger_state"]
    if st is None:
        return "no ledger entry: nothing was charged" if m["outcome"]["state"] == "refused" else "no ledger state"
    if m["outcome"]["state"] == "published" and st == "started":
        return ("ledger state when the manifest was written: started; the ledger commit follows the manifest, "
                "dpops release status or manifest verify --ledger shows it now")
    return f"ledger state when the manifest was written: {st}"


def _cap(x, scope: dict) -> str:
    """A scope figure at its cap's precision (``format_budget``)."""
    return format_budget(x, scope["cap"]["value"]) if isinstance(x, (float, int)) or x is None else str(x)


def _fmt(x) -> str:
    if isinstance(x, (float, int)) and not isinstance(x, bool) or x is None:
        return format_budget(x)  # one formatting owner for figures (dpops.ledger.budget)
    return str(x)


@cli.command("verify")
@click.argument("run_or_file")
@ledger_option
@click.option("--manifests", "manifests", envvar="DPOPS_MANIFESTS_DIR", type=click.Path(file_okay=False),
              help="directory to look a run id up in (default: $DPOPS_MANIFESTS_DIR)")
@_spec_option
@click.option("--public-key", "public_key", envvar="DPOPS_MANIFEST_PUBLIC_KEY",
              type=click.Path(dir_okay=False, exists=True),
              help="Ed25519 public key (PEM; default $DPOPS_MANIFEST_PUBLIC_KEY): the manifest must carry a valid "
                   "signature by it")
@click.option("--require-signature", is_flag=True,
              help="fail unless the manifest carries a valid signature by --public-key")
@key_file_option("also check the published files' keyed fingerprints (without a key that check is listed as "
                 "skipped and only the ledger's file digests are compared, when a ledger is given)")
@previous_keys_option
@json_option
def verify_cmd(run_or_file: str, manifests: str | None, spec: str | None, public_key: str | None,
               require_signature: bool, key_file: str | None, previous_key_files: tuple[str, ...],
               as_json: bool) -> None:
    """Recompute a manifest's claim (RUN_ID or FILE); exit 7 naming the field on any mismatch.

    Checks that could not run are listed as "skip" with the reason: a manifest is fully verified
    only when the ledger, the published files and (if signed) the signature were checked."""
    from dpops.manifest.verify import verify_manifest

    path, m, digest = _load(run_or_file, manifests, spec)
    key = load_keys(key_file, previous_key_files)
    ledger = None
    url = ledger_url(required=False)  # optional: with a ledger the scope total is recomputed too
    if url:
        from dpops.ledger import open_ledger

        ledger = open_ledger(url)
    try:
        result = verify_manifest(m, ledger=ledger, public_key=public_key, source=path,
                                 file_name=os.path.basename(path), file_digest=digest,
                                 require_signature=require_signature, key=key,
                                 manifests_dir=_folder_of(path))
    finally:
        if ledger is not None:
            ledger.close()
    skipped = [c.name for c in result.checks if c.skipped]
    if as_json:
        if result.ok:
            echo_ok(result.to_dict())
    else:
        for c in result.checks:
            mark = "skip" if c.skipped else ("ok" if c.ok else "FAIL")
            say(f"{mark:4}  {c.name}" + (f"  ({c.skipped})" if c.skipped else "")
                       + (f"  ({c.note})" if c.note else ""))
            for p in c.problems:
                say(f"      {p}")
    if not result.ok:
        raise attach(IntegrityError(f"{path}: verification failed: {len(result.problems)} problem(s); first: "
                                    f"{result.problems[0]}"), result.to_dict())
    if not as_json:
        say(f"verified: run {result.run_id}" + (f" (not checked: {', '.join(skipped)})" if skipped else ""))
