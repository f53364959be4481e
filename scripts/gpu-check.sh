#!/usr/bin/env bash
# Prove the GPU agent's CUDA paths on a GPU machine, in under 8 minutes, and print one summary.
#
#   scripts/gpu-check.sh [--wheels DIR] [--device cuda|cpu] [--quick]
#
# Steps (each under its own time limit):
#   1. a Python with the project, pytest and a CUDA torch: $PYTHON if set, else .venv,
#      else the machine's python3; what is missing goes into .venv-gpu (it sees the
#      machine's packages, so a preinstalled CUDA torch is used as it is);
#   2. pytest -m gpu tests/gpu (ordering without host syncs, page reuse after save, two
#      agents on one client, a node restart under a live agent, cuda:1 where there are two
#      devices, concurrent prefetch and load, scattered block tables, bounce-buffer staging);
#   3. kvstore bench gpu with a scattered block table: arena -> HBM load against a
#      pinned cudaMemcpyAsync of the same bytes (target >= 0.8x), HBM -> arena save against
#      a pinned D2H copy, byte-identical loads.
#
# --device cpu dry-runs what needs no GPU (step 1, and the bench on CPU tensors, whose
# numbers mean nothing); step 2 is then skipped.  --quick runs a smaller bench.
#
# Machines without network: prepare a wheel folder where there is one, carry it, and pass
# --wheels DIR (pip then installs with --no-index from DIR only).  On the same platform and
# Python version as the GPU machine (else add --platform/--python-version/--only-binary=:all:):
#
#   python3 -c 'import tomllib; [print(d) for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]' >deps.txt
#   pip download -d wheels -r deps.txt pytest      # about 40 MB; the project itself runs from the tree
#   pip download -d wheels torch                   # only for a machine without a CUDA torch (GBs)
#
# Exit status: 0 when every step passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

WHEELS=""
DEVICE="cuda"
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$(cd "$2" && pwd)" || { echo "gpu-check: no wheel folder $2" >&2; exit 2; }; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu-check: --device is cuda or cpu" >&2; exit 2 ;; esac

START=$(date +%s)
LOG="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
declare -a SUMMARY=()
FAILED=0
note() { SUMMARY+=("$1"); echo "gpu-check: $1"; }
fail() { FAILED=1; note "FAIL $1"; }

# -- 1. a Python that has what the checks import ------------------------------------------
has() {  # has PYTHON: the project's imports, pytest, and torch (with CUDA unless --device cpu)
  "$1" - "$DEVICE" >/dev/null 2>&1 <<'EOF'
import sys
import grpc, numpy, pydantic, pytest, xxhash, lmdb  # noqa: F401
import torch
sys.exit(0 if sys.argv[1] == "cpu" or torch.cuda.is_available() else 1)
EOF
}

PY=""
for cand in "${PYTHON:-}" "$ROOT/.venv/bin/python" "$ROOT/.venv-gpu/bin/python" "$(command -v python3 || true)"; do
  if [ -n "$cand" ] && [ -x "$cand" ] && has "$cand"; then PY="$cand"; break; fi
done
if [ -z "$PY" ]; then
  base="$(command -v python3 || true)"
  [ -n "$base" ] || { echo "gpu-check: no python3 on this machine" >&2; exit 2; }
  if [ ! -x "$ROOT/.venv-gpu/bin/python" ]; then
    "$base" -m venv --system-site-packages "$ROOT/.venv-gpu" >"$LOG/venv.log" 2>&1 \
      || { cat "$LOG/venv.log" >&2; echo "gpu-check: cannot create .venv-gpu (python3-venv missing?)" >&2; exit 2; }
  fi
  PY="$ROOT/.venv-gpu/bin/python"
  pip_args=(--disable-pip-version-check -q)
  if [ -n "$WHEELS" ]; then
    pip_args+=(--no-index --find-links "$WHEELS")
  fi
  # the project runs from this tree (nothing to build): only its dependencies are installed;
  # torch comes from the machine when it has one, and is installed only where it is missing
  mapfile -t pkgs < <("$PY" -c 'import tomllib; [print(d) for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]')
  pkgs+=(pytest)
  "$PY" -c "import torch" >/dev/null 2>&1 || pkgs+=(torch)
  timeout 240 "$PY" -m pip install "${pip_args[@]}" "${pkgs[@]}" >"$LOG/pip.log" 2>&1 \
    || { tail -20 "$LOG/pip.log" >&2; echo "gpu-check: installing into .venv-gpu failed${WHEELS:+ (from $WHEELS only)}" >&2; exit 2; }
  has "$PY" || { echo "gpu-check: $PY still lacks a CUDA torch or the project's packages" >&2; exit 2; }
