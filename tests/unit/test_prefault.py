"""The background pre-fault of a peer's region (p2pworker/shm/prefault.py): only pages in memory are populated (a
hole of the peer's sparse file is never allocated), the walk ends exactly once by the MOVES table, stop() leaves
the mapping before it returns, and a file shrunk under the mapping ends the walk without a SIGBUS."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from p2pworker.shm import prefault as pf
from p2pworker.shm import vm
from p2pworker.shm.prefault import MOVES, Prefault, PrefaultState, runs_of, walk_refusal

pytestmark = pytest.mark.timeout(60)

PAGE = vm.PAGE_BYTES


def _kernel_populates() -> bool:
    with mmap.mmap(-1, PAGE) as m:
        return vm.populate_read(np.frombuffer(m, np.uint8).ctypes.data, PAGE) == 0


if not _kernel_populates():  # EINVAL before Linux 5.14: the worker's walk then ends FAILED and copies fault
    pytest.skip("MADV_POPULATE_READ needs Linux 5.14+", allow_module_level=True)


@pytest.fixture
def shm_file():
    path = f"/dev/shm/p2pw-test-prefault-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        yield path, fd
    finally:
        os.close(fd)
        os.unlink(path)


def written(fd: int, size: int, value: int = 1) -> None:
    """The "producer" sizes its file and writes every byte of it."""
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as w:
        np.frombuffer(w, np.uint8)[:] = value


def rss_of(address: int) -> int:
    """Resident bytes of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    start = f"{address:x}-"
    with open("/proc/self/smaps") as f:
        lines = iter(f)
        for line in lines:
            if line.startswith(start):
                for field in lines:
                    if field.startswith("Rss:"):
                        return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def wait_end(p: Prefault) -> None:
    p.thread.join(30)
    assert not p.thread.is_alive()


def test_runs_of_matches_a_page_by_page_reading():
    rng = np.random.default_rng(7)
    for _ in range(200):
        v = rng.random(rng.integers(0, 60)) < rng.random()
        want, i = [], 0
        while i < len(v):
            if v[i]:
                j = i
                while j < len(v) and v[j]:
                    j += 1
                want.append((i, j - i))
                i = j
            else:
                i += 1
        assert runs_of(v) == want, v


