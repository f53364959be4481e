"""The requests a serving benchmark sends: a Mooncake-format trace, scaled, with token ids.

A trace line says a prompt's length and the ids of its 512-token blocks (two requests
sharing an id at the same position share that block and every block before it); it holds
no text.  This module turns a slice of it into :class:`Work` items, pure functions of
the file and the options (no clock, no randomness beyond seeded generators):

* **tokens**: each hash id becomes ``block_tokens`` token ids drawn from a generator seeded
  by (``salt``, id), so equal ids give equal tokens (hence equal chunk keys in the store and
  equal blocks in vLLM's prefix cache) and different ids almost surely differ; a prompt
  is its blocks' tokens, the last block cut to the prompt's (scaled) length.
* **scaling**: ``block_tokens`` B rescales the trace's 512-token blocks to B tokens, and
  the input length with them (every block but the last is whole; the last keeps its
  share); output lengths are scaled by ``output_scale`` (default B/512) and kept at least
  ``min_output_tokens`` (so a request has inter-token intervals to measure).
* **arrivals** (open loop): the trace's timestamps, from the slice's first request, times
  ``time_scale``; or rescaled so the mean rate is ``rate`` requests/s.
* **slice**: ``sample`` F keeps the requests of a share F of the trace's sampling units
  (:func:`sample_units`; a unit is kept when a hash of its key falls below F), so a
  thinned trace keeps the reuse its requests have with each other (on Mooncake's trace a
  10 % sample keeps ~0.6 of blocks shared, as the whole trace has, where its first 200
  requests share 0.06).  The units are the trace's prefix trees (requests grouped by
  their first hash id), except that a tree holding more than half the requests (a
  conversation trace under one shared system prompt: every request is in it) is split
  below its shared prefix: into its sessions (``session_id``: a conversation, kept
  whole with its branches) and, for requests without one, into the subtrees under the
  prefix all of them share (split again while one holds more than half the trace).  A
  sample that no unit's hash falls into keeps the unit of the lowest hash, so a sample
  is never empty; ``Workload.sampled_by`` says which units it took.  Then ``window``
  (seconds of the trace, ``"A:B"``), then the first ``requests``.
* ``unique``: every request gets hash ids of its own (no prefix is shared: the no-reuse
  overhead run).
* **sessions**: a request's ``session_id`` is kept (the runner passes it to the connector
  as ``kv_transfer_params["session_id"]``), and the trace's ``close_session`` events of the
  slice's sessions become ``closes`` at their scaled times.

Bad trace lines (missing or ill-typed fields) are skipped and reported by line
(``Workload.skipped``); a trace left with no request is an error.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.traces.format import DEFAULT_BLOCK_TOKENS, Request, Trace


@dataclasses.dataclass(frozen=True, slots=True)
class Work:
    """One request to send: ``index`` in the slice, ``line_index`` in the trace's requests."""

    index: int
    arrival_s: float  # seconds after the run's start
    tokens: tuple[int, ...]
    output_tokens: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How the trace was turned into requests (reported in the JSON's ``scaling``)."""

    block_tokens: int = 16
    trace_block_tokens: int = DEFAULT_BLOCK_TOKENS
    output_scale: float | None = None  # None: block_tokens / trace_block_tokens
    min_output_tokens: int = 8
    max_output_tokens: int | None = None
    time_scale: float = 1.0
    rate: float | None = None  # requests/s; overrides time_scale
    requests: int | None = None
    window: tuple[float, float] | None = None  # seconds of the trace
    sample: float | None = None  # share of prefix trees kept
    unique: bool = False
    vocab: int = 32000
    salt: str = "kvstore-bench-serving"

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise InvalidArgument(f"--block-tokens must be positive, got {self.block_tokens}")
        if self.time_scale <= 0 or not math.isfinite(self.time_scale):
            raise InvalidArgument(f"--time-scale must be a positive number, got {self.time_scale}")
        if self.rate is not None and (self.rate <= 0 or not math.isfinite(self.rate)):
            raise InvalidArgument(f"--rate must be a positive number of requests per second, got {self.rate}")
        if self.requests is not None and self.requests <= 0:
            raise InvalidArgument(f"--requests must be positive, got {self.requests}")
        if self.min_output_tokens < 1:
            raise InvalidArgument(f"--min-output-tokens must be at least 1, got {self.min_output_tokens}")
        if self.output_scale is not None and self.output_scale <= 0:
            raise InvalidArgument(f"--output-scale must be positive, got {self.output_scale}")
        if self.sample is not None and not (0 < self.sample <= 1):
            raise InvalidArgument(f"--sample must be a share in (0, 1], got {self.sample}")
        if self.window is not None and not (0 <= self.window[0] < self.window[1]):
            raise InvalidArgument(f"--window must be A:B seconds with 0 <= A < B, got {self.window}")
        if self.vocab < 100:
            raise InvalidArgument(f"the model's vocabulary is too small to synthesise prompts ({self.vocab} tokens)")

    @property
    def out_scale(self) -> float:
        return self.output_scale if self.output_scale is not None else self.block_tokens / self.trace_block_tokens

    def to_json(self) -> dict[str, object]:
        return {
            "block_tokens": self.block_tokens,
            "trace_block_tokens": self.trace_block_tokens,
            "input_scale": self.block_tokens / self.trace_block_tokens,
            "output_scale": self.out_scale,
            "min_output_tokens": self.min_output_tokens,
            "max_output_tokens": self.max_output_tokens,
            "time_scale": self.time_scale,
            "rate": self.rate,
            "requests": self.requests,
            "window_s": list(self.window) if self.window else None,
            "sample": self.sample,
            "unique_prompts": self.unique,
            "salt": self.salt,
        }


def parse_window(text: str) -> tuple[float, float]:
    """``"A:B"`` (seconds of the trace) → (A, B)."""
    try:
        a, b = text.split(":")
        return float(a or 0), float(b)
    except ValueError:
        raise InvalidArgument(f"--window must be A:B (seconds of the trace), got {text!r}") from None


class TokenSynth:
    """Token ids of hash-id blocks: deterministic per (salt, id), cached."""

    def __init__(self, block_tokens: int, vocab: int, salt: str) -> None:
        self.block_tokens = block_tokens
        self.high = max(2, vocab - 1)  # ids 1 .. vocab-2: clear of special ids at either end
        self.salt = salt.encode()

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019  # one synthesiser per run; the cache is the point
    def block(self, hash_id: int) -> tuple[int, ...]:
        seed = xxhash.xxh64_intdigest(self.salt + hash_id.to_bytes(8, "little"))
        return tuple(np.random.default_rng(seed).integers(1, self.high, self.block_tokens).tolist())

    def prompt(self, hash_ids: Sequence[int], length: int) -> tuple[int, ...]:
        out: list[int] = []
        for h in hash_ids:
            out.extend(self.block(h))
        return tuple(out[:length])


@dataclasses.dataclass(frozen=True)
class Workload:
    """A trace slice as requests (see the module docstring)."""

    trace: str
    scaling: Scaling
    items: tuple[Work, ...]
    skipped: tuple[str, ...]  # bad trace lines, each naming its line
    closes: tuple[tuple[float, str], ...] = ()  # (seconds after the start, session id): close_session events
    sampled_by: str | None = None  # with a sample: "prefix trees", or "sessions and subtrees below a shared root"

    @property
    def duration_s(self) -> float:
        return self.items[-1].arrival_s if self.items else 0.0

    @property
    def offered_rps(self) -> float:
        """Arrivals per second between the first and the last (``rate`` when it was set)."""
        return (len(self.items) - 1) / self.duration_s if self.duration_s > 0 else float("inf")

    @property
    def max_len(self) -> int:
        """The longest prompt plus its output (the engines' ``max_model_len`` must hold it)."""
        return max(len(w.tokens) + w.output_tokens for w in self.items)

    def summary(self) -> dict[str, object]:
        n_in = [len(w.tokens) for w in self.items]
        n_out = [w.output_tokens for w in self.items]
        return {
            "path": self.trace,
            "requests": len(self.items),
            "skipped_lines": list(self.skipped),
            "duration_s": round(self.duration_s, 3),
            "offered_rps": round(self.offered_rps, 3) if math.isfinite(self.offered_rps) else None,
            "prompt_tokens": {"mean": round(float(np.mean(n_in)), 1), "max": max(n_in), "total": sum(n_in)},
            "output_tokens": {"mean": round(float(np.mean(n_out)), 1), "max": max(n_out), "total": sum(n_out)},
            "shared_block_ratio": round(shared_block_ratio([w.hash_ids for w in self.items]), 4),
            "sampled_by": self.sampled_by,
        }

    def resalted(self, salt: str) -> Workload:
        """The same requests with other tokens (a sweep's steps do not reuse each other's KV)."""
        return build(self.trace, dataclasses.replace(self.scaling, salt=salt))


def shared_block_ratio(chains: Sequence[Sequence[int]]) -> float:
    """Blocks whose whole prefix (ids up to and including them) appeared in an earlier
    request: the hit ratio of an unbounded prefix cache."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for c in chains:
        for i in range(len(c)):
            p = tuple(c[: i + 1])
            total += 1
            if p in seen:
                hits += 1
            else:
                seen.add(p)
    return hits / total if total else 0.0


DOMINANT_SHARE = 0.5
"""A prefix tree holding more than this share of a trace's requests is split for sampling."""


def _key_hash(key: bytes) -> int:
    return int(xxhash.xxh64_intdigest(key))


def _id_bytes(h: int) -> bytes:
    """A hash id as the 8 bytes its key hashes (ids past 64 bits wrap, never raise)."""
    return (h & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little")


def _common_prefix(chains: Sequence[Sequence[int]]) -> int:
    """How many leading hash ids every chain of ``chains`` shares."""
    first = chains[0]
    n = min(len(c) for c in chains)
    for c in chains[1:]:
        k = 0
        while k < n and c[k] == first[k]:
            k += 1
        n = k
        if n == 0:
            break
    return n


def sample_units(reqs: Sequence[Request]) -> tuple[list[tuple[bytes, list[int]]], bool]:
    """The units ``--sample`` keeps or drops whole, as (key, indices into ``reqs``), and
    whether a dominant tree was split (see the module docstring).  Keys: a prefix tree's
    root id as 8 little-endian bytes (as ever, so samples of traces without a dominant
    tree are unchanged), ``session:<id>``, ``tree:<ids of the subtree's path>``, and
    ``request:<index>`` for a request without hash ids."""
    trees: dict[int, list[int]] = {}
    units: list[tuple[bytes, list[int]]] = []
    for i, r in enumerate(reqs):
        if r.hash_ids:
            trees.setdefault(r.hash_ids[0], []).append(i)
        else:
            units.append((b"request:%d" % i, [i]))
    limit = DOMINANT_SHARE * len(reqs)
    split = False
    for root, members in trees.items():
        if len(members) <= limit or len(members) < 2:
            units.append((_id_bytes(root), members))
            continue
        split = True
        sessions: dict[str, list[int]] = {}
        rest: list[int] = []
        for i in members:
            sid = reqs[i].session_id
            if sid is not None:
                sessions.setdefault(sid, []).append(i)
            else:
                rest.append(i)
        units.extend((b"session:" + sid.encode(), idx) for sid, idx in sessions.items())
        units.extend(_subtrees(reqs, rest, limit))
    return units, split


def _subtrees(reqs: Sequence[Request], members: list[int], limit: float) -> list[tuple[bytes, list[int]]]:
    """``members`` (requests of one tree) grouped by the hash id just below the prefix they
    all share; a group still over ``limit`` requests is split again below its own."""
    out: list[tuple[bytes, list[int]]] = []
    todo = [members] if members else []
    while todo:
        group = todo.pop()
        depth = _common_prefix([reqs[i].hash_ids for i in group])
        children: dict[tuple[int, ...], list[int]] = {}
        for i in group:
            ids = reqs[i].hash_ids
            children.setdefault(tuple(ids[: depth + 1]), []).append(i)  # the shared prefix itself: its own
        for path, idx in children.items():
            if len(idx) > limit and len(children) > 1:
                todo.append(idx)
            else:
                out.append((b"tree:" + b"".join(_id_bytes(h) for h in path), idx))
    return out


def sample(reqs: Sequence[Request], share: float) -> tuple[list[Request], str]:
    """The requests of the units (:func:`sample_units`) whose key hashes below ``share``
    of the hash range, in trace order (at least one unit), and what the units were."""
    units, split = sample_units(reqs)
    cut = share * 2**64
    hashed = [(_key_hash(key), idx) for key, idx in units]
    keep = [idx for h, idx in hashed if h < cut]
    if not keep and hashed:
        keep = [min(hashed, key=lambda u: u[0])[1]]
    chosen = sorted(i for idx in keep for i in idx)
    return [reqs[i] for i in chosen], "sessions and subtrees below a shared root" if split else "prefix trees"


def build(path: str | Path, s: Scaling) -> Workload:
    """Load ``path`` and make the requests of ``s`` (see the module docstring)."""
    trace = Trace.load(path, block_tokens=s.trace_block_tokens, bad_lines="skip")
    reqs = list(trace.requests)
    sampled_by = None
    if s.sample is not None and reqs:
        reqs, sampled_by = sample(reqs, s.sample)
    if s.window is not None:
        t0 = reqs[0].timestamp
        reqs = [r for r in reqs if s.window[0] * 1e3 <= r.timestamp - t0 < s.window[1] * 1e3]
    if s.requests is not None:
        reqs = reqs[: s.requests]
    if not reqs:
        raise InvalidArgument(f"trace {path}: no request in the chosen slice (--window/--requests)")
    ts = [r.timestamp / 1e3 for r in reqs]
    arrivals = [(t - ts[0]) * s.time_scale for t in ts]
    stretch = 1.0
    if s.rate is not None and len(reqs) > 1:
        span = arrivals[-1]
        want = (len(reqs) - 1) / s.rate
        stretch = want / span if span > 0 else 1.0
        arrivals = [a * stretch for a in arrivals] if span > 0 else [i / s.rate for i in range(len(reqs))]
    sessions = {r.session_id for r in reqs if r.session_id is not None}
    closes = tuple(
        (max(0.0, (c.timestamp / 1e3 - ts[0]) * s.time_scale * stretch), c.session_id)
        for c in trace.closes
        if c.session_id in sessions and ts[0] <= c.timestamp / 1e3
    )
    synth = TokenSynth(s.block_tokens, s.vocab, s.salt)
    items = []
    for i, r in enumerate(reqs):
        ids = r.hash_ids
        if s.unique:
            ids = tuple((1 << 62) + i * 100_000 + j for j in range(len(ids)))
        last = r.input_length - s.trace_block_tokens * (len(ids) - 1)
        length = (len(ids) - 1) * s.block_tokens + max(1, round(last * s.block_tokens / s.trace_block_tokens))
        out = max(s.min_output_tokens, round(r.output_length * s.out_scale))
        if s.max_output_tokens is not None:
            out = min(out, s.max_output_tokens)
        items.append(Work(i, arrivals[i], synth.prompt(ids, length), out, ids, r.session_id))
    return Workload(str(path), s, tuple(items), trace.skipped, closes if not s.unique else (), sampled_by)
