"""The vLLM connector's tests need vLLM (``./scripts/setup.sh --vllm`` makes ``.venv-vllm``);
``.ci/run`` runs them there with ``-m vllm``.  Elsewhere they are deselected by the
``vllm`` marker, and not even imported where vLLM is missing."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]
