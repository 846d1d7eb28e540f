"""Workers that their host does not run for longer than the heartbeat deadline: two real workers (``p2pworker
launch``) on loopback, driven through their rings as the adapter would; SIGSTOP/SIGCONT stands for a host that
starves them of CPU.

The rule (p2pworker/control/liveness.py): a peer's silence is measured on the run clock, which does not count the
time our own loop did not run, and the tick right after such a stall reads what queued meanwhile before it judges.
The bounds, with the default liveness (heartbeat 1 s x 3 = the deadline, 3 s; tick 0.25 s):

- a worker that did not run never declares a link lost for that silence (its ``heartbeat_lost`` stays 0);
- a worker that ran through its peer's stop hears nothing for real, and it cannot tell a stopped peer from a cut
  wire: it declares the link lost within DEADLINE_S + TICK_S of the peer's last frame, the loads on it fail then;
  after the SIGCONT the link is up again within LINK_BACK_S and loads succeed;
- a SIGKILLed peer is declared lost at once (its kernel closed the connection): within CLOSED_S, not the deadline;
  one that never comes back is redialled for ``[control] forget_down_s``, then no more.

Each bound gets SLACK_S for a loaded 2-core host.  Both workers log to files under the test's tmp_path; regions are
the test's own (conftest checks /dev/shm), admin sockets live in tmp_path, ports are the workers' own (port 0).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import numpy as np
import pytest

from p2pworker import api
from p2pworker.admin import query
from p2pworker.client import WorkerClient
from p2pworker.shm import KVRegion

pytestmark = pytest.mark.timeout(120)

ENV = {"P2PWORKER_SECRET": "starved-links"}
BLOCKS, BLOCK_BYTES = 64, 64 * 1024
DEADLINE_S, TICK_S = 3.0, 0.25  # [control] defaults: heartbeat_interval_s 1 s x heartbeat_liveness 3; its tick
STOP_S = 4.0  # longer than the deadline
LINK_BACK_S = 2.0  # after a SIGCONT: the peer's RESET or the dialer's backoff (0.1 s), then one handshake
CLOSED_S = 0.25  # a killed peer's closed connection: one turn of the consumer's loop (it sleeps on the monitor)
SLACK_S = 1.5  # scheduling noise on a loaded 2-core host (as tests/fault)
LOST_LINE = re.compile(r"control link \S+ \(.*\) down: heartbeat lost")


class Node:
    """One worker, its region (seeded bytes), its admin socket and its log file."""

    def __init__(self, name: str, prefix: str, tmp_path, seed: int, settings: dict | None = None, port: int = 0):
        self.name = name
        self.admin = str(tmp_path / f"{name}.admin")
        self.log_path = tmp_path / f"{name}.log"
        self.region = KVRegion.create(f"{prefix}{name}", BLOCKS, BLOCK_BYTES)
        self.region.array()[:] = np.random.default_rng(seed).integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        self._log = open(self.log_path, "wb")
        args = ["--port", str(port), "--admin", self.admin]
        if settings is not None:
            args += ["--settings-json", json.dumps(settings)]
        self.client = WorkerClient(name, args=args, env=ENV, stderr=self._log)
        self.client.attach(self.region.handle, {"model": "starved-links"})
        self.reported: dict[int, api.JobFinished] = {}
        self.stopped = False

    @property
    def pid(self) -> int:
        return self.client.proc.pid

    @property
    def address(self) -> str:
        return self.client.ready.address

    def signal(self, sig: signal.Signals) -> None:
        self.client.proc.send_signal(sig)
        self.stopped = sig is signal.SIGSTOP

    def control(self) -> dict:
        """The control transport's counters (``p2pworker inspect``): only ask a worker that runs."""
        return query(self.admin)["control"]

    def status(self) -> dict:
        return query(self.admin)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def collect(self, want: set[int], timeout_s: float) -> dict[int, api.JobFinished]:
        """Wait until every job of ``want`` is reported (each at most once)."""
        deadline = time.monotonic() + timeout_s
        while not want <= set(self.reported):
            for ev in self.client.poll():
                if isinstance(ev, api.JobFinished):
                    assert ev.job_id not in self.reported, f"job {ev.job_id} reported twice"
                    self.reported[ev.job_id] = ev
            assert time.monotonic() < deadline, f"{self.name}: jobs {sorted(want - set(self.reported))} not " \
                                                f"reported within {timeout_s} s"
            time.sleep(0.001)
        return {j: self.reported[j] for j in want}

    def close(self) -> int | None:
        if self.stopped:
            self.signal(signal.SIGCONT)
        try:
            return self.client.close()
        finally:
            self._log.close()
            self.region.close()


