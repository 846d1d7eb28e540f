"""PD transfer through vLLM's tiering manager: P2PWorkerTier (+ its worker) vs vLLM's in-tree `p2p` tier.

    .venv-vllm033/bin/python benchmarks/pd_tier.py [--reps 5] [--geometries 16384x64,16384x512,262144x64,262144x512]

Two processes per tier kind, each a real ``TieringOffloadingManager`` (built through
``OffloadingSpecFactory`` exactly as vLLM does; scheduler side only, so it runs on the CPU) whose only
secondary tier is the one under test, on loopback with real NIXL.  Both schedulers step every 1 ms.  The
producer stores N chunks for a request with ``remote_decoder`` (the cascade parks them in the tier); the
consumer, given ``remote_prefiller``, runs lookup -> promotion -> lookup until every chunk is HIT and
checks the bytes.  Reported per geometry, same run, tiers interleaved rep by rep:

- fetch: first consumer lookup -> every chunk HIT (rep 0 includes session setup: "cold"; the rest "warm");
- scheduler-thread time inside tier calls (every SecondaryTierManager method, timed by wrapping the tier
  instance; only calls on the scheduler thread count), per call p50/p99 and per request in total,
  consumer and producer side.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time

import numpy as np

TIER_METHODS = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "on_new_request",
                "on_request_finished", "serve_external_requests", "has_pending_work", "on_schedule_end", "touch",
                "take_events", "get_stats")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mk(cls, **kw):
    ok = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in kw.items() if k in ok})


def build(kind: str, name: str, port: int, row: int, num_chunks: int):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if kind == "ours":
        tier = {"type": "P2PWorkerTier", "module_path": "vllm_adapter.tier", "host": "127.0.0.1", "port": port}
    else:
        tier = {"type": "p2p", "host": "127.0.0.1", "port": port}
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * row, "eviction_policy": "lru",
             "secondary_tiers": [tier]}
    config = OffloadingConfig(
        groups=(_mk(OffloadingGroupConfig, tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=row, enable_kv_cache_events=False, extra_config=extra,
        engine_id=f"pdbench{kind}{name}{os.getpid()}",
        model=_mk(OffloadingModelConfig, name="bench", dtype="float16", max_model_len=1 << 20),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
    )
    spec = OffloadingSpecFactory.create_spec(config)
    return spec.get_manager()


class Timed:
    """Wraps a tier instance's methods; records durations of scheduler-thread calls."""

    def __init__(self, tier):
        self.calls: dict[str, list[float]] = {}
        self.off_thread_s = 0.0
        main = threading.main_thread()
        for name in TIER_METHODS:
            fn = getattr(tier, name, None)
            if fn is None:
                continue

            def wrap(*a, _fn=fn, _name=name, **kw):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    dt = time.perf_counter() - t0
                    if threading.current_thread() is main:
                        self.calls.setdefault(_name, []).append(dt)
                    else:
                        self.off_thread_s += dt

            setattr(tier, name, wrap)

    def take(self) -> dict[str, list[float]]:
        out, self.calls = self.calls, {}
        return out


