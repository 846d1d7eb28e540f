"""The two halves of a ring endpoint, as mixins of :class:`~p2pworker.shm.ring.Ring`: the producer's (publish at
HEAD, a message that spans slots kept and published as space frees) and the consumer's (read at TAIL, a message
that spans slots reassembled).  The head/tail protocol is drawn in :mod:`p2pworker.shm.ring`'s docstring.

Mixins rather than objects the ring holds: ``try_put``/``try_get`` are the hot path (a round trip is a few
microseconds), and a method found on the ring's own class costs no extra hop.  Both read the attributes
``Ring.__init__`` sets (declared below).
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from p2pworker.errors import MessageTooLarge, RingError
from p2pworker.shm.ring_layout import HEADER_BYTES, LEN_BYTES, LEN_MASK, MORE, TSO, W_HEAD, W_TAIL, fence


class _Endpoint:
    """What both halves read of the ring (set by ``Ring.__init__``)."""

    name: str
    max_message_bytes: int
    nslots: int
    slot_bytes: int
    capacity: int
    _mask: int
    _closed: bool
    _buf: memoryview
    _w: memoryview
    _clock: Callable[[], float]
    _ring_peer_bell: Callable[[], None]  # Bells.ring_peer
    _wait: Callable[[Callable[[], bool], float | None, str], None]  # Ring._wait: spin, then sleep on the bell


class ProducerSide(_Endpoint):
    _tx: memoryview | None  # the unpublished rest of a message that spans slots
    _enc: msgspec.msgpack.Encoder

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
        if not TSO:
            fence()
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
            self._wait(self._has_space, left(deadline, self._clock), "space in ring")
        while not self.flush():
            self._wait(self._has_space, left(deadline, self._clock), "space in ring")

    def try_put(self, msg: Any) -> bool:
        return self.try_put_bytes(self._enc.encode(msg))

    def put(self, msg: Any, timeout_s: float | None = None) -> None:
        self.put_bytes(self._enc.encode(msg), timeout_s)

    def _has_space(self) -> bool:
        w = self._w
        return w[W_HEAD] - w[W_TAIL] < self.nslots


class ConsumerSide(_Endpoint):
    _rx: bytearray  # the slots of a message whose last slot has not arrived
    _skipping: bool  # the rest of a message refused as too large is consumed unread
    _dec: msgspec.msgpack.Decoder

    def _take(self, decode: bool) -> Any:
        if self._closed:
            raise RingError(f"ring {self.name!r} is closed")
        w = self._w
        while True:
            tail = w[W_TAIL]
            if tail >= w[W_HEAD]:
                return None  # empty (a message whose last slot is still to come stays in _rx)
            if not TSO:
                fence()
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
        if not TSO:
            fence()
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
            self._wait(self._has_data, left(deadline, self._clock), "a message")

    def _has_data(self) -> bool:
        w = self._w
        return w[W_TAIL] < w[W_HEAD]


def left(deadline: float | None, clock: Callable[[], float]) -> float | None:
    return None if deadline is None else max(0.0, deadline - clock())
