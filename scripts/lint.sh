#!/usr/bin/env bash
# The quality gate: ruff lint, ruff format check and mypy, with the versions pinned in the
# `test` extra (installed into .venv by scripts/setup.sh).  Fails if any of the three fails;
# runs all three either way, so one run lists every finding.
#   scripts/lint.sh            check the whole project (configuration: pyproject.toml)
#   scripts/lint.sh --fix      let ruff fix what it can and format, then check
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${KVSTORE_VENV:-.venv}
for tool in ruff mypy; do
  [ -x "$VENV/bin/$tool" ] || { echo "lint.sh: $VENV/bin/$tool missing: run scripts/setup.sh" >&2; exit 2; }
done
if [ "${1:-}" = "--fix" ]; then
  "$VENV/bin/ruff" check --fix . && "$VENV/bin/ruff" format .
elif [ $# -gt 0 ]; then
  echo "lint.sh: unknown option $1 (known: --fix)" >&2; exit 2
fi
failed=()
echo "== ruff check";          "$VENV/bin/ruff" check . || failed+=("ruff check")
echo "== ruff format --check"; "$VENV/bin/ruff" format --check . || failed+=("ruff format")
echo "== mypy";                "$VENV/bin/mypy" || failed+=("mypy")
if [ ${#failed[@]} -gt 0 ]; then
  echo "lint.sh: failed: ${failed[*]}" >&2
  exit 1
fi
echo "lint.sh: ruff and mypy pass"
