"""Mooncake-format request traces: parsing, validation and the keys of their blocks.

One JSON object per line, one request each (``tests/data/README.md``; the format of the traces Mooncake published):
``timestamp`` (ms from the start), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``, one id per ``block_tokens``-token block of the prompt (the last block may
be partial).  Two requests that share an id at the same position share that block and
every block before it.

Keys: a block's 16-byte key is chained like a real chunk key (DESIGN §1)::

    key_{-1} = namespace fingerprint (8 bytes; the namespace is salted per replay)
    key_i    = xxh3_128(key_{i-1} || hash_id_i as little-endian u64)

so a block's parent is the previous block of its request, and the same id at another
position (or after other ids) is another block.  ``block_ids`` numbers the distinct keys
densely (first appearance order) for the offline optimum, which only needs identity.

Everything here is a pure function of the file and the options: no clock, no randomness.
A :class:`Trace` is immutable once loaded; derived tables are computed once, on demand.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterable, Sequence

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import NO_PARENT, ChunkKey, Namespace

DEFAULT_BLOCK_TOKENS = 512
REPLAY_MODEL_ID = "kvstore-replay"


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    timestamp: float  # ms from the start of the trace
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        ts: float | int = int(self.timestamp) if float(self.timestamp).is_integer() else self.timestamp
        return json.dumps(
            {"timestamp": ts, "input_length": self.input_length, "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        )


def _int_field(obj: dict[str, object], name: str, where: str, *, required: bool = True) -> int:
    if name not in obj:
        if not required:
            return 0
        raise InvalidArgument(f"{where}: missing field {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidArgument(f"{where}: {name!r} must be a non-negative integer, got {v!r}")
    return v


def parse_request(line: str, where: str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Request:
    """One trace line → :class:`Request`; ``where`` (``"trace.jsonl line 7"``) prefixes every error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "timestamp" not in obj:
        raise InvalidArgument(f"{where}: missing field 'timestamp'")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise InvalidArgument(f"{where}: 'timestamp' must be a non-negative number of milliseconds, got {ts!r}")
    input_length = _int_field(obj, "input_length", where)
    output_length = _int_field(obj, "output_length", where, required=False)
    if "hash_ids" not in obj:
        raise InvalidArgument(f"{where}: missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise InvalidArgument(f"{where}: 'hash_ids' must be a list of non-negative integers, got {type(ids).__name__}")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0 or h >= 2**64:
            raise InvalidArgument(f"{where}: hash_ids[{i}] must be a non-negative integer below 2**64, got {h!r}")
    need = -(-input_length // block_tokens)
    if len(ids) != need:
        raise InvalidArgument(
            f"{where}: input_length {input_length} makes {need} blocks of {block_tokens} tokens but the line has "
            f"{len(ids)} hash_ids (is --block-tokens {block_tokens} the trace's block size?)"
        )
    return Request(float(ts), input_length, output_length, tuple(ids))


class Trace:
    """The requests of one trace, in file order, with their keys and dense block ids."""

    def __init__(self, requests: Sequence[Request], *, block_tokens: int = DEFAULT_BLOCK_TOKENS, name: str = "trace", salt: str = "") -> None:
        if block_tokens <= 0:
            raise InvalidArgument(f"--block-tokens must be positive, got {block_tokens}")
        self.requests: tuple[Request, ...] = tuple(requests)
        self.block_tokens = block_tokens
        self.name = name
        self.salt = salt

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, block_tokens: int = DEFAULT_BLOCK_TOKENS, limit: int | None = None, salt: str = "") -> "Trace":
        """Read a JSON-lines trace; blank lines are skipped, anything else malformed is an error naming the line."""
        if block_tokens <= 0:
            raise InvalidArgument(f"--block-tokens must be positive, got {block_tokens}")
        if limit is not None and limit <= 0:
            raise InvalidArgument(f"--requests must be positive, got {limit}")
        name = os.fspath(path)
        try:
            f = open(name, encoding="utf-8")
        except OSError as e:
            raise InvalidArgument(f"cannot read trace {name}: {e.strerror or e}") from None
        reqs: list[Request] = []
        with f:
            try:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    reqs.append(parse_request(line, f"{name} line {lineno}", block_tokens))
                    if limit is not None and len(reqs) >= limit:
                        break
            except UnicodeDecodeError as e:
                raise InvalidArgument(f"{name}: not a UTF-8 text file ({e.reason})") from None
        if not reqs:
            raise InvalidArgument(f"trace {name} holds no requests")
        return cls(reqs, block_tokens=block_tokens, name=name, salt=salt)

    @classmethod
    def from_hash_ids(cls, chains: Iterable[Sequence[int]], *, block_tokens: int = DEFAULT_BLOCK_TOKENS, salt: str = "") -> "Trace":
        """A trace of full blocks, one request per chain (tests, tiny examples)."""
        reqs = [Request(float(i), len(c) * block_tokens, 0, tuple(c)) for i, c in enumerate(chains)]
        return cls(reqs, block_tokens=block_tokens, name="inline", salt=salt)

    def with_salt(self, salt: str) -> "Trace":
        return Trace(self.requests, block_tokens=self.block_tokens, name=self.name, salt=salt)

    def write(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for r in self.requests:
                f.write(r.to_json() + "\n")

    def __len__(self) -> int:
        return len(self.requests)

    # -- derived tables ----------------------------------------------------------------
    @functools.cached_property
    def namespace(self) -> Namespace:
        return Namespace(REPLAY_MODEL_ID, chunk_tokens=self.block_tokens, tenant_salt=self.salt)

    @functools.cached_property
    def keys(self) -> tuple[tuple[ChunkKey, ...], ...]:
        """Per request, the chained key of each block."""
        root = self.namespace.fingerprint
        memo: dict[tuple[bytes, int], ChunkKey] = {}
        out = []
        for r in self.requests:
            prev, ks = root, []
            for h in r.hash_ids:
                k = memo.get((prev, h))
                if k is None:
                    k = memo[(prev, h)] = ChunkKey(xxhash.xxh3_128_digest(prev + h.to_bytes(8, "little")))
                ks.append(k)
                prev = k
            out.append(tuple(ks))
        return tuple(out)

    @functools.cached_property
    def block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Per request, a dense id per distinct key (0, 1, ... in order of first appearance)."""
        ids: dict[ChunkKey, int] = {}
        return tuple(tuple(ids.setdefault(k, len(ids)) for k in ks) for ks in self.keys)

    @functools.cached_property
    def unique_blocks(self) -> int:
        return len({b for bs in self.block_ids for b in bs})

    @functools.cached_property
    def total_blocks(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)

    @functools.cached_property
    def total_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def block_token_counts(self, request: Request) -> list[int]:
        """Tokens in each block of a request (the last one may be partial)."""
        n, bt = len(request.hash_ids), self.block_tokens
        if n == 0:
            return []
        return [bt] * (n - 1) + [request.input_length - bt * (n - 1)]

    def hit_tokens(self, request: Request, hit_blocks: int) -> int:
        """Tokens covered by the first ``hit_blocks`` blocks of ``request``."""
        return min(request.input_length, hit_blocks * self.block_tokens)

    def parents(self, index: int) -> list[ChunkKey]:
        ks = self.keys[index]
        return [NO_PARENT, *ks[:-1]] if ks else []

    def summary(self) -> dict[str, object]:
        """Size figures and the unlimited-capacity prefix hit ratio."""
        seen: set[int] = set()
        hits = 0
        for bs in self.block_ids:
            n = 0
            for b in bs:
                if b not in seen:
                    break
                n += 1
            hits += n
            seen.update(bs)
        span = (self.requests[-1].timestamp - self.requests[0].timestamp) / 1000 if self.requests else 0.0
        return {
            "requests": len(self),
            "blocks": self.total_blocks,
            "unique_blocks": self.unique_blocks,
            "tokens": self.total_tokens,
            "duration_s": round(span, 3),
            "unlimited_hit_ratio": hits / self.total_blocks if self.total_blocks else 0.0,
        }


class HitRatios:
    """The two ratios every replay result reports, from its ``blocks``/``hit_blocks`` and
    ``tokens``/``hit_tokens`` counts (a mixin for the simulator, live and optimal results)."""

    __slots__ = ()
    blocks: int
    hit_blocks: int
    tokens: int
    hit_tokens: int

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0
