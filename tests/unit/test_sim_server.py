"""The mock engine's parts without processes: the OpenAI protocol checks, prompt hashing,
the engine model's abort and reset, KV events as the conductor decodes them, the live
engine's step loop on an asyncio loop, and ``kvstore bench serving --engine sim``'s flags."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from kvstore.bench.serving import cli as serving
from kvstore.conductor.cacheindex import FleetCacheIndex
from kvstore.conductor.kvevents import decode_batch
from kvstore.errors import InvalidArgument
from kvstore.sim import kvevents_pub, openai
from kvstore.sim.engine import BlockStored, EngineModel
from kvstore.sim.live import LiveEngine, prompt_block_hashes
from kvstore.sim.profile import EngineProfile

VOCAB = 32000


def _parse(body: Any, max_model_len: int = 1024) -> openai.GenRequest:
    return openai.parse_completion(body, served="m", vocab=VOCAB, max_model_len=max_model_len)


# -- the protocol --------------------------------------------------------------------------
def test_text_tokenizes_by_word_deterministically() -> None:
    a = openai.tokenize("the cat  sat", VOCAB)
    assert a == openai.tokenize("the cat sat", VOCAB) and len(a) == 3 and a[0] != a[1]
    assert all(0 <= t < VOCAB for t in a)
    chat = openai.chat_tokens([{"role": "user", "content": "the cat sat"}], VOCAB)
    assert chat[1:4] == a and len(chat) == 5  # <|user|>, the words, <|assistant|>


def test_generated_tokens_depend_on_the_prompt_alone() -> None:
    d = openai.prompt_digest([1, 2, 3])
    run = [openai.output_token(d, i, VOCAB) for i in range(8)]
    assert run == [openai.output_token(openai.prompt_digest([1, 2, 3]), i, VOCAB) for i in range(8)]
    assert run != [openai.output_token(openai.prompt_digest([1, 2, 4]), i, VOCAB) for i in range(8)]


def test_a_completion_request_is_read_as_vllm_reads_it() -> None:
    r = _parse({"model": "m", "prompt": [5, 6, 7], "stream": True, "stream_options": {"include_usage": True}})
    assert (r.tokens, r.max_tokens, r.stream, r.include_usage, r.chat) == ((5, 6, 7), 16, True, True, False)
    assert _parse({"prompt": [[5, 6]], "max_tokens": 3, "ignore_eos": True}).tokens == (5, 6)  # a batch of one
    assert _parse({"prompt": "a b c", "max_tokens": 2}).tokens == tuple(openai.tokenize("a b c", VOCAB))
    chat = openai.parse_chat(
        {"messages": [{"role": "user", "content": "hi"}]}, served="m", vocab=VOCAB, max_model_len=64
    )
    assert chat.chat and chat.max_tokens == 64 - len(chat.tokens)  # vLLM's default: what the context leaves


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ([1, 2], 400, "JSON object"),
        ({"prompt": [1], "model": "x"}, 404, "does not exist"),
        ({"prompt": [VOCAB]}, 400, "out of vocabulary"),
        ({"prompt": [-1]}, 400, "out of vocabulary"),
        ({"prompt": [True]}, 400, "'prompt' must be"),
        ({"prompt": ""}, 400, "cannot be empty"),
        ({"prompt": [1], "max_tokens": 1024}, 400, "maximum context length is 1024"),
        ({"prompt": [1], "max_tokens": "2"}, 400, "max_tokens must be an integer"),
        ({"prompt": [1], "stream": "yes"}, 400, "stream must be a boolean"),
        ({"prompt": [1], "logprobs": 2}, 400, "logprobs is not supported"),
        ({"prompt": [1], "echo": True}, 400, "echo is not supported"),
    ],
)
def test_what_vllm_refuses_is_a_bad_request(body: Any, status: int, says: str) -> None:
    with pytest.raises(openai.BadRequest, match=says) as e:
        _parse(body)
    assert e.value.status == status and e.value.body()["error"]["code"] == status


# -- the engine's hashing and its helpers -------------------------------------------------
def test_prompt_blocks_are_hashed_by_content_chained() -> None:
    a = prompt_block_hashes(list(range(300)), 128)
    assert len(a) == 2  # the partial last block has no hash
    b = prompt_block_hashes([*range(128), *range(900, 1100)], 128)
    assert a[0] == b[0] and a[1] != b[1]
    assert prompt_block_hashes(list(range(300)), 128, b"other")[0] != a[0]


def _profile(blocks: int = 16) -> EngineProfile:
    import dataclasses

    return dataclasses.replace(EngineProfile.load("local"), num_gpu_blocks=blocks)


def test_abort_frees_a_running_request_and_reset_needs_an_idle_cache() -> None:
    m = EngineModel(_profile(), rng=random.Random(0))
    hashes = prompt_block_hashes(list(range(300)), 128)
    m.add_request("a", 300, hashes, 4, 0.0)
    m.add_request("b", 300, hashes, 4, 0.0)
    res = m.step(0.0)
    assert [e for e in res.kv_events if isinstance(e, BlockStored)]
    assert not m.reset_prefix_cache()  # requests hold blocks: nothing changes
    assert m.lookup_prefix(hashes) == 2
    assert m.abort_request("a") and m.abort_request("b") and not m.abort_request("b")
    m.check()
    assert m.num_unfinished == 0 and m.lookup_prefix(hashes) == 2  # freed, still cached
    assert m.reset_prefix_cache()
    m.check()
    assert m.lookup_prefix(hashes) == 0
    m.add_request("c", 300, hashes, 1, 1.0)
    assert m.step(1.0).cached_tokens == 0


def test_waiting_requests_can_be_aborted_too() -> None:
    m = EngineModel(_profile(), rng=random.Random(0))
    m.add_request("w", 10, (), 2, 0.0)
    assert m.abort_request("w") and m.num_waiting == 0 and not m.has_work(0.0)
    m.check()


# -- KV events as the conductor reads them --------------------------------------------------
def test_published_events_decode_into_the_conductors_index() -> None:
    tokens = list(range(2000, 2256))
    hashes = prompt_block_hashes(tokens, 128)
    index = FleetCacheIndex()
    index.add_engine("e", 128)
    stored = kvevents_pub.block_stored(hashes[:1], None, tokens[:128], 128)
    child = kvevents_pub.block_stored(hashes[1:], hashes[0], tokens[128:], 128)
    index.apply("e", decode_batch(kvevents_pub.encode_batch([stored, child])).events)
    assert index.match(tokens)["e"] == 256
    index.apply("e", decode_batch(kvevents_pub.encode_batch([kvevents_pub.block_removed(hashes[1:])])).events)
    assert index.match(tokens)["e"] == 128
    index.apply("e", decode_batch(kvevents_pub.encode_batch([kvevents_pub.all_blocks_cleared()])).events)
    assert index.match(tokens)["e"] == 0
    assert index.counts("e")["malformed"] == index.counts("e")["unknown"] == 0
    with pytest.raises(InvalidArgument, match="token ids"):
        kvevents_pub.block_stored(hashes, None, tokens[:10], 128)


# -- the live engine on a loop ----------------------------------------------------------------
async def collect(live: LiveEngine, sub: Any) -> list[int]:
    return [t async for t in live.outputs(sub)]


def test_the_live_engine_streams_each_request_its_tokens_and_aborts_cleanly() -> None:
    async def main() -> tuple[list[list[int]], LiveEngine]:
        live = LiveEngine(_profile(64), model_name="m", vocab=VOCAB, speed=1000.0)
        live.start()
        try:
            subs = [live.submit(list(range(i, i + 300)), 4) for i in range(3)]
            stuck = live.submit(list(range(50, 350)), 10_000 // 2)
            got = await asyncio.gather(*(collect(live, s) for s in subs))
            live.abort(stuck)
            with pytest.raises(InvalidArgument, match="KV blocks"):
                live.submit(list(range(100)), 100_000)  # more than the cache could ever hold
            return got, live
        finally:
            await live.close()

    got, live = asyncio.run(main())
    assert [len(g) for g in got] == [4, 4, 4]
    assert got[0] == [openai.output_token(openai.prompt_digest(list(range(300))), i, VOCAB) for i in range(4)]
    assert live.model.num_unfinished == 0 and live.failed is None
    live.model.check()


# -- kvstore bench serving --engine sim ----------------------------------------------------------
def test_engine_sim_runs_baseline_pool_and_conductor_only() -> None:
    assert serving._configs(None, None, "sim") == ["baseline", "pool", "conductor"]
    assert serving._configs("conductor", None, "sim") == ["conductor"]
    assert serving._configs("baseline,pool", None, "sim") == ["baseline", "pool"]
    for configs in ("pd", "baseline,pd", "conductor-pd"):
        with pytest.raises(
            InvalidArgument, match="--engine sim runs the configurations baseline, pool, conductor only"
        ):
            serving._configs(configs, None, "sim")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--engine", "sim", "--configs", "baseline,pd"], "baseline, pool, conductor only"),
        (["--kv-scale", "8"], "--kv-scale is for --engine sim"),
        (["--engine", "sim", "--target", "http://127.0.0.1:1"], "--target does not go with --engine sim"),
        (["--engine", "sim", "--model", "/m"], "--model does not go with --engine sim"),
        (["--profile", "local"], "--profile is for --engine sim"),
    ],
)
def test_engine_sim_flags_fail_before_anything_starts(argv: list[str], says: str, capsys: Any) -> None:
    from kvstore.cli import main

    assert main(["bench", "serving", *argv]) == 2
    assert says in capsys.readouterr().err
