"""``dpops release run|restate|status``: run one release over one data interval.

Exit codes: 0 ok, 3 invalid spec or parameter, 4 invalid input, 5 budget refused,
6 ledger or storage problem, 7 noisy output failed its checks, 1 internal error.
"""

from __future__ import annotations

import functools
import os
import traceback
from typing import Any, Callable

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
from dpops.errors import DEBUG_ENV, DpopsError, public_message


def _internal_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Unexpected exceptions become one 'internal error' line (exit 1) instead of a bare traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DpopsError as exc:
            failed = getattr(exc, "dpops_outcome", None)  # the run's refused/failed outcome (dpops.release)
            if failed is not None and not getattr(exc, "json_payload", None):
                attach(exc, scope_figures_json(failed.as_dict()))
            raise
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # noqa: BLE001
            last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f" at {last.filename}:{last.lineno}" if last else ""
            if os.environ.get(DEBUG_ENV):
                raise
            # Only the class and the code location: the text may quote input data (dpops.errors).
            raise DpopsError(f"internal error (a bug, please report it): {public_message(exc)}{where}") from None

    return wrapper


def _common(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = json_option(fn)
    fn = ledger_option(fn)
    fn = click.option("--interval", required=True,
                      help="data interval START/END, ISO-8601 UTC, e.g. 2024-01-01/2024-01-02; or one START "
                           "(e.g. 2024-01-03) for the one period / schedule interval of the spec starting there")(fn)
    fn = click.argument("spec", type=click.Path(dir_okay=False))(fn)
    return fn


def parse_interval_option(spec_path: str, text: str) -> Any:
    """``--interval``: START/END as given, or one START expanded to the spec's period starting there."""
    from dpops.release.preparation import requested_interval

    return requested_interval(spec_path, text)


def _compute_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--estimation-staging", "estimation_staging", default=None, envvar="DPOPS_ESTIMATION_STAGING",
                      help="a spec with bounds: estimate: estimate on --runner's workers, with their scratch files and "
                           "exact counts under this private location (a local directory or s3:// prefix both this "
                           "process and the workers reach, apart from every data, public and output root); unset: "
                           "the estimation reads in this process [env DPOPS_ESTIMATION_STAGING]")(fn)
    fn = click.option("--runner", default="FnApiRunner", show_default=True, help="Beam runner")(fn)
    fn = click.option("--runner-option", "runner_options", multiple=True,
                      help="extra Beam pipeline option, repeatable (logged: never a secret)")(fn)
    fn = click.option("--randomness", type=click.Choice(["keyed", "os"]), default="keyed", show_default=True,
                      help="keyed: reproducible noise, free retries; os: fresh noise, a lost run costs a new charge")(fn)
    fn = key_file_option("keys the noise and the input's fingerprint")(fn)
    fn = click.option("--gx-checks/--no-gx-checks", default=True, show_default=True,
                      help="also run the Great Expectations checks on the noisy output before publishing")(fn)
    return fn


def scope_figures_json(doc: dict[str, Any]) -> dict[str, Any]:
    """An outcome's or a status's budget figures as its line shows them (``dpops.ledger.budget.budget_json``: the
    scope's at its cap's precision, remaining exactly 0 at the cap; a run's own ε alone), exact under ``exact``."""
    from dpops.ledger.budget import budget_json

    cap = doc.get("scope_cap")
    scale = float(cap) if isinstance(cap, (int, float)) else None
    out = budget_json(doc, {"epsilon_charged": None, "run_epsilon": None, "scope_remaining": scale,
                            "scope_total": scale, "scope_cap": None})
    if isinstance(out.get("runs"), list):
        out["runs"] = [budget_json(r, {"epsilon": scale}) if isinstance(r, dict) else r for r in out["runs"]]
    return out


def _emit(outcome: Any, as_json: bool) -> None:
    if as_json:
        echo_ok(scope_figures_json(outcome.as_dict()))
    else:
        say(outcome.line())


@click.group("release", cls=HelpGroup)
def cli() -> None:
    """Run, restate and inspect releases (one spec, one data interval)."""


@cli.command("run")
@_common
@_compute_options
@click.option("--publish", "publish_output", is_flag=True,
              help="publish the noisy output and commit the run (without it: compute and stage only)")
