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
from typing import TYPE_CHECKING, Any

import click

from dpops.errors import LedgerError

if TYPE_CHECKING:
    from dpops.keyref import KeyRing
    from dpops.noise.randomness import NoiseKey

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


def load_key(key_file: str | None) -> NoiseKey | None:
    """The ``NoiseKey`` of ``--key-file`` (or ``$DPOPS_NOISE_KEY_FILE``), or None when neither is given."""
    if not key_file:
        return None
    from dpops.noise.randomness import NoiseKey

    return NoiseKey.from_file(key_file)


def previous_keys_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--previous-key-file PATH`` (repeatable; default ``$DPOPS_PREVIOUS_NOISE_KEY_FILES``, paths separated by
    ``os.pathsep``): the keys of earlier rotations (``dpops.keyref.KeyRing``). Checks use, for each record, the
    key it was made under; a re-run compares the input under the key it was published under."""
    return click.option("--previous-key-file", "previous_key_files", multiple=True, type=click.Path(dir_okay=False),
                        help="a noise key of an earlier rotation, mode 0600 (repeatable; default "
                             "$DPOPS_PREVIOUS_NOISE_KEY_FILES): check what was published under it")(fn)


def previous_key_files(given: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The previous keys' files: the option's, else ``$DPOPS_PREVIOUS_NOISE_KEY_FILES``'s."""
    from dpops.keyref import previous_key_paths

    return tuple(given) or previous_key_paths()


def load_keys(key_file: str | None, previous: tuple[str, ...] | list[str] = ()) -> NoiseKey | KeyRing | None:
    """``load_key``, or a ``KeyRing`` of the current key and the previous ones when any is given (the option's
    or the environment's): what the checking commands pass to verification."""
    paths = previous_key_files(previous)
    if not paths:
        return load_key(key_file)
    from dpops.keyref import KeyRing

    return KeyRing.load(key_file, paths)


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


# --------------------------------------------------------------------------- help


