"""Engine profiles: what one simulated engine costs per step, what it holds, how fast its tiers load.

A profile is data, loaded from JSON (``kvstore/sim/profiles/*.json``, shipped with the
package, or any file), one key per field of :class:`EngineProfile`.  The step-time model
(all coefficients in milliseconds, one term per count the engine model reports)::

    step_ms = overhead_ms
            + prefill_ms_per_token   × P    P: prefill tokens computed in the step (chunks of
                                               prompts, and recomputed tokens after a preemption)
            + prefill_attn_ms        × A    A: Σ over the step's prefill chunks of p × p, p the
                                               chunk's new tokens: attention pairs among them
            + prefill_cached_attn_ms × C    C: Σ over those chunks of p × c, c the tokens before
                                               the chunk (a cached prefix, earlier chunks): its
                                               new tokens' attention pairs with them
            + decode_ms_per_seq      × D    D: sequences decoding one token in the step
            + decode_ms_per_kv_token × K    K: Σ over those sequences of the context each attends
                                               (its computed tokens + 1): the KV bytes the step reads
            + request_ms             × N    N: requests the step schedules for the first time

This is BLIS's β0 + β1·prefill tokens + β2·decode tokens with two attention terms.  For
one fresh prompt of T tokens in one step (c = 0) the prefill part is NVIDIA Dynamo's
mocker polynomial, ``overhead + b·T + a·T²``; a cached prefix is not recomputed but is
still attended, through ``c``: ``prefill_cached_attn_ms`` (default: ``prefill_attn_ms``)
prices those pairs apart, since an engine reads that KV back from its cache (on the
project's CPU engines, measured by ``kvstore sim calibrate``, about twice as dear a pair).  ``jitter_cv`` (default 0) multiplies a step's time by a
lognormal factor of mean 1 and that coefficient of variation, drawn from the caller's
``random.Random``.  ``request_ms`` (default 0) is what taking a request in costs a served
engine besides its tokens (its API server's and scheduler's work, on a CPU engine on the
same core): ``kvstore sim calibrate --served`` finds about 6 ms on the project's CPU engines,
which a prefill's TTFT pays and a decode step does not.

An engine with the pool's connector (every configuration with a store) adds
``connector_step_ms`` to each step that runs a batch and ``connector_request_ms`` for each
request the step schedules for the first time: what the connector's hooks, its saves and the
node beside the engine cost it besides bytes over bandwidth (on a CPU engine they share its
core; both default to 0).  One save of ``n`` chunks takes ``connector_save_ms`` besides
their bytes over the DRAM link (:meth:`EngineProfile.save_s`: the Reserve and commit round
trips, the copy and checksum on the worker's thread); that is the cost the connector's
``evidence`` admission weighs a chunk's recompute time against, and what a handoff waits for.

Loading KV from a tier (``dram``, ``nvme``, ``network``) takes
``latency_s + bytes / bandwidth_Bps`` (:meth:`EngineProfile.load_s`).

Every numeric field is a *constant*; ``sources`` maps a constant's name to where its value
comes from (a citation, or ``derived: ...`` with the derivation).  The bundled profiles cite
every constant (:meth:`EngineProfile.uncited` is empty; a unit test holds them to it).

Validation: unknown keys, missing keys, wrong types, and values out of range are
:class:`~kvstore.errors.InvalidArgument` (a ``ValueError``) naming the key.  Sizes, limits,
``overhead_ms``, ``prefill_ms_per_token`` and bandwidths must be positive; the other step
coefficients, latencies and ``jitter_cv`` may be 0.  A profile is immutable once built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import types
from collections.abc import Mapping
from importlib import resources
from typing import Any, Literal

from kvstore.errors import InvalidArgument

Tier = Literal["dram", "nvme", "network"]
TIERS: tuple[Tier, ...] = ("dram", "nvme", "network")

_TEXT = ("name", "description", "model", "hardware")
_POSITIVE_INT = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "block_size",
    "num_gpu_blocks",
    "kv_bytes_per_token",
)
_POSITIVE = ("overhead_ms", "prefill_ms_per_token", "dram_bandwidth_Bps", "nvme_bandwidth_Bps", "network_bandwidth_Bps")
_NON_NEGATIVE = (
    "prefill_attn_ms",
    "prefill_cached_attn_ms",
    "decode_ms_per_seq",
    "decode_ms_per_kv_token",
    "dram_latency_s",
    "nvme_latency_s",
    "network_latency_s",
    "jitter_cv",
    "connector_step_ms",
    "connector_request_ms",
    "connector_save_ms",
    "request_ms",
)
_OPTIONAL = {
    "prefill_cached_attn_ms": None,
    "jitter_cv": 0.0,
    "connector_step_ms": 0.0,
    "connector_request_ms": 0.0,
    "connector_save_ms": 0.0,
    "request_ms": 0.0,
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineProfile:
    """One engine's costs and limits (see the module docstring for the step-time model)."""

    name: str
    description: str
    model: str
    hardware: str
    # step time, milliseconds
    overhead_ms: float  # every step that runs a batch
    prefill_ms_per_token: float  # per prefill token computed
    prefill_attn_ms: float  # per attention pair of a prefill chunk's new tokens among themselves
    decode_ms_per_seq: float  # per sequence decoding one token
    decode_ms_per_kv_token: float  # per context token a decoding sequence attends
    # engine limits (vLLM's names)
    max_num_batched_tokens: int  # token budget of one step
    max_num_seqs: int  # running requests at most
    block_size: int  # tokens per KV block
    num_gpu_blocks: int  # KV capacity in blocks (vLLM's count: block 0 is its null block)
    kv_bytes_per_token: int
    # tiers the engine loads KV from
    dram_bandwidth_Bps: float
    nvme_bandwidth_Bps: float
    network_bandwidth_Bps: float
    dram_latency_s: float  # per transfer
    nvme_latency_s: float
    network_latency_s: float
    jitter_cv: float = 0.0  # coefficient of variation of a step's time (lognormal); 0: none
    # per attention pair of a chunk's new token with a token before the chunk (None: prefill_attn_ms)
    prefill_cached_attn_ms: float | None = None
    # what the pool's connector costs an engine besides moving bytes (engines with a store only)
    connector_step_ms: float = 0.0  # every step that runs a batch
    connector_request_ms: float = 0.0  # per request, in the step that first schedules it
    connector_save_ms: float = 0.0  # per save, besides its bytes over the DRAM link
    request_ms: float = 0.0  # per request, in the step that first schedules it (any engine)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)  # constant → citation

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}" if isinstance(self.name, str) and self.name else "profile"
        for k in _TEXT:
            if not isinstance(getattr(self, k), str):
                raise InvalidArgument(f"{where}: {k!r} must be a string, got {getattr(self, k)!r:.60}")
        if not self.name:
            raise InvalidArgument("profile: 'name' must be non-empty")
        if self.prefill_cached_attn_ms is None:
            object.__setattr__(self, "prefill_cached_attn_ms", self.prefill_attn_ms)
        for k in _POSITIVE_INT:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgument(f"{where}: {k!r} must be a positive integer, got {v!r}")
        if self.num_gpu_blocks < 2:
            raise InvalidArgument(f"{where}: 'num_gpu_blocks' must be at least 2 (block 0 is the null block)")
        for k in _POSITIVE + _NON_NEGATIVE:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise InvalidArgument(f"{where}: {k!r} must be a finite number, got {v!r}")
            if k in _POSITIVE and v <= 0:
                raise InvalidArgument(f"{where}: {k!r} must be positive, got {v!r}")
            if v < 0:
                raise InvalidArgument(f"{where}: {k!r} must not be negative, got {v!r}")
            object.__setattr__(self, k, float(v))
        if not isinstance(self.sources, Mapping):
            raise InvalidArgument(f"{where}: 'sources' must be an object of constant name → citation")
        for k, v in self.sources.items():
            if k not in CONSTANTS:
                raise InvalidArgument(f"{where}: sources[{k!r}] names no constant (known: {', '.join(CONSTANTS)})")
            if not isinstance(v, str) or not v.strip():
                raise InvalidArgument(f"{where}: sources[{k!r}] must be a non-empty citation string")
        object.__setattr__(self, "sources", types.MappingProxyType(dict(self.sources)))

    # -- the model ----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def step_ms(
        self,
        prefill_tokens: int,
        attention_pairs: int,
        decode_seqs: int,
        decode_context_tokens: int,
        cached_pairs: int = 0,
        new_requests: int = 0,
    ) -> float:
        """A step's time without jitter, in ms (a step that runs nothing: 0).
        ``attention_pairs`` counts every pair, Σ p × (c + p); ``cached_pairs`` those of them
        with a token before the chunk, Σ p × c; ``new_requests`` the requests it schedules for
        the first time (see the module docstring)."""
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        cached = self.prefill_attn_ms if self.prefill_cached_attn_ms is None else self.prefill_cached_attn_ms
        return (
            self.overhead_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.prefill_attn_ms * (attention_pairs - cached_pairs)
            + cached * cached_pairs
            + self.decode_ms_per_seq * decode_seqs
            + self.decode_ms_per_kv_token * decode_context_tokens
            + self.request_ms * new_requests
        )

    def jitter(self, rng: random.Random) -> float:
        """A lognormal factor of mean 1 and coefficient of variation ``jitter_cv`` (1.0 without jitter)."""
        if self.jitter_cv == 0:
            return 1.0
        sigma2 = math.log1p(self.jitter_cv**2)
        return rng.lognormvariate(-sigma2 / 2, math.sqrt(sigma2))

    def bandwidth_Bps(self, tier: Tier) -> float:
        return float(getattr(self, f"{_tier(tier)}_bandwidth_Bps"))

    def latency_s(self, tier: Tier) -> float:
        return float(getattr(self, f"{_tier(tier)}_latency_s"))

    def load_s(self, tier: Tier, nbytes: int) -> float:
        """Seconds to load ``nbytes`` of KV from ``tier`` in one transfer (0 bytes: no transfer)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s(tier) + nbytes / self.bandwidth_Bps(tier)

    def save_s(self, nbytes: int) -> float:
        """Seconds one save of ``nbytes`` of KV takes the connector's worker (0 bytes: no save)."""
        if nbytes <= 0:
            return 0.0
        return self.load_s("dram", nbytes) + self.connector_save_ms / 1000

    def uncited(self) -> list[str]:
        """The constants ``sources`` does not cite."""
        return [k for k in CONSTANTS if k not in self.sources]

    # -- files --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["sources"] = dict(self.sources)
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def from_dict(cls, obj: object, where: str = "profile") -> EngineProfile:
        if not isinstance(obj, dict):
            raise InvalidArgument(f"{where}: expected a JSON object, got {type(obj).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for k in obj:
            if k not in known:
                raise InvalidArgument(f"{where}: unknown key {k!r} (known: {', '.join(sorted(known))})")
        missing = [k for k in known if k not in obj and k not in _OPTIONAL and k != "sources"]
        if missing:
            raise InvalidArgument(f"{where}: missing key(s) {', '.join(repr(k) for k in sorted(missing))}")
        try:
            return cls(**obj)
        except InvalidArgument as e:
            raise InvalidArgument(f"{where}: {e}") from None

    @classmethod
    def load(cls, name_or_path: str | os.PathLike[str]) -> EngineProfile:
        """A bundled profile by name (``h100-llama3-8b``; :func:`list_profiles`), or a JSON file."""
        s = os.fspath(name_or_path)
        bundled = _bundled()
        if s in bundled:
            text, where = bundled[s].read_text(encoding="utf-8"), f"bundled profile {s!r}"
        else:
            if os.sep not in s and "/" not in s and not s.endswith(".json"):
                raise InvalidArgument(f"no bundled profile {s!r} (bundled: {', '.join(sorted(bundled))}; or a path)")
            try:
                with open(s, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise InvalidArgument(f"cannot read profile {s}: {e.strerror or e}") from None
            where = s
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(obj, where)


CONSTANTS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(EngineProfile) if f.name not in _TEXT and f.name != "sources"
)
"""The fields a profile's ``sources`` must cite."""


def _tier(tier: str) -> str:
    if tier not in TIERS:
        raise InvalidArgument(f"unknown tier {tier!r} (known: {', '.join(TIERS)})")
    return tier


def _bundled() -> dict[str, Any]:
    root = resources.files("kvstore.sim").joinpath("profiles")
    return {p.name[: -len(".json")]: p for p in root.iterdir() if p.name.endswith(".json")}


def list_profiles() -> list[str]:
    """The bundled profiles' names, sorted."""
    return sorted(_bundled())
