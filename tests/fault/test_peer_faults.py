"""Fault suite, peers: each test is one promise (its docstring), checked with real workers on loopback.

Default liveness: heartbeats every 1 s, a peer silent for 3 intervals is dead (the "deadline", 3 s).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from p2pworker import api
from tests.helpers.fault import BLOCKS, Jobs, figure, keys_for, load, park, pd

pytestmark = pytest.mark.timeout(180)
DEADLINE_S = 3.0
SLACK_S = 1.5  # scheduling noise on a loaded 2-core box


@pytest.mark.parametrize("data_path", ["same_host", "nixl"], indirect=True)
def test_peer_sigkill_during_a_large_transfer(nodes, figures):
    """Peer SIGKILL during a large transfer: every job the consumer had on that peer is reported failed
    within the heartbeat deadline, a transfer from another peer finishes, and the worker keeps serving."""
    a, b, d = nodes("pa"), nodes("pb", seed=1), nodes("cd", seed=2)
    jobs = Jobs()
    assert pd(a, d, jobs, "warm-a")[0].success and pd(b, d, jobs, "warm-b")[0].success
    # A parks half of a 64 MiB request and never finishes it: D's fetch is in progress when A dies.
    n = 128
    keys = keys_for("big", n)
    park(a, jobs, "big", keys[: n // 2], list(range(n // 2)), finished=False)
    on_a = [load(d, a.address, jobs, "big", keys, list(range(n)))]
    on_a.append(load(d, a.address, jobs, "never-parked", keys_for("np", 8), list(range(128, 136))))
    time.sleep(0.3)
    t0 = time.monotonic()
    a.kill()
    sb = park(b, jobs, "from-b", keys_for("from-b", 64), list(range(64)))
    lb = load(d, b.address, jobs, "from-b", keys_for("from-b", 64), list(range(160, 224)))
    got = jobs.collect(d, set(on_a) | {lb}, timeout_s=DEADLINE_S + SLACK_S + 5)
    took = time.monotonic() - t0
    assert not got[on_a[0]].success and not got[on_a[1]].success
    assert got[lb].success and jobs.collect(b, {sb}, 10)[sb].success
    assert took <= DEADLINE_S + SLACK_S, f"failures reported {took:.2f} s after the kill"
    assert pd(b, d, jobs, "after")[0].success
    figure(figures, "peer SIGKILL mid-transfer: its jobs reported failed", f"{took:.2f} s",
           f"≤ {DEADLINE_S:g} s + slack")


@pytest.mark.parametrize("data_path", ["same_host", "nixl"], indirect=True)
def test_peer_sigstop_then_sigcont(nodes, figures):
    """A hung peer (SIGSTOP) is declared dead within the deadline; loads on it fail, never hang; after
    SIGCONT it serves again (its session is re-established)."""
    a, d = nodes("pa"), nodes("cd", seed=2)
    jobs = Jobs()
    assert pd(a, d, jobs, "warm")[0].success
    a.kill(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        keys = keys_for("hung", 8)
        lj = load(d, a.address, jobs, "hung", keys, list(range(8)))
        got = jobs.collect(d, {lj}, timeout_s=DEADLINE_S + SLACK_S + 5)[lj]
        took = time.monotonic() - t0
    finally:
        a.kill(signal.SIGCONT)
    assert not got.success and took <= DEADLINE_S + SLACK_S, (got, took)
    deadline = time.monotonic() + 20
    while True:  # the resumed peer is reached again (a fresh session)
        ld, _ = pd(a, d, jobs, f"resumed-{time.monotonic_ns()}", timeout_s=20)
        if ld.success:
            break
        assert time.monotonic() < deadline, f"resumed peer never served: {ld.reason}"
        time.sleep(0.5)
    figure(figures, "peer SIGSTOP: load on it reported failed", f"{took:.2f} s", f"≤ {DEADLINE_S:g} s + slack")


def test_peer_restarts_on_the_same_address(nodes, figures):
    """A peer killed and restarted on the same address (a new NIXL agent, new node id): the old session is
    retired, the next request is served by the new one, no crash on either side."""
    a, d = nodes("pa"), nodes("cd", seed=2)
    jobs = Jobs()
    assert pd(a, d, jobs, "before")[0].success
    old_address = a.address
    a.kill()
    a.client.close(timeout_s=5)
    a.start()  # same port: a.port was fixed at the first start
    assert a.address == old_address
    t0 = time.monotonic()
    deadline = time.monotonic() + 20
    while True:
        ld, st = pd(a, d, jobs, f"after-{time.monotonic_ns()}", timeout_s=20)
        if ld.success:
            break
        assert time.monotonic() < deadline, f"never served by the restarted peer: {ld.reason}"
        time.sleep(0.2)
    assert d.client.alive() and a.client.alive()
    figure(figures, "peer restarted on the same address: first successful load", f"{time.monotonic() - t0:.2f} s",
           "< 20 s")


class Partition:
    """A loopback TCP forwarder for the control connection that can drop traffic (partition) and heal."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.blocked = threading.Event()
        self.stop = threading.Event()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.lsock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                c, _ = self.lsock.accept()
            except OSError:
                continue
            u = socket.create_connection(self.target)
            self.socks += [c, u]
            for src, dst in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.1)
        while not self.stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if self.blocked.is_set():
                continue  # partitioned: traffic vanishes, connections stay up
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def heal(self) -> None:
        """Unblock, and reset the partitioned connections (a real partition leaves their streams broken)."""
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.socks.clear()
        self.blocked.clear()

    def close(self) -> None:
        self.stop.set()
        self.heal()
        self.lsock.close()


