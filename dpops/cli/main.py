"""Entry point of the ``dpops`` command.

Sub-commands are registered lazily from modules of this package, each exposing a
click command or group named ``cli``. Errors derived from ``DpopsError`` are
printed as one clear line on stderr and mapped to the exit codes documented in
``dpops.errors`` (and README.md).
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from dpops import __version__
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
]


class LazyGroup(click.Group):
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
def cli() -> None:
    """dpops: differentially private batch releases with a global budget ledger.

    Exit codes: 0 ok, 1 internal error, 2 usage, 3 invalid parameter or spec,
    4 invalid input data, 5 budget refused, 6 ledger/storage unavailable,
    7 verification failed.
    """


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="dpops", standalone_mode=False)
    except DpopsError as exc:
        click.echo(f"dpops: error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug: one clear line and exit 1, never a bare traceback
        if os.environ.get(DEBUG_ENV):
            raise
        # Only the class: a foreign exception's text may quote input data (dpops.errors.public_message).
        click.echo(f"dpops: internal error ({public_message(exc)}). This is a bug; please report it "
                   "with the command you ran.", err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
