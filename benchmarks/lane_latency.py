"""Same-host lane vs the control link: one PD request through two workers, and the bare transports under it.

    .venv/bin/python benchmarks/lane_latency.py [--blocks-of 16x64 256x64] [--requests 300] [--rounds 4] [--hog]

Per geometry and round, a fresh pair of workers (``p2pworker.bench.pd.PDRig``, same host, the same-host copy
path) runs ``--requests`` requests alone (submit to loaded: latency) and as many 4 in flight (throughput), once
with the lane (the default) and once with ``[data] lane = false`` (the session's messages on ZMQ), the order
flipped every round; medians over the rounds.  Before that, the bare transports the two differ by, two processes
that sleep between messages (1 ms apart): a ZMQ DEALER -> ROUTER round trip over tcp loopback (what a session's
Fetch and Offer cost on the control link) and a SOCK_SEQPACKET socket pair round trip (the lane).  Prints one
JSON line per contender.  ``--hog``: a pure-Python spin runs beside it all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {"lane": [], "control link": ["--settings-json", '{"data": {"lane": false}}']}


def _q(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(f * len(xs)))]


def _zmq_echo(port_q) -> None:
    import zmq

    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    port_q.put(port)
    p = zmq.Poller()
    p.register(r, zmq.POLLIN)
    while p.poll(5000):
        f = r.recv_multipart()
        if f[-1] == b"stop":
            break
        r.send_multipart([f[0], b"x" * 60])
    r.close(0)
    ctx.term()


def _unix_echo(sock) -> None:
    p = select.poll()
    p.register(sock, select.POLLIN)
    while p.poll(5000):
        if sock.recv(4096) == b"stop":
            break
        sock.send(b"x" * 60)


def _round_trips(send, wait, recv, n: int, what: str) -> list[float]:
    """``n`` timed round trips of a 60-byte message, 1 ms apart (the peer sleeps between them), after 50 untimed."""
    rtts = []
    for i in range(n + 50):
        t0 = time.perf_counter()
        send(b"y" * 60)
        if not wait():
            raise SystemExit(f"{what} did not answer")
        recv()
        if i >= 50:
            rtts.append(time.perf_counter() - t0)
        time.sleep(0.001)
    return rtts


def bare(n: int) -> list[dict]:
    import zmq

    out = []
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_zmq_echo, args=(q,))
    proc.start()
    zc = zmq.Context()
    d = zc.socket(zmq.DEALER)
    d.connect(f"tcp://127.0.0.1:{q.get(timeout=30)}")
    poller = zmq.Poller()
    poller.register(d, zmq.POLLIN)
    rtts = _round_trips(d.send, lambda: poller.poll(2000), d.recv, n, "zmq echo")
    d.send(b"stop")
    proc.join(10)
    d.close(0)
    zc.term()
    out.append({"contender": "bare zmq tcp round trip (1 ms apart)", "p50_us": round(_q(rtts, .5) * 1e6, 1),
                "p90_us": round(_q(rtts, .9) * 1e6, 1)})
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = ctx.Process(target=_unix_echo, args=(b,))
    proc.start()
    p = select.poll()
    p.register(a, select.POLLIN)
    rtts = _round_trips(a.send, lambda: p.poll(2000), lambda: a.recv(4096), n, "unix echo")
    a.send(b"stop")
    proc.join(10)
    a.close()
    b.close()
    out.append({"contender": "bare SOCK_SEQPACKET pair round trip (1 ms apart)", "p50_us": round(_q(rtts, .5) * 1e6, 1),
                "p90_us": round(_q(rtts, .9) * 1e6, 1)})
    return out


def _hog() -> None:
    while True:
        pass


def main() -> int:
    from p2pworker.admin import query
    from p2pworker.bench.pd import PDRig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks-of", nargs="+", default=["16x64", "256x64"], help="KiBxBLOCKS per request")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hog", action="store_true")
    args = ap.parse_args()
    hog = None
    if args.hog:
        hog = mp.get_context("spawn").Process(target=_hog, daemon=True)
        hog.start()
    try:
        for row in bare(args.requests):
            print(json.dumps(row), flush=True)
        for geo in args.blocks_of:
            kib, blocks = (int(x) for x in geo.split("x"))
            got: dict[str, dict[str, list[float]]] = {v: {"p50": [], "p90": [], "gbps": []} for v in VARIANTS}
            for r in range(args.rounds):
                order = list(VARIANTS.items()) if r % 2 == 0 else list(reversed(VARIANTS.items()))
                for name, wargs in order:
                    with PDRig(max(1024, blocks * 8), kib * 1024, worker_args=wargs) as rig:
                        rig.run(20, blocks, inflight=1, verify=True, contiguous=True)  # warm, and byte-checked
                        alone = rig.run(args.requests, blocks, inflight=1, verify=False, contiguous=True)
                        four = rig.run(args.requests, blocks, inflight=4, verify=False, contiguous=True)
                        if alone.failures or four.failures:
                            raise SystemExit(f"{name}: {(alone.failures + four.failures)[:3]}")
                        lanes = {s["lane"] for c in rig.clients for s in query(c.ready.admin)["sessions"]}
                        want = {"up"} if name == "lane" else {"control link"}
                        if lanes != want:
                            raise SystemExit(f"{name}: sessions' lanes {lanes}, expected {want}")
                        got[name]["p50"].append(alone.latency_ms(0.5))
                        got[name]["p90"].append(alone.latency_ms(0.9))
                        got[name]["gbps"].append(four.gbps)
            for name, g in got.items():
                print(json.dumps({"geometry": f"{kib} KiB x {blocks}", "messages": name, "rounds": args.rounds,
                                  "alone_p50_ms": round(statistics.median(g["p50"]), 3),
                                  "alone_p90_ms": round(statistics.median(g["p90"]), 3),
                                  "inflight4_gbps": round(statistics.median(g["gbps"]), 2),
                                  "p50_each_round": [round(x, 3) for x in g["p50"]], "hog": args.hog}), flush=True)
    finally:
        if hog is not None:
            hog.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
