"""A stand-in for vLLM's process (importable by spawned children): owns a region and a worker, leaves a load
in flight, then waits to be killed."""

from __future__ import annotations

import os
import time


def adapter_with_load_in_flight(region_name: str, admin: str, producer: str, secret: str, q) -> None:
    from p2pworker import api
    from p2pworker.client import WorkerClient
    from p2pworker.shm import KVRegion
    from p2pworker.shm.liveness import start_time

    os.environ["P2PWORKER_SECRET"] = secret
    reg = KVRegion.create(region_name, 64, 64 * 1024)
    c = WorkerClient("orphan", args=["--port", "0", "--admin", admin])
    c.attach(reg.handle, {"model": "fault-suite"})
    c.send(api.LoadJob(1, producer, "never-parked", [b"k%d" % i for i in range(8)], list(range(8))))
    time.sleep(0.5)
    q.put((c.proc.pid, start_time(c.proc.pid), c.prefix))
    time.sleep(120)
