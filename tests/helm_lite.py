"""A small, strict renderer for the subset of Helm's template language that
``deploy/helm/kvstore`` uses, so the chart is checked without a helm binary.

Supported, with Go text/template semantics:

* text, and actions ``{{ ... }}`` with the trim markers ``{{- `` and `` -}}``;
  comments ``{{/* ... */}}``;
* ``if PIPELINE`` / ``else`` / ``end`` (Go truthiness: false, 0, "", empty list or map
  and a missing value are false), ``range $k, $v := PIPELINE`` / ``end`` over a map
  (sorted keys) or a list;
* operands ``.Values.a.b``, ``.Release.Name|Namespace|Service``,
  ``.Chart.Name|Version|AppVersion``, ``$var``, ``"string"``, integers, true/false;
* functions ``quote``, ``toJson``, ``toYaml``, ``indent N``, ``nindent N``,
  ``add A B...``, ``default D``, in pipelines (``X | f a`` is ``f a X``), and
  ``fail "message"`` (raises :class:`ChartFailed`, as ``helm`` refuses to render).

Anything else — another function or keyword, ``include``/``define``, a value missing
from the values, a number Helm would print in exponent form (values are float64 in
Helm: 1000000 prints as 1e+06), a string ``quote`` or ``toJson`` would escape — raises
:class:`TemplateError` instead of rendering something Helm might not.  Where
``helm-python-sdk`` is installed, tests/unit/test_deploy.py renders with real Helm too
and compares.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


class TemplateError(Exception):
    pass


class ChartFailed(TemplateError):
    """The chart itself refused the values (``fail``): the message is the chart's."""


_ACTION = re.compile(r"\{\{(-[ \t\r\n])?(.*?)([ \t\r\n]-)?\}\}", re.S)
_WS = " \t\r\n"
_SAFE_STR = re.compile(r"[\x20-\x7e]*")  # printable ASCII: Go's %q and json.Marshal add no escapes but \" and \\


# -- parsing ------------------------------------------------------------------------------
class _Node:
    pass


class _Text(_Node):
    def __init__(self, text: str) -> None:
        self.text = text


class _Action(_Node):
    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline


class _If(_Node):
    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline
        self.then: list[_Node] = []
        self.other: list[_Node] = []


class _Range(_Node):
    def __init__(self, key: str | None, value: str, pipeline: str) -> None:
        self.key, self.value, self.pipeline = key, value, pipeline
        self.body: list[_Node] = []


def _lex(src: str, name: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", body)] with the trim markers applied to the text."""
    out: list[tuple[str, str]] = []
    pos = 0
    trim_next = False
    for m in _ACTION.finditer(src):
        text = src[pos : m.start()]
        if trim_next:
            text = text.lstrip(_WS)
        if m.group(1):
            text = text.rstrip(_WS)
        out.append(("text", text))
        body = m.group(2).strip()
        if "{{" in body:
            raise TemplateError(f"{name}: unbalanced action near {m.group(0)[:60]!r}")
        out.append(("action", body))
        trim_next = bool(m.group(3))
        pos = m.end()
    tail = src[pos:]
    if "{{" in tail or "}}" in tail:
        raise TemplateError(f"{name}: unbalanced braces in {tail[:60]!r}")
    out.append(("text", tail.lstrip(_WS) if trim_next else tail))
    return out


def parse(src: str, name: str = "template") -> list[_Node]:
    root: list[_Node] = []
    stack: list[tuple[_Node | None, list[_Node]]] = [(None, root)]
    for kind, body in _lex(src, name):
        cur = stack[-1][1]
        if kind == "text":
            if body:
                cur.append(_Text(body))
            continue
        if body.startswith("/*"):
            if not body.endswith("*/"):
                raise TemplateError(f"{name}: unterminated comment {body[:40]!r}")
            continue
        word, _, rest = body.partition(" ")
        if word == "if":
            node = _If(rest.strip())
            cur.append(node)
            stack.append((node, node.then))
        elif word == "else":
            owner = stack[-1][0]
            if not isinstance(owner, _If) or rest.strip() or stack[-1][1] is owner.other:
                raise TemplateError(f"{name}: unsupported or misplaced {{{{ {body} }}}} (only a plain else inside if)")
            stack[-1] = (owner, owner.other)
        elif word == "range":
            m = re.fullmatch(r"(\$\w+)(?:\s*,\s*(\$\w+))?\s*:=\s*(.+)", rest.strip())
            if not m:
                raise TemplateError(
                    f"{name}: only `range $k, $v := PIPELINE` or `range $v := PIPELINE` is supported, got {body!r}"
                )
            key, value = (m.group(1), m.group(2)) if m.group(2) else (None, m.group(1))
            node = _Range(key, value, m.group(3))
            cur.append(node)
            stack.append((node, node.body))
        elif word == "end":
            if len(stack) == 1 or rest.strip():
                raise TemplateError(f"{name}: unexpected {{{{ {body} }}}}")
            stack.pop()
        elif word in ("define", "template", "block", "with", "include", "tpl", "break", "continue"):
            raise TemplateError(f"{name}: {word!r} is not supported by this renderer")
        else:
            cur.append(_Action(body))
    if len(stack) != 1:
        raise TemplateError(f"{name}: missing {{{{ end }}}}")
    return root


# -- evaluation ---------------------------------------------------------------------------
_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(\$\w*(?:\.\w+)*)|(\.\w+(?:\.\w+)*)|(-?\d+)|(\w+))')


