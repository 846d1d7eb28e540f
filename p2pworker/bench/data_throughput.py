"""Data-plane throughput, side by side in one run: raw NIXL calls, our NIXL transport, the ZMQ
fallback and memcpy, over the same geometry (both regions in /dev/shm, two processes).

    python -m p2pworker.bench.data_throughput [--block-bytes 16384 262144] [--blocks 64 512] [--reps 11]
        [--batch-mib 32] [--copy-threads 2]

``p2pworker bench`` runs the raw NIXL and memcpy contenders (contiguous rows) beside its workers.

The measuring process is the consumer: it READs a producer process's rows into its own
region (pull, as the worker does); the producer only makes progress (and serves the
fallback's reads).

Contenders per (block_bytes, blocks per transfer, row pattern):

- ``raw_nixl``: what a caller does with NIXL directly, prepared once: per-row
  descriptor lists on both sides (``prep_xfer_dlist``), then per transfer
  ``make_prepped_xfer("READ", ...)`` + ``transfer`` + ``check_xfer_state`` until DONE.
- ``p2pworker_nixl``: ``NixlTransport.read_blocks`` + ``poll`` until reported
  (runs coalesced, bounded pieces).
- ``p2pworker_zmq``: the fallback transport.
- ``p2pworker_same_host``: the same-host path (``same_host=True``): our process copies the producer's rows out
  of a read-only map of its region file (``copy_threads`` threads for pieces of >= 4 MiB), with the
  transport's bookkeeping around each piece and the producer-alive check after it.
- ``memcpy``: numpy row copy between two /dev/shm regions in one process (one thread).

Row patterns: ``contig`` (rows 0..n-1 on both sides: one run) and
``scattered`` (random distinct rows: about one run per row).
One JSON line per contender and geometry: median GB/s over ``reps`` timed
batches (each >= 32 MiB, contenders interleaved round by round), descriptors per transfer, and ``vs_raw``
(our median / raw median).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import uuid

import msgspec
import numpy as np


def raw_read(agent, local_dl, local_idx, remote_dl, remote_idx) -> None:
    """One plain NIXL READ of prepared rows, spun to completion: the baseline every benchmark compares with."""
    h = agent.make_prepped_xfer("READ", local_dl, local_idx, remote_dl, remote_idx)
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)
    agent.release_xfer_handle(h)
    if state != "DONE":
        raise RuntimeError(f"raw NIXL transfer ended {state}")


def _producer(name: str, num_blocks: int, block_bytes: int, q_out, q_in) -> None:
    """The passive side: holds the rows the consumer reads; polls so both backends make progress."""
    from p2pworker.data.nixl_transport import NixlTransport
    from p2pworker.data.zmq_transport import ZmqTransport
    from p2pworker.shm import KVRegion

    with KVRegion.create(name, num_blocks, block_bytes) as reg:
        reg.array()[:] = 0x5A
        nx = NixlTransport(reg, agent_name=f"bench-tgt-{os.getpid()}", same_host=True)  # offers its file too
        zq = ZmqTransport(reg, agent_name=f"bench-tgt-zmq-{os.getpid()}")
        q_out.put((msgspec.msgpack.encode(nx.local_info()), msgspec.msgpack.encode(zq.local_info())))
        try:
            while True:
                nx.poll()
                zq.poll()
                try:
                    q_in.get_nowait()
                    break
                except queue.Empty:
                    pass
        finally:
            zq.close()
            nx.close()


def _rows(pattern: str, n: int, num_blocks: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "contig":
        return np.arange(n), np.arange(n)
    return rng.permutation(num_blocks)[:n], rng.permutation(num_blocks)[:n]


def _transport_once(tr, lr: np.ndarray, rr: np.ndarray):
    """One read of rows ``rr`` into ``lr`` through our transport ``tr``, polled until it is reported."""
    def once():
        tid = tr.read_blocks("t", lr, rr)
        while True:
            done, failed = tr.poll()
            if failed:
                raise RuntimeError(f"transfer failed: {failed}")
            if tid in done:
                return
    return once


def _interleaved_gbps(fns: dict, nbytes: int, reps: int, batch_bytes: int) -> dict[str, float]:
    """Median GB/s per contender; each sample times a batch of >= ``batch_bytes``,
    and contenders alternate round by round so they share the machine's noise."""
    batch = max(1, batch_bytes // nbytes)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: connections, page faults, caches
        for _ in range(batch):
            fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            samples[name].append((time.perf_counter() - t0) / batch)
    return {name: nbytes / statistics.median(ts) / 1e9 for name, ts in samples.items()}


def bench_geometry(block_bytes: int, counts: list[int], reps: int, batch_bytes: int, seed: int = 0,
                   only: set[str] | None = None, patterns: tuple[str, ...] = ("contig", "scattered"),
                   copy_threads: int = 2) -> list[dict]:
    from p2pworker.data.base import PeerDataInfo, coalesce
    from p2pworker.data.nixl_transport import NixlTransport, import_nixl
    from p2pworker.data.zmq_transport import ZmqTransport
    from p2pworker.shm import KVRegion

    nixl_agent, nixl_agent_config = import_nixl()
    num_blocks = max(counts) * 2
    tag = f"p2pw_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(f"{tag}_t", num_blocks, block_bytes, q_out, q_in), daemon=True)
    proc.start()
    rows_out: list[dict] = []
    src = KVRegion.create(f"{tag}_s", num_blocks, block_bytes)  # memcpy's source only
    dst = KVRegion.create(f"{tag}_d", num_blocks, block_bytes)  # every contender reads into it
    try:
        src.array()[:] = 0x5A
        nx_raw, zq_raw = q_out.get(timeout=120)
        nx_info = msgspec.msgpack.decode(nx_raw, type=PeerDataInfo)
        zq_info = msgspec.msgpack.decode(zq_raw, type=PeerDataInfo)

        raw = nixl_agent(f"bench-raw-{os.getpid()}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        reg = raw.register_memory([(dst.address, dst.nbytes, 0, "")], "DRAM")
        remote = raw.add_remote_agent(nx_info.metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        rowlist = lambda base: [(base + i * block_bytes, block_bytes, 0) for i in range(num_blocks)]  # noqa: E731
        local_dl = raw.prep_xfer_dlist("NIXL_INIT_AGENT", rowlist(dst.address), "DRAM")
        remote_dl = raw.prep_xfer_dlist(remote, rowlist(nx_info.base_address), "DRAM")

        ours = NixlTransport(dst, agent_name=f"bench-ours-{os.getpid()}")
        ours.add_peer("t", nx_info)
        fb = ZmqTransport(dst, agent_name=f"bench-fb-{os.getpid()}")
        fb.add_peer("t", zq_info)
        same = NixlTransport(dst, agent_name=f"bench-same-{os.getpid()}", same_host=True, copy_threads=copy_threads)
        same.add_peer("t", nx_info)
        if same.path_of("t")[0] != "same_host":
            raise RuntimeError(f"the same-host path was refused: {same.path_of('t')[1]}")
        rng = np.random.default_rng(seed)
        src_arr, dst_arr = src.array(), dst.array()

        for n in counts:
            for pattern in patterns:
                lr, rr = _rows(pattern, n, num_blocks, rng)
                li, ri = lr.astype(np.int32), rr.astype(np.int32)  # outside the timed calls
                nbytes = n * block_bytes
                runs = len(coalesce(lr, rr))

                def raw_once(li=li, ri=ri):
                    raw_read(raw, local_dl, li, remote_dl, ri)

                # src_arr/dst_arr from the enclosing scope, not bound as defaults: they are deleted (del, below)
                # before the regions close, which a closure default would keep exported
                def memcpy_once(lr=lr, rr=rr, n=n, pattern=pattern):
                    if pattern == "contig":
                        dst_arr[:n] = src_arr[:n]  # noqa: F821
                    else:
                        dst_arr[lr] = src_arr[rr]  # noqa: F821

                fns = {"raw_nixl": raw_once, "p2pworker_nixl": _transport_once(ours, lr, rr),
                       "p2pworker_zmq": _transport_once(fb, lr, rr),
                       "p2pworker_same_host": _transport_once(same, lr, rr), "memcpy": memcpy_once}
                gbps = _interleaved_gbps({k: f for k, f in fns.items() if only is None or k in only},
                                         nbytes, reps, batch_bytes)
                descs = {"raw_nixl": n, "p2pworker_nixl": ours.stats.last_descriptors,
                         "p2pworker_zmq": fb.stats.last_descriptors,
                         "p2pworker_same_host": same.stats.last_descriptors, "memcpy": runs}
                results = {c: (gbps[c], descs[c]) for c in gbps}
                raw_gbps = results["raw_nixl"][0]
                for contender, (gbps, descs) in results.items():
                    rows_out.append({
                        "contender": contender,
                        "block_bytes": block_bytes,
                        "blocks": n,
                        "pattern": pattern,
                        "runs": runs,
                        "descriptors": descs,
                        "gbps_median": round(gbps, 3),
                        "vs_raw": round(gbps / raw_gbps, 3),
                    })
        del src_arr, dst_arr
        same.close()
        fb.close()
        ours.close()
        raw.release_dlist_handle(local_dl)
        raw.release_dlist_handle(remote_dl)
        raw.remove_remote_agent(remote)
        raw.deregister_memory(reg)
    finally:
        q_in.put("exit")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        src.close()
        dst.close()
    return rows_out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-bytes", type=int, nargs="+", default=[16 << 10, 256 << 10])
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--reps", type=int, default=11, help="timed samples per contender")
    ap.add_argument("--batch-mib", type=int, default=32, help="bytes moved per timed sample")
    ap.add_argument("--copy-threads", type=int, default=2, help="the same-host contender's copy_threads")
    args = ap.parse_args(argv)
    for bb in args.block_bytes:
        for row in bench_geometry(bb, args.blocks, args.reps, args.batch_mib << 20, copy_threads=args.copy_threads):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
