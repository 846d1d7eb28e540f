"""Data plane between two real processes on loopback: NIXL (UCX, DRAM) and the ZMQ fallback.

The test process is the consumer: it READs a spawned producer's rows into its own region.
"""

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
from tests.helpers.peers import data_peer, random_rows, region_bytes

BACKENDS = ["nixl", "zmq"]
MODES = BACKENDS + ["same_host"]  # same_host: NIXL transports, the consumer copying out of the producer's file
CANARY = 0xEE  # what our rows hold before a read; a row still CANARY was not written


class PeerProc:
    """A spawned data_peer (a producer holding ``region_bytes(seed, ...)``) plus the queues to talk to it."""

    def __init__(self, children, backend, name, num_blocks, block_bytes, seed=0):
        self.q_out, self.q_in = children.ctx.Queue(), children.ctx.Queue()
        self.num_blocks, self.block_bytes, self.seed = num_blocks, block_bytes, seed
        self.proc = children.start(data_peer, backend, name, num_blocks, block_bytes, self.q_out, self.q_in, seed)
        self.info = msgspec.msgpack.decode(self.q_out.get(timeout=60), type=PeerDataInfo)

    def expected(self) -> np.ndarray:
        return region_bytes(self.seed, self.num_blocks, self.block_bytes)

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


def transport(region, mode: str, agent_name: str, **kw):
    """Our consumer side for ``mode`` (see MODES)."""
    backend = "nixl" if mode == "same_host" else mode
    return make_data_transport(region, backend=backend, agent_name=agent_name, same_host=mode == "same_host", **kw)


@pytest.fixture
def local_region(shm_prefix):
    with KVRegion.create(shm_prefix + "local", 256, 16384) as reg:
        reg.array()[:] = CANARY
        yield reg


@pytest.mark.parametrize("backend", MODES)
def test_scattered_rows_land_byte_exact(children, shm_prefix, local_region, backend):
    peer = PeerProc(children, backend, shm_prefix + "peer", 512, 16384, seed=5)
    tr = transport(local_region, backend, agent_name=f"local-{os.getpid()}-{backend}")
    try:
        assert tr.backend == ("nixl" if backend == "same_host" else backend)
        tr.add_peer("out-1", peer.info)
        path, why = tr.path_of("out-1")
        assert path == backend, (path, why)
        rng = np.random.default_rng(3)
        local_rows = random_rows(rng, 100, 256)
        remote_rows = random_rows(rng, 100, 512, run_len=8)
        tid = tr.read_blocks("out-1", local_rows, remote_rows)
        assert tr.stats.last_descriptors == len(coalesce(local_rows, remote_rows))
        assert settle(tr, [tid]) == {tid: None}
        assert tr.stats.bytes_done == 100 * 16384 and tr.stats.per_peer_bytes == {"out-1": 100 * 16384}
        mine = local_region.array()
        assert (mine[local_rows] == peer.expected()[remote_rows]).all()
        untouched = np.setdiff1d(np.arange(256), local_rows)
        assert (mine[untouched] == CANARY).all(), "bytes landed outside the granted rows"
        del mine
        assert (peer.dump() == peer.expected()).all(), "a read changed the producer's region"
        peer.exit(children)
    finally:
        assert tr.close()


