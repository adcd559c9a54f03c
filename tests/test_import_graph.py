"""dpops' import graph: no circle among ``analysis/``, ``manifest/`` and ``release/``, and ``analysis/`` stays pure.

Why (issue 27 item 2): ``dpops.analysis`` is documented as computed from a release spec alone -- no data is
read and nothing is charged. A module of it that imports the ledger, the release steps, a manifest module
or a storage writer can charge, read private data or write what a reviewer reads, behind a name that says
it does not. A circle among the three packages is how that happened before: the estimation (which reads
and charges) lived in analysis/, the release imported it, and the manifest verifier imported both.

The graph is built statically with ``ast`` from every ``import`` and ``from ... import`` anywhere in a file:
at module level, inside functions, and under ``if TYPE_CHECKING`` (a type-only import is still a
dependency of the module's design, and the next edit makes it a runtime one). An edge goes to the module
named (``from a.b import c`` goes to ``a.b.c`` when that is a module file, else to ``a.b``); importing a
module does not add edges to its parent packages' ``__init__`` (those are not what the author chose).
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dpops.analysis", "dpops.manifest", "dpops.release")
# analysis/ may import none of these: the ledger (charging, access records), the release steps (reading
# private data), any manifest module (the writers, and the verifier that imports the release's rules) and the
# storage backends (writers). Two modules under them are pure and stay allowed:
# - ``dpops.storage.location`` only parses a path or URI (no backend, no write);
# - ``dpops.ledger.budget`` is the ledger's arithmetic (how a composed state becomes the number compared with a
#   cap: ``state_rho``); the horizon must measure exactly as the ledger will, so it uses the one definition.
#   It opens no database and writes nothing. (Its owner may move it under dpops/accounting; then drop it here.)
ANALYSIS_FORBIDDEN = ("dpops.ledger", "dpops.release", "dpops.manifest", "dpops.storage")
ANALYSIS_ALLOWED = ("dpops.storage.location", "dpops.ledger.budget")


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line})"


def module_names(root: Path, top: str = "dpops") -> dict[str, Path]:
    """Every module of the package ``top`` under ``root``: dotted name -> file."""
    out = {}
    for f in sorted((root / top).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(root: Path, top: str = "dpops") -> list[Edge]:
    """Every static import between modules of ``top`` (module level, function level, TYPE_CHECKING)."""
    modules = module_names(root, top)
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = str(path.relative_to(root))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                while t and t not in modules:  # ``import dpops.x.y`` of a name that is not a file: its package
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.append(Edge(name, t, rel, node.lineno))
    return list(dict.fromkeys(edges))  # one edge per (source, target, line): ``from a import b, c`` is one import


def package_of(module: str, packages: Iterable[str]) -> str | None:
    """The package of ``packages`` that ``module`` belongs to (None: none of them)."""
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def cycle_problems(edges: Iterable[Edge], packages: Iterable[str] = PACKAGES) -> list[str]:
    """One line per circle: among the packages themselves, and among their modules (with each edge's file:line)."""
    packages = tuple(packages)
    inside = [e for e in edges if package_of(e.source, packages) and package_of(e.target, packages)]
    out = []
    by_package: dict[str, set[str]] = {p: set() for p in packages}
    witness: dict[tuple[str, str], Edge] = {}
    for e in inside:
        a, b = package_of(e.source, packages), package_of(e.target, packages)
        assert a is not None and b is not None
        if a != b:
            by_package[a].add(b)
            witness.setdefault((a, b), e)
    cycle = _one_cycle(by_package)
    if cycle:
        hops = [str(witness[(x, y)]) for x, y in zip(cycle, cycle[1:], strict=False)]
        out.append("package circle " + " -> ".join(cycle) + ", e.g. " + "; ".join(hops))
    return out + module_circles(inside)


def _one_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as [a, b, ..., a] (graphlib names the one it meets), or None."""
    try:
        graphlib.TopologicalSorter({k: set(v) for k, v in graph.items()}).prepare()
    except graphlib.CycleError as exc:
        found = list(exc.args[1])
        return found[::-1]  # graphlib lists predecessors first; reversed it follows the imports
    return None


def strongly_connected(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """The components of more than one module (every module reaches every other), by reachability."""
    nodes = set(graph) | {t for ts in graph.values() for t in ts}

    def reach(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for t in graph.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    fwd = {n: reach(n) for n in nodes}
    comps: list[set[str]] = []
    for n in sorted(nodes):
        if any(n in c for c in comps):
            continue
        comp = {m for m in fwd[n] if n in fwd[m]}
        if len(comp) > 1:
            comps.append(comp)
    return comps


def analysis_problems(edges: Iterable[Edge]) -> list[str]:
    """Each import of a module of ``dpops.analysis`` that reaches the ledger, the release, a manifest or storage."""
    out = []
    for e in edges:
        if package_of(e.source, ("dpops.analysis",)) is None:
            continue
        if package_of(e.target, ANALYSIS_FORBIDDEN) and not package_of(e.target, ANALYSIS_ALLOWED):
            out.append(f"{e}: dpops.analysis is pure (no data read, nothing charged or written); move the code "
                       "that needs it under dpops/release/ or pass its result in")
    return out


def test_no_circle_among_analysis_manifest_release():
    problems = cycle_problems(import_edges(ROOT))
    assert not problems, "import circles:\n" + "\n".join(problems)


def test_analysis_imports_no_ledger_release_manifest_or_storage():
    problems = analysis_problems(import_edges(ROOT))
    assert not problems, "\n".join(problems)


def test_the_checks_see_function_level_and_type_checking_imports_and_name_the_circle(tmp_path):
    """The checks can fail: a planted tree with a function-level circle and a TYPE_CHECKING ledger import."""
    pkg = tmp_path / "dpops"
    for d in ("analysis", "release", "manifest", "ledger"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "analysis" / "est.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dpops.ledger import Ledger\n"
        "def f():\n    from dpops.release.prep import g\n")
    (pkg / "release" / "prep.py").write_text("def g():\n    from ..analysis import est\n")
    (pkg / "manifest" / "verify.py").write_text("import dpops.analysis.est\n")
    edges = import_edges(tmp_path)
    cycles = cycle_problems(edges)
    assert len(cycles) == 2, cycles
    assert cycles[0].startswith("package circle dpops.analysis -> dpops.release -> dpops.analysis") or \
        cycles[0].startswith("package circle dpops.release -> dpops.analysis -> dpops.release"), cycles
    assert "module circle of 2 files (dpops.analysis.est, dpops.release.prep)" in cycles[1]
    assert "dpops/release/prep.py:2" in cycles[1] and "dpops/analysis/est.py:5" in cycles[1]
    bad = analysis_problems(edges)
    assert any("dpops.analysis.est -> dpops.ledger (dpops/analysis/est.py:3)" in b for b in bad), bad
    assert any("-> dpops.release.prep" in b for b in bad), bad


def module_circles(edges: Iterable[Edge]) -> list[str]:
    """One line per set of modules that import each other (directly or around a loop), anywhere in the tree."""
    graph: dict[str, set[str]] = {}
    at: dict[tuple[str, str], Edge] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        at.setdefault((e.source, e.target), e)
    out = []
    for comp in strongly_connected(graph):
        cycle = _one_cycle({m: graph.get(m, set()) & comp for m in comp}) or []
        hops = [str(at[(x, y)]) for x, y in zip(cycle, cycle[1:], strict=False)]
        out.append(f"module circle of {len(comp)} files ({', '.join(sorted(comp))}): " + "; ".join(hops))
    return out


def test_no_module_circle_anywhere_in_dpops_pipelines_dags_or_plugins():
    """No two modules of our code depend on each other, in any package (not only the three above).

    Why: a circle is where a rule stops having one owner. The last one was inside the ledger: the database's cap
    check imported the ledger's store for the cap rule while the store's schema installed the check, and the
    checkpoint, role and verify modules imported the Ledger that calls them. The rule now sits in
    ``dpops.ledger.cap`` and those modules take ``backend.OpenLedger``.
    """
    problems = [p for top in ("dpops", "pipelines", "dags", "plugins") for p in module_circles(import_edges(ROOT, top))]
    assert not problems, "import circles:\n" + "\n".join(problems)


def test_the_whole_tree_check_names_a_circle_inside_any_package(tmp_path):
    """It can fail: a function-level circle between two ledger modules, as store.py and db_cap.py had."""
    pkg = tmp_path / "dpops" / "ledger"
    pkg.mkdir(parents=True)
    (tmp_path / "dpops" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "store.py").write_text("from dpops.ledger.schema import migrate\n")
    (pkg / "schema.py").write_text("from dpops.ledger import db_cap\n")
    (pkg / "db_cap.py").write_text("def check():\n    from dpops.ledger.store import check_cap\n")
    circles = module_circles(import_edges(tmp_path))
    assert len(circles) == 1, circles
    assert circles[0].startswith("module circle of 3 files (dpops.ledger.db_cap, dpops.ledger.schema, "
                                 "dpops.ledger.store)"), circles
    assert "dpops/ledger/db_cap.py:2" in circles[0], circles


def private_imports(root: Path, top: str) -> list[str]:
    """``from a.b import _name`` anywhere in ``top`` where ``_name`` is not a dunder: a private name of another
    module (``path:line module._name``). A module's ``_name`` is its own business; a second module depending on it
    is a rule with two owners that nobody reviews as an interface."""
    out = []
    for path in sorted((root / top).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        out.append(f"{path.relative_to(root)}:{node.lineno} {node.module}.{alias.name}")
    return out


def test_no_private_name_is_imported_across_modules():
    """dpops, pipelines, dags and plugins import only public names of one another (the project's style rule)."""
    problems = [p for top in ("dpops", "pipelines", "dags", "plugins") for p in private_imports(ROOT, top)]
    assert not problems, "private names imported from another module:\n" + "\n".join(problems)


def test_the_private_import_check_names_the_import(tmp_path):
    """It can fail: a multi-line import of one private name among public ones."""
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "a.py").write_text("from pipelines.b import (\n    Public,\n    _Private,\n)\n")
    assert private_imports(tmp_path, "pipelines") == ["pipelines/a.py:1 pipelines.b._Private"]
