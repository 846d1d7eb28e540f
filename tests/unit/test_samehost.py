"""The same-host copy path's checks (p2pworker/data/samehost.py, p2pworker/data/handover.py): it is chosen only
when every check passes, each failing check names itself, the files and the process come from the kernel (handed
over descriptors, SO_PEERCRED) rather than from the peer's word, and a copy is byte-exact, into our rows only, and
refused once the peer's worker died.

One process, real files in /dev/shm; the peer's "worker" is this process (a handover thread), or a child started
for the test."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time

from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest

from p2pworker.data import handover, samehost
from p2pworker.data.base import coalesce, split_runs
from p2pworker.data.samehost import Copier, NotSameHost, Refusal, open_source
from p2pworker.errors import TransferFailed
from p2pworker.protocol.peer_info import PeerDataInfo
from p2pworker.shm import KVRegion

NB, BB = 64, 16384
replace = msgspec.structs.replace


@pytest.fixture
def regions(shm_prefix):
    """The peer's region (seeded bytes, two segment files) and ours (zeros)."""
    with KVRegion.create(shm_prefix + "peer", NB, BB, segment_bytes=NB * BB // 2) as peer, \
            KVRegion.create(shm_prefix + "ours", NB, BB) as ours:
        peer.array()[:] = np.random.default_rng(1).integers(0, 256, size=(NB, BB), dtype=np.uint8)
        yield peer, ours


@pytest.fixture
def server(regions):
    """The peer's handover socket, served by a thread of this process (so the kernel names this process)."""
    srv = samehost.serve(regions[0])
    yield srv
    srv.close()


def info_of(region: KVRegion, srv: handover.HandoverServer, **same_host) -> PeerDataInfo:
    sh = samehost.local_info(region, srv)
    return PeerDataInfo("nixl", "peer", region.address, region.num_blocks, region.block_bytes,
                        same_host=replace(sh, **same_host) if same_host else sh)


def refusal(info: PeerDataInfo, enabled: bool = True) -> NotSameHost:
    with pytest.raises(NotSameHost) as e:
        open_source(enabled, info).close()
    return e.value


SERVER = """
import sys, time
from p2pworker.data.handover import HandoverServer
n = len(sys.argv) // 2
srv = HandoverServer(sys.argv[1:1 + n], [tuple(map(int, x.split(":"))) for x in sys.argv[1 + n:]])
print(srv.name, srv.token.hex(), flush=True)
time.sleep(60)
"""


@pytest.fixture
def child_server(regions):
    """A stand-in for the peer's worker in another process: it hands over the peer region's files."""
    peer, _ = regions
    ids = [f"{d}:{i}" for d, i in peer.file_ids]
    p = subprocess.Popen([sys.executable, "-c", SERVER, *(s.path for s in peer.handle.segments), *ids],
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    name, token = p.stdout.readline().split()
    yield p, name, bytes.fromhex(token)
    p.kill()
    p.wait()


def test_every_check_that_fails_names_itself(regions, server, shm_prefix):
    peer, _ = regions
    info = info_of(peer, server)
    assert refusal(info, enabled=False).refusal is Refusal.OFF
    assert refusal(replace(info, same_host=None)).refusal is Refusal.NOT_OFFERED
    assert refusal(info_of(peer, server, boot_id="another-kernel")).refusal is Refusal.OTHER_BOOT
    files = info.same_host.files
    # only files directly under /dev/shm, named plainly: never a path a peer picked elsewhere (a device, ../)
    for bad in ("/etc/passwd", "/dev/zero", f"/dev/shm/../shm/{shm_prefix}peer", "/dev/shm/", "/dev/shm/.."):
        got = refusal(info_of(peer, server, files=(replace(files[0], path=bad),) + files[1:]))
        assert got.refusal is Refusal.NOT_SHM, bad
    # only a p2pworker handover socket's name is connected to (a peer must not point us at another local service),
    # with a token of the right size
    for bad in ("@/tmp/.X11-unix/X0", "p2pworker-ho-", "p2pworker-ho-0123456789abcdef0", "/run/dbus/socket"):
        got = refusal(info_of(peer, server, socket=bad))
        assert got.refusal is Refusal.NO_SOCKET and "not a p2pworker handover socket" in got.detail, bad
    assert refusal(info_of(peer, server, token=b"short")).refusal is Refusal.NO_SOCKET
    # no handover socket of that name in this network namespace; our token refused (nothing handed over)
    assert refusal(info_of(peer, server, socket="p2pworker-ho-" + "0" * 16)).refusal is Refusal.NO_SOCKET
    got = refusal(info_of(peer, server, token=bytes(handover.TOKEN_BYTES)))
    assert got.refusal is Refusal.NO_SOCKET and "token refused" in got.detail, got
    # files the peer names but did not hand over: a third engine's region (here the decoy's) is not its to offer;
    # naming fewer files than it holds is refused too
    with KVRegion.create(shm_prefix + "decoy", NB // 2, BB) as decoy:
        decoy.array()[:] = 7
        (dev, ino), = decoy.file_ids
        other = (replace(files[0], path=decoy.handle.segments[0].path, dev=dev, ino=ino),) + files[1:]
        assert refusal(info_of(peer, server, files=other)).refusal is Refusal.NOT_HELD
        assert refusal(info_of(peer, server, files=files[:1])).refusal is Refusal.NOT_HELD
        # the handed-over file's identity at a path that opens another file here: a same-named file in another
        # /dev/shm (a container's own)
        moved = (replace(files[0], path=decoy.handle.segments[0].path),) + files[1:]
        assert refusal(info_of(peer, server, files=moved)).refusal is Refusal.OTHER_FILE
    gone = (replace(files[0], path=f"/dev/shm/{shm_prefix}nowhere"),) + files[1:]
    assert refusal(info_of(peer, server, files=gone)).refusal is Refusal.NO_FILE  # handed over, not openable here
    big = (replace(files[0], nbytes=files[0].nbytes * 4),) + files[1:]  # more than the file holds
    assert refusal(info_of(peer, server, files=big)).refusal is Refusal.UNUSABLE
    src = open_source(True, info)  # and every check passing: the path is taken
    try:
        assert src.alive() and src.region.readonly and src.pid == os.getpid()
    finally:
        src.close()


@pytest.mark.parametrize("pidfd_from", ["kernel", "pid"])
def test_the_process_watched_is_the_one_the_kernel_says_sent_the_files(regions, child_server, pidfd_from,
                                                                        monkeypatch):
    """No pid travels in the Hello: the sender's pid comes from SO_PEERCRED, and the pidfd names that process:
    SO_PEERPIDFD where the kernel has it (6.5+), else pidfd_open of that pid while the sender waits for our ack."""
    peer, _ = regions
    p, name, token = child_server
    if pidfd_from == "pid":
        monkeypatch.setattr(handover, "peer_pidfd", lambda s: None)
    else:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.connect("\0" + name)
        fd = handover.peer_pidfd(probe)
        probe.close()
        if fd is None:
            pytest.skip("this kernel has no SO_PEERPIDFD (< 6.5): the 'pid' case covers it")
        os.close(fd)
    info = PeerDataInfo("nixl", "peer", peer.address, NB, BB,
                        same_host=samehost.SameHostInfo(samehost.boot_id(), name, token, _files(peer),
                                                              net_ns=samehost.net_namespace()))
    src = open_source(True, info)
    try:
        assert src.pid == p.pid and src.alive()
        p.kill()  # and the pidfd is of that process: its death shows
        p.wait()
        assert not src.alive()
    finally:
        src.close()


def _files(region: KVRegion):
    from p2pworker.protocol.peer_info import RegionFile

    return tuple(RegionFile(s.path, d, i, s.nbytes, s.file_offset)
                 for s, (d, i) in zip(region.handle.segments, region.file_ids))


def open_fds() -> set[int]:
    listed = [int(x) for x in os.listdir("/proc/self/fd")]  # includes the listing's own, closed by now
    return {fd for fd in listed if _valid(fd)}


def _valid(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_a_sender_gone_before_our_ack_is_not_trusted(regions, shm_prefix, monkeypatch):
    """Without SO_PEERPIDFD the sender must still be connected after we opened its pidfd by pid (it waits for our
    ack): a pid whose process ended meanwhile may name another process by then.  Forced here: the pidfd is opened
    only after the sender closed."""
    peer, _ = regions
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    name = f"p2pw-test-{shm_prefix}"
    lsock.bind("\0" + name)
    lsock.listen(1)
    closed = threading.Event()

    def answer_then_leave():
        conn, _ = lsock.accept()
        conn.recv(64)
        fds = [os.open(s.path, os.O_RDONLY) for s in peer.handle.segments]
        socket.send_fds(conn, [b"F"], fds)
        for fd in fds:
            os.close(fd)
        conn.close()  # without waiting for the ack
        closed.set()

    before = open_fds()
    t = threading.Thread(target=answer_then_leave, daemon=True)
    t.start()
    monkeypatch.setattr(handover, "peer_pidfd", lambda s: None)  # the older kernels' path
    real = os.pidfd_open
    monkeypatch.setattr(handover.os, "pidfd_open", lambda pid: (closed.wait(5), real(pid))[1])
    try:
        with pytest.raises(handover.HandoverRefused) as e:
            handover.receive(name, bytes(handover.TOKEN_BYTES), len(peer.handle.segments))
        assert e.value.failure is handover.Failure.NO_PROCESS and "before our ack" in str(e.value)
        t.join(5)
        assert open_fds() <= before, "a refused handover left descriptors open"
    finally:
        t.join(5)
        lsock.close()


def test_idle_connections_delay_no_handover(regions):
    """The server holds every connection at once, each for at most its timeout: local processes that connect and
    send nothing (20 here, held for 5 s) do not delay a consumer that asks meanwhile."""
    peer, _ = regions
    srv = handover.HandoverServer([s.path for s in peer.handle.segments], peer.file_ids, timeout_s=5.0)
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(20)]
    try:
        for c in idle:
            c.connect("\0" + srv.name)
        time.sleep(0.05)  # let the server take them first
        t0 = time.monotonic()
        handed = handover.receive(srv.name, srv.token, 2, timeout_s=2.0)
        waited = time.monotonic() - t0
        try:
            assert handed.pid == os.getpid() and len(handed.fds) == 2
            assert [os.fstat(fd).st_ino for fd in handed.fds] == [i for _, i in peer.file_ids]
            assert all(os.get_inheritable(fd) is False for fd in handed.fds), "received descriptors not CLOEXEC"
        finally:
            handed.close_fds()
            os.close(handed.pidfd)
        assert waited < 1.0, waited  # not queued behind the idle ones (5 s each)
    finally:
        for c in idle:
            c.close()
        srv.close()
    srv.close()  # idempotent
    with pytest.raises(handover.HandoverRefused):  # closed: nobody answers
        handover.receive(srv.name, srv.token, 2, timeout_s=0.5)


def test_a_full_server_evicts_the_oldest_idle_connection_not_the_consumer(regions, monkeypatch):
    """At MAX_CONNS (4 here) a new connection evicts the oldest still waiting for its hello: idle connections held
    open cannot lock a consumer out."""
    peer, _ = regions
    monkeypatch.setattr(handover, "MAX_CONNS", 4)
    srv = handover.HandoverServer([s.path for s in peer.handle.segments], peer.file_ids, timeout_s=5.0)
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(4)]
    try:
        for c in idle:
            c.connect("\0" + srv.name)
        time.sleep(0.05)
        handed = handover.receive(srv.name, srv.token, 2, timeout_s=2.0)
        handed.close_fds()
        os.close(handed.pidfd)
        idle[0].settimeout(1.0)
        assert idle[0].recv(1) == b"", "the oldest idle connection was not the one dropped"
    finally:
        for c in idle:
            c.close()
        srv.close()


EMFILE_SERVER = """
import os, resource, sys, time
from p2pworker.data.handover import HandoverServer
n = len(sys.argv) // 2
srv = HandoverServer(sys.argv[1:1 + n], [tuple(map(int, x.split(":"))) for x in sys.argv[1 + n:]])
soft = len(os.listdir("/proc/self/fd")) + 1  # room for nothing more: accept() fails with EMFILE
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(srv.name, flush=True)
time.sleep(30)
"""


def test_accept_failing_for_want_of_descriptors_does_not_spin(regions):
    """accept() failing with EMFILE leaves the connection queued, so the listener polls readable at once: the
    thread must pause listening rather than spin a core."""
    peer, _ = regions
    ids = [f"{d}:{i}" for d, i in peer.file_ids]
    p = subprocess.Popen([sys.executable, "-c", EMFILE_SERVER, *(s.path for s in peer.handle.segments), *ids],
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    conns = []
    try:
        name = p.stdout.readline().strip()
        for _ in range(8):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.connect("\0" + name)
            conns.append(c)
        time.sleep(0.3)

        def cpu_s() -> float:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(1.5)
        share = (cpu_s() - c0) / (time.monotonic() - t0)
        assert share < 0.3, f"the handover thread used {share:.0%} of a core while accept() failed"
    finally:
        for c in conns:
            c.close()
        p.kill()
        p.wait()


def test_more_files_than_one_message_carries_go_over_several(shm_prefix):
    """The kernel takes at most 253 descriptors a message: a region of 300 segment files is handed over in two."""
    with KVRegion.create(shm_prefix + "many", 300, 4096, segment_bytes=4096) as region:
        assert len(region.handle.segments) == 300 > handover.FDS_PER_MESSAGE
        srv = samehost.serve(region)
        try:
            handed = handover.receive(srv.name, srv.token, 300)
            try:
                assert [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in handed.fds] == list(region.file_ids)
            finally:
                handed.close_fds()
                os.close(handed.pidfd)
        finally:
            srv.close()


class FakeServer:
    """A hostile handover server: answers one connection with the descriptors ``fds_of()`` returns, in messages
    of ``per_message``, ``pause_s`` apart, then closes."""

    def __init__(self, fds_of, per_message: int = 200, pause_s: float = 0.0):
        self.name = handover.NAME_PREFIX + os.urandom(8).hex()
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.lsock.bind("\0" + self.name)
        self.lsock.listen(1)
        self.fds_of, self.per_message, self.pause_s = fds_of, per_message, pause_s
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        conn, _ = self.lsock.accept()
        with conn:
            conn.recv(64)
            fds = self.fds_of()
            try:
                for i in range(0, len(fds), self.per_message):
                    socket.send_fds(conn, [b"F"], fds[i:i + self.per_message])
                    time.sleep(self.pause_s)
            except OSError:
                pass  # the consumer gave up
            finally:
                for fd in fds:
                    os.close(fd)

    def close(self):
        self.thread.join(10)
        self.lsock.close()


@pytest.mark.parametrize("flags", [os.O_PATH, os.O_WRONLY], ids=["O_PATH", "O_WRONLY"])
def test_descriptors_not_open_for_reading_are_refused(regions, server, flags):
    """A peer that cannot read a file can still get an O_PATH descriptor of it (search permission on /dev/shm
    suffices) or a write-only one: handed over, they must not make us read that file for it."""
    peer, _ = regions
    fake = FakeServer(lambda: [os.open(s.path, flags) for s in peer.handle.segments])
    try:
        got = refusal(info_of(peer, server, socket=fake.name))
        assert got.refusal is Refusal.NOT_HELD, got
    finally:
        fake.close()


def test_a_peer_trickling_descriptors_cannot_hold_us_past_the_deadline(regions, shm_prefix, monkeypatch):
    """The whole handover has one deadline, however the peer paces its messages (one descriptor every 0.3 s for
    10 named files here): refused about TIMEOUT_S after it began, all received descriptors closed."""
    peer, _ = regions
    with KVRegion.create(shm_prefix + "ten", 10, 4096, segment_bytes=4096) as ten:
        fake = FakeServer(lambda: [os.open(s.path, os.O_RDONLY) for s in ten.handle.segments],
                          per_message=1, pause_s=0.3)
        srv = samehost.serve(ten)
        try:
            before = open_fds()
            t0 = time.monotonic()
            got = refusal(info_of(ten, srv, socket=fake.name))
            took = time.monotonic() - t0
            assert got.refusal is Refusal.NO_SOCKET and "TimeoutError" in got.detail, got
            assert took < handover.TIMEOUT_S + 0.5, took
            fake.close()  # its sends end once we are gone; its own descriptors closed
            assert open_fds() <= before, "a refused handover left descriptors open"
        finally:
            fake.close()
            srv.close()


def test_prechecks_refuse_without_talking_to_the_peer(regions, server):
    peer, _ = regions
    info = info_of(peer, server)
    files = info.same_host.files
    many = files * (handover.MAX_FILES // len(files) + 1)
    got = refusal(info_of(peer, server, files=many))
    assert got.refusal is Refusal.UNUSABLE and "region files" in got.detail, got
    # a socket name is only ours in the network namespace it was bound in
    got = refusal(info_of(peer, server, net_ns=(1, 2)))
    assert got.refusal is Refusal.NO_SOCKET and "another network namespace" in got.detail, got


def test_mode_a_never_watches_another_process_than_the_sender(regions, child_server, monkeypatch):
    """Mode A (no SO_PEERPIDFD, kernels < 6.5) against a real process: the sender hands over its files and is
    killed before we open its pidfd by pid (forced; not reaped, so the pid still opens).  Either the handover is
    refused (its connection closed, or its pidfd already shows the exit), or, while its threads are still exiting
    (the leader a zombie, the files still open), the pidfd we keep is of that dying process: it shows the exit."""
    peer, _ = regions
    p, name, token = child_server
    monkeypatch.setattr(handover, "peer_pidfd", lambda s: None)
    real = os.pidfd_open

    def after_its_death(pid):
        p.kill()
        for _ in range(500):  # until the leader is a zombie (not reaped: the pid still names it)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        return real(pid)

    monkeypatch.setattr(handover.os, "pidfd_open", after_its_death)
    try:
        handed = handover.receive(name, token, len(peer.handle.segments))
    except handover.HandoverRefused as e:
        assert e.failure is handover.Failure.NO_PROCESS, e
        return
    try:
        assert handed.pid == p.pid
        poll = select.poll()
        poll.register(handed.pidfd, select.POLLIN)
        assert poll.poll(5000), "the pidfd kept does not show the sender's exit: it names another process"
    finally:
        handed.close_fds()
        os.close(handed.pidfd)


def test_the_peer_region_is_mapped_read_only(regions, server):
    peer, _ = regions
    src = open_source(True, info_of(peer, server))
    try:
        view = src.region.array()
        assert (view == peer.array()).all()
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0] = 1
    finally:
        del view
        src.close()
    src.close()  # idempotent


@pytest.mark.parametrize("threads", [1, 3])
def test_copies_are_byte_exact_and_touch_only_the_granted_rows(regions, server, threads):
    peer, ours = regions
    rng = np.random.default_rng(threads)
    local, remote = rng.permutation(NB)[:40], rng.permutation(NB)[:40]
    src = open_source(True, info_of(peer, server))
    copier = Copier(ours, threads=threads, split_bytes=0)  # split whatever the size: the threads run
    try:
        copier.copy(src, coalesce(local, remote))
        mine = ours.array()
        assert (mine[local] == peer.array()[remote]).all()
        assert not mine[np.setdiff1d(np.arange(NB), local)].any(), "bytes landed outside the granted rows"
    finally:
        del mine
        copier.close()
        src.close()


def test_a_helper_waiting_for_a_core_does_not_hold_the_copy_and_nothing_lands_after_it_returns(regions, server):
    """Chunks are taken in turn: a helper thread that stalls inside its chunk (a busy box: it waits for a core)
    leaves the rest to this thread, and copy() returns only once the helper's chunk is in too."""
    peer, ours = regions
    me = threading.current_thread()
    helper_in, gate = threading.Event(), threading.Event()
    copied: list[tuple[bool, tuple]] = []

    class Gated(Copier):
        def copy_runs(self, src, runs):
            if threading.current_thread() is not me:
                helper_in.set()
                assert gate.wait(10)
            else:
                assert helper_in.wait(10), "the helper never took a chunk"
            super().copy_runs(src, runs)
            copied.append((threading.current_thread() is me, tuple(map(tuple, runs.tolist()))))

        def take_chunks(self, src, chunks, counter):
            n = super().take_chunks(src, chunks, counter)
            if threading.current_thread() is me:
                assert not gate.is_set()
                gate.set()  # only now may the stalled helper finish its chunk
            return n

    rng = np.random.default_rng(7)
    local, remote = rng.permutation(NB)[:48], rng.permutation(NB)[:48]
    runs = coalesce(local, remote)
    src = open_source(True, info_of(peer, server))
    copier = Gated(ours, threads=2, split_bytes=0, chunk_bytes=4 * BB)
    try:
        copier.copy(src, runs)
        by_me = [c for mine, c in copied if mine]
        by_helper = [c for mine, c in copied if not mine]
        assert len(by_helper) == 1 == copier.chunks_by_helpers  # it stalled in its first chunk; we took the rest
        assert len(by_me) == len(split_runs(runs, BB, 4 * BB)) - 1
        mine = ours.array()
        assert (mine[local] == peer.array()[remote]).all()  # the helper's chunk too: it landed before the return
        assert not mine[np.setdiff1d(np.arange(NB), local)].any(), "bytes landed outside the granted rows"
    finally:
        mine = None
        copier.close()
        src.close()


def test_a_helper_that_fails_fails_the_copy_only_after_every_other_chunk_ended(regions, server):
    peer, ours = regions
    me = threading.current_thread()
    helper_in = threading.Event()
    copied: list[tuple] = []

    class Failing(Copier):
        def copy_runs(self, src, runs):
            if threading.current_thread() is not me:
                helper_in.set()
                raise RuntimeError("helper broke")
            assert helper_in.wait(10), "the helper never took a chunk"
            super().copy_runs(src, runs)
            copied.append(tuple(map(tuple, runs.tolist())))

    runs = coalesce(np.arange(48), np.arange(48))
    src = open_source(True, info_of(peer, server))
    copier = Failing(ours, threads=2, split_bytes=0, chunk_bytes=4 * BB)
    try:
        with pytest.raises(RuntimeError, match="helper broke"):
            copier.copy(src, runs)
        assert len(copied) == len(split_runs(runs, BB, 4 * BB)) - 1  # the rest was copied, then it raised
    finally:
        copier.close()
        src.close()


def test_a_helper_still_queued_is_cancelled_not_waited_for(regions, server):
    """No core for the helper yet (here: its one pool thread busy): this thread copies every chunk and returns
    without waiting for it; the cancelled helper never runs."""
    peer, ours = regions
    rng = np.random.default_rng(3)
    local, remote = rng.permutation(NB)[:32], rng.permutation(NB)[:32]
    src = open_source(True, info_of(peer, server))
    pool = ThreadPoolExecutor(1)
    copier = Copier(ours, threads=2, split_bytes=0, chunk_bytes=2 * BB, pool=pool)
    release = threading.Event()
    blocker = pool.submit(release.wait, 30)  # the pool's only thread is taken
    try:
        copier.copy(src, coalesce(local, remote))  # waiting for the queued helper would wait out the blocker's 30 s
        assert not blocker.done() and copier.chunks_by_helpers == 0
        mine = ours.array()
        assert (mine[local] == peer.array()[remote]).all()
    finally:
        mine = None
        release.set()
        blocker.result(10)
        copier.close()
        src.close()


def test_a_copy_after_the_peer_worker_exited_fails(regions, child_server):
    peer, ours = regions
    mapper, name, token = child_server
    info = PeerDataInfo("nixl", "peer", peer.address, NB, BB,
                        same_host=samehost.SameHostInfo(samehost.boot_id(), name, token, _files(peer),
                                                              net_ns=samehost.net_namespace()))
    src = open_source(True, info)
    copier = Copier(ours)
    try:
        copier.copy(src, coalesce(np.arange(4), np.arange(4)))  # alive: fine
        mapper.kill()
        mapper.wait()
        assert not src.alive()
        # its vLLM may already have reused the rows: the piece fails (the load is reported failed)
        with pytest.raises(TransferFailed, match=f"pid {mapper.pid}.*exited"):
            copier.copy(src, coalesce(np.arange(4, 8), np.arange(4)))
    finally:
        src.close()


def test_a_peer_file_that_shrank_is_refused_before_it_is_touched(regions, server):
    """Touching a page past the end of a shrunk file would be a SIGBUS (the worker dead); the size is checked
    through the descriptors we mapped before every piece."""
    peer, ours = regions
    src = open_source(True, info_of(peer, server))
    copier = Copier(ours)
    try:
        copier.copy(src, coalesce(np.arange(4), np.arange(40, 44)))
        os.truncate(peer.handle.segments[1].path, 4096)
        with pytest.raises(TransferFailed, match="shrank"):
            copier.copy(src, coalesce(np.arange(4), np.arange(40, 44)))  # rows in the shrunk second file
    finally:
        src.close()


def test_a_peer_named_fifo_or_directory_is_refused_without_blocking(shm_prefix, regions):
    """The files are opened non-blocking, without following links: a FIFO (whose open would block the worker's
    loop forever), a directory or a link is refused at once."""
    from p2pworker.errors import RegionIdentityError
    from p2pworker.shm import RegionHandle, Segment

    peer, _ = regions
    fifo, link = f"/dev/shm/{shm_prefix}fifo", f"/dev/shm/{shm_prefix}link"
    os.mkfifo(fifo)
    os.symlink(peer.handle.segments[0].path, link)
    try:
        for path, err in ((fifo, RegionIdentityError), ("/dev/shm", RegionIdentityError), (link, OSError)):
            h = RegionHandle(segments=(Segment(path, 4096),), num_blocks=1, block_bytes=4096)
            with pytest.raises(err):
                KVRegion.attach_readonly(h, ((0, 0),))
    finally:
        os.unlink(fifo)
        os.unlink(link)


def test_a_transport_offers_its_file_only_when_on_and_stops_handing_it_over_when_closed(regions):
    from p2pworker.data import make_data_transport

    peer, _ = regions
    for on in (True, False):
        tr = make_data_transport(peer, backend="zmq", agent_name=f"offer-{on}", same_host=on)
        try:
            sh = tr.local_info().same_host
            assert (sh is not None) is on
            if on:
                assert sh.boot_id == samehost.boot_id() and len(sh.token) == handover.TOKEN_BYTES
                assert [(f.path, f.dev, f.ino) for f in sh.files] == [
                    (s.path, os.stat(s.path).st_dev, os.stat(s.path).st_ino) for s in peer.handle.segments]
                assert tr.local_info().same_host == sh  # one handover socket per transport
                handed = handover.receive(sh.socket, sh.token, len(sh.files))
                handed.close_fds()
                os.close(handed.pidfd)
        finally:
            assert tr.close()
        if on:
            threads = [t.name for t in threading.enumerate()]
            assert "p2pw-handover" not in threads, threads
            with pytest.raises(handover.HandoverRefused):
                handover.receive(sh.socket, sh.token, len(sh.files), timeout_s=0.5)


class _HeldWalk:
    """Every populate round of a walk waits for ``leave`` (one page per round); ``inside`` once one is waiting."""

    def __init__(self, monkeypatch):
        from p2pworker.shm import prefault

        self.inside, self.leave = threading.Event(), threading.Event()
        real = prefault.vm.populate_read

        def held(at, n):
            self.inside.set()
            self.leave.wait(30)
            return real(at, n)

        monkeypatch.setattr(prefault.vm, "populate_read", held)
        monkeypatch.setattr(prefault.Prefault, "CHUNK_BYTES", prefault.vm.PAGE_BYTES)


def test_a_source_closed_mid_walk_unmaps_only_after_the_walk_left(regions, server, monkeypatch):
    peer, _ = regions
    held = _HeldWalk(monkeypatch)
    src = open_source(True, info_of(peer, server), prefault=True)
    seen = {}
    unmap = src.region.close

    def recording_unmap():
        walk = src.prefault
        seen.update(state=walk.state, out=walk.left, thread=threading.current_thread(), status=walk.status())
        unmap()

    src.region.close = recording_unmap
    try:
        assert held.inside.wait(10) and src.prefault_status()["state"] == "running"
        threading.Timer(0.05, held.leave.set).start()  # the round ends (within close()'s wait, on a quiet box)
        src.close()
        src.prefault.thread.join(10)  # by close() itself, or by the walk as it left if it took longer
        assert seen and seen["state"].value == "stopped" and seen["out"], seen  # out of the mapping before it went
        assert seen["status"]["scanned_bytes"] < seen["status"]["nbytes"], seen
    finally:
        held.leave.set()
        src.close()


def test_a_walk_that_outlasts_close_unmaps_as_it_leaves(regions, server, monkeypatch, caplog):
    peer, _ = regions
    held = _HeldWalk(monkeypatch)
    src = open_source(True, info_of(peer, server), prefault=True)
    try:
        assert held.inside.wait(10)
        t0 = time.monotonic()
        src.close()  # the walk is held inside its round: close() must neither unmap nor wait for it
        assert time.monotonic() - t0 < 5
        assert not src.region.closed, "unmapped under a running walk"
        assert "still inside it: unmapped as it leaves" in caplog.text
        held.leave.set()
        src.prefault.thread.join(10)
        assert src.region.closed and src.prefault.state.value == "stopped"  # the walk unmapped on its way out
        src.close()  # idempotent
    finally:
        held.leave.set()
        src.close()


def test_a_walk_mincore_would_lie_to_is_skipped(regions, server, monkeypatch):
    from p2pworker.shm import prefault

    peer, _ = regions
    for seg in peer.handle.segments:
        os.chown(seg.path, 65534, 65534)  # another user's files, and we lack CAP_FOWNER (below)
    monkeypatch.setattr(prefault, "has_cap", lambda bit: False)
    src = open_source(True, info_of(peer, server), prefault=True)
    try:
        st = src.prefault_status()
        assert st["state"] == "skipped" and "not the owner of the peer's file (uid 65534" in st["error"], st
        assert st["populated_bytes"] == 0 and src.prefault.thread is None
    finally:
        src.close()


def test_the_walk_populates_only_the_rows_and_ends_done(regions, server):
    peer, _ = regions
    src = open_source(True, info_of(peer, server), prefault=True)
    try:
        deadline = time.monotonic() + 10
        while src.prefault_status()["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.01)
        st = src.prefault_status()
        assert st["state"] == "done" and st["populated_bytes"] == st["nbytes"] == NB * BB, st
    finally:
        src.close()
    plain = open_source(True, info_of(peer, server))
    try:
        assert plain.prefault_status() is None  # not asked: no walk
    finally:
        plain.close()


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (3, 1), (4, 2), (64, 2)])
def test_copy_threads_0_means_one_thread_below_4_cpus_else_two(cpus, threads):
    """[data] copy_threads = 0 (the default): on a host with few CPUs a helper thread only waits for a core the
    schedulers and the peer's worker need (pd_tier on 2 CPUs was as fast or faster with one)."""
    assert samehost.auto_copy_threads(cpus) == threads


@pytest.mark.parametrize("files, cap", [
    ({"cpu.max": "200000 100000\n"}, 2),
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs of time: a second thread still gets some
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
])
def test_available_cpus_is_the_affinity_mask_capped_by_a_cgroup_quota(tmp_path, monkeypatch, files, cap):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    # a 64-CPU mask, so that every cap below it shows (on a 2-CPU machine a cap of 2 or 3 would not)
    monkeypatch.setattr(samehost.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert samehost.available_cpus(str(tmp_path)) == (64 if cap is None else cap)
