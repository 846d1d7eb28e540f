"""Across the wire: KV reads through the two workers vs raw NIXL, over the same veth between two emulated hosts.

    .venv/bin/python benchmarks/hosts_bench.py [--sizes-mib 1 16 64] [--reps 5] [--rounds 2] [--same-host]
                                              [--json out.json]

Two hosts as in tests/helpers/hosts/emulate.py (network namespaces joined by a veth, own PID/IPC namespaces and
/dev/shm: UCX goes over TCP on the veth; where namespaces are refused, loopback with UCX_TLS=tcp,self, and the output
says which).  Per size, alternated in ``--rounds`` blocks of ``--reps`` each: "workers" = producer stores, consumer
loads (command on the consumer's ring to its report, as tests/helpers/hosts/agent.py times it); "raw_nixl" = a READ of
the same rows by a plain NIXL agent in the consumer host's process from one in the producer host's process, whose target
side runs a progress thread (every 0.1 ms: the best a passive target can do over TCP).  256 KiB blocks.  Medians,
and workers / raw.  Root needed for the namespaces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.hosts.emulate import two_hosts  # noqa: E402

BLOCK = 256 * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passive-poll-s", type=float, default=None,
                    help="the workers' passive_poll_s (default: the worker's default, 0.001)")
    ap.add_argument("--passive-burst-s", type=float, default=None,
                    help="the workers' passive_burst_s (default: the worker's, 1.0; 0 turns the burst off)")
    ap.add_argument("--same-host", action="store_true",
                    help="after the emulated hosts, the same measurement with both hosts on this host's loopback "
                         "and UCX's own transport choice (cma), the workers kept on NIXL ([data] same_host = false: "
                         "p2pworker bench measures the same-host copy path): the same-host figures, same run")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    worker = {k: v for k, v in (("passive_poll_s", args.passive_poll_s), ("passive_burst_s", args.passive_burst_s))
              if v is not None}
    settings = {"worker": worker} if worker else None
    results = [measure(args, settings, same_host=False)]
    if args.same_host:  # workers vs raw NIXL over cma: keep the workers on NIXL
        results.append(measure(args, {**(settings or {}), "data": {"same_host": False}}, same_host=True))
    for mode, rows in results:
        print(f"hosts: {mode}; {args.rounds} rounds x {args.reps} reps, 256 KiB blocks, medians")
        print(f"{'MiB':>5} {'workers GB/s':>13} {'raw NIXL GB/s':>14} {'ratio':>6} {'workers p50 ms':>15} "
              f"{'raw p50 ms':>11}")
        for r in rows:
            print(f"{r['mib']:>5} {r['workers_gbps']:>13.2f} {r['raw_nixl_gbps']:>14.2f} {r['ratio']:>6.2f} "
                  f"{r['workers_p50_ms']:>15.2f} {r['raw_p50_ms']:>11.2f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"reps": args.reps, "rounds": args.rounds, "settings": settings,
                       "results": [{"mode": m, "rows": rows} for m, rows in results]}, f, indent=2)


def measure(args, settings: dict | None, same_host: bool) -> tuple[str, list[dict]]:
    sizes = [m * (1 << 20) // BLOCK for m in args.sizes_mib]
    blocks = 2 * max(sizes) + 8
    samples: dict[tuple[str, int], list[float]] = {}
    job = 1
    with tempfile.TemporaryDirectory() as logs, two_hosts("bench", Path(logs), blocks, BLOCK, settings,
                                                          same_host=same_host) as hosts:
        raw_a = hosts.a.call(op="raw_open", serve=True)
        hosts.b.call(op="raw_open", serve=False)
        for rnd in range(args.rounds):
            for n in sizes:
                for _ in range(args.reps):  # workers: a fresh request each time (a store is fetched once)
                    req = f"r{job}"
                    keys = [f"{req}-{i}".encode().hex() for i in range(n)]
                    hosts.a.call(op="store", job=job, request=req, keys=keys, rows=list(range(n)))
                    t0 = time.perf_counter()
                    hosts.b.call(op="load", job=job + 1, address=hosts.a.address, request=req, keys=keys,
                                 rows=list(range(blocks - n, blocks)))
                    done = hosts.b.call(op="wait", jobs=[job + 1], timeout_s=60, wait_s=70)["done"]
                    took = time.perf_counter() - t0
                    if not done.get(str(job + 1), {}).get("success"):
                        raise SystemExit(f"load {req} failed: {done}")
                    samples.setdefault(("workers", n), []).append(took)
                    job += 2
                out = hosts.b.call(op="raw_read", metadata=raw_a["metadata"], base=raw_a["base"], rows=n,
                                   dst=blocks - n, reps=args.reps, wait_s=120)
                samples.setdefault(("raw_nixl", n), []).extend(out["seconds"])
            print(f"{hosts.mode}: round {rnd + 1}/{args.rounds} done", file=sys.stderr)
        hosts.b.call(op="raw_close")
        hosts.a.call(op="raw_close")
        mode = hosts.mode
    rows = []
    for n in sizes:
        w = n * BLOCK / statistics.median(samples[("workers", n)]) / 1e9
        r = n * BLOCK / statistics.median(samples[("raw_nixl", n)]) / 1e9
        w_ms = statistics.median(samples[("workers", n)]) * 1e3
        r_ms = statistics.median(samples[("raw_nixl", n)]) * 1e3
        rows.append({"mib": n * BLOCK >> 20, "blocks": n, "workers_gbps": round(w, 3), "raw_nixl_gbps": round(r, 3),
                     "ratio": round(w / r, 3), "workers_p50_ms": round(w_ms, 2), "raw_p50_ms": round(r_ms, 2)})
    return mode, rows


if __name__ == "__main__":
    main()
