"""Entry point of the ``dpops`` command.

Sub-commands are registered lazily from modules of this package, each exposing a
click command or group named ``cli``. Errors derived from ``DpopsError`` are
printed as one clear line on stderr and mapped to the exit codes documented in
``dpops.errors`` (and README.md).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

import click

from dpops import __version__
from dpops.cli.common import (
    HelpGroup,
    dumps,
    error_object,
    json_printed,
    ledger_option,
    reset,
    say,
    wants_json,
)
from dpops.errors import DEBUG_ENV, DpopsError, public_message

# (command name, module under dpops.cli). A module that does not exist yet is skipped.
SUBCOMMANDS = [
    ("account", "account"),
    ("ledger", "ledger"),
    ("plan", "plan"),
    ("spec", "spec"),
    ("release", "release"),
    ("manifest", "manifest"),
    ("report", "report"),
    ("audit", "audit"),
    ("key", "key"),
    ("gaps", "gaps"),
    ("tune", "tune"),
    ("simulate", "simulate"),
    ("estimate", "estimate"),
]


class LazyGroup(HelpGroup):
    def main(self, args: list[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: object) -> object:
        """Standalone calls (the console script, ``click.testing.CliRunner``) go through ``main()`` so
        that errors get the same one line, exit code and ``--json`` object everywhere."""
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)  # type: ignore[arg-type]
        sys.exit(main(None if args is None else list(args)))

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name, mod in SUBCOMMANDS if self._load(mod) is not None]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        for name, mod in SUBCOMMANDS:
            if name == cmd_name:
                return self._load(mod)
        return None

    @staticmethod
    def _load(mod: str) -> click.Command | None:
        try:
            module = importlib.import_module(f"dpops.cli.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name == f"dpops.cli.{mod}":
                return None
            raise
        return getattr(module, "cli", None)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dpops")
@ledger_option
def cli() -> None:
    """dpops: differentially private batch releases with a global budget ledger.

    Exit codes: 0 ok, 1 internal error, 2 usage, 3 invalid parameter or spec,
    4 invalid input data, 5 budget refused, 6 ledger/storage unavailable,
    7 verification failed.
    """


def _fail(exc: BaseException, code: int, message: str, as_json: bool, *, stderr_line: str | None = None) -> int:
    """One clear line on stderr; with ``--json`` also one JSON object on stdout (unless the command
    already printed its own)."""
    if stderr_line is not None:
        say(stderr_line, err=True)
    if as_json and not json_printed():
        click.echo(dumps(error_object(exc, code, message)))
    return code


# Young-generation threshold of the collector while the ``dpops`` process runs (CPython's default: 700).
# A release imports Beam, pandas and pyarrow, allocating a few hundred thousand long-lived objects; at 700
# the collector ran a generation-0 pass every 700 of them and promoted them in ~0.2-0.3 s of passes. Speed
# only: a cycle is still collected, just after more allocations (reference counting frees everything
# else at once); nothing the collector sees is private data that must go at a precise time.
GC_YOUNG_THRESHOLD = 50_000


def _enter_process() -> None:
    """The ``dpops`` process's own settings, set by ``main()`` only when it is the process entry (the console
    script, ``python -m dpops.cli.main``): an in-process caller (tests, click's runner) keeps its own."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _leave_process() -> None:
    """Freeze the heap for the interpreter's exit (``main()`` as the process entry, after the command returned).

    The interpreter's final collection walks every object still tracked, Beam's graph and modules included
    (~0.45 s of a 10M-row release, after its output is published). ``gc.freeze()`` moves them out of the
    collector's generations, so that walk is skipped. Privacy: cleanup is unchanged. By this point every
    temporary file or directory of the run (they may hold private rows: the publication's check directory,
    the estimation's scratch) has been removed by its own ``with`` block or ``finally`` inside the command,
    and a young-generation collection first finalizes the cyclic garbage that cleanup just left; at exit
    ``atexit`` handlers and ``weakref.finalize`` (``tempfile.TemporaryDirectory``) still run, as do
    reference-count deallocations and ``__del__`` of objects freed by module teardown. What a frozen heap
    skips is only the collection of cyclic garbage whose memory the exit returns to the OS anyway; no
    finalizer is skipped on purpose and the process still exits through ``sys.exit`` (never ``os._exit``),
    with the command's exit code (``tests/test_cli_exit.py``)."""
    gc.collect(1)
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    """The ``dpops`` command; ``argv=None`` (the process entry) reads ``sys.argv`` and also applies the
    process's collector settings (``_enter_process``, ``_leave_process``)."""
    if argv is not None:
        return _main(list(argv))
    _enter_process()
    try:
        return _main(list(sys.argv[1:]))
    finally:
        _leave_process()


def _main(args: list[str]) -> int:
    as_json = wants_json(args)
    reset()
    try:
        cli.main(args=args, prog_name="dpops", standalone_mode=False)
    except DpopsError as exc:
        return _fail(exc, exc.exit_code, str(exc), as_json, stderr_line=f"dpops: error: {exc}")
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return _fail(exc, exc.exit_code, exc.format_message(), as_json)
    except click.exceptions.Abort as exc:
        return _fail(exc, 1, "aborted", as_json, stderr_line="aborted")
    except Exception as exc:  # noqa: BLE001 - a bug: one clear line and exit 1, never a bare traceback
        if os.environ.get(DEBUG_ENV):
            raise
        # Only the class: a foreign exception's text may quote input data (dpops.errors.public_message).
        msg = (f"internal error ({public_message(exc)}). This is a bug; please report it "
               "with the command you ran.")
        return _fail(exc, 1, msg, as_json, stderr_line=f"dpops: {msg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
