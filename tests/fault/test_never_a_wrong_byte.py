"""Fault suite, "never a wrong byte": real workers, real NIXL (or the ZMQ fallback where named),
each test one promise (its docstring).

The promise behind all of them (invariant 7, docs/invariants.md): a row of an engine's region is written only by that
engine's own worker, never after the job that covers it was reported; a load reports a key as moved only
with that key's bytes.  The tests fill rows with a canary after a report and check that nothing changes
them afterwards, and compare every successful load byte for byte.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from p2pworker import api
from tests.helpers.fault import BLOCKS, Jobs, fake_nixl, figure, keys_for, load, park, pd

pytestmark = pytest.mark.timeout(240)
CANARY = 0xA5
BIG_BLOCK = 2 << 20  # 256 blocks x 2 MiB = 512 MiB regions


def short_lease(tmp_path, name: str, load_timeout_s: float, backend: str = "auto") -> list[str]:
    """Worker args for a config file with a short consumer lease (load_timeout_s)."""
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[session]\nload_timeout_s = {load_timeout_s}\nfetch_timeout_s = {load_timeout_s * 0.8}\n'
                    f'[data]\nbackend = "{backend}"\n')
    return ["--config", str(path)]


def collect_all(node, jobs: Jobs, timeout_s: float) -> None:
    """Take every report the node has now (exactly-once checked), without waiting for specific ids."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in node.client.poll():
            if isinstance(ev, api.JobFinished):
                assert ev.job_id not in jobs.reported, f"job {ev.job_id} reported twice"
                jobs.reported[ev.job_id] = ev
        time.sleep(0.01)


