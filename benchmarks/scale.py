"""One worker serving many peers: aggregate throughput, p99 job latency, memory per session.

    python benchmarks/scale.py [--peers 1,8,64] [--inflight 1000] [--seconds 10] [--blocks 4] [--block-kib 64]

A "hub" worker (the prefill side) parks every request's blocks; N consumer workers (real
``p2pworker launch`` processes, each with its own region, real NIXL) fetch them, together keeping up to
``--inflight`` requests in flight through the hub.  Per N, for ``--seconds``: requests completed,
aggregate GB/s, job latency p50/p99 (consumer LoadJob submit -> JobFinished), hub RSS with N sessions
minus its RSS before the peers connected, per session.  Peers are started once and reused: 64 workers
need ~10 GB of RAM here.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from p2pworker import api
from p2pworker.client import WorkerClient
from p2pworker.shm import KVRegion

HUB_BLOCKS = 4096


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


class Peer:
    def __init__(self, name: str, tag: str, blocks: int, block_bytes: int):
        self.region = KVRegion.create(f"{tag}_{name}", blocks, block_bytes, segment_bytes=1 << 30)
        self.client = WorkerClient(name, args=["--port", "0"])
        self.name = name
        self.free = list(range(blocks))
        self.live: dict[int, tuple[float, list[int]]] = {}

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.region.close()


@dataclass
class Window:
    """One ``--seconds`` window's tallies."""

    lat: list[float] = field(default_factory=list)
    done: int = 0
    failed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    hub_store_jobs: int = 0


class Scale:
    """The hub and the peers started so far (reused from one peer count to the next), and the ids handed out."""

    def __init__(self, a: argparse.Namespace, tag: str, hub: WorkerClient):
        self.a, self.tag, self.hub = a, tag, hub
        self.bb = a.block_kib * 1024
        self.peers: list[Peer] = []
        self.job = self.req = 0

    def grow(self, n: int, blocks_per_peer: int) -> None:
        t0 = time.monotonic()
        while len(self.peers) < n:
            if mem_available_mib() < 1536:
                raise SystemExit(f"stopping at {len(self.peers)} peers: under 1.5 GiB of memory left")
            p = Peer(f"c{len(self.peers)}", self.tag, max(blocks_per_peer, 64), self.bb)
            p.client.attach(p.region.handle, {"model": "scale"})
            self.peers.append(p)
        print(f"{n} peer(s) up in {time.monotonic() - t0:.1f} s; peer worker RSS "
              f"{rss_mib(self.peers[-1].client.proc.pid):.0f} MiB; {mem_available_mib():.0f} MiB available", flush=True)

    def submit(self, p: Peer, per_peer: int, rng: np.random.Generator, w: Window) -> None:
        """Up to ``per_peer`` of ``p``'s requests in flight: parked on the hub, fetched by ``p``."""
        blocks = self.a.blocks
        while len(p.live) < per_peer and len(p.free) >= blocks:
            self.req += 1
            name = f"s{self.req}"
            keys = [b"%s/%d" % (name.encode(), i) for i in range(blocks)]
            src = rng.choice(HUB_BLOCKS, blocks, replace=False).tolist()
            dst = [p.free.pop() for _ in range(blocks)]
            self.job += 2
            job = self.job
            t_sub = time.perf_counter()
            if not p.client.send(api.LoadJob(job, self.hub.ready.address, name, keys, dst)):
                p.free.extend(dst)  # its command ring is full: later
                return
            p.live[job] = (t_sub, dst)
            for cmd in (api.StoreJob(job - 1, name, keys, src), api.RequestFinished(name)):
                while not self.hub.send(cmd):  # the hub drains its ring quickly
                    self.hub.poll()
                    time.sleep(0.0002)
            w.hub_store_jobs += 1

    @staticmethod
    def reap(p: Peer, w: Window) -> None:
        for ev in p.client.poll():
            if isinstance(ev, api.JobFinished) and ev.job_id in p.live:
                t, dst = p.live.pop(ev.job_id)
                p.free.extend(dst)
                w.lat.append(time.perf_counter() - t)
                w.done += ev.success
                w.failed += not ev.success
                if not ev.success:
                    w.reasons[ev.reason[:80]] = w.reasons.get(ev.reason[:80], 0) + 1

    def window(self, n: int, rss_base: float) -> dict:
        """``n`` peers fetch from the hub for ``--seconds``; then every open job is waited for."""
        a = self.a
        per_peer = max(1, a.inflight // n)
        self.grow(n, per_peer * a.blocks)
        active = self.peers[:n]
        for p in active:
            p.free = list(range(p.region.num_blocks))
        w = Window()
        t_end = time.monotonic() + a.seconds
        t_start = time.monotonic()
        rng = np.random.default_rng(n)
        while time.monotonic() < t_end or any(p.live for p in active):
            submitting = time.monotonic() < t_end
            for p in active:
                if submitting:
                    self.submit(p, per_peer, rng, w)
                self.reap(p, w)
            self.hub.poll()
            if time.monotonic() > t_end + 60:
                raise RuntimeError("jobs still open 60 s after the run")
        elapsed = time.monotonic() - t_start
        time.sleep(0.5)
        lat = sorted(w.lat)
        hub_pid = self.hub.proc.pid
        return {"peers": n, "inflight": per_peer * n, "requests": w.done, "failed": w.failed,
                "GBps": round(w.done * a.blocks * self.bb / elapsed / 1e9, 3),
                "p50_ms": round(lat[len(lat) // 2] * 1e3, 2) if lat else None,
                "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, 2) if lat else None,
                "hub_rss_mib": round(rss_mib(hub_pid), 1),
                "hub_rss_per_session_kib": round((rss_mib(hub_pid) - rss_base) * 1024 / n, 1),
                "failure_reasons": w.reasons}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="1,8,64")
    ap.add_argument("--inflight", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--blocks", type=int, default=4, help="blocks per request")
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    os.environ.setdefault("P2PWORKER_SECRET", secrets.token_hex(16))
    tag = f"p2pw_scale_{os.getpid()}"
    counts = [int(x) for x in a.peers.split(",")]
    hub_region = KVRegion.create(f"{tag}_hub", HUB_BLOCKS, a.block_kib * 1024, segment_bytes=1 << 30)
    hub = WorkerClient("hub", args=["--port", "0"])
    run = Scale(a, tag, hub)
    results = []
    try:
        hub.attach(hub_region.handle, {"model": "scale"})
        time.sleep(1.0)
        rss_base = rss_mib(hub.proc.pid)
        print(f"hub up: RSS {rss_base:.0f} MiB; {a.blocks} x {a.block_kib} KiB per request", flush=True)
        for n in counts:
            row = run.window(n, rss_base)
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p in run.peers:
            p.close()
        hub.close()
        hub_region.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
