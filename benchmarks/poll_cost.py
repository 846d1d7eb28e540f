"""What an idle P2PWorkerTier adds to vLLM's tier-poll thread (the goal: "adds nothing measurable").

    .venv-vllm033/bin/python benchmarks/poll_cost.py [--seconds 5] [--rounds 4]

One real ``TieringOffloadingManager`` (vLLM 0.33) whose only secondary tier is P2PWorkerTier with its spawned worker
(tests/helpers/vllm_engines.py's ``Engine``), nothing in flight.  vLLM's tier-poll thread (``vllm_offload_tier_poll``)
runs a round every 1 ms and calls the tier's ``get_finished_jobs``.  For ``--seconds`` at a time, alternated
``--rounds``
times, that thread calls either the tier's own ``get_finished_jobs`` or a stub returning nothing (the round's cost
to vLLM without us: its lock, its sleep, its loop); both through the same counting wrapper.  Prints, per mode, the
thread's CPU (its own CPU clock, ns resolution) as a share of a core and per call, medians over the rounds; the
difference is what our tier adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    os.environ.setdefault("P2PWORKER_SECRET", "poll-cost-bench")  # one engine, no peer: any secret will do
    from tests.helpers.ports import free_port
    from tests.helpers.vllm_engines import Engine

    eng = Engine("pollcost", free_port())
    try:
        thread = eng.mgr._tier_poll_thread
        if thread is None:
            raise SystemExit("this vLLM build runs no tier-poll thread (vLLM 0.33 does; 0.32 does not)")
        clock = time.pthread_getcpuclockid(thread.ident)
        tier = eng.tier
        real = type(tier).get_finished_jobs.__get__(tier)
        calls = [0]
        mode = {"fn": real}

        def counted():
            calls[0] += 1
            return mode["fn"]()

        tier.get_finished_jobs = counted  # the manager looks the method up on the tier each round
        time.sleep(1.0)  # warm: the worker attached, the thread running
        out: dict[str, list[tuple[float, float]]] = {"ours": [], "stub": []}
        for _ in range(a.rounds):
            for name, fn in (("ours", real), ("stub", lambda: [])):
                mode["fn"] = fn
                time.sleep(0.05)
                c0, n0, t0 = time.clock_gettime_ns(clock), calls[0], time.monotonic()
                time.sleep(a.seconds)
                c1, n1, t1 = time.clock_gettime_ns(clock), calls[0], time.monotonic()
                out[name].append(((c1 - c0) / 1e9 / (t1 - t0), (c1 - c0) / 1e3 / max(1, n1 - n0)))
        mode["fn"] = real
        res = {}
        for name, xs in out.items():
            res[name] = {"core_pct": round(100 * statistics.median(x[0] for x in xs), 3),
                         "us_per_round": round(statistics.median(x[1] for x in xs), 2),
                         "rounds_per_s": round(len(xs) and statistics.median(
                             (x[0] * 1e6 / x[1]) if x[1] else 0.0 for x in xs), 1)}
        res["ours_minus_stub_core_pct"] = round(res["ours"]["core_pct"] - res["stub"]["core_pct"], 3)
        res["ours_minus_stub_us_per_round"] = round(res["ours"]["us_per_round"] - res["stub"]["us_per_round"], 2)
        print(json.dumps(res))
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
