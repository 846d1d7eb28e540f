"""Shared fixtures: unique /dev/shm names per test, leak checks, spawned children."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import socket

import pytest

from p2pworker.shm.sweep import leftovers, sweep

RUN_PREFIX = f"p2pwt{os.getpid()}_"

try:  # tests/vllm and tests/e2e run in the vLLM venvs (scripts/test.sh); the worker's venv has no vLLM
    import vllm  # noqa: F401
except ImportError:
    collect_ignore = ["vllm", "e2e"]
_counter = itertools.count()


@pytest.fixture
def shm_prefix(request):
    """A /dev/shm name prefix owned by this test; the test fails if anything is left under it."""
    prefix = f"{RUN_PREFIX}{next(_counter)}_"
    yield prefix
    left = sweep(prefix)
    if left and not request.node.get_closest_marker("leaves_shm"):
        pytest.fail(f"test left /dev/shm entries behind: {left}")


@pytest.fixture(scope="session", autouse=True)
def no_shm_leftovers_after_suite():
    import glob

    admin_before = set(glob.glob("/tmp/p2pworker-*.admin"))
    yield
    left = leftovers(RUN_PREFIX)
    sweep(RUN_PREFIX)
    assert not left, f"the suite left /dev/shm entries behind: {left}"
    admin_left = set(glob.glob("/tmp/p2pworker-*.admin")) - admin_before
    assert not admin_left, f"the suite left worker admin sockets behind: {sorted(admin_left)}"


@pytest.fixture
def seqpacket_pair():
    """A connected AF_UNIX SEQPACKET pair (what a same-host lane is): closed after the test."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def free_port():
    """A function returning a loopback TCP port that was free a moment ago (outside the ephemeral range:
    tests/helpers/ports.py says why)."""
    from tests.helpers.ports import free_port as get

    return get


class Children:
    """Spawned child processes of one test; all are reaped (killed if needed) at teardown."""

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.procs: list[mp.Process] = []

    def start(self, target, *args) -> mp.Process:
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def join_ok(self, proc: mp.Process, timeout_s: float = 30.0) -> None:
        proc.join(timeout_s)
        assert not proc.is_alive(), f"child {proc.pid} did not exit within {timeout_s} s"
        assert proc.exitcode == 0, f"child {proc.pid} exited with {proc.exitcode}"

    def reap(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


@pytest.fixture
def children():
    c = Children()
    yield c
    c.reap()


def pytest_configure(config):
    config.addinivalue_line("markers", "leaves_shm: the test checks leftovers itself")
