"""The files and modules docs/architecture.md and CONTRIBUTING.md name exist.

Both documents describe the tree by name: paths in backticks (``kvstore/node/transfers.py``,
``gpu_agent/vllm/``, ``tests/unit/test_import_graph.py``) and dotted modules
(``kvstore.cluster.membership``).  A module that moved or went away leaves a name behind
that sends a reader to nothing; this finds every such name.  What counts:

* a backticked path that starts at one of the project's top-level directories and names
  a file (with a suffix) or a directory (ending in ``/``); ``*`` globs must match
  something; placeholders (``<...>``, ``{...}``, ``...``) are not paths;
* a backticked dotted name that starts with a project package (``kvstore.``, ``client.``,
  ``tiers.``, ``gpu_agent.``, ``protos.``): its longest prefix that is a module or package
  must be followed by at most one more part: nothing, or a name its source defines or imports.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "docs" / "architecture.md", ROOT / "CONTRIBUTING.md"]
TOP = ("kvstore", "client", "tiers", "gpu_agent", "protos", "deploy", "scripts", "tests", "docs", ".ci")
PACKAGES = ("kvstore", "client", "tiers", "gpu_agent", "protos")
TICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^(?:\./)?((?:{})/[\w./*-]*)$".format("|".join(re.escape(t) for t in TOP)))
DOTTED = re.compile(r"^((?:{})(?:\.\w+)+)$".format("|".join(PACKAGES)))


def _is_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file() or p.with_suffix(".pyi").is_file()


def _missing_path(path: str) -> bool:
    path = path.rstrip(".")
    if "*" in path:
        return not any(ROOT.glob(path.rstrip("/")))
    p = ROOT / path
    return not p.is_dir() if path.endswith("/") else not p.exists()


def _source(dotted: str) -> str:
    p = ROOT.joinpath(*dotted.split("."))
    for f in (p.with_suffix(".py"), p / "__init__.py", p.with_suffix(".pyi")):
        if f.is_file():
            return f.read_text(encoding="utf-8")
    return ""


def _missing_module(dotted: str) -> bool:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if _is_module(".".join(parts[:n])):
            if n == len(parts):
                return False
            # one attribute of the module, defined or imported there (a word of its source)
            return len(parts) - n > 1 or not re.search(rf"\b{re.escape(parts[n])}\b", _source(".".join(parts[:n])))
    return True


def names() -> list[tuple[str, int, str]]:
    out = []
    for doc in DOCS:
        for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
            for m in TICKED.finditer(line):
                text = m.group(1).strip()
                if any(c in text for c in "<>{} ") or "..." in text:
                    continue
                out.append((f"{doc.relative_to(ROOT).as_posix()}:{i}", i, text))
    return out


def test_the_scan_finds_names_of_both_kinds() -> None:
    got = [t for _, _, t in names()]
    assert sum(bool(PATH.match(t)) for t in got) > 50 and sum(bool(DOTTED.match(t)) for t in got) > 5
    assert _missing_path("kvstore/no_such_module.py") and not _missing_path("kvstore/node/transfers.py")
    assert _missing_module("kvstore.cluster.simbench") and not _missing_module("kvstore.cluster.membership")
    assert not _missing_module("kvstore.keys.chunk_keys") and _missing_module("kvstore.keys.chunk_keys.x")


def test_every_named_file_and_module_exists() -> None:
    bad = []
    for where, _line, text in names():
        if (m := PATH.match(text)) and _missing_path(m.group(1)):
            bad.append(f"{where}: `{text}` is not in the tree")
        elif DOTTED.match(text) and _missing_module(text):
            bad.append(f"{where}: `{text}` is no module (or attribute of one)")
    assert not bad, f"{len(bad)} names in the docs point at nothing:\n" + "\n".join(bad)
