"""How fast an idle worker answers its first ring command: the real worker process, not an echo loop.

    .venv/bin/python benchmarks/worker_wake.py [--n 200] [--idle-ms 20,200]

Two workers (p2pworker.bench.pd.PDRig) with a session between them.  Then, ``--n`` times per idle time: leave the
consumer's worker alone for that long (it sleeps in its idle poll: up to its 50 ms tick), put one LoadJob on its
command ring and spin on the event ring until its JobFinished is there.  The LoadJob has no keys, so the session
answers at once ("bad load") without touching the peer: the figure is the wake (the ring's bell, zmq_poll
returning), taking the command, the session, and the event back, as vLLM's tier sees it.  The hot figure (no idle
time before the command) is measured in the same run for comparison, and so is the floor under any design: two
bare processes ping-ponging one byte through a pair of FIFOs (each blocked in poll(2)) after the same idle time.
Prints one JSON line per contender and idle time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import wake_latency  # benchmarks/: run as a script, its directory is on the path (spawned children too)

from p2pworker import api
from p2pworker.bench.pd import PDRig


def measure(rig: PDRig, idle_s: float, n: int) -> list[float]:
    out = []
    addr = rig.prefill.ready.address
    for _ in range(n):
        if idle_s:
            time.sleep(idle_s)
        job = rig.next_job_id()
        t0 = time.perf_counter()
        assert rig.decode.send(api.LoadJob(job, addr, "wake", [], []))
        while True:
            # wait on the event ring's bell, not a spin: a spinning adapter on a 2-core box takes the CPU the woken
            # worker needs (measured here: a spin loop made the same wake take ~3 ms)
            evs = [e for e in rig.decode.wait(0.5) if isinstance(e, api.JobFinished) and e.job_id == job]
            if evs:
                out.append(time.perf_counter() - t0)
                assert not evs[0].success and "bad load" in evs[0].reason, evs[0]
                break
    return out


def row(contender: str, idle_ms: float, xs: list[float]) -> str:
    xs = sorted(xs)
    return json.dumps({"contender": contender, "idle_ms": idle_ms, "n": len(xs),
                       "p50_us": round(statistics.median(xs) * 1e6, 1),
                       "p99_us": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e6, 1),
                       "max_us": round(xs[-1] * 1e6, 1)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--idle-ms", default="20,200", help="idle times before each command, ms (0 = hot is always run)")
    a = ap.parse_args()
    with PDRig(64, 16384) as rig:
        res = rig.run(2, 4, inflight=1, verify=True)  # the session between the two workers, up and used
        assert not res.failures and not res.mismatches, res.failures
        for idle_ms in [0.0] + [float(x) for x in a.idle_ms.split(",")]:
            n = a.n if idle_ms else 10 * a.n
            print(row("worker", idle_ms, measure(rig, idle_ms / 1e3, n)), flush=True)
            # benchmarks/wake_latency.py's FIFO pair (the ring's bell is a FIFO): p50/p99 over its samples after
            # the first sixth (its warm-up)
            bare = wake_latency.run("fifo", n, idle_ms / 1e3)
            print(json.dumps({**bare, "contender": "bare_fifo_pair", "idle_ms": idle_ms}), flush=True)
        codes = rig.close()
    assert codes == [0, 0], codes


if __name__ == "__main__":
    main()
