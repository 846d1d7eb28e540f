"""What the same-host path's handover adds to a first contact: a consumer's ``samehost.open_source`` (the checks,
the descriptors received over the producer's handover socket, the read-only map) against a producer process
serving its region's files, side by side with the bare connect + hello round trip on the same socket.

    .venv/bin/python benchmarks/handover_latency.py --n 200 --blocks 4096 --block-kib 256

Prints one JSON line: p50/p90 µs of each, and the ratio.  Run it on a quiet machine and once with a busy
neighbour (``--hog``); compare within a run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time


def _producer(name: str, blocks: int, block_bytes: int, q_out, q_in) -> None:
    from p2pworker.data import samehost
    from p2pworker.shm import KVRegion

    with KVRegion.create(name, blocks, block_bytes) as reg:
        srv = samehost.serve(reg)
        try:
            q_out.put(samehost.local_info(reg, srv))
            q_in.get()
        finally:
            srv.close()


def _hog(stop) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--hog", action="store_true", help="a busy process beside it")
    args = ap.parse_args()

    from p2pworker.data import handover, samehost
    from p2pworker.protocol.peer_info import PeerDataInfo

    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    bb = args.block_kib << 10
    prod = ctx.Process(target=_producer, args=(f"hoLat{os.getpid()}", args.blocks, bb, q_out, q_in))
    prod.start()
    stop = ctx.Event()
    hog = ctx.Process(target=_hog, args=(stop,)) if args.hog else None
    if hog is not None:
        hog.start()
    try:
        sh = q_out.get(timeout=60)
        info = PeerDataInfo("nixl", "p", 0, args.blocks, bb, same_host=sh)
        bare, full = [], []
        for _ in range(args.n):  # alternated, so both see the same machine
            t0 = time.perf_counter()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect("\0" + sh.socket)
            s.sendall(b"x" * handover.HELLO_BYTES)  # a wrong hello: the server closes at once
            s.recv(16)
            s.close()
            bare.append((time.perf_counter() - t0) * 1e6)
            t0 = time.perf_counter()
            src = samehost.open_source(True, info)
            full.append((time.perf_counter() - t0) * 1e6)
            src.close()
        out = {
            "n": args.n, "region_mib": args.blocks * bb >> 20, "hog": args.hog,
            "open_source_us_p50": round(statistics.median(full), 1), "open_source_us_p90": round(pct(full, 0.9), 1),
            "bare_roundtrip_us_p50": round(statistics.median(bare), 1),
            "bare_roundtrip_us_p90": round(pct(bare, 0.9), 1),
            "ratio_p50": round(statistics.median(full) / statistics.median(bare), 2),
        }
        print(json.dumps(out))
    finally:
        q_in.put("stop")
        prod.join(30)
        stop.set()
        if hog is not None:
            hog.join(10)


if __name__ == "__main__":
    main()