def through(a, d, via: str, jobs: Jobs, req: str, n: int = 16):
    """One load of ``n`` rows from ``a`` by ``d``, dialed at ``via`` (the partition's forwarder); its report."""
    src, dst = list(range(n)), list(range(64, 64 + n))
    keys = keys_for(req, n)
    park(a, jobs, req, keys, src)
    lj = load(d, via, jobs, req, keys, dst)
    return jobs.collect(d, {lj}, timeout_s=DEADLINE_S + SLACK_S + 25)[lj]


NO_LANE = ["--settings-json", '{"data": {"lane": false}}']


def test_control_plane_partition_then_heal(nodes, figures):
    """Control traffic between two workers is dropped (a partition on loopback): a load fails within the
    heartbeat deadline, never hangs; after the partition heals, loads succeed again.  (The session's messages on
    the control link: with a same-host lane they would bypass the partition, see the next test.)"""
    a, d = nodes("pa", args=NO_LANE), nodes("cd", seed=2, args=NO_LANE)
    part = Partition(a.port)
    via = f"127.0.0.1:{part.port}"
    jobs = Jobs()
    try:
        assert through(a, d, via, jobs, "before").success
        part.blocked.set()
        t0 = time.monotonic()
        got = through(a, d, via, jobs, "during")
        took = time.monotonic() - t0
        assert not got.success and took <= DEADLINE_S + SLACK_S, (got, took)
        part.heal()
        t1 = time.monotonic()
        deadline = t1 + 30
        while not through(a, d, via, jobs, f"healed-{time.monotonic_ns()}").success:
            assert time.monotonic() < deadline, "no recovery after the partition healed"
            time.sleep(0.5)
        figure(figures, "control partition: load reported failed", f"{took:.2f} s", f"≤ {DEADLINE_S:g} s + slack")
        figure(figures, "control partition healed: first successful load", f"{time.monotonic() - t1:.2f} s", "< 30 s")
    finally:
        part.close()


