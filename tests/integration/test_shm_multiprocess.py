"""The shared-memory plane across real processes (spawned, not forked)."""

from __future__ import annotations

import os
import signal
import threading
import time

import msgspec
import numpy as np
import pytest

from p2pworker.errors import PeerDead
from p2pworker.shm import KVRegion, RegionHandle, Ring, Role
from p2pworker.shm.ring import PeerStatus
from p2pworker.shm.sweep import leftovers, sweep


class Seq(msgspec.Struct, tag="seq"):
    seq: int
    pad: bytes = b""


def _pad_for(seq: int) -> bytes:
    return seq.to_bytes(8, "little") * 60 if seq % 997 == 0 else b""


# ---------------------------------------------------------------- children
def _consume_in_order(name: str, n: int) -> None:
    ring = Ring.attach(name, Role.CONSUMER, msg_type=Seq)
    try:
        for expected in range(n):
            msg = ring.get(timeout_s=30)
            if msg.seq != expected or msg.pad != _pad_for(expected):
                print(f"expected {expected}, got {msg.seq}", flush=True)
                os._exit(3)
        try:  # nothing beyond n: the producer closes, and that is all we may see
            extra = ring.get(timeout_s=30)
            print(f"unexpected extra message {extra}", flush=True)
            os._exit(4)
        except PeerDead:
            pass
    finally:
        ring.close()


def _consume_after_go(name: str, ready, go, n: int) -> None:
    ring = Ring.attach(name, Role.CONSUMER, msg_type=Seq)
    ready.set()
    if not go.wait(30):
        os._exit(5)
    got = [ring.get(timeout_s=10).seq for _ in range(n)]
    ring.close()
    os._exit(0 if got == list(range(n)) else 6)