class Jobs:
    def __init__(self):
        self.n = 0

    def park(self, prod: Node, req: str, keys: list[bytes], rows: list[int], finished: bool = True) -> int:
        self.n += 1
        assert prod.client.send(api.StoreJob(self.n, req, keys, rows))
        if finished:
            assert prod.client.send(api.RequestFinished(req))
        return self.n

    def load(self, cons: Node, prod: Node, req: str, keys: list[bytes], rows: list[int]) -> int:
        self.n += 1
        assert cons.client.send(api.LoadJob(self.n, prod.address, req, keys, rows))
        return self.n

    def pd(self, prod: Node, cons: Node, req: str, n: int = 8, timeout_s: float = 20.0) -> api.JobFinished:
        """One whole request prod -> cons; on success the bytes are checked."""
        src, dst = rows_for(req, n)
        keys = keys_for(req, n)
        sj = self.park(prod, req, keys, src)
        lj = self.load(cons, prod, req, keys, dst)
        ld = cons.collect({lj}, timeout_s)[lj]
        if ld.success:
            assert prod.collect({sj}, timeout_s)[sj].success
            assert (cons.region.array()[dst] == prod.region.array()[src]).all(), "bytes differ"
        return ld


def keys_for(req: str, n: int) -> list[bytes]:
    return [f"{req}/{i}".encode() for i in range(n)]


