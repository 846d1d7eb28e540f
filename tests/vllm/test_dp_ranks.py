"""An engine with two data-parallel ranks, each rank a real TieringOffloadingManager built with its own rank's
parallel config (as vLLM builds each DP rank's engine core), so each rank's tier spawns its own worker on the
control port base + rank.  (Each DP rank is an engine core of its own, and what our tier sees of it is this; a real
`vllm serve --data-parallel-size 2` on vLLM's CPU backend runs in tests/e2e/test_dp_engine.py.)

- Each puller rank pulls from the source rank of its index, on port + rank; the puller's second rank
  takes its first step with that pull (it never stepped before) and is served within the idle-source bound (1 s).
- The source's workers die (SIGKILL) holding what the next pulls ask for: every puller rank recomputes (MISS) within
  1 s, and within 1 s of the first, each on its own: the dead process's kernel closes its connections, and a rank
  sees that at once whether its session moved to a same-host lane or runs on the control link alone.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.ports import free_port_run
from tests.helpers.vllm_engines import Engine, LookupResult, pull, run_until, until_answered

pytestmark = pytest.mark.timeout(240)

RANKS = 2
FIRST_PULL_S = 1.0  # the first pull into a rank that never stepped: the idle-source bound (vLLM's in-tree tier: 10.4 s)
DEAD_SEEN_S = 1.0  # a killed source's closed connections, seen by a rank (a loop turn) and answered MISS, with slack
RANKS_APART_S = 1.0  # every rank refuses the dead source within this of the first


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


def test_each_rank_pulls_and_serves_on_its_port_and_a_dead_source_is_refused_on_every_rank():
    # no tier-poll thread on the source: unstepped, its tiers supervise nothing, so a killed worker stays dead
    sources = _engines("dpsrc", engine_extra={"tier_poll_interval_s": 0})
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
            ctx = pull(reader, addresses[r], f"dp-pull-{r}")
            t0 = time.monotonic()
            got = until_answered(reader, [sources[r]], ctx, ids_of[r], timeout_s=30)
            took = time.monotonic() - t0
            assert got == [LookupResult.HIT] * 4, (r, got)
            c = reader.tier.counters()
            assert c["loads_ok"] == 1 and c["pull_keys_landed"] == 4, (r, c)
            if r == 1:
                assert took <= FIRST_PULL_S, f"the first pull into a rank that never stepped took {took:.2f} s"
            print(f"rank {r}: pulled 4 chunks from {addresses[r]} in {took:.3f} s")
            with reader.lock:
                reader.mgr.on_request_finished(ctx)
        # the source's workers die (SIGKILL: no bye) while they hold what the next pulls ask for
        dead_ids = [[800 + 10 * r, 801 + 10 * r] for r in range(RANKS)]
        for r, src in enumerate(sources):
            src.store(f"own-dead-{r}", dead_ids[r])
            run_until([src], src.idle)
        for src in sources:
            os.kill(src.tier.supervisor.client.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        ctxs = [pull(reader, addresses[r], f"dp-dead-{r}") for r, reader in enumerate(pullers)]
        seen_at = []
        for r, reader in enumerate(pullers):  # the source engines take no step: their tiers restart nothing
            got = until_answered(reader, [], ctxs[r], dead_ids[r], timeout_s=10)
            seen_at.append(time.monotonic())
            assert got == [LookupResult.MISS] * 2, (r, got)
            assert reader.tier.counters()["pull_keys_landed"] == 4, "a dead source's keys landed"
            with reader.lock:
                reader.mgr.on_request_finished(ctxs[r])
        # each rank learns on its own (its own worker, its own links), at once: the killed workers' kernel closed
        # every connection (lane and control link alike), so no rank waits for a heartbeat's silence
        late = [round(t - t0, 3) for t in seen_at]
        assert max(late) <= DEAD_SEEN_S, f"ranks recomputed after {late} s"
        assert seen_at[-1] - seen_at[0] <= RANKS_APART_S, f"ranks recomputed after {late} s"
        print(f"dead source: the ranks recomputed after {late} s (spread {seen_at[-1] - seen_at[0]:.3f} s)")
    finally:
        for e in (*pullers, *sources):
            e.close()
