"""What every ``dpops`` command shares: where the ledger is, how ``--json`` reports, how tables fit.

``--ledger URL`` is accepted at every level (``dpops --ledger U ledger status X``,
``dpops ledger --ledger U status X``, ``dpops ledger status X --ledger U``); all spellings land in
one place (``click.Context.meta``, shared by a command and its parent groups), and
``DPOPS_LEDGER_URL`` is the fallback. Two different URLs in one command line are a usage error:
the operator meant one ledger, and guessing which would charge the wrong one.

There is no default ledger file: a command that needs a ledger and has no URL fails (exit 2), and
a ``sqlite:///`` URL naming a file that does not exist is refused (exit 6) except by the commands
that create a ledger on purpose (``ledger init`` and ``ledger scope create``). A read such as
``ledger verify`` against a mistyped path used to create an empty database and report "OK: 0
entries", which a reviewer could take as a verified, empty budget history.

``--json``: every reporting command prints exactly one JSON object on stdout with ``ok`` and
``exit_code``; an error adds ``error`` (or ``refusal`` for a budget refusal, exit 5) and whatever
the command had gathered (``dpops.cli.main`` prints it; a command attaches it with ``attach``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import click

from dpops.errors import LedgerError

LEDGER_ENV = "DPOPS_LEDGER_URL"
KEY_FILE_ENV = "DPOPS_NOISE_KEY_FILE"
LEDGER_META = "dpops.ledger_url"
JSON_PRINTED = "dpops.json_printed"
LEDGER_HELP = ("ledger URL: sqlite:///path.sqlite or postgresql://user@host:port/db (default $DPOPS_LEDGER_URL; "
               "also accepted before the command: dpops --ledger URL ...)")

# Commands whose purpose is to create a ledger: only they may open a SQLite file that does not exist.
CREATING_COMMANDS = ("ledger init", "ledger scope create")

_state: dict[str, bool] = {"json_printed": False}


def _store_ledger(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    prev = ctx.meta.get(LEDGER_META)
    if prev is not None and prev != value:
        raise click.UsageError("--ledger was given twice with different URLs; give one ledger")
    ctx.meta[LEDGER_META] = value
    return value


def ledger_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--ledger URL`` on a command or group; read it back with ``ledger_url(ctx)``."""
    return click.option("--ledger", "ledger_opt", default=None, metavar="URL", expose_value=False,
                        callback=_store_ledger, is_eager=True, help=LEDGER_HELP)(fn)


def key_file_option(purpose: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--key-file PATH``, default ``$DPOPS_NOISE_KEY_FILE``: the ONE way every command finds the noise key, so
    a command that only checks (``manifest verify``, ``release status``, ``report``) sees the key that
    ``release run`` used. ``purpose`` says what the command does with it."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        return click.option("--key-file", "key_file", envvar=KEY_FILE_ENV, type=click.Path(dir_okay=False),
                            default=None, help=f"noise key file, mode 0600 (default ${KEY_FILE_ENV}): {purpose}")(fn)
    return deco


def load_key(key_file: str | None) -> Any:
    """The ``NoiseKey`` of ``--key-file`` (or ``$DPOPS_NOISE_KEY_FILE``), or None when neither is given."""
    if not key_file:
        return None
    from dpops.randomness import NoiseKey

    return NoiseKey.from_file(key_file)


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True,
                        help="print one JSON object (with ok and exit_code) on stdout, also on errors")(fn)


def ledger_url(ctx: click.Context | None = None, *, required: bool = True, create: bool = False) -> str | None:
    """The ledger URL of this command line (any level), else ``$DPOPS_LEDGER_URL``.

    ``required``: no URL is a usage error (no silent default file). ``create``: a SQLite file that
    does not exist yet may be created; otherwise it is refused, naming ``dpops ledger init``."""
    ctx = ctx or click.get_current_context(silent=True)
    url = (ctx.meta.get(LEDGER_META) if ctx is not None else None) or os.environ.get(LEDGER_ENV) or None
    if url is None:
        if required:
            raise click.UsageError(f"no ledger given: pass --ledger URL or set {LEDGER_ENV} (e.g. "
                                   "sqlite:////var/lib/dpops/ledger.sqlite); dpops never picks a default file")
        return None
    if not create:
        refuse_missing_sqlite(url)
    return url


def sqlite_path(url: str) -> str | None:
    """The file of a ``sqlite:///`` URL (None for other schemes or a malformed URL: the backend reports those)."""
    if not url.lower().startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):].partition("?")[0]
    return path or None


