"""``scripts/pd.sh start`` N times in a row: is the first request through the router served over P2P every time?

    .venv-vllmcpu032/bin/python benchmarks/pd_starts.py [--starts 10] [--json out.json]

Each round starts a fresh PD pair of `vllm serve` engines and the router exactly as the e2e suite does
(tests/helpers/e2e.py: the tiny model, vLLM's CPU backend, loopback), sends one 300-token request through the
router the moment ``pd.sh start`` returns, reads the decode engine's P2P prompt tokens for it, and stops the pair,
checking the stop was clean (no force-kill, nothing left in /dev/shm or /tmp).  A start whose first request was
recomputed (0 P2P tokens) is a failure: before the router waited for its instances, 2 of 6 starts of a 12-prompt
run lost P2P this way.

Prints one line per start (start seconds, first request's P2P tokens, stop seconds) and a JSON summary; exits 1 if
any start's first request was not served over P2P or any stop was not clean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.helpers.e2e import PD, running  # noqa: E402  (the e2e suite's own start/stop and checks)
from tests.helpers.tiny_model import build  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--json", help="write the summary here too")
    args = ap.parse_args()
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="pd-starts-") as tmp:
        model = build(os.path.join(tmp, "model"), seed=0)
        for i in range(args.starts):
            pair = PD(model, tempfile.mkdtemp(prefix=f"run{i}-", dir=tmp))
            try:
                # running() sends the first request through the router right after the start and asserts it was
                # served over P2P; on leaving, it stops the pair and asserts the stop was clean
                with running(pair):
                    pass
                ok = True
            except AssertionError as e:
                ok = False
                failures.append(f"start {i + 1}: {e}")
            s = pair.report.get("script_s", {})
            row = {"start": i + 1, "ok": ok, "start_s": s.get("start", [None])[0],
                   "first_request_p2p_tokens": (pair.report.get("first_request_p2p_tokens") or [None])[0],
                   "stop_s": s.get("stop", [None])[0]}
            rows.append(row)
            print(f"start {i + 1:2d}: {'ok  ' if ok else 'FAIL'} pd.sh start {row['start_s']} s, first request "
                  f"{row['first_request_p2p_tokens']} P2P tokens, pd.sh stop {row['stop_s']} s", flush=True)
    summary = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "starts": args.starts,
               "served_over_p2p": sum(r["ok"] for r in rows), "rows": rows, "failures": failures}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
