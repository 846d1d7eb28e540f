"""A prefill/decode rig without vLLM: two KV regions in /dev/shm, two workers on loopback, PD requests.

The "prefill" side stores each request's blocks (StoreJob: they park in its
worker); the "decode" side loads them into rows it grants (LoadJob: its
worker fetches: the prefill worker offers the leased rows and the decode
worker reads them with the data transport).  Used by
``p2pworker demo`` (verifies every byte) and ``p2pworker bench``.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from p2pworker import api
from p2pworker.client import WorkerClient
from p2pworker.errors import P2PError
from p2pworker.shm import KVRegion


@dataclass
class PDResult:
    requests: int
    blocks_per_request: int
    block_bytes: int
    bytes_moved: int
    seconds: float
    latencies_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    mismatches: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds else 0.0

    def latency_ms(self, q: float) -> float:
        xs = sorted(self.latencies_s)
        return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class PDRig:
    def __init__(self, num_blocks: int, block_bytes: int, *, backend: str = "auto", seed: int = 0,
                 worker_args: list[str] | None = None, stderr=None):
        os.environ.setdefault("P2PWORKER_SECRET", secrets.token_hex(16))  # both workers are ours
        tag = f"p2pw_pd_{os.getpid()}_{secrets.token_hex(3)}"
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.rng = np.random.default_rng(seed)
        self.regions: list[KVRegion] = []
        self.clients: list[WorkerClient] = []
        try:
            self.prefill_region = self._region(f"{tag}_prefill")
            self.decode_region = self._region(f"{tag}_decode")
            args = ["--port", "0", "--backend", backend] + (worker_args or [])
            self.prefill = self._client("prefill", args, stderr)
            self.decode = self._client("decode", args, stderr)
            self.prefill.attach(self.prefill_region.handle, {"model": "p2pworker-demo"})
            self.decode.attach(self.decode_region.handle, {"model": "p2pworker-demo"})
        except BaseException:
            self.close()
            raise
        self.prefill_region.array()[:] = self.rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
        self._job = 0
        self._req = 0

    def next_job_id(self) -> int:
        """A job id no job of this rig used yet (ids are unique per worker pair: the adapter's rule)."""
        self._job += 1
        return self._job

    def _region(self, name: str) -> KVRegion:
        reg = KVRegion.create(name, self.num_blocks, self.block_bytes, segment_bytes=1 << 30)
        self.regions.append(reg)
        return reg

    def _client(self, name: str, args: list[str], stderr) -> WorkerClient:
        c = WorkerClient(name, args=args, stderr=stderr)
        self.clients.append(c)
        return c

    @property
    def backend(self) -> str:
        return self.prefill.ready.backend if self.prefill.ready else "?"

    def run(self, requests: int, blocks: int, *, inflight: int = 4, verify: bool = True, contiguous: bool = False,
            progress: Callable[[int], None] | None = None, timeout_s: float = 120.0) -> PDResult:
        """Move ``requests`` requests of ``blocks`` blocks prefill -> decode, ``inflight`` at a time.

        Rows are random on both sides (one run per row), or with ``contiguous``
        one run per request on both sides (the geometry raw NIXL is measured on).
        """
        if blocks * inflight > self.num_blocks:
            raise P2PError(f"{blocks} blocks x {inflight} in flight exceed the {self.num_blocks}-block regions")
        res = PDResult(requests, blocks, self.block_bytes, 0, 0.0)
        src_all, dst_all = self.prefill_region.array(), self.decode_region.array()
        free = np.ones(self.num_blocks, dtype=bool)  # decode rows not granted to a live request
        live: dict[int, tuple] = {}  # load job -> (store job, src rows, dst rows, t0)
        stores: dict[int, bool] = {}
        submitted = 0
        t_start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while submitted < requests or live:
            while submitted < requests and len(live) < inflight:
                lj, flight = self._submit(blocks, contiguous, free)
                live[lj] = flight
                stores[flight[0]] = False
                submitted += 1
            self._poll_stores(stores, res)
            for ev in self.decode.wait(0.002):
                if not isinstance(ev, api.JobFinished) or ev.job_id not in live:
                    continue
                self._loaded(ev, live.pop(ev.job_id), res, free, verify, src_all, dst_all)
                if progress:
                    progress(1)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(live)} requests still in flight after {timeout_s} s")
            if not (self.prefill.alive() and self.decode.alive()):
                raise P2PError("a worker died")
        res.seconds = time.perf_counter() - t_start
        wait_until = time.monotonic() + 10
        while not all(stores.values()) and time.monotonic() < wait_until:
            self._poll_stores(stores)
            time.sleep(0.001)
        missing = [j for j, done in stores.items() if not done]
        if missing:
            res.failures.append(f"store jobs never reported: {missing[:5]}")
        del src_all, dst_all
        return res

    def _rows(self, blocks: int, contiguous: bool, free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One request's prefill rows and the free decode rows granted to it."""
        if contiguous:
            start = int(self.rng.integers(self.num_blocks // blocks)) * blocks
            slot = next(i for i in range(0, self.num_blocks - blocks + 1, blocks) if free[i:i + blocks].all())
            return np.arange(start, start + blocks), np.arange(slot, slot + blocks)
        src_rows = self.rng.choice(self.num_blocks, blocks, replace=False)
        return src_rows, self.rng.choice(np.flatnonzero(free), blocks, replace=False)

    def _submit(self, blocks: int, contiguous: bool, free: np.ndarray) -> tuple[int, tuple]:
        """One request: its blocks stored on prefill, loaded by decode.  (load job, (store job, src rows, dst rows,
        t0))."""
        self._req += 1
        req = f"demo-{self._req}"
        src_rows, dst_rows = self._rows(blocks, contiguous, free)
        free[dst_rows] = False
        keys = [b"%s/%d" % (req.encode(), i) for i in range(blocks)]
        sj, lj = self.next_job_id(), self.next_job_id()
        if not self.prefill.send(api.StoreJob(sj, req, keys, src_rows.tolist())) or \
           not self.prefill.send(api.RequestFinished(req)):
            raise P2PError("prefill command ring full")
        t0 = time.perf_counter()
        if not self.decode.send(api.LoadJob(lj, self.prefill.ready.address, req, keys, dst_rows.tolist())):
            raise P2PError("decode command ring full")
        return lj, (sj, src_rows, dst_rows, t0)

    def _poll_stores(self, stores: dict[int, bool], res: PDResult | None = None) -> None:
        """Prefill's reports: each store job seen done; a failed one counted in ``res`` (when given)."""
        for ev in self.prefill.poll():
            if isinstance(ev, api.JobFinished):
                stores[ev.job_id] = True
                if res is not None and not ev.success:
                    res.failures.append(f"store {ev.job_id}: {ev.reason}")

    @staticmethod
    def _loaded(ev: api.JobFinished, flight: tuple, res: PDResult, free: np.ndarray, verify: bool,
                src_all: np.ndarray, dst_all: np.ndarray) -> None:
        """A load job's report: its latency, its bytes (compared with ``verify``), its decode rows free again."""
        _, src_rows, dst_rows, t0 = flight
        res.latencies_s.append(time.perf_counter() - t0)
        if not ev.success:
            res.failures.append(f"load {ev.job_id}: {ev.reason}")
        else:
            res.bytes_moved += ev.nbytes
            if verify and not np.array_equal(dst_all[dst_rows], src_all[src_rows]):
                res.mismatches += 1
        free[dst_rows] = True

    def close(self) -> list[int | None]:
        codes = [c.close() for c in self.clients]
        for reg in self.regions:
            reg.close()
        self.clients, self.regions = [], []
        return codes

    def __enter__(self) -> "PDRig":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