def test_only_the_pages_in_memory_are_populated_and_no_hole_is_allocated(shm_file):
    path, fd = shm_file
    size = 64 << 20
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as w:  # the "producer" wrote the first half and 1 page in the middle of the rest
        a = np.frombuffer(w, np.uint8)
        a[: size // 2] = 1
        a[size // 2 + 40 * PAGE] = 2
        del a
    written = size // 2 + PAGE
    blocks_before = os.fstat(fd).st_blocks
    ro = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        address = np.frombuffer(ro, np.uint8).ctypes.data
        assert rss_of(address) == 0  # a fresh mapping: no page tables yet (the negative control of the check)
        p = Prefault(address, size, name="test")
        wait_end(p)
        assert p.state is PrefaultState.DONE, p.status()
        assert p.populated_bytes == written and p.scanned_bytes == size, p.status()
        assert rss_of(address) == written  # mapped here now, without one read
        assert os.fstat(fd).st_blocks == blocks_before  # the other half is still holes: nothing allocated
        assert p.stop() and p.state is PrefaultState.DONE  # stop after the end changes nothing
    finally:
        ro.close()


def test_stop_ends_the_walk_before_it_returns(shm_file, monkeypatch):
    path, fd = shm_file
    size = 64 << 20
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size) as w:
        np.frombuffer(w, np.uint8)[::PAGE] = 1
    monkeypatch.setattr(Prefault, "CHUNK_BYTES", PAGE)  # 16,384 rounds: still walking when stop() comes
    ro = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        address = np.frombuffer(ro, np.uint8).ctypes.data
        p = Prefault(address, size)
        deadline = time.monotonic() + 10
        while p.populated_bytes == 0 and time.monotonic() < deadline:  # under way, so stop() cuts a walk
            time.sleep(0.001)
        assert p.stop(timeout_s=10)
        assert not p.thread.is_alive()
        assert p.state is PrefaultState.STOPPED and p.scanned_bytes < size, p.status()
        seen = rss_of(address)  # at least what it populated (a fault maps up to 16 resident neighbours too)
        assert 0 < p.populated_bytes <= seen < size, (p.status(), seen)
    finally:
        ro.close()


def test_a_file_shrunk_under_the_mapping_ends_the_walk_without_a_sigbus(shm_file, monkeypatch):
    path, fd = shm_file
    size = 32 << 20
    written(fd, size, 3)
    ro = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        address = np.frombuffer(ro, np.uint8).ctypes.data
        os.ftruncate(fd, size // 4)  # the peer shrank its file: touching the rest would be a SIGBUS
        p = Prefault(address, size)
        wait_end(p)
        assert p.state is PrefaultState.DONE and p.populated_bytes == size // 4, p.status()
        # the race: mincore answered while every page was still there, the populate comes after the shrink
        monkeypatch.setattr(pf.vm, "resident", lambda at, n: np.ones(n // PAGE, dtype=bool))
        p = Prefault(address, size)
        wait_end(p)
        assert p.state is PrefaultState.FAILED and "Bad address" in p.error, p.status()  # EFAULT, no SIGBUS
    finally:
        ro.close()


def test_a_kernel_that_refuses_ends_the_walk_failed_with_the_reason(shm_file, monkeypatch):
    path, fd = shm_file
    written(fd, 4 << 20)
    monkeypatch.setattr(pf.vm, "populate_read", lambda addr, n: 22)  # EINVAL: a kernel before 5.14
    ro = mmap.mmap(fd, 4 << 20, prot=mmap.PROT_READ)
    try:
        p = Prefault(np.frombuffer(ro, np.uint8).ctypes.data, 4 << 20)
        wait_end(p)
        assert p.state is PrefaultState.FAILED and "Invalid argument" in p.error, p.status()
        assert p.populated_bytes == 0
    finally:
        ro.close()


def test_the_walk_ends_once_by_the_table():
    assert set(MOVES) == set(PrefaultState)
    assert MOVES[PrefaultState.RUNNING] == {PrefaultState.DONE, PrefaultState.STOPPED, PrefaultState.FAILED}
    for end in (PrefaultState.SKIPPED, PrefaultState.DONE, PrefaultState.STOPPED, PrefaultState.FAILED):
        assert not MOVES[end]  # no second end: _end asserts every move against this table


def test_rows_that_start_inside_a_page_are_walked_from_that_page(shm_file):
    path, fd = shm_file
    written(fd, 1 << 20)
    ro = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)
    try:
        base = np.frombuffer(ro, np.uint8).ctypes.data
        p = Prefault(base + 100, (1 << 20) - 100)  # a data_offset of 100 bytes
        wait_end(p)
        assert (p.address, p.nbytes) == (base, 1 << 20)
        assert p.state is PrefaultState.DONE and p.populated_bytes == 1 << 20, p.status()
    finally:
        ro.close()


def test_a_refused_walk_is_skipped_and_never_started():
    p = Prefault(PAGE, PAGE, refusal="not the owner")
    assert p.state is PrefaultState.SKIPPED and p.error == "not the owner" and p.thread is None
    assert p.stop() and p.status()["state"] == "skipped"


_REFUSAL_AS_NOBODY = """
import mmap, os, sys
import numpy as np
from p2pworker.shm import vm
from p2pworker.shm.prefault import walk_refusal  # imported first: nobody may not read this Python's files
fd = os.open(sys.argv[1], os.O_RDONLY)
os.setgid(65534); os.setuid(65534)  # capabilities go with uid 0
m = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)
print(int(vm.resident(np.frombuffer(m, np.uint8).ctypes.data, 1 << 20).sum()), repr(walk_refusal([fd])))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_mincore_is_trusted_only_for_the_files_owner(shm_file):
    """The kernel tells a reader that is not the owner (nor a writer, nor CAP_FOWNER) that every page of a file is
    in memory: its walk would allocate the file's holes.  Such a reader's walk is refused."""
    path, fd = shm_file
    os.ftruncate(fd, 1 << 20)  # 256 pages, one of them written: the rest are holes
    os.pwrite(fd, b"x", 0)
    os.chmod(path, 0o644)
    run = [sys.executable, "-c", _REFUSAL_AS_NOBODY, path]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    got = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env)
    resident, why = got.stdout.split(" ", 1)
    assert resident == "256", got  # the kernel's answer to a reader: every page in memory (why we refuse)
    assert "not the owner of the peer's file (uid 0, we are 65534)" in why, got
    os.chown(path, 65534, 65534)  # its own file: mincore is honest, the walk may run
    got = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env)
    assert got.stdout.split() == ["1", "''"], got
    assert walk_refusal([fd]) == ""  # root here: CAP_FOWNER (the initial user namespace)


def test_cap_fowner_counts_only_where_every_uid_is_itself(shm_file, monkeypatch):
    path, fd = shm_file
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file away")
    os.fchown(fd, 65534, 65534)
    monkeypatch.setattr(pf, "has_cap", lambda bit: True)
    monkeypatch.setattr(pf, "initial_user_namespace", lambda: False)  # a container's user namespace
    assert "not the owner" in walk_refusal([fd])
    monkeypatch.setattr(pf, "initial_user_namespace", lambda: True)
    assert walk_refusal([fd]) == ""


def test_a_walk_that_does_not_stop_in_time_says_so(shm_file, monkeypatch):
    path, fd = shm_file
    written(fd, 1 << 20)
    inside, leave = threading.Event(), threading.Event()

    def stuck(at, n):  # a populate that takes longer than stop() waits
        inside.set()
        leave.wait(30)
        return 0

    monkeypatch.setattr(pf.vm, "populate_read", stuck)
    monkeypatch.setattr(Prefault, "CHUNK_BYTES", 256 << 10)  # a round after the stuck one: it sees the stop
    ro = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)
    try:
        p = Prefault(np.frombuffer(ro, np.uint8).ctypes.data, 1 << 20)
        assert inside.wait(10)
        t0 = time.monotonic()
        assert p.stop(timeout_s=0.2) is False  # the owner must not unmap now
        assert time.monotonic() - t0 < 5
        released = []
        assert p.stop_then(lambda: released.append(threading.current_thread()), timeout_s=0.1) is False
        assert not released  # not while the walk is inside
        leave.set()
        p.thread.join(10)
        assert p.state is PrefaultState.STOPPED and released == [p.thread]  # run by the walk as it left
        assert p.stop_then(lambda: released.append("again"))  # out now: released at once, by the caller
    finally:
        leave.set()
        ro.close()


def test_inspect_names_a_walk_that_has_not_ended_well(monkeypatch):
    from click.testing import CliRunner

    from p2pworker import admin, cli

    def session(link, pf):
        return {"peer_id": "p", "link": link, "state": "active", "open_loads": 0, "data_path": "same_host",
                "data_path_why": "", "lane": "up", "close_reason": "", "peer_region_prefault": pf}

    walk = {"populated_bytes": 0, "scanned_bytes": 48 << 20, "nbytes": 128 << 20}
    status = {"name": "w", "pid": 1, "state": "running", "uptime_s": 3, "address": "tcp://127.0.0.1:1",
              "backend": "nixl", "fingerprint": "f", "jobs_in_flight": 0, "transfers_in_flight": 0, "bytes_read": 0,
              "parked_requests": 0, "counters": {},
              "sessions": [session("l-run", {**walk, "state": "running", "error": ""}),
                           session("l-bad", {**walk, "state": "failed", "error": "madvise: Invalid argument"}),
                           session("l-done", {**walk, "state": "done", "error": ""}),
                           session("l-none", None)]}
    monkeypatch.setattr(admin, "query", lambda path, timeout_s: status)
    monkeypatch.setattr(cli, "admin_paths", lambda a: ["/tmp/p2pworker-test.admin"])
    res = CliRunner().invoke(cli.main, ["inspect"])
    assert res.exit_code == 0, res.output
    assert "l-run: peer region pre-fault running, 48 of 128 MiB walked\n" in res.output
    assert "l-bad: peer region pre-fault failed, 48 of 128 MiB walked: madvise: Invalid argument" in res.output
    assert "l-done: peer region" not in res.output and "l-none: peer region" not in res.output
