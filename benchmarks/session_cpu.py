"""The sans-IO hot path of one PD request, per step, in one process: real Sessions and ParkingLot, real messages.

    .venv/bin/python benchmarks/session_cpu.py [--keys 64] [--requests 3000] [--tree DIR]

``--tree``: the checkout whose p2pworker (and tests/helpers/session.py) is measured, e.g. a git worktree of
another revision (default: this one).

A handshaken consumer/producer pair (tests/helpers/session.py) runs ``--requests`` requests of ``--keys``
keys: the producer parks a store (``store``), the consumer loads (``load``), the producer answers its Fetch
(``fetch->offer``), the consumer turns the Offer into a read (``offer->post``), the read settles (``settle``) and
the producer takes the Release (``release``).  Encoding the frames is outside the timed steps, decoding inside.
Prints the median per step (µs) over all but the first 500 requests, hot: compare revisions only within one run
of alternated invocations (machines here are noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    from p2pworker.protocol import messages as m
    from tests.helpers.session import Pair

    k = args.keys
    p = Pair(a={"num_blocks": 32 * k}, b={"num_blocks": 32 * k}).handshake()
    steps = {name: [] for name in ("store", "load", "fetch->offer", "offer->post", "settle", "release")}
    pc = time.perf_counter
    for i in range(args.requests):
        req = f"r{i}"
        keys = [b"%s/%d" % (req.encode(), j) for j in range(k)]
        rows = list(range((i % 32) * k, (i % 32) * k + k))
        t0 = pc()
        p.b.lot.store(2 * i + 1, req, keys, rows)
        steps["store"].append(pc() - t0)
        p.b.lot.request_finished(req)
        t0 = pc()
        acts = p.sa.load(2 * i + 2, req, keys, rows)
        steps["load"].append(pc() - t0)
        frames = [m.encode(a.msg) for a in acts]
        t0 = pc()
        acts = [a for f in frames for a in p.sb.receive(f)]
        steps["fetch->offer"].append(pc() - t0)
        frames = [m.encode(a.msg) for a in acts]
        t0 = pc()
        acts = [a for f in frames for a in p.sa.receive(f)]
        steps["offer->post"].append(pc() - t0)
        t0 = pc()
        acts = p.sa.on_read_result(acts[0].read_id, True)
        steps["settle"].append(pc() - t0)
        frames = [m.encode(a.msg) for a in acts if hasattr(a, "msg")]
        t0 = pc()
        for f in frames:
            p.sb.receive(f)
        steps["release"].append(pc() - t0)
        p.a.reporter.take()
        p.b.reporter.take()
    total = 0.0
    for name, xs in steps.items():
        med = 1e6 * statistics.median(xs[500:])
        total += med
        print(f"{name:14s} {med:7.1f} us")
    print(f"{'total':14s} {total:7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