def key(rid: str, i: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(hashlib.sha256(f"{rid}/{i}".encode()).digest(), 0)


def payload(rid: str, i: int, row: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{rid}/{i}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(-128, 128, row, dtype=np.int8)


def _serve(kind: str, role: str, port: int, row: int, num_chunks: int, conn) -> None:
    """One scheduler: steps every 1 ms; runs commands from the parent between steps."""
    os.environ.setdefault("P2PWORKER_SECRET", "pd-tier-bench")
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    mgr = build(kind, role, port, row, num_chunks)
    tier = mgr.secondary_tiers[0]
    timed = Timed(tier)
    view = np.asarray(tier._primary_kv_view)
    lock = getattr(mgr, "lock", None) or threading.Lock()

    def step(new=()):
        with lock:
            mgr.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=[]))

    conn.send("ready")
    try:
        while True:
            if not conn.poll(0.001):
                step()
                continue
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            if cmd[0] == "store":  # what prefill does: primary store, then the cascade parks it in the tier
                _, rid, n = cmd
                timed.take()  # from here on: the producer's tier calls for this request (store + cascade)
                ctx = ReqContext(req_id=rid, kv_transfer_params={"remote_decoder": {"kv_request_id": rid}})
                keys = [key(rid, i) for i in range(n)]
                with lock:
                    mgr.on_new_request(ctx)
                    out = mgr.prepare_store(keys, ctx)
                for k, r in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist()):
                    view[r] = payload(rid, keys.index(k), row)
                with lock:
                    mgr.complete_store(out.keys_to_store, ctx)
                    mgr.on_request_finished(ctx)
                step([rid])
                conn.send("stored")
            elif cmd[0] == "drain":  # producer: wait until the tier reported its jobs, then report its calls
                deadline = time.monotonic() + 30
                while mgr._jobs and time.monotonic() < deadline:
                    step()
                    time.sleep(0.001)
                conn.send({"calls": timed.take(), "left": len(mgr._jobs), "off_thread_s": timed.off_thread_s})
            elif cmd[0] == "fetch":
                _, rid, n, pport = cmd
                ctx = ReqContext(req_id=f"d-{rid}", kv_transfer_params={"remote_prefiller": {
                    "kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": pport}})
                keys = [key(rid, i) for i in range(n)]
                timed.take()
                t0 = time.perf_counter()
                with lock:
                    mgr.on_new_request(ctx)
                first = True
                deadline = time.monotonic() + 60
                while True:
                    with lock:
                        res = [mgr.lookup(k, ctx) for k in keys]
                    if all(r is LookupResult.HIT for r in res) or time.monotonic() > deadline:
                        break
                    if any(r is LookupResult.MISS for r in res):
                        break
                    step([ctx.req_id] if first else ())
                    first = False
                    time.sleep(0.001)
                dt = time.perf_counter() - t0
                ok = all(r is LookupResult.HIT for r in res)
                if ok:
                    with lock:
                        spec_l = mgr.prepare_load(keys, ctx)
                    rows = spec_l.chunk_ids.tolist()
                    ok = all((view[r] == payload(rid, i, row)).all() for i, r in enumerate(rows))
                    with lock:
                        mgr.complete_load(keys, ctx)
                with lock:
                    mgr.on_request_finished(ctx)
                conn.send({"s": dt, "ok": ok, "results": sorted({r.name for r in res}), "calls": timed.take(),
                           "off_thread_s": timed.off_thread_s})
    finally:
        del view
        mgr.shutdown()
        conn.send("closed")


