"""Exception hierarchy. Each class carries the process exit code the CLI uses.

Exit codes (documented in README.md):
  0  success
  1  internal error (a bug: please report it)
  2  usage error (bad command-line arguments; click's own convention)
  3  invalid parameter or release spec (fix the configuration), or a refused permission (connect as the
     role the message names, e.g. the ledger owner)
  4  invalid input data (fix or provide the input file)
  5  budget refused by the ledger (nothing was spent)
  6  ledger, storage or Beam runner unavailable / conflicting state (retry later)
  7  verification failed (tampered or inconsistent ledger/manifest)
"""

from __future__ import annotations


class DpopsError(Exception):
    """Base class of every error dpops raises on purpose."""

    exit_code = 1


class InvalidParameter(DpopsError, ValueError):
    """A privacy or mechanism parameter is out of its domain (epsilon <= 0, NaN bound, ...)."""

    exit_code = 3


class SpecError(DpopsError, ValueError):
    """A release spec or scope definition is invalid."""

    exit_code = 3


class InputDataError(DpopsError):
    """The private input is missing, unreadable or does not match the declared schema."""

    exit_code = 4


class PermissionRefused(DpopsError):
    """The connected identity may not do this (e.g. the ledger's application role asked to change a cap or create
    a scope, which only the owner role may). Not retryable: connect as the role the message names."""

    exit_code = 3


class BudgetExceeded(DpopsError):
    """The ledger refused a reservation because the scope's cap would be exceeded."""

    exit_code = 5


class LedgerError(DpopsError):
    """The ledger is unreachable, or a state transition is not allowed."""

    exit_code = 6


class NeedsOperator(LedgerError):
    """The ledger state of the run allows no automatic progress: only an operator's explicit action
    (named in the message, e.g. ``dpops release run --fresh-attempt``) can. A retry cannot fix it, so an
    orchestrator fails the task at once instead of retrying it."""

    exit_code = 6


class StorageError(DpopsError):
    """Staging or publishing an output failed (disk full, read-only path, corrupt file)."""

    exit_code = 6


class RunnerError(DpopsError):
    """The Beam runner, its options or its endpoint cannot be used (unknown runner, unknown flag, a job
    service or worker pool that does not answer). Raised before the ledger starts the run: nothing charged."""

    exit_code = 6


class IntegrityError(DpopsError):
    """Verification failed: a hash chain, a total or a manifest claim does not recompute."""

    exit_code = 7


class InternalError(DpopsError):
    """An unexpected failure (a bug) whose original text is withheld because it may quote input data."""

    exit_code = 1


DEBUG_ENV = "DPOPS_DEBUG"


def public_message(exc: BaseException) -> str:
    """The text of ``exc`` that may go to a log line, an alert, the ledger or the terminal.

    dpops's own errors are written never to contain file contents or cell values (they name the file, the
    declared column, a row number and what to do), so their text is kept. Any other exception (pyarrow,
    numpy, pandas, GX, Beam's wrapper of a worker error) may quote the offending cell or line, e.g.
    ``CSV parse error: Expected 4 columns, got 5: <the private row>``, so only its class name is kept.
    Privacy reason: logs and alerts leave the trusted boundary (semantics.md section 6).
    """
    if isinstance(exc, DpopsError):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__} (its text is withheld because it may quote input data; rerun with " \
           f"{DEBUG_ENV}=1 on a trusted terminal to see it)"
