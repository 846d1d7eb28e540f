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
"""

from __future__ import annotations

import enum
import os
import platform
import re
import select
import stat
import threading
import time
from typing import Any, Callable

import mmap
import msgspec
import posix_ipc

from p2pworker.errors import MessageTooLarge, PeerDead, RingError
from p2pworker.limits import RING_MAX_MESSAGE_BYTES
from p2pworker.shm.liveness import process_alive, self_identity

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
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")

_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()


def _fence() -> None:
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


def bell_paths(name: str) -> tuple[str, str]:
    return f"{SHM_DIR}/{name}.data.bell", f"{SHM_DIR}/{name}.space.bell"


def ring_files(name: str) -> list[str]:
    """Every filesystem entry a ring called ``name`` owns (for sweeping)."""
    return [f"{SHM_DIR}/{name}", *bell_paths(name)]


def _open_bell(path: str, create: bool) -> int:
    if create:
        os.mkfifo(path, 0o600)
    # O_RDWR on a FIFO never blocks in open() and keeps the pipe alive on Linux.
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise RingError(f"{path} is not a FIFO")
    return fd



class PeerStatus(enum.Enum):
    """The other side of a ring, as its header words say."""

    PENDING = "pending"  # not attached yet
    ALIVE = "alive"
    CLOSED = "closed"  # it closed the ring (an orderly exit)
    DEAD = "dead"  # attached, then its process exited or was killed (pid + start time no longer match)

    @property
    def gone(self) -> bool:
        return self in (PeerStatus.CLOSED, PeerStatus.DEAD)

class Ring:
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
        data_bell, space_bell = bell_paths(name)
        self._data_fd = _open_bell(data_bell, create=creator)
        try:
            self._space_fd = _open_bell(space_bell, create=creator)
        except BaseException:
            os.close(self._data_fd)
            raise
        if role is Role.PRODUCER:
            self._me = (W_PROD_PID, W_PROD_START, W_PROD_STATE)
            self._peer = (W_CONS_PID, W_CONS_START, W_CONS_STATE)
            self._my_sleep, self._peer_sleep = W_PROD_SLEEPING, W_CONS_SLEEPING
            self._my_bell, self._peer_bell = self._space_fd, self._data_fd
        else:
            self._me = (W_CONS_PID, W_CONS_START, W_CONS_STATE)
            self._peer = (W_PROD_PID, W_PROD_START, W_PROD_STATE)
            self._my_sleep, self._peer_sleep = W_CONS_SLEEPING, W_PROD_SLEEPING
            self._my_bell, self._peer_bell = self._data_fd, self._space_fd
        self._poller = select.poll()
        self._poller.register(self._my_bell, select.POLLIN)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(msg_type) if msg_type is not None else msgspec.msgpack.Decoder()
        self._claim_role()

    # ------------------------------------------------------------ construction
    @classmethod
    def create(
        cls, name: str, role: Role, *, nslots: int = 256, slot_bytes: int = 4096, **kw: Any
    ) -> "Ring":
        """Create the ring ``name`` (fails if it exists) and take ``role`` in it."""
        if not _NAME_RE.match(name):
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
            _unlink_all(name)
            raise

    @classmethod
    def attach(cls, name: str, role: Role, **kw: Any) -> "Ring":
        """Attach to the existing ring ``name`` and take ``role`` in it."""
        if not _NAME_RE.match(name):
            raise RingError(f"bad ring name {name!r}")
        try:
            shm = posix_ipc.SharedMemory("/" + name)
        except posix_ipc.ExistentialError as e:
            raise RingError(f"ring {name!r} does not exist in {SHM_DIR}") from e
        if shm.size < HEADER_BYTES:
            shm.close_fd()
            raise RingError(f"ring {name!r} is too small to be a ring ({shm.size} bytes)")
        return cls(name, role, shm, creator=False, **kw)

    def _claim_role(self) -> None:
        w = self._w
        pid_i, start_i, state_i = self._me
        if w[state_i] == STATE_ATTACHED and process_alive(int(w[pid_i]), int(w[start_i])):
            holder = int(w[pid_i])
            self._release_all()
            raise RingError(f"{self.role.value} role of ring {self.name!r} is held by live pid {holder}")
        pid, start = self_identity()
        w[pid_i] = pid
        w[start_i] = start
        w[state_i] = STATE_ATTACHED

    # ------------------------------------------------------------ liveness
    @property
    def peer_pid(self) -> int:
        return int(self._w[self._peer[0]])

    def peer_status(self) -> PeerStatus:
        w = self._w
        pid_i, start_i, state_i = self._peer
        state = w[state_i]
        if state == STATE_UNATTACHED:
            return PeerStatus.PENDING
        if state == STATE_CLOSED:
            return PeerStatus.CLOSED
        return PeerStatus.ALIVE if process_alive(int(w[pid_i]), int(w[start_i])) else PeerStatus.DEAD

    def peer_alive(self) -> bool:
        """True unless the peer attached and then closed, exited or crashed."""
        return not self.peer_status().gone

    def check_peer(self) -> None:
        status = self.peer_status()
        if status is PeerStatus.CLOSED:
            raise PeerDead(self.name, self._peer_role, self.peer_pid, "it closed the ring")
        if status is PeerStatus.DEAD:
            raise PeerDead(self.name, self._peer_role, self.peer_pid, "the process exited or was killed")

    @property
    def _peer_role(self) -> str:
        return "consumer" if self.role is Role.PRODUCER else "producer"

    # ------------------------------------------------------------ producer side
    def try_put_bytes(self, data: bytes | bytearray | memoryview) -> bool:
        """Publish ``data``; never blocks.  True when the ring took the message, False when it is full.

        A message larger than one slot is taken as soon as its first slot is
        published; the ring keeps the rest and publishes it from :meth:`flush`
        (called by every later ``try_put``): keep calling it while
        :attr:`pending_bytes` is non-zero.  False while an earlier message is
        still partly unpublished.
        """
        if self._closed:
            raise RingError(f"ring {self.name!r} is closed")
        n = len(data)
        if n > self.max_message_bytes:
            raise MessageTooLarge(n, self.max_message_bytes, self.name)
        if self._tx is not None and not self.flush():
            return False
        w = self._w
        head = w[W_HEAD]
        if head - w[W_TAIL] >= self.nslots:
            return False
        if n <= self.capacity:  # the common case: one slot, published at once
            self._write_slot(head, data, n)
            self._ring_peer_bell()
            return True
        self._tx = memoryview(data).cast("B")
        self.flush()
        return True

    def _write_slot(self, head: int, data: Any, word: int) -> None:
        n = word & LEN_MASK
        off = HEADER_BYTES + (head & self._mask) * self.slot_bytes
        self._buf[off + LEN_BYTES : off + LEN_BYTES + n] = data
        self._w[off >> 3] = word
        if not _TSO:
            _fence()
        self._w[W_HEAD] = head + 1

    def flush(self) -> bool:
        """Publish what fits of a message that spans slots; never blocks.  True when nothing is left."""
        tx = self._tx
        if tx is None:
            return True
        if self._closed:
            raise RingError(f"ring {self.name!r} is closed")
        w = self._w
        head, cap = w[W_HEAD], self.capacity
        free = self.nslots - (head - w[W_TAIL])
        published = False
        while free > 0 and tx is not None:
            n = min(cap, len(tx))
            last = n == len(tx)
            self._write_slot(head, tx[:n], n if last else n | MORE)
            head += 1
            free -= 1
            published = True
            tx = None if last else tx[n:]
        self._tx = tx
        if published:
            self._ring_peer_bell()
        return tx is None

    @property
    def pending_bytes(self) -> int:
        """Bytes of a taken message not published yet (see :meth:`try_put_bytes`)."""
        return 0 if self._tx is None else len(self._tx)

    def put_bytes(self, data: bytes | bytearray | memoryview, timeout_s: float | None = None) -> None:
        """Publish ``data`` whole, waiting for free slots up to ``timeout_s`` in all.

        Raises ``TimeoutError`` when the ring stays full.  A message that spans
        slots may then be partly published and is still owned by the ring:
        :meth:`flush` finishes it; putting it again would deliver it twice.
        ``PeerDead`` when the consumer is gone, ``MessageTooLarge`` when
        ``data`` exceeds ``max_message_bytes``.
        """
        deadline = None if timeout_s is None else self._clock() + timeout_s
        while not self.try_put_bytes(data):
            self._wait(self._has_space, _left(deadline, self._clock), "space in ring")
        while not self.flush():
            self._wait(self._has_space, _left(deadline, self._clock), "space in ring")

    def try_put(self, msg: Any) -> bool:
        return self.try_put_bytes(self._enc.encode(msg))

    def put(self, msg: Any, timeout_s: float | None = None) -> None:
        self.put_bytes(self._enc.encode(msg), timeout_s)

    def _has_space(self) -> bool:
        w = self._w
        return w[W_HEAD] - w[W_TAIL] < self.nslots

    # ------------------------------------------------------------ consumer side
    def _take(self, decode: bool) -> Any:
        if self._closed:
            raise RingError(f"ring {self.name!r} is closed")
        w = self._w
        while True:
            tail = w[W_TAIL]
            if tail >= w[W_HEAD]:
                return None  # empty (a message whose last slot is still to come stays in _rx)
            if not _TSO:
                _fence()
            off = HEADER_BYTES + (tail & self._mask) * self.slot_bytes
            word = w[off >> 3]
            n = word & LEN_MASK
            if n > self.capacity:
                self._rx = bytearray()
                self._release_slot(tail)
                raise RingError(f"ring {self.name!r} is corrupt: slot length {n} > capacity {self.capacity}")
            if self._skipping:
                self._skipping = bool(word & MORE)
                self._release_slot(tail)
                continue
            payload = self._buf[off + LEN_BYTES : off + LEN_BYTES + n]
            if word & MORE:
                self._rx += payload
                payload.release()
                self._release_slot(tail)
                if len(self._rx) > self.max_message_bytes:
                    size, self._rx = len(self._rx), bytearray()
                    self._skipping = True  # its remaining slots are consumed unread as they arrive
                    raise MessageTooLarge(size, self.max_message_bytes, self.name)
                continue
            try:
                if self._rx:  # the last slot of a message that spans slots
                    self._rx += payload
                    payload.release()
                    whole, self._rx = self._rx, bytearray()
                    out = self._dec.decode(whole) if decode else bytes(whole)
                else:
                    out = self._dec.decode(payload) if decode else bytes(payload)
            finally:
                payload.release()
                self._release_slot(tail)  # a bad message is consumed, not re-read forever
            return out

    def _release_slot(self, tail: int) -> None:
        if not _TSO:
            _fence()
        self._w[W_TAIL] = tail + 1
        self._ring_peer_bell()

    def try_get_bytes(self) -> bytes | None:
        """The next message's bytes, or None when the ring is empty; never blocks."""
        return self._take(decode=False)

    def try_get(self) -> Any:
        """The next decoded message, or None when the ring is empty; never blocks.

        A message that does not decode as ``msg_type`` is consumed and raises
        ``msgspec.ValidationError``/``DecodeError``.
        """
        return self._take(decode=True)

    def get_bytes(self, timeout_s: float | None = None) -> bytes:
        return self._get(False, timeout_s)

    def get(self, timeout_s: float | None = None) -> Any:
        """The next decoded message, waiting up to ``timeout_s`` (None: until the peer dies)."""
        return self._get(True, timeout_s)

    def _get(self, decode: bool, timeout_s: float | None) -> Any:
        deadline = None if timeout_s is None else self._clock() + timeout_s
        while True:
            out = self._take(decode)
            if out is not None:  # None also while a message that spans slots is only partly here
                return out
            self._wait(self._has_data, _left(deadline, self._clock), "a message")

    def _has_data(self) -> bool:
        w = self._w
        return w[W_TAIL] < w[W_HEAD]

    def depth(self) -> int:
        """Messages published and not yet consumed."""
        w = self._w
        return int(w[W_HEAD] - w[W_TAIL])

    # ------------------------------------------------------------ watching (a second thread of the consumer)
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
        w[self._my_sleep] = 1
        _fence()
        try:
            if w[W_HEAD] > after_head:
                return
            poller = select.poll()
            poller.register(self._my_bell, select.POLLIN)
            poller.register(interrupt_fd, select.POLLIN)
            poller.poll(max(0, int(timeout_s * 1000)))
        finally:
            self.disarm()

    # ------------------------------------------------------------ waiting
    def _ring_peer_bell(self) -> None:
        _fence()
        w = self._w
        if w[self._peer_sleep]:
            w[self._peer_sleep] = 0
            try:
                os.write(self._peer_bell, b"\x01")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def fileno(self) -> int:
        """The bell this endpoint sleeps on: readable when the peer rang it.

        For external poll loops: call :meth:`arm` before polling this fd and
        :meth:`disarm` after; ``arm()`` returning True means "ready now, do not
        sleep".
        """
        return self._my_bell

    def arm(self) -> bool:
        """Announce that this side is about to sleep.  True if it should not."""
        ready = self._has_data if self.role is Role.CONSUMER else self._has_space
        self._w[self._my_sleep] = 1
        _fence()
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
                    left = deadline - clock()
                    if left <= 0:
                        raise TimeoutError(
                            f"no {what} on ring {self.name!r} ({self.role.value}) within {timeout_s} s"
                        )
                    slice_s = min(slice_s, left)
                self._poller.poll(max(1, int(slice_s * 1000 + 0.999)))
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
            _unlink_all(self.name)

    def close(self) -> None:
        """Mark this side closed, wake the peer, unmap.  The creator also unlinks.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        w = self._w
        w[self._me[2]] = STATE_CLOSED
        _fence()
        try:
            os.write(self._peer_bell, b"\x01")  # a sleeping peer sees CLOSED now
        except (BlockingIOError, OSError):
            pass
        self._release_all()
        if self.creator:
            self.unlink()

    def _release_memory(self) -> None:
        self._w.release()
        self._buf.release()
        self._mm.close()

    def _release_all(self) -> None:
        self._release_memory()
        for fd in (getattr(self, "_data_fd", -1), getattr(self, "_space_fd", -1)):
            if fd >= 0:
                os.close(fd)
        self._data_fd = self._space_fd = -1

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ring({self.name!r}, {self.role.value}, nslots={self.nslots}, slot_bytes={self.slot_bytes})"


def _left(deadline: float | None, clock: Callable[[], float]) -> float | None:
    return None if deadline is None else max(0.0, deadline - clock())


def _unlink_all(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass
    for path in bell_paths(name):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
