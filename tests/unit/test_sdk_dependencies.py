"""The SDK depends only on the wire: ``client/`` imports nothing from the node runtime
(``kvstore.node``) or the tiers, the shared modules at the ``kvstore/`` root that both sides
use import neither, and no two SDK modules import each other (function-level imports
included: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ("kvstore/framing.py", "kvstore/shm.py", "kvstore/vocabulary.py", "kvstore/wire.py")
FORBIDDEN = ("kvstore.node", "tiers")
# The cluster router's two files are being moved onto the shared modules in their own change
# (their imports of kvstore.node.ledger and tiers.arena, and their mutual import); every other
# SDK module is held to the rule now.
PENDING: set[str] = set()  # files exempt while a change is under way (none now)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def sdk_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "client").glob("*.py"))


def offending(files: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for f in files:
        hits = sorted(m for m in imports(ROOT / f) if any(m == x or m.startswith(x + ".") for x in forbidden))
        if hits:
            bad[f] = hits
    return bad


def test_the_sdk_imports_nothing_from_the_node_or_the_tiers() -> None:
    files = [f for f in sdk_files() if f not in PENDING]
    assert "client/_core.py" in files and "client/_datachannel.py" in files
    assert offending(files, FORBIDDEN) == {}


def test_the_shared_modules_import_neither_side() -> None:
    assert offending(list(SHARED), (*FORBIDDEN, "client")) == {}


def test_no_import_cycle_among_sdk_modules() -> None:
    def module(f: str) -> str:
        return f.removesuffix(".py").replace("/", ".")

    names = {module(f): f for f in sdk_files() if f != "client/__init__.py"}
    deps = {m: {d for d in imports(ROOT / f) if d in names and d != m} for m, f in names.items()}
    reach = {m: set(ds) for m, ds in deps.items()}  # transitive closure (a dozen modules)
    changed = True
    while changed:
        changed = False
        for m in reach:
            more = set().union(*(reach[d] for d in reach[m])) - reach[m]
            if more:
                reach[m] |= more
                changed = True
    cycles = sorted((a, b) for a in reach for b in reach[a] if a < b and a in reach[b])
    assert [c for c in cycles if {names[c[0]], names[c[1]]} - PENDING] == []
