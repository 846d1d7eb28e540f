#!/usr/bin/env python3
"""Why the ring's bell is a FIFO: wake-up round trip, POSIX semaphore vs FIFO, side by side.

Two processes ping-pong through a pair of wake-up primitives; the waiter is
asleep (not spinning).  ``--gap-ms`` idles before every ping so the waiter is
cold.  One JSON line per (primitive, gap):

    python benchmarks/wake_latency.py [-n 600] [--gap-ms 0 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import tempfile
import time
import uuid

import posix_ipc


def _sem_echo(a: str, b: str, n: int) -> None:
    sa, sb = posix_ipc.Semaphore(a), posix_ipc.Semaphore(b)
    for _ in range(n):
        sa.acquire(10)
        sb.release()


def _fifo_echo(pa: str, pb: str, n: int) -> None:
    fa = os.open(pa, os.O_RDWR | os.O_NONBLOCK)
    fb = os.open(pb, os.O_RDWR | os.O_NONBLOCK)
    poller = select.poll()
    poller.register(fa, select.POLLIN)
    for _ in range(n):
        poller.poll(10_000)
        os.read(fa, 64)
        os.write(fb, b"x")


def run(kind: str, n: int, gap_s: float) -> dict:
    ctx = mp.get_context("spawn")
    samples = []
    tag = uuid.uuid4().hex[:8]
    if kind == "posix_semaphore":
        a = posix_ipc.Semaphore(f"/p2pw_wake_{tag}_a", posix_ipc.O_CREX)
        b = posix_ipc.Semaphore(f"/p2pw_wake_{tag}_b", posix_ipc.O_CREX)
        try:
            proc = ctx.Process(target=_sem_echo, args=(a.name, b.name, n))
            proc.start()
            for _ in range(n):
                time.sleep(gap_s)
                t0 = time.perf_counter_ns()
                a.release()
                b.acquire(10)
                samples.append(time.perf_counter_ns() - t0)
            proc.join(10)
        finally:
            a.unlink()
            b.unlink()
    else:
        with tempfile.TemporaryDirectory(prefix="p2pw_wake_") as d:
            pa, pb = f"{d}/a", f"{d}/b"
            os.mkfifo(pa)
            os.mkfifo(pb)
            fa = os.open(pa, os.O_RDWR | os.O_NONBLOCK)
            fb = os.open(pb, os.O_RDWR | os.O_NONBLOCK)
            poller = select.poll()
            poller.register(fb, select.POLLIN)
            proc = ctx.Process(target=_fifo_echo, args=(pa, pb, n))
            proc.start()
            for _ in range(n):
                time.sleep(gap_s)
                t0 = time.perf_counter_ns()
                os.write(fa, b"x")
                poller.poll(10_000)
                os.read(fb, 64)
                samples.append(time.perf_counter_ns() - t0)
            proc.join(10)
            os.close(fa)
            os.close(fb)
    us = sorted(s / 1000 for s in samples[n // 6 :])
    return {
        "contender": kind,
        "gap_ms": gap_s * 1000,
        "n": len(us),
        "p50_us": round(us[len(us) // 2], 1),
        "p99_us": round(us[int(len(us) * 0.99)], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=600)
    ap.add_argument("--gap-ms", type=float, nargs="+", default=[0.0, 2.0])
    args = ap.parse_args()
    for gap in args.gap_ms:
        for kind in ("posix_semaphore", "fifo"):
            print(json.dumps(run(kind, args.n, gap / 1000)), flush=True)


if __name__ == "__main__":
    main()