def refuse_missing_sqlite(url: str) -> None:
    path = sqlite_path(url)
    if path is not None and not os.path.exists(path):
        from dpops.ledger.backend import redact

        raise LedgerError(f"no ledger database at {path} (from --ledger or {LEDGER_ENV}): check the URL, or create "
                          f"the ledger with: dpops ledger init --ledger {redact(url)}; nothing was created")


def open_cli_ledger(ctx: click.Context | None = None, *, create: bool = False) -> Any:
    from dpops.ledger import open_ledger

    return open_ledger(ledger_url(ctx, create=create))


# --------------------------------------------------------------------------- JSON


def finite(obj: Any) -> Any:
    """JSON-safe: infinities and NaN become null (strict JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(finite(obj), indent=2, sort_keys=True, allow_nan=False, default=str)


def mark_json_printed() -> None:
    """A command printed its own JSON object; an error after it must not print a second one."""
    _state["json_printed"] = True


def json_printed() -> bool:
    return _state["json_printed"]


def reset() -> None:
    _state["json_printed"] = False


def echo_ok(doc: dict[str, Any]) -> None:
    """The success object: ``doc`` plus ``ok: true, exit_code: 0``."""
    click.echo(dumps({**doc, "ok": True, "exit_code": 0}))
    mark_json_printed()


def attach(exc: BaseException, payload: dict[str, Any]) -> BaseException:
    """Keep what a failing command gathered, for its ``--json`` error object."""
    try:
        exc.json_payload = payload  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - exceptions with __slots__
        pass
    return exc


def error_object(exc: BaseException, exit_code: int, message: str) -> dict[str, Any]:
    from dpops.errors import BudgetExceeded

    doc = dict(getattr(exc, "json_payload", None) or {})
    doc.update({"ok": False, "exit_code": exit_code})
    doc["refusal" if isinstance(exc, BudgetExceeded) else "error"] = message
    return doc


def wants_json(argv: Sequence[str]) -> bool:
    """``--json`` among the options (before a ``--``): errors then also go to stdout as JSON."""
    for a in argv:
        if a == "--":
            return False
        if a == "--json":
            return True
    return False


# --------------------------------------------------------------------------- tables


def terminal_width() -> int:
    """``$COLUMNS`` or the terminal's width (80 when neither is known)."""
    try:
        cols = int(os.environ.get("COLUMNS", ""))
        if cols > 0:
            return cols
    except ValueError:
        pass
    return shutil.get_terminal_size((80, 24)).columns


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], *, keep: Sequence[str] = (),
                caption: str | None = None, right: Sequence[str] = ()) -> None:
    """A rich table that fits the terminal, never cutting the columns in ``keep`` (ids, dates).

    Kept columns are ``no_wrap`` at their full width; the others fold. If the kept columns alone do
    not fit, each row is printed as ``column: value`` lines instead, so an id is never abbreviated
    into something that names another run."""
    from rich.console import Console
    from rich.table import Table

    from dpops.ledger.text import printable

    # Every cell and the title escaped: ledger text written before issue 19 item 11 may hold terminal escapes.
    rows = [[printable(str(v), keep_newlines=True) for v in r] for r in rows]
    title = printable(title)
    caption = printable(caption) if caption else caption
    width = terminal_width()
    console = Console(width=width, soft_wrap=False, highlight=False)
    need = sum(max([len(c)] + [len(r[i]) for r in rows]) + 3 for i, c in enumerate(columns) if c in keep) + \
        sum(6 for c in columns if c not in keep) + 1
    if need > width:
        console.print(title, markup=False, overflow="fold")
        for r in rows:
            for c, v in zip(columns, r):
                # a kept value (an id, a date) is short enough for one line; a long URI or note folds
                console.print(f"  {c}: {v}", markup=False, overflow="fold")
            console.print("")
        if caption:
            console.print(caption, markup=False, overflow="fold")
        return
    table = Table(title=title, caption=caption, caption_justify="left")
    for c in columns:
        if c in keep:
            table.add_column(c, no_wrap=True, min_width=max([len(c)] + [len(r[columns.index(c)]) for r in rows]),
                             justify="right" if c in right else "left")
        else:
            table.add_column(c, overflow="fold", justify="right" if c in right else "left")
    for r in rows:
        table.add_row(*r)
    console.print(table)