def _tokens(cmd: str, name: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    cmd = cmd.strip()
    while pos < len(cmd):
        m = _TOKEN.match(cmd, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"{name}: cannot parse {cmd[pos:]!r}")
        kind = ("string", "var", "field", "int", "ident")[next(i for i in range(5) if m.group(i + 1) is not None)]
        out.append((kind, m.group(m.lastindex or 0).strip()))
        pos = m.end()
    return out


def _split_pipeline(pipeline: str) -> list[str]:
    parts, cur, in_str, esc = [], "", False, False
    for ch in pipeline:
        if in_str:
            cur += ch
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
            cur += ch
        elif ch == "|":
            parts.append(cur)
            cur = ""
        elif ch in "()":
            raise TemplateError(f"parentheses are not supported: {pipeline!r}")
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


def _truthy(v: Any) -> bool:
    if v is MISSING or v is None:
        return False
    if isinstance(v, (bool, int, float, str, list, dict)):
        return bool(v)
    raise TemplateError(f"truthiness of {type(v).__name__}")


def _check_number(v: int | float) -> str:
    """How Helm prints a number from values.yaml (a float64, %v): refuse what it would
    print differently from Python (exponent form from 1e6 up, fractions)."""
    if abs(v) >= 1_000_000 or (isinstance(v, float) and v and abs(v) < 1e-4):
        raise TemplateError(
            f"{v} would print as {v:.6g} in Helm (values are float64): keep it in [1e-4, 1e6) or quote it"
        )
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)  # both shortest round-trip digits in this range


def _print(v: Any) -> str:
    if v is MISSING:
        raise TemplateError("a value used in the template is missing from the values")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, _Int64):
        return str(int(v))
    if isinstance(v, (int, float)):
        return _check_number(v)
    if isinstance(v, str):
        return v
    raise TemplateError(f"printing a {type(v).__name__} directly ({v!r}): use toYaml or toJson")


class _Int64(int):
    """The result of sprig's ``add``: an int64, printed as plain digits."""


def _string_literal(tok: str) -> str:
    body = tok[1:-1]
    if "\\" in body:
        raise TemplateError(f"escapes in string literals are not supported: {tok}")
    return body


def _fn_quote(*args: Any) -> str:
    out = []
    for a in args:
        s = _print(a) if not isinstance(a, str) else a
        if not _SAFE_STR.fullmatch(s) or '"' in s or "\\" in s:
            raise TemplateError(f"quote of {s!r}: Go's %q would escape it")
        out.append(f'"{s}"')
    return " ".join(out)


def _fn_to_json(v: Any) -> str:
    def walk(x: Any) -> Any:
        if isinstance(x, bool) or x is None:
            return x
        if isinstance(x, float):
            if x.is_integer() and abs(x) < 1e16:
                return int(x)
            if "e" in repr(x):  # Go's json.Marshal writes plain digits up to 1e21, Python switches earlier
                raise TemplateError(f"toJson of {x!r}: Go and Python would print it differently")
            return x
        if isinstance(x, int):
            if abs(x) >= 10**21:
                raise TemplateError(f"toJson of {x}: Go prints it in exponent form")
            return x
        if isinstance(x, str):
            if not _SAFE_STR.fullmatch(x) or any(c in x for c in '<>&"\\'):
                raise TemplateError(f"toJson of {x!r}: Go would escape it")
            return x
        if isinstance(x, list):
            return [walk(i) for i in x]
        if isinstance(x, dict):
            return {str(k): walk(i) for k, i in x.items()}
        raise TemplateError(f"toJson of {type(x).__name__}")

    if v is MISSING:
        raise TemplateError("toJson of a missing value")
    return json.dumps(walk(v), separators=(",", ":"), sort_keys=True)


def _fn_to_yaml(v: Any) -> str:
    if v is MISSING:
        raise TemplateError("toYaml of a missing value")
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def _int_arg(n: Any, fn: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, float)) or (isinstance(n, float) and not n.is_integer()):
        raise TemplateError(f"{fn}: expected a whole number, got {n!r}")
    return int(n)


def _fn_indent(n: Any, s: Any) -> str:
    pad = " " * _int_arg(n, "indent")
    return pad + str(s).replace("\n", "\n" + pad)


def _fn_nindent(n: Any, s: Any) -> str:
    return "\n" + _fn_indent(n, s)


def _fn_add(*args: Any) -> _Int64:
    if not args:
        raise TemplateError("add needs arguments")
    return _Int64(sum(_int_arg(a, "add") for a in args))


def _fn_default(d: Any, v: Any = MISSING) -> Any:
    return v if _truthy(v) else d


def _fn_fail(message: Any, *rest: Any) -> str:
    if rest or not isinstance(message, str):
        raise TemplateError("fail takes one string")
    raise ChartFailed(message)