@pytest.mark.parametrize("data_path", ["same_host", "nixl"], indirect=True)
def test_producer_sigstopped_mid_fetch_never_writes_into_the_consumers_rows(nodes, tmp_path, figures):
    """(a) Producer SIGSTOPped in the middle of a 512 MiB fetch: the consumer times out and reports the load
    failed; the test fills the consumer's rows with a canary, SIGCONTs the producer and waits past its lease:
    0 canary bytes change (with pull, nothing but the consumer's own worker writes its rows)."""
    prod = nodes("prod", block_bytes=BIG_BLOCK, seed=1)
    cons = nodes("cons", block_bytes=BIG_BLOCK, seed=2, args=short_lease(tmp_path, "cons", 2.0))
    jobs = Jobs()
    keys = keys_for("big", BLOCKS)
    src, dst = list(range(BLOCKS)), list(reversed(range(BLOCKS)))
    lj = load(cons, prod.address, jobs, "big", keys, dst)  # the fetch first, then the stores in batches
    batches = [(keys[i:i + 32], src[i:i + 32]) for i in range(0, BLOCKS, 32)]
    sjs = [park(prod, jobs, "big", k, r, finished=False) for k, r in batches[:3]]
    time.sleep(0.3)  # three batches (192 MiB) offered and being read
    cons.check_data_path()  # on the path this run is for
    prod.kill(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        sjs += [park(prod, jobs, "big", k, r, finished=False) for k, r in batches[3:]]  # queued in its ring
        rep = jobs.collect(cons, {lj}, timeout_s=15)[lj]
        took = time.monotonic() - t0
        assert not rep.success, "the load could not have completed: 5 of 8 batches were never offered"
        assert 0 < len(rep.keys) < BLOCKS or rep.keys == [], rep
        arr = cons.region.array()
        arr[dst] = CANARY
    finally:
        prod.kill(signal.SIGCONT)
    prod.client.send(api.RequestFinished("big"))
    collect_all(prod, jobs, timeout_s=2.0 + 0.5 + 2.0)  # past the producer's hold of the consumer's lease
    changed = int(np.count_nonzero(cons.region.array()[dst] != CANARY))
    assert changed == 0, f"{changed} bytes of the consumer's reported rows changed after the report"
    assert set(sjs) <= set(jobs.reported), "every store job is reported once the lease ends"
    figure(figures, "producer SIGSTOP mid 512 MiB fetch: canary bytes changed after the report", f"{changed}", "0")
    figure(figures, "producer SIGSTOP mid fetch: consumer load reported", f"{took:.2f} s", "≤ lease 2 s + slack")


@pytest.mark.parametrize("data_path", ["same_host", "nixl"], indirect=True)
def test_consumer_sigstopped_mid_read_past_the_lease_never_reports_mixed_bytes(nodes, tmp_path, figures):
    """(b) Consumer SIGSTOPped while its reads run, kept stopped past the producer's lease; the producer's
    rows are then overwritten (as vLLM reuses them); consumer SIGCONT: its load is reported failed, never
    success with mixed bytes, and nothing lands in its rows after the report."""
    prod = nodes("prod", block_bytes=BIG_BLOCK, seed=1)
    cons = nodes("cons", block_bytes=BIG_BLOCK, seed=2, args=short_lease(tmp_path, "cons", 2.0))
    jobs = Jobs()
    caught = 0
    outcomes: list[str] = []
    pd(prod, cons, jobs, "warm-up", n=4)  # the session up (and its data path checked) before the stops
    for attempt, delay_s in enumerate((0.03, 0.01, 0.0)):
        keys = keys_for(f"r{attempt}", BLOCKS)
        src = list(range(BLOCKS))
        dst = np.random.default_rng(attempt).permutation(BLOCKS).tolist()
        original = prod.region.array()[src].copy()
        sj = park(prod, jobs, f"r{attempt}", keys, src)
        time.sleep(0.2)  # parked before the fetch: the whole request is offered at once
        lj = load(cons, prod.address, jobs, f"r{attempt}", keys, dst)
        time.sleep(delay_s)
        cons.kill(signal.SIGSTOP)
        try:
            collect_all(prod, jobs, timeout_s=2.0 + 0.5 + 1.5)  # the producer's hold ends while cons is stopped
            st = jobs.reported.get(sj)
            if st is None:  # stopped before its fetch went out: nothing was leased; not a mid-read case
                outcomes.append("stopped before the fetch")
            elif st.success:  # the consumer's Release came first: its reads were over before the stop
                outcomes.append("reads done before the stop")
            else:
                assert "ran out" in st.reason, st.reason
                prod.region.array()[src] = np.uint8(attempt + 1)  # vLLM reuses the producer's rows
        finally:
            cons.kill(signal.SIGCONT)
        rep = jobs.collect(cons, {lj}, timeout_s=15)[lj]
        if st is None:  # stopped before its fetch: the stopped consumer's link may have been declared dead
            prod.region.array()[src] = original
            continue
        got = cons.region.array()[dst]
        if rep.success:
            assert (got == original).all(), "a load reported success with bytes that are not the producer's"
        else:
            assert st is not None and not st.success, (rep, st)
            caught += 1
            outcomes.append("caught mid-read: load failed")
            cons.region.array()[dst] = CANARY
            time.sleep(1.0)
            assert (cons.region.array()[dst] == CANARY).all(), "bytes landed after the failed report"
            # why: its own read deadline, or (stopped ~4 s, past the 3 s heartbeat liveness) the session declared the
            # producer lost when it woke, or found that the producer (which declared IT lost meanwhile) closed their
            # same-host lane, whichever its loop saw first: all are failures, which is the promise
            assert any(w in rep.reason for w in ("deadline", "timed out", "heartbeat lost", "peer lost")), rep.reason
        prod.region.array()[src] = original
    assert caught >= 1, f"the consumer was never stopped in the middle of its reads: {outcomes}"
    st = cons.status()  # reads seen done after their deadline: open sessions' counters + retired ones'
    late = sum(s["late_reads"] for s in st["sessions"]) + st["counters"].get("sessions_late_reads", 0)
    outcomes.append(f"{late} read(s) reported done after the deadline (discarded); the others were cancelled")
    figure(figures, "consumer SIGSTOP mid read past the lease: loads reported failed (never mixed bytes)",
           f"{caught} of 3 attempts caught mid-read ({'; '.join(outcomes)})", "≥ 1, 0 mixed")


@pytest.mark.timeout(900)
def test_many_consumers_on_one_producer_with_a_short_lease(nodes, tmp_path, figures):
    """(c) Many consumers on one producer, a short load timeout: every successful load is byte-exact, and
    every failed one leaves its rows untouched after the report (canary).  Half of each request's stores
    reach the producer only after the consumer's lease ran out, so both outcomes happen."""
    n_cons, per_req = 64, 16
    prod = nodes("prod", seed=1, block_bytes=64 << 10)
    args = short_lease(tmp_path, "cons", 1.0)
    cons = [nodes(f"c{i}", seed=10 + i, args=args, block_bytes=64 << 10) for i in range(n_cons)]
    jobs = Jobs()
    plans = []
    ok = failed = intact = 0
    for rnd in range(3):
        canaried: list[tuple] = []  # (consumer, rows) of this round's failed loads, canary-filled after the report
        for i, c in enumerate(cons):
            req = f"c{i}-{rnd}"
            keys = keys_for(req, per_req)
            src = np.random.default_rng(rnd * 100 + i).choice(BLOCKS, per_req, replace=False).tolist()
            dst = np.random.default_rng(rnd * 100 + i + 50).choice(BLOCKS, per_req, replace=False).tolist()
            half = per_req // 2 if i % 2 else per_req  # odd consumers: the rest comes too late
            park(prod, jobs, req, keys[:half], src[:half], finished=half == per_req)
            plans.append((c, load(c, prod.address, jobs, req, keys, dst), src, dst))
        time.sleep(1.5)  # past the 1 s lease of the odd consumers' loads
        for i, c in enumerate(cons):
            if i % 2:
                req = f"c{i}-{rnd}"
                _, _, src, _ = plans[i]
                park(prod, jobs, req, keys_for(req, per_req)[per_req // 2:], src[per_req // 2:])
        for c, lj, src, dst in plans:
            rep = jobs.collect(c, {lj}, timeout_s=30)[lj]
            if rep.success:
                ok += 1
                assert (c.region.array()[dst] == prod.region.array()[src]).all(), "bytes differ"
            else:
                failed += 1
                c.region.array()[dst] = CANARY
                canaried.append((c, dst))
        plans.clear()
        time.sleep(1.0)  # the late stores are parked and offered to nobody; the producer goes on working
        for c, dst in canaried:  # no failed load's rows changed after its report
            assert (c.region.array()[dst] == CANARY).all(), "bytes landed in a failed load's rows after its report"
            intact += 1
    collect_all(prod, jobs, timeout_s=1.0)
    assert ok and failed, (ok, failed)  # both paths ran
    figure(figures, f"{n_cons} consumers x 3 rounds on one producer, lease 1 s",
           f"{ok} ok (byte-exact) / {failed} failed, {intact} failed loads' canaries intact", "no wrong byte")


def test_symmetric_pair_with_a_reconnect_in_the_middle(nodes, figures):
    """(d) A symmetric pair with loads in flight both ways and a reconnect in the middle: no "unknown data
    peer", no 30 s stall; every load after the reconnect succeeds byte-exact."""
    a, b = nodes("a", seed=1), nodes("b", seed=2)
    jobs = Jobs()
    reasons: list[str] = []
    worst = 0.0
    for rnd in range(12):
        pending = []
        for prod, cons, tag in ((a, b, "ab"), (b, a, "ba")):
            req = f"{tag}-{rnd}"
            keys = keys_for(req, 16)
            src = list(range(16 * (rnd % 8), 16 * (rnd % 8) + 16))
            dst = list(range(128 + 16 * (rnd % 8), 128 + 16 * (rnd % 8) + 16))
            park(prod, jobs, req, keys, src)
            pending.append((prod, cons, load(cons, prod.address, jobs, req, keys, dst), src, dst, time.monotonic()))
        if rnd == 5:  # drop a's outbound session to b (and with it b's inbound one) while both loads run
            a.client.send(api.CloseSession(b.address))
        for prod, cons, lj, src, dst, t0 in pending:
            rep = jobs.collect(cons, {lj}, timeout_s=40)[lj]
            worst = max(worst, time.monotonic() - t0)
            if rep.success:
                assert (cons.region.array()[dst] == prod.region.array()[src]).all()
            else:
                reasons.append(rep.reason)
                assert rnd == 5, f"round {rnd} failed: {rep.reason}"
    assert not any("unknown data peer" in r for r in reasons), reasons
    assert worst < 5.0, f"a load took {worst:.1f} s"
    figure(figures, "symmetric pair, reconnect mid-flight: slowest load", f"{worst * 1e3:.0f} ms", "< 5 s, no stall")


# ---------------------------------------------------------------------------------------------------------------
# (e) a protocol error on an outbound link: a real Worker (in a thread of this process) whose control
# transport corrupts its first offer, through a patch applied here (test code), not a production switch.
def test_protocol_error_on_an_outbound_link_then_the_next_load_succeeds(nodes, shm_prefix, tmp_path, figures):
    """(e) A producer that breaks the protocol once: the consumer closes that session (reason logged), and
    the next load to the same producer, which did not restart, gets a fresh session and succeeds."""
    import os

    from p2pworker.client import WorkerClient
    from p2pworker.config import load_config
    from p2pworker.shm import KVRegion
    from p2pworker.worker import Worker

    os.environ["P2PWORKER_SECRET"] = "fault-suite"
    region = KVRegion.create(f"{shm_prefix}hostile", BLOCKS, 256 * 1024)
    region.array()[:] = np.random.default_rng(5).integers(0, 256, size=region.array().shape, dtype=np.uint8)
    client = WorkerClient("hostile", spawn=False, prefix=f"{shm_prefix}hostile_rings")
    cfg = load_config(None, {"rings": client.prefix, "name": "hostile", "admin_path": str(tmp_path / "h.admin")})
    cfg.control.port = 0
    worker = Worker(cfg)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    cons = nodes("cons", seed=2)
    jobs = Jobs()
    try:
        ready = client.attach(region.handle, {"model": "fault-suite"})
        addr = ready.address.removeprefix("tcp://")
        real_send = worker.ctl.send
        corrupted = []

        def send(link, payload):  # the first offer goes out as garbage: a protocol error at the consumer
            if not corrupted and payload[:1] and b"offer" in payload[:16]:
                corrupted.append(link)
                payload = b"\x82\xa4type\xa5offer\xa1x\x01"
            real_send(link, payload)

        worker.ctl.send = send
        for rnd in range(3):
            keys = keys_for(f"h{rnd}", 8)
            assert client.send(api.StoreJob(100 + rnd, f"h{rnd}", keys, list(range(8 * rnd, 8 * rnd + 8))))
            assert client.send(api.RequestFinished(f"h{rnd}"))
            t0 = time.monotonic()
            lj = load(cons, addr, jobs, f"h{rnd}", keys, list(range(64, 72)))
            rep = jobs.collect(cons, {lj}, timeout_s=20)[lj]
            took = time.monotonic() - t0
            if rnd == 0:
                assert not rep.success and "protocol error" in rep.reason, rep
                continue
            if not rep.success and "retrying in" in rep.reason:  # within the reconnect backoff: once more
                time.sleep(0.5)
                lj = load(cons, addr, jobs, f"h{rnd}", keys, list(range(64, 72)))
                rep = jobs.collect(cons, {lj}, timeout_s=20)[lj]
            assert rep.success, rep
            assert (cons.region.array()[64:72] == region.array()[8 * rnd:8 * rnd + 8]).all()
        figure(figures, "protocol error on an outbound link: next load to the same producer", "succeeds",
               f"fresh session, {took * 1e3:.0f} ms")
    finally:
        worker.stop("test over")
        t.join(20)
        client.close()
        region.close()


# ---------------------------------------------------------------------------------------------------------------
# (g) NIXL that imports but fails at registration.  We run as root here, so a lowered RLIMIT_MEMLOCK does
# not bite (CAP_IPC_LOCK); instead the worker gets a stand-in `nixl` package on its PYTHONPATH whose
# register_memory raises the way UCX does when it cannot pin memory.  Test code only.
def test_nixl_registration_failure_is_a_clear_error_not_a_crash_loop(shm_prefix, tmp_path, figures):
    """(g) NIXL registration fails: under ``backend = nixl`` the worker reports a fatal WorkerError naming
    the cause at once (it does not crash; it exits cleanly when told); under ``auto`` it falls back to ZMQ."""
    import os

    from p2pworker.client import WorkerClient
    from p2pworker.errors import P2PError
    from p2pworker.shm import KVRegion

    env = {"P2PWORKER_SECRET": "fault-suite", "PYTHONPATH": fake_nixl(tmp_path) + os.pathsep + os.getcwd()}
    region = KVRegion.create(f"{shm_prefix}g", 16, 64 * 1024)
    try:
        c = WorkerClient("g-nixl", args=["--port", "0", "--backend", "nixl"], env=env)
        t0 = time.monotonic()
        try:
            with pytest.raises(P2PError) as e:
                c.attach(region.handle, {"model": "g"}, timeout_s=30)
            took = time.monotonic() - t0
            msg = str(e.value)
            assert "ucp_mem_map failed" in msg and "register" in msg, msg
            assert "memlock" in msg.lower() or "auto" in msg, msg  # it says what to do about it
            assert c.alive(), "the worker crashed instead of reporting"
        finally:
            assert c.close() == 0
        c = WorkerClient("g-auto", args=["--port", "0", "--backend", "auto"], env=env)
        try:
            assert c.attach(region.handle, {"model": "g"}, timeout_s=30).backend == "zmq"
        finally:
            assert c.close() == 0
    finally:
        region.close()
    figure(figures, "NIXL registration failure under backend=nixl: clear error", f"{took:.2f} s", "no crash loop")
