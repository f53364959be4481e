"""The OpenAI-compatible protocol of a mock engine (``kvstore sim serve``): requests parsed
and checked as vLLM's server checks them, answers shaped as vLLM writes them.

Pure functions over JSON values; no state, no I/O.  What vLLM would refuse is a
:class:`BadRequest` carrying vLLM's status (400, or 404 for a model it does not serve) and
its error body (``{"error": {"message", "type", "param", "code"}}``).

The mock has no real tokenizer.  Text is tokenized deterministically, one token per
whitespace-separated word, its id ``xxh3_64(word) mod vocab`` (:func:`tokenize`); a chat's
messages are each ``<|role|>`` then the content's words, then ``<|assistant|>``
(:func:`chat_tokens`).  Generated tokens are a pure function of the prompt's token ids
(:func:`output_token`), the same on every engine and every run, and their text is
``" t<id>"`` each (:func:`detokenize`).  The mock never samples EOS: a request generates
exactly its ``max_tokens`` (as vLLM with ``ignore_eos``); sampling parameters
(``temperature``, ``seed``, ``top_p``, ...) are accepted and do not change the tokens.
Not supported, refused with a 400 that says so: ``n`` > 1, batched prompts (a list of
more than one prompt), ``logprobs``, ``echo``, and chat content parts other than text.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections.abc import Sequence
from typing import Any

import xxhash

DEFAULT_COMPLETION_TOKENS = 16
"""``max_tokens`` of a completion that does not say (OpenAI's and vLLM's default)."""


class BadRequest(Exception):
    """A request vLLM's server would refuse: ``status`` and its error body (:meth:`body`)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    @property
    def kind(self) -> str:
        return "NotFoundError" if self.status == 404 else "BadRequestError"

    def body(self) -> dict[str, Any]:
        return error_body(str(self), status=self.status, kind=self.kind, param=self.param)


