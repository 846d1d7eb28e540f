"""What the fault suite (tests/fault) drives: real workers (``p2pworker launch``) on loopback, each with its own KV
region, through their rings as the vLLM adapter would (:class:`Node`, :class:`Jobs`, :func:`park`, :func:`load`,
:func:`pd`); process probes (RSS, file descriptors); the measured figures for docs/reliability.md; a stand-in NIXL
whose registration fails."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np

from p2pworker import api
from p2pworker.client import WorkerClient
from p2pworker.shm import KVRegion

SECRET = "fault-suite"
BLOCKS, BLOCK_BYTES = 256, 256 * 1024  # 64 MiB regions


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field}")


def rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmRSS")


def rss_anon_kib(pid: int) -> int:
    """Anonymous resident memory (heap, stacks): what a leak grows.  VmRSS also counts the shared-memory rings'
    and region's pages as they are first touched, and library pages as they are first run."""
    return _status_kib(pid, "RssAnon")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Node:
    """One worker with its region (random bytes), as an engine's adapter would own them."""

    def __init__(self, name: str, prefix: str, tmp, *, port: int = 0, identity: dict | None = None,
                 block_bytes: int = BLOCK_BYTES, args: list[str] | None = None, seed: int = 0,
                 data_path: str = "same_host"):
        self.name, self.prefix, self.tmp, self.port = name, prefix, tmp, port
        self.data_path = data_path  # what its sessions must use: both workers of a test run on this host
        self.path_checked = False
        self.identity = identity or {"model": "fault-suite"}
        self.block_bytes = block_bytes
        self.region = KVRegion.create(f"{prefix}{name}", BLOCKS, block_bytes, segment_bytes=1 << 30)
        self.region.array()[:] = np.random.default_rng(seed).integers(0, 256, size=(BLOCKS, block_bytes),
                                                                      dtype=np.uint8)
        self.args = list(args or [])
        if data_path == "nixl":  # off the same-host copy path: NIXL even on one host
            self.args += ["--settings-json", json.dumps({"data": {"same_host": False}})]
        self.client: WorkerClient | None = None
        self.start()

    def check_data_path(self, require: bool = True) -> None:
        """Every session of this node that has a data path uses the one the test asked for; with ``require``,
        there is at least one (a session is up: call it right after a load went through).  A link the peer dialed
        and that we never read from has none yet ("undecided")."""
        sessions = [s for s in self.status()["sessions"] if s.get("data_path") not in (None, "", "undecided")]
        paths = {s["data_path"] for s in sessions}
        want = self.data_path if self.data_path == "same_host" else "nixl"
        assert paths == {want} if require else paths <= {want}, \
            f"{self.name}: sessions use {paths or 'nothing'}, the test runs on {want}: " \
            f"{[(s['link'], s['data_path'], s.get('data_path_why')) for s in sessions]}"

    def start(self) -> None:
        self.admin = str(self.tmp / f"{self.name}-{time.monotonic_ns()}.admin")
        self.client = WorkerClient(self.name, args=["--port", str(self.port), *self.args, "--admin", self.admin],
                                   env={"P2PWORKER_SECRET": SECRET})
        self.client.attach(self.region.handle, self.identity)
        if self.port == 0:
            self.port = int(self.client.ready.address.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self.client.proc.pid

    @property
    def address(self) -> str:
        return self.client.ready.address.removeprefix("tcp://")

    def status(self) -> dict:
        from p2pworker.admin import query

        return query(self.admin)

    def kill(self, sig=signal.SIGKILL) -> None:
        os.kill(self.pid, sig)

    def close(self) -> int | None:
        if self.client is None:
            return None
        c, self.client = self.client, None
        return c.close()


class Jobs:
    """Job ids, and the exactly-once bookkeeping of what each worker reported."""

    def __init__(self):
        self.next = 0
        self.reported: dict[int, api.JobFinished] = {}

    def new(self) -> int:
        self.next += 1
        return self.next

    def collect(self, node: Node, want: set[int], timeout_s: float) -> dict[int, api.JobFinished]:
        deadline = time.monotonic() + timeout_s
        got = {}
        while not want <= set(self.reported):
            for ev in node.client.poll():
                if isinstance(ev, api.JobFinished):
                    assert ev.job_id not in self.reported, f"job {ev.job_id} reported twice"
                    self.reported[ev.job_id] = ev
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs {sorted(want - set(self.reported))} not reported within {timeout_s} s")
            time.sleep(0.001)
        for j in want:
            got[j] = self.reported[j]
        return got


def park(prod: Node, jobs: Jobs, req: str, keys: list[bytes], rows: list[int], finished: bool = True) -> int:
    j = jobs.new()
    assert prod.client.send(api.StoreJob(j, req, keys, rows))
    if finished:
        assert prod.client.send(api.RequestFinished(req))
    return j


def load(cons: Node, prod_address: str, jobs: Jobs, req: str, keys: list[bytes], rows: list[int]) -> int:
    j = jobs.new()
    assert cons.client.send(api.LoadJob(j, prod_address, req, keys, rows))
    return j


def keys_for(req: str, n: int) -> list[bytes]:
    return [f"{req}/{i}".encode() for i in range(n)]


def pd(prod: Node, cons: Node, jobs: Jobs, req: str, n: int = 16, timeout_s: float = 30.0, verify: bool = True):
    """One whole PD request prod -> cons; returns (load report, store report)."""
    rng = np.random.default_rng(abs(hash(req)) % (1 << 32))
    src, dst = rng.permutation(BLOCKS)[:n].tolist(), rng.permutation(BLOCKS)[:n].tolist()
    keys = keys_for(req, n)
    sj = park(prod, jobs, req, keys, src)
    lj = load(cons, prod.address, jobs, req, keys, dst)
    ld = jobs.collect(cons, {lj}, timeout_s)[lj]
    if ld.success and not cons.path_checked:  # once per node: an admin query
        cons.path_checked = True
        cons.check_data_path()
    if not ld.success:
        return ld, None  # the parked store is reported park_timeout_s after its request ends (or at shutdown)
    st = jobs.collect(prod, {sj}, timeout_s)[sj]
    if verify:
        assert (cons.region.array()[dst] == prod.region.array()[src]).all(), "bytes differ"
    return ld, st


def figure(figures, promise: str, measured: str, bound: str) -> None:
    figures.append({"promise": promise, "measured": measured, "bound": bound})
    print(f"\nFIGURE {promise}: {measured} (bound {bound})")


FAKE_NIXL = '''
class nixl_agent_config:
    def __init__(self, *a, **kw):
        pass


class nixl_agent:
    def __init__(self, name, config=None):
        self.backends = {"UCX": object()}

    def get_plugin_list(self):
        return ["UCX"]

    def register_memory(self, *a, **kw):
        raise RuntimeError("NIXL_ERR_BACKEND: ucp_mem_map failed: Cannot allocate memory (RLIMIT_MEMLOCK)")
'''


def fake_nixl(tmp_path) -> str:
    pkg = tmp_path / "fakenixl" / "nixl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_api.py").write_text(FAKE_NIXL)
    return str(pkg.parent)
