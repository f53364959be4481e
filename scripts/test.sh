#!/usr/bin/env bash
# The project's test command (the README's, and CI's after set-up and lint), in five phases:
#   main   the main suite on both cores (pytest-xdist, one worker per core, a module's tests on
#          one worker so module fixtures start once), every test but the two phases below;
#   solo   the tests marked `solo`: they need the machine to themselves (chaos, load, network
#          partitions, the browser, timing-sensitive fleets), run one at a time after `main`;
#   vllm   tests/vllm in .venv-vllm (real vLLM engines, shared per module: tests/vllm/vllm_rig.py);
#   sglang tests/hicache in .venv-sglang (SGLang's own HiCache controller and pools over a real node);
#   lmcache tests/lmcache_store in .venv-vllm made with --lmcache (LMCache's own storage manager over a real node).
# Every phase runs even if an earlier one failed (one run lists every failure); the exit status
# is non-zero if any failed.  Each phase lists its 15 slowest tests; at the end it prints each phase's seconds and status; with
# TEST_PHASE_LOG set, it also appends "phase seconds status" lines to that file (.ci/run's table).
#   scripts/test.sh               all five phases
#   scripts/test.sh main solo     just those phases, in that order
#   TEST_WORKERS=1        the main phase on one core (default: the machine's cores, at most 2 here)
set -uo pipefail
cd "$(dirname "$0")/.."
phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(main solo vllm sglang lmcache)
for p in "${phases[@]}"; do
  case "$p" in
    main | solo | vllm | sglang | lmcache) ;;
    *) echo "test.sh: unknown phase $p (known: main, solo, vllm, sglang, lmcache)" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/pytest ] || { echo "test.sh: .venv/bin/pytest missing: run scripts/setup.sh" >&2; exit 2; }
# The suite starts hundreds of Python processes (nodes, engines, conductors, CLIs) from this tree:
# with PYTHONDONTWRITEBYTECODE set (some images set it) each compiled the project anew (about 1 s
# of CPU for the conductor's imports) and pytest rewrote every test module in every phase and worker
# (15 s each).  The tests write bytecode (git ignores __pycache__), whatever the caller's setting.
unset PYTHONDONTWRITEBYTECODE
cores=$(nproc 2>/dev/null || echo 1)
workers=${TEST_WORKERS:-$((cores < 2 ? 1 : 2))}

run_phase() {
  case "$1" in
    main)
      if [ "$workers" -gt 1 ]; then
        .venv/bin/pytest -n "$workers" --dist loadfile --durations=15 -m "not gpu and not vllm and not sglang and not lmcache and not solo"
      else
        .venv/bin/pytest --durations=15 -m "not gpu and not vllm and not sglang and not lmcache and not solo"
      fi
      ;;
    solo) .venv/bin/pytest --durations=15 -m "solo and not gpu and not vllm and not sglang and not lmcache" ;;
    vllm)
      [ -x .venv-vllm/bin/pytest ] || { echo "test.sh: .venv-vllm missing: run scripts/setup.sh --vllm" >&2; return 2; }
      .venv-vllm/bin/pytest --durations=15 -m vllm tests/vllm
      ;;
    sglang)
      [ -x .venv-sglang/bin/pytest ] || { echo "test.sh: .venv-sglang missing: run scripts/setup.sh --sglang" >&2; return 2; }
      .venv-sglang/bin/pytest --durations=15 -m sglang tests/hicache
      ;;
    lmcache)
      .venv-vllm/bin/python -c "import lmcache" 2>/dev/null \
        || { echo "test.sh: LMCache missing in .venv-vllm: run scripts/setup.sh --vllm --lmcache" >&2; return 2; }
      .venv-vllm/bin/pytest --durations=15 -m lmcache tests/lmcache_store
      ;;
  esac
}

table=()
failed=0
for p in "${phases[@]}"; do
  echo "== test.sh: $p"
  t0=$(date +%s)
  run_phase "$p"
  rc=$?
  # pytest's 5, nothing selected, is a failure but in `solo` (a tree may mark none)
  if [ "$rc" = 0 ] || { [ "$rc" = 5 ] && [ "$p" = solo ]; }; then status=passed; else status="failed (exit $rc)"; failed=1; fi
  secs=$(($(date +%s) - t0))
  table+=("$(printf '%-6s %6d s  %s' "$p" "$secs" "$status")")
  [ -z "${TEST_PHASE_LOG:-}" ] || echo "$p $secs $status" >>"$TEST_PHASE_LOG"
done
echo "== test.sh: phases"
printf '%s\n' "${table[@]}"
exit $failed
