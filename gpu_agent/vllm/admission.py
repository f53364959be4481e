"""What the connector saves: the save policy (``save_policy``), pure and clock-free.

Saving every computed chunk is the pool's cost with no reuse: a copy, a checksum and two
RPCs per chunk, for KV nobody reads again.  A chunk is worth storing when it will be read
again; the policies say how that is known:

* ``always``: every chunk the engine computes (prompt, decode with ``save_decode``, the
  prompt's trailing partial chunk);
* ``second-sighting``: a chunk whose key this engine has looked up before (a count-min
  sketch of lookups, :class:`Sightings`): a system prompt is stored by its second request
  and read by the third; a one-off prompt is never stored; decode chunks are never stored
  (nobody has looked them up);
* ``hinted``: requests that carry a retention hint (``kv_transfer_params["session_id"]``,
  a conversation whose next turn extends this one, or ``kv_transfer_params["retain"]``
  true) store everything, decode KV included; others store nothing;
* ``auto`` (the default): ``hinted`` for requests with a hint, ``second-sighting`` for
  the rest.

An engine that only produces (``kv_producer``, prefill/decode) stores every chunk whatever
the policy: its consumer reads them next.  Chunks are stored as a leading run (a lookup
matches leading chunks only), so a chunk not admitted ends the run.

State: :class:`Sightings` belongs to the scheduler half (its thread only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gpu_agent.vllm.spec import request_session
from kvstore.keys import ChunkKey
from tiers.sketch import FrequencySketch

SAVE_POLICIES = ("auto", "always", "second-sighting", "hinted")
EVERYTHING = 1 << 62


@dataclasses.dataclass(frozen=True, slots=True)
class SavePlan:
    """What one request may store: its leading ``prompt_chunks`` full prompt chunks (chunk
    counts from 0), the prompt's trailing partial chunk (``tail``), decode chunks (``decode``)."""

    prompt_chunks: int = EVERYTHING
    tail: bool = True
    decode: bool = True

    @property
    def limited(self) -> bool:
        return self.prompt_chunks < EVERYTHING or not self.tail or not self.decode


NOTHING = SavePlan(0, False, False)


class Sightings:
    """How many times each chunk key was looked up lately (a count-min sketch with ageing:
    ``tiers.sketch.FrequencySketch``; a few hundred KiB, whatever the number of keys)."""

    def __init__(self, width: int = 1 << 16) -> None:
        self._sketch = FrequencySketch(width)

    def sight(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Count one sighting of each key; each key's count, this one included."""
        return [self._sketch.increment(k) for k in keys]


def hinted(request: Any) -> bool:
    """Whether a request says its KV will be read again (a session, or ``retain``)."""
    if request_session(request) is not None:
        return True
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("retain") is True


def plan(
    policy: str,
    *,
    counts: Sequence[int],
    tail_count: int | None,
    hint: bool,
    producer_only: bool,
    save_decode: bool,
) -> SavePlan:
    """The :class:`SavePlan` of one request: ``counts`` are its full prompt chunks' sighting
    counts (:meth:`Sightings.sight`, this lookup included), ``tail_count`` its partial
    chunk's (None: the prompt ends on a chunk boundary)."""
    if producer_only or policy == "always" or (hint and policy in ("hinted", "auto")):
        seen_tail = policy == "always" or producer_only or (tail_count or 0) >= 2
        return SavePlan(EVERYTHING, seen_tail, save_decode)
    if policy == "hinted":
        return NOTHING
    run = next((i for i, c in enumerate(counts) if c < 2), len(counts))
    return SavePlan(run, run == len(counts) and (tail_count or 0) >= 2, False)
