"""Cost per chunk as requests grow: 64 to 65,536 chunks per request (a 1M-token prompt at 16 tokens per chunk).

    .venv-vllm034/bin/python benchmarks/scale_keys.py [--sizes 64,1024,8192,65536] [--reps 3] [--json F]

The results file (p2pworker/bench/results.py): ``benchmarks/results/scale_keys.json`` by default.

Two real ``TieringOffloadingManager`` s (vLLM's own, scheduler side, built as vLLM builds them) in this process,
each with P2PWorkerTier and its worker, on loopback with real NIXL; 4 KiB chunks (vLLM's smallest: chunks are
page-aligned).  Per request: the producer stores N chunks with ``remote_decoder`` (the cascade parks them in the
tier), the consumer looks every chunk up (promotion), steps until the load job is reported, looks them up again
(all HIT), and the bytes are checked.
Both schedulers step every ~1 ms while a request is in flight; there is no tier-poll thread here, so every ring
write happens on the scheduler thread (the 0.32 way: the costlier case).  Per size, medians over ``--reps``
warm requests (a 64-chunk request opens the session first), and per chunk:

- sched_us: scheduler-thread time inside every tier method (both engines' tiers: store, cascade, lookups,
  submit_load, polls), divided by N;
- worker_us: CPU time (user + system) of both worker processes over the request, divided by N;
- load_us: submit_load (the scheduler step that submits the one load job) -> the job reported, divided by N;
- e2e_us: first consumer lookup (HIT_PENDING) -> load job reported -> every chunk HIT, divided by N (includes
  vLLM's own manager work for 2N lookups).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pd_tier import Timed, build  # noqa: E402  (a sibling script, not a package)

from p2pworker.bench import results  # noqa: E402  (pd_tier put the repository root on sys.path)
from tests.helpers.ports import free_port  # noqa: E402

ROW = 4096


def _cpu_s(pid: int) -> float:
    """CPU time of every thread of ``pid``, in ns resolution (schedstat; /proc/<pid>/stat counts 10 ms ticks,
    more than a small request's whole cost)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended between listdir and open
    return total / 1e9


def _payloads(tag: int, n: int) -> np.ndarray:
    ids = np.arange(n, dtype=np.int64) + (tag << 32)
    out = ((ids[:, None] * 131 + np.arange(ROW)[None, :] * 7) % 251).astype(np.int8)
    out[:, :8] = ids.astype("<i8").view(np.int8).reshape(-1, 8)
    return out


class Engine:
    def __init__(self, role: str, n: int, capacity: int):
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self._end = ScheduleEndContext
        self.port = free_port()
        self.mgr = build("ours", role, self.port, ROW, capacity)
        # vLLM 0.33+ guards its manager with a lock its tier-poll thread takes too; 0.32 has neither
        self.lock = getattr(self.mgr, "lock", None) or threading.Lock()
        self.tier = self.mgr.secondary_tiers[0]
        self.timed = Timed(self.tier)
        self.view = np.asarray(self.tier._primary_kv_view)
        self.pid = self.tier.supervisor.client.proc.pid

    def step(self, new=()) -> None:
        with self.lock:
            self.mgr.on_schedule_end(self._end(new_req_ids=list(new), preempted_req_ids=[]))

    def close(self) -> None:
        del self.view
        self.mgr.shutdown()


def request(prod: Engine, cons: Engine, tag: int, n: int) -> dict:
    import hashlib

    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    rid = f"scale-{tag}"
    keys = [make_offload_key(hashlib.sha256(b"%d/%d" % (tag, i)).digest(), 0) for i in range(n)]
    data = _payloads(tag, n)
    prod.timed.take()
    cons.timed.take()
    cpu0 = _cpu_s(prod.pid) + _cpu_s(cons.pid)
    # producer: what prefill does (primary store, then the cascade parks the chunks in the tier)
    pctx = ReqContext(req_id=rid, kv_transfer_params={"remote_decoder": {"kv_request_id": rid}})
    with prod.lock:
        prod.mgr.on_new_request(pctx)
        out = prod.mgr.prepare_store(keys, pctx)
    index = {k: i for i, k in enumerate(keys)}
    prod.view[np.asarray(out.store_spec.chunk_ids)] = data[[index[k] for k in out.keys_to_store]].view(prod.view.dtype)
    with prod.lock:
        prod.mgr.complete_store(out.keys_to_store, pctx)
        prod.mgr.on_request_finished(pctx)
    prod.step([rid])
    # consumer: lookup -> promotion -> lookup until all HIT
    ctx = ReqContext(req_id=f"d-{rid}", kv_transfer_params={"remote_prefiller": {
        "kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": prod.port}})
    t0 = time.perf_counter()
    with cons.lock:
        cons.mgr.on_new_request(ctx)
    with cons.lock:
        res = [cons.mgr.lookup(k, ctx) for k in keys]  # HIT_PENDING: promotions queued
    t_submit = time.perf_counter()
    cons.step([ctx.req_id])  # submit_load: one job of n keys
    deadline = time.monotonic() + 300
    while cons.mgr._jobs:  # the load in flight: both schedulers step every ~1 ms, as engines do
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} chunks: load not reported within 300 s")
        time.sleep(0.001)
        cons.step()
        prod.step()
    load_s = time.perf_counter() - t_submit
    with cons.lock:
        res = [cons.mgr.lookup(k, ctx) for k in keys]
    e2e = time.perf_counter() - t0
    ok = all(r is LookupResult.HIT for r in res)
    if ok:
        with cons.lock:
            spec = cons.mgr.prepare_load(keys, ctx)
        ok = bool((cons.view[np.asarray(spec.chunk_ids)].view(np.int8) == data).all())
        with cons.lock:
            cons.mgr.complete_load(keys, ctx)
    with cons.lock:
        cons.mgr.on_request_finished(ctx)
    while prod.mgr._jobs or cons.mgr._jobs:  # the producer's store reports (after the consumer's release)
        prod.step()
        cons.step()
        time.sleep(0.001)
    by_method: dict[str, float] = {}
    for side, e in (("producer", prod), ("consumer", cons)):
        for name, times in e.timed.take().items():
            by_method[f"{side}.{name}"] = sum(times)
    worker = _cpu_s(prod.pid) + _cpu_s(cons.pid) - cpu0
    return {"ok": ok, "e2e_s": e2e, "load_s": load_s, "sched_s": sum(by_method.values()), "worker_cpu_s": worker,
            "sched_s_by_method": by_method}