def _spanning_payload(seq: int) -> bytes:
    """Sizes from 1 byte to 3x the whole test ring (8 slots of 1,016 bytes), derived from seq."""
    n = 1 + (seq * 7919) % 24_000
    return (seq.to_bytes(4, "little") * (n // 4 + 1))[:n]


def _consume_spanning(name: str, n: int) -> None:
    ring = Ring.attach(name, Role.CONSUMER, msg_type=Seq)
    try:
        for expected in range(n):
            msg = ring.get(timeout_s=30)
            if msg.seq != expected or msg.pad != _spanning_payload(expected):
                print(f"expected {expected}, got {msg.seq} ({len(msg.pad)} bytes)", flush=True)
                os._exit(3)
    finally:
        ring.close()


def _attach_and_hang(name: str, role: str, ready) -> None:
    ring = Ring.attach(name, Role(role), msg_type=Seq)  # noqa: F841 (held until killed)
    ready.set()
    time.sleep(60)
    os._exit(7)


def _region_child(handle_wire: bytes | None, name: str | None, num_blocks: int, block_bytes: int) -> None:
    if handle_wire is not None:
        reg = KVRegion.attach(RegionHandle.decode(handle_wire))
    else:
        reg = KVRegion.attach_files(name, num_blocks, block_bytes)
    with reg:
        arr = reg.array()
        for row in range(0, num_blocks, 2):  # even rows: the parent's pattern
            if not (arr[row] == row % 251).all():
                os._exit(8)
        for row in range(1, num_blocks, 2):  # odd rows: ours
            arr[row] = 255 - row % 251
        del arr


def _create_region_and_hang(name: str, ready) -> None:
    KVRegion.create(name, 8, 4096, segment_bytes=4096 * 4)
    ready.set()
    time.sleep(60)


# ---------------------------------------------------------------- tests
@pytest.mark.timeout(180)
def test_one_million_messages_in_order_across_wraparound(children, shm_prefix):
    n = 1_000_000
    prod = Ring.create(f"{shm_prefix}big", Role.PRODUCER, nslots=64, slot_bytes=1024, msg_type=Seq)
    try:
        proc = children.start(_consume_in_order, prod.name, n)
        t0 = time.monotonic()
        for i in range(n):
            prod.put(Seq(i, _pad_for(i)), timeout_s=30)
        prod.close()
        children.join_ok(proc, timeout_s=60)
        elapsed = time.monotonic() - t0
        print(f"1e6 messages through a 64-slot ring: {elapsed:.2f} s ({n / elapsed / 1e3:.0f} k msg/s)")
        assert n // 64 > 10_000  # the ring wrapped over ten thousand times
    finally:
        prod.close()


@pytest.mark.timeout(120)
def test_messages_spanning_slots_arrive_whole_and_in_order(children, shm_prefix):
    """The adapter's way of writing (try_put, then flush while a message is partly out, never blocking) into a
    consumer in another process: 3,000 messages of 1 byte to 3x the ring's size, each whole and in order."""
    n = 3000
    prod = Ring.create(f"{shm_prefix}span", Role.PRODUCER, nslots=8, slot_bytes=1024, msg_type=Seq)
    try:
        proc = children.start(_consume_spanning, prod.name, n)
        deadline = time.monotonic() + 90
        for i in range(n):
            while not prod.try_put(Seq(i, _spanning_payload(i))):
                assert time.monotonic() < deadline
                time.sleep(0)
        while not prod.flush():
            assert time.monotonic() < deadline
            time.sleep(0)
        children.join_ok(proc, timeout_s=60)
    finally:
        prod.close()


def test_full_ring_backpressure_across_processes(children, shm_prefix):
    ctx = children.ctx
    ready, go = ctx.Event(), ctx.Event()
    with Ring.create(f"{shm_prefix}bp", Role.PRODUCER, nslots=8, slot_bytes=128, msg_type=Seq) as prod:
        proc = children.start(_consume_after_go, prod.name, ready, go, 9)
        assert ready.wait(30)
        for i in range(8):
            assert prod.try_put(Seq(i))
        assert not prod.try_put(Seq(8))
        with pytest.raises(TimeoutError):
            prod.put(Seq(8), timeout_s=0.2)
        go.set()
        t0 = time.monotonic()
        prod.put(Seq(8), timeout_s=10)  # asleep on the space bell until the consumer frees a slot
        assert time.monotonic() - t0 < 5
        children.join_ok(proc)


@pytest.mark.parametrize("my_role", ["consumer", "producer"])
def test_peer_death_is_detected_while_waiting(children, shm_prefix, my_role):
    me = Role(my_role)
    peer = Role.PRODUCER if me is Role.CONSUMER else Role.CONSUMER
    ready = children.ctx.Event()
    with Ring.create(f"{shm_prefix}pd", me, nslots=4, slot_bytes=128, msg_type=Seq) as ring:
        proc = children.start(_attach_and_hang, ring.name, peer.value, ready)
        assert ready.wait(30)
        assert ring.peer_status() is PeerStatus.ALIVE and ring.peer_pid == proc.pid
        if me is Role.PRODUCER:
            for i in range(4):
                ring.put(Seq(i))
        killed_at = []

        def kill():
            killed_at.append(time.monotonic())
            os.kill(proc.pid, signal.SIGKILL)

        timer = threading.Timer(0.3, kill)
        timer.start()
        with pytest.raises(PeerDead, match="exited or was killed"):
            if me is Role.CONSUMER:
                ring.get(timeout_s=20)
            else:
                ring.put(Seq(99), timeout_s=20)
        detect_s = time.monotonic() - killed_at[0]
        timer.join()
        assert detect_s < 1.0, f"peer death took {detect_s:.3f} s to notice"
        assert not ring.peer_alive()
        proc.join(5)
        assert proc.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("by_name", [False, True])
def test_region_attached_in_another_process_sees_the_same_bytes(children, shm_prefix, by_name):
    num_blocks, block_bytes = 12, 3 * 4096
    with KVRegion.create(shm_prefix + "kv", num_blocks, block_bytes, segment_bytes=8 * 4096) as reg:
        assert len(reg.handle.segments) == 5
        arr = reg.array()
        for row in range(0, num_blocks, 2):
            arr[row] = row % 251
        wire = None if by_name else reg.handle.encode()
        proc = children.start(_region_child, wire, shm_prefix + "kv", num_blocks, block_bytes)
        children.join_ok(proc)
        for row in range(1, num_blocks, 2):
            assert (arr[row] == 255 - row % 251).all(), f"row {row} not written by the child"
        del arr


def test_crashed_owner_leaves_files_that_sweep_removes(children, shm_prefix):
    ready = children.ctx.Event()
    proc = children.start(_create_region_and_hang, shm_prefix + "crash", ready)
    assert ready.wait(30)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    assert len(leftovers(shm_prefix + "crash")) == 2  # two segment files, no owner to unlink them
    assert len(sweep(shm_prefix + "crash")) == 2
    assert leftovers(shm_prefix) == []


def test_region_copy_between_processes_matches_numpy(children, shm_prefix):
    """A sanity check on volume: 64 MiB written by the parent, verified by the child."""
    num_blocks, block_bytes = 256, 256 * 1024
    with KVRegion.create(shm_prefix + "vol", num_blocks, block_bytes, segment_bytes=16 << 20) as reg:
        arr = reg.array()
        arr[0::2] = (np.arange(0, num_blocks, 2) % 251).astype(np.uint8)[:, None]
        proc = children.start(_region_child, reg.handle.encode(), None, num_blocks, block_bytes)
        children.join_ok(proc)
        assert (arr[1::2] == (255 - np.arange(1, num_blocks, 2) % 251).astype(np.uint8)[:, None]).all()
        del arr
