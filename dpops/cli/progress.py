"""Progress by stage for long CLI runs, on stderr (stdout stays for the result and ``--json``).

On a terminal: a rich spinner naming the current stage, and one line per finished stage with its
duration. Otherwise (a log file, Airflow, a pipe): one plain line per stage, so a log shows where a
run spent its time or stopped. Stage names are ``dpops.release.STAGES``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def stage_progress(enabled: bool = True, *, tty: bool | None = None) -> Iterator[Callable[[str], None] | None]:
    """Yield a ``progress(stage)`` callback for ``dpops.release`` (None when disabled)."""
    if not enabled:
        yield None
        return
    is_tty = sys.stderr.isatty() if tty is None else tty
    if not is_tty:
        def plain(stage: str) -> None:
            print(f"dpops: stage: {stage}", file=sys.stderr, flush=True)

        yield plain
        return
    from rich.console import Console

    console = Console(stderr=True)
    current: dict[str, object] = {}
    with console.status("starting") as status:
        def rich_stage(stage: str) -> None:
            now = time.monotonic()
            if current:
                console.print(f"[green]done[/green] {current['name']} ({now - float(current['t']):.1f} s)")  # type: ignore[arg-type]
            current.update(name=stage, t=now)
            status.update(f"{stage} ...")

        try:
            yield rich_stage
        except BaseException:
            if current:
                console.print(f"[red]stopped[/red] in {current['name']}")
            raise
        if current:
            console.print(f"[green]done[/green] {current['name']} "
                          f"({time.monotonic() - float(current['t']):.1f} s)")  # type: ignore[arg-type]
