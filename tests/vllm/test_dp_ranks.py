"""An engine with two data-parallel ranks, each rank a real TieringOffloadingManager built with its own rank's
parallel config (as vLLM builds each DP rank's engine core), so each rank's tier spawns its own worker on the
control port base + rank.  (vLLM's CPU backend was not run with --data-parallel-size 2 here: each DP rank is an
engine core of its own, and what our tier sees of it is this.)

- Each puller rank pulls from the source rank of its index, on port + rank; the puller's second rank
  takes its first step with that pull (it never stepped before) and is served within a few seconds.
- The source dies: every puller rank's next pull is refused at once (MISS, vLLM recomputes), each rank on its own
  within a second of the first rank seeing it, instead of waiting out a timeout per rank.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.ports import free_port_run
from tests.helpers.vllm_engines import Engine, LookupResult, ReqContext, run_until

pytestmark = pytest.mark.timeout(240)

RANKS = 2
FIRST_PULL_S = 5.0  # the first pull into a rank that never stepped: served within this (vLLM's in-tree tier: 10.4 s)


def _engines(name: str, **kw) -> list[Engine]:
    base = free_port_run(RANKS)
    out: list[Engine] = []
    try:
        for r in range(RANKS):
            out.append(Engine(name, base, num_chunks=16, dp=(r, RANKS), **kw))
    except BaseException:
        for e in out:
            e.close()
        raise
    return out


def _pull(reader: Engine, address: str, rid: str) -> ReqContext:
    host, port = address.split(":")
    ctx = ReqContext(req_id=rid, kv_transfer_params={
        "remote_kv_source": {"kv_request_id": rid, "remote_host": host, "remote_port": int(port)}})
    with reader.lock:
        reader.mgr.on_new_request(ctx)
    return ctx


def _until_answered(reader: Engine, others: list[Engine], ctx: ReqContext, ids: list[int],
                    timeout_s: float) -> list:
    """Scheduler passes over ``ctx`` until its lookups are all HIT (pulled) or all MISS (recompute)."""
    deadline = time.monotonic() + timeout_s
    first = True
    while True:
        got = reader.lookup(ctx, ids)
        if got in ([LookupResult.HIT] * len(ids), [LookupResult.MISS] * len(ids)):
            return got
        assert time.monotonic() < deadline, f"not answered within {timeout_s} s: {got}"
        reader.step([ctx.req_id] if first else [])
        first = False
        run_until([reader, *others], lambda: reader.idle() and not reader.tier.lookups.pending, timeout_s=timeout_s)


def test_each_rank_pulls_and_serves_on_its_port_and_a_dead_source_is_refused_on_every_rank():
    sources = _engines("dpsrc")
    pullers = _engines("dppul")
    try:
        addresses = [s.tier.worker_address for s in sources]
        ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
        assert ports[1] == ports[0] + 1, addresses  # base + rank
        ids_of = [list(range(700 + 10 * r, 704 + 10 * r)) for r in range(RANKS)]
        for r, src in enumerate(sources):
            src.store(f"own-{r}", ids_of[r])
            run_until([src], src.idle)
        pullers[0].step()  # rank 0 has stepped before its first pull; rank 1 has not
        for r, reader in enumerate(pullers):
            ctx = _pull(reader, addresses[r], f"dp-pull-{r}")
            t0 = time.monotonic()
            got = _until_answered(reader, [sources[r]], ctx, ids_of[r], timeout_s=30)
            took = time.monotonic() - t0
            assert got == [LookupResult.HIT] * 4, (r, got)
            c = reader.tier.counters()
            assert c["loads_ok"] == 1 and c["pull_keys_landed"] == 4, (r, c)
            if r == 1:
                assert took <= FIRST_PULL_S, f"the first pull into a rank that never stepped took {took:.2f} s"
            print(f"rank {r}: pulled 4 chunks from {addresses[r]} in {took:.3f} s")
            with reader.lock:
                reader.mgr.on_request_finished(ctx)
        for s in sources:
            s.close()
        sources = []
        seen_at = []
        for r, reader in enumerate(pullers):
            ctx = _pull(reader, addresses[r], f"dp-dead-{r}")
            got = _until_answered(reader, [], ctx, [800 + r, 810 + r], timeout_s=10)
            seen_at.append(time.monotonic())
            assert got == [LookupResult.MISS] * 2, (r, got)
            with reader.lock:
                reader.mgr.on_request_finished(ctx)
        spread = seen_at[-1] - seen_at[0]
        assert spread <= 1.0, f"the last rank saw the dead source {spread:.2f} s after the first"
        print(f"dead source refused on every rank within {spread:.3f} s of the first")
    finally:
        for e in (*pullers, *sources):
            e.close()
