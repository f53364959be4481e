"""The engine's record in etcd: what the connector's scheduler half registers when the
engine has an ``advertise_url`` (:class:`~kvstore.cluster.state.EngineRecord`, kept alive on a
lease by :class:`~kvstore.cluster.engines.EngineRegistrar`), so a request scheduler
(``kvstore conductor``) finds the engines of a fleet and keys prompts as they do.

The record says where clients reach the engine (``advertise_url``), its role (vLLM's
``kv_role``: ``kv_producer`` → ``prefill``, ``kv_consumer`` → ``decode``, ``kv_both`` →
``both``), the models it serves, the fingerprint of the namespace its plain requests are
keyed in (rank 0, no LoRA adapter, no ``cache_salt``: exactly what the scheduler half keys
such a request by), its chunk and block sizes, the kvstore target it saves and loads
through, and vLLM's KV-events endpoints as another machine reaches them.

Only the scheduler process registers (one record per engine; with data parallelism one per
rank, ``<engine_id>-dp<rank>``).  Registration never fails or stalls the engine.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from gpu_agent.vllm.settings import ConnectorSettings, advertised_host_port
from gpu_agent.vllm.spec import EngineSpec
from kvstore.cluster.state import EngineRecord

if TYPE_CHECKING:
    from kvstore.cluster.engines import EngineRegistrar

log = logging.getLogger(__name__)

ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
WILDCARDS = ("*", "0.0.0.0", "[::]", "::")


def engine_role(kv_role: str | None) -> str:
    """The record's role for vLLM's ``kv_role`` (None, as vLLM allows with no transfer: ``both``)."""
    return ROLES.get(kv_role or "kv_both", "both")


def served_models(served_model_name: str | list[str] | tuple[str, ...] | None, model: str) -> tuple[str, ...]:
    """vLLM's ``served_model_name`` (a name or a list of names; none: the model) as names."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = [n for n in names if n]
    return tuple(dict.fromkeys(names)) if names else (model,)


def reachable_endpoint(endpoint: str | None, host: str, *, publisher: bool = False) -> str:
    """A ZMQ endpoint as another machine reaches it: a wildcard host (``tcp://*:5557``,
    ``0.0.0.0``, ``[::]``) becomes ``host``; ``inproc://`` (this process only) and a port
    the OS picks (``:0``: the engine alone knows which) become "" (none to give).
    ``publisher``: vLLM's PUB socket binds only a wildcard host; given another host it
    *connects* there (to a subscriber that binds), so there is nothing to subscribe to: ""."""
    if not endpoint or endpoint.startswith("inproc://"):
        return ""
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc://: reachable on this machine, as it is
    addr, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or port == "0" or (publisher and addr not in WILDCARDS):
        return ""
    if addr in WILDCARDS:
        addr = host
    return f"tcp://{addr}:{port}"


def kv_events_endpoints(vllm_config: Any, host: str) -> tuple[str, str]:
    """vLLM's KV-events publisher and replay endpoints for this engine (its data-parallel rank's
    ports), as reachable from elsewhere; ("", "") when it publishes none over ZMQ."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not cfg.enable_kv_cache_events or cfg.publisher != "zmq":
        return "", ""
    from vllm.distributed.kv_events import ZmqEventPublisher

    rank = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    pub = reachable_endpoint(ZmqEventPublisher.offset_endpoint_port(cfg.endpoint, rank), host, publisher=True)
    replay = reachable_endpoint(ZmqEventPublisher.offset_endpoint_port(cfg.replay_endpoint, rank), host)
    if not pub and cfg.endpoint:
        log.warning(
            "kvstore: vLLM's KV events go to %s, where no router can subscribe (vLLM connects out to a host it "
            "is given, and binds only tcp://*:PORT); the engine is registered without them (give "
            "kv_events_config.endpoint as tcp://*:5557)",
            cfg.endpoint,
        )
    return pub, replay


def engine_record(vllm_config: Any, spec: EngineSpec, settings: ConnectorSettings, chunk: int) -> EngineRecord:
    """The scheduler half's record (``spec`` is rank 0's)."""
    assert (spec.tp_rank, spec.pp_rank) == (0, 0), "the scheduler keys by rank 0's namespace"
    host, _ = advertised_host_port(settings.advertise_url)
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    engine_id = settings.registered_engine_id()
    if int(getattr(pc, "data_parallel_size", 1) or 1) > 1:
        engine_id = f"{engine_id}-dp{int(getattr(pc, 'data_parallel_index', 0) or 0)}"
    events, replay = kv_events_endpoints(vllm_config, host)
    target = settings.target
    if target.startswith("unix://~"):
        target = "unix://" + os.path.expanduser(target[len("unix://") :])
    return EngineRecord(
        engine_id=engine_id,
        url=settings.advertise_url.rstrip("/"),
        role=engine_role(vllm_config.kv_transfer_config.kv_role),
        fingerprint=spec.namespace(chunk, salt=settings.salt).fingerprint.hex(),
        chunk_tokens=chunk,
        block_size=spec.block_size,
        models=served_models(getattr(mc, "served_model_name", None), str(mc.model)),
        node=target,
        kv_events=events,
        kv_events_replay=replay,
        tp_size=spec.tp_size,
        bytes_per_token=spec.layout().block_bytes(1) * spec.tp_size * spec.pp_size,
        host=socket.gethostname(),
        pid=os.getpid(),
    )


def start_registration(
    vllm_config: Any, spec: EngineSpec, settings: ConnectorSettings, chunk: int
) -> EngineRegistrar | None:
    """Register the engine (None when it has no ``advertise_url``): returns at once; the record
    is written when etcd answers and revoked by the registrar's ``close()``."""
    target = settings.registry_target()
    if not target:
        return None
    from kvstore.cluster.engines import EngineRegistrar

    record = engine_record(vllm_config, spec, settings, chunk)
    log.info("kvstore: registering engine %s (%s, %s) in %s", record.engine_id, record.url, record.role, target)
    return EngineRegistrar(target, record).start()
