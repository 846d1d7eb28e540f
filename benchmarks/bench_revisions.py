"""`p2pworker bench --json` for two revisions side by side, alternated run by run, medians per geometry.

    .venv/bin/python benchmarks/bench_revisions.py --base ca0900d [--reps 3] [bench options, e.g. --blocks 64]

The base revision is checked out in a temporary git worktree and run with the same virtual environment
(``PYTHONPATH`` points at the tree, so its workers are that revision's code); the working tree is "head".
Prints one JSON line per geometry and revision (medians of ``workers_gbps``, ``raw_nixl_gbps``,
``latency_ms_p50``) and the ratio head / base of the workers' throughput.  Machines here are noisy: compare
only figures from one run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(tree: str, extra: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-m", "p2pworker.cli", "bench", "--json", *extra], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"bench in {tree} failed ({out.returncode}): {out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare the working tree against")
    ap.add_argument("--reps", type=int, default=3)
    args, extra = ap.parse_known_args()
    rows: dict[tuple[int, int, str, str], list[dict]] = {}  # (block bytes, blocks, data path, revision)
    with tempfile.TemporaryDirectory(prefix="p2pw-base-") as tmp:
        base = os.path.join(tmp, "tree")
        subprocess.run(["git", "worktree", "add", "--detach", "-q", base, args.base], cwd=ROOT, check=True)
        try:
            for _ in range(args.reps):
                for name, tree in (("base", base), ("head", ROOT)):
                    for r in bench(tree, extra):
                        rows.setdefault((r["block_bytes"], r["blocks"], r["data_path"], name), []).append(r)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base], cwd=ROOT, check=False)
    med = {k: {f: statistics.median(r[f] for r in rs) for f in ("workers_gbps", "raw_nixl_gbps", "latency_ms_p50")}
           for k, rs in rows.items()}
    for (bb, n, path, name), m in sorted(med.items()):
        print(json.dumps({"block_bytes": bb, "blocks": n, "data_path": path,
                          "rev": args.base if name == "base" else "working tree",
                          "runs": len(rows[(bb, n, path, name)]), **m}))
    for bb, n, path in sorted({k[:3] for k in med}):
        base_m, head_m = med.get((bb, n, path, "base")), med.get((bb, n, path, "head"))
        if base_m and head_m:  # each path on its own: same-host copies and NIXL reads differ several-fold
            print(json.dumps({"block_bytes": bb, "blocks": n, "data_path": path,
                              "workers_gbps_head_over_base": round(head_m["workers_gbps"] / base_m["workers_gbps"], 3),
                              "latency_p50_head_over_base": round(head_m["latency_ms_p50"] / base_m["latency_ms_p50"],
                                                                  3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
