"""The two doorbells of a ring: FIFOs next to it (``<name>.data.bell``, ``<name>.space.bell``), and the sleep
flags in its header that say when one is worth ringing (the sleeping and waking protocol is drawn in
:mod:`p2pworker.shm.ring`'s docstring).

The consumer sleeps on the data bell and the producer rings it after a publish; the producer sleeps on the space
bell and the consumer rings it after a release.
"""

from __future__ import annotations

import os
import select
import stat
from typing import Callable

from p2pworker.errors import RingError
from p2pworker.shm.ring_layout import END_WORDS, Role, bell_paths, fence


def open_bell(path: str, create: bool) -> int:
    if create:
        os.mkfifo(path, 0o600)
    # O_RDWR on a FIFO never blocks in open() and keeps the pipe alive on Linux.
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise RingError(f"{path} is not a FIFO")
    return fd


class Bells:
    """One end's bell (it sleeps on it) and its peer's (it rings it), with both sleep flags in ``words`` (the
    ring's own ``memoryview`` cast to u64)."""

    def __init__(self, name: str, role: Role, words: memoryview, *, create: bool):
        data_bell, space_bell = bell_paths(name)
        self._data_fd = open_bell(data_bell, create=create)
        try:
            self._space_fd = open_bell(space_bell, create=create)
        except BaseException:
            os.close(self._data_fd)
            raise
        self._w = words
        self._my_sleep, self._peer_sleep = END_WORDS[role].sleeping, END_WORDS[role.peer].sleeping
        if role is Role.PRODUCER:
            self._my_bell, self._peer_bell = self._space_fd, self._data_fd
        else:
            self._my_bell, self._peer_bell = self._data_fd, self._space_fd
        self._poller = select.poll()
        self._poller.register(self._my_bell, select.POLLIN)

    def ring_peer(self) -> None:
        """After a publish or a release: wake the peer if it said it may sleep (hot: every put and get)."""
        fence()
        w = self._w
        if w[self._peer_sleep]:
            w[self._peer_sleep] = 0
            try:
                os.write(self._peer_bell, b"\x01")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def wake_peer(self) -> None:
        """Ring the peer's bell whether it sleeps or not (this end closed: it must see that now)."""
        fence()
        try:
            os.write(self._peer_bell, b"\x01")
        except (BlockingIOError, OSError):
            pass

    def fileno(self) -> int:
        return self._my_bell

    def arm(self, ready: Callable[[], bool]) -> bool:
        """Announce that this side is about to sleep.  True if it should not (``ready()`` after the fence)."""
        self._w[self._my_sleep] = 1
        fence()
        if ready():
            self._w[self._my_sleep] = 0
            return True
        return False

    def disarm(self, drain: bool = True) -> None:
        """Done sleeping.  ``drain=False``: a poll just found the bell empty, so skip the read that empties it."""
        self._w[self._my_sleep] = 0
        if drain:
            try:
                os.read(self._my_bell, 4096)
            except BlockingIOError:
                pass

    def sleep(self, timeout_ms: int) -> None:
        """Poll this end's bell (armed first) for up to ``timeout_ms``."""
        self._poller.poll(timeout_ms)

    def watch(self, woken: Callable[[], bool], timeout_ms: int, interrupt_fd: int) -> None:
        """Sleep on this end's bell and ``interrupt_fd`` unless ``woken()`` after arming; disarm after."""
        self._w[self._my_sleep] = 1
        fence()
        try:
            if woken():
                return
            poller = select.poll()
            poller.register(self._my_bell, select.POLLIN)
            poller.register(interrupt_fd, select.POLLIN)
            poller.poll(timeout_ms)
        finally:
            self.disarm()

    def close(self) -> None:
        """Close both FIFOs' descriptors.  Idempotent."""
        for fd in (self._data_fd, self._space_fd):
            if fd >= 0:
                os.close(fd)
        self._data_fd = self._space_fd = -1