@click.option("--progress/--no-progress", "show_progress", default=True, show_default=True,
              help="show each stage on stderr (a spinner on a terminal, one line per stage otherwise)")
@click.option("--fresh-attempt", "fresh_attempt", is_flag=True,
              help="the interval's run is spent_unpublished (e.g. after dpops ledger recover): start a fresh attempt "
                   "with fresh noise, charged AGAIN, linked to the spent run in the ledger, manifest and report "
                   "(needs --reason)")
@click.option("--reason", default=None, help="why a fresh attempt is made (recorded in the ledger and the manifest)")
@previous_keys_option
@_internal_errors
def run_cmd(spec: str, interval: str, as_json: bool, runner: str, runner_options: tuple,
            estimation_staging: str | None, randomness: str, key_file: str | None, gx_checks: bool,
            publish_output: bool, show_progress: bool, fresh_attempt: bool, reason: str | None,
            previous_key_files: tuple[str, ...]) -> None:
    """Reserve budget, compute and (with --publish) publish SPEC over --interval.

    Safe to repeat: a published interval is served without a charge; a retry reuses the reservation
    (keyed randomness reproduces the same noise). A spent_unpublished run is never recomputed: only
    --fresh-attempt --reason "..." publishes that interval, at a second charge."""
    if fresh_attempt and not (reason or "").strip():
        raise click.UsageError("--fresh-attempt needs --reason \"...\" (recorded in the ledger and the manifest)")
    if reason is not None and not fresh_attempt:
        raise click.UsageError("--reason is only used with --fresh-attempt")
    from dpops import release
    from dpops.cli.progress import stage_progress
    iv = parse_interval_option(spec, interval)
    url = ledger_url()
    with stage_progress(show_progress) as progress, release.open_run_ledger(url) as ledger:
        outcome = release.execute_release(spec, iv.start, iv.end, ledger=ledger, randomness=randomness,
                                       key_path=key_file, runner=runner, runner_options=runner_options,
                                       publish_output=publish_output, gx_checks=gx_checks, actor=None,
                                       progress=progress, fresh_attempt=reason.strip() if fresh_attempt and reason
                                       else None, previous_key_paths=previous_key_files,
                                       estimation_staging=estimation_staging)
    _emit(outcome, as_json)


@cli.command("restate")
@_common
@_compute_options
@click.option("--progress/--no-progress", "show_progress", default=True, show_default=True,
              help="show each stage on stderr")
@_internal_errors
def restate_cmd(spec: str, interval: str, as_json: bool, runner: str, runner_options: tuple,
                estimation_staging: str | None, randomness: str, key_file: str | None, gx_checks: bool,
                show_progress: bool) -> None:
    """Publish a corrected input of an already published interval as a new version (a fresh charge,
    linked to the run it corrects; the old version is kept)."""
    from dpops import release
    from dpops.cli.progress import stage_progress
    iv = parse_interval_option(spec, interval)
    url = ledger_url()
    with stage_progress(show_progress) as progress, release.open_run_ledger(url) as ledger:
        outcome = release.execute_restatement(spec, iv.start, iv.end, ledger=ledger, randomness=randomness,
                                           key_path=key_file, runner=runner, runner_options=runner_options,
                                           gx_checks=gx_checks, progress=progress,
                                           estimation_staging=estimation_staging)
    _emit(outcome, as_json)


@cli.command("status")
@_common
@_internal_errors
@key_file_option("also check the published files against the manifest's keyed fingerprints (without a key that "
                 "part is listed as skipped)")
@previous_keys_option
def status_cmd(spec: str, interval: str, as_json: bool, key_file: str | None,
               previous_key_files: tuple[str, ...]) -> None:
    """What the ledger and the published outputs say about SPEC's --interval (reads no private data).

    Exits 7 naming the file when a published file no longer matches what was published."""
    from dpops import release
    from dpops.errors import IntegrityError
    iv = parse_interval_option(spec, interval)
    key = load_keys(key_file, previous_key_files)
    with release.open_run_ledger(ledger_url()) as ledger:
        st = release.status(spec, iv.start, iv.end, ledger=ledger, key=key)
        st.update(_position(ledger, st))
    files = st.get("published_files")
    if files and files["problems"]:
        if not as_json:
            _print_status(st)
        raise attach(IntegrityError(f"{st['release']} {st['interval']}: the published output changed after "
                                    "publication: " + "; ".join(files["problems"])), st)
    if as_json:
        echo_ok(scope_figures_json(st))
    else:
        _print_status(st)