fi
info="$("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
       torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)"
note "python $PY: torch $info"

# -- 2. the CUDA test suite -----------------------------------------------------------------
if [ "$DEVICE" = "cuda" ]; then
  timeout 300 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="" >"$LOG/pytest.log" 2>&1
  rc=$?
  line="$(grep -E '[0-9]+ (passed|failed|error)' "$LOG/pytest.log" | tail -1)"
  if [ $rc -eq 0 ]; then note "ok   pytest -m gpu tests/gpu: $line"
  else
    tail -40 "$LOG/pytest.log"
    fail "pytest -m gpu tests/gpu (rc $rc): ${line:-see $LOG/pytest.log}"
  fi
else
  note "skip pytest -m gpu tests/gpu (--device cpu)"
fi

# -- 3. the benchmark, scattered block table --------------------------------------------------
if [ $QUICK -eq 1 ] || [ "$DEVICE" = "cpu" ]; then
  size=(--layers 8 --blocks 8 --iters 3)
else
  size=(--layers 32 --blocks 16 --iters 5)
fi
timeout 240 "$PY" -m kvstore bench gpu --device "$DEVICE" --table scattered "${size[@]}" --json >"$LOG/bench.json" 2>"$LOG/bench.err"
rc=$?
if [ $rc -ne 0 ]; then
  tail -20 "$LOG/bench.err"
  fail "kvstore bench gpu (rc $rc)"
else
  verdict="$("$PY" - "$LOG/bench.json" "$DEVICE" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
ratio = r["ratio_arena_to_hbm_vs_pinned"]
load = r["agent_gbps"]["load_from_arena"]
ok = r["agent_load_byte_identical"] and (sys.argv[2] == "cpu" or (r["arena_pinned"] and ratio["agent_load"] >= 0.8))
print(("ok  " if ok else "FAIL") + f" bench ({r['table']} table, {r['blocks']} blocks of {r['block_bytes'] >> 20} MiB): "
      f"load {load:.1f} GB/s = {ratio['agent_load']:.2f}x pinned cudaMemcpyAsync (target >= 0.8), "
      f"{ratio['agent_load_vs_whole_blocks']:.2f}x whole blocks; save {r['agent_gbps']['save_to_arena']:.1f} GB/s = "
      f"{ratio['agent_save_vs_pinned_d2h']:.2f}x pinned D2H; "
      f"HBM pool {r['agent_gbps']['load_from_hbm_pool']:.1f} GB/s; overlap hides {r['overlap']['hidden_over_load']:.0%} of the load; "
      f"pinned {r['arena_pinned']}, byte-identical {r['agent_load_byte_identical']}")
EOF
)"
  case "$verdict" in
    ok*) note "$verdict" ;;
    *) fail "${verdict#FAIL }" ;;
  esac
fi

# -- summary ---------------------------------------------------------------------------------
echo
echo "== gpu-check summary ($(( $(date +%s) - START )) s, logs in $LOG) =="
for s in "${SUMMARY[@]}"; do echo "  $s"; done
if [ $FAILED -eq 0 ]; then echo "  ALL GREEN"; else echo "  FAILED"; fi
exit $FAILED
