"""Every "§N" in the project names a section of docs/architecture.md.

Code and documents cite the architecture as "architecture §N" ("## N. Title" headings).
The original design document is not in the repository, so a reference to it (the word
DESIGN before a section sign) is an error, as is a section number with no heading.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SCANNED_DIRS = ["kvstore", "client", "tiers", "gpu_agent", "protos", "deploy", "scripts", "docs", "tests"]
SCANNED_FILES = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "pyproject.toml"]
TEXT_SUFFIXES = {
    ".py",
    ".pyi",
    ".proto",
    ".md",
    ".yaml",
    ".yml",
    ".toml",
    ".sh",
    ".tpl",
    ".txt",
    ".html",
    ".js",
    ".css",
}
SKIP_PARTS = {"__pycache__", "node_modules"}
HEADING = re.compile(r"^## (\d+)\. \S", re.M)
SECTION = re.compile(r"§\s?(\d+)")
OLD = "DESIGN" + " §"  # spelt in two parts so that this file does not match itself


def sections() -> list[int]:
    return [int(n) for n in HEADING.findall(ARCHITECTURE.read_text(encoding="utf-8"))]


def scanned() -> list[Path]:
    paths = [ROOT / f for f in SCANNED_FILES if (ROOT / f).is_file()]
    for d in SCANNED_DIRS:
        paths += [
            p
            for p in sorted((ROOT / d).rglob("*"))
            if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name == "Dockerfile") and not SKIP_PARTS & set(p.parts)
        ]
    return paths


def references() -> list[tuple[str, int, int, str]]:
    """(file, line, section, the line) for every § reference in the scanned files."""
    out = []
    for p in scanned():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), start=1):
            for m in SECTION.finditer(line):
                out.append((p.relative_to(ROOT).as_posix(), i, int(m.group(1)), line.strip()))
    return out


def test_architecture_sections_are_numbered_in_order() -> None:
    got = sections()
    assert got, f"{ARCHITECTURE} has no '## N. Title' headings"
    assert got == list(range(1, len(got) + 1)), f"section numbers must run 1..N once each, got {got}"


def test_every_section_reference_resolves() -> None:
    known = set(sections())
    refs = references()
    assert refs, "no § references found at all: the scan is looking in the wrong place"
    bad = [
        f"{f}:{line}: §{n} is not a heading of docs/architecture.md: {text}"
        for f, line, n, text in refs
        if n not in known
    ]
    assert not bad, "\n".join(bad)


def test_no_reference_to_the_design_document_remains() -> None:
    bad = []
    for p in scanned():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += [
            f"{p.relative_to(ROOT).as_posix()}:{i}: {line.strip()}"
            for i, line in enumerate(text.splitlines(), start=1)
            if OLD in line
        ]
    assert not bad, (
        f"{len(bad)} reference(s) to a design document not in the repository (cite architecture §N):\n" + "\n".join(bad)
    )
