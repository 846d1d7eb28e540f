"""CPU per PD request in each process: the consumer's worker, the producer's worker, and the rig driving them.

    .venv/bin/python benchmarks/request_cpu.py [--requests 2000] [--inflight 4] [--block-kib 16] [--tree DIR]

``PDRig`` (p2pworker/bench/pd.py: two workers on loopback, regions in /dev/shm, the same-host path and its lane on
one host) moves ``--requests`` requests of 64 contiguous blocks, ``--inflight`` at a time, after 50 unmeasured
ones.  CPU (user + system) from /proc/<pid>/stat over the measured requests, per request and as a share of the
wall time; with it the throughput and one-request latency.  ``--tree``: the checkout whose workers run (a git
worktree of another revision; default: this one).  One line per run: compare revisions only in alternated runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ap.parse_args()
    tree = os.path.abspath(args.tree)
    sys.path.insert(0, tree)
    # The workers the rig spawns run that tree's code too: `python -m p2pworker.cli` puts its working directory
    # first on sys.path (before PYTHONPATH), so they start in the tree.
    os.environ["PYTHONPATH"] = tree
    os.chdir(tree)
    from p2pworker.bench.pd import PDRig

    bb = args.block_kib * 1024
    with PDRig(max(4 * 64 * 2, (64 << 20) // bb), bb) as rig:
        rig.run(50, 64, inflight=args.inflight, contiguous=True, verify=False)
        pids = {"rig": os.getpid(), "consumer": rig.decode.proc.pid, "producer": rig.prefill.proc.pid}
        c0 = {k: cpu_s(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        res = rig.run(args.requests, 64, inflight=args.inflight, contiguous=True, verify=False)
        wall = time.perf_counter() - t0
        c1 = {k: cpu_s(p) for k, p in pids.items()}
    if res.failures or res.mismatches:
        print(f"failures: {res.failures[:3]}, mismatches: {res.mismatches}", file=sys.stderr)
        return 1
    n = args.requests
    cpu = " ".join(f"{k} {1e6 * (c1[k] - c0[k]) / n:.0f} us/req ({100 * (c1[k] - c0[k]) / wall:.0f} %)" for k in pids)
    print(f"{args.block_kib} KiB x 64, {args.inflight} in flight: {res.gbps:.2f} GB/s, "
          f"p50 {res.latency_ms(0.5):.3f} ms, p90 {res.latency_ms(0.9):.3f} ms; CPU {cpu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