FUNCS = {
    "quote": _fn_quote,
    "toJson": _fn_to_json,
    "toYaml": _fn_to_yaml,
    "indent": _fn_indent,
    "nindent": _fn_nindent,
    "add": _fn_add,
    "default": _fn_default,
    "fail": _fn_fail,
}


class Renderer:
    def __init__(self, context: Mapping[str, Any], name: str) -> None:
        self.ctx = context
        self.name = name

    def _operand(self, kind: str, tok: str, scope: Mapping[str, Any]) -> Any:
        if kind == "string":
            return _string_literal(tok)
        if kind == "int":
            return int(tok)
        if kind == "ident" and tok in ("true", "false"):
            return tok == "true"
        if kind == "field":
            parts = tok[1:].split(".")
            if parts[0] not in self.ctx:
                raise TemplateError(f"{self.name}: unknown object .{parts[0]}")
            return self._walk(self.ctx[parts[0]], parts[1:], tok)
        if kind == "var":
            name, *rest = tok.split(".")
            if name not in scope:
                raise TemplateError(f"{self.name}: undefined variable {name}")
            return self._walk(scope[name], rest, tok)
        raise TemplateError(f"{self.name}: unsupported operand {tok!r}")

    def _walk(self, v: Any, parts: list[str], tok: str) -> Any:
        for p in parts:
            if not isinstance(v, Mapping):
                raise TemplateError(f"{self.name}: {tok}: cannot take .{p} of {type(v).__name__}")
            v = v.get(p, MISSING)
            if v is MISSING:
                return MISSING if p == parts[-1] else self._fail_missing(tok)
        return v

    def _fail_missing(self, tok: str) -> Any:
        raise TemplateError(f"{self.name}: {tok}: a parent of this value is missing")

    def eval(self, pipeline: str, scope: Mapping[str, Any]) -> Any:
        value: Any = MISSING
        for i, cmd in enumerate(_split_pipeline(pipeline)):
            toks = _tokens(cmd, self.name)
            if not toks:
                raise TemplateError(f"{self.name}: empty command in {pipeline!r}")
            head_kind, head = toks[0]
            if head_kind == "ident" and head not in ("true", "false"):
                if head not in FUNCS:
                    raise TemplateError(f"{self.name}: function {head!r} is not supported by this renderer")
                args = [self._operand(k, t, scope) for k, t in toks[1:]]
                if i > 0:
                    args.append(value)
                value = FUNCS[head](*args)
            else:
                if i > 0 or len(toks) != 1:
                    raise TemplateError(f"{self.name}: cannot parse command {cmd!r}")
                value = self._operand(head_kind, head, scope)
        return value

    def render(self, nodes: list[_Node], scope: Mapping[str, Any]) -> str:
        out: list[str] = []
        for n in nodes:
            if isinstance(n, _Text):
                out.append(n.text)
            elif isinstance(n, _Action):
                out.append(_print(self.eval(n.pipeline, scope)))
            elif isinstance(n, _If):
                out.append(self.render(n.then if _truthy(self.eval(n.pipeline, scope)) else n.other, scope))
            elif isinstance(n, _Range):
                coll = self.eval(n.pipeline, scope)
                if coll is MISSING or coll is None:
                    continue
                if isinstance(coll, Mapping):
                    items = sorted(coll.items())
                elif isinstance(coll, list):
                    items = list(enumerate(coll))
                else:
                    raise TemplateError(f"{self.name}: range over {type(coll).__name__}")
                for k, v in items:
                    inner = dict(scope)
                    if n.key:
                        inner[n.key] = k
                    inner[n.value] = v
                    out.append(self.render(n.body, inner))
        return "".join(out)


# -- the chart ----------------------------------------------------------------------------
def merge_values(base: Any, override: Any) -> Any:
    """Helm's coalescing of user values over the chart's: maps merge, the rest replaces."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge_values(base.get(k), v) if k in base else v
        return out
    return override


def render_chart(
    chart_dir: str | Path,
    values: Mapping[str, Any] | None = None,
    *,
    release: str = "kvstore",
    namespace: str = "default",
) -> dict[str, str]:
    """{template path: rendered text} for every manifest template, as ``helm template`` does."""
    chart_dir = Path(chart_dir)
    meta = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    defaults = yaml.safe_load((chart_dir / "values.yaml").read_text()) or {}
    ctx = {
        "Values": merge_values(defaults, dict(values or {})),
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {"Name": meta["name"], "Version": meta["version"], "AppVersion": meta.get("appVersion", "")},
    }
    out = {}
    for path in sorted((chart_dir / "templates").iterdir()):
        if path.name.startswith("_") or path.name == "NOTES.txt":
            continue  # partials (define/include are unsupported, so any use fails) and notes
        if path.suffix not in (".yaml", ".yml"):
            raise TemplateError(f"unexpected file in templates/: {path.name}")
        rel = f"{meta['name']}/templates/{path.name}"
        out[rel] = Renderer(ctx, rel).render(parse(path.read_text(), rel), {})
    return out
