"""Demos and the tools they share: not product code (nothing in ``gpu_agent`` imports them).

Modules: ``cli`` (``kvstore demo``: arguments and dispatch), ``pd`` (``kvstore demo pd``:
prefill -> decode handoff, a small random Llama), ``_worker`` (one process of that demo,
``python -m kvstore.demo._worker``), ``hf`` (its Hugging Face glue), ``vllm`` (``kvstore
demo vllm``), ``lmcache`` (``kvstore demo lmcache``), ``engine`` (one vLLM engine in a
process of its own: the vLLM demos, the end-to-end tests, the simulator's calibration).
Importing this package imports nothing.
"""
