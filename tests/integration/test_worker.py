"""Two real workers launched through the CLI, driven through their rings by a harness that plays the adapter."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest

from p2pworker import api, copytune
from p2pworker.client import WorkerClient
from p2pworker.data import samehost
from p2pworker.errors import RingApiMismatch
from p2pworker.session.session import SessionConfig, longest_hold_s
from p2pworker.shm import KVRegion
from p2pworker.shm.sweep import leftovers
from tests.helpers.ports import free_port

ENV = {"P2PWORKER_SECRET": "worker-tests"}
BIN = Path(sys.executable).with_name("p2pworker")


def finished(client: WorkerClient, job_ids: set[int], timeout_s: float = 30.0) -> dict[int, api.JobFinished]:
    """Wait until every job in ``job_ids`` is reported; fail on a duplicate report."""
    got: dict[int, api.JobFinished] = {}
    deadline = time.monotonic() + timeout_s
    while set(got) != job_ids:
        assert time.monotonic() < deadline, f"jobs {job_ids - set(got)} not reported in {timeout_s} s"
        for ev in client.poll():
            if isinstance(ev, api.JobFinished):
                assert ev.job_id not in got, f"job {ev.job_id} reported twice"
                got[ev.job_id] = ev
        if not client.alive() and set(got) != job_ids:
            raise AssertionError(f"worker died with jobs {job_ids - set(got)} unreported")
        time.sleep(0.001)
    return got


@contextlib.contextmanager
def worker_pair(shm_prefix: str, tmp_path, names: tuple[str, str], num_blocks: int, block_bytes: int,
                segment_bytes: int | None = None):
    """Two regions of seeded random bytes, two workers attached to them; both must exit 0."""
    regions, clients = [], []
    try:
        for i, name in enumerate(names):
            reg = KVRegion.create(f"{shm_prefix}{name}", num_blocks, block_bytes,
                                  segment_bytes=segment_bytes or num_blocks * block_bytes)
            reg.array()[:] = np.random.default_rng(i).integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
            regions.append(reg)
            c = WorkerClient(name, args=["--port", "0", "--admin", str(tmp_path / f"{name}.admin")], env=ENV)
            clients.append(c)
        for c, reg in zip(clients, regions):
            c.attach(reg.handle, {"model": "test"})
        yield clients, regions
    finally:
        codes = [c.close() for c in clients]
        for reg in regions:
            reg.close()
    assert codes == [0, 0], f"worker exit codes {codes}"


@pytest.fixture
def pair(shm_prefix, tmp_path):
    """Two regions (random bytes), two workers attached to them."""
    with worker_pair(shm_prefix, tmp_path, ("wa", "wb"), 128, 64 * 1024, segment_bytes=2 << 20) as p:
        yield p


def test_two_workers_move_blocks_byte_exact_both_ways_and_inspect_sees_them(pair, tmp_path):
    (a, b), (ra, rb) = pair
    rng = np.random.default_rng(5)
    job = 0
    for src, dst, rsrc, rdst in ((a, b, ra, rb), (b, a, rb, ra)):
        req = f"req-{src.name}"
        src_rows = rng.permutation(128)[:40]
        dst_rows = rng.permutation(128)[:40]
        keys = [b"%s-%d" % (src.name.encode(), i) for i in range(40)]
        expect = rsrc.array()[src_rows].copy()
        assert src.send(api.StoreJob(job + 1, req, keys, src_rows.tolist()))
        assert dst.send(api.LoadJob(job + 2, src.ready.address, req, keys, dst_rows.tolist()))
        loads = finished(dst, {job + 2})
        stores = finished(src, {job + 1})
        assert loads[job + 2].success and loads[job + 2].keys == []  # success: every key moved, none echoed
        assert stores[job + 1].success
        assert (rdst.array()[dst_rows] == expect).all(), f"{src.name} -> {dst.name}: bytes differ"
        job += 2
    res = subprocess.run([str(BIN), "inspect", "--json", "--admin", str(tmp_path / "wa.admin")],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    (st,) = json.loads(res.stdout)
    assert st["name"] == "wa" and st["state"] == "running" and st["backend"] == "nixl"
    assert st["jobs_in_flight"] == 0 and st["bytes_read"] == 40 * 64 * 1024
    assert {s["peer_id"] for s in st["sessions"] if s["state"] == "active"} == {b.ready.node_id}
    # both workers on this host, each seeing the other's region file and process: the same-host copy path
    assert {(s["data_path"], s["data_path_why"]) for s in st["sessions"]} == {("same_host", "")}, st["sessions"]
    res = subprocess.run([str(BIN), "inspect", "--admin", str(tmp_path / "wb.admin")],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "worker wb" in res.stdout and "active" in res.stdout


def test_shutdown_command_fails_parked_work_once_and_exits_0(pair):
    (a, b), _ = pair
    assert a.send(api.StoreJob(1, "never-fetched", [b"k"], [3]))
    assert a.send(api.Shutdown("test"))
    got = finished(a, {1})
    assert not got[1].success and "shutting down" in got[1].reason
    assert a.proc.wait(15) == 0


@pytest.mark.timeout(120)
def test_sigterm_during_a_large_transfer_exits_0_with_every_job_reported(shm_prefix, tmp_path):
    """SIGTERM to the consumer while its reads run (pull: the consumer moves the bytes): it cancels and waits for
    its reads, reports the load failed, releases the producer's rows and exits 0; the producer's store is
    reported once the release (or at worst the consumer's 5 s lease) arrives."""
    cfg = tmp_path / "slow.toml"  # small pieces: the transfer spans many loop turns
    cfg.write_text("[data]\nmax_piece_bytes = 1048576\npost_budget_bytes = 1048576\n[session]\nload_timeout_s = 5.0\n")
    nb, bb = 1024, 256 * 1024
    with KVRegion.create(shm_prefix + "p", nb, bb) as rp, KVRegion.create(shm_prefix + "c", nb, bb) as rc:
        rp.array()[:] = 7
        prod = WorkerClient("prod", args=["--port", "0"], env=ENV)
        cons = WorkerClient("cons", config_path=str(cfg), args=["--port", "0", "--admin", str(tmp_path / "c.admin")],
                            env=ENV)
        try:
            prod.attach(rp.handle)
            cons.attach(rc.handle)
            keys = [b"%d" % i for i in range(nb)]
            assert prod.send(api.StoreJob(1, "big", keys, list(range(nb))))
            assert cons.send(api.LoadJob(2, prod.ready.address, "big", keys, list(range(nb))))
            from p2pworker.admin import query
            deadline = time.monotonic() + 20
            while query(str(tmp_path / "c.admin"))["transfers_in_flight"] == 0:
                assert time.monotonic() < deadline, "the transfer never started"
            cons.proc.send_signal(signal.SIGTERM)
            assert cons.proc.wait(20) == 0
            load = finished(cons, {2}, timeout_s=5)[2]
            assert not load.success and "SIGTERM" in load.reason
            store = finished(prod, {1}, timeout_s=5.0 + 0.5 + 5)[1]
            assert not store.success  # not every row was read
            assert prod.proc.poll() is None  # the producer keeps serving
        finally:
            assert prod.close() == 0
            cons.close()
    assert not leftovers(f"p2pw_prod_{os.getpid()}") and not leftovers(f"p2pw_cons_{os.getpid()}")
    assert not (tmp_path / "c.admin").exists()


@pytest.mark.timeout(60)
def test_idle_worker_uses_under_2_percent_of_a_core(pair):
    (a, b), (ra, rb) = pair
    assert b.send(api.OpenSession(a.ready.address))  # a live session with heartbeats, nothing else
    b.wait_for(lambda e: isinstance(e, api.PeerUp))

    def cpu_s(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = [cpu_s(c.proc.pid) for c in (a, b)]
    time.sleep(10)
    used = [cpu_s(c.proc.pid) - b0 for c, b0 in zip((a, b), before)]
    print(f"idle CPU over 10 s: {used[0]:.3f} s and {used[1]:.3f} s")
    assert max(used) < 0.2, f"an idle worker used {max(used) / 10:.1%} of a core"


def test_a_worker_whose_adapter_stops_reading_sleeps_until_it_reads_again(pair, tmp_path):
    """More events than the event ring holds, and an adapter that does not read for a while (a long engine step):
    the worker waits on the ring's space bell instead of polling every millisecond, and hands the rest over as
    soon as the adapter reads again.  (64 such workers spinning starved a whole test run of its CPU.)"""
    from p2pworker.admin import query

    (a, _), _ = pair
    n = 400  # the event ring has 256 slots
    sent = 0
    deadline = time.monotonic() + 30
    while sent < n:  # a store whose keys and rows disagree fails at once: one event each, no peer needed
        assert time.monotonic() < deadline, f"only {sent} commands taken"
        if a.send(api.StoreJob(1000 + sent, "r", [b"k"], [])):
            sent += 1
        else:
            time.sleep(0.001)
    time.sleep(0.5)  # the worker took them all and filled the event ring
    admin = str(tmp_path / "wa.admin")
    before = query(admin)["counters"]
    assert before.get("event_ring_full", 0) > 0, before  # it did run out of room
    time.sleep(2.0)
    loops = query(admin)["counters"]["loops"] - before["loops"]
    # asleep: timers only (~20 turns/s); polling for room every 1 ms would be ~2,000
    assert loops < 300, f"{loops} loop turns in 2 s while the adapter did not read"
    got = finished(a, set(range(1000, 1000 + n)), timeout_s=10)
    assert len(got) == n and not any(e.success for e in got.values())
    # and asleep again once it handed them over (a wake-up byte left on the ring's bell would spin it)
    time.sleep(0.3)
    before = query(admin)["counters"]["loops"]
    time.sleep(2.0)
    loops = query(admin)["counters"]["loops"] - before
    assert loops < 300, f"{loops} loop turns in 2 s after the adapter read everything"


def test_metrics_endpoint_counts_jobs(shm_prefix, tmp_path):
    port = free_port()
    with KVRegion.create(shm_prefix + "m", 8, 4096) as reg:
        c = WorkerClient("metrics", args=["--port", "0", "--metrics-port", str(port)], env=ENV)
        try:
            c.attach(reg.handle)
            c.send(api.StoreJob(1, "r", [b"k"], [0]))
            c.send(api.Shutdown())
            finished(c, {1})
        finally:
            c.close()
    # the worker is gone now; check a live one instead: DP rank 1 serves on port + 1, every series labelled
    with KVRegion.create(shm_prefix + "m2", 8, 4096) as reg:
        c = WorkerClient("metrics2", args=["--port", "0", "--dp-index", "1", "--metrics-port", str(port - 1)], env=ENV)
        try:
            c.attach(reg.handle, {"model": "tiny-test"})
            c.send(api.LoadJob(1, "127.0.0.1:1", "r", [b"k"], [0]))  # unreachable peer: fails within the deadline
            finished(c, {1}, timeout_s=10)
            from prometheus_client.parser import text_string_to_metric_families

            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            fams = {f.name: f for f in text_string_to_metric_families(body)}
            ident = {"engine": "metrics2", "role": "", "dp_rank": "1", "model": "tiny-test"}
            for f in fams.values():
                for s in f.samples:
                    assert {k: s.labels.get(k) for k in ident} == ident, (f.name, s.labels)  # every series labelled
            jobs = {(s.labels["kind"], s.labels["outcome"]): s.value for s in fams["p2pworker_jobs"].samples
                    if s.name == "p2pworker_jobs_total"}
            # every kind x outcome exists from attach on (primed at 0): a dashboard's outcome="failed" reads 0
            assert jobs == {("load", "failed"): 1.0, ("load", "ok"): 0.0, ("store", "ok"): 0.0,
                            ("store", "failed"): 0.0}
            assert [s.value for s in fams["p2pworker_transfers_in_flight"].samples] == [0.0]
            # counts that only rise are counters (exposed as <name>_total)
            assert fams["p2pworker_peer_deaths"].type == "counter"
            assert fams["p2pworker_protocol_errors"].type == "counter"
            assert "p2pworker_peer_deaths_total{" in body and fams["p2pworker_sessions"].type == "gauge"
        finally:
            assert c.close() == 0


def status_of(admin_path) -> dict:
    res = subprocess.run([str(BIN), "inspect", "--json", "--admin", str(admin_path)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)[0]


def sessions_of(admin_path) -> list[dict]:
    return status_of(admin_path)["sessions"]


def test_a_listed_peer_is_connected_before_any_request_even_one_that_starts_later(shm_prefix, tmp_path):
    """The tier's `peers`: the adapter sends OpenSession for each once its worker is ready; the worker
    connects and keeps the session, so the first request finds it (and its data path) set up.  Here the peer
    starts only after it was listed (a decode engine up before its prefill engine)."""
    port = free_port()
    regions, clients = [], []
    try:
        for i, (name, args) in enumerate((("ka", ["--port", "0"]), ("kb", ["--port", str(port)]))):
            reg = KVRegion.create(f"{shm_prefix}{name}", 64, 64 * 1024)
            reg.array()[:] = i + 1
            regions.append(reg)
            if i == 0:
                c = WorkerClient(name, args=args + ["--admin", str(tmp_path / "ka.admin")], env=ENV)
                clients.append(c)
                c.attach(reg.handle, {"model": "test"})
                assert c.send(api.OpenSession(f"127.0.0.1:{port}"))  # nobody listens there yet
                time.sleep(1.0)
                assert not [s for s in sessions_of(tmp_path / "ka.admin") if s["state"] == "active"]
        b = WorkerClient("kb", args=["--port", str(port)], env=ENV)
        clients.append(b)
        b.attach(regions[1].handle, {"model": "test"})
        a = clients[0]
        deadline = time.monotonic() + 15
        while not (up := [s for s in sessions_of(tmp_path / "ka.admin") if s["state"] == "active"]):
            assert time.monotonic() < deadline, "the listed peer's session never came up"
            time.sleep(0.1)
        (s0,) = up
        assert s0["peer_id"] == b.ready.node_id and s0["data_path"] == "same_host", s0
        # the first request uses that session: no second link, and it moves the bytes
        assert b.send(api.StoreJob(1, "r", [b"k0", b"k1"], [5, 6]))
        assert a.send(api.LoadJob(2, f"127.0.0.1:{port}", "r", [b"k0", b"k1"], [10, 11]))
        assert finished(a, {2})[2].success and finished(b, {1})[1].success
        assert (regions[0].array()[10:12] == 2).all()
        assert [s["link"] for s in sessions_of(tmp_path / "ka.admin")] == [s0["link"]]
        st = status_of(tmp_path / "ka.admin")
        assert st["kept_peers"] == [f"127.0.0.1:{port}"]
        if copytune.applies():  # spawned with glibc's non-temporal threshold lowered (p2pworker.copytune)
            assert f"{copytune.TUNABLE}={copytune.THRESHOLD:#x}" in st["glibc_tunables"]
    finally:
        codes = [c.close() for c in clients]
        for reg in regions:
            reg.close()
    assert codes == [0, 0], f"worker exit codes {codes}"


def test_a_session_opened_ahead_is_not_reopened_when_it_ends_but_a_listed_peers_is(shm_prefix, tmp_path):
    """OpenSession(keep=False) (the adapter saw a request that will load from that peer) opens the session once;
    keep=True (a listed peer) also re-opens it whenever it ends.  Both producers shut down and come back on the same
    ports: only the listed one is connected again."""
    adm = tmp_path / "oa.admin"
    ports = {"ahead": free_port(), "kept": free_port()}
    regions, clients = [], []

    def start(name: str, args: list[str]) -> WorkerClient:
        reg = KVRegion.create(f"{shm_prefix}{name}", 16, 16 * 1024)
        regions.append(reg)
        c = WorkerClient(name, args=args, env=ENV)
        clients.append(c)
        c.attach(reg.handle, {"model": "test"})
        return c

    def active() -> dict[str, dict]:
        return {s["peer_id"]: s for s in sessions_of(adm) if s["state"] == "active"}

    def until(pred, what: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, f"{what}: {sessions_of(adm)}"
            time.sleep(0.1)

    try:
        a = start("oa", ["--port", "0", "--admin", str(adm)])
        prod = {k: start(f"o{k[0]}1", ["--port", str(p)]) for k, p in ports.items()}
        assert a.send(api.OpenSession(f"127.0.0.1:{ports['ahead']}", keep=False))
        assert a.send(api.OpenSession(f"127.0.0.1:{ports['kept']}", keep=True))
        until(lambda: set(active()) == {c.ready.node_id for c in prod.values()}, "both sessions up")
        assert status_of(adm)["kept_peers"] == [f"127.0.0.1:{ports['kept']}"]
        for c in prod.values():
            assert c.close() == 0  # an orderly exit: its sessions end with a Bye
        until(lambda: not active(), "both sessions ended")
        again = {k: start(f"o{k[0]}2", ["--port", str(p)]) for k, p in ports.items()}
        until(lambda: again["kept"].ready.node_id in active(), "the listed peer was not connected again")
        time.sleep(1.0)  # as long again for the other: it would have been re-opened on the same tick
        assert again["ahead"].ready.node_id not in active()
    finally:
        codes = [c.close() for c in clients if c.proc is not None and c.proc.poll() is None]
        for reg in regions:
            reg.close()
    assert set(codes) <= {0}, f"worker exit codes {codes}"


def test_ping_reports_rtt_and_fingerprint_and_refuses_a_wrong_secret(pair):
    (a, _), _ = pair
    env = {**os.environ, **ENV}
    res = subprocess.run([str(BIN), "ping", a.ready.address, "--json", "--expect-fingerprint", a.ready.fingerprint],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["node_id"] == a.ready.node_id and out["compatible"] is True and out["rtt_ms"] > 0
    assert out["fingerprint_fields"]["model.model"] == "test" and out["block_bytes"] == 64 * 1024
    res = subprocess.run([str(BIN), "ping", a.ready.address, "--expect-fingerprint", "0" * 16],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 1 and "compatible with 0000000000000000: NO" in res.stdout
    res = subprocess.run([str(BIN), "ping", a.ready.address], capture_output=True, text=True, timeout=60,
                         env={**env, "P2PWORKER_SECRET": "wrong"})
    assert res.returncode == 1 and "failed to prove the shared secret" in res.stderr
    assert not [e for e in a.poll() if isinstance(e, api.PeerDown)]  # a probe is not a peer


def test_drain_reports_drained_once_nothing_is_in_flight_and_refuses_new_work(pair):
    (a, b), _ = pair
    assert a.send(api.StoreJob(1, "r", [b"k"], [1]))
    assert b.send(api.LoadJob(2, a.ready.address, "r", [b"k"], [2]))
    assert a.send(api.Drain())
    finished(b, {2})
    a.wait_for(lambda e: isinstance(e, api.Drained), timeout_s=10)
    assert a.send(api.StoreJob(3, "r2", [b"k"], [1]))
    got = finished(a, {1, 3})
    assert got[1].success and not got[3].success and "draining" in got[3].reason


def test_a_peer_named_by_host_name_is_resolved_off_the_loop_and_served(pair):
    """A load addressed to ``localhost:PORT`` (a name, not an IP literal) is parked while the worker's resolver
    thread looks the name up (getaddrinfo never runs on the event loop, where a slow resolver would stall every
    session past its heartbeat deadline), then served byte-exact.  (Only an /etc/hosts name: a test must send
    nothing off the host, so a slow or failing DNS server is not exercised here.)"""
    (a, b), (ra, rb) = pair
    port = a.ready.address.rsplit(":", 1)[1]
    keys = [b"name-%d" % i for i in range(4)]
    assert a.send(api.StoreJob(1, "by-name", keys, [0, 1, 2, 3]))
    assert a.send(api.RequestFinished("by-name"))
    assert b.send(api.LoadJob(2, f"localhost:{port}", "by-name", keys, [10, 11, 12, 13]))
    got = finished(b, {2}, timeout_s=20)[2]
    assert got.success, got
    assert (rb.array()[10:14] == ra.array()[0:4]).all()


@pytest.mark.timeout(240)
def test_65536_key_jobs_and_lookups_through_real_workers_byte_exact(shm_prefix, tmp_path):
    """Invariant 8 end to end below vLLM: a store, a load and a lookup of 65,536 keys (a 1M-token prompt at 16
    tokens per chunk) cross the rings (each message spans ~45 slots) and the control plane (8 frames each way)
    and move byte-exact through NIXL; each job is reported once."""
    n, block = 65_536, 256
    with worker_pair(shm_prefix, tmp_path, ("ka", "kb"), n, block) as (clients, regions):
        (prod, cons), (rp, rc) = clients, regions
        rng = np.random.default_rng(3)
        src, dst = rng.permutation(n), rng.permutation(n)
        keys = [i.to_bytes(32, "little") for i in range(n)]
        expect = rp.array()[src].copy()
        t0 = time.monotonic()
        assert prod.send(api.StoreJob(1, "long", keys, src.tolist()))
        assert prod.send(api.RequestFinished("long"))
        assert cons.send(api.LoadJob(2, prod.ready.address, "long", keys, dst.tolist()))
        load = finished(cons, {2}, timeout_s=120)[2]
        store = finished(prod, {1}, timeout_s=60)[1]
        elapsed = time.monotonic() - t0
        assert load.success and load.nbytes == n * block, load.reason
        assert store.success, store.reason
        assert (rc.array()[dst] == expect).all(), "bytes differ"
        print(f"65,536-key PD job through two workers: {elapsed:.2f} s")
        # a symmetric lookup of 65,536 keys: asked in parts, served by the peer's adapter (here: the test), answered
        assert cons.send(api.LookupKeys(7, prod.ready.address, "sym", keys))
        ask = prod.wait_for(lambda e: isinstance(e, api.PeerLookup), timeout_s=60)
        assert ask.keys == keys and ask.request_id == "sym"
        present = [i % 2 == 0 for i in range(n)]
        assert prod.send(api.AnswerLookup(ask.peer_id, ask.lookup_id, present))
        got = cons.wait_for(lambda e: isinstance(e, api.LookupResult), timeout_s=60)
        assert got.lookup_id == 7 and got.present == present


@pytest.mark.timeout(300)
def test_a_job_larger_than_the_whole_command_ring_goes_through(shm_prefix, tmp_path):
    """500,000 keys: the LoadJob is ~19 MB, more than the command ring's 256 slots of 64 KiB (16 MiB), so the
    adapter side publishes it as the worker frees slots (client.poll/flush, never blocking), and the worker's
    events come back the same way.  Byte-exact, each job reported once."""
    n, block = 500_000, 64
    with worker_pair(shm_prefix, tmp_path, ("ra", "rb"), n, block) as (clients, regions):
        (prod, cons), (rp, rc) = clients, regions
        src, dst = np.arange(n), np.random.default_rng(4).permutation(n)
        keys = [i.to_bytes(32, "little") for i in range(n)]
        load = api.LoadJob(2, prod.ready.address, "huge", keys, dst.tolist())
        assert len(msgspec.msgpack.encode(load)) > api.RING_NSLOTS * api.RING_SLOT_BYTES
        expect = rp.array()[src].copy()
        t0 = time.monotonic()
        assert prod.send(api.StoreJob(1, "huge", keys, src.tolist()))
        assert prod.cmd.pending_bytes > 0  # taken, partly out
        assert cons.send(load)
        while prod.cmd.pending_bytes:  # what the tier's polls do
            prod.poll()
            time.sleep(0.001)
        assert prod.send(api.RequestFinished("huge"))
        got = finished(cons, {2}, timeout_s=240)[2]
        assert got.success, got.reason
        assert finished(prod, {1}, timeout_s=60)[1].success
        assert (rc.array()[dst] == expect).all(), "bytes differ"
        print(f"500,000-key PD job (LoadJob of {len(msgspec.msgpack.encode(load)) / 2**20:.1f} MiB) through two "
              f"workers: {time.monotonic() - t0:.2f} s")


@pytest.mark.parametrize("spec,says", [
    ("tests.hooks.no_such_module:install", "No module named 'tests.hooks.no_such_module'"),
    ("tests.hooks.corrupt_loads", "expected module:function"),
    ("tests.hooks.corrupt_loads:no_such_function", "no_such_function"),
])
def test_a_failing_hook_stops_the_worker_at_start_and_leaves_nothing(shm_prefix, tmp_path, spec, says):
    """$P2PWORKER_HOOK, the worker's one extension point (tests only): a hook that cannot be installed fails the
    start with the cause, and the worker it was given is shut down (rings closed, admin socket removed)."""
    admin = tmp_path / "h.admin"
    log_path = tmp_path / "hook.log"
    with open(log_path, "w") as log_file:
        c = WorkerClient("hook", args=["--port", "0", "--admin", str(admin)], stderr=log_file,
                         env={**ENV, "P2PWORKER_HOOK": spec, "PYTHONPATH": str(Path(__file__).parents[2])})
        try:
            assert c.proc.wait(timeout=60) != 0
        finally:
            c.close()
    text = log_path.read_text()
    assert "worker did not start" in text and says in text, text[-2000:]
    assert not admin.exists(), "the admin socket of a worker whose hook failed was left behind"


def test_close_does_not_hang_on_a_worker_that_outlives_its_sigkill(shm_prefix, tmp_path, monkeypatch, caplog):
    """close() (vLLM's shutdown of the tier, every tool) asks the worker to shut down, SIGKILLs it after
    ``timeout_s`` and waits KILL_WAIT_S more: a worker stuck in the kernel (here: stopped, and the SIGKILL does not
    reach it) is left behind with an error naming its pid, not waited for without bound as before."""
    import threading

    from p2pworker import client as client_mod

    reg = KVRegion.create(f"{shm_prefix}stuck", 8, 4096)
    c = WorkerClient("stuck", args=["--port", "0"], env=ENV)  # its admin socket ours to remove
    pid = c.proc.pid
    try:
        c.attach(reg.handle, {"model": "test"})
        os.kill(pid, signal.SIGSTOP)  # reads no Shutdown
        monkeypatch.setattr(client_mod, "KILL_WAIT_S", 1.0)
        monkeypatch.setattr(c.proc, "kill", lambda: None)  # our SIGKILL does not reach it
        out = {}
        closing = threading.Thread(target=lambda: out.setdefault("code", c.close(timeout_s=0.5)), daemon=True)
        t0 = time.monotonic()
        closing.start()
        closing.join(10)
        took, blocked = time.monotonic() - t0, closing.is_alive()
        if blocked:
            os.kill(pid, signal.SIGKILL)  # lets close() return
            closing.join(10)
        assert not blocked, "close() waited for a worker that did not die"
        assert out["code"] is None and 1.5 <= took < 6.0, (out, took)
        assert f"(pid {pid}) still alive 1 s after SIGKILL" in caplog.text
        os.kill(pid, 0)  # left behind, alive
        assert not os.path.exists(c.admin_path)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        c.proc.wait(10)
        reg.close()


def test_an_operator_launched_worker_waits_for_the_event_ring_created_after_the_command_ring(shm_prefix, tmp_path):
    """The adapter creates <rings>.cmd, then <rings>.evt: a worker already waiting (`--wait-rings`) that sees the
    command ring first waits for the event ring too, instead of failing between the two (a CI run hit that window)."""
    from p2pworker.shm.ring import Ring, Role

    prefix = f"{shm_prefix}opring"
    cmd_name, evt_name = api.ring_names(prefix)
    worker = subprocess.Popen([str(BIN), "launch", "--rings", prefix, "--wait-rings", "30", "--port", "0",
                               "--name", "opring", "--admin", str(tmp_path / "opring.admin")],
                              env={**os.environ, **ENV})
    rings = []
    try:
        rings.append(Ring.create(cmd_name, Role.PRODUCER, nslots=api.RING_NSLOTS, slot_bytes=api.RING_SLOT_BYTES,
                                 msg_type=api.Command))
        time.sleep(1.5)  # the worker has found the command ring by now (it polls every 0.1 s)
        assert worker.poll() is None, "the worker gave up while the event ring was not there yet"
        evt = Ring.create(evt_name, Role.CONSUMER, nslots=api.RING_NSLOTS, slot_bytes=api.RING_SLOT_BYTES,
                          msg_type=api.Event)
        rings.append(evt)
        deadline = time.monotonic() + 20
        while not isinstance(evt.try_get(), api.Heartbeat):  # its loop runs: it attached both rings
            assert worker.poll() is None and time.monotonic() < deadline, "no heartbeat from the worker"
            time.sleep(0.05)
        assert rings[0].try_put(api.Shutdown("test over"))
        code = worker.wait(15)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(15)
        for r in rings:
            r.unlink()
            r.close()
    assert code == 0


@pytest.mark.parametrize("theirs, says", [(0, "a release from before the ring API was versioned"),
                                          (api.RING_API + 1, f"ring API {api.RING_API + 1}")])
def test_a_worker_refuses_an_adapter_of_another_release_as_a_configuration_error(shm_prefix, tmp_path, theirs, says):
    """An adapter of another p2pworker release (an operator-launched worker in another image) may send commands this
    worker cannot decode (it would drop them: a ResetCache never answered).  Its AttachRegion's ring API differs:
    the worker refuses it as fatal (the adapter does not restart it) and says both versions; no Ready."""
    reg = KVRegion.create(f"{shm_prefix}oldad", 8, 4096)
    c = WorkerClient("oldad", args=["--port", "0", "--admin", str(tmp_path / "oldad.admin")], env=ENV)
    try:
        assert c.send(api.AttachRegion(reg.handle, {"model": "test"}, theirs))
        ev = c.wait_for(lambda e: isinstance(e, (api.Ready, api.WorkerError)), 30)
        assert isinstance(ev, api.WorkerError), f"a worker attached for an adapter of ring API {theirs}: {ev}"
        assert ev.fatal and ev.attach and says in ev.message and f"speaks ring API {api.RING_API}" in ev.message
    finally:
        code = c.close()
        reg.close()
    assert code == 0


def test_ready_says_the_ring_api_and_the_longest_hold_from_the_workers_own_settings(shm_prefix, tmp_path):
    """The adapter's drain bound comes from the worker's Ready: its own [session] settings, which for an
    operator-launched worker are not the tier's.  A copy_threads that is set is used as set."""
    reg = KVRegion.create(f"{shm_prefix}hold", 8, 4096)
    settings = {"session": {"max_lease_s": 900.0, "load_timeout_s": 20.0}, "data": {"copy_threads": 3}}
    c = WorkerClient("hold", args=["--port", "0", "--admin", str(tmp_path / "hold.admin"),
                                   "--settings-json", json.dumps(settings)], env=ENV)
    try:
        ready = c.attach(reg.handle, {"model": "test"})
        assert ready.api == api.RING_API
        assert ready.hold_s == pytest.approx(longest_hold_s(SessionConfig(max_lease_s=900.0, load_timeout_s=20.0)))
        assert ready.hold_s > longest_hold_s(SessionConfig()) + 500
        assert status_of(tmp_path / "hold.admin")["copy_threads"] == 3
    finally:
        code = c.close()
        reg.close()
    assert code == 0


def test_a_client_refuses_a_worker_of_another_release(shm_prefix, tmp_path):
    """The other direction: a worker whose Ready has no ring API (an older release) is refused by name."""
    reg = KVRegion.create(f"{shm_prefix}oldw", 8, 4096)
    c = WorkerClient("oldw", args=["--port", "0", "--admin", str(tmp_path / "oldw.admin")],
                     env={**ENV, "P2PWORKER_HOOK": "tests.hooks.old_release:install",
                          "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        with pytest.raises(RingApiMismatch, match="a release from before the ring API was versioned"):
            c.attach(reg.handle, {"model": "test"})
    finally:
        code = c.close()
        reg.close()
    assert code == 0


def test_copy_threads_0_is_chosen_from_the_cpus_this_worker_may_use(pair, tmp_path):
    """The default [data] copy_threads = 0 reaches the copier resolved (status shows what it uses), from the CPUs
    this process may use (affinity, capped by a cgroup quota)."""
    want = samehost.auto_copy_threads(samehost.available_cpus())
    for name in ("wa", "wb"):
        assert status_of(tmp_path / f"{name}.admin")["copy_threads"] == want >= 1


def test_an_undecodable_first_command_is_refused_as_another_release(shm_prefix, tmp_path):
    """The ring API check needs AttachRegion to decode: a later release whose RegionHandle has a field this one does
    not know (it forbids unknown fields) is refused at once as fatal, naming the likely cause, not dropped while
    vLLM waits out its start timeout."""

    class FutureAttach(msgspec.Struct, tag="attach_region"):  # what a later adapter might send
        handle: dict
        identity: dict
        api: int

    reg = KVRegion.create(f"{shm_prefix}future", 8, 4096)
    handle = {**msgspec.to_builtins(reg.handle), "numa_node": 1}
    c = WorkerClient("future", args=["--port", "0", "--admin", str(tmp_path / "future.admin")], env=ENV)
    try:
        assert c.send(FutureAttach(handle, {"model": "test"}, api.RING_API + 1))
        ev = c.wait_for(lambda e: isinstance(e, (api.Ready, api.WorkerError)), 30)
        assert isinstance(ev, api.WorkerError) and ev.fatal and ev.attach, ev
        assert "likely another p2pworker release" in ev.message and f"ring API {api.RING_API}" in ev.message
    finally:
        code = c.close()
        reg.close()
    assert code == 0


def events_until(client: WorkerClient, want, timeout_s: float) -> list:
    """Poll ``client`` until ``want(events so far)``; every event is kept (none is dropped on the way)."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while not want(got):
        assert time.monotonic() < deadline, f"not seen within {timeout_s} s: {got}"
        got += client.poll()
        time.sleep(0.001)
    return got


def _answered(lookup_id: int):
    return lambda evs: any(isinstance(e, api.LookupResult) and e.lookup_id == lookup_id for e in evs)


def test_pulls_from_an_address_that_never_comes_up_fail_fast_and_are_counted(pair, tmp_path):
    """A ``remote_kv_source`` naming a port nobody listens on: the lookup is answered "not here" (the tier then
    recomputes) once the dial fails, and every pull for that address during the backoff after it fails at once,
    with the reason, instead of waiting for a handshake that will not come (before: each waited out the handshake or
    lookup timeout).  The failure is counted once per dial (peers_unreachable) and the worker stays up."""
    (a, _), _ = pair
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    assert a.send(api.LookupKeys(1, dead, "nobody-home", [b"k"]))
    (first,) = [e for e in events_until(a, _answered(1), 10) if isinstance(e, api.LookupResult)]
    first_s = time.monotonic() - t0
    assert first.present is None, first
    t1 = time.monotonic()
    assert a.send(api.LookupKeys(2, dead, "nobody-home", [b"k"]))
    assert a.send(api.LoadJob(3, dead, "nobody-home", [b"k"], [5]))
    evs = events_until(a, lambda evs: _answered(2)(evs) and any(isinstance(e, api.JobFinished) for e in evs), 10)
    again_s = time.monotonic() - t1
    (second,) = [e for e in evs if isinstance(e, api.LookupResult)]
    (load,) = [e for e in evs if isinstance(e, api.JobFinished)]
    assert second.present is None and "unreachable" in second.reason, second
    assert not load.success and "unreachable" in load.reason, load
    assert again_s < 0.5, f"a pull during the backoff took {again_s:.2f} s (first dial: {first_s:.2f} s)"
    assert status_of(tmp_path / "wa.admin")["counters"]["peers_unreachable"] >= 1
