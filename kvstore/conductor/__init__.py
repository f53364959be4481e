"""``kvstore conductor``: the KV-cache-aware, SLO-aware request scheduler in front of vLLM engines.

Mooncake's other half: each request goes where its time to first token is estimated to be
shortest, counting what each engine's own cache holds, what the pool holds and where,
each engine's queue, and what moving the KV costs; with SLOs set, requests that cannot
meet them are refused before any engine spends time on them.

* :mod:`~kvstore.conductor.policy`: the decision (pure);
* :mod:`~kvstore.conductor.cost`: the TTFT/TBT model, fitted online to the fleet;
* :mod:`~kvstore.conductor.engines`: the engines, their liveness and load;
* :mod:`~kvstore.conductor.kvevents` and :mod:`~kvstore.conductor.localview`: each
  engine's own prefix cache, from vLLM's KV events;
* :mod:`~kvstore.conductor.service`: the state and background work of one conductor;
* :mod:`~kvstore.conductor.front`: the OpenAI-compatible HTTP front (aiohttp);
* :mod:`~kvstore.conductor.cli`: ``kvstore conductor``.
"""
