"""Every ``kvstore bench ...`` the README and the docs show still parses (issue 37: the
subcommands came in, the flags of earlier releases stay for a release).

Each invocation, in backticks or on a line of a code block, is parsed by
:func:`kvstore.bench.cli.parse`, the parser ``kvstore bench`` runs, with its placeholders
filled in (``N`` a number, ``URL`` an address, ``[--flag]`` given); nothing is run.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvstore.bench import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TICKED = re.compile(r"`(?:\.venv[\w-]*/bin/)?kvstore bench([^`]*)`")
BLOCK_LINE = re.compile(r"^\s*(?:\.venv[\w-]*/bin/)?kvstore bench(.*?)(?:\s+#.*)?$")
FILL = {
    "N": "4",
    "T": "1024",
    "R,...": "1,2",
    "URL": "http://127.0.0.1:9",
    "L,H,D,DTYPE": "2,2,64,float16",
    "PNG": "out.png",
}


def invocations() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        in_block = False
        for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            found = [m.group(1) for m in TICKED.finditer(line)]
            if in_block and (m := BLOCK_LINE.match(line)):
                found.append(m.group(1))
            out += [(f"{doc.relative_to(ROOT)}:{i}", args.strip()) for args in found]
    return out


def argv(args: str) -> list[str] | None:
    """The arguments with placeholders filled in; None for a placeholder subcommand."""
    if "SUBCOMMAND" in args or "--help" in args:
        return None
    args = re.sub(r"\[([^\[\]]*)\]", r"\1", args).replace("\\|", "|")  # optional parts given
    words = shlex.split(args)
    return [FILL.get(w, w) for w in words if w != "..."]


def test_the_docs_show_every_subcommand() -> None:
    shown = {a.split()[0] for _, a in invocations() if a and not a.startswith("-")}
    assert {
        "engine",
        "index",
        "latency",
        "connector",
        "gpu",
        "placement",
        "cluster-sim",
        "conductor-sim",
        "serving",
    } <= shown


@pytest.mark.parametrize(("where", "args"), invocations(), ids=lambda x: str(x)[:60])
def test_a_documented_bench_command_parses(where: str, args: str, capsys: pytest.CaptureFixture[str]) -> None:
    words = argv(args)
    if words is None:
        return
    try:
        parsed = cli.parse(words)
    except SystemExit as e:
        err = capsys.readouterr().err
        if not (words[-1].startswith("--") and "expected one argument" in err):
            pytest.fail(f"{where}: `kvstore bench {args}` does not parse ({e.code}): {err}")
        parsed = cli.parse([*words, "x"])  # prose naming a flag (`... --records`): it takes a value
    assert callable(parsed.fn), where