def error_body(message: str, *, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclasses.dataclass(frozen=True, slots=True)
class GenRequest:
    """A checked generation request."""

    chat: bool
    tokens: tuple[int, ...]
    max_tokens: int
    stream: bool
    include_usage: bool  # stream_options.include_usage (non-streaming answers always carry usage)
    return_token_ids: bool  # vLLM's ``return_token_ids``: token ids in each choice


# -- the tokenizer --------------------------------------------------------------------------
def tokenize(text: str, vocab: int) -> list[int]:
    """One token per whitespace-separated word: ``xxh3_64(word) mod vocab``."""
    return [xxhash.xxh3_64_intdigest(w.encode()) % vocab for w in text.split()]


def detokenize(token_ids: Sequence[int]) -> str:
    return "".join(f" t{t}" for t in token_ids)


def chat_tokens(messages: Any, vocab: int) -> list[int]:
    """A chat's prompt: each message ``<|role|>`` and its content's words, then ``<|assistant|>``."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of message objects", param="messages")
    out: list[int] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"messages[{i}]: only text content parts are supported by the mock engine", param="messages"
                    )
                parts.append(part["text"])
            text = " ".join(parts)
        else:
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", param="messages")
        out += tokenize(f"<|{m['role']}|> {text}", vocab)
    return out + tokenize("<|assistant|>", vocab)


def prompt_digest(tokens: Sequence[int]) -> int:
    """The seed of a prompt's generated tokens."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens))


def output_token(digest: int, index: int, vocab: int) -> int:
    """The ``index``-th generated token of the prompt of ``digest`` (from 0)."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QI", digest, index)) % vocab


# -- requests ----------------------------------------------------------------------------------
def _int(body: dict[str, Any], key: str, *, low: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise BadRequest(f"{key} must be an integer >= {low}, got {v!r}", param=key)
    return v


def _common(body: Any, served: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served:
        raise BadRequest(f"The model `{model}` does not exist.", status=404, param="model")
    n = _int(body, "n", low=1)
    if n is not None and n > 1:
        raise BadRequest("n > 1 is not supported by the mock engine", param="n")
    for key in ("logprobs", "top_logprobs", "prompt_logprobs"):
        if body.get(key) not in (None, False):
            raise BadRequest(f"{key} is not supported by the mock engine", param=key)
    if body.get("echo"):
        raise BadRequest("echo is not supported by the mock engine", param="echo")
    for key in ("stream", "ignore_eos", "return_token_ids"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise BadRequest(f"{key} must be a boolean, got {body[key]!r}", param=key)
    opts = body.get("stream_options")
    if opts is not None:
        if not body.get("stream"):
            raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
    return body


def _prompt(p: Any, vocab: int) -> list[int]:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return tokenize(p, vocab)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"Token id {bad} is out of vocabulary (0..{vocab - 1})", param="prompt")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
        raise BadRequest("batched prompts are not supported by the mock engine: send one prompt", param="prompt")
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of one of those", param="prompt")


def _finish(
    body: dict[str, Any], tokens: list[int], max_tokens: int | None, *, chat: bool, max_model_len: int
) -> GenRequest:
    if not tokens:
        raise BadRequest("The prompt cannot be empty", param="messages" if chat else "prompt")
    if max_tokens is None:
        max_tokens = max_model_len - len(tokens) if chat else DEFAULT_COMPLETION_TOKENS
    if len(tokens) + max_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the {'messages' if chat else 'prompt'}, "
            f"{max_tokens} in the completion). Please reduce the length of the "
            f"{'messages' if chat else 'prompt'} or completion.",
            param="max_tokens",
        )
    min_tokens = _int(body, "min_tokens", low=0)
    if min_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    opts = body.get("stream_options") or {}
    return GenRequest(
        chat=chat,
        tokens=tuple(tokens),
        max_tokens=max_tokens,
        stream=bool(body.get("stream")),
        include_usage=bool(opts.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids")),
    )


def parse_completion(body: Any, *, served: str, vocab: int, max_model_len: int) -> GenRequest:
    """A ``POST /v1/completions`` body, checked (:class:`BadRequest` if vLLM would refuse it)."""
    b = _common(body, served)
    tokens = _prompt(b.get("prompt"), vocab)
    return _finish(b, tokens, _int(b, "max_tokens", low=1), chat=False, max_model_len=max_model_len)


def parse_chat(body: Any, *, served: str, vocab: int, max_model_len: int) -> GenRequest:
    """A ``POST /v1/chat/completions`` body, checked."""
    b = _common(body, served)
    tokens = chat_tokens(b.get("messages"), vocab)
    limit = _int(b, "max_completion_tokens", low=1)
    if limit is None:
        limit = _int(b, "max_tokens", low=1)
    return _finish(b, tokens, limit, chat=True, max_model_len=max_model_len)


# -- answers ------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _choice(req: GenRequest, token_ids: Sequence[int], finish: str | None, *, delta: bool) -> dict[str, Any]:
    text = detokenize(token_ids)
    c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    if req.chat and delta:
        c["delta"] = {"content": text}
    elif req.chat:
        c["message"] = {"role": "assistant", "content": text}
    else:
        c["text"] = text
    if req.return_token_ids:
        c["token_ids"] = list(token_ids)
    return c


def chunk(
    req: GenRequest, rid: str, model: str, token_ids: Sequence[int], finish: str | None, created: int
) -> dict[str, Any]:
    """One streamed chunk (``text_completion`` or ``chat.completion.chunk``)."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice(req, token_ids, finish, delta=True)],
    }


def role_chunk(rid: str, model: str, created: int) -> dict[str, Any]:
    """A chat stream's first chunk, before any token (as vLLM sends it)."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }


def usage_chunk(req: GenRequest, rid: str, model: str, created: int, use: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }


def full(req: GenRequest, rid: str, model: str, token_ids: Sequence[int], use: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed answer (``text_completion`` or ``chat.completion``)."""
    return {
        "id": rid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(req, token_ids, "length", delta=False)],
        "usage": use,
        "kv_transfer_params": None,
    }
