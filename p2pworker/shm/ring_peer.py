"""The two ends of a ring as its header words say: this end's claim on its role, and the peer's liveness.

Each end writes its pid, its start time (``/proc/<pid>/stat``) and its state (unattached, attached, closed) into
its own words; the other end reads them.  A pid alone is not an identity (:mod:`p2pworker.shm.liveness`).
"""

from __future__ import annotations

import enum

from p2pworker.errors import PeerDead, RingError
from p2pworker.shm.liveness import process_alive, self_identity
from p2pworker.shm.ring_layout import END_WORDS, STATE_ATTACHED, STATE_CLOSED, STATE_UNATTACHED, Role


class PeerStatus(enum.Enum):
    """The other side of a ring, as its header words say."""

    PENDING = "pending"  # not attached yet
    ALIVE = "alive"
    CLOSED = "closed"  # it closed the ring (an orderly exit)
    DEAD = "dead"  # attached, then its process exited or was killed (pid + start time no longer match)

    @property
    def gone(self) -> bool:
        return self in (PeerStatus.CLOSED, PeerStatus.DEAD)


class Ends:
    """This end's claim on ``role`` in ring ``name`` and what the peer's words say, over the header ``words``
    (the ring's own ``memoryview`` cast to u64: no second view, so the ring can release its mapping)."""

    def __init__(self, name: str, role: Role, words: memoryview):
        self.name = name
        self.role = role
        self._w = words
        self._me = END_WORDS[role]
        self._peer = END_WORDS[role.peer]

    def claim(self) -> None:
        """Take this end's role; RingError when a live process holds it."""
        w, me = self._w, self._me
        if w[me.state] == STATE_ATTACHED and process_alive(int(w[me.pid]), int(w[me.start])):
            raise RingError(f"{self.role.value} role of ring {self.name!r} is held by live pid {int(w[me.pid])}")
        pid, start = self_identity()
        w[me.pid] = pid
        w[me.start] = start
        w[me.state] = STATE_ATTACHED

    def mark_closed(self) -> None:
        """This end closed the ring (the peer reads PeerStatus.CLOSED)."""
        self._w[self._me.state] = STATE_CLOSED

    @property
    def peer_pid(self) -> int:
        return int(self._w[self._peer.pid])

    def peer_status(self) -> PeerStatus:
        w, peer = self._w, self._peer
        state = w[peer.state]
        if state == STATE_UNATTACHED:
            return PeerStatus.PENDING
        if state == STATE_CLOSED:
            return PeerStatus.CLOSED
        return PeerStatus.ALIVE if process_alive(int(w[peer.pid]), int(w[peer.start])) else PeerStatus.DEAD

    def check_peer(self) -> None:
        """PeerDead when the peer closed the ring or its process is gone."""
        status = self.peer_status()
        if status is PeerStatus.CLOSED:
            raise PeerDead(self.name, self.role.peer.value, self.peer_pid, "it closed the ring")
        if status is PeerStatus.DEAD:
            raise PeerDead(self.name, self.role.peer.value, self.peer_pid, "the process exited or was killed")
