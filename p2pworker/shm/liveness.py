"""Process identity and liveness across processes, without signals.

A pid alone is not an identity: pids are reused, and a child that died but was
not reaped yet (a zombie) still answers ``kill(pid, 0)``.  We therefore name a
process by ``(pid, start_time)`` where ``start_time`` is field 22 of
``/proc/<pid>/stat`` (clock ticks since boot), and call it alive only while a
process with that pid and that start time exists and is not a zombie.
"""

from __future__ import annotations

import os


def _read_stat(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rindex(b")") + 2 :].split()
    state = rest[0].decode()
    start_ticks = int(rest[19])  # field 22 overall; rest[0] is field 3
    return state, start_ticks


def start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot, 0 if it does not exist."""
    st = _read_stat(pid)
    return st[1] if st else 0


def self_identity() -> tuple[int, int]:
    pid = os.getpid()
    return pid, start_time(pid)


def process_alive(pid: int, start_ticks: int) -> bool:
    """True while the process ``(pid, start_ticks)`` exists and is not a zombie."""
    if pid <= 0:
        return False
    st = _read_stat(pid)
    if st is None:
        return False
    state, ticks = st
    if start_ticks and ticks != start_ticks:
        return False  # the pid was reused by another process
    return state not in ("Z", "X", "x")
