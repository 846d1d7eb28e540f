"""The worker's copies stream past the caches: glibc's non-temporal threshold, set for the worker process.

A same-host copy (p2pworker.data.samehost.Copier) moves megabytes that nobody reads soon after: vLLM's next touch of
the row is a GPU DMA, or another copy many steps later.  glibc's ``memmove`` uses ordinary stores below its
non-temporal threshold, so every destination line is first read from DRAM (read-for-ownership) and then written
back: three DRAM transfers per byte instead of two.  glibc sets that threshold from the cache size; on the
2-core EPYC VMs this runs on it is 0xf000000 (240 MiB), so no copy of ours streamed (docs/configuration.md,
"Streaming copies"; ``p2pworker bench --path same_host`` measures the copies through two workers).

The threshold is a glibc tunable, read once when a process starts: so the worker is started with it
(:func:`worker_env`, used by ``WorkerClient``), and ``p2pworker launch`` started without it (an operator's own
launch line) execs itself once with it added.  An operator who sets ``glibc.cpu.x86_non_temporal_threshold``
in ``GLIBC_TUNABLES`` keeps that value (to turn streaming off: a value above the largest copy, e.g. 0xffffffffff).
Other platforms (not x86-64, not glibc) ignore it: nothing is changed there.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
THRESHOLD = 0x10000  # 64 KiB: a same-host chunk is 1 MiB.  Every other copy this size streams too (a multi-MB
# ring message or control frame of a 65,536-key job): those cost speed at most, not measured
REEXEC_MARK = "P2PWORKER_TUNED"  # set on the exec'd process: never a second exec, whatever glibc made of it


def applies() -> bool:
    """x86-64 with glibc (the tunable exists there only)."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    return platform.machine() in ("x86_64", "AMD64") and libc.startswith("glibc")


def worker_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with the threshold added to ``GLIBC_TUNABLES``; None when nothing is to change (set already, by us
    or the operator, or not applicable)."""
    current = env.get("GLIBC_TUNABLES", "")
    if TUNABLE in current or not applies():
        return None
    setting = f"{TUNABLE}={THRESHOLD:#x}"
    return {**env, "GLIBC_TUNABLES": f"{current}:{setting}" if current else setting}


def reexec_if_untuned() -> None:
    """In ``p2pworker launch``, before anything else: exec this same command line once with the threshold set (the
    pid stays: an adapter or supervisor watching it sees the same process).  Returns when nothing is to change."""
    if os.environ.get(REEXEC_MARK):
        return
    args = sys.argv[1:]
    # Only a process started as ``... launch ...``: inside another program (click's CliRunner, cli.main() called
    # from Python) orig_argv is that program's command line, which must not be run again.
    if not sys.executable or "launch" not in args or sys.orig_argv[len(sys.orig_argv) - len(args):] != args:
        return
    env = worker_env(os.environ)
    if env is None:
        return
    env[REEXEC_MARK] = "1"
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:  # the interpreter moved under us, say: run untuned rather than not at all
        logging.getLogger(__name__).warning("not re-executing with %s (copies will not stream): %s", TUNABLE, e)
