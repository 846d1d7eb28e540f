"""vLLM 0.34's deferred release, under the real tiering managers: a load that can no longer succeed is reported
failed at once, and vLLM gets its rows back only once none of our reads can land in them (invariant 7).

The decode engine's worker runs with a stalled data plane (tests/hooks/stalled_reads.py): while a flag file exists it
collects no settled read, so a posted read stays pending as long as the test wants.  On vLLM 0.33 (no deferred
release) the same scenarios show the other half of the contract: the load is reported only once its reads settled.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.vllm_engines import Engine, LookupResult, ReqContext, run_until
from vllm_adapter.contract import VLLM


@pytest.fixture
def stalled(free_port, monkeypatch, tmp_path):
    """(prefill, decode, the stall flag file, the decode worker's log of settled reads and reported jobs)."""
    flag, log = tmp_path / "stall", tmp_path / "log"
    prefill = Engine("drp", free_port())
    monkeypatch.setenv("P2PWORKER_HOOK", "tests.hooks.stalled_reads:install")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))
    monkeypatch.setenv("P2PW_STALL_READS", str(flag))
    monkeypatch.setenv("P2PW_STALL_LOG", str(log))
    decode = Engine("drd", free_port())
    yield prefill, decode, flag, log
    flag.unlink(missing_ok=True)  # a worker holding reads cannot stop cleanly
    for e in (decode, prefill):
        e.close()


def consume(decode: Engine, prefill: Engine, kv: str, ids: list[int]) -> ReqContext:
    """A PD consumer's request for ``ids`` of ``kv``: looked up, its load submitted by the step."""
    host, port = prefill.tier.worker_address.split(":")
    ctx = ReqContext(req_id=f"d-{kv}", kv_transfer_params={
        "remote_prefiller": {"kv_request_id": kv, "remote_host": host, "remote_port": int(port)}})
    with decode.lock:
        decode.mgr.on_new_request(ctx)
    assert decode.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * len(ids)
    decode.step([ctx.req_id])
    return ctx


def deferred_chunks(engine: Engine) -> int:
    """Rows vLLM holds back from its free pool for a deferred release (0.34's primary tier; 0 elsewhere)."""
    return int(getattr(engine.mgr.primary_tier, "num_deferred_release_chunks", 0))


def log_lines(log: Path) -> list[tuple[float, str]]:
    if not log.exists():
        return []
    return [(float(t), rest) for t, rest in (line.split(" ", 1) for line in log.read_text().splitlines())]


def first(lines, prefix: str) -> float:
    return next(t for t, what in lines if what.startswith(prefix))


def short_with_a_read_past_the_gap(prefill: Engine, decode: Engine, flag: Path, kv: str) -> ReqContext:
    """The producer holds key 1 of [0, 1] only: it offers 1 (its read is posted and stalls), then says it lacks 0.
    vLLM recomputes from key 0, so the read of key 1 is useless."""
    prefill.store(f"p-{kv}", [1], {"remote_decoder": {"kv_request_id": kv}})
    flag.touch()
    ctx = consume(decode, prefill, kv, [0, 1])
    return ctx


def test_a_load_the_source_answered_not_held_is_reported_before_its_read_settles(stalled):
    prefill, decode, flag, log = stalled
    ctx = short_with_a_read_past_the_gap(prefill, decode, flag, "kv-gap")
    if VLLM.deferred_release:
        run_until([decode, prefill], decode.idle, timeout_s=10)  # reported (failed) while the read is stalled
        assert decode.lookup(ctx, [0, 1]) == [LookupResult.MISS] * 2  # vLLM recomputes from key 0
        [event] = decode.tier.jobs.deferred.values()
        assert not event.is_set() and deferred_chunks(decode) == 2, "rows released while a read may land in them"
        flag.unlink()
        run_until([decode, prefill], lambda: not decode.tier.jobs.deferred and deferred_chunks(decode) == 0,
                  timeout_s=10)
        assert event.is_set()
        lines = log_lines(log)
        assert first(lines, "JobFinished") < first(lines, "read") < first(lines, "RowsSettled")
        assert "False" in next(what for _, what in lines if what.startswith("JobFinished"))  # settled False
    else:  # 0.33: no deferred release: the load stays open until its read settled, then is reported
        time.sleep(1.0)
        for _ in range(20):
            decode.step()
        assert not decode.idle(), "reported before its read settled, without a deferred release"
        flag.unlink()
        run_until([decode, prefill], decode.idle, timeout_s=10)
        lines = log_lines(log)
        assert first(lines, "read") < first(lines, "JobFinished")
    assert decode.tier.counters()["loads_failed"] + decode.tier.counters()["loads_short"] == 1
    with decode.lock:
        decode.mgr.on_request_finished(ctx)


