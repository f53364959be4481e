"""What the scheduler tells the workers each step (:class:`KVStoreMeta`): loads and saves.

Picklable and self-contained: a worker needs nothing else to move the bytes.  The
namespace is the scheduler's (rank 0); each worker keys its own shard with
:func:`~gpu_agent.vllm.spec.rank_namespace`.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.keys import Namespace


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[first_token, num_tokens)`` of ``tokens`` into ``block_ids``.

    ``tokens`` covers whole chunks up to the one holding ``num_tokens - 1``; tokens below
    ``first_token`` are the engine's own (its prefix cache): their chunks are neither
    acquired nor required to be stored, and their pages are never written."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    first_token: int
    num_tokens: int
    namespace: Namespace
    session_id: str | None = None
    tail: bool = False  # the last chunk of ``tokens`` is partial: keyed by its exact tokens
    async_load: bool = False  # loaded in the background; the worker reports it in ``get_finished``
    kind: str = "local"  # where its chunks are (the load gate's kinds: local, nvme, remote)
    from_view: bool = False  # planned from the pool's view (a shortfall is a stale view: view_stale_hits)


@dataclasses.dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store ``tokens``' full chunks from ``block_ids``, from chunk ``skip_chunks`` on
    (the chunks before it are stored already, or their save was issued in an earlier step)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    skip_chunks: int
    namespace: Namespace
    session_id: str | None = None
    tail: bool = False  # ``tokens`` ends in a partial chunk, saved too (``block_ids`` cover its whole chunk)


@dataclasses.dataclass
class KVStoreMeta(KVConnectorMetadata):
    """One step's loads and saves, the requests vLLM preempted before it (their pages may be
    rewritten by this step: saves still copying them are cancelled first), and the step's
    scheduled tokens (``step_tokens``, ``prefill_tokens`` of them prompt tokens): what the
    load gate's recompute rate is measured by."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    preempted: set[str] = dataclasses.field(default_factory=set)
    step_tokens: int = 0
    prefill_tokens: int = 0
