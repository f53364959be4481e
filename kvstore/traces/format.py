"""Mooncake-format request traces: parsing, validation and the keys of their blocks.

One JSON object per line, one request each (``tests/data/README.md``; the format of the traces Mooncake published):
``timestamp`` (ms from the start), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``, one id per ``block_tokens``-token block of the prompt (the last block may
be partial).  Two requests that share an id at the same position share that block and
every block before it.

Session hints (``kvstore/node/sessions.py``): a request line may carry ``"session_id"`` (a
string), and an event line ``{"timestamp": T, "close_session": ID}`` says that session
sends no more requests from time ``T`` on.  A close of a session no request has opened
(or one closed already, with no request since), or a session id that is not a string,
is a bad line: fatal by default, or skipped and reported by line (``bad_lines="skip"``).

Keys: a block's 16-byte key is chained like a real chunk key (architecture §1)::

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
from collections.abc import Iterable, Iterator, Sequence

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
    session_id: str | None = None

    def to_json(self) -> str:
        obj: dict[str, object] = {
            "timestamp": _ts(self.timestamp),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id is not None:
            obj["session_id"] = self.session_id
        return json.dumps(obj)


@dataclasses.dataclass(frozen=True, slots=True)
class Close:
    """A ``close_session`` event: ``session_id`` ends at ``timestamp`` (ms), before request ``before``."""

    timestamp: float
    session_id: str
    before: int  # index of the first request after it in the file

    def to_json(self) -> str:
        return json.dumps({"timestamp": _ts(self.timestamp), "close_session": self.session_id})


def _ts(t: float) -> float | int:
    return int(t) if float(t).is_integer() else t


def _session_field(v: object, where: str, field: str) -> str:
    from kvstore.vocabulary import check_session_id

    if not isinstance(v, str) or not v:
        raise InvalidArgument(f"{where}: {field!r} must be a non-empty string, got {v!r:.60}")
    try:
        check_session_id(v)
    except InvalidArgument as e:
        raise InvalidArgument(f"{where}: {e}") from None
    return v


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
    """One request line → :class:`Request`; ``where`` (``"trace.jsonl line 7"``) prefixes every error."""
    r = parse_line(line, where, block_tokens)
    if not isinstance(r, Request):
        raise InvalidArgument(f"{where}: expected a request, got a close_session event")
    return r


def parse_line(line: str, where: str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Request | Close:
    """One trace line → :class:`Request` or :class:`Close` (``before`` left 0 for the caller)."""
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
    if "close_session" in obj:
        return Close(float(ts), _session_field(obj["close_session"], where, "close_session"), 0)
    session = _session_field(obj["session_id"], where, "session_id") if "session_id" in obj else None
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
    return Request(float(ts), input_length, output_length, tuple(ids), session)


class Trace:
    """The requests of one trace, in file order, with their keys and dense block ids."""

    def __init__(
        self,
        requests: Sequence[Request],
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        name: str = "trace",
        salt: str = "",
        closes: Sequence[Close] = (),
        skipped: Sequence[str] = (),
    ) -> None:
        if block_tokens <= 0:
            raise InvalidArgument(f"--block-tokens must be positive, got {block_tokens}")
        self.requests: tuple[Request, ...] = tuple(requests)
        self.closes: tuple[Close, ...] = tuple(
            sorted(closes, key=lambda c: c.before)
        )  # stable: file order within a gap
        self.skipped: tuple[str, ...] = tuple(skipped)  # bad lines skipped at load, each naming its line
        self.block_tokens = block_tokens
        self.name = name
        self.salt = salt

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        limit: int | None = None,
        salt: str = "",
        bad_lines: str = "fail",
    ) -> Trace:
        """Read a JSON-lines trace; blank lines are skipped, anything else malformed is an error
        naming the line (``bad_lines="skip"``: skipped, and listed in ``skipped``)."""
        if bad_lines not in ("fail", "skip"):
            raise InvalidArgument(f"bad_lines must be 'fail' or 'skip', got {bad_lines!r}")
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
        closes: list[Close] = []
        skipped: list[str] = []
        open_sessions: set[str] = set()
        with f:
            try:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    if limit is not None and len(reqs) >= limit:
                        break
                    where = f"{name} line {lineno}"
                    try:
                        item = parse_line(line, where, block_tokens)
                        if isinstance(item, Close):
                            if item.session_id not in open_sessions:
                                raise InvalidArgument(
                                    f"{where}: close_session {item.session_id!r} names no open session "
                                    "(no request of it yet, or closed already)"
                                )
                            open_sessions.discard(item.session_id)
                            closes.append(dataclasses.replace(item, before=len(reqs)))
                            continue
                    except InvalidArgument as e:
                        if bad_lines == "fail":
                            raise
                        skipped.append(str(e))
                        continue
                    if item.session_id is not None:
                        open_sessions.add(item.session_id)
                    reqs.append(item)
            except UnicodeDecodeError as e:
                raise InvalidArgument(f"{name}: not a UTF-8 text file ({e.reason})") from None
        if not reqs:
            raise InvalidArgument(f"trace {name} holds no requests")
        return cls(reqs, block_tokens=block_tokens, name=name, salt=salt, closes=closes, skipped=skipped)

    @classmethod
    def from_hash_ids(
        cls, chains: Iterable[Sequence[int]], *, block_tokens: int = DEFAULT_BLOCK_TOKENS, salt: str = ""
    ) -> Trace:
        """A trace of full blocks, one request per chain (tests, tiny examples)."""
        reqs = [Request(float(i), len(c) * block_tokens, 0, tuple(c)) for i, c in enumerate(chains)]
        return cls(reqs, block_tokens=block_tokens, name="inline", salt=salt)

    def with_salt(self, salt: str) -> Trace:
        return Trace(
            self.requests,
            block_tokens=self.block_tokens,
            name=self.name,
            salt=salt,
            closes=self.closes,
            skipped=self.skipped,
        )

    def without_sessions(self) -> Trace:
        """The same requests with no session ids and no close events (the unhinted replay)."""
        reqs = [dataclasses.replace(r, session_id=None) for r in self.requests]
        return Trace(reqs, block_tokens=self.block_tokens, name=self.name, salt=self.salt)

    @functools.cached_property
    def has_sessions(self) -> bool:
        return bool(self.closes) or any(r.session_id is not None for r in self.requests)

    def events(self) -> Iterator[tuple[int, Request | Close]]:
        """Requests (with their index) and close events in file order; a close has index -1."""
        c = 0
        for i, r in enumerate(self.requests):
            while c < len(self.closes) and self.closes[c].before <= i:
                yield -1, self.closes[c]
                c += 1
            yield i, r
        for close in self.closes[c:]:
            yield -1, close

    def write(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for _, item in self.events():
                f.write(item.to_json() + "\n")

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
            "sessions": len({r.session_id for r in self.requests if r.session_id is not None}),
            "session_closes": len(self.closes),
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
