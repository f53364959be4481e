#!/usr/bin/env bash
# Set up kvstore on a fresh Debian machine: system packages, a virtual environment
# in .venv, the package (editable) with its test, GPU-agent, demo and planner extras.  Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
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

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# the CPU build of torch (the GPU agent's extra); an unpinned torch would pull a multi-GB CUDA build
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,gpu,demo,plan]"
echo "kvstore is set up in .venv"
