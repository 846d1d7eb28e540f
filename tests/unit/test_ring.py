"""Ring behaviour inside one process: both endpoints here, so every edge is deterministic."""

from __future__ import annotations

import mmap
import os
import select
import time

import msgspec
import posix_ipc
import pytest

from p2pworker.errors import MessageTooLarge, PeerDead, RingError
from p2pworker.shm.ring import HEADER_BYTES, LEN_BYTES, PeerStatus, Ring, Role, ring_files


class Cmd(msgspec.Struct, tag="cmd"):
    seq: int
    data: bytes = b""


class Other(msgspec.Struct, tag="other"):
    x: int


@pytest.fixture
def pair(shm_prefix):
    prod = Ring.create(f"{shm_prefix}r", Role.PRODUCER, nslots=8, slot_bytes=128, msg_type=Cmd)
    cons = Ring.attach(f"{shm_prefix}r", Role.CONSUMER, msg_type=Cmd)
    yield prod, cons
    cons.close()
    prod.close()


def test_order_across_many_wraps(pair):
    prod, cons = pair
    for i in range(1000):
        prod.put(Cmd(i), timeout_s=1)
        if i % 3 == 2:
            for j in range(i - 2, i + 1):
                assert cons.get(timeout_s=1).seq == j
    assert cons.depth() == 1
    assert cons.get(timeout_s=1).seq == 999
    assert cons.try_get() is None


def test_full_ring_backpressure(pair):
    prod, cons = pair
    for i in range(8):
        assert prod.try_put(Cmd(i))
    assert prod.depth() == 8
    assert not prod.try_put(Cmd(8))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no space"):
        prod.put(Cmd(8), timeout_s=0.1)
    assert 0.09 <= time.monotonic() - t0 < 1.0
    assert cons.get().seq == 0
    prod.put(Cmd(8), timeout_s=0.1)
    assert [cons.get().seq for _ in range(8)] == list(range(1, 9))


def test_timeout_on_empty(pair):
    _, cons = pair
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no a message|no message|a message"):
        cons.get(timeout_s=0.05)
    assert 0.045 <= time.monotonic() - t0 < 1.0
    with pytest.raises(TimeoutError):
        cons.get(timeout_s=0)