class Pair:
    def __init__(self, kind: str, row: int, num_chunks: int):
        ctx = mp.get_context("spawn")
        self.kind = kind
        self.pport, dport = _free_port(), _free_port()
        self.p_conn, a = ctx.Pipe()
        self.d_conn, b = ctx.Pipe()
        cap = num_chunks * 2 + 8
        self.procs = [ctx.Process(target=_serve, args=(kind, "P", self.pport, row, cap, a), daemon=True),
                      ctx.Process(target=_serve, args=(kind, "D", dport, row, cap, b), daemon=True)]
        for p in self.procs:
            p.start()
        for c in (self.p_conn, self.d_conn):
            if not c.poll(180) or c.recv() != "ready":
                raise RuntimeError(f"{kind}: a scheduler did not start")

    def request(self, rid: str, n: int) -> dict:
        self.p_conn.send(("store", rid, n))
        assert self.p_conn.poll(60) and self.p_conn.recv() == "stored"
        self.d_conn.send(("fetch", rid, n, self.pport))
        assert self.d_conn.poll(120), "fetch did not finish"
        out = self.d_conn.recv()
        self.p_conn.send(("drain",))
        assert self.p_conn.poll(60)
        prod = self.p_conn.recv()
        out["producer_calls"] = prod["calls"]
        out["producer_off_thread_s"] = prod["off_thread_s"]
        return out

    def close(self) -> None:
        for c in (self.p_conn, self.d_conn):
            try:
                c.send(("quit",))
                c.poll(60) and c.recv()
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def summarize(reps: list[dict], row: int, n: int) -> dict:
    warm = reps[1:] or reps
    fetch = [r["s"] for r in warm]
    out = {"cold_ms": round(reps[0]["s"] * 1e3, 1), "warm_ms": round(statistics.median(fetch) * 1e3, 1),
           "warm_GBps": round(row * n / statistics.median(fetch) / 1e9, 3),
           "all_ok": all(r["ok"] for r in reps)}
    for side, field, off in (("consumer", "calls", "off_thread_s"),
                             ("producer", "producer_calls", "producer_off_thread_s")):
        per_call: list[float] = []
        per_req: list[float] = []
        by_name: dict[str, list[float]] = {}
        for r in warm:
            tot = 0.0
            for name, ds in r[field].items():
                if name == "has_pending_work":
                    continue  # polled every step whether the tier has work or not; reported separately
                per_call += ds
                by_name.setdefault(name, []).extend(ds)
                tot += sum(ds)
            per_req.append(tot)
        out[side] = {"per_call_p50_us": round(_pct(per_call, 0.5) * 1e6, 1),
                     "per_call_p99_us": round(_pct(per_call, 0.99) * 1e6, 1),
                     "per_request_ms": round(statistics.median(per_req) * 1e3, 3),
                     "calls_per_request": round(len(per_call) / max(1, len(warm)), 1),
                     # 0.33's tier-poll thread (tolerates_off_thread_polling) holds the manager lock too
                     "off_thread_ms_whole_run": round(reps[-1][off] * 1e3, 3),
                     "by_method_us": {k: {"n": len(v), "p50": round(_pct(v, 0.5) * 1e6, 1),
                                          "p99": round(_pct(v, 0.99) * 1e6, 1), "max": round(max(v) * 1e6, 1)}
                                      for k, v in sorted(by_name.items())}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="requests per geometry and tier (the first one is cold)")
    ap.add_argument("--geometries", default="16384x64,16384x512,262144x64,262144x512", help="ROW_BYTESxCHUNKS,...")
    ap.add_argument("--tiers", default="ours,intree")
    ap.add_argument("--json", metavar="FILE", help="also write every figure (per method) to FILE")
    a = ap.parse_args()
    import vllm

    results = {"vllm": vllm.__version__, "geometries": {}}
    for geo in a.geometries.split(","):
        row, n = (int(x) for x in geo.split("x"))
        pairs = {k: Pair(k, row, n) for k in a.tiers.split(",")}
        reps: dict[str, list[dict]] = {k: [] for k in pairs}
        try:
            for i in range(a.reps):  # interleaved: the machine's noise hits both tiers alike
                for k, pair in pairs.items():
                    reps[k].append(pair.request(f"r{i}-{k}-{geo}", n))
        finally:
            for pair in pairs.values():
                pair.close()
        g = {k: summarize(v, row, n) for k, v in reps.items()}
        if "ours" in g and "intree" in g:
            g["ratios"] = {
                "throughput_ours_over_intree": round(g["ours"]["warm_GBps"] / g["intree"]["warm_GBps"], 2),
                "consumer_sched_time_intree_over_ours": round(
                    g["intree"]["consumer"]["per_request_ms"] / max(1e-9, g["ours"]["consumer"]["per_request_ms"]), 1),
                "producer_sched_time_intree_over_ours": round(
                    g["intree"]["producer"]["per_request_ms"] / max(1e-9, g["ours"]["producer"]["per_request_ms"]), 1),
            }
        results["geometries"][f"{row // 1024} KiB x {n}"] = g
        print(f"== {row // 1024} KiB x {n} chunks ({row * n / 2**20:.0f} MiB), vLLM {vllm.__version__}", flush=True)
        for k in pairs:
            s = g[k]
            print(f"  {k:7s} cold {s['cold_ms']:7.1f} ms  warm {s['warm_ms']:7.1f} ms ({s['warm_GBps']:.2f} GB/s)"
                  f"  ok={s['all_ok']}  | consumer sched {s['consumer']['per_request_ms']:.3f} ms/req "
                  f"(p50 {s['consumer']['per_call_p50_us']} / p99 {s['consumer']['per_call_p99_us']} us/call, "
                  f"{s['consumer']['calls_per_request']} calls) | producer sched "
                  f"{s['producer']['per_request_ms']:.3f} ms/req (p50 {s['producer']['per_call_p50_us']} / "
                  f"p99 {s['producer']['per_call_p99_us']} us/call)", flush=True)
        if "ratios" in g:
            print(f"  ratios: {g['ratios']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
