"""The import graph keeps the floor plan (docs/architecture.md §16, issue 14 points 1-2).

Parsed with ``ast`` from every project module (``kvstore``, ``client``, ``tiers``,
``gpu_agent``, ``protos``); nothing is imported.  The rules:

* ``client/`` imports nothing from ``kvstore.node`` and nothing from ``tiers``, and no
  private (``_``-prefixed) name of another package, whether a module or a name in it;
* the product (``client``, ``tiers``, ``gpu_agent``, ``protos``, ``kvstore.node``,
  ``kvstore.cluster``, ``kvstore.conductor``, ``kvstore.dashboard``, ``kvstore.local`` and
  the ``kvstore/`` root but its command line) imports no tool (``kvstore.bench``,
  ``kvstore.demo``, ``kvstore.sim``, ``kvstore.traces``), lazy imports included, and holds
  no demo or benchmark module;
* no package imports one above it (:data:`LAYERS`, lowest first), lazy imports included:
  the node never names the cluster (the command line hands it the cluster link), nothing
  below the command line imports it;
* the ``kvstore/`` root keeps at most 14 modules;
* no import cycle between any two files of the project.

What counts as an edge for cycles: imports that run when the module loads (module level,
including inside ``try``/``if`` blocks there, but not under ``if TYPE_CHECKING:``).
Imports inside functions and methods run later, when the module is whole, and exist to
keep optional or heavy modules (torch, vLLM, a subcommand's code) off the import path;
they cannot make a module see another half-initialised, so they are not cycles.  The
``client/`` rules hold for every import, lazy ones included: a dependency is a dependency.

``from package import name`` is an edge to ``package.name`` when that is a module, else to
``package`` (its ``__init__``).  Each failure lists every violation.

``python tests/unit/test_import_graph.py`` (``scripts/import-graph.sh``) prints the package
graph: each package, its layer and what it imports, arrows running up marked.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvstore", "client", "tiers", "gpu_agent", "protos")
MAX_ROOT_MODULES = 14


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    target: str  # module name (resolved)
    names: tuple[str, ...]  # what ``from target import ...`` took ("" for ``import target``)
    line: int
    eager: bool  # runs when the importer loads (module level, not TYPE_CHECKING)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in p.parts:
                out[module_name(p)] = p
    return out


MODULES = project_modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(body: list[ast.stmt], eager: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, eager
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(node.body, False)
        elif isinstance(node, ast.ClassDef):
            yield from _walk(node.body, eager)  # a class body runs at import
        elif isinstance(node, ast.If):
            yield from _walk(node.body, eager and not _is_type_checking(node.test))
            yield from _walk(node.orelse, eager)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    yield from _walk([s for s in sub if isinstance(s, ast.stmt | ast.excepthandler)], eager)
            if isinstance(node, ast.Match):
                for case in node.cases:
                    yield from _walk(case.body, eager)


def _resolve(importer: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owning_module(name: str) -> str | None:
    """The project module ``name`` is, or lies in (``kvstore.errors.X`` → ``kvstore.errors``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports() -> list[Import]:
    out = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_pkg = path.name == "__init__.py"
        for node, eager in _walk(tree.body, True):
            if isinstance(node, ast.Import):
                for a in node.names:
                    target = _owning_module(a.name)
                    if target is not None:
                        out.append(Import(mod, target, ("",), node.lineno, eager))
            else:
                base = _resolve(mod, is_pkg, node)
                if _owning_module(base) is None:
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in MODULES:
                        out.append(Import(mod, sub, ("",), node.lineno, eager))
                    else:
                        out.append(Import(mod, _owning_module(base) or base, (a.name,), node.lineno, eager))
    return out


IMPORTS = imports()


def _where(i: Import) -> str:
    return f"{MODULES[i.importer].relative_to(ROOT)}:{i.line}"


def _package(module: str) -> str:
    return module.split(".")[0]


def test_the_scan_sees_the_project() -> None:
    assert {"kvstore.keys", "client", "tiers.base", "kvstore.node.manager"} <= set(MODULES)
    assert any(i.importer.startswith("client") and i.target == "kvstore.keys" for i in IMPORTS)


def test_client_imports_nothing_of_the_node_nor_the_tiers() -> None:
    bad = [
        f"{_where(i)}: {i.importer} imports {i.target}" + (f" ({', '.join(i.names)})" if i.names != ("",) else "")
        for i in IMPORTS
        if _package(i.importer) == "client"
        and (i.target == "kvstore.node" or i.target.startswith(("kvstore.node.", "tiers")) or i.target == "tiers")
    ]
    assert not bad, f"client/ must depend only on the wire and shared modules ({len(bad)}):\n" + "\n".join(bad)


def _private(i: Import) -> str | None:
    """The private name of another package that ``i`` takes, if any."""
    if _package(i.target) == _package(i.importer):
        return None
    parts = i.target.split(".")
    for part in parts[1:]:
        if part.startswith("_") and not part.startswith("__"):
            return i.target
    for n in i.names:
        if n.startswith("_") and not n.startswith("__"):
            return f"{i.target}.{n}"
    return None


def test_client_takes_no_private_name_of_another_package() -> None:
    bad = [
        f"{_where(i)}: {i.importer} imports {name}"
        for i in IMPORTS
        if _package(i.importer) == "client" and (name := _private(i)) is not None
    ]
    assert not bad, f"client/ uses private names of other packages ({len(bad)}):\n" + "\n".join(bad)


TOOLS = ("kvstore.bench", "kvstore.demo", "kvstore.sim", "kvstore.traces")
PRODUCT = (
    "client",
    "tiers",
    "gpu_agent",
    "protos",
    "kvstore.node",
    "kvstore.cluster",
    "kvstore.conductor",
    "kvstore.dashboard",
    "kvstore.local",
)
ENTRY_POINTS = ("kvstore.cli", "kvstore.__main__")  # the command line dispatches to the tools


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _product(module: str) -> bool:
    root = module.count(".") == 1 and module.startswith("kvstore.") or module == "kvstore"
    return _under(module, PRODUCT) or (root and not _under(module, TOOLS) and module not in ENTRY_POINTS)


def test_the_product_imports_no_tool_and_holds_none() -> None:
    bad = [
        f"{_where(i)}: {i.importer} imports {i.target}"
        for i in IMPORTS
        if _product(i.importer) and _under(i.target, TOOLS)
    ]
    assert not bad, f"the product must not depend on demos, benchmarks or simulators ({len(bad)}):\n" + "\n".join(bad)
    tools = [m for m in MODULES if _product(m) and any(w in m.rsplit(".", 1)[-1] for w in ("bench", "demo"))]
    assert not tools, (
        f"demo or benchmark modules inside product packages: {tools} (they live in kvstore/bench, kvstore/demo)"
    )
    assert _product("kvstore.node.server") and _product("kvstore.keys") and not _product("kvstore.cli")
    assert not _product("kvstore.bench.sdk") and not _product("kvstore.demo.engine") and not _product("kvstore.sim")


def test_kvstore_root_keeps_at_most_14_modules() -> None:
    root = sorted(p.name for p in (ROOT / "kvstore").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, (
        f"kvstore/ root has {len(root)} modules, at most {MAX_ROOT_MODULES}: {', '.join(root)}"
    )


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _parent_packages(module: str) -> Iterator[str]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first."""
    parts = module.split(".")
    for k in range(1, len(parts)):
        yield ".".join(parts[:k])


def eager_edges() -> dict[str, set[str]]:
    """Module-level imports, plus the package ``__init__`` modules they run first (those of
    other packages: the importer's own packages are already being imported)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if not i.eager or i.target == i.importer:
            continue
        edges[i.importer].add(i.target)
        mine = set(_parent_packages(i.importer))
        edges[i.importer] |= {
            p for p in _parent_packages(i.target) if p in MODULES and p not in mine and p != i.importer
        }
    return edges


def test_no_import_cycle_between_files() -> None:
    edges = eager_edges()
    lines = []
    for comp in _cycles(edges):
        members = set(comp)
        lines.append(f"cycle of {len(comp)} modules: {', '.join(comp)}")
        for i in IMPORTS:
            if i.eager and i.importer in members and i.target != i.importer:
                via = [t for t in (i.target, *_parent_packages(i.target)) if t in members and t in edges[i.importer]]
                if via:
                    lines.append(f"    {_where(i)}: {i.importer} -> {via[0]}")
    assert not lines, "module-level import cycles (break them, or import lazily where the use is):\n" + "\n".join(lines)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert list(_parent_packages("a.b.c")) == ["a", "a.b"]


LAYERS: tuple[tuple[str, ...], ...] = (
    ("protos", "kvstore"),  # the wire and the vocabulary (the kvstore/ root modules)
    ("tiers",),
    ("kvstore.node",),
    ("kvstore.cluster",),
    ("client",),
    ("gpu_agent", "gpu_agent.vllm", "gpu_agent.lmcache", "gpu_agent.sglang"),
    ("kvstore.conductor", "kvstore.dashboard"),
    ("kvstore.local",),
    ("kvstore.bench", "kvstore.demo", "kvstore.sim", "kvstore.traces"),  # the tools
    ("kvstore.cli",),  # the command line, the composition root
)
"""Packages, lowest first.  A package may import its own layer and those below."""


def layer_package(module: str) -> str:
    """The :data:`LAYERS` package of a module: its sub-package (``kvstore.node``,
    ``gpu_agent.vllm``), ``kvstore.cli`` for the command line, else its top package."""
    if module in ENTRY_POINTS:
        return "kvstore.cli"
    parts = module.split(".")
    if len(parts) > 1 and parts[0] in ("kvstore", "gpu_agent") and (ROOT / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


LAYER_OF = {p: n for n, layer in enumerate(LAYERS) for p in layer}


def package_graph() -> dict[tuple[str, str], list[Import]]:
    """(importer package, imported package) → the imports behind that arrow."""
    out: dict[tuple[str, str], list[Import]] = {}
    for i in IMPORTS:
        a, b = layer_package(i.importer), layer_package(i.target)
        if a != b:
            out.setdefault((a, b), []).append(i)
    return out


def test_every_package_has_a_layer() -> None:
    packages = {layer_package(m) for m in MODULES}
    assert packages - set(LAYER_OF) == set(), f"packages with no layer in LAYERS: {packages - set(LAYER_OF)}"
    assert layer_package("kvstore.node.server") == "kvstore.node" and layer_package("kvstore.keys") == "kvstore"
    assert (
        layer_package("gpu_agent.vllm.scheduler") == "gpu_agent.vllm" and layer_package("kvstore.cli") == "kvstore.cli"
    )


def test_no_package_imports_one_above_it() -> None:
    bad = [
        f"{_where(i)}: {i.importer} imports {i.target} ({a}, layer {LAYER_OF[a]}, below {b}, layer {LAYER_OF[b]})"
        for (a, b), found in sorted(package_graph().items())
        if LAYER_OF[a] < LAYER_OF[b]
        for i in found
    ]
    assert not bad, f"imports running up the layers ({len(bad)}):\n" + "\n".join(bad)


if __name__ == "__main__":
    graph = package_graph()
    up = 0
    for layer in reversed(LAYERS):
        for pkg in layer:
            targets = sorted((b for (a, b) in graph if a == pkg), key=lambda b: (-LAYER_OF[b], b))
            marks = []
            for b in targets:
                lazy = "" if any(i.eager for i in graph[(pkg, b)]) else " (lazy)"
                wrong = LAYER_OF[pkg] < LAYER_OF[b]
                up += wrong
                marks.append(f"{b}{lazy}{'  <-- UP' if wrong else ''}")
            print(f"{LAYER_OF[pkg]}  {pkg:<18} -> {', '.join(marks) or '-'}")
    print(f"{up} arrows run up the layers")
    raise SystemExit(1 if up else 0)
