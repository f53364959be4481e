"""Every Python block in the README runs as written, against a real node, and prints what
the README shows (issue 16 #5).

Conventions (README.md, section Tests):

* a ```` ```text ```` block right after a Python block is that block's expected output;
  a Python block without one must print nothing;
* ``<!-- doctest: skip: REASON -->`` on the line before a Python block leaves it out (the
  "Use with vLLM" block: it needs vLLM and a model; ``tests/vllm`` runs the connector).

The blocks run in order, each as its own process, with ``HOME`` pointing at a directory
whose ``~/.local/share/kvstore`` is the node's data directory: the default socket the
README uses is the node's.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, NodeProcess, clean_env, start_clean, stop_clean

SKIP = re.compile(r"<!--\s*doctest:\s*skip:\s*(?P<why>[^>]+?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")


@dataclasses.dataclass
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    expected: str  # stdout
    skip: str  # why not run ("": run)


def python_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        lang, start = m["lang"], i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang == "python":
            skip = SKIP.search(lines[start - 1]) if start else None
            blocks.append(Block(start + 1, "\n".join(body) + "\n", "", skip["why"] if skip else ""))
        elif lang == "text" and blocks and blocks[-1].expected == "" and _only_blank(lines, blocks[-1].line, start):
            blocks[-1].expected = "\n".join(body) + "\n"
    return blocks


def _only_blank(lines: list[str], py_line: int, text_start: int) -> bool:
    """True if nothing but blank lines lies between the Python block (fence at ``py_line``) and ``text_start``."""
    j = py_line  # the line after the python fence, 0-based
    while j < text_start and not lines[j].startswith("```"):
        j += 1
    return all(not ln.strip() for ln in lines[j + 1 : text_start])


BLOCKS = python_blocks((ROOT / "README.md").read_text())


def test_the_parser_finds_the_blocks_and_the_marker() -> None:
    assert len(BLOCKS) >= 4
    assert [b.skip != "" for b in BLOCKS].count(True) == 1, "only the vLLM block is marked doctest: skip"
    skipped = next(b for b in BLOCKS if b.skip)
    assert "from vllm import" in skipped.code and "vLLM" in skipped.skip
    quick = BLOCKS[0]
    assert "with KVClient(" in quick.code and quick.expected.strip()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, NodeProcess]]:
    h = tmp_path_factory.mktemp("home")
    n = start_clean(h / ".local" / "share" / "kvstore", "--dram", "256MiB", "--nvme", "256MiB")
    yield h, n
    stop_clean(n)


RUN = [b for b in BLOCKS if not b.skip]  # the marked block is left out, not skipped (tests/vllm covers it)


@pytest.mark.parametrize("block", RUN, ids=[f"README.md:{b.line}" for b in RUN])
def test_readme_block_runs_and_prints_what_the_readme_shows(block: Block, home: tuple[Path, NodeProcess]) -> None:
    h, _ = home
    p = subprocess.run(
        [sys.executable, "-c", block.code],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=clean_env(HOME=str(h), PYTHONPATH=str(ROOT)),
    )
    assert p.returncode == 0, f"README.md:{block.line} failed:\n{p.stderr}"
    assert p.stdout == block.expected, (
        f"README.md:{block.line} printed:\n{p.stdout}\nthe README shows:\n{block.expected}"
    )
