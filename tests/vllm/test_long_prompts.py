"""Any prompt length (invariant 8) under vLLM's real TieringOffloadingManager (0.32 and 0.33), real workers.

A 128k-token prompt is 8,192 chunks of 16 tokens and a 1M-token prompt 65,536: one load job of that many keys
crosses the command ring (spanning slots), the control plane (Fetch/Offer/Release in parts) and NIXL.  Chunks
are 4 KiB here (vLLM's smallest: it aligns chunks to pages), so two engines of 65,536 chunks hold 256 MiB each.
"""

from __future__ import annotations

import time

import pytest

from p2pworker import api
from tests.helpers.vllm_engines import Engine, LookupResult, ReqContext, key, run_until
from vllm_adapter.hints import PullPath

pytestmark = pytest.mark.timeout(300)
ROW = 4096


def _engines(free_port, n: int):
    prefill = Engine("lp", free_port(), num_chunks=n, row=ROW)
    try:
        decode = Engine("ld", free_port(), num_chunks=n, row=ROW)
    except BaseException:
        prefill.close()
        raise
    return prefill, decode


def _consumer(decode: Engine, prefill: Engine, req: str, kv: str, kind: str = "remote_prefiller") -> ReqContext:
    host, port = prefill.tier.worker_address.split(":")
    ctx = ReqContext(req_id=req, kv_transfer_params={
        kind: {"kv_request_id": kv, "remote_host": host, "remote_port": int(port)}})
    with decode.lock:
        decode.mgr.on_new_request(ctx)
    return ctx


@pytest.mark.parametrize("n", [8192, 65_536])
def test_a_long_prompt_pd_request_lands_byte_exact_as_one_job(free_port, n):
    prefill, decode = _engines(free_port, n)
    try:
        ids = list(range(n))
        prefill.store("p", ids, {"remote_decoder": {"kv_request_id": "kv-long"}})
        ctx = _consumer(decode, prefill, "d", "kv-long")
        assert decode.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * n
        t0 = time.perf_counter()
        decode.step(["d"])  # submit_load: one job of n keys (and, without a poll thread, its ring write)
        step_s = time.perf_counter() - t0
        run_until([decode, prefill], lambda: decode.idle() and prefill.idle(), timeout_s=180)
        total_s = time.perf_counter() - t0
        assert decode.lookup(ctx, ids) == [LookupResult.HIT] * n
        decode.check_loaded(ctx, ids)
        st_p, st_d = prefill.tier.counters(), decode.tier.counters()
        assert st_d["loads_ok"] == 1 and st_d["loads_failed"] == 0, st_d
        assert st_p["stores_failed"] == 0 and st_p["jobs_in_flight"] == 0, st_p
        print(f"{n} chunks: scheduler step with submit_load {step_s * 1e3:.1f} ms, request done in {total_s:.2f} s")
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("path", [PullPath.ONE_TRIP, PullPath.ASK_FIRST])
def test_a_symmetric_pull_of_65536_keys(free_port, path):
    """One trip: every lookup HIT at once, the load of 65,536 keys asks the source.  Ask first: one batched lookup
    of 65,536 keys, then the load."""
    n = 65_536
    owner, reader = _engines(free_port, n)
    try:
        ids = list(range(n))
        owner.store("own", ids)  # a plain request: the chunks live in the owner's primary tier only
        ctx = _consumer(reader, owner, "sym", "sym-long", kind="remote_kv_source")
        if path is PullPath.ASK_FIRST:
            reader.tier.hints.lacked(owner.tier.worker_address, [key(0)])  # the source lately lacked the first key
            assert reader.lookup(ctx, ids) == [LookupResult.RETRY] * n  # asked in one batched lookup at the next poll
            run_until([reader, owner], lambda: reader.lookup(ctx, [n - 1]) != [LookupResult.RETRY], timeout_s=120)
        assert reader.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * n  # the owner holds every one
        assert ctx.get_state(PullPath) is path
        reader.step(["sym"])
        run_until([reader, owner], lambda: reader.idle() and owner.idle(), timeout_s=180)
        assert reader.lookup(ctx, ids) == [LookupResult.HIT] * n
        reader.check_loaded(ctx, ids)
        assert owner.tier.counters()["stores_failed"] == 0
    finally:
        reader.close()
        owner.close()


def test_jobs_past_the_limits_fail_cleanly_and_the_engine_keeps_serving(free_port, monkeypatch):
    """The hard limits are 1,048,576 keys per job and 256 MiB per ring message (p2pworker.limits); both are lowered
    here so that a job can cross them cheaply.  Crossing either fails that job through vLLM's normal failure path
    (the request recomputes), raises nothing into the scheduler, and the next request is served."""
    n = 4096
    prefill, decode = _engines(free_port, n)
    try:
        monkeypatch.setattr(api, "MAX_JOB_KEYS", 600)
        prefill.store("p1", range(700), {"remote_decoder": {"kv_request_id": "kv-over"}})
        ctx = _consumer(decode, prefill, "d1", "kv-over")
        assert decode.lookup(ctx, range(700)) == [LookupResult.HIT_PENDING] * 700
        decode.step(["d1"])  # submit_load of 700 keys > 600: failed at submit, reported like any failed load
        run_until([decode], decode.idle, timeout_s=10)
        assert decode.tier.counters()["loads_failed"] == 1
        assert decode.lookup(ctx, [0]) == [LookupResult.MISS]  # recompute
        monkeypatch.undo()

        # A command larger than the ring's message limit (lowered to 20 kB; 1,000 keys encode to ~45 kB).
        decode.tier.supervisor.client.cmd.max_message_bytes = 20_000
        prefill.store("p2", range(700, 1700), {"remote_decoder": {"kv_request_id": "kv-big"}})
        ctx2 = _consumer(decode, prefill, "d2", "kv-big")
        assert decode.lookup(ctx2, range(700, 1700)) == [LookupResult.HIT_PENDING] * 1000
        decode.step(["d2"])
        run_until([decode, prefill], decode.idle, timeout_s=10)
        assert decode.tier.counters()["loads_failed"] == 2
        decode.tier.supervisor.client.cmd.max_message_bytes = api.RING_MAX_MESSAGE_BYTES

        # ...and the engine serves the next long request (2,000 chunks: its command spans slots).
        ids = list(range(1700, 3700))
        prefill.store("p3", ids, {"remote_decoder": {"kv_request_id": "kv-after"}})
        ctx3 = _consumer(decode, prefill, "d3", "kv-after")
        assert decode.lookup(ctx3, ids) == [LookupResult.HIT_PENDING] * len(ids)
        decode.step(["d3"])
        run_until([decode, prefill], lambda: decode.idle() and prefill.idle(), timeout_s=60)
        decode.check_loaded(ctx3, ids)
        assert decode.tier.counters()["loads_ok"] == 1
    finally:
        decode.close()
        prefill.close()