class HelpGroup(click.Group):
    """A group whose command list shows each command's whole first sentence, wrapped, never cut with "...".

    click abbreviates a command's short help to what fits beside its name on one line; an operator
    then reads "Compose the privacy events in EVENTS_JSON and print epsilon..." and has to guess."""

    group_class = type  # sub-groups made with @group.group() list their commands the same way

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's ``short_help``, else the first paragraph of its help, whole."""
        import inspect

        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                text = cmd.short_help or inspect.cleandoc(cmd.help or "").split("\n\n")[0]
                rows.append((name, " ".join(text.replace("\b", "").split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


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


def prose_width(err: bool = False) -> int | None:
    """The width prose wraps at: ``$COLUMNS``, else the terminal's when the stream is one; None (lines whole) for a
    pipe or a log without ``$COLUMNS``, where a reader greps whole lines. Tables always need a width (80 then)."""
    try:
        cols = int(os.environ.get("COLUMNS", ""))
        if cols > 0:
            return cols
    except ValueError:
        pass
    stream = click.get_text_stream("stderr" if err else "stdout")
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return shutil.get_terminal_size((80, 24)).columns if tty else None


def _words(text: str) -> list[str]:
    return [w for line in text.split("\n") for w in line.split()] or [""]


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` wrapped at ``width`` at whitespace only: a word (an id, a date, a URI) is never split."""
    import textwrap

    out: list[str] = []
    for line in text.split("\n"):
        out.extend(textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False) or [""])
    return out


def echo_wrapped(text: str, *, indent: int = 0, err: bool = False) -> None:
    """Print prose wrapped to the terminal (``$COLUMNS``, ``prose_width``) at whitespace only, continuation lines
    indented two more than the first: the same rule as the tables, so a sentence around a run id, a date or a path
    reads at 80 columns and the token stays whole for copying. Without a known width (a pipe, a log) each line is
    printed whole."""
    import textwrap

    width = prose_width(err)
    first, rest = " " * indent, " " * (indent + 2)
    for part in text.split("\n"):
        if width is None:
            click.echo(first + part, err=err)
            continue
        lines = textwrap.wrap(part, max(width, len(rest) + 1), initial_indent=first, subsequent_indent=rest,
                              break_long_words=False, break_on_hyphens=False)
        click.echo("\n".join(lines or [""]), err=err)


def say(text: str, *, err: bool = False) -> None:
    """Print prose (a message, an outcome line, a list item) wrapped to ``$COLUMNS`` (``echo_wrapped``) at
    whitespace only: each line of ``text`` keeps its own leading indentation and its continuation lines are indented
    two more, so an item reads as one item; an id, a date, a hash or a URI longer than the line stays whole on a
    line of its own, for copying. Every non-table output of the CLI goes through it or through ``print_table``
    (issue 28 item 13: lines of up to 582 characters ignored ``COLUMNS``); JSON never does."""
    for line in text.split("\n"):
        body = line.lstrip(" ")
        echo_wrapped(body, indent=len(line) - len(body), err=err)


def _labelled(label: str, text: str, width: int, indent: int) -> list[str]:
    """``label: text`` wrapped under itself at whitespace only; a token longer than the line stays whole."""
    import textwrap

    head = " " * indent + f"{label}: "
    pad = " " * (indent + 4)
    lines: list[str] = []
    for n, part in enumerate(text.split("\n") or [""]):
        first = head if n == 0 else pad
        lines.extend(textwrap.wrap(part, max(width, len(first) + 1), initial_indent=first, subsequent_indent=pad,
                                   break_long_words=False, break_on_hyphens=False) or [first.rstrip()])
    return lines


def table_lines(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], width: int, *,
                keep: Sequence[str] = (), below: Sequence[str] = (), caption: str | None = None,
                right: Sequence[str] = (), below_if_needed: Sequence[str] = ()) -> list[str]:
    """The lines ``print_table`` prints at ``width`` columns (see there)."""
    if below:  # wide enough for every column on the row's line: no line under it
        inline = _table_lines(title, columns, rows, width, keep=(*keep, *below, *below_if_needed), below=(),
                              caption=caption, right=right)
        if inline is not None:
            return inline
    lines = _table_lines(title, columns, rows, width, keep=(*keep, *below_if_needed), below=below,
                         caption=caption, right=right)
    if lines is None and below_if_needed:  # still too wide: those columns go under the row as well
        lines = _table_lines(title, columns, rows, width, keep=keep, below=(*below, *below_if_needed),
                             caption=caption, right=right)
    return lines if lines is not None else _block_lines(title, columns, rows, width, caption)


def _table_lines(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], width: int, *,
                 keep: Sequence[str], below: Sequence[str], caption: str | None,
                 right: Sequence[str]) -> list[str] | None:
    """The table at ``width``, or None when its narrowest layout does not fit."""
    from rich.cells import cell_len

    shown = [i for i, c in enumerate(columns) if c not in below]
    under = [i for i, c in enumerate(columns) if c in below]
    sep = " │ "
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for i in shown:
        cells = [r[i] for r in rows]
        if columns[i] in keep:  # whole cell on one line
            lo[i] = max([max(map(cell_len, _words(columns[i])))] + [max(map(cell_len, v.split("\n"))) for v in cells])
        else:  # wraps at whitespace, never inside a word
            lo[i] = max(cell_len(w) for v in [columns[i], *cells] for w in _words(v))
        hi[i] = max([lo[i], cell_len(columns[i])] + [cell_len(line) for v in cells for line in v.split("\n")])
    overhead = cell_len(sep) * (len(shown) - 1)
    if not shown or sum(lo.values()) + overhead > width:
        return None
    widths = dict(lo)
    spare = width - overhead - sum(widths.values())
    want = {i: hi[i] - lo[i] for i in shown}
    while spare > 0 and any(want.values()):  # hand out the spare columns one at a time to the widest wish
        i = max(want, key=lambda k: want[k])
        widths[i] += 1
        want[i] -= 1
        spare -= 1

    def fit(i: int, text: str) -> str:
        pad = widths[i] - cell_len(text)
        return " " * pad + text if columns[i] in right else text + " " * pad

    def row_lines(cells: Sequence[str], header: bool = False) -> list[str]:
        wrapped = {i: (cells[i].split("\n") if columns[i] in keep and not header else wrap_words(cells[i], widths[i]))
                   for i in shown}
        height = max(len(v) for v in wrapped.values())
        return [sep.join(fit(i, wrapped[i][n] if n < len(wrapped[i]) else "") for i in shown).rstrip()
                for n in range(height)]

    out = [*wrap_words(title, width), *row_lines(columns, header=True), "─┼─".join("─" * widths[i] for i in shown)]
    for r in rows:
        out.extend(row_lines(r))
        for i in under:
            if r[i] and r[i] != "-":
                out.extend(_labelled(columns[i], r[i], width, 4))
    if caption:
        out.extend(wrap_words(caption, width))
    return out


def _block_lines(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], width: int,
                 caption: str | None) -> list[str]:
    out = wrap_words(title, width)
    for r in rows:
        for c, v in zip(columns, r):
            if v:  # an empty cell (no output yet, restates nothing) is left out, not printed as "c:"
                out.extend(_labelled(c, v, width, 2))
        out.append("")
    if caption:
        out.extend(wrap_words(caption, width))
    return out


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], *, keep: Sequence[str] = (),
                below: Sequence[str] = (), caption: str | None = None, right: Sequence[str] = (),
                below_if_needed: Sequence[str] = ()) -> None:
    """A table that fits ``$COLUMNS`` (the terminal) without ever splitting an id, a date or a URI.

    Every column wraps at whitespace only, so a word is never cut; the columns in ``keep`` (ids,
    dates, short status words) never wrap at all. The columns in ``below`` (long reasons, run ids,
    output URIs) are printed on their own ``column: value`` line under each row, at the full width;
    the columns in ``below_if_needed`` (say a long release name) stay on the row, whole, unless the
    table does not fit otherwise, and then go under the row too.
    If the table's narrowest layout still does not fit, every row becomes ``column: value`` lines.
    A token longer than the terminal is printed whole on one line (the terminal may fold it on the
    screen, but a copy gives the token): an abbreviated or split run id could name another run, and
    a URI cut in two cannot be pasted into the command that reads it.

    Every cell and the title are escaped: ledger text written before issue 19 item 11 may hold
    terminal escapes."""
    from dpops.ledger.text import printable

    cells = [[printable(str(v), keep_newlines=True) for v in r] for r in rows]
    lines = table_lines(printable(title), columns, cells, terminal_width(), keep=keep, below=below,
                        caption=printable(caption) if caption else None, right=right,
                        below_if_needed=below_if_needed)
    click.echo("\n".join(lines))
