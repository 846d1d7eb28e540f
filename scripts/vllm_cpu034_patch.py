"""The edits scripts/vllm_cpu034.sh makes to third-party files to run vLLM 0.34.0 on this kind of machine (x86, no GPU,
no triton-cpu).  Each edit is idempotent and refuses, saying why, a file that does not look as expected.

    python scripts/vllm_cpu034_patch.py platform [--check | --revert] [FILE]
        FILE: vllm/platforms/cpu.py of an installed vLLM 0.34.0 (default: the running interpreter's).  vLLM 0.34 stops
        on an x86 CPU without triton-cpu ("requires Triton (triton-cpu)"); it has a standalone no-Triton CPU model
        runner that it enables only on non-x86 CPUs.  Three edits enable that runner on x86 when $P2PW_VLLM_CPU_KERNELS
        names a library holding the runner's kernels (which the x86 build leaves out: scripts/vllm_cpu034_kernels.cpp)
        and load that library after vLLM's own kernels.  Not a configuration upstream supports: the scheduler, engine
        core, KV offloading and tiering are 0.34's own, the model runner is the standalone one.
        --check: exit 0 if patched, 1 if not (the file is as shipped), 2 if the file is neither.
    python scripts/vllm_cpu034_patch.py sdist SRC_DIR
        the unpacked vllm-0.34.0 sdist, before `setup.py bdist_wheel` for the CPU: Debian 12's gcc 12.2 (vLLM asks for
        12.3 on x86; gcc 12.2 crashes on four array bounds of csrc/cpu/sgl-kernels/flash_mla.cpp written as a constexpr,
        and compiles them written as its value), and the CPU requirements without the `+cpu` torch pin (PyPI has the
        CUDA build of torch 2.14.0 only, which runs on the CPU) and without triton-cpu (a GitHub release asset).
    python scripts/vllm_cpu034_patch.py torch-cmake SITE_PACKAGES
        torch 2.14.0's CMake config in a build environment: PyPI's torch is the CUDA build, and its Caffe2Config.cmake
        looks for a CUDA toolkit (none here) when anything links against torch; define the one imported target the
        torch_cuda interface needs (torch::cudart, empty), which makes public/cuda.cmake return at its include guard.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import sysconfig
from pathlib import Path

ENV = "P2PW_VLLM_CPU_KERNELS"
MARK = "p2pworker vllm_cpu034"  # on every line we add, so a patched file is recognised (and can be reverted)

# platform: (as shipped, as patched); each "as shipped" must occur exactly once in vLLM 0.34.0's file.
PLATFORM_EDITS = [
    (  # 1. check_and_update_config: no RuntimeError on x86 without Triton when the runner's kernels are given
        '        if cls.get_cpu_architecture() == CpuArchEnum.X86 and not HAS_TRITON:\n'
        '            raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")\n',
        '        if cls.get_cpu_architecture() == CpuArchEnum.X86 and not HAS_TRITON:\n'
        f'            if not os.environ.get("{ENV}"):  # {MARK}: x86 runs the standalone runner\n'
        '                raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")\n',
    ),
    (  # 2. uses_standalone_cpu_model_runner: true on x86 too when the runner's kernels are given
        '        return not HAS_TRITON and cls.get_cpu_architecture() != CpuArchEnum.X86\n',
        f'        if not HAS_TRITON and os.environ.get("{ENV}"):  # {MARK}: the standalone runner on x86\n'
        f'            return True  # {MARK}\n'
        '        return not HAS_TRITON and cls.get_cpu_architecture() != CpuArchEnum.X86\n',
    ),
    (  # 3. the end of import_kernels: after vllm._C (which defines the `_C` op library), load the runner's kernels
        '        else:\n'
        '            try:\n'
        '                import vllm._C  # noqa: F401\n'
        '            except ImportError as e:\n'
        '                logger.warning_once("Failed to import from vllm._C: %s", repr(e))\n',
        '        else:\n'
        '            try:\n'
        '                import vllm._C  # noqa: F401\n'
        '            except ImportError as e:\n'
        '                logger.warning_once("Failed to import from vllm._C: %s", repr(e))\n'
        f'        if os.environ.get("{ENV}"):  # {MARK}: the standalone runner\'s kernels\n'
        f'            torch.ops.load_library(os.environ["{ENV}"])  # {MARK}\n',
    ),
]


class Unexpected(Exception):
    """The file is not the one the edits were written for."""


def _state(text: str, edits: list[tuple[str, str]]) -> str:
    """'patched', 'shipped', or raise Unexpected saying which edit does not fit."""
    done = [text.count(new) == 1 for _, new in edits]
    if all(done):
        return "patched"
    if MARK in text:
        raise Unexpected(f"partly patched (edits {[i + 1 for i, d in enumerate(done) if not d]} missing)")
    for i, (old, _) in enumerate(edits, 1):
        if (n := text.count(old)) != 1:
            raise Unexpected(f"edit {i}: the code it replaces occurs {n} times, not once:\n{old}")
    return "shipped"


def _check_platform_structure(text: str) -> None:
    """The loaded library must come last in import_kernels, and the methods must be where the edits assume."""
    tree = ast.parse(text)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CpuPlatform"), None)
    if cls is None:
        raise Unexpected("no class CpuPlatform")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    for name in ("check_and_update_config", "uses_standalone_cpu_model_runner", "import_kernels"):
        if name not in methods:
            raise Unexpected(f"CpuPlatform has no method {name}")
    last = methods["import_kernels"].body[-1]
    if not (isinstance(last, ast.If) and ENV in ast.unparse(last.test)):
        raise Unexpected("after the edit, import_kernels does not end by loading the kernel library")
    for name in ("check_and_update_config", "uses_standalone_cpu_model_runner"):
        if ENV not in ast.unparse(methods[name]):
            raise Unexpected(f"after the edit, {name} does not read ${ENV}")


def _write(path: Path, text: str) -> None:
    """A new file in the old one's place, never an edit in place: uv installs by hard-linking files from its cache,
    so writing into the installed file would change every environment (and the cache) that shares it."""
    tmp = path.with_name(path.name + ".p2pw-tmp")
    tmp.write_text(text)
    os.chmod(tmp, path.stat().st_mode)
    os.replace(tmp, path)


def platform(path: Path, check: bool, revert: bool) -> int:
    text = path.read_text()
    try:
        state = _state(text, PLATFORM_EDITS)
    except Unexpected as e:
        print(f"vllm_cpu034_patch: {path} does not look like vLLM 0.34.0's vllm/platforms/cpu.py: {e}",
              file=sys.stderr)
        return 2
    if check:
        print(f"vllm_cpu034_patch: {path}: {state}")
        return 0 if state == "patched" else 1
    if revert:
        if state == "patched":
            for old, new in PLATFORM_EDITS:
                text = text.replace(new, old, 1)
            _write(path, text)
        print(f"vllm_cpu034_patch: {path}: as shipped")
        return 0
    if state == "shipped":
        for old, new in PLATFORM_EDITS:
            text = text.replace(old, new, 1)
        try:
            _check_platform_structure(text)
        except (Unexpected, SyntaxError) as e:
            print(f"vllm_cpu034_patch: {path}: refusing to write: {e}", file=sys.stderr)
            return 2
        _write(path, text)
    print(f"vllm_cpu034_patch: {path}: patched (the standalone CPU model runner when ${ENV} is set)")
    return 0


def _edit(path: Path, fn, what: str) -> None:
    text = path.read_text()
    new = fn(text)
    if new != text:
        _write(path, new)
        print(f"vllm_cpu034_patch: {path}: {what}")
    else:
        print(f"vllm_cpu034_patch: {path}: already {what}")


def _gcc(text: str) -> str:
    old, new = "VERSION_GREATER_EQUAL 12.3))", "VERSION_GREATER_EQUAL 12.2))"
    if text.count(new) == 1 and old not in text:
        return text
    if text.count(old) != 1 or 'message(FATAL_ERROR "X86 backend requires gcc/g++ >= 12.3")' not in text:
        raise Unexpected("no single x86 gcc >= 12.3 check")
    return text.replace(old, new, 1).replace(
        'message(FATAL_ERROR "X86 backend requires gcc/g++ >= 12.3")',
        f'message(FATAL_ERROR "X86 backend requires gcc/g++ >= 12.2")  # {MARK}: 12.3 upstream', 1)


FLASH_MLA_BOUND = re.compile(r"^(\s*alignas\(64\) \w+ \w+\[)kBLOCK_H_MAX( \* BLOCK_N)?\];$", re.M)


def _flash_mla(text: str) -> str:
    if "constexpr int64_t kBLOCK_H_MAX = 16;" not in text:
        raise Unexpected("kBLOCK_H_MAX is not 16")
    n = len(FLASH_MLA_BOUND.findall(text))
    if n == 0 and len(re.findall(r"alignas\(64\) \w+ \w+\[16( \* BLOCK_N)?\];", text)) == 4:
        return text
    if n != 4:
        raise Unexpected(f"{n} arrays bounded by kBLOCK_H_MAX, not 4")
    return FLASH_MLA_BOUND.sub(lambda m: f"{m.group(1)}16{m.group(2) or ''}];  // {MARK}: kBLOCK_H_MAX (gcc 12.2)",
                               text)


def _requirements(expect_triton: int):
    def edit(text: str) -> str:
        lines = text.splitlines(keepends=True)
        pins = [i for i, ln in enumerate(lines) if ln.startswith("torch==2.14.0+cpu;")]
        triton = [i for i, ln in enumerate(lines) if ln.startswith("triton @ ")]
        if not pins and not triton and any(ln.startswith("torch==2.14.0;") for ln in lines):
            return text
        if len(pins) != 1 or len(triton) != expect_triton:
            raise Unexpected(f"{len(pins)} torch==2.14.0+cpu pins and {len(triton)} triton URLs, "
                             f"not 1 and {expect_triton}")
        lines[pins[0]] = lines[pins[0]].replace("torch==2.14.0+cpu;", "torch==2.14.0;", 1)
        return "".join(ln for i, ln in enumerate(lines) if i not in triton)
    return edit


def sdist(src: Path) -> int:
    if not (src / "setup.py").is_file() or "Version: 0.34.0" not in (src / "PKG-INFO").read_text():
        print(f"vllm_cpu034_patch: {src} is not an unpacked vllm-0.34.0 sdist", file=sys.stderr)
        return 2
    steps = [
        ("cmake/cpu_extension.cmake", _gcc, "gcc 12.2 accepted"),
        ("csrc/cpu/sgl-kernels/flash_mla.cpp", _flash_mla, "array bounds written as 16"),
        ("requirements/cpu.txt", _requirements(expect_triton=2), "torch==2.14.0 (PyPI's), no triton-cpu"),
        ("requirements/build/cpu.txt", _requirements(expect_triton=0), "torch==2.14.0 (PyPI's)"),
    ]
    for rel, fn, what in steps:
        try:
            _edit(src / rel, fn, what)
        except Unexpected as e:
            print(f"vllm_cpu034_patch: {src / rel} does not look like vLLM 0.34.0's: {e}", file=sys.stderr)
            return 2
    return 0


TORCH_CUDA_INCLUDE = '  include("${CMAKE_CURRENT_LIST_DIR}/public/cuda.cmake")\n'
TORCH_NO_CUDA = (f"  # {MARK}: a CPU-only build against PyPI's CUDA torch on a machine without a CUDA toolkit;\n"
                 "  # with this empty target public/cuda.cmake returns at its include guard\n"
                 "  if(NOT TARGET torch::cudart)\n"
                 "    add_library(torch::cudart INTERFACE IMPORTED)\n"
                 "  endif()\n")


def torch_cmake(site: Path) -> int:
    path = site / "torch/share/cmake/Caffe2/Caffe2Config.cmake"
    if not path.is_file():
        print(f"vllm_cpu034_patch: no torch CMake config at {path}", file=sys.stderr)
        return 2
    text = path.read_text()
    if TORCH_NO_CUDA + TORCH_CUDA_INCLUDE in text:
        print(f"vllm_cpu034_patch: {path}: already without the CUDA toolkit lookup")
        return 0
    if text.count(TORCH_CUDA_INCLUDE) != 1 or MARK in text:
        print(f"vllm_cpu034_patch: {path} does not look like torch 2.14.0's (one include of public/cuda.cmake)",
              file=sys.stderr)
        return 2
    _write(path, text.replace(TORCH_CUDA_INCLUDE, TORCH_NO_CUDA + TORCH_CUDA_INCLUDE, 1))
    print(f"vllm_cpu034_patch: {path}: without the CUDA toolkit lookup")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("platform", help="vllm/platforms/cpu.py: the standalone CPU model runner on x86")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--revert", action="store_true")
    p.add_argument("file", nargs="?", type=Path,
                   default=Path(sysconfig.get_paths()["purelib"]) / "vllm" / "platforms" / "cpu.py")
    sub.add_parser("sdist", help="the unpacked vllm-0.34.0 sdist").add_argument("src", type=Path)
    sub.add_parser("torch-cmake", help="a build environment's torch").add_argument("site", type=Path)
    a = ap.parse_args(argv)
    if a.what == "platform":
        if not a.file.is_file():
            print(f"vllm_cpu034_patch: no {a.file} (is vLLM installed there?)", file=sys.stderr)
            return 2
        return platform(a.file, a.check, a.revert)
    if a.what == "sdist":
        return sdist(a.src)
    return torch_cmake(a.site)


if __name__ == "__main__":
    sys.exit(main())
