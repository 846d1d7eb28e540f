"""The same-host copy path between two real workers (issue 16): taken when the handshake proves the consumer sees
the producer's region file and process, refused (and NIXL used, with the same bytes) when it does not: a consumer
in its own mount namespace with a private /dev/shm (a container), even one holding a file at the producer's very
path; and never taken when turned off.  ``p2pworker inspect`` (the worker's status) says which path each session
uses and why not the other."""

from __future__ import annotations

import pytest

from tests.hosts.emulate import PRIVATE_PID, PRIVATE_SHM, two_hosts

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


def test_workers_on_one_host_copy_from_the_region_file_byte_exact(tmp_path):
    with two_hosts("sh", tmp_path, blocks=512, block_bytes=BLOCK, same_host=True) as hosts:
        move_and_check(hosts)
        assert paths(hosts.b) == {("same_host", "")}  # the consumer copies out of a's file
        assert paths(hosts.a) == {("same_host", "")}  # and would, the other way


def test_same_host_turned_off_uses_nixl_with_the_same_bytes(tmp_path):
    with two_hosts("shoff", tmp_path, blocks=512, block_bytes=BLOCK, same_host=True,
                   settings={"data": {"same_host": False}}) as hosts:
        move_and_check(hosts)
        (path, why), = paths(hosts.b)
        assert path == "nixl" and "turned off here" in why, (path, why)


def test_a_consumer_with_a_private_dev_shm_uses_nixl_even_with_a_file_at_the_producers_path(tmp_path):
    with two_hosts("shpriv", tmp_path, blocks=512, block_bytes=BLOCK, private_shm=True) as hosts:
        assert hosts.mode == PRIVATE_SHM
        # b's /dev/shm is its own tmpfs: put a file of the same size at a's region path there, so that the path
        # opens, but another file (what a container's own /dev/shm may well hold under vLLM's naming)
        hosts.b.call(op="decoy", path=hosts.a.region, nbytes=512 * BLOCK)
        move_and_check(hosts)
        (path, why), = paths(hosts.b)
        assert path == "nixl" and "opens another file here" in why, (path, why)
        (path, why), = paths(hosts.a)  # a cannot open b's region file at all
        assert path == "nixl" and "does not open here" in why, (path, why)


def test_a_consumer_in_its_own_pid_namespace_uses_nixl_though_it_shares_dev_shm(tmp_path):
    """A container that mounts the host's /dev/shm but has its own PID namespace: b can open a's region file, but
    a's pid does not name a's worker there, so a death of that worker mid-copy could not be seen: refused."""
    with two_hosts("shpid", tmp_path, blocks=512, block_bytes=BLOCK, private_pid=True) as hosts:
        assert hosts.mode == PRIVATE_PID
        move_and_check(hosts)
        for host in (hosts.b, hosts.a):
            (path, why), = paths(host)
            assert path == "nixl" and "not visible here" in why and "another PID namespace" in why, (path, why)