@cli.command("check-pointer")
@click.option("--root", "root", required=True, help="the release's output root (a local path or s3://...)")
@click.option("--release", "release_name", required=True, help="the release name (the spec's name)")
@click.option("--interval", required=True, help="data interval START/END, ISO-8601 UTC, e.g. 2024-01-01/2024-01-02")
@click.option("--public-key", "public_key", envvar="DPOPS_MANIFEST_PUBLIC_KEY",
              type=click.Path(dir_okay=False, exists=True), default=None,
              help="the publisher's Ed25519 public key (PEM; default $DPOPS_MANIFEST_PUBLIC_KEY): the reader's check")
@click.option("--key-file", "key_file", type=click.Path(dir_okay=False), default=None,
              help="the noise key file instead (operators and reviewers only; readers never hold it)")
@click.option("--ledger-id", "ledger_id", envvar="DPOPS_LEDGER_ID", default=None,
              help="the publishing deployment's ledger id (default $DPOPS_LEDGER_ID; the ledger_id field of "
                   "dpops release status --json): versions bound to another ledger are refused")
@json_option
@_internal_errors
def check_pointer_cmd(root: str, release_name: str, interval: str, public_key: str | None, key_file: str | None,
                      ledger_id: str | None, as_json: bool) -> None:
    """A reader's check, without the ledger: does ROOT's ``current`` for --interval name a version dpops published?

    The version's ``_PUBLISHED.json`` binding (release, interval, version, run id, ledger entry, file
    sha256, output root, ledger id) must verify under --public-key (the signature) or --key-file (the keyed
    MAC), name ROOT (and --ledger-id when given), its files must match, and no newer version may exist,
    valid or damaged. Exits 7 naming the version otherwise."""
    from dpops.errors import IntegrityError
    from dpops.inputs import parse_interval
    from dpops.storage import open_store
    from dpops.storage.published import check_published

    iv = parse_interval(interval)
    key = None
    if key_file:
        from dpops.keyref import resolve_key

        key = resolve_key(key_file)
    store = open_store(root, release_name)
    res = check_published(store, iv.slug, committed=None, key=key, public_key=public_key, ledger_id=ledger_id or None)
    doc = {"release": release_name, "interval": str(iv), "problems": res.problems, "checked": res.checked,
           "not_checked": res.not_checked,
           "current": None if res.current is None else {"version": res.current.version, "run_id": res.current.run_id,
                                                        "uri": res.current.uri}}
    if res.problems:
        if not as_json:
            for p in res.problems:
                say(f"  {p}")
        raise attach(IntegrityError(f"{release_name} {iv}: the current pointer does not name a version dpops "
                                    "published: " + "; ".join(res.problems)), doc)
    if as_json:
        echo_ok(doc)
    else:
        assert res.current is not None
        say(f"current: v{res.current.version} (run {res.current.run_id}) at {res.current.uri}: "
                   f"binding verified ({', '.join(res.checked)})")
        for p in res.not_checked:
            say(f"  not checked: {p}")


@cli.command("check-staged-access")
@click.option("--root", "root", required=True, help="the output root (a local path or s3://...)")
@json_option
@_internal_errors
def check_staged_access_cmd(root: str, as_json: bool) -> None:
    """Can whoever runs this reach ROOT's ``staged/`` (unreleased noisy output)? Run it AS A READER.

    Local roots: every directory under staged/ must be 0700. s3:// roots: with the reader's credentials
    (e.g. AWS_PROFILE=reader) listing staged/ and reading an object there must be denied by the bucket
    policy (deploy/s3-bucket-policy.json). Exits 7 naming what a reader could reach."""
    from dpops.errors import IntegrityError
    from dpops.storage import as_location
    from dpops.storage.access import check_staged_access

    problems = check_staged_access(as_location(root))
    doc = {"root": root, "problems": problems}
    if problems:
        if not as_json:
            for p in problems:
                say(f"  {p}")
        raise attach(IntegrityError(f"{root}: staged/ is reachable: " + "; ".join(problems)), doc)
    if as_json:
        echo_ok(doc)
    else:
        say(f"{root}: staged/ is closed to these credentials")


