"""The connector's settings (``kv_connector_extra_config``) and the namespaces it keys by.

Pure: no vLLM import, so the rules are unit-tested without an engine.  Everything that
must match for two engines to share KV is folded into the :class:`~kvstore.keys.Namespace`
(model and revision, KV dtype, the engine's page layout, block size through the chunk
size, tensor/pipeline rank and size) and, per request, the LoRA adapter and the
request's ``cache_salt``; two requests that must not share KV never compute the same key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from client import Timeouts, connect
from kvstore.cluster.state import check_engine_id, parse_target
from kvstore.errors import Incompatible, InvalidArgument

DEFAULT_TARGET = "unix://~/.local/share/kvstore/kvstore.sock"
AGENT = "vllm-connector"
"""The connector's ``ClientOptions.agent``: the node counts its calls as this agent's."""
RETRY_S = 5.0
"""After a failed store call, how long the connector serves without the store before trying
it again: ``ConnectorSettings.retry_s``'s default."""


ASYNC_LOADS = ("auto", "always", "never")
SAVE_POLICIES = ("evidence", "auto", "always", "second-sighting", "hinted")  # gpu_agent.vllm.admission
LOOKUPS = ("view", "rpc")  # gpu_agent.vllm.view, gpu_agent.vllm.storelink


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` may hold.  Unknown keys are an error naming them."""

    target: str = DEFAULT_TARGET
    """``unix:///path/kvstore.sock`` (zero-copy, the node on this machine), ``host:port``
    or ``etcd://host:port/cluster`` (lookups only; loads and saves need the local node)."""
    lookup_target: str = ""
    """Where the scheduler asks ``match_prefix`` (default: ``target``); an ``etcd://``
    target makes lookups cluster-wide."""
    token: str | None = None
    token_file: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    chunk_tokens: int = 0
    """Tokens per kvstore chunk: a multiple of vLLM's block size (0: the smallest multiple >= 256)."""
    deadline_s: float = 2.0
    """Most seconds one store call may take; past it the request recomputes."""
    retry_s: float = RETRY_S
    """After a failed store call (the node down, restarting or overloaded), how many seconds
    the engine serves without the store before it tries it again."""
    load_timeout_s: float = 0.0
    """Most seconds a step waits for a load to end (its copies, its leases back) before its
    blocks count as failed and are recomputed (0: ``deadline_s``)."""
    verify_loads: bool = True
    """Check every loaded block's payload checksum (a mismatch is recomputed, never loaded)."""
    hbm_bytes: int = 0
    """HBM block pool of the GPU agent (0: vLLM's own prefix cache is the HBM tier)."""
    model_id: str = ""
    """Name KV under this model id instead of vLLM's ``model`` (e.g. a path that differs between machines)."""
    salt: str = ""
    """Extra isolation folded into every key (e.g. a deployment's secret)."""
    save_decode: bool = True
    """Also save the full chunks decoding fills, so a conversation's next turn (prompt,
    answer and a new message) loads the answer's KV too (where ``save_policy`` saves the
    request's decode KV)."""
    save_policy: str = "evidence"
    """Which computed chunks are stored (``gpu_agent.vllm.admission``): ``evidence`` (the
    default: learnt from the engine's own node, which counts what share of what it stored
    is read back per namespace and prompt position; a chunk is stored when that share ×
    its measured recompute time beats its measured save time; with no evidence yet, it is
    stored; only ``kv_transfer_params["retain"]`` true stores a request whole); ``always``;
    ``second-sighting`` (a chunk this engine has looked up before: a shared prefix is
    stored by its second request); ``hinted`` (requests with a session id or
    ``kv_transfer_params["retain"]``, decode KV included; nothing else); ``auto``:
    ``hinted`` for requests with a hint, ``second-sighting`` for the rest.  An engine that
    only produces (``kv_producer``) stores everything."""
    background_saves: bool = True
    """Where the agent copies on the host (CPU engines), run saves on the worker's saver
    thread, off the step (false: inside ``wait_for_save``, the step waits for the copy)."""
    load_gate: bool = True
    """Load a hit only where its measured load time beats recomputing its tokens (per kind:
    the node's DRAM, its NVMe, another node); ``gpu_agent.vllm.gate``."""
    lookups: str = "view"
    """How the scheduler learns what the pool holds: ``view``, from an in-process view every
    node streams its holdings to (``gpu_agent.vllm.view``: answered at once, no store call,
    no request told "not yet" but a decode engine waiting for its producer's handoff; needs
    the node's admin token, else it falls back to ``rpc``); ``rpc``, by asking the store on
    the connector's own thread, waited for as the ``lookup_*`` settings below say."""
    lookup_wait_ms: float = 2.0
    """The least milliseconds one scheduling pass of vLLM may wait for lookups' answers (in
    all); past its budget a request waits a step ("not yet") while its lookup runs on the
    connector's own thread (never longer than ``deadline_s``).  ``gpu_agent.vllm.pacing``."""
    lookup_wait_step: float = 0.0
    """On a busy engine a pass may wait this fraction of the measured step time for lookups
    (0: only ``lookup_wait_ms``).  Off by default: measured on CPU engines, whose scheduler
    and forward pass share cores, 0.5 tripled the scheduler thread's connector time per
    request (15.8 ms against 4.9-6.3 ms off) and bought nothing measurable."""
    lookup_idle_wait_ms: float = 0.0
    """On an idle engine (its last pass scheduled nothing) a pass may wait this long for
    lookups (0: only ``lookup_wait_ms``)."""
    lookup_odds: bool = True
    """Compute a request at once rather than have it wait a step for a lookup not answered
    yet, when the lookups of its class (hinted, prefix seen before, new) are measured to
    find too few tokens to pay for that step (on an idle engine: for the lookup's latency),
    and do not look it up at all when they find less than a lookup costs, but for one
    probe in eight (``gpu_agent.vllm.patience``; false: always look up and wait, as far as
    ``deadline_s``)."""
    prefetch: bool = True
    """With ``lookups="view"`` and a ``lookup_target``: a request that arrives behind
    waiting ones has the chunks the pool holds on other nodes pulled into this engine's
    node while it waits (``gpu_agent.vllm.prefetcher``), so its load is the local one."""
    events_resync_s: float = 1.0
    """How often the chunks this engine reported stored (KV events) are checked against the
    store, so the node's own evictions and demotions reach KV events too (0: never).  Only
    with vLLM's ``kv_events_config`` enabled."""
    defer_free: bool = True
    """Keep a finished request's blocks until its save is committed (``request_finished`` → True)."""
    copy_threads: int = 0
    """Threads that share one load's or save's host copies, the engine's own included
    (0: torch's intra-op threads, i.e. the cores the worker was given, at most 4)."""
    async_loads: str = "auto"
    """Which hits load while the engine keeps stepping (vLLM's ``load_kv_async``: the request
    waits in ``WAITING_FOR_REMOTE_KVS``, the batch runs on): ``auto``, hits with chunks on
    NVMe or on another node (their latency is the disk's or the network's); ``always``;
    ``never`` (every load inside the step that computes the request)."""
    advertise_url: str = ""
    """The engine's OpenAI base URL as clients reach it (``http://10.0.0.5:8000``): the
    engine then registers in etcd (``engines/<engine_id>`` on a lease, for a request
    scheduler such as ``kvstore conductor``; see ``kvstore.cluster.engines``) and drops out
    when it stops or dies ("": not registered)."""
    registry: str = ""
    """``etcd://host:port/cluster`` to register the engine in (default: the lookup target,
    ``lookup_target`` or else ``target``, when it is an ``etcd://`` target).  Only with
    ``advertise_url``; etcd down never stalls the engine: it registers when etcd answers."""
    engine_id: str = ""
    """The engine's id in the registry (default: ``host:port`` of ``advertise_url``)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise InvalidArgument(f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(names)}")
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in extra:
                continue
            v = extra[f.name]
            want = type(f.default) if f.default is not None else str
            if want is bool and not isinstance(v, bool):
                raise InvalidArgument(f"kv_connector_extra_config.{f.name} must be true or false, got {v!r}")
            if want in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise InvalidArgument(f"kv_connector_extra_config.{f.name} must be a number, got {v!r}")
            if want is str and v is not None and not isinstance(v, str):
                raise InvalidArgument(f"kv_connector_extra_config.{f.name} must be a string, got {v!r}")
            kw[f.name] = want(v) if v is not None and want in (int, float) else v
        s = cls(**kw)
        if s.save_policy not in SAVE_POLICIES:
            raise InvalidArgument(
                f"kv_connector_extra_config.save_policy must be one of {list(SAVE_POLICIES)}, got {s.save_policy!r}"
            )
        for name in ("lookup_wait_ms", "lookup_wait_step", "lookup_idle_wait_ms"):
            if getattr(s, name) < 0:
                raise InvalidArgument(f"kv_connector_extra_config.{name} must be >= 0, got {getattr(s, name)!r}")
        if s.lookup_wait_step > 1:
            raise InvalidArgument(
                f"kv_connector_extra_config.lookup_wait_step must be at most 1 (a fraction of the step), "
                f"got {s.lookup_wait_step!r}"
            )
        if s.lookups not in LOOKUPS:
            raise InvalidArgument(
                f"kv_connector_extra_config.lookups must be one of {list(LOOKUPS)}, got {s.lookups!r}"
            )
        if s.async_loads not in ASYNC_LOADS:
            raise InvalidArgument(
                f"kv_connector_extra_config.async_loads must be one of {list(ASYNC_LOADS)}, got {s.async_loads!r}"
            )
        if (
            s.chunk_tokens < 0
            or s.deadline_s <= 0
            or s.retry_s <= 0
            or s.load_timeout_s < 0
            or s.hbm_bytes < 0
            or s.events_resync_s < 0
            or s.copy_threads < 0
        ):
            raise InvalidArgument(
                "kv_connector_extra_config: chunk_tokens, hbm_bytes, load_timeout_s, events_resync_s, copy_threads >= 0 "
                "and deadline_s, retry_s > 0"
            )
        s.registry_target()  # an engine that cannot register fails at start, naming the keys
        s.registered_engine_id()
        return s

    def registry_target(self) -> str:
        """Where the engine registers (``etcd://host:port/cluster``; "" when it does not: no
        ``advertise_url``).  InvalidArgument when ``advertise_url`` has no etcd to register in."""
        if not self.advertise_url:
            if self.registry or self.engine_id:
                raise InvalidArgument(
                    "kv_connector_extra_config.registry and engine_id register the engine only with "
                    "kv_connector_extra_config.advertise_url (the engine's OpenAI URL as clients reach it)"
                )
            return ""
        advertised_host_port(self.advertise_url)
        lookups = self.lookup_target or self.target
        target = self.registry or (lookups if lookups.startswith("etcd://") else "")
        if not target:
            raise InvalidArgument(
                f"kv_connector_extra_config.advertise_url={self.advertise_url!r} registers the engine in etcd, "
                "but there is none to register in: set kv_connector_extra_config.registry to "
                "etcd://HOST:PORT/CLUSTER (or make lookup_target an etcd:// target)"
            )
        try:
            parse_target(target)
        except InvalidArgument as e:
            raise InvalidArgument(f"kv_connector_extra_config.registry: {e}") from None
        return target

    def registered_engine_id(self) -> str:
        """The engine's id in the registry: ``engine_id``, or ``host:port`` of ``advertise_url``."""
        if not self.advertise_url:
            return ""
        host, port = advertised_host_port(self.advertise_url)
        eid = self.engine_id or f"{host}:{port}"
        try:
            return check_engine_id(eid)
        except InvalidArgument as e:
            raise InvalidArgument(f"kv_connector_extra_config.engine_id: {e}") from None

    @property
    def wait_s(self) -> float:
        """Most seconds one engine step waits on a load or a save's end."""
        return self.load_timeout_s or self.deadline_s

    def chunk_for(self, block_size: int) -> int:
        """The chunk size for vLLM's ``block_size``; a chunk covers whole vLLM blocks."""
        if block_size <= 0:
            raise Incompatible(f"vLLM block_size={block_size}")
        if self.chunk_tokens == 0:
            return -(-256 // block_size) * block_size
        if self.chunk_tokens % block_size:
            raise Incompatible(
                f"kv_connector_extra_config.chunk_tokens={self.chunk_tokens} is not a multiple of vLLM's "
                f"block_size={block_size}: a kvstore chunk must cover whole vLLM blocks"
            )
        return self.chunk_tokens

    def client(self, target: str | None = None) -> Any:
        """A kvstore client for ``target`` (default: ``self.target``) with these credentials and
        deadlines: a node's client, or a cluster's for an ``etcd://`` target (``client.connect``)."""
        import os

        t = target or self.target
        if t.startswith("unix://~"):
            t = "unix://" + os.path.expanduser(t[len("unix://") :])
        kw: dict[str, Any] = {
            "timeouts": Timeouts(rpc=self.deadline_s, data=self.deadline_s, connect=self.deadline_s),
            "agent": AGENT,
        }
        for name in ("token", "token_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(self, name):
                kw[name] = getattr(self, name)
        if self.tls:
            kw["tls"] = True
        return connect(t, **kw)


def advertised_host_port(url: str) -> tuple[str, int]:
    """Host (IPv6 in brackets) and port of an ``http(s)://HOST[:PORT]`` URL (the scheme's
    port when it has none); InvalidArgument naming ``advertise_url`` otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(
            f"kv_connector_extra_config.advertise_url must be http(s)://HOST:PORT (the engine's OpenAI URL "
            f"as clients reach it), got {url!r}"
        )
    if parts.hostname in ("0.0.0.0", "::", "*"):
        raise InvalidArgument(
            f"kv_connector_extra_config.advertise_url={url!r}: a wildcard address is not one clients can reach; "
            "give the engine's address on the network"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return host, port or (443 if parts.scheme == "https" else 80)