def test_a_partitioned_control_link_ends_a_lane_session_within_the_heartbeat_deadline(nodes, figures):
    """Same host, the session's messages on its lane: dropping the control link's traffic leaves the lane working,
    but the link's heartbeats still decide liveness: within the deadline the session is closed (its lane with it)
    and a load fails at once instead of hanging; after the partition heals, loads succeed again."""
    a, d = nodes("pa"), nodes("cd", seed=2)
    part = Partition(a.port)
    via = f"127.0.0.1:{part.port}"
    jobs = Jobs()

    def lanes() -> list[str]:
        return [s["lane"] for s in d.status()["sessions"] if s["state"] == "active"]

    try:
        assert through(a, d, via, jobs, "before").success
        assert lanes() == ["up"], lanes()
        part.blocked.set()
        t0 = time.monotonic()
        while lanes():
            assert time.monotonic() - t0 <= DEADLINE_S + SLACK_S, f"session still up: {d.status()['sessions']}"
            time.sleep(0.1)
        closed_after = time.monotonic() - t0
        t1 = time.monotonic()
        got = through(a, d, via, jobs, "during")
        assert not got.success and time.monotonic() - t1 <= DEADLINE_S + SLACK_S, got
        part.heal()
        deadline = time.monotonic() + 30
        while not through(a, d, via, jobs, f"healed-{time.monotonic_ns()}").success:
            assert time.monotonic() < deadline, "no recovery after the partition healed"
            time.sleep(0.5)
        assert lanes() == ["up"], lanes()
        figure(figures, "control partition with a lane: session closed", f"{closed_after:.2f} s",
               f"≤ {DEADLINE_S:g} s + slack")
    finally:
        part.close()


def test_a_lane_session_ends_with_the_peers_own_reason(nodes, figures):
    """Same host, the session on its lane.  A producer that shuts down says why: its Bye goes on the lane before the
    lane closes, and the consumer reads it first (the PeerDown it reports carries that reason, not "peer lost").  A
    producer SIGKILLed mid-load is seen from the kernel closing its connections, the lane's or the control link's,
    whichever the loop reads first (both end within milliseconds of each other): the load fails naming that close, not
    the heartbeat's silence, and nothing hangs."""
    a, d = nodes("pa"), nodes("cd", seed=2)
    jobs = Jobs()
    assert pd(a, d, jobs, "warm")[0].success
    assert [s["lane"] for s in d.status()["sessions"] if s["state"] == "active"] == ["up"]
    a.close()
    reasons: list[str] = []
    deadline = time.monotonic() + 15
    while not reasons:
        assert time.monotonic() < deadline, "no PeerDown after the producer shut down"
        reasons += [ev.reason for ev in d.client.poll() if isinstance(ev, api.PeerDown)]
        time.sleep(0.01)
    assert "said bye" in reasons[0] and "shutting down" in reasons[0], reasons

    b = nodes("pb", seed=1)
    assert pd(b, d, jobs, "warm-b")[0].success
    keys = keys_for("half", 32)
    park(b, jobs, "half", keys[:16], list(range(16)), finished=False)  # the load waits for the other half
    lj = load(d, b.address, jobs, "half", keys, list(range(100, 132)))
    time.sleep(0.3)
    t0 = time.monotonic()
    b.kill()
    got = jobs.collect(d, {lj}, timeout_s=DEADLINE_S + SLACK_S + 5)[lj]
    took = time.monotonic() - t0
    assert not got.success and "peer lost" in got.reason, got
    assert "same-host lane" in got.reason or "connection closed" in got.reason, got.reason
    assert "heartbeat" not in got.reason, got.reason
    assert pd(nodes("pc", seed=3), d, jobs, "after")[0].success  # the consumer's worker serves on
    figure(figures, "peer SIGKILL with a lane: its load reported failed", f"{took:.2f} s",
           f"≤ {DEADLINE_S:g} s + slack (the lane's or the link's close, not the heartbeat)")