def test_a_drain_ends_every_load_and_sets_every_deferred_release_before_it_returns(stalled):
    """vLLM's reset_cache (drain_jobs) with a load whose read is stalled: it returns only once that read settled,
    every event set (vLLM 0.34 asserts no deferred release is left), and the tier serves on."""
    prefill, decode, flag, log = stalled
    prefill.store("p-dr", [2, 3], {"remote_decoder": {"kv_request_id": "kv-dr"}})
    flag.touch()
    ctx = consume(decode, prefill, "kv-dr", [2, 3])
    t_end = time.monotonic() + 1.0  # the Fetch, its Offer and our posted read (stalled) take milliseconds
    run_until([decode, prefill], lambda: time.monotonic() > t_end, timeout_s=10)
    assert decode.tier.counters()["jobs_in_flight"] == 1
    done: list[BaseException | None] = []

    def reset() -> None:
        try:
            with decode.lock:
                decode.mgr.reset_cache()
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            done.append(e)

    t = threading.Thread(target=reset)
    t.start()
    time.sleep(1.0)
    assert not done, "drain_jobs returned while a read could still land in vLLM's rows"
    flag.unlink()
    t.join(timeout=30)
    assert done == [None]
    assert not decode.tier.jobs.open and not decode.tier.jobs.deferred and deferred_chunks(decode) == 0
    lines = log_lines(log)
    if VLLM.deferred_release:  # the load was reported at once, unsettled, and settled only after its read
        assert first(lines, "JobFinished") < first(lines, "read") < first(lines, "RowsSettled")
        assert next(what for _, what in lines if what.startswith("JobFinished")).endswith("False")
    else:
        assert first(lines, "read") < first(lines, "JobFinished")
    with decode.lock:
        decode.mgr.on_request_finished(ctx)
        on_flushed = getattr(decode.mgr, "on_reset_flushed", None)
        if on_flushed is not None:
            on_flushed()


def test_a_worker_killed_with_deferred_rows_outstanding_releases_them_once_it_is_gone(stalled):
    prefill, decode, flag, _ = stalled
    ctx = short_with_a_read_past_the_gap(prefill, decode, flag, "kv-kill")
    pid = decode.tier.supervisor.client.proc.pid
    if VLLM.deferred_release:
        run_until([decode, prefill], lambda: bool(decode.tier.jobs.deferred), timeout_s=10)
        [event] = decode.tier.jobs.deferred.values()
    else:
        run_until([decode, prefill], lambda: not prefill.idle(), timeout_s=10)  # offered and read: still open
        event = None
    time.sleep(0.5)
    assert event is None or not event.is_set()
    os.kill(pid, signal.SIGKILL)
    run_until([decode], lambda: decode.tier.supervisor.client is None or decode.tier.supervisor.client.proc.pid
              != pid, timeout_s=15)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped before anything was released
    assert not decode.tier.jobs.deferred and not decode.tier.jobs.open
    if event is not None:
        assert event.is_set()
        run_until([decode], lambda: deferred_chunks(decode) == 0, timeout_s=10)
    flag.unlink()
    run_until([decode], lambda: decode.tier.supervisor.ready, timeout_s=60)
    with decode.lock:
        decode.mgr.on_request_finished(ctx)
