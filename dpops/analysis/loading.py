"""``load``: the one way the analysis functions accept a spec (a path, a dict as the YAML would parse, or a spec).

A module of its own so that every analysis module can take a spec the same way without importing the
package's ``__init__`` (which imports them: a circle). Loading a spec reads the spec file only, never data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpops.errors import InvalidParameter

if TYPE_CHECKING:
    from dpops.spec import ReleaseSpec


def load(spec: ReleaseSpec | str | os.PathLike[str] | Mapping[str, Any], *,
         base_dir: str | os.PathLike[str] | None = None) -> ReleaseSpec:
    """A validated ``ReleaseSpec`` from a YAML path, a dict (as the YAML would parse) or a spec itself.

    A dict's relative paths start at ``base_dir`` (default the working directory). Errors are the same
    ``SpecError`` (exit class 3) the CLI prints.
    """
    from dpops.spec import ReleaseSpec, load_spec, parse_spec

    if isinstance(spec, ReleaseSpec):
        return spec
    if isinstance(spec, Mapping):
        return parse_spec(dict(spec), source="<dict>", base_dir=Path(base_dir) if base_dir is not None else None)
    if isinstance(spec, (str, os.PathLike)):
        return load_spec(spec)
    raise InvalidParameter(f"a spec is a path, a dict or a ReleaseSpec, got {type(spec).__name__}")


__all__ = ["load"]
