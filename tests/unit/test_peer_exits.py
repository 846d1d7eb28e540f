"""PeerExits (p2pworker/worker/exits.py) with a real peer process: the pidfd the kernel gives for a lane's socket
names the process at its other end, and its leases end only once that process has exited."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys

import pytest

from p2pworker.worker.exits import PeerExits

pytestmark = pytest.mark.timeout(30)

CHILD = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(b"up")
time.sleep(60)
"""


class Orphans:
    def __init__(self, held: dict) -> None:
        self.held = held

    def count(self, reader) -> int:
        return self.held.get(reader, 0)


class Lot:
    """The lot as PeerExits asks it: leases held by a closed session, ended when its reader is gone."""

    def __init__(self, held: dict) -> None:
        self.held = held
        self.orphans = Orphans(held)
        self.gone: list = []

    def reader_gone(self, reader, reason: str) -> int:
        self.gone.append((reader, reason))
        return self.held.pop(reader, 0)


class Peer:
    peer_id = "peer-a"


@pytest.fixture
def lane(tmp_path):
    """(our end of a lane a child process connected, the child)."""
    path = str(tmp_path / "lane.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    child = subprocess.Popen([sys.executable, "-c", CHILD, path])
    try:
        srv.settimeout(10)
        conn, _ = srv.accept()
        assert conn.recv(16) == b"up"
        yield conn, child
        conn.close()
    finally:
        srv.close()
        if child.poll() is None:
            child.kill()
        child.wait(5)


def test_a_closed_sessions_leases_end_once_its_peer_process_exits(lane):
    conn, child = lane
    s = Peer()
    lot = Lot({s: 2})
    counters = collections.Counter()
    exits = PeerExits(lambda: lot, counters)
    exits.know(s, conn)
    if s not in exits.known:
        pytest.skip("this kernel gives no SO_PEERPIDFD (Linux < 6.5): leases end at their hold's end")
    exits.retired(s)
    assert s in exits.watched and exits.tick() == 0 and not lot.gone  # alive: held
    child.send_signal(signal.SIGSTOP)
    assert exits.tick() == 0  # stopped is not gone
    child.kill()
    child.wait(5)
    assert exits.tick() == 2 and lot.gone[0][0] is s and "exited" in lot.gone[0][1]
    assert counters["leases_ended_reader_exited"] == 2 and not exits.watched


def test_a_session_that_holds_nothing_is_not_watched_and_its_pidfd_closed(lane):
    conn, _ = lane
    s = Peer()
    exits = PeerExits(lambda: Lot({}), collections.Counter())
    before = len(os.listdir("/proc/self/fd"))
    exits.know(s, conn)
    exits.retired(s)
    assert not exits.watched and not exits.known
    assert len(os.listdir("/proc/self/fd")) == before


def test_leases_that_ended_otherwise_stop_the_watch(lane):
    conn, _ = lane
    s = Peer()
    lot = Lot({s: 1})
    exits = PeerExits(lambda: lot, collections.Counter())
    exits.know(s, conn)
    exits.retired(s)
    lot.held.clear()  # released, or the hold ran out
    assert exits.tick() == 0 and not exits.watched and not lot.gone