def rows_for(req: str, n: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(sum(req.encode()))
    return rng.permutation(BLOCKS)[:n].tolist(), rng.permutation(BLOCKS)[:n].tolist()


@pytest.fixture
def consumer_settings() -> dict | None:
    """The consumer's --settings-json (a test overrides this fixture to change it)."""
    return None


@pytest.fixture
def producer_port(request, free_port) -> int:
    """The producer's control port: 0 (any free one), or with ``indirect`` parametrization "fixed", a port outside
    the ephemeral range, so that a test can bind it again after the producer died (nothing else takes it meanwhile)."""
    return free_port() if getattr(request, "param", None) == "fixed" else 0


@pytest.fixture
def pair(shm_prefix, tmp_path, consumer_settings, producer_port):
    """(producer, consumer): the consumer dials the producer with its first load.  Both must exit 0 unless killed."""
    nodes: list[Node] = []
    try:
        nodes.append(Node("prod", shm_prefix, tmp_path, seed=1, port=producer_port))
        nodes.append(Node("cons", shm_prefix, tmp_path, seed=2, settings=consumer_settings))
        yield nodes[0], nodes[1]
    finally:
        codes = {n.name: n.close() for n in nodes}
    assert all(c in (0, -signal.SIGKILL) for c in codes.values()), f"worker exit codes {codes}"


def wait_for(what: str, pred, timeout_s: float, every_s: float = 0.05) -> float:
    """Seconds until ``pred()`` held (polled every ``every_s``); fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(every_s)
    return time.monotonic() - t0


def open_pull(jobs: Jobs, prod: Node, cons: Node, req: str) -> tuple[int, list[bytes], list[int], list[int]]:
    """A pull in flight: the consumer's fetch is out and half the request is parked and offered; the request is not
    finished, so the load waits on the link."""
    keys = keys_for(req, 16)
    src, dst = rows_for(req, 16)
    lj = jobs.load(cons, prod, req, keys, dst)
    jobs.park(prod, req, keys[:8], src[:8], finished=False)
    time.sleep(0.3)  # the fetch reached the producer, the first half was offered and read
    return lj, keys, src, dst


def test_a_host_that_stops_both_workers_past_the_deadline_costs_no_link_and_no_load(pair):
    """The report's case: the host runs neither worker for 4 s (> the 3 s deadline) while a pull is in flight.
    Neither declares the link lost (each counts the stall as its own, and logs it); the pull completes byte-exact
    once the rest is parked; the producer still serves on the same inbound link (no reconnect), even a deadline
    after the SIGCONT; the next request is served."""
    prod, cons = pair
    jobs = Jobs()
    assert jobs.pd(prod, cons, "warm").success
    links = {n.name: {s["link"] for s in query(n.admin)["sessions"] if s["state"] == "active"} for n in pair}
    lj, keys, src, dst = open_pull(jobs, prod, cons, "open")
    for n in (prod, cons):
        n.signal(signal.SIGSTOP)
    try:
        time.sleep(STOP_S)
    finally:
        for n in (prod, cons):
            n.signal(signal.SIGCONT)
    resumed = time.monotonic()
    jobs.park(prod, "open", keys[8:], src[8:])  # the rest, and the request's end
    ld = cons.collect({lj}, timeout_s=10)[lj]
    assert ld.success, f"the pull in flight across the stop failed: {ld.reason}"
    assert (cons.region.array()[dst] == prod.region.array()[src]).all(), "bytes differ"
    time.sleep(max(0.0, DEADLINE_S + TICK_S + SLACK_S - (time.monotonic() - resumed)))  # no late verdict either
    for n in (prod, cons):
        ctl = n.control()
        assert ctl["heartbeat_lost"] == 0 and ctl["links_down"] == 0, (n.name, ctl)
        assert ctl["stalls"] >= 1 and ctl["stalled_ms"] >= (STOP_S - 1.0) * 1000, (n.name, ctl)
        log = n.log()
        assert "did not read its sockets for" in log and not LOST_LINE.search(log), (n.name, log[-2000:])
        now = {s["link"] for s in query(n.admin)["sessions"] if s["state"] == "active"}
        assert now == links[n.name], f"{n.name}: sessions {links[n.name]} before the stop, {now} after"
    assert jobs.pd(prod, cons, "after").success


@pytest.mark.parametrize("stopped", ["producer", "consumer"])
def test_a_worker_stopped_past_the_deadline_blames_nobody_and_its_link_comes_back(pair, stopped):
    """One worker stopped for 4 s with a pull in flight.  The other, which ran, heard nothing for real: it declares
    the link lost within DEADLINE_S + TICK_S (+ slack), as it must for a cut wire.  The pull is reported (failed,
    never hung) by the end of the stop + slack.  The stopped worker, after its SIGCONT, never blames its peer (no
    heartbeat_lost, no "heartbeat lost" line, not even a deadline later); it logs its own stall; the link is up
    again within LINK_BACK_S and a request is served over it."""
    prod, cons = pair
    jobs = Jobs()
    assert jobs.pd(prod, cons, "warm").success
    quiet, ran = (prod, cons) if stopped == "producer" else (cons, prod)
    lj, _, _, _ = open_pull(jobs, prod, cons, "open")
    quiet.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        took = wait_for(f"{ran.name} declares the stopped {quiet.name} lost",
                        lambda: ran.control()["heartbeat_lost"] == 1, timeout_s=DEADLINE_S + TICK_S + SLACK_S)
        if cons is ran:  # the consumer runs: its load fails with the link, now
            assert not cons.collect({lj}, timeout_s=SLACK_S)[lj].success
        time.sleep(max(0.0, STOP_S - (time.monotonic() - t0)))
    finally:
        quiet.signal(signal.SIGCONT)
    resumed = time.monotonic()
    ld = cons.collect({lj}, timeout_s=SLACK_S)[lj]  # the stopped consumer's: when it hears the link is gone
    assert not ld.success and time.monotonic() - t0 <= STOP_S + SLACK_S, ld
    back = wait_for("the link is back and serves",
                    lambda: jobs.pd(prod, cons, f"back-{jobs.n}", timeout_s=LINK_BACK_S + SLACK_S).success,
                    timeout_s=LINK_BACK_S + SLACK_S, every_s=0.1)
    time.sleep(max(0.0, DEADLINE_S + TICK_S + SLACK_S - (time.monotonic() - resumed)))  # no late verdict either
    ctl = quiet.control()
    assert ctl["heartbeat_lost"] == 0 and ctl["stalls"] >= 1 and ctl["stalled_ms"] >= (STOP_S - 1.0) * 1000, ctl
    log = quiet.log()
    assert "did not read its sockets for" in log and not LOST_LINE.search(log), log[-2000:]
    assert ran.control()["heartbeat_lost"] == 1
    assert jobs.pd(prod, cons, "after").success
    print(f"\n{stopped} stopped {STOP_S:g} s: {ran.name} declared it lost after {took:.2f} s; a request was served "
          f"{back:.2f} s after the SIGCONT")


def test_a_killed_peer_is_declared_lost_at_once(pair):
    """A dead peer is seen fast: the producer SIGKILLed with a pull in flight; its kernel closes the TCP connection,
    and the consumer's link goes down on that close (``connection_closed``), not after the heartbeat deadline; the
    pull is reported failed by then; the consumer serves on."""
    prod, cons = pair
    jobs = Jobs()
    assert jobs.pd(prod, cons, "warm").success
    lj, _, _, _ = open_pull(jobs, prod, cons, "open")
    prod.signal(signal.SIGKILL)
    took = wait_for("the consumer declares the killed producer lost", lambda: cons.control()["connection_closed"] == 1,
                    timeout_s=CLOSED_S + SLACK_S, every_s=0.01)
    assert not cons.collect({lj}, timeout_s=0.5)[lj].success
    assert prod.client.proc.wait(5) == -signal.SIGKILL
    assert cons.control()["heartbeat_lost"] == 0  # the close told it, not the silence
    print(f"\nproducer SIGKILLed: the consumer declared it lost after {took:.3f} s (bound {CLOSED_S:g} s; the "
          f"heartbeat deadline {DEADLINE_S + TICK_S:g} s)")


FORGET_S = 2.0  # the consumer's [control] forget_down_s in the next test (default 60 s)
REDIAL_S = 1.0  # [control] reconnect_max_s: a DOWN link is redialled at most this far apart
BACKOFF_MAX_S = 5.0  # an address whose dial failed is dialled again after at most this (worker/peers.py)


@pytest.mark.parametrize("producer_port", ["fixed"], indirect=True)
@pytest.mark.parametrize("consumer_settings", [{"control": {"forget_down_s": FORGET_S}}])
def test_a_peer_gone_for_good_is_redialled_for_forget_down_s_then_only_when_named(pair, shm_prefix, tmp_path):
    """A source that does not come back (SIGKILLed; a scaled-down pod): the consumer redials its address, a refused
    dial at most reconnect_max_s apart, for [control] forget_down_s after the link went down, then drops the link
    (counted, ``links_down`` back to 0) and dials it no more on its own.  A later pull naming the address fails at
    once, as it did while the link was redialled, and dials it again; a worker restarted on that address is pulled
    from at the next pulls, the first once that dial linked."""
    prod, cons = pair
    jobs = Jobs()
    assert jobs.pd(prod, cons, "warm").success
    port = int(prod.address.rsplit(":", 1)[1])
    t0 = time.monotonic()  # before the kill: the link went down after it, so it may not be dropped before t0 + FORGET_S
    prod.signal(signal.SIGKILL)
    assert prod.client.proc.wait(5) == -signal.SIGKILL
    wait_for("the consumer declares the killed producer lost", lambda: cons.control()["connection_closed"] == 1,
             timeout_s=CLOSED_S + SLACK_S, every_s=0.01)
    assert cons.status()["links_down"] == 1
    wait_for("the link is dropped", lambda: cons.status()["counters"].get("links_dropped_down", 0) == 1,
             timeout_s=FORGET_S + TICK_S + SLACK_S, every_s=0.05)
    dropped_after = time.monotonic() - t0
    st = cons.status()
    assert st["links_down"] == 0 and st["sessions"] == [], st["sessions"]
    refused = cons.control()["connect_refused"]
    assert refused >= 1, "the link was not redialled while it was down"
    assert dropped_after >= FORGET_S, f"dropped {dropped_after:.2f} s after the kill (window {FORGET_S:g} s)"
    time.sleep(2 * REDIAL_S + 0.5)
    assert cons.control()["connect_refused"] == refused, "a dropped link was redialled"

    t1 = time.monotonic()
    lj = jobs.load(cons, prod, "after", keys_for("after", 4), rows_for("after", 4)[1])
    got = cons.collect({lj}, timeout_s=CLOSED_S + SLACK_S)[lj]
    failed_after = time.monotonic() - t1
    assert not got.success and "unreachable" in got.reason and "dialling it again" in got.reason, got.reason
    wait_for("the pull dials the address again", lambda: cons.control()["connect_refused"] == refused + 1,
             timeout_s=SLACK_S, every_s=0.01)

    # a silent host there now (TCP accepted by the kernel, never a greeting): pulls still fail at once, none waits
    # on the dial's handshake deadline
    with socket.socket() as silent:
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind(("127.0.0.1", port))
        silent.listen(8)
        quick = []
        for i in range(3):
            time.sleep(0.3)  # past the refused dial's backoff (0.2 s) for the first; the dial in flight for the rest
            t = time.monotonic()
            lj = jobs.load(cons, prod, f"silent-{i}", keys_for(f"silent-{i}", 4), rows_for(f"silent-{i}", 4)[1])
            got = cons.collect({lj}, timeout_s=CLOSED_S + SLACK_S)[lj]
            quick.append(time.monotonic() - t)
            # dialling (the first; the rest while that dial waits for a greeting), or in the backoff of a dial that
            # ended early on a host that stalled us: failed at once either way
            assert not got.success and ("dialling it again" in got.reason or "retrying in" in got.reason), got.reason
        assert max(quick) < CLOSED_S + SLACK_S, quick

    back = Node("back", shm_prefix, tmp_path, seed=1, port=port)  # restarted on the address the pulls name
    try:
        assert back.address == prod.address
        t2, tries, slowest = time.monotonic(), 0, 0.0
        while True:
            t = time.monotonic()
            ld = jobs.pd(back, cons, f"back-{tries}")
            if ld.success:
                break
            slowest = max(slowest, time.monotonic() - t)
            assert "unreachable" in ld.reason, ld.reason
            tries += 1
            assert time.monotonic() - t2 < BACKOFF_MAX_S + SLACK_S, f"not pulled from after {tries} tries"
            time.sleep(0.05)
        served_after = time.monotonic() - t2
        assert slowest < CLOSED_S + SLACK_S, f"a pull to the gone address waited {slowest:.2f} s"
    finally:
        assert back.close() == 0
    print(f"\npeer gone for good: {refused} refused redial(s), then dropped {dropped_after:.2f} s after the kill "
          f"(forget_down_s {FORGET_S:g} s); a later pull failed after {failed_after:.3f} s and dialled once; "
          f"with a silent host there, pulls failed after {', '.join(f'{q:.3f}' for q in quick)} s; "
          f"restarted on the address: served after {served_after:.2f} s ({tries} pull(s) failed at once before, "
          f"slowest {slowest:.3f} s)")