def _position(ledger: Any, st: dict) -> dict:
    """The scope's composed total, cap and accountant, beside each run's own ε (issue 12)."""
    from dpops.release import scope_position

    pos = scope_position(ledger, st["scope"])
    pos.pop("scope_remaining", None)
    return pos


def _print_status(st: dict) -> None:
    """``release status`` for people: the scope line wrapped at words, then the versions and the runs as tables that
    fit 80 columns (whole run ids, times and URIs; restatements and the output URI on their own line)."""
    from dpops.cli.common import print_table, terminal_width, wrap_words
    from dpops.ledger.budget import format_budget

    width = terminal_width()
    files = st.get("published_files")
    cap_value = st.get("scope_cap")
    u = "ρ" if st.get("budget_unit") == "rho" else "ε"
    rem = "?" if st["scope_remaining"] is None else format_budget(st["scope_remaining"], cap_value)
    total = "?" if st.get("scope_total") is None else format_budget(st["scope_total"], cap_value)
    cap = "?" if cap_value is None else format_budget(cap_value)
    lines = wrap_words(f"release={st['release']} interval={st['interval']} scope={st['scope']} remaining={rem}: "
                       f"scope total {u}={total} of cap {cap} ({st.get('accountant') or '?'} accountant, all runs "
                       "composed)", width)
    lines += wrap_words(f"published run: {st['published_run'] or '-'}", width)
    if st["output_uri"]:
        lines += wrap_words(f"output: {st['output_uri']}", width)
    click.echo("\n".join(lines))
    if st["versions"]:
        print_table("published versions", ["version", "run", "published at", "restates"],
                    [[f"v{v['version']}", v["run_id"], v["published_at"], v["restates"] or ""] for v in st["versions"]],
                    keep=("version", "run", "published at"), below=("restates",))
    if st["runs"]:
        print_table(f"ledger runs of this interval ({u}: the run alone)", ["run", "state", u, "key", "restates"],
                    [[r["run_id"], r["state"].replace("_", " "), format_budget(r["epsilon"], cap_value), r["key_id"],
                      r["restates"] or ""] for r in st["runs"]],
                    keep=("run", u, "key"), below=("restates",), right=(u,))
    if files:
        # ok only when every check ran: a part that could not (e.g. no noise key) is named as skipped
        verdict = ("CHANGED" if files["problems"] else "NOT CHECKED" if not files["checked"] else
                   "partly checked" if files["not_checked"] else "ok")
        out = wrap_words(f"published files: {verdict}" + (f" ({', '.join(files['checked'])} checked)"
                                                          if files["checked"] else ""), width)
        for p in files["problems"]:
            out += ["  " + x for x in wrap_words(p, width - 2)]
        for p in files["not_checked"]:
            out += ["  " + x for x in wrap_words(f"skipped: {p}", width - 2)]
        click.echo("\n".join(out))


@cli.command("abandon")
@_common
@key_file_option("identifies the run (the input fingerprint is keyed)")
@click.option("--randomness", type=click.Choice(["keyed", "os"]), default="keyed", show_default=True)
@click.option("--reason", required=True, help="why the run is given up (recorded in the ledger)")
@_internal_errors
def abandon_cmd(spec: str, interval: str, as_json: bool, key_file: str | None,
                randomness: str, reason: str) -> None:
    """Give up the unpublished run of SPEC over --interval: refund it if no noise was drawn yet, else mark
    it spent_unpublished (the charge stays)."""
    from dpops import release
    iv = parse_interval_option(spec, interval)
    with release.open_run_ledger(ledger_url()) as ledger:
        ctx = release.prepare(spec, iv.start, iv.end, randomness=randomness, key_path=key_file, ledger=ledger,
                              estimation="serve")  # abandoning never charges an estimation
        outcome = release.abandon(ctx, ledger, reason=reason)
    _emit(outcome, as_json)