@pytest.mark.parametrize("offered", ["answers", "no_handover_here", "nothing_usable"])
def test_a_link_the_peer_dialed_chooses_its_path_at_the_first_read(children, shm_prefix, local_region, offered,
                                                                   monkeypatch):
    """``add_peer(now=False)`` (the peer dialed us): no handover until we read from it; the first read runs the
    checks and takes the same-host path, or, when they fail (here: no handover socket of that name), loads the
    peer into NIXL then; both byte-exact.  When NIXL refuses it too, the read fails with PeerUnusable (the worker
    closes the session) and so does every later one, without another handover."""
    from p2pworker.data import samehost
    from p2pworker.errors import PeerUnusable

    handovers = []
    real = samehost.handover.receive
    monkeypatch.setattr(samehost.handover, "receive", lambda *a, **k: (handovers.append(a[0]), real(*a, **k))[1])
    peer = PeerProc(children, "same_host", shm_prefix + "peer", 512, 16384, seed=7)
    tr = transport(local_region, "same_host", agent_name=f"local-{os.getpid()}-lazy")
    try:
        info = peer.info
        if offered != "answers":
            info = msgspec.structs.replace(
                info, same_host=msgspec.structs.replace(info.same_host, socket="p2pworker-ho-" + "0" * 16))
        if offered == "nothing_usable":
            info = msgspec.structs.replace(info, metadata=b"not a NIXL agent's metadata")
        tr.add_peer("in-1", info, now=False)
        path, why = tr.path_of("in-1")
        assert path == "undecided" and "first read" in why, (path, why)
        assert tr.remotes() == {info.agent_name: 1} and handovers == []  # nothing asked of the peer yet
        rows = np.arange(40, 72)
        if offered == "nothing_usable":
            for _ in range(2):
                with pytest.raises(PeerUnusable):
                    tr.read_blocks("in-1", rows, rows + 100)
            assert len(handovers) == 1, handovers  # decided once
            path, why = tr.path_of("in-1")
            assert path == "unusable" and "refused it too" in why, (path, why)
            assert (local_region.array()[rows] == CANARY).all()
            # a later link to that agent starts afresh (nothing was loaded or posted through the unusable one)
            tr.add_peer("out-2", peer.info)
            assert tr.path_of("out-2") == ("same_host", "")
            tid = tr.read_blocks("out-2", rows, rows + 100)
            assert settle(tr, [tid]) == {tid: None}
            assert (local_region.array()[rows] == peer.expected()[rows + 100]).all()
        else:
            tid = tr.read_blocks("in-1", rows, rows + 100)
            assert settle(tr, [tid]) == {tid: None}
            assert (local_region.array()[rows] == peer.expected()[rows + 100]).all()
            tid = tr.read_blocks("in-1", rows, rows + 200)
            assert settle(tr, [tid]) == {tid: None}
            assert len(handovers) == 1, handovers
            path, why = tr.path_of("in-1")
            if offered == "answers":
                assert (path, why) == ("same_host", "")
            else:
                assert path == "nixl" and "does not hand over its files here" in why, (path, why)
        peer.exit(children)
    finally:
        assert tr.close()


def test_a_peer_naming_anothers_agent_with_its_own_files_is_not_used_for_the_other(children, shm_prefix,
                                                                                   local_region):
    """A peer that dials us claiming another's agent name, copying its fields but naming its own handover socket,
    must not become the same-host source when we then dial the real one: that link is refused (another
    incarnation of the agent), never served out of the first peer's files."""
    peer = PeerProc(children, "same_host", shm_prefix + "peer", 512, 16384, seed=7)
    tr = transport(local_region, "same_host", agent_name=f"local-{os.getpid()}-squat")
    try:
        squat = msgspec.structs.replace(
            peer.info, same_host=msgspec.structs.replace(peer.info.same_host, socket="p2pworker-ho-" + "1" * 16))
        tr.add_peer("in-1", squat, now=False)
        with pytest.raises(TransferFailed, match="already loaded"):
            tr.add_peer("out-1", peer.info)
        peer.exit(children)
    finally:
        assert tr.close()


@pytest.mark.parametrize("backend", MODES)
@pytest.mark.timeout(180)
def test_peer_killed_mid_transfer_fails_in_deadline_and_others_keep_working(children, shm_prefix, backend):
    bb, nb = 256 * 1024, 1024  # 256 MiB regions
    with KVRegion.create(shm_prefix + "big", nb, bb) as reg:
        tr = transport(reg, backend, agent_name=f"big-{os.getpid()}-{backend}",
                       max_piece_bytes=4 << 20, post_budget_bytes=4 << 20)
        try:
            victim = PeerProc(children, backend, shm_prefix + "victim", nb, bb, seed=1)
            tr.add_peer("victim", victim.info)
            tid = tr.read_blocks("victim", np.arange(nb), np.arange(nb))
            for _ in range(3):
                tr.poll()  # a few pieces posted, most still pending
            assert tr.in_flight() == 1
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            result = settle(tr, [tid], timeout_s=10)
            detect_s = time.monotonic() - killed
            assert result[tid] is not None, "a read from a killed peer reported success"
            if backend == "same_host":  # the next piece's copy saw the pidfd readable: the rows may be reused now
                assert "exited during the copy" in result[tid], result[tid]
            # ZMQ: the piece in flight fails once ack_timeout_s (3 s) passed since it was posted (before
            # the kill), noticed by the next poll: the slack is that one trip round the loop.
            assert detect_s <= 3.0 + 0.1, f"failure took {detect_s:.3f} s (heartbeat deadline 3 s)"
            victim.proc.join(5)
            assert sweep(shm_prefix + "victim")  # a SIGKILLed owner cannot unlink its own region
            tr.remove_peer("victim")

            other = PeerProc(children, backend, shm_prefix + "other", 64, bb, seed=2)
            tr.add_peer("other", other.info)
            t2 = tr.read_blocks("other", np.arange(64), np.arange(64))
            assert settle(tr, [t2]) == {t2: None}
            assert (reg.array()[:64] == other.expected()).all()
            other.exit(children)
        finally:
            assert tr.close()


