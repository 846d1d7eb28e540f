"""A ring's header words, slot framing and file names (drawn in :mod:`p2pworker.shm.ring`'s docstring).

Shared by the rooms of the ring: :mod:`~p2pworker.shm.ring_sides` (the producer and consumer halves),
:mod:`~p2pworker.shm.ring_bells`, :mod:`~p2pworker.shm.ring_peer` and :class:`~p2pworker.shm.ring.Ring`.
"""

from __future__ import annotations

import enum
import os
import platform
import re
import threading
from dataclasses import dataclass

import posix_ipc

from p2pworker.limits import RING_MAX_MESSAGE_BYTES

MAGIC = int.from_bytes(b"p2pwring", "little")
VERSION = 2
HEADER_BYTES = 512
LEN_BYTES = 8
MORE = 1 << 63  # in a slot's length word: the message continues in the next slot
LEN_MASK = (1 << 48) - 1
DEFAULT_MAX_MESSAGE_BYTES = RING_MAX_MESSAGE_BYTES

W_MAGIC, W_VERSION, W_NSLOTS, W_SLOT_BYTES = 0, 1, 2, 3
W_HEAD, W_TAIL = 8, 16
W_PROD_PID, W_PROD_START, W_PROD_STATE = 24, 25, 26
W_CONS_PID, W_CONS_START, W_CONS_STATE = 32, 33, 34
W_CONS_SLEEPING, W_PROD_SLEEPING = 40, 48

STATE_UNATTACHED, STATE_ATTACHED, STATE_CLOSED = 0, 1, 2

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")

TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier, from Python.

    An uncontended lock round trip is a pair of atomic read-modify-writes in
    libc (``lock cmpxchg`` on x86), which orders every earlier store before
    every later load.  Costs ~0.2 us here.
    """
    _fence_lock.acquire()
    _fence_lock.release()


class Role(enum.Enum):
    PRODUCER = "producer"
    CONSUMER = "consumer"

    @property
    def peer(self) -> "Role":
        """The role at the other end of the ring."""
        return Role.CONSUMER if self is Role.PRODUCER else Role.PRODUCER


@dataclass(frozen=True)
class EndWords:
    """The header words one end of a ring writes (its claim) and the flag that says it may sleep."""

    pid: int
    start: int
    state: int
    sleeping: int


END_WORDS: dict[Role, EndWords] = {
    Role.PRODUCER: EndWords(W_PROD_PID, W_PROD_START, W_PROD_STATE, W_PROD_SLEEPING),
    Role.CONSUMER: EndWords(W_CONS_PID, W_CONS_START, W_CONS_STATE, W_CONS_SLEEPING),
}


def bell_paths(name: str) -> tuple[str, str]:
    return f"{SHM_DIR}/{name}.data.bell", f"{SHM_DIR}/{name}.space.bell"


def ring_files(name: str) -> list[str]:
    """Every filesystem entry a ring called ``name`` owns (for sweeping)."""
    return [f"{SHM_DIR}/{name}", *bell_paths(name)]


def unlink_all(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass
    for path in bell_paths(name):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
