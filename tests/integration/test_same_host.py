"""The same-host copy path between two real workers: taken when the handshake proves the consumer sees
the producer's region file and process, refused (and NIXL used, with the same bytes) when it does not: a consumer
in its own mount namespace with a private /dev/shm (a container), even one holding a file at the producer's very
path; and never taken when turned off.  ``p2pworker inspect`` (the worker's status) says which path each session
uses and why not the other."""

from __future__ import annotations

import time

import pytest

from tests.helpers.hosts.emulate import PRIVATE_PID, PRIVATE_SHM, two_hosts

pytestmark = pytest.mark.timeout(180)

BLOCK = 256 * 1024


def keys(req: str, n: int) -> list[str]:
    return [f"{req}-{i:05d}".encode().hex() for i in range(n)]


def transfer(hosts, req: str, src_rows: list[int], dst_rows: list[int], job: int) -> dict:
    ks = keys(req, len(src_rows))
    hosts.a.call(op="store", job=job, request=req, keys=ks, rows=src_rows)
    hosts.b.call(op="load", job=job + 1, address=hosts.a.address, request=req, keys=ks, rows=dst_rows)
    done = hosts.b.call(op="wait", jobs=[job + 1], timeout_s=60, wait_s=70)["done"]
    assert str(job + 1) in done, f"load of {req} not reported"
    return done[str(job + 1)]


def same_bytes(hosts, src_rows, dst_rows) -> bool:
    return hosts.a.call(op="digest", rows=src_rows)["sha256"] == hosts.b.call(op="digest", rows=dst_rows)["sha256"]


def paths(host) -> set[tuple[str, str]]:
    """(data_path, why not same_host) of the host's active sessions."""
    st = host.call(op="status")["status"]
    return {(s["data_path"], s["data_path_why"]) for s in st["sessions"] if s["state"] == "active"}


def lanes(host) -> list[str]:
    """Where each active session's messages go: "up" (its same-host lane), "dialing" or "control link"."""
    st = host.call(op="status")["status"]
    return sorted(s["lane"] for s in st["sessions"] if s["state"] == "active")


def move_and_check(hosts) -> None:
    assert not same_bytes(hosts, list(range(64)), list(range(256, 320))), "regions start equal: proves nothing"
    for n, req in ((4, "r-1m"), (64, "r-16m"), (256, "r-64m")):
        rep = transfer(hosts, req, list(range(n)), list(range(256, 256 + n)), job=10 * n)
        assert rep["success"], rep
        assert same_bytes(hosts, list(range(n)), list(range(256, 256 + n))), f"{req}: bytes differ"
    # scattered rows both sides
    src, dst = list(range(300, 420, 3)), list(range(0, 160, 4))
    rep = transfer(hosts, "r-scattered", src, dst, job=5000)
    assert rep["success"] and same_bytes(hosts, src, dst), rep


def load_back(hosts, job: int = 9000) -> None:
    """a loads 8 rows from b (the other way), byte-exact."""
    ks = keys(f"r-back-{job}", 8)
    hosts.b.call(op="store", job=job, request=f"r-back-{job}", keys=ks, rows=list(range(8)))
    hosts.a.call(op="load", job=job + 1, address=hosts.b.address, request=f"r-back-{job}", keys=ks,
                 rows=list(range(400, 408)))
    done = hosts.a.call(op="wait", jobs=[job + 1], timeout_s=60, wait_s=70)["done"]
    assert done[str(job + 1)]["success"], done
    assert hosts.b.call(op="digest", rows=list(range(8)))["sha256"] == \
        hosts.a.call(op="digest", rows=list(range(400, 408)))["sha256"]


def test_workers_on_one_host_copy_from_the_region_file_byte_exact(tmp_path):
    with two_hosts("sh", tmp_path, blocks=512, block_bytes=BLOCK, same_host=True) as hosts:
        move_and_check(hosts)
        assert paths(hosts.b) == {("same_host", "")}  # the consumer copies out of a's file
        # a accepted b's link and has not read from it: its path is chosen at its first read (no handover for
        # links a producer only serves)
        (path, why), = paths(hosts.a)
        assert path == "undecided" and "first read" in why, (path, why)
        # b dialed a: that session's messages moved to a lane, on both ends (the ZMQ link keeps the heartbeats)
        assert lanes(hosts.b) == ["up"] and lanes(hosts.a) == ["up"], (lanes(hosts.a), lanes(hosts.b))
        load_back(hosts)
        assert ("same_host", "") in paths(hosts.a) and {p for p, _ in paths(hosts.a)} <= {"same_host", "undecided"}, \
            paths(hosts.a)
        assert lanes(hosts.a) == ["up", "up"] and lanes(hosts.b) == ["up", "up"]  # a dialed b: a second lane