@pytest.mark.parametrize("backend", MODES)
def test_close_with_transfers_in_flight_waits_then_reports_each_once(children, shm_prefix, backend):
    bb, nb = 256 * 1024, 512
    with KVRegion.create(shm_prefix + "dst", nb, bb) as reg:
        reg.array()[:] = CANARY
        tr = transport(reg, backend, agent_name=f"close-{os.getpid()}-{backend}",
                       max_piece_bytes=4 << 20, post_budget_bytes=8 << 20)
        peer = PeerProc(children, backend, shm_prefix + "src", nb, bb, seed=3)
        tr.add_peer("p", peer.info)
        tids = [tr.read_blocks("p", np.arange(i, nb, 4), np.arange(i, nb, 4)) for i in range(4)]
        tr.poll()  # some pieces posted
        t0 = time.monotonic()
        assert tr.close(timeout_s=10) is True
        assert time.monotonic() - t0 < 10
        assert tr.in_flight() == 0  # nothing can still land once close() returned
        done, failed = tr.poll()
        assert sorted(list(done) + [t for t, _ in failed]) == tids  # every transfer reported once
        assert all(r == "cancelled" for _, r in failed)
        assert tr.poll() == ((), ())
        snap1 = reg.array().copy()
        time.sleep(0.2)
        assert (reg.array() == snap1).all(), "bytes still landing in our region after close() returned"
        with pytest.raises(TransferFailed, match="closed"):
            tr.read_blocks("p", [0], [0])
        peer.exit(children)


def test_fallback_and_nixl_move_the_same_bytes(children, shm_prefix, local_region):
    rng = np.random.default_rng(11)
    local_rows = random_rows(rng, 64, 256, run_len=2)
    remote_rows = random_rows(rng, 64, 128)
    results = {}
    for backend in BACKENDS:
        local_region.array()[:] = CANARY
        peer = PeerProc(children, backend, shm_prefix + backend, 128, 16384, seed=9)
        tr = make_data_transport(local_region, backend=backend, agent_name=f"same-{os.getpid()}-{backend}")
        tr.add_peer("p", peer.info)
        tid = tr.read_blocks("p", local_rows, remote_rows)
        assert settle(tr, [tid]) == {tid: None}
        results[backend] = local_region.array().copy()
        peer.exit(children)
        assert tr.close()
    assert (results["nixl"] == results["zmq"]).all()
    assert (results["nixl"][local_rows] != CANARY).any()


@pytest.mark.parametrize("backend", MODES)
def test_two_keys_naming_one_agent_share_it(children, shm_prefix, local_region, backend):
    """A symmetric pair's two links (or an overlapping reconnect) name the same remote agent:
    NIXL refuses a second add_remote_agent, so the agent is loaded once and removed with the last key
    (on the same-host path: the peer's file is mapped once and unmapped with the last key)."""
    peer = PeerProc(children, backend, shm_prefix + "peer", 128, 16384, seed=4)
    expected = peer.expected()
    tr = transport(local_region, backend, agent_name=f"keys-{os.getpid()}-{backend}")

    def read_ok(key: str, local_rows, remote_rows) -> None:
        local_region.array()[:] = CANARY
        tid = tr.read_blocks(key, local_rows, remote_rows)
        assert settle(tr, [tid]) == {tid: None}
        assert (local_region.array()[local_rows] == expected[remote_rows]).all()

    try:
        tr.add_peer("out-3", peer.info)
        tr.add_peer("in-ab12", peer.info)
        assert tr.remotes() == {peer.info.agent_name: 2}
        t1 = tr.read_blocks("out-3", np.arange(0, 32), np.arange(96, 128))
        t2 = tr.read_blocks("in-ab12", np.arange(32, 64), np.arange(0, 32))
        assert settle(tr, [t1, t2]) == {t1: None, t2: None}
        assert (local_region.array()[:64] == expected[np.r_[96:128, 0:32]]).all()

        tr.remove_peer("out-3")
        assert tr.remotes() == {peer.info.agent_name: 1}
        read_ok("in-ab12", np.arange(100, 140), np.arange(40, 80))
        with pytest.raises(TransferFailed, match="unknown data peer 'out-3'"):
            tr.read_blocks("out-3", [0], [0])

        tr.remove_peer("in-ab12")
        assert tr.remotes() == {}
        tr.add_peer("out-4", peer.info)  # the agent was removed, so it can be added again
        tr.add_peer("in-cd34", peer.info)
        read_ok("out-4", np.arange(10), np.arange(118, 128))
        read_ok("in-cd34", np.arange(200, 256), np.arange(56))
        peer.exit(children)
    finally:
        assert tr.close()
    assert tr.remotes() == {}


