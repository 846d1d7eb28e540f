"""What a producer worker's polling costs: its CPU (share of one core) idle, and while it holds a lease with nothing
offered (a consumer's Fetch for a request not stored yet: nobody can read, so nothing to progress for).

    .venv/bin/python benchmarks/lease_cpu.py [--seconds 10] [--settings-json '{"worker": {...}}']

Two workers (`WorkerClient`) on loopback, regions in /dev/shm; CPU from /proc/<pid>/stat (user + system) over
``--seconds``.  One JSON line.  While offered rows are being read the producer polls every passive_burst_poll_s
(0.2 ms) for passive_burst_s (1 s) after each offer: that is transfer time, not idle time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pworker import api  # noqa: E402
from p2pworker.client import WorkerClient  # noqa: E402
from p2pworker.shm import KVRegion  # noqa: E402


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def share(pid: int, seconds: float) -> float:
    c0 = cpu_s(pid)
    time.sleep(seconds)
    return (cpu_s(pid) - c0) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--settings-json", default="{}")
    args = ap.parse_args()
    env = {"P2PWORKER_SECRET": "lease-cpu"}
    flags = ["--port", "0", "--settings-json", args.settings_json]
    tag = f"p2pw_leasecpu_{os.getpid()}"
    with KVRegion.create(f"{tag}_a", 16, 4096) as ra, KVRegion.create(f"{tag}_b", 16, 4096) as rb:
        a = WorkerClient("lease-a", args=flags, env=env)
        b = WorkerClient("lease-b", args=flags, env=env)
        try:
            ready = a.attach(ra.handle)
            b.attach(rb.handle)
            time.sleep(2)  # past start-up
            idle = share(a.proc.pid, args.seconds)
            # a Fetch for a request never stored: the producer holds a lease with nothing offered
            b.send(api.LoadJob(1, ready.address.removeprefix("tcp://"), "never-stored", [b"k"], [0]))
            time.sleep(1)
            leased = share(a.proc.pid, args.seconds)
            print(json.dumps({"settings": json.loads(args.settings_json), "seconds": args.seconds,
                              "producer_idle_core_share": round(idle, 4),
                              "producer_lease_nothing_offered_core_share": round(leased, 4)}))
        finally:
            a.close()
            b.close()


if __name__ == "__main__":
    main()
