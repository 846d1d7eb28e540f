"""Single-producer / single-consumer rings in POSIX shared memory.

One ring carries messages one way between exactly two processes (the adapter
inside vLLM and its worker use two: commands one way, events the other).
Memory comes from ``posix_ipc.SharedMemory`` (``/dev/shm/<name>``); the wake-up
"bells" are two FIFOs next to it (``/dev/shm/<name>.data.bell`` and
``.space.bell``), so a sleeping side can wait on a file descriptor together
with its ZMQ sockets.

Byte layout (native-endian u64 words; each group with one writer sits on its
own 64-byte cache line)::

    byte  word  field          written by   meaning
    ----  ----  -------------  -----------  ------------------------------------
       0     0  MAGIC          creator      b"p2pwring" as u64
       8     1  VERSION        creator      layout version (2: messages may span slots)
      16     2  NSLOTS         creator      number of slots, a power of two
      24     3  SLOT_BYTES     creator      bytes per slot, length word included
      64     8  HEAD           producer     messages published (monotonic)
     128    16  TAIL           consumer     messages consumed (monotonic)
     192    24  PROD_PID       producer     pid, 0 until a producer attached
     200    25  PROD_START     producer     its start time (/proc/<pid>/stat)
     208    26  PROD_STATE     producer     0 unattached, 1 attached, 2 closed
     256    32  CONS_PID       consumer     \
     264    33  CONS_START     consumer      } same, for the consumer
     272    34  CONS_STATE     consumer     /
     320    40  CONS_SLEEPING  both         1: consumer may sleep on the data bell
     384    48  PROD_SLEEPING  both         1: producer may sleep on the space bell
     512        slot 0 ... slot NSLOTS-1, SLOT_BYTES each:

        slot k = seq % NSLOTS:   [ u64 word | payload (length bytes) | unused ]
        word = length (bits 0..47) | MORE (bit 63): another slot of this message follows

Messages larger than one slot span consecutive slots (invariant 8: a 65,536-key
job is ~2.8 MB; a 1M-key one is larger than the whole ring).  The producer
publishes the slots of one message in order, as space frees up; the consumer
copies MORE slots into a reassembly buffer and returns the message when the
slot without MORE arrives.  A message larger than ``max_message_bytes`` (a
hard limit, checked on both sides) raises ``MessageTooLarge`` before anything
is published.  A non-blocking producer (``try_put``) that cannot publish a
whole message at once keeps the rest and publishes it from :meth:`flush`
(and every later ``try_put``), so messages never interleave.

Head/tail protocol::

    empty: HEAD == TAIL            full: HEAD - TAIL == NSLOTS
    put:   wait for HEAD - TAIL < NSLOTS; write payload, then length, into slot
           HEAD % NSLOTS; then store HEAD + 1            (publish)
    get:   wait for TAIL < HEAD; read slot TAIL % NSLOTS;
           then store TAIL + 1                           (release the slot)

Memory ordering: HEAD and TAIL each have one writer and are stored with one
aligned 8-byte store (``memoryview.cast("Q")``), so they are never torn.  On
x86-64 (TSO) stores become visible in program order and loads are not
reordered with older loads, so "payload, then HEAD" on one side and "HEAD,
then payload" on the other need no fence.  On weaker machines ``_fence()`` is
called around publish and release.

Sleeping and waking (both directions are the same; shown for the consumer)::

    consumer:  spin up to spin_s, os.sched_yield() between looks
               CONS_SLEEPING = 1; fence; look again; if still empty:
               poll(data bell, min(poll_slice_s, time left)); CONS_SLEEPING = 0
    producer:  publish HEAD; fence; if CONS_SLEEPING: CONS_SLEEPING = 0 and
               write one byte to the data bell

The fence on both sides (store, then load: Dekker) means the two cannot miss
each other.  The bell wait is sliced: every slice checks the peer's liveness
(pid + start time, or its CLOSED state), so a dead peer is reported as
``PeerDead`` within one slice, and no wait is ever unbounded by accident.
A side that must never block (the adapter inside vLLM's scheduler) uses the
``try_*`` calls only.

The code, by concern: :mod:`~p2pworker.shm.ring_layout` (the words above, the names in /dev/shm),
:mod:`~p2pworker.shm.ring_sides` (the producer and consumer halves, mixins of :class:`Ring`: the hot path),
:mod:`~p2pworker.shm.ring_bells` (the bells and sleep flags), :mod:`~p2pworker.shm.ring_peer` (role claims, peer
liveness); :class:`Ring` here creates, attaches, waits, watches and closes.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any, Callable

import msgspec
import posix_ipc

from p2pworker.errors import RingError
from p2pworker.shm.ring_bells import Bells
from p2pworker.shm.ring_layout import (DEFAULT_MAX_MESSAGE_BYTES, HEADER_BYTES, LEN_BYTES, LEN_MASK, MAGIC, MORE,
                                       NAME_RE, SHM_DIR, STATE_ATTACHED, STATE_CLOSED, STATE_UNATTACHED, VERSION,
                                       W_HEAD, W_MAGIC, W_NSLOTS, W_SLOT_BYTES, W_TAIL, W_VERSION, Role, bell_paths,
                                       ring_files, unlink_all)
from p2pworker.shm.ring_peer import Ends, PeerStatus
from p2pworker.shm.ring_sides import ConsumerSide, ProducerSide

__all__ = [  # the names this module has always offered; each now lives in the room named above
    "DEFAULT_MAX_MESSAGE_BYTES", "HEADER_BYTES", "LEN_BYTES", "LEN_MASK", "MAGIC", "MORE", "SHM_DIR",
    "STATE_ATTACHED", "STATE_CLOSED", "STATE_UNATTACHED", "VERSION", "PeerStatus", "Ring", "Role", "bell_paths",
    "ring_files",
]


class Ring(ProducerSide, ConsumerSide):
    """One endpoint (producer or consumer) of a shared-memory SPSC ring.

    Use :meth:`create` in the process that owns the ring (it unlinks the names
    in :meth:`close`) and :meth:`attach` in the other.  ``msg_type`` (a msgspec
    type, e.g. a tagged Struct union) makes :meth:`put`/:meth:`get` encode and
    decode msgpack; the ``*_bytes`` calls move raw bytes.
    """

    def __init__(
        self,
        name: str,
        role: Role,
        shm: posix_ipc.SharedMemory,
        *,
        creator: bool,
        msg_type: Any = None,
        spin_s: float = 200e-6,
        poll_slice_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ):
        self.name = name
        self.max_message_bytes = max_message_bytes
        self._tx: memoryview | None = None  # producer: the unpublished rest of a message that spans slots
        self._rx = bytearray()  # consumer: the slots of a message whose last slot has not arrived
        self._skipping = False  # consumer: the rest of a message refused as too large is consumed unread
        self.role = role
        self.creator = creator
        self.spin_s = spin_s
        self.poll_slice_s = poll_slice_s
        self._clock = clock
        self._closed = False
        self._unlinked = False
        self._mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        self._buf = memoryview(self._mm)
        self._w = self._buf.cast("Q")
        w = self._w
        magic, version = w[W_MAGIC], w[W_VERSION]
        if magic != MAGIC or version != VERSION:
            self._release_memory()
            raise RingError(
                f"/dev/shm/{name} is not a p2pworker ring of version {VERSION} "
                f"(magic {magic:#x}, version {version})"
            )
        self.nslots = int(w[W_NSLOTS])
        self.slot_bytes = int(w[W_SLOT_BYTES])
        self.capacity = self.slot_bytes - LEN_BYTES
        self._mask = self.nslots - 1
        self._bells = Bells(name, role, w, create=creator)
        self._ring_peer_bell = self._bells.ring_peer  # bound once: called on every publish and release
        self._ends = Ends(name, role, w)
        self._ready = self._has_data if role is Role.CONSUMER else self._has_space
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(msg_type) if msg_type is not None else msgspec.msgpack.Decoder()
        try:
            self._ends.claim()
        except RingError:  # a live process holds the role
            self._release_all()
            raise

    # ------------------------------------------------------------ construction
    @classmethod
    def create(
        cls, name: str, role: Role, *, nslots: int = 256, slot_bytes: int = 4096, **kw: Any
    ) -> "Ring":
        """Create the ring ``name`` (fails if it exists) and take ``role`` in it."""
        if not NAME_RE.match(name):
            raise RingError(f"bad ring name {name!r}: use [A-Za-z0-9_.-], at most 200 chars")
        if nslots < 2 or nslots & (nslots - 1):
            raise RingError(f"nslots must be a power of two >= 2, got {nslots}")
        if slot_bytes < 64 or slot_bytes % 64:
            raise RingError(f"slot_bytes must be a multiple of 64 and >= 64, got {slot_bytes}")
        size = HEADER_BYTES + nslots * slot_bytes
        try:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError as e:
            raise RingError(f"ring {name!r} already exists in {SHM_DIR}") from e
        try:
            with mmap.mmap(shm.fd, size) as mm:
                with memoryview(mm) as mv, mv[:HEADER_BYTES].cast("Q") as w:
                    w[W_NSLOTS] = nslots
                    w[W_SLOT_BYTES] = slot_bytes
                    w[W_VERSION] = VERSION
                    w[W_MAGIC] = MAGIC  # last: an attacher sees a complete header or none
            return cls(name, role, shm, creator=True, **kw)
        except BaseException:
            shm.close_fd()
            unlink_all(name)
            raise

    @classmethod
    def attach(cls, name: str, role: Role, **kw: Any) -> "Ring":
        """Attach to the existing ring ``name`` and take ``role`` in it."""
        if not NAME_RE.match(name):
            raise RingError(f"bad ring name {name!r}")
        try:
            shm = posix_ipc.SharedMemory("/" + name)
        except posix_ipc.ExistentialError as e:
            raise RingError(f"ring {name!r} does not exist in {SHM_DIR}") from e
        if shm.size < HEADER_BYTES:
            shm.close_fd()
            raise RingError(f"ring {name!r} is too small to be a ring ({shm.size} bytes)")
        return cls(name, role, shm, creator=False, **kw)

    # ------------------------------------------------------------ liveness (ring_peer.Ends)
    @property
    def peer_pid(self) -> int:
        return self._ends.peer_pid

    def peer_status(self) -> PeerStatus:
        return self._ends.peer_status()

    def peer_alive(self) -> bool:
        """True unless the peer attached and then closed, exited or crashed."""
        return not self._ends.peer_status().gone

    def check_peer(self) -> None:
        self._ends.check_peer()

    # ------------------------------------------------------------ watching (a second thread of the consumer)
    def depth(self) -> int:
        """Messages published and not yet consumed."""
        w = self._w
        return int(w[W_HEAD] - w[W_TAIL])

    def published(self) -> tuple[int, int]:
        """(TAIL, HEAD): slots consumed and published so far.  Read-only: safe from a thread other than the
        consumer's (each word is one aligned 8-byte load)."""
        w = self._w
        return int(w[W_TAIL]), int(w[W_HEAD])

    def peek_head(self, slot: int, nbytes: int = 32) -> bytes:
        """The first ``nbytes`` of slot ``slot``'s payload, unconsumed.  A hint only: the consumer may release the
        slot and the producer re-fill it while this reads (then the bytes are of a message already taken).  While
        the consumer does not consume, slots from TAIL to HEAD are stable (the producer writes only at HEAD)."""
        off = HEADER_BYTES + (slot & self._mask) * self.slot_bytes
        n = min(int(self._w[off >> 3]) & LEN_MASK, nbytes, self.capacity)
        return bytes(self._buf[off + LEN_BYTES : off + LEN_BYTES + n])

    def watch(self, after_head: int, timeout_s: float, interrupt_fd: int) -> None:
        """Sleep until HEAD passes ``after_head``, ``interrupt_fd`` is readable, or ``timeout_s`` ends.  For a
        watcher thread beside a consumer that only polls (the adapter's engine waker): it uses this endpoint's
        sleep flag and bell, which the consumer's ``try_get`` never touches.  Never call it while the consumer
        itself may sleep on this ring (``get``)."""
        w = self._w
        self._bells.watch(lambda: w[W_HEAD] > after_head, max(0, int(timeout_s * 1000)), interrupt_fd)

    # ------------------------------------------------------------ waiting (ring_bells.Bells)
    def fileno(self) -> int:
        """The bell this endpoint sleeps on: readable when the peer rang it.

        For external poll loops: call :meth:`arm` before polling this fd and
        :meth:`disarm` after; ``arm()`` returning True means "ready now, do not
        sleep".
        """
        return self._bells.fileno()

    def arm(self) -> bool:
        """Announce that this side is about to sleep.  True if it should not."""
        return self._bells.arm(self._ready)

    def disarm(self, drain: bool = True) -> None:
        """Done sleeping.  ``drain=False``: a poll just found the bell empty, so skip the read that empties it."""
        self._bells.disarm(drain)

    def _wait(self, ready: Callable[[], bool], timeout_s: float | None, what: str) -> None:
        if self._closed:
            raise RingError(f"ring {self.name!r} is closed")
        clock = self._clock
        now = clock()
        deadline = None if timeout_s is None else now + timeout_s
        spin_end = now + self.spin_s
        yield_ = os.sched_yield
        while True:  # bounded spin: a hot peer answers within microseconds
            if ready():
                return
            now = clock()
            if now >= spin_end or (deadline is not None and now >= deadline):
                break
            yield_()
        while True:  # then sleep on the bell, one slice at a time
            if self.arm():
                return
            try:
                self.check_peer()
                slice_s = self.poll_slice_s
                if deadline is not None:
                    left_s = deadline - clock()
                    if left_s <= 0:
                        raise TimeoutError(
                            f"no {what} on ring {self.name!r} ({self.role.value}) within {timeout_s} s"
                        )
                    slice_s = min(slice_s, left_s)
                self._bells.sleep(max(1, int(slice_s * 1000 + 0.999)))
            finally:
                self.disarm()

    # ------------------------------------------------------------ teardown
    def unlink(self) -> None:
        """Remove the ring's names from /dev/shm; mappings stay valid.

        Safe once both sides attached: after it, a crash of either side leaves
        nothing behind.  Idempotent.
        """
        if not self._unlinked:
            self._unlinked = True
            unlink_all(self.name)

    def close(self) -> None:
        """Mark this side closed, wake the peer, unmap.  The creator also unlinks.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ends.mark_closed()
        self._bells.wake_peer()  # a sleeping peer sees CLOSED now
        self._release_all()
        if self.creator:
            self.unlink()

    def _release_memory(self) -> None:
        self._w.release()
        self._buf.release()
        self._mm.close()

    def _release_all(self) -> None:
        self._release_memory()
        self._bells.close()

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ring({self.name!r}, {self.role.value}, nslots={self.nslots}, slot_bytes={self.slot_bytes})"
