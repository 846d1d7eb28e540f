"""Fault suite, adapter side (needs vLLM: runs in the vLLM venvs): P2PWorkerTier inside vLLM's real
TieringOffloadingManager, its worker killed under load."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.fault import figure
from tests.helpers.vllm_engines import Engine, LookupResult, ReqContext, run_until

pytestmark = pytest.mark.timeout(240)


def loads_in_flight(decode, host: str, port: str, n: int, prefix: str, first_chunk: int) -> None:
    """``n`` PD loads in flight on ``decode``: nothing is parked for them, so each waits at the producer."""
    for i in range(n):
        ctx = ReqContext(req_id=f"d{i}", kv_transfer_params={"remote_prefiller": {
            "kv_request_id": f"{prefix}-{i}", "remote_host": host, "remote_port": int(port)}})
        with decode.lock:
            decode.mgr.on_new_request(ctx)
        decode.lookup(ctx, [first_chunk + i])
        decode.step([ctx.req_id])
    run_until([decode], lambda: len(decode.tier.jobs.open) == n and not decode.tier.outbox.commands, timeout_s=10)


def served_after_restart(prefill, decode, host: str, port: str, kv: str) -> bool:
    """One PD request through the (restarted) decode worker: every chunk HIT afterwards."""
    prefill.store("p-after", [7], {"remote_decoder": {"kv_request_id": kv}})
    ctx = ReqContext(req_id="d-after", kv_transfer_params={"remote_prefiller": {
        "kv_request_id": kv, "remote_host": host, "remote_port": int(port)}})
    with decode.lock:
        decode.mgr.on_new_request(ctx)
    decode.lookup(ctx, [7])
    decode.step(["d-after"])
    run_until([decode, prefill], lambda: decode.idle() and prefill.idle(), timeout_s=30)
    return decode.lookup(ctx, [7]) == [LookupResult.HIT]


def test_worker_sigkill_under_load_fails_every_job_once_within_1s(free_port, figures, monkeypatch):
    """Worker SIGKILL under load: the tier reports every in-flight job failed exactly once (vLLM's manager
    asserts on a duplicate) within 1 s, lookups MISS meanwhile, and a restarted worker serves the next
    request."""
    monkeypatch.setenv("P2PWORKER_SECRET", "fault-suite")
    prefill, decode = Engine("prefill", free_port(), num_chunks=64), Engine("decode", free_port(), num_chunks=64)
    try:
        host, port = prefill.tier.worker_address.split(":")
        n = 24
        loads_in_flight(decode, host, port, n, "kv-pending", 1000)
        old = decode.tier.supervisor.client.proc
        t0 = time.monotonic()
        os.kill(old.pid, signal.SIGKILL)
        run_until([decode], decode.idle, timeout_s=10)  # a double or unknown report would raise in vLLM
        took = time.monotonic() - t0
        assert decode.tier.counters()["loads_failed"] == n
        assert took <= 1.0, f"in-flight jobs reported failed {took:.2f} s after the worker died"
        run_until([decode], lambda: decode.tier.supervisor.ready, timeout_s=30)
        assert decode.tier.supervisor.client.proc.pid != old.pid
        assert served_after_restart(prefill, decode, host, port, "kv-after")
        figure(figures, f"worker SIGKILL with {n} loads in flight: all reported failed once", f"{took * 1e3:.0f} ms",
               "≤ 1 s")
    finally:
        for e in (decode, prefill):
            e.close()


def test_worker_sigstopped_under_the_adapter_fails_jobs_and_recovers(free_port, figures, monkeypatch):
    """A wedged worker (SIGSTOP: its pid lives, its loop does not): the tier notices the missing
    heartbeats within worker_stall_s (2 s here), SIGKILLs it, reports every in-flight job failed exactly once
    only after it is gone (a resumed worker could still copy into rows vLLM reused), and a restarted worker
    serves the next request."""
    monkeypatch.setenv("P2PWORKER_SECRET", "fault-suite")
    stall_s = 2.0
    prefill = Engine("prefill", free_port(), num_chunks=64)
    decode = Engine("decode", free_port(), num_chunks=64, worker_stall_s=stall_s)
    try:
        host, port = prefill.tier.worker_address.split(":")
        n = 8
        loads_in_flight(decode, host, port, n, "kv-wedged", 2000)
        old = decode.tier.supervisor.client.proc
        t0 = time.monotonic()
        os.kill(old.pid, signal.SIGSTOP)
        run_until([decode], decode.idle, timeout_s=stall_s + 10)
        took = time.monotonic() - t0
        assert old.poll() is not None, "jobs were failed while the wedged worker still lived"
        assert decode.tier.counters()["loads_failed"] == n
        assert took <= stall_s + 1.5, f"jobs of a wedged worker reported failed after {took:.2f} s"
        run_until([decode], lambda: decode.tier.supervisor.ready, timeout_s=30)
        assert served_after_restart(prefill, decode, host, port, "kv-after-wedge")
        figure(figures, f"worker SIGSTOP under the adapter ({n} loads in flight): failed once, after the kill",
               f"{took:.2f} s", f"≤ worker_stall_s {stall_s:g} s + slack")
    finally:
        for e in (decode, prefill):
            e.close()


def test_nixl_failing_at_registration_fails_vllm_start_with_the_cause(free_port, monkeypatch, tmp_path):
    """Backend nixl and a NIXL that fails to register memory: the tier's constructor (vLLM's
    engine start) fails within seconds naming the cause, instead of "did not become ready" after 120 s, and
    no worker is restarted in a loop."""
    from p2pworker.errors import P2PError
    from tests.helpers.fault import fake_nixl

    monkeypatch.setenv("P2PWORKER_SECRET", "fault-suite")
    monkeypatch.setenv("PYTHONPATH", fake_nixl(tmp_path) + os.pathsep + os.getcwd())
    t0 = time.monotonic()
    with pytest.raises(P2PError, match="ucp_mem_map failed"):
        Engine("broken", free_port(), num_chunks=16, backend="nixl")
    assert time.monotonic() - t0 < 30
