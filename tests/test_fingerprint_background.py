"""The input's keyed fingerprint is hashed in a background thread while the release imports Beam
(``dpops.inputs.start_input_fingerprint``, ``prepare(..., warm=...)``, ``pipeline_seam.warm_pipeline``).

Speed only, so what is checked is that nothing else changes: the same fingerprint, the same error for an
unreadable file (raised where the fingerprint is asked for), the hashing really overlapping the caller's
work, and the release warming the pipeline only when it runs the real one.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dpops.errors import InputDataError
from dpops.inputs import TestFingerprintKey, input_fingerprint, start_input_fingerprint
from dpops.release import execute
from dpops.release.pipeline_seam import warm_pipeline

KEY = TestFingerprintKey()


def _files(root: Path) -> list[str]:
    root.mkdir()
    out = []
    for i, size in enumerate((0, 1, (1 << 23) + 7, 3 << 20)):  # empty, tiny, over one 8 MiB read, under one
        p = root / f"part-{i}.csv"
        p.write_bytes(os.urandom(size))
        out.append(str(p))
    return out


def test_the_background_fingerprint_is_the_fingerprint(tmp_path):
    paths = _files(tmp_path / "in")
    rows = [["a"], ["b"]]
    for public in (None, rows):
        want = input_fingerprint(paths, KEY, public)
        assert start_input_fingerprint(paths, KEY, public)() == want
        assert start_input_fingerprint(list(reversed(paths)), KEY, public)() == want  # sorted by name, as before
    assert start_input_fingerprint(paths, KEY, rows)() != input_fingerprint(paths, KEY)


def test_an_unreadable_file_raises_the_same_error_when_the_fingerprint_is_asked_for(tmp_path):
    paths = _files(tmp_path / "in")
    (tmp_path / "in" / "dir.csv").mkdir()
    bad = [*paths, str(tmp_path / "in" / "dir.csv")]
    with pytest.raises(InputDataError) as serial:
        input_fingerprint(bad, KEY)
    finish = start_input_fingerprint(bad, KEY)  # does not raise here: the thread hit the error
    with pytest.raises(InputDataError) as background:
        finish()
    assert str(background.value) == str(serial.value) and "dir.csv" in str(background.value)


def test_the_hashing_overlaps_the_callers_work(tmp_path):
    """The input is a FIFO that only the caller's later work fills: if the hashing did not run beside that
    work (say it ran in the start call), the writer below would never be reached and the test would time out."""
    data = os.urandom(5 << 20)
    (tmp_path / "fifo").mkdir()
    (tmp_path / "file").mkdir()
    fifo = tmp_path / "fifo" / "day.csv"
    os.mkfifo(fifo)
    (tmp_path / "file" / "day.csv").write_bytes(data)
    box: list[str] = []

    def start() -> None:
        finish = start_input_fingerprint([str(fifo)], KEY)
        with open(fifo, "wb") as fh:  # the caller's own work, after start returned
            fh.write(data)
        box.append(finish())

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # unblock the reader so no thread is left behind, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("start_input_fingerprint hashed before returning: nothing overlapped")
    assert box == [input_fingerprint([str(tmp_path / "file" / "day.csv")], KEY)]


class _Stop(Exception):
    pass


def test_the_release_warms_the_real_pipeline_only(monkeypatch):
    seen: list[object] = []

    def prepare(*a: object, **k: object) -> None:
        seen.append(k.get("warm"))
        raise _Stop

    monkeypatch.setattr(execute, "prepare", prepare)
    for fn in (execute.execute_release, execute.execute_restatement):
        seen.clear()
        with pytest.raises(_Stop):
            fn(Path("spec.yaml"), "2024-01-01", ledger=None)  # type: ignore[arg-type]
        with pytest.raises(_Stop):
            fn(Path("spec.yaml"), "2024-01-01", ledger=None, run_release=lambda req: None)  # type: ignore[arg-type]
        assert seen == [warm_pipeline, None], fn.__name__
