"""Fronts: which engine serves a request, and how a request goes through them.

A front is what sits before the engines in a fleet: here it runs inside the benchmark's
client (no extra hop to measure), and the request scheduler of the conductor plugs in
the same way (a :class:`Front` with its own :meth:`Front.route`).

* :class:`RoundRobin`: the next live engine, in turn (``baseline``, ``pool``, ``--target``).
* :class:`PrefillDecode`: as vLLM's disaggregated-serving proxies do, each request goes
  first to a prefill engine (non-streaming, ``max_tokens=1``; its response carries the
  connector's ``kv_transfer_params``), then to a decode engine with those
  ``kv_transfer_params``, which streams the answer.  Prefill and decode engines are each
  taken in turn.

An engine a request could not reach (connection refused or reset) is marked dead by the
runner and skipped from then on; the front fails only when none of a role is left.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from kvstore.bench.serving.fleet import Engine


class NoEngine(RuntimeError):
    """No live engine of the role a request needs."""


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one request goes: ``prefill`` (None: straight to ``decode``) then ``decode``."""

    decode: Engine
    prefill: Engine | None = None


class Front:
    """Picks a :class:`Route` per request; owns nothing but its turn counters."""

    name = "front"

    def route(self, index: int) -> Route:
        raise NotImplementedError


def _next_live(cycle: itertools.cycle[Engine], n: int, role: str) -> Engine:
    for _ in range(n):
        e = next(cycle)
        if e.alive:
            return e
    raise NoEngine(f"no live {role} engine left")


class RoundRobin(Front):
    name = "round-robin"

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.engines = list(engines)
        self._cycle = itertools.cycle(self.engines)

    def route(self, index: int) -> Route:
        return Route(_next_live(self._cycle, len(self.engines), "serving"))


class PrefillDecode(Front):
    name = "prefill-decode"

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.prefill = [e for e in engines if e.role == "prefill"]
        self.decode = [e for e in engines if e.role == "decode"]
        if not self.prefill or not self.decode:
            raise ValueError("a prefill-decode front needs prefill and decode engines")
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)

    def route(self, index: int) -> Route:
        return Route(
            decode=_next_live(self._d, len(self.decode), "decode"),
            prefill=_next_live(self._p, len(self.prefill), "prefill"),
        )


def front_for(engines: Sequence[Engine]) -> Front:
    """The front a fleet's roles call for."""
    if any(e.role == "prefill" for e in engines):
        return PrefillDecode(engines)
    return RoundRobin(engines)
