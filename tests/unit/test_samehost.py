"""The same-host copy path's checks (p2pworker/data/samehost.py): it is chosen only when every check passes, each
failing check names itself, and a copy is byte-exact, into our rows only, and refused once the peer's worker died.

One process, real files in /dev/shm; the peer's "worker" is this process, or a child started for the test."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from p2pworker.data import samehost
from p2pworker.data.base import coalesce
from p2pworker.data.samehost import Copier, NotSameHost, Refusal, open_source
from p2pworker.errors import TransferFailed
from p2pworker.protocol.peer_info import PeerDataInfo
from p2pworker.shm import KVRegion
from p2pworker.shm.liveness import start_time

NB, BB = 64, 16384
replace = msgspec.structs.replace


@pytest.fixture
def regions(shm_prefix):
    """The peer's region (seeded bytes, two segment files) and ours (zeros)."""
    with KVRegion.create(shm_prefix + "peer", NB, BB, segment_bytes=NB * BB // 2) as peer, \
            KVRegion.create(shm_prefix + "ours", NB, BB) as ours:
        peer.array()[:] = np.random.default_rng(1).integers(0, 256, size=(NB, BB), dtype=np.uint8)
        yield peer, ours


def info_of(region: KVRegion, **same_host) -> PeerDataInfo:
    sh = samehost.local_info(region)
    return PeerDataInfo("nixl", "peer", region.address, region.num_blocks, region.block_bytes,
                        same_host=replace(sh, **same_host) if same_host else sh)


def refusal(info: PeerDataInfo, enabled: bool = True) -> Refusal:
    with pytest.raises(NotSameHost) as e:
        open_source(enabled, info).close()
    return e.value.refusal


@pytest.fixture
def child():
    """A process that maps nothing of ours (a pid with a start time, but not the peer's worker)."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


MAPPER = """
import mmap, sys, time
files = [open(p, "rb") for p in sys.argv[1:]]
maps = [mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) for f in files]
print("mapped", flush=True)
time.sleep(60)
"""


@pytest.fixture
def mapper(regions):
    """A stand-in for the peer's worker: another process that maps the peer region's files."""
    peer, _ = regions
    p = subprocess.Popen([sys.executable, "-c", MAPPER, *(s.path for s in peer.handle.segments)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "mapped"
    yield p
    p.kill()
    p.wait()


def test_every_check_that_fails_names_itself(regions, shm_prefix, child):
    peer, _ = regions
    info = info_of(peer)
    assert refusal(info, enabled=False) is Refusal.OFF
    assert refusal(replace(info, same_host=None)) is Refusal.NOT_OFFERED
    assert refusal(info_of(peer, boot_id="another-kernel")) is Refusal.OTHER_BOOT
    # a pid with another start time is another process (pid reuse), or one of another PID namespace
    assert refusal(info_of(peer, pid_start_ticks=info.same_host.pid_start_ticks + 1)) is Refusal.NO_PROCESS
    done = subprocess.Popen(["true"])
    done.wait()
    assert refusal(info_of(peer, pid=done.pid)) is Refusal.NO_PROCESS
    # a PID namespace of its own (a container): its pid numbers mean other processes here
    assert refusal(info_of(peer, pid_ns=(1, 2))) is Refusal.NO_PROCESS
    files = info.same_host.files
    # only files directly under /dev/shm, named plainly: never a path a peer picked elsewhere (a device, ../)
    for bad in ("/etc/passwd", "/dev/zero", f"/dev/shm/../shm/{shm_prefix}peer", "/dev/shm/", "/dev/shm/.."):
        assert refusal(info_of(peer, files=(replace(files[0], path=bad),) + files[1:])) is Refusal.NOT_SHM, bad
    # a live process that does not map the files it names: a peer naming a file it does not use (a third engine's
    # region would be read with OUR permissions on its behalf)
    assert refusal(info_of(peer, pid=child.pid, pid_start_ticks=start_time(child.pid))) \
        is Refusal.NOT_MAPPED
    gone = (replace(files[0], path=f"/dev/shm/{shm_prefix}nowhere"),) + files[1:]
    assert refusal(info_of(peer, files=gone)) is Refusal.NO_FILE  # the peer maps that file, we cannot open it
    # a file at the advertised path that is not the one the peer mapped: a same-named file in another /dev/shm
    with KVRegion.create(shm_prefix + "decoy", NB // 2, BB) as decoy:
        decoy.array()[:] = 7
        other = (replace(files[0], path=decoy.handle.segments[0].path),) + files[1:]
        assert refusal(info_of(peer, files=other)) is Refusal.OTHER_FILE
    big = (replace(files[0], nbytes=files[0].nbytes * 4),) + files[1:]  # more than the file holds
    assert refusal(info_of(peer, files=big)) is Refusal.UNUSABLE
    src = open_source(True, info)  # and every check passing: the path is taken
    try:
        assert src.alive() and src.region.readonly
    finally:
        src.close()


def test_the_peer_region_is_mapped_read_only(regions):
    peer, _ = regions
    src = open_source(True, info_of(peer))
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
def test_copies_are_byte_exact_and_touch_only_the_granted_rows(regions, threads):
    peer, ours = regions
    rng = np.random.default_rng(threads)
    local, remote = rng.permutation(NB)[:40], rng.permutation(NB)[:40]
    src = open_source(True, info_of(peer))
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


def test_a_copy_after_the_peer_worker_exited_fails(regions, mapper):
    peer, ours = regions
    info = info_of(peer, pid=mapper.pid, pid_start_ticks=start_time(mapper.pid))
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


def test_a_peer_file_that_shrank_is_refused_before_it_is_touched(regions):
    """Touching a page past the end of a shrunk file would be a SIGBUS (the worker dead); the size is checked
    through the descriptors we mapped before every piece."""
    peer, ours = regions
    src = open_source(True, info_of(peer))
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


def test_a_transport_offers_its_file_only_when_on(regions):
    from p2pworker.data import make_data_transport

    peer, _ = regions
    for on in (True, False):
        tr = make_data_transport(peer, backend="zmq", agent_name=f"offer-{on}", same_host=on)
        try:
            sh = tr.local_info().same_host
            assert (sh is not None) is on
            if on:
                assert sh.pid == os.getpid() and sh.boot_id == samehost.boot_id()
                assert [(f.path, f.dev, f.ino) for f in sh.files] == [
                    (s.path, os.stat(s.path).st_dev, os.stat(s.path).st_ino) for s in peer.handle.segments]
        finally:
            assert tr.close()


def test_odd_bytes_in_the_named_process_map_are_a_refusal_not_a_crash(shm_prefix, regions):
    """/proc/<pid>/maps shows mapped paths raw (any byte but a newline): a process the peer names that maps a
    file named with non-UTF-8 bytes must give a refusal (the link uses NIXL), not an exception out of add_peer."""
    peer, _ = regions
    odd = os.fsencode(f"/dev/shm/{shm_prefix}odd") + b"\xff\xfe name"
    with open(odd, "wb") as f:
        f.truncate(4096)
    p = subprocess.Popen([sys.executable, "-c", MAPPER, os.fsdecode(odd)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "mapped"
        got = refusal(info_of(peer, pid=p.pid, pid_start_ticks=start_time(p.pid)))
        assert got is Refusal.NOT_MAPPED  # it maps the odd file, not the peer's region
    finally:
        p.kill()
        p.wait()
        os.unlink(odd)
