"""Data plane between two real processes on loopback: NIXL (UCX, DRAM) and the ZMQ fallback."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import msgspec
import numpy as np
import pytest

from p2pworker.data import PeerDataInfo, coalesce, make_data_transport
from p2pworker.errors import DataPlaneUnavailable, TransferFailed
from p2pworker.shm import KVRegion
from p2pworker.shm.sweep import sweep
from tests.integration.peers import data_peer, random_rows

BACKENDS = ["nixl", "zmq"]


class PeerProc:
    """A spawned data_peer plus the queues to talk to it."""

    def __init__(self, children, backend, name, num_blocks, block_bytes):
        self.q_out, self.q_in = children.ctx.Queue(), children.ctx.Queue()
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.proc = children.start(data_peer, backend, name, num_blocks, block_bytes, self.q_out, self.q_in)
        self.info = msgspec.msgpack.decode(self.q_out.get(timeout=60), type=PeerDataInfo)

    def dump(self) -> np.ndarray:
        self.q_in.put(("dump",))
        raw = self.q_out.get(timeout=60)
        return np.frombuffer(raw, dtype=np.uint8).reshape(self.num_blocks, self.block_bytes)

    def exit(self, children) -> None:
        self.q_in.put(("exit",))
        children.join_ok(self.proc)


def settle(tr, tids, timeout_s=30.0):
    """Poll until every id in ``tids`` is reported; returns {tid: None | reason}; fails on double reports."""
    out: dict[int, str | None] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(tids):
        assert time.monotonic() < deadline, f"transfers {set(tids) - set(out)} not reported in {timeout_s} s"
        done, failed = tr.poll()
        for tid in done:
            assert tid not in out, f"transfer {tid} reported twice"
            out[tid] = None
        for tid, reason in failed:
            assert tid not in out, f"transfer {tid} reported twice"
            out[tid] = reason
    return out


@pytest.fixture
def local_region(shm_prefix):
    with KVRegion.create(shm_prefix + "local", 256, 16384) as reg:
        arr = reg.array()
        arr[:] = np.random.default_rng(7).integers(0, 256, size=arr.shape, dtype=np.uint8)
        del arr
        yield reg


@pytest.mark.parametrize("backend", BACKENDS)
def test_scattered_rows_land_byte_exact(children, shm_prefix, local_region, backend):
    peer = PeerProc(children, backend, shm_prefix + "peer", 512, 16384)
    tr = make_data_transport(local_region, backend=backend, agent_name=f"local-{os.getpid()}-{backend}")
    try:
        assert tr.backend == backend
        tr.add_peer("p", peer.info)
        rng = np.random.default_rng(3)
        local_rows = random_rows(rng, 100, 256)
        remote_rows = random_rows(rng, 100, 512, run_len=8)
        tid = tr.write_blocks("p", local_rows, remote_rows)
        assert tr.stats.last_descriptors == len(coalesce(local_rows, remote_rows))
        assert settle(tr, [tid]) == {tid: None}
        theirs = peer.dump()
        mine = local_region.array()
        assert (theirs[remote_rows] == mine[local_rows]).all()
        untouched = np.setdiff1d(np.arange(512), remote_rows)
        assert not theirs[untouched].any(), "bytes landed outside the granted rows"
        del mine
        peer.exit(children)
    finally:
        assert tr.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(180)
def test_peer_killed_mid_transfer_fails_in_deadline_and_others_keep_working(children, shm_prefix, backend):
    bb, nb = 256 * 1024, 1024  # 256 MiB regions
    with KVRegion.create(shm_prefix + "big", nb, bb) as reg:
        reg.array()[:] = 0x5A
        tr = make_data_transport(reg, backend=backend, agent_name=f"big-{os.getpid()}-{backend}",
                                 max_piece_bytes=4 << 20, post_budget_bytes=4 << 20)
        try:
            victim = PeerProc(children, backend, shm_prefix + "victim", nb, bb)
            tr.add_peer("victim", victim.info)
            tid = tr.write_blocks("victim", np.arange(nb), np.arange(nb))
            for _ in range(3):
                tr.poll()  # a few pieces posted, most still pending
            assert tr.in_flight() == 1
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            result = settle(tr, [tid], timeout_s=10)
            detect_s = time.monotonic() - killed
            assert result[tid] is not None, "a transfer to a killed peer reported success"
            assert detect_s <= 3.0, f"failure took {detect_s:.2f} s (heartbeat deadline 3 s)"
            victim.proc.join(5)
            assert sweep(shm_prefix + "victim")  # a SIGKILLed owner cannot unlink its own region
            tr.remove_peer("victim")

            other = PeerProc(children, backend, shm_prefix + "other", 64, bb)
            tr.add_peer("other", other.info)
            t2 = tr.write_blocks("other", np.arange(64), np.arange(64))
            assert settle(tr, [t2]) == {t2: None}
            assert (other.dump() == 0x5A).all()
            other.exit(children)
        finally:
            assert tr.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_with_transfers_in_flight_waits_then_reports_each_once(children, shm_prefix, backend):
    bb, nb = 256 * 1024, 512
    with KVRegion.create(shm_prefix + "src", nb, bb) as reg:
        reg.array()[:] = 0x33
        tr = make_data_transport(reg, backend=backend, agent_name=f"close-{os.getpid()}-{backend}",
                                 max_piece_bytes=4 << 20, post_budget_bytes=8 << 20)
        peer = PeerProc(children, backend, shm_prefix + "dst", nb, bb)
        tr.add_peer("p", peer.info)
        tids = [tr.write_blocks("p", np.arange(i, nb, 4), np.arange(i, nb, 4)) for i in range(4)]
        tr.poll()  # some pieces posted
        t0 = time.monotonic()
        assert tr.close(timeout_s=10) is True
        assert time.monotonic() - t0 < 10
        assert tr.in_flight() == 0  # nothing can still land once close() returned
        done, failed = tr.poll()
        assert sorted(list(done) + [t for t, _ in failed]) == tids  # every transfer reported once
        assert all(r == "cancelled" for _, r in failed)
        assert tr.poll() == ((), ())
        snap1 = peer.dump().copy()
        time.sleep(0.2)
        assert (peer.dump() == snap1).all(), "bytes still landing after close() returned"
        with pytest.raises(TransferFailed, match="closed"):
            tr.write_blocks("p", [0], [0])
        peer.exit(children)


def test_fallback_and_nixl_move_the_same_bytes(children, shm_prefix, local_region):
    rng = np.random.default_rng(11)
    local_rows = random_rows(rng, 64, 256, run_len=2)
    remote_rows = random_rows(rng, 64, 128)
    results = {}
    for backend in BACKENDS:
        peer = PeerProc(children, backend, shm_prefix + backend, 128, 16384)
        tr = make_data_transport(local_region, backend=backend, agent_name=f"same-{os.getpid()}-{backend}")
        tr.add_peer("p", peer.info)
        tid = tr.write_blocks("p", local_rows, remote_rows)
        assert settle(tr, [tid]) == {tid: None}
        results[backend] = peer.dump().copy()
        peer.exit(children)
        assert tr.close()
    assert (results["nixl"] == results["zmq"]).all()
    assert results["nixl"][remote_rows].any()


def test_submission_errors_are_immediate(shm_prefix, local_region):
    tr = make_data_transport(local_region, backend="zmq", agent_name="subm")
    try:
        with pytest.raises(TransferFailed, match="unknown data peer"):
            tr.write_blocks("nobody", [0], [0])
        info = tr.local_info()
        with pytest.raises(TransferFailed, match="block_bytes=8192, local block_bytes=16384"):
            tr.add_peer("x", msgspec.structs.replace(info, block_bytes=8192))
        with pytest.raises(TransferFailed, match="data backend 'nixl'"):
            tr.add_peer("x", msgspec.structs.replace(info, backend="nixl"))
        tr.add_peer("self", info)
        with pytest.raises(TransferFailed, match="peer's 0..255"):
            tr.write_blocks("self", [0], [256])
    finally:
        assert tr.close()


def test_nixl_missing_fails_fast_or_falls_back(monkeypatch, caplog, local_region):
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # `from nixl._api import ...` now raises ImportError
    with pytest.raises(DataPlaneUnavailable, match=r"NIXL cannot be imported .*pip install"):
        make_data_transport(local_region, backend="nixl", agent_name="n1")
    with caplog.at_level(logging.WARNING, logger="p2pworker.data"):
        tr = make_data_transport(local_region, backend="auto", agent_name="n2")
    try:
        assert tr.backend == "zmq"
        assert "NIXL cannot be imported" in caplog.text and "ZMQ fallback" in caplog.text
    finally:
        tr.close()


def test_nixl_backend_that_cannot_be_created_fails_fast(local_region):
    from p2pworker.data.nixl_transport import NixlTransport

    with pytest.raises(DataPlaneUnavailable, match=r"backend\(s\) \['NO_SUCH'\] could not be created"):
        NixlTransport(local_region, agent_name="nope", backends=("NO_SUCH",))


def test_zmq_receiver_refuses_hostile_writes(shm_prefix):
    """Bad token, rows outside the region, short frames: refused, nothing written, receiver lives on."""
    import zmq

    from p2pworker.data.zmq_transport import KIND_WRITE, WriteHeader, _enc

    with KVRegion.create(shm_prefix + "tgt", 8, 4096) as reg:
        tr = make_data_transport(reg, backend="zmq", agent_name="tgt")
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(tr.local_info().endpoint)
        token = tr.local_info().token
        bad = [
            [KIND_WRITE, b"x" * 16, _enc.encode(WriteHeader(1, 1, [(0, 1)])), b"\xff" * 4096],
            [KIND_WRITE, token, _enc.encode(WriteHeader(1, 2, [(7, 2)])), b"\xff" * 8192],
            [KIND_WRITE, token, _enc.encode(WriteHeader(1, 3, [(0, 1)])), b"\xff" * 100],
            [KIND_WRITE, token, b"\xc1garbage", b"\xff" * 4096],
        ]
        for frames in bad:
            s.send_multipart(frames)
        deadline = time.monotonic() + 5
        while tr.rejected_writes < len(bad) and time.monotonic() < deadline:
            tr.poll()
            time.sleep(0.001)
        assert tr.rejected_writes == len(bad)
        assert not reg.array().any(), "a refused write changed the region"
        s.send_multipart([KIND_WRITE, token, _enc.encode(WriteHeader(1, 4, [(3, 1)])), b"\x07" * 4096])
        while tr.received_bytes < 4096 and time.monotonic() < deadline:
            tr.poll()
        assert (reg.array()[3] == 7).all()
        s.close(linger=0)
        ctx.term()
        assert tr.close()
