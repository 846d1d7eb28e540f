"""glibc's default memmove against streaming (non-temporal) stores, as the worker now runs (p2pworker.copytune).

    .venv/bin/python benchmarks/stream_copy.py [--pairs 6] [--mib 128] [--reps 5]

Each pair: one child process with glibc's default threshold, one with the worker's (``GLIBC_TUNABLES``), in turn;
each copies ``--mib`` MiB between two mapped /dev/shm files in 1 MiB and 8 MiB ``ctypes.memmove`` calls (the
same-host copy's chunk and piece), ``--reps`` times, and reports its median GB/s per call size.  The tunable is
read at process start, so the two cannot share a process; machines here are noisy, so read the pairs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
CALLS = (1 * MiB, 8 * MiB)


def child(mib: int, reps: int) -> dict:
    import numpy as np

    n = mib * MiB
    paths = [f"/dev/shm/p2pw-stream-{os.getpid()}-{i}" for i in (0, 1)]
    maps = []
    try:
        for p in paths:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, n)
                maps.append(mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0x8000)))
            finally:
                os.close(fd)
        maps[0].write(os.urandom(MiB) * mib)
        src, dst = (np.frombuffer(m, dtype=np.uint8).ctypes.data for m in maps)
        out = {}
        for call in CALLS:
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                for off in range(0, n, call):
                    ctypes.memmove(dst + off, src + off, call)
                times.append(time.perf_counter() - t)
            out[f"{call // MiB}MiB_gbps"] = round(n / statistics.median(times) / 1e9, 2)
        return out
    finally:
        for m in maps:
            m.close()
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.mib, a.reps)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from p2pworker import copytune

    if not copytune.applies():
        raise SystemExit("not x86-64 glibc: the worker sets nothing here")
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", copytune.REEXEC_MARK)}
    arms = {"glibc_default": base, "streaming": copytune.worker_env(base)}
    rows: dict[str, list[dict]] = {k: [] for k in arms}
    for i in range(a.pairs):
        for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            res = subprocess.run([sys.executable, __file__, "--child", "--mib", str(a.mib), "--reps", str(a.reps)],
                                 env=arms[arm], capture_output=True, text=True, timeout=300, check=True)
            rows[arm].append(json.loads(res.stdout))
        print(json.dumps({"pair": i, **{arm: rows[arm][-1] for arm in arms}}))
    for key in rows["glibc_default"][0]:
        d = [r[key] for r in rows["glibc_default"]]
        s = [r[key] for r in rows["streaming"]]
        print(json.dumps({"calls": key, "glibc_default_median": statistics.median(d),
                          "streaming_median": statistics.median(s),
                          "paired_ratio_median": round(statistics.median(b / a_ for a_, b in zip(d, s)), 2),
                          "pairs_faster": sum(b > a_ for a_, b in zip(d, s)), "pairs": len(d)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