def test_fingerprint_and_block_size_mismatch_name_both_values(nodes, figures):
    """Peers whose KV is not compatible never exchange data: the handshake is rejected and the failed load's
    reason names both values (fingerprint field; block size)."""
    a = nodes("pa", identity={"model": "model-A"})
    d = nodes("cd", identity={"model": "model-B"}, seed=2)
    jobs = Jobs()
    ld, _ = pd(a, d, jobs, "fp")
    assert not ld.success and "model-A" in ld.reason and "model-B" in ld.reason, ld.reason
    e = nodes("pe", block_bytes=128 * 1024, seed=3)
    ld2, _ = pd(e, d, jobs, "bs", verify=False)
    assert not ld2.success and "131072" in ld2.reason and "262144" in ld2.reason, ld2.reason
    figure(figures, "fingerprint mismatch: load fails with", repr(ld.reason.split("rejected by the peer: ")[-1][:110]),
           "names both values")
    figure(figures, "block size mismatch: load fails with", repr(ld2.reason.split("rejected by the peer: ")[-1][:110]),
           "names both values")


@pytest.mark.parametrize("data_path", ["same_host", "nixl"], indirect=True)
def test_shutdown_under_load_writes_nothing_after_close(nodes, figures):
    """Shutdown under load: once the consumer's worker close() returns, not one byte lands in its region
    (a canary written right after close() is intact 2 s later), and the producer survives."""
    a, d = nodes("pa"), nodes("cd", seed=2)
    jobs = Jobs()
    for i in range(6):  # many loads in flight: 6 x 32 blocks x 256 KiB = 48 MiB
        keys = keys_for(f"r{i}", 32)
        park(a, jobs, f"r{i}", keys, list(range(32 * i % BLOCKS, 32 * i % BLOCKS + 32)))
        load(d, a.address, jobs, f"r{i}", keys, list(range(32 * i, 32 * i + 32)))
    time.sleep(0.005)
    d.close()
    arr = d.region.array()
    canary = np.frombuffer(b"CANARY!!" * (arr.shape[1] // 8), dtype=np.uint8)
    arr[:] = canary
    time.sleep(2.0)
    bad = int((arr != canary).any(axis=1).sum())
    del arr
    assert bad == 0, f"{bad} row(s) were written after close() returned"
    assert a.client.alive()
    assert pd(a, nodes("ce", seed=5), jobs, "producer-still-serves")[0].success
    figure(figures, "shutdown under load: rows written after close()", f"{bad} of {BLOCKS}", "0")


def test_adapter_dies_worker_drains_deregisters_exits(nodes, children, shm_prefix, tmp_path, figures):
    """The adapter's process (vLLM) dies with a load in flight: its worker notices within the liveness
    period, fails and drains what it had, deregisters, unmaps and exits; its rings and admin socket are
    gone, and its peer keeps serving others."""
    from p2pworker.shm.liveness import process_alive
    from p2pworker.shm.sweep import leftovers, sweep
    from tests.helpers.adapter_child import adapter_with_load_in_flight
    from tests.helpers.fault import SECRET

    a = nodes("pa")
    q = children.ctx.Queue()
    admin = str(tmp_path / "orphan.admin")
    child = children.start(adapter_with_load_in_flight, shm_prefix + "orphan", admin, a.address, SECRET, q)
    pid, started, prefix = q.get(timeout=60)
    os.kill(child.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while process_alive(pid, started):
        assert time.monotonic() - t0 < 5.0, "worker still running 5 s after its adapter died"
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert not leftovers(prefix), "ring files left behind"
    assert not os.path.exists(admin), "admin socket left behind"
    assert sweep(shm_prefix + "orphan")  # the dead adapter owned the region file (vLLM's to remove)
    assert pd(a, nodes("cd", seed=2), Jobs(), "peer-still-serves")[0].success
    figure(figures, "adapter SIGKILLed with a load in flight: worker gone, nothing left", f"{took:.2f} s", "< 5 s")
