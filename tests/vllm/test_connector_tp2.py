"""Tensor parallelism end to end: a TP=2 vLLM engine on the CPU stores and loads each
rank's shard through a real node (the checks of ``test_connector_e2e.py``: equal greedy
tokens and logprobs, the node's block reads).

A module of its own, on ``vllm_rig.tp2_rig`` (the reference engine and the TP=2 engine
only): its two ranks and engine core busy-wait on the two cores, and beside the five other
engines of ``vllm_rig.rig`` the machine stalled for 17 s to 2 minutes (``stalls.py``'s
report: every nice-0 process unscheduled while about a hundred engine threads were
runnable), past the save's deadline.
"""

from __future__ import annotations

import pytest
from test_connector_e2e import consume, reset
from vllm_rig import CHUNK, N, Rig, diff, info, made, prompt, same, tp2_rig  # noqa: F401 - fixtures

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_tensor_parallel_ranks_store_and_load_their_own_shards(tp2_rig: Rig) -> None:
    """A TP=2 engine saves each rank's shard of a chunk under the rank's own key (a chunk
    is two blocks on the node); with its own prefix cache dropped, its ranks load them
    back, each its own."""
    rig = tp2_rig
    for seed, n in ((901, N), (902, 4 * CHUNK)):
        toks = prompt(seed, n)
        first = rig.tp2.generate(toks, max_tokens=8)
        want = rig.want(toks, 8)
        assert same(first, want), diff(first, want)
        assert info(first).get("saved"), first["kv_transfer_params"]
        reset(rig.tp2)
        consume(rig, rig.tp2, toks, made(first, toks), ranks=2)