def test_submission_errors_are_immediate(shm_prefix, local_region):
    tr = make_data_transport(local_region, backend="zmq", agent_name="subm")
    try:
        with pytest.raises(TransferFailed, match="unknown data peer"):
            tr.read_blocks("nobody", [0], [0])
        info = tr.local_info()
        with pytest.raises(TransferFailed, match="block_bytes=8192, local block_bytes=16384"):
            tr.add_peer("x", msgspec.structs.replace(info, block_bytes=8192))
        with pytest.raises(TransferFailed, match="data backend 'nixl'"):
            tr.add_peer("x", msgspec.structs.replace(info, backend="nixl"))
        tr.add_peer("self", info)
        with pytest.raises(TransferFailed, match="peer's 0..255"):
            tr.read_blocks("self", [0], [256])
        with pytest.raises(TransferFailed, match="local rows outside 0..255"):
            tr.read_blocks("self", [256], [0])
    finally:
        assert tr.close()


def test_nixl_missing_fails_fast_or_falls_back(monkeypatch, caplog, local_region):
    from p2pworker.data.nixl_transport import NIXL_MODULES

    for name in NIXL_MODULES:  # every place NIXL may live now raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
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


def test_nixl_registration_failure_is_data_plane_unavailable(monkeypatch, caplog, local_region):
    """E.g. RLIMIT_MEMLOCK too low: a P2PError naming cause and remedy; `auto` falls back, `nixl` does not."""
    from p2pworker.data.nixl_transport import import_nixl

    nixl_agent, _ = import_nixl()

    def refuse(self, *a, **kw):
        raise Exception("registerMem failed: Cannot allocate memory")  # a plain Exception, as NIXL raises

    monkeypatch.setattr(nixl_agent, "register_memory", refuse)
    with pytest.raises(DataPlaneUnavailable, match=r"could not register the KV region .*Cannot allocate memory"
                                                  r".*RLIMIT_MEMLOCK.*ulimit -l.*'auto'"):
        make_data_transport(local_region, backend="nixl", agent_name="reg1")
    with caplog.at_level(logging.WARNING, logger="p2pworker.data"):
        tr = make_data_transport(local_region, backend="auto", agent_name="reg2")
    try:
        assert tr.backend == "zmq"
        assert "Cannot allocate memory" in caplog.text and "ZMQ fallback" in caplog.text
    finally:
        assert tr.close()
    monkeypatch.undo()

    deregistered = []
    real_dereg = nixl_agent.deregister_memory

    def no_metadata(self):
        raise Exception("no md")

    def counted_dereg(self, reg, *a, **kw):
        deregistered.append(reg)
        return real_dereg(self, reg, *a, **kw)

    monkeypatch.setattr(nixl_agent, "get_agent_metadata", no_metadata)
    monkeypatch.setattr(nixl_agent, "deregister_memory", counted_dereg)
    with pytest.raises(DataPlaneUnavailable, match=r"could not produce its metadata: Exception: no md"):
        make_data_transport(local_region, backend="nixl", agent_name="md1")
    assert len(deregistered) == 1, "the region stayed registered after a failed start"


# ---------------------------------------------------------------- ZMQ fallback, one process, exact timing


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def pump(*transports, until, timeout_s=5.0):
    """Poll ``transports`` until ``until()``; returns every report of the first one."""
    done, failed = [], []
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "condition not reached in time"
        for i, tr in enumerate(transports):
            d, f = tr.poll()
            if i == 0:
                done += d
                failed += f
        time.sleep(0.0005)
    return done, failed