def test_message_larger_than_a_slot_spans_slots(pair):
    prod, cons = pair
    cap = 128 - LEN_BYTES
    assert prod.capacity == cap
    for n in (cap, cap + 1, 3 * cap, 3 * cap + 7):
        data = bytes(range(256)) * (n // 256) + b"z" * (n % 256)
        prod.put_bytes(data, timeout_s=1)
        assert prod.depth() == -(-n // cap)  # one slot per capacity's worth
        assert cons.get_bytes(timeout_s=1) == data
        assert prod.depth() == 0


def test_message_larger_than_the_whole_ring_goes_through_as_space_frees(pair):
    """8 slots of 120 bytes; a 5,000-byte message: the non-blocking producer publishes what fits, the
    consumer sees nothing until the last slot, and a second message waits behind the first (no interleaving)."""
    prod, cons = pair
    big = os.urandom(5000)
    assert prod.try_put_bytes(big)  # taken: the first 8 slots are published, the rest waits in the ring
    assert prod.pending_bytes == 5000 - 8 * prod.capacity
    assert not prod.try_put_bytes(b"next")  # the big one is not out yet: nothing else may start
    assert not prod.flush()
    got = []
    for _ in range(200):
        m = cons.try_get_bytes()
        if m is not None:
            got.append(m)
        prod.flush()
        if got and prod.pending_bytes == 0:
            break
    assert got == [big] and prod.pending_bytes == 0
    assert prod.try_put_bytes(b"next")
    assert cons.try_get_bytes() == b"next"


def test_message_over_the_hard_limit_is_refused_on_both_sides(shm_prefix):
    prod = Ring.create(f"{shm_prefix}lim", Role.PRODUCER, nslots=8, slot_bytes=128, max_message_bytes=1000)
    cons = Ring.attach(f"{shm_prefix}lim", Role.CONSUMER, max_message_bytes=300)
    try:
        with pytest.raises(MessageTooLarge) as ei:
            prod.try_put_bytes(b"x" * 1001)
        assert ei.value.nbytes == 1001 and ei.value.capacity == 1000
        assert "1001" in str(ei.value) and "max_message_bytes=1000" in str(ei.value)
        assert prod.depth() == 0 and prod.pending_bytes == 0  # nothing half-published
        # The consumer's own limit: the message is consumed unread (all its slots), the next one is intact.
        prod.put_bytes(b"y" * 500, timeout_s=1)  # 5 slots of 120
        prod.put_bytes(b"after", timeout_s=1)
        with pytest.raises(MessageTooLarge):
            while cons.try_get_bytes() is None:
                pass
        assert cons.get_bytes(timeout_s=1) == b"after"
        assert cons.try_get_bytes() is None
    finally:
        cons.close()
        prod.close()


def test_blocking_put_of_a_spanning_message_times_out_then_flush_finishes_it(pair):
    prod, cons = pair
    big = os.urandom(2000)  # 17 slots through 8
    with pytest.raises(TimeoutError):
        prod.put_bytes(big, timeout_s=0.05)
    assert prod.pending_bytes > 0
    out = bytearray()
    while True:
        m = cons.try_get_bytes()
        prod.flush()
        if m is not None:
            out += m
            break
    assert bytes(out) == big


def test_undecodable_message_is_consumed_not_stuck(pair):
    prod, cons = pair
    prod.put(Other(1))
    prod.put(Cmd(5))
    with pytest.raises(msgspec.ValidationError):
        cons.get()
    assert cons.get().seq == 5


def test_peer_close_drains_then_reports_peer_dead(pair):
    prod, cons = pair
    prod.put(Cmd(1))
    prod.close()
    assert cons.get(timeout_s=1).seq == 1  # what was published is still delivered
    assert cons.peer_status() is PeerStatus.CLOSED
    with pytest.raises(PeerDead, match="closed"):
        cons.get(timeout_s=5)


def test_consumer_close_wakes_a_blocked_producer(pair):
    prod, cons = pair
    for i in range(8):
        prod.put(Cmd(i))
    cons.close()
    t0 = time.monotonic()
    with pytest.raises(PeerDead):
        prod.put(Cmd(9), timeout_s=5)
    assert time.monotonic() - t0 < 1.0


def test_role_held_by_live_process_is_refused(pair, shm_prefix):
    with pytest.raises(RingError, match="held by live pid"):
        Ring.attach(f"{shm_prefix}r", Role.CONSUMER)


def test_create_existing_and_attach_missing(pair, shm_prefix):
    with pytest.raises(RingError, match="already exists"):
        Ring.create(f"{shm_prefix}r", Role.PRODUCER)
    with pytest.raises(RingError, match="does not exist"):
        Ring.attach(f"{shm_prefix}nope", Role.CONSUMER)
    with pytest.raises(RingError, match="bad ring name"):
        Ring.create("a/b", Role.PRODUCER)
    with pytest.raises(RingError, match="power of two"):
        Ring.create(f"{shm_prefix}x", Role.PRODUCER, nslots=6)


def test_attach_to_something_that_is_not_a_ring(shm_prefix):
    shm = posix_ipc.SharedMemory(f"/{shm_prefix}junk", posix_ipc.O_CREX, size=HEADER_BYTES + 4096)
    shm.close_fd()
    os.mkfifo(f"/dev/shm/{shm_prefix}junk.data.bell")
    os.mkfifo(f"/dev/shm/{shm_prefix}junk.space.bell")
    with pytest.raises(RingError, match="not a p2pworker ring"):
        Ring.attach(f"{shm_prefix}junk", Role.CONSUMER)
    for path in ring_files(f"{shm_prefix}junk"):
        os.unlink(path)


def test_unlink_after_attach_leaves_nothing_and_keeps_working(pair, shm_prefix):
    prod, cons = pair
    prod.unlink()
    assert not any(os.path.exists(p) for p in ring_files(f"{shm_prefix}r"))
    prod.put(Cmd(3))
    assert cons.get(timeout_s=1).seq == 3


def test_creator_close_unlinks_and_close_is_idempotent(shm_prefix):
    name = f"{shm_prefix}c"
    ring = Ring.create(name, Role.CONSUMER)
    assert all(os.path.exists(p) for p in ring_files(name))
    ring.close()
    ring.close()
    assert not any(os.path.exists(p) for p in ring_files(name))
    with pytest.raises(RingError, match="closed"):
        ring.get(timeout_s=0.1)


def test_external_poll_loop_wakes_on_put(pair):
    prod, cons = pair
    poller = select.poll()
    poller.register(cons.fileno(), select.POLLIN)
    assert not cons.arm()  # empty: fine to sleep
    prod.put(Cmd(1))
    assert poller.poll(1000), "the bell did not ring"
    cons.disarm()
    assert cons.try_get().seq == 1
    prod.put(Cmd(2))
    assert cons.arm()  # data already there: do not sleep
    cons.disarm()


def test_a_bell_left_unread_keeps_the_next_poll_returning_until_drained(pair):
    """``disarm(drain=False)`` (the worker's loop after a poll that did not report the bell) leaves a byte that
    lands later in the bell: the next poll returns at once with it, and a draining disarm empties it.  Nothing is
    lost (the wake comes one poll late) and nothing spins (one drain and the poll sleeps again)."""
    prod, cons = pair
    poller = select.poll()
    poller.register(cons.fileno(), select.POLLIN)
    assert not cons.arm()
    assert not poller.poll(0)
    cons.disarm(drain=False)  # the poll found nothing
    assert not cons.arm()
    prod.put(Cmd(1))  # rings: the byte lands after that poll looked
    cons.disarm(drain=False)
    assert poller.poll(0), "the late byte must make the next poll return"
    cons.disarm(drain=True)
    assert not poller.poll(0), "drained: the next poll sleeps"
    assert cons.try_get().seq == 1


def test_blocked_producer_is_woken_by_a_get(pair):
    """A producer asleep on a full ring wakes when the consumer frees a slot (same process, via threads)."""
    import threading

    prod, cons = pair
    for i in range(8):
        prod.put(Cmd(i))
    t = threading.Timer(0.2, cons.get)
    t.start()
    t0 = time.monotonic()
    prod.put(Cmd(8), timeout_s=5)
    assert 0.15 < time.monotonic() - t0 < 1.0
    t.join()


def test_a_producer_that_closes_mid_message_delivers_nothing_of_it(pair):
    """The consumer has the first slots of a message when the producer closes: the partial message is never
    returned (it is not a message), the peer is reported closed, and the ring does not hang."""
    prod, cons = pair
    prod.put_bytes(b"whole", timeout_s=1)
    assert prod.try_put_bytes(os.urandom(5000))  # 8 slots out, the rest pending
    assert cons.try_get_bytes() == b"whole"
    assert cons.try_get_bytes() is None  # 7 slots read into the reassembly buffer, still incomplete
    prod.close()  # with bytes still pending: they are dropped with the producer
    assert cons.try_get_bytes() is None
    with pytest.raises(PeerDead, match="closed"):
        cons.get_bytes(timeout_s=0.5)


def test_a_corrupt_slot_length_is_consumed_and_reported(pair, shm_prefix):
    prod, cons = pair
    prod.put_bytes(b"x", timeout_s=1)
    # a third mapping of the ring's memory, as a buggy or hostile process with access to /dev/shm would have
    with open(f"/dev/shm/{shm_prefix}r", "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        w = memoryview(mm).cast("Q")
        w[HEADER_BYTES >> 3] = 10_000  # slot 0's length word, beyond the slot
        w.release()
    with pytest.raises(RingError, match="corrupt"):
        cons.try_get_bytes()
    prod.put_bytes(b"after", timeout_s=1)
    assert cons.get_bytes(timeout_s=1) == b"after"
