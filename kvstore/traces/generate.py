"""Synthetic Mooncake-format traces: multi-turn conversations over shared system prompts.

The model (every draw from one ``random.Random(seed)``, so a seed names a trace):

* ``system_prompts`` shared system prompts with Zipf(``zipf``) popularity, each
  ~``system_tokens`` tokens (log-normal).  A conversation opens with one of them with
  probability ``reuse``, otherwise with a private preamble of the same length
  distribution (no cross-conversation reuse);
* conversations start as a Poisson process; each has a geometric number of turns with
  mean ``turns``.  Turn *t+1* arrives an exponential ``think_s`` after turn *t* and its
  prompt is turn *t*'s prompt + turn *t*'s output (``output_tokens``) + a new user
  message (``user_tokens``).  With probability ``branch`` a turn instead re-asks from
  an earlier turn of the same conversation (an edit or a regenerate);
* a ``one_shot`` fraction of requests are single, unrelated prompts (~``user_tokens``);
* requests arrive at ``rate`` per second on average (the conversation start rate is
  set so the total matches) and are written sorted by timestamp;
* session hints (``sessions``): each conversation is a session (``"session_id"`` on its
  requests; its length is its number of turns, mean ``turns``), and so is each one-shot
  request.  A ``close_share`` of sessions that end within the trace send a
  ``close_session`` event ``close_after_s`` after their last turn (the rest are left to
  the node's idle TTL, like a client that forgets).  These draws come from a second
  generator, so the requests are the same with or without sessions.

Block ids follow the format's rule: full ``block_tokens`` blocks of a prompt keep their
id from the request that first had them; a trailing partial block always gets a fresh
id (the next turn fills it with other tokens), and so does the block where a shared
system prompt ends and the conversation's own tokens begin.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import random

from kvstore.errors import InvalidArgument
from kvstore.traces.format import DEFAULT_BLOCK_TOKENS, Close, Request


@dataclasses.dataclass(frozen=True, slots=True)
class GenParams:
    requests: int = 2000
    seed: int = 0
    system_prompts: int = 20
    system_tokens: int = 6000
    zipf: float = 1.0
    reuse: float = 0.7
    turns: float = 4.0
    think_s: float = 60.0
    user_tokens: int = 1500
    output_tokens: int = 300
    branch: float = 0.1
    one_shot: float = 0.2
    rate: float = 4.0
    max_tokens: int = 128_000
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    sessions: bool = True
    close_after_s: float = 60.0
    close_share: float = 1.0

    def check(self) -> GenParams:
        def need(ok: bool, flag: str, what: str, v: object) -> None:
            if not ok:
                raise InvalidArgument(f"--{flag} must be {what}, got {v!r}")

        need(self.requests > 0, "requests", "positive", self.requests)
        need(self.system_prompts >= 0, "system-prompts", "zero or more", self.system_prompts)
        need(self.system_tokens > 0, "system-tokens", "positive", self.system_tokens)
        need(self.zipf >= 0, "zipf", "zero or more", self.zipf)
        need(0 <= self.reuse <= 1, "reuse", "in [0, 1]", self.reuse)
        need(self.turns >= 1, "turns", "at least 1", self.turns)
        need(self.think_s > 0, "think-time", "positive", self.think_s)
        need(self.user_tokens > 0, "user-tokens", "positive", self.user_tokens)
        need(self.output_tokens >= 0, "output-tokens", "zero or more", self.output_tokens)
        need(0 <= self.branch < 1, "branch", "in [0, 1)", self.branch)
        need(0 <= self.one_shot <= 1, "one-shot", "in [0, 1]", self.one_shot)
        need(self.rate > 0, "rate", "positive", self.rate)
        need(self.block_tokens > 0, "block-tokens", "positive", self.block_tokens)
        need(self.max_tokens >= self.block_tokens, "max-tokens", "at least one block", self.max_tokens)
        need(
            self.close_after_s >= 0 and math.isfinite(self.close_after_s),
            "close-after",
            "zero or more seconds",
            self.close_after_s,
        )
        need(0 <= self.close_share <= 1, "close-share", "in [0, 1]", self.close_share)
        return self


@dataclasses.dataclass(slots=True)
class _Conversation:
    ids: list[int]  # full-block ids of the current context
    tokens: int  # tokens of the current context
    history: list[tuple[list[int], int]]  # (ids, tokens) of earlier turns, for branches
    turns_left: int


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.8) -> int:
    """A log-normal draw with the given mean (not median), at least 1."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, int(rng.lognormvariate(mu, sigma)))


def generate(p: GenParams) -> list[Request]:
    """The requests of the trace ``p`` names, without session hints (:func:`generate_events` gives them)."""
    return generate_events(dataclasses.replace(p, sessions=False))[0]