@pytest.mark.parametrize("how", ["cancelled", "timed_out"])
def test_zmq_reply_after_cancel_or_timeout_is_dropped_and_rows_untouched(shm_prefix, how):
    """The consumer copies only into pieces still open: a producer's late reply never reaches our rows."""
    bb = 4096
    clock = FakeClock()
    with KVRegion.create(shm_prefix + "cons", 16, bb) as cons_reg, \
            KVRegion.create(shm_prefix + "prod", 16, bb) as prod_reg:
        cons_reg.array()[:] = CANARY
        prod_reg.array()[:] = region_bytes(6, 16, bb)
        consumer = make_data_transport(cons_reg, backend="zmq", agent_name="cons", clock=clock, ack_timeout_s=3.0)
        producer = make_data_transport(prod_reg, backend="zmq", agent_name="prod")
        try:
            consumer.add_peer("out-1", producer.local_info())
            tid = consumer.read_blocks("out-1", np.arange(0, 8), np.arange(8, 16))
            assert consumer.poll() == ((), ())  # the request is out; the producer has not served it
            if how == "cancelled":
                consumer.cancel([tid])
                expect = "cancelled"
            else:
                clock.t += 3.0  # exactly the deadline: no reply within ack_timeout_s
                expect = "no reply within 3.0 s"
            done, failed = consumer.poll()
            assert list(done) == [] and len(failed) == 1 and failed[0][0] == tid and expect in failed[0][1]
            assert consumer.in_flight() == 0
            # Now the producer serves the request; its reply reaches the consumer's socket late.
            pump(producer, until=lambda: producer.served_bytes == 8 * bb)
            done, failed = pump(consumer, until=lambda: consumer.late_replies == 1)
            assert (done, failed) == ([], []), "a transfer was reported twice"
            assert (cons_reg.array() == CANARY).all(), "a late reply was copied into our rows"
            assert consumer.received_bytes == 0 and consumer.stats.bytes_done == 0

            # Positive control: the same read, not cancelled, lands.
            t2 = consumer.read_blocks("out-1", np.arange(0, 8), np.arange(8, 16))
            done, _ = pump(consumer, producer, until=lambda: consumer.in_flight() == 0)
            assert done == [t2]
            assert (cons_reg.array()[:8] == prod_reg.array()[8:]).all()
            assert (cons_reg.array()[8:] == CANARY).all()
        finally:
            assert consumer.close() and producer.close()


def test_zmq_producer_refuses_hostile_reads(shm_prefix):
    """Bad token, rows outside the region, oversized, malformed: refused with nothing served; producer lives on."""
    import zmq

    from p2pworker.data.zmq_transport import KIND_DATA, KIND_READ, DataHeader, ReadHeader

    enc, data_dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(DataHeader)  # the frames' public types

    bb = 4096
    with KVRegion.create(shm_prefix + "src", 8, bb) as reg:
        reg.array()[:] = region_bytes(8, 8, bb)
        tr = make_data_transport(reg, backend="zmq", agent_name="src", max_serve_bytes=4 * bb)
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(tr.local_info().endpoint)
        token = tr.local_info().token
        refused = {
            1: [KIND_READ, b"x" * 16, enc.encode(ReadHeader(1, 1, [(0, 1)]))],
            2: [KIND_READ, token, enc.encode(ReadHeader(1, 2, [(7, 2)]))],
            3: [KIND_READ, token, enc.encode(ReadHeader(1, 3, [(0, 0)]))],
            4: [KIND_READ, token, enc.encode(ReadHeader(1, 4, [(0, 3), (4, 2)]))],  # above max_serve_bytes
            5: [KIND_READ, token, enc.encode(ReadHeader(1, 5, []))],
        }
        try:
            for frames in refused.values():
                s.send_multipart(frames)
            s.send_multipart([KIND_READ, token, b"\xc1garbage"])  # undecodable: refused, not answered
            s.send_multipart([b"W", token, enc.encode(ReadHeader(1, 6, [(0, 1)]))])  # the old push frame
            errors = {}
            while len(errors) < len(refused):
                pump(tr, until=lambda: s.poll(0))
                kind, raw, *data = s.recv_multipart()
                h = data_dec.decode(raw)
                assert kind == KIND_DATA and h.error and not data, "a refused read carried rows"
                errors[h.seq] = h.error
            assert "bad read token" in errors[1] and "outside 0..8" in errors[2] and "outside" in errors[3]
            assert "max_serve_bytes" in errors[4] and "no rows" in errors[5]
            pump(tr, until=lambda: tr.rejected_reads == 7)
            assert tr.served_bytes == 0
            s.send_multipart([KIND_READ, token, enc.encode(ReadHeader(2, 9, [(3, 1), (6, 2)]))])
            pump(tr, until=lambda: s.poll(0))
            kind, raw, *data = s.recv_multipart()
            assert data_dec.decode(raw) == DataHeader(2, 9, "")
            assert [bytes(d) for d in data] == [reg.array()[3].tobytes(), reg.array()[6:8].tobytes()]
        finally:
            s.close(linger=0)
            ctx.term()
            assert tr.close()


