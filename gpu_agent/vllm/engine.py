"""One vLLM engine in a process of its own, driven over stdin/stdout (JSON lines).

The demo and the end-to-end tests run prefill and decode in separate engine processes,
as a disaggregated deployment does.  The parent (:class:`EngineProcess`) sends
``{"cmd": "generate", "tokens": [...], "max_tokens": N, "cache_salt": S}`` and gets back
``{"tokens": [...], "ttft_ms": T}`` (TTFT: from ``add_request`` to the first token, stepping
the engine), or ``{"error": ...}``.  The child dies with its parent (``kvstore.children``).

``make_model`` writes a small random-weight Llama (config and seeded weights, made
locally), so every engine computes the same KV without a hub or a download; the
weights are random but not degenerate, so wrong KV shows in the tokens and logprobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.children import spawn, stop

HEAD_DIM = 64


def make_model(path: Path, *, layers: int, hidden: int, max_tokens: int, vocab: int = 32000) -> Path:
    """A Llama of ``layers`` x ``hidden`` (head dim 64, 2 query heads per KV head), seeded weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(2, hidden // HEAD_DIM)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=heads * HEAD_DIM,
        intermediate_size=2 * heads * HEAD_DIM,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=HEAD_DIM,
        max_position_embeddings=max_tokens,
        torch_dtype="float32",  # type: ignore[call-arg]  # a PretrainedConfig keyword, not in LlamaConfig's signature
    )
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_lora(path: Path, model: Path, *, rank: int = 8, seed: int = 1) -> Path:
    """A LoRA adapter (PEFT layout) on ``model``'s q and v projections, seeded random weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(model)
    g = torch.Generator().manual_seed(seed)
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads  # None means one per query head
    hidden, q_out, kv_out = cfg.hidden_size, cfg.num_attention_heads * HEAD_DIM, kv_heads * HEAD_DIM
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for proj, out in (("q_proj", q_out), ("v_proj", kv_out)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": ["q_proj", "v_proj"],
                "lora_dropout": 0.0,
                "bias": "none",
                "base_model_name_or_path": str(model),
                "task_type": "CAUSAL_LM",
            }
        )
    )
    return path


def engine_kwargs(
    model: str, *, max_tokens: int, kv_bytes: int, connector: dict[str, Any] | None, lora: bool = False
) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a CPU engine (offline, dummy weights, token ids in and out)."""
    kw: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max_tokens,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=False,
        max_num_batched_tokens=max_tokens,
        seed=0,
    )
    if lora:
        kw.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    if connector is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="gpu_agent.vllm",
            kv_role=connector.get("role", "kv_both"),
            kv_connector_extra_config=connector.get("extra", {}),
            kv_load_failure_policy="recompute",
        )
    return kw


def _serve(spec: dict[str, Any]) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # the protocol keeps the real stdout; everything else printed (here, by vLLM, by the
    # processes it starts) goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams

    llm = LLM(
        **engine_kwargs(
            spec["model"],
            max_tokens=spec["max_tokens"],
            kv_bytes=spec["kv_bytes"],
            connector=spec.get("connector"),
            lora=bool(spec.get("lora")),
        )
    )
    engine = llm.llm_engine
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    n = 0
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        try:
            n += 1
            prompt: dict[str, Any] = {"prompt_token_ids": req["tokens"]}
            if req.get("cache_salt"):
                prompt["cache_salt"] = req["cache_salt"]
            lora = None
            if req.get("lora"):
                from vllm.lora.request import LoRARequest

                lora = LoRARequest(req["lora"]["name"], int(req["lora"]["id"]), req["lora"]["path"])
            extra = {"kv_transfer_params": {"session_id": req["session_id"]}} if req.get("session_id") else None
            sp = SamplingParams(
                max_tokens=int(req.get("max_tokens", 8)), temperature=0.0, ignore_eos=True, logprobs=0, extra_args=extra
            )
            rid = f"r{n}"
            t0 = time.perf_counter()
            engine.add_request(rid, prompt, sp, lora_request=lora)
            ttft, tokens, logprobs, params = None, [], [], None
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.request_id == rid and o.outputs:
                        tokens = list(o.outputs[0].token_ids)
                        logprobs = [lp[t].logprob for t, lp in zip(tokens, o.outputs[0].logprobs or [])]
                        params = getattr(o, "kv_transfer_params", None) or params
                        if ttft is None and tokens:
                            ttft = (time.perf_counter() - t0) * 1e3
            out.write(
                json.dumps({"tokens": tokens, "logprobs": logprobs, "ttft_ms": ttft, "kv_transfer_params": params})
                + "\n"
            )
        except Exception as e:  # report, keep serving
            out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()


class EngineProcess:
    """A vLLM engine child process (see the module docstring)."""

    def __init__(
        self,
        model: Path,
        *,
        max_tokens: int,
        kv_bytes: int,
        connector: dict[str, Any] | None = None,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        lora: bool = False,
    ) -> None:
        spec = {
            "model": str(model),
            "max_tokens": max_tokens,
            "kv_bytes": kv_bytes,
            "connector": connector,
            "lora": lora,
        }
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = spawn(
            [sys.executable, "-m", "gpu_agent.vllm.engine", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.started_s = 0.0

    def wait_ready(self, timeout: float = 300.0) -> EngineProcess:
        t0 = time.perf_counter()
        line = self._readline(timeout)
        if not json.loads(line).get("ready"):
            raise RuntimeError(f"engine did not start: {line}{self.log_tail()}")
        self.started_s = time.perf_counter() - t0
        return self

    def _readline(self, timeout: float) -> str:
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"no answer from the engine process in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process exited (code {self.proc.poll()}){self.log_tail()}")
        return line

    def log_tail(self, lines: int = 40) -> str:
        """The end of the engine's log (vLLM's own stack traces land there), for an error message."""
        if self.log_path is None:
            return ""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last {len(text)} lines of {self.log_path.name} ---\n" + "\n".join(text)

    def generate(
        self,
        tokens: list[int],
        *,
        max_tokens: int = 8,
        cache_salt: str = "",
        lora: dict[str, Any] | None = None,
        session_id: str = "",
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        """Greedy tokens, their logprobs and TTFT; ``lora``: ``{"name", "id", "path"}`` of an adapter;
        ``session_id``: passed as ``kv_transfer_params["session_id"]`` (the store's session hints)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            json.dumps(
                {
                    "cmd": "generate",
                    "tokens": tokens,
                    "max_tokens": max_tokens,
                    "cache_salt": cache_salt,
                    "lora": lora,
                    "session_id": session_id,
                }
            )
            + "\n"
        )
        self.proc.stdin.flush()
        r: dict[str, Any] = json.loads(self._readline(timeout))
        if "error" in r:
            raise RuntimeError(f"engine: {r['error']}{self.log_tail()}")
        return r

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except Exception:
                pass
        stop(self.proc, timeout=10)
        if not isinstance(self._log, int):  # a file we opened, not subprocess.DEVNULL
            self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