def generate_events(p: GenParams) -> tuple[list[Request], list[Close]]:
    """The requests and the ``close_session`` events of the trace ``p`` names."""
    p.check()
    rng = random.Random(p.seed)
    ids = _Ids()
    bt = p.block_tokens
    prompts = []  # (full-block ids, tokens) per shared system prompt
    for _ in range(p.system_prompts):
        n = _lognormal(rng, p.system_tokens, 0.6)
        prompts.append((ids.fresh(n // bt), n))
    weights = [1.0 / (i + 1) ** p.zipf for i in range(len(prompts))]
    # rate of conversation starts such that requests arrive at p.rate overall
    conv_rate = p.rate * (1 - p.one_shot) / p.turns
    one_shot_rate = p.rate * p.one_shot
    events: list[tuple[float, int, int]] = []  # (time s, seq, conversation index or -1 new / -2 one-shot)
    seq = 0

    def push(t: float, what: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, what))
        seq += 1

    if conv_rate > 0:
        push(rng.expovariate(conv_rate), -1)
    if one_shot_rate > 0:
        push(rng.expovariate(one_shot_rate), -2)
    convs: dict[int, _Conversation] = {}
    next_conv = 0
    out: list[Request] = []
    ended: list[tuple[float, str]] = []  # (time of the last turn, session) of sessions that ended
    one_shots = 0

    def request(t: float, full: list[int], tokens: int, output: int, session: str) -> Request:
        tail = [] if tokens % bt == 0 else ids.fresh(1)  # a partial last block: fresh every time
        return Request(
            round(t * 1000, 3), tokens, output, tuple(full[: tokens // bt] + tail), session if p.sessions else None
        )

    while len(out) < p.requests:
        t, _, what = heapq.heappop(events)
        out_tokens = _lognormal(rng, p.output_tokens) if p.output_tokens else 0
        if what == -2:
            tokens = min(_lognormal(rng, p.user_tokens), p.max_tokens)
            one_shots += 1
            out.append(request(t, ids.fresh(tokens // bt), tokens, out_tokens, f"o{one_shots}"))
            ended.append((t, f"o{one_shots}"))
            push(t + rng.expovariate(one_shot_rate), -2)
            continue
        if what == -1:
            push(t + rng.expovariate(conv_rate), -1)
            if prompts and rng.random() < p.reuse:
                base, base_tokens = rng.choices(prompts, weights)[0]
            else:
                base_tokens = _lognormal(rng, p.system_tokens, 0.6)
                base = ids.fresh(base_tokens // bt)
            user = _lognormal(rng, p.user_tokens)
            tokens = min(base_tokens + user, p.max_tokens)
            # blocks past the shared prompt's last full block are this conversation's own
            full = list(base[: tokens // bt]) + ids.fresh(max(0, tokens // bt - len(base)))
            turns = 1
            while rng.random() < 1 - 1 / p.turns:  # geometric, mean p.turns
                turns += 1
            conv = _Conversation(full, tokens, [], turns)
            what = next_conv
            next_conv += 1
            convs[what] = conv
        else:
            conv = convs[what]
            if conv.history and rng.random() < p.branch:
                conv.ids, conv.tokens = rng.choice(conv.history)
            grown = min(conv.tokens + out_tokens + _lognormal(rng, p.user_tokens), p.max_tokens)
            keep = conv.tokens // bt  # full blocks of the previous prompt stay; the rest is new
            conv.ids = conv.ids[:keep] + ids.fresh(grown // bt - keep)
            conv.tokens = grown
        out.append(request(t, conv.ids, conv.tokens, out_tokens, f"c{what}"))
        conv.history.append((list(conv.ids), conv.tokens))
        conv.turns_left -= 1
        if conv.turns_left > 0 and conv.tokens < p.max_tokens:
            push(t + rng.expovariate(1 / p.think_s), what)
        else:
            del convs[what]
            ended.append((t, f"c{what}"))
    t0 = out[0].timestamp
    reqs = [dataclasses.replace(r, timestamp=round(r.timestamp - t0, 3)) for r in out]
    return reqs, _closes(p, reqs, ended, t0) if p.sessions else []


def _closes(p: GenParams, reqs: list[Request], ended: list[tuple[float, str]], t0: float) -> list[Close]:
    """A close ``close_after_s`` after each ended session's last turn (a ``close_share`` of them),
    placed among the requests by time; closes after the trace's last request are left out."""
    rng = random.Random(f"{p.seed}/closes")  # its own draws: the requests do not depend on these
    last = reqs[-1].timestamp
    times = [r.timestamp for r in reqs]
    out = []
    for t, session in ended:
        if rng.random() >= p.close_share:
            continue
        at = round(round(t * 1000, 3) - t0 + p.close_after_s * 1000, 3)  # t0: the first request's ms, unshifted
        if at <= last:
            out.append(Close(at, session, bisect.bisect_right(times, at)))
    out.sort(key=lambda c: (c.before, c.timestamp))
    return out