def test_zmq_consumer_refuses_hostile_replies(shm_prefix):
    """A producer that answers with the wrong frames fails the piece and writes nothing; an answer to a
    piece nobody asked for is dropped."""
    import zmq

    from p2pworker.data.zmq_transport import KIND_DATA, KIND_READ, DataHeader, ReadHeader

    enc, read_dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ReadHeader)  # the frames' public types

    bb = 4096
    ctx = zmq.Context()
    evil = ctx.socket(zmq.ROUTER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.setsockopt(zmq.RCVTIMEO, 5000)
    port = evil.bind_to_random_port("tcp://127.0.0.1")
    with KVRegion.create(shm_prefix + "cons", 8, bb) as reg:
        reg.array()[:] = CANARY
        tr = make_data_transport(reg, backend="zmq", agent_name="cons")
        info = PeerDataInfo("zmq", "evil", 0, 8, bb, endpoint=f"tcp://127.0.0.1:{port}", token=b"t" * 16)
        tr.add_peer("evil", info)

        def request():
            """Submit a read of the evil producer's rows 4..5 into ours 0..1; return (tid, ident, header)."""
            tid = tr.read_blocks("evil", [0, 1], [4, 5])
            pump(tr, until=lambda: evil.poll(0))
            ident, kind, token, raw = evil.recv_multipart()
            assert kind == KIND_READ and token == b"t" * 16
            h = read_dec.decode(raw)
            assert h.tid == tid and h.runs == [(4, 2)]
            return tid, ident, h

        try:
            answers = [
                lambda h: [KIND_DATA, enc.encode(DataHeader(h.tid, h.seq)), b"\x01" * bb],  # one row short
                lambda h: [KIND_DATA, enc.encode(DataHeader(h.tid, h.seq)), b"\x01" * bb, b"\x01" * bb],  # 2 frames
                lambda h: [KIND_DATA, enc.encode(DataHeader(h.tid, h.seq)), b"\x01" * (2 * bb + 1)],
                lambda h: [KIND_DATA, enc.encode(DataHeader(h.tid, h.seq, "rows gone")), b"\x01" * 2 * bb],
            ]
            reasons = []
            for answer in answers:
                tid, ident, h = request()
                evil.send_multipart([ident] + answer(h))
                _, failed = pump(tr, until=lambda: tr.in_flight() == 0)
                assert [t for t, _ in failed] == [tid]
                reasons.append(failed[0][1])
            assert all("malformed reply" in r for r in reasons[:3]) and "refused the read: rows gone" in reasons[3]
            assert tr.rejected_replies == 3
            assert (reg.array() == CANARY).all(), "a refused reply was copied into our rows"

            tid, ident, h = request()
            evil.send_multipart([ident, KIND_DATA, enc.encode(DataHeader(h.tid + 100, h.seq)), b"\x02" * 2 * bb])
            evil.send_multipart([ident, b"junk"])
            pump(tr, until=lambda: tr.late_replies == 1 and tr.rejected_replies == 4)
            assert tr.in_flight() == 1 and (reg.array() == CANARY).all()
            evil.send_multipart([ident, KIND_DATA, enc.encode(DataHeader(h.tid, h.seq)), b"\x03" * 2 * bb])
            done, _ = pump(tr, until=lambda: tr.in_flight() == 0)
            assert done == [tid] and (reg.array()[:2] == 3).all() and (reg.array()[2:] == CANARY).all()
        finally:
            assert tr.close()
            evil.close(linger=0)
            ctx.term()
