"""One emulated host's engine side: a KV region and a spawned worker, driven by JSON lines on stdin.

Run inside the host's namespaces by tests/helpers/hosts/emulate.py (so the region, the rings and the worker all live in
that host's private /dev/shm, and the worker binds that host's veth address).  One request per line, one answer
per line; an answer is {"ok": true, ...} or {"ok": false, "error": "..."}.

    {"op": "start", "name": N, "blocks": B, "block_bytes": S, "host": IP, "port": P, "seed": K, "settings": {...},
     "advertise": IP}   (bind host, e.g. 0.0.0.0, and the address peers are told to dial)
        -> {"ok": true, "address": "IP:PORT", "backend": "nixl", "region": PATH}   region of seeded random
           bytes (its first file at PATH), worker attached
    {"op": "store", "job": J, "request": R, "keys": [hex...], "rows": [...]}          park rows for a consumer
    {"op": "load", "job": J, "address": A, "request": R, "keys": [hex...], "rows": [...]}
    {"op": "wait", "jobs": [J...], "timeout_s": T}
        -> {"ok": true, "done": {J: {"success": b, "reason": s, "seconds": f, "nbytes": n}}, "worker_exit": C}
           (reported so far; worker_exit: the worker's exit code if it died while we waited, else null)
    {"op": "digest", "rows": [...]} -> {"ok": true, "sha256": hex}                     of those rows, in order
    {"op": "stop"} -> {"ok": true, "exit_code": C}                                     worker closed, region removed
    {"op": "status"} -> {"ok": true, "status": {...}}               the worker's `p2pworker inspect --json` status
    {"op": "decoy", "path": P, "nbytes": N} -> {"ok": true}         a file of N bytes at P in this host's /dev/shm
                                                                    (removed at stop), e.g. another host's region path

"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Callable

import numpy as np

from p2pworker import admin, api
from p2pworker.client import WorkerClient
from p2pworker.shm import KVRegion


class Agent:
    def __init__(self) -> None:
        self.region: KVRegion | None = None
        self.client: WorkerClient | None = None
        self.done: dict[int, dict] = {}
        self.decoys: list[str] = []

    def start(self, name: str, blocks: int, block_bytes: int, host: str, port: int, seed: int,
              settings: dict | None, advertise: str | None = None) -> dict:
        self.region = KVRegion.create(f"p2pw_host_{name}_{os.getpid()}", blocks, block_bytes)
        rng = np.random.default_rng(seed)
        self.region.array()[:] = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
        args = ["--host", host, "--port", str(port)] + (["--advertise-host", advertise] if advertise else [])
        if settings:
            args += ["--settings-json", json.dumps(settings)]
        self.client = WorkerClient(name, args=args)
        ready = self.client.attach(self.region.handle, {"model": "emulated-hosts"})
        return {"address": ready.address.removeprefix("tcp://"), "backend": ready.backend,
                "region": self.region.handle.segments[0].path}

    def _collect(self) -> None:
        for ev in self.client.poll():
            if isinstance(ev, api.JobFinished):
                if ev.job_id in self.done:
                    raise AssertionError(f"job {ev.job_id} reported twice")
                self.done[ev.job_id] = {"success": ev.success, "reason": ev.reason, "seconds": ev.seconds,
                                        "nbytes": ev.nbytes}

    def handle(self, req: dict) -> dict:
        op = req["op"]
        handler = self._OPS.get(op)
        if handler is None:
            raise ValueError(f"unknown op {op!r}")
        return handler(self, req)

    def _op_start(self, req: dict) -> dict:
        return self.start(req["name"], req["blocks"], req["block_bytes"], req["host"], req["port"],
                          req.get("seed", 0), req.get("settings"), req.get("advertise"))

    def _op_job(self, req: dict) -> dict:
        keys = [bytes.fromhex(k) for k in req["keys"]]
        cmd = (api.StoreJob(req["job"], req["request"], keys, req["rows"]) if req["op"] == "store" else
               api.LoadJob(req["job"], req["address"], req["request"], keys, req["rows"]))
        if not self.client.send(cmd):
            raise RuntimeError("command ring full")
        return {}

    def _op_wait(self, req: dict) -> dict:
        want, deadline = set(req["jobs"]), time.monotonic() + req["timeout_s"]
        exit_code = None
        while not want <= set(self.done) and time.monotonic() < deadline:
            self._collect()
            if not self.client.alive():  # what the tier does then: its jobs fail once, it restarts the worker
                self._collect()
                exit_code = self.client.proc.poll()
                break
            time.sleep(0.001)
        return {"done": {str(j): self.done[j] for j in want if j in self.done}, "worker_exit": exit_code}

    def _op_digest(self, req: dict) -> dict:
        arr = self.region.array()
        h = hashlib.sha256()
        for r in req["rows"]:
            h.update(arr[r].tobytes())
        return {"sha256": h.hexdigest()}

    def _op_decoy(self, req: dict) -> dict:
        fd = os.open(req["path"], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, req["nbytes"])
        finally:
            os.close(fd)
        self.decoys.append(req["path"])
        return {}

    _OPS: dict[str, Callable[["Agent", dict], dict]] = {
        "start": _op_start,
        "store": _op_job,
        "load": _op_job,
        "wait": _op_wait,
        "digest": _op_digest,
        "status": lambda self, req: {"status": admin.query(self.client.ready.admin)},
        "decoy": _op_decoy,
        "stop": lambda self, req: {"exit_code": self.close()},
    }

    def close(self) -> int | None:
        code = self.client.close() if self.client is not None else None
        self.client = None
        if self.region is not None:
            self.region.close()
            self.region = None
        for path in self.decoys:
            os.unlink(path)
        self.decoys = []
        return code


def main() -> None:
    # answers on the original stdout only: everything else that writes to fd 1 (NIXL's logs, the spawned worker,
    # which inherits it) goes to stderr instead
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    agent = Agent()
    try:
        for line in sys.stdin:
            try:
                out = {"ok": True, **agent.handle(json.loads(line))}
            except Exception as e:  # noqa: BLE001 - every failure goes back to the test as an answer
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            answers.write(json.dumps(out) + "\n")
            if json.loads(line).get("op") == "stop":
                return
    finally:
        agent.close()


if __name__ == "__main__":
    main()