def prefaults(host) -> list[dict | None]:
    st = host.call(op="status")["status"]
    return [s["peer_region_prefault"] for s in st["sessions"] if s["state"] == "active"]


def test_the_consumer_prefaults_the_producers_region_in_the_background_and_not_when_turned_off(tmp_path):
    with two_hosts("shpf", tmp_path, blocks=512, block_bytes=BLOCK, same_host=True) as hosts:
        rep = transfer(hosts, "r-pf", list(range(4)), list(range(256, 260)), job=10)
        assert rep["success"] and same_bytes(hosts, list(range(4)), list(range(256, 260))), rep
        deadline = time.monotonic() + 30
        while (got := prefaults(hosts.b)) and got[0]["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.05)  # 128 MiB: ~15 ms of populating here, on the worker's own thread
        (pf,) = got
        # the agent filled its whole region with random bytes: every page is in memory, so every page is mapped
        assert pf["state"] == "done" and pf["populated_bytes"] == pf["nbytes"] >= 512 * BLOCK, pf
        assert prefaults(hosts.a) == [None]  # a serves b's link and never read from b: nothing mapped, no walk
    with two_hosts("shpfoff", tmp_path, blocks=512, block_bytes=BLOCK, same_host=True,
                   settings={"data": {"prefault_peers": False}}) as hosts:
        rep = transfer(hosts, "r-pf", list(range(4)), list(range(256, 260)), job=10)
        assert rep["success"] and same_bytes(hosts, list(range(4)), list(range(256, 260))), rep
        assert paths(hosts.b) == {("same_host", "")} and prefaults(hosts.b) == [None]


def test_the_lane_turned_off_keeps_messages_on_the_control_link_with_the_same_bytes(tmp_path):
    with two_hosts("shnolane", tmp_path, blocks=512, block_bytes=BLOCK, same_host=True,
                   settings={"data": {"lane": False}}) as hosts:
        move_and_check(hosts)
        assert paths(hosts.b) == {("same_host", "")}
        assert lanes(hosts.a) == lanes(hosts.b) == ["control link"]


def test_same_host_turned_off_uses_nixl_with_the_same_bytes(tmp_path):
    with two_hosts("shoff", tmp_path, blocks=512, block_bytes=BLOCK, same_host=True,
                   settings={"data": {"same_host": False}}) as hosts:
        move_and_check(hosts)
        (path, why), = paths(hosts.b)
        assert path == "nixl" and "turned off here" in why, (path, why)
        assert lanes(hosts.a) == lanes(hosts.b) == ["control link"]  # no handover socket: no lane either


def test_a_consumer_with_a_private_dev_shm_uses_nixl_even_with_a_file_at_the_producers_path(tmp_path):
    with two_hosts("shpriv", tmp_path, blocks=512, block_bytes=BLOCK, private_shm=True) as hosts:
        assert hosts.mode == PRIVATE_SHM
        # b's /dev/shm is its own tmpfs: put a file of the same size at a's region path there, so that the path
        # opens, but another file (what a container's own /dev/shm may well hold under vLLM's naming)
        hosts.b.call(op="decoy", path=hosts.a.region, nbytes=512 * BLOCK)
        move_and_check(hosts)
        (path, why), = paths(hosts.b)
        assert path == "nixl" and "opens another file here" in why, (path, why)
        load_back(hosts)
        got = paths(hosts.a)  # a cannot open b's region file at all
        assert any(p == "nixl" and "does not open here" in why for p, why in got), got
        assert "same_host" not in {p for p, _ in got}, got


def test_a_worker_in_its_own_pid_namespace_is_copied_from_only_where_the_kernel_shows_it(tmp_path):
    """A container that mounts the host's /dev/shm but has its own PID namespace (b).  b cannot see a's worker (the
    kernel names the sender of a's files pid 0 there), so a death of that worker mid-copy could not be seen: b uses
    NIXL.  a sees b's worker (b's namespace is a child of a's; the kernel translates the pid), watches it through a
    pidfd, and copies from b's file: the pid comes from the kernel, not from b."""
    with two_hosts("shpid", tmp_path, blocks=512, block_bytes=BLOCK, private_pid=True) as hosts:
        assert hosts.mode == PRIVATE_PID
        move_and_check(hosts)  # b loads from a
        (path, why), = paths(hosts.b)
        assert path == "nixl" and "not visible here" in why and "PID namespace" in why, (path, why)
        load_back(hosts)  # and a loads from b, on the same-host path
        assert ("same_host", "") in paths(hosts.a) and {p for p, _ in paths(hosts.a)} <= {"same_host", "undecided"}, \
            paths(hosts.a)
