"""Scratch files of the private passes (the estimation's and the private tune's): numeric columns as ``.npz``.

Why a format of its own: a scratch file holds private rows between two Beam steps on a private staging
location, and is read back by a worker. ``np.load(..., allow_pickle=False)`` reads only arrays, so a scratch file
that someone else could write (a shared prefix) can never run code in a worker that unpickles it. One owner for
both passes.
"""

from __future__ import annotations

import io

import numpy as np

Columns = dict[str, np.ndarray]


def pack_columns(cols: Columns) -> bytes:
    """Columns as an .npz (names kept in order; no pickles)."""
    names = list(cols)
    buf = io.BytesIO()
    np.savez(buf, names=np.asarray(names, dtype=np.str_), **{f"a{i}": cols[n] for i, n in enumerate(names)})
    return buf.getvalue()


def unpack_columns(data: bytes) -> Columns:
    """``pack_columns``'s columns back, read with ``allow_pickle=False``."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {str(n): z[f"a{i}"] for i, n in enumerate(z["names"])}


def concat_columns(parts: list[Columns]) -> Columns:
    """The parts' columns concatenated in order (the parts have the same names)."""
    return {k: np.concatenate([x[k] for x in parts]) for k in parts[0]} if len(parts) > 1 else parts[0]


__all__ = ["Columns", "concat_columns", "pack_columns", "unpack_columns"]