def measure(n: int, reps: int, capacity_factor: int) -> dict:
    cap = capacity_factor * n + 128
    prod, cons = Engine("P", n, cap), Engine("D", n, cap)
    try:
        request(prod, cons, 10_000 + n, 64)  # session setup and first-contact costs stay out of the figures
        runs = [request(prod, cons, n * 100 + r, n) for r in range(reps)]
    finally:
        cons.close()
        prod.close()
    med = {k: statistics.median(r[k] for r in runs) for k in ("e2e_s", "load_s", "sched_s", "worker_cpu_s")}
    return {"chunks": n, "reps": reps, "capacity_chunks": cap, "all_ok": all(r["ok"] for r in runs), **med,
            "sched_us_per_chunk": med["sched_s"] / n * 1e6, "worker_us_per_chunk": med["worker_cpu_s"] / n * 1e6,
            "e2e_us_per_chunk": med["e2e_s"] / n * 1e6, "load_us_per_chunk": med["load_s"] / n * 1e6, "runs": runs}


def _header() -> None:
    print(f"{'chunks':>8} {'sched us/chunk':>15} {'worker us/chunk':>16} {'load us/chunk':>14} {'e2e us/chunk':>13} "
          f"{'e2e ms':>9}  ok")


def _row(r: dict) -> None:
    print(f"{r['chunks']:>8} {r['sched_us_per_chunk']:>15.2f} {r['worker_us_per_chunk']:>16.2f} "
          f"{r['load_us_per_chunk']:>14.2f} {r['e2e_us_per_chunk']:>13.2f} {r['e2e_s'] * 1e3:>9.1f}  {r['all_ok']}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,1024,8192,65536")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="the results file (default: benchmarks/results/scale_keys.json)")
    ap.add_argument("--replot", default=None, metavar="FILE", help="print this results file's figures; start nothing")
    ap.add_argument("--capacity-factor", type=int, default=0,
                    help="each engine's CPU tier holds this many requests' chunks (default reps + 2: no request "
                         "evicts another; 2: from the third request on, rows freed by eviction are reused)")
    args = ap.parse_args()
    if args.replot:
        doc = results.load(args.replot, "scale_keys")
        print(f"vLLM {doc['result']['vllm']}, {doc['date']}, {doc['revision']}")
        _header()
        for r in doc["result"]["results"]:
            _row(r)
        return
    os.environ.setdefault("P2PWORKER_SECRET", "scale-keys-bench")
    import vllm

    run = results.Run("scale_keys")
    out = {"vllm": vllm.__version__, "row_bytes": ROW, "results": []}
    _header()
    for n in (int(x) for x in args.sizes.split(",")):
        r = measure(n, args.reps, args.capacity_factor or args.reps + 2)
        out["results"].append(r)
        _row(r)
    by = {r["chunks"]: r for r in out["results"]}
    if 1024 in by and 65536 in by:
        out["ratio_65536_vs_1024"] = {k: by[65536][k] / max(by[1024][k], 1e-9) for k in
                                      ("sched_us_per_chunk", "worker_us_per_chunk", "load_us_per_chunk",
                                       "e2e_us_per_chunk")}
        print("per-chunk ratio 65,536 vs 1,024:", {k: round(v, 2) for k, v in out["ratio_65536_vs_1024"].items()})
    print(f"results: {run.save(args.json, out)}")


if __name__ == "__main__":
    main()
