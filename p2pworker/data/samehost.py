"""Same-host copy path: a consumer whose producer runs on this host copies the offered rows itself, out of a
read-only map of the producer's region file, at memcpy speed instead of through NIXL/UCX.

Used only when the handshake PROVES the consumer sees the producer's region and process, never assumed from an
address (127.0.0.1 may be another network namespace, a container, a VM's forwarded port).  The checks, in order;
the first that fails names why the link uses the backend (NIXL or the ZMQ fallback) instead::

    check                                          refusal when it fails
    our [data] same_host is on                     OFF
    the peer offers its files (its same_host on)   NOT_OFFERED
    same kernel: /proc/sys/kernel/random/boot_id   OTHER_BOOT       another host, another VM
    every file is directly under /dev/shm          NOT_SHM          a peer naming /dev/..., a FIFO's path, ../
    same PID namespace (/proc/self/ns/pid)         NO_PROCESS       a container with its own PID namespace
    the peer's worker is visible here: its pid     NO_PROCESS       gone, or pid reused
      with the same start time (pidfd opened,
      then the start time read again)
    that process maps every advertised file        NOT_MAPPED       a peer naming a file no process it names
      (/proc/<pid>/maps: device and inode)                          uses (see the trust note below)
    every segment path opens here, without         NO_FILE          a private /dev/shm (another mount namespace)
      following a link or blocking
    ... a regular file, the very one the peer      OTHER_FILE       a same-named file in another /dev/shm
      mapped (st_dev, st_ino of the descriptor
      we map)
    ... large enough for the peer's geometry       UNUSABLE         (or mmap failed)

Then :class:`SameHostSource` is the peer's region mapped PROT_READ here plus a pidfd of its worker.  A copy is
one ``memmove`` per run (ctypes releases the GIL, so a large piece is split over ``copy_threads`` threads), and
runs synchronously inside the data transport's post, like NIXL's cma copy on one host: the piece is DONE when
the call returns, so the exactly-once and lease rules of :mod:`p2pworker.data.pieces` hold unchanged.

Trust: the pid a peer advertises is checked (visible, same namespace, maps the files) but not bound to the
control connection the Hello came over.  A peer holding the shared secret, on this host, can therefore name
ANOTHER local process and a /dev/shm file that process maps, and we would copy that file's rows (read with our
permissions) into the rows granted for its keys.  Peers that hold the secret can already read every engine they
have a session with through NIXL; what this adds is files of other local processes that our uid may read.  And a
process that may write the producer's file can shrink it while we copy (SIGBUS: our worker dies, its jobs fail,
no wrong byte).  Where engines on one host must not trust each other that far, set [data] same_host = false.

Invariant 7, both sides: we write only OUR rows (the destination is our region; the peer's mapping is read-only,
a write there would fault).  A producer row must not be handed back to its vLLM while we still read it: the
producer's worker holds the offered rows under a lease until our Release (sent only after this copy returned and
the load was reported) or its expiry (longer than our own bound on a read).  What a lease cannot cover is the
producer's WORKER dying mid-copy: its vLLM then fails the parked jobs and may reuse the rows at once.  So after
each copy we ask the pidfd whether the worker still lives: alive after the copy means alive, and holding the
lease, during all of it; dead means the piece fails (the load is reported failed, never with those bytes).
"""

from __future__ import annotations

import ctypes
import enum
import os
import select
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from p2pworker.data.base import split_runs
from p2pworker.errors import RegionError, RegionIdentityError, TransferFailed
from p2pworker.protocol.peer_info import PeerDataInfo, RegionFile, SameHostInfo
from p2pworker.shm.liveness import start_time
from p2pworker.shm.region import SHM_DIR, KVRegion, RegionHandle, Segment

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class Refusal(enum.Enum):
    """Why a link does not use the same-host path (the value is what ``p2pworker inspect`` shows)."""

    OFF = "turned off here ([data] same_host = false)"
    NOT_OFFERED = "the peer does not offer its region file ([data] same_host = false there)"
    OTHER_BOOT = "another kernel (boot id differs): another host or VM"
    NOT_SHM = "the peer names a region file that is not directly under /dev/shm"
    NO_PROCESS = "the peer's worker is not visible here (another PID namespace, or it exited)"
    NOT_MAPPED = "the peer's worker does not map the files it names"
    NO_FILE = "the peer's region file does not open here (a private /dev/shm: another mount namespace)"
    OTHER_FILE = "the peer's region path opens another file here (device/inode differ)"
    UNUSABLE = "the peer's region file cannot be mapped for its geometry"


class NotSameHost(Exception):
    def __init__(self, refusal: Refusal, detail: str = "") -> None:
        super().__init__(f"{refusal.value}{': ' + detail if detail else ''}")
        self.refusal = refusal
        self.detail = detail


def boot_id() -> str:
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return ""  # never equal to a peer's: the check fails closed


def pid_namespace() -> tuple[int, int]:
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return (0, 0)  # never equal to a peer's real one: the check fails closed
    return (st.st_dev, st.st_ino)


# A worker's maps is ~100 KiB; a process mapping more is not one we copy from.  A bound on a process, not on a
# job (invariant 8): a region of any size is one line per segment file.
MAPS_MAX_BYTES = 16 << 20


def mapped_files(pid: int) -> set[tuple[int, int]] | None:
    """(st_dev, st_ino) of every file the process maps (/proc/<pid>/maps), None when we may not read it (or it is
    not the map of a worker).  Bytes, not text: a mapped path may hold any byte but a newline."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            data = f.read(MAPS_MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAPS_MAX_BYTES:
        return None
    out = set()
    for line in data.splitlines():
        parts = line.split(maxsplit=5)
        try:
            if len(parts) >= 5 and parts[4] != b"0":
                major, minor = (int(x, 16) for x in parts[3].split(b":"))
                out.add((os.makedev(major, minor), int(parts[4])))
        except ValueError:
            return None  # not the kernel's format: refuse rather than guess
    return out


def local_info(region: KVRegion) -> SameHostInfo:
    """What we offer a same-host peer: our kernel, our process, and the files behind our region as mapped."""
    pid = os.getpid()
    files = tuple(
        RegionFile(seg.path, dev, ino, seg.nbytes, seg.file_offset)
        for seg, (dev, ino) in zip(region.handle.segments, region.file_ids)
    )
    return SameHostInfo(boot_id(), pid, start_time(pid), files, region.handle.data_offset, pid_namespace())


class SameHostSource:
    """A peer's region mapped read-only here, and a pidfd of the worker that holds its leases.  Owned by one
    remote record of the data transport; :meth:`close` unmaps (only once nothing copies from it)."""

    def __init__(self, info: PeerDataInfo, sh: SameHostInfo) -> None:
        self.pid = sh.pid
        self._pidfd: int | None = None
        self._poll = select.poll()
        for f in sh.files:  # before anything opens them: only vLLM-style region files, by plain names
            if os.path.dirname(f.path) != SHM_DIR or os.path.basename(f.path) in ("", ".", ".."):
                raise NotSameHost(Refusal.NOT_SHM, f.path)
        if tuple(sh.pid_ns) != pid_namespace():
            raise NotSameHost(Refusal.NO_PROCESS, "another PID namespace")
        if not sh.pid_start_ticks or start_time(sh.pid) != sh.pid_start_ticks:  # 0: no such process here
            raise NotSameHost(Refusal.NO_PROCESS, f"pid {sh.pid}")
        try:
            self._pidfd = os.pidfd_open(sh.pid)
        except OSError as e:
            raise NotSameHost(Refusal.NO_PROCESS, f"pidfd_open({sh.pid}): {e}") from e
        try:
            # read again AFTER opening: the pidfd now surely names the process that started at that tick
            if start_time(sh.pid) != sh.pid_start_ticks:
                raise NotSameHost(Refusal.NO_PROCESS, f"pid {sh.pid} exited during the check")
            self._poll.register(self._pidfd, select.POLLIN)  # readable once the process exited
            # The files must be that process's own (it maps them): a peer could otherwise name any file it can stat,
            # e.g. a third engine's region, and have us read it with our permissions into rows it then fetches.
            mapped = mapped_files(sh.pid)
            if mapped is None:
                raise NotSameHost(Refusal.NO_PROCESS, f"/proc/{sh.pid}/maps is not readable here")
            missing = [f.path for f in sh.files if (f.dev, f.ino) not in mapped]
            if missing:
                raise NotSameHost(Refusal.NOT_MAPPED, ", ".join(missing))
            handle = RegionHandle(
                segments=tuple(Segment(f.path, f.nbytes, f.file_offset) for f in sh.files),
                num_blocks=info.num_blocks, block_bytes=info.block_bytes, data_offset=sh.data_offset,
            )
            try:
                self.region = KVRegion.attach_readonly(handle, tuple((f.dev, f.ino) for f in sh.files))
            except RegionIdentityError as e:
                raise NotSameHost(Refusal.OTHER_FILE, str(e)) from e
            except RegionError as e:  # missing file (geometry errors are RegionError too: checked first)
                missing = "does not exist" in str(e)
                raise NotSameHost(Refusal.NO_FILE if missing else Refusal.UNUSABLE, str(e)) from e
            except (OSError, ValueError) as e:  # permission denied, mmap refused
                refusal = Refusal.NO_FILE if isinstance(e, PermissionError) else Refusal.UNUSABLE
                raise NotSameHost(refusal, f"{type(e).__name__}: {e}") from e
        except BaseException:
            self._close_pidfd()
            raise
        self.address = self.region.address

    def alive(self) -> bool:
        """The peer's worker has not exited (the pidfd is not readable)."""
        if self._pidfd is None:
            return False
        return not self._poll.poll(0)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            os.close(fd)

    def close(self) -> None:
        """Unmap and drop the pidfd.  Idempotent; the caller guarantees no copy from it is running."""
        self._close_pidfd()
        region = getattr(self, "region", None)
        if region is not None:
            region.close()


def open_source(enabled: bool, info: PeerDataInfo) -> SameHostSource:
    """The checks of the table above, in order; raises :class:`NotSameHost` naming the first that fails.  Any
    other failure while checking (peer input we did not foresee) is a refusal too: the link then uses the
    backend, and the worker lives on (invariant 3)."""
    if not enabled:
        raise NotSameHost(Refusal.OFF)
    sh = info.same_host
    if sh is None:
        raise NotSameHost(Refusal.NOT_OFFERED)
    ours = boot_id()
    if not ours or sh.boot_id != ours:
        raise NotSameHost(Refusal.OTHER_BOOT, f"{sh.boot_id!r} vs ours {ours!r}")
    try:
        return SameHostSource(info, sh)
    except NotSameHost:
        raise
    except Exception as e:
        raise NotSameHost(Refusal.UNUSABLE, f"{type(e).__name__}: {e}") from e


class Copier:
    """Copies runs of rows from a :class:`SameHostSource` into our region: one ``memmove`` per run, the runs of a
    piece of at least ``split_bytes`` spread over ``threads`` threads (this one included).  Synchronous: every
    byte is copied when :meth:`copy` returns, or it raised."""

    def __init__(self, dest: KVRegion, *, threads: int = 1, split_bytes: int = 4 << 20) -> None:
        self._dest = dest.address
        self._bb = dest.block_bytes
        self.threads = max(1, threads)
        self.split_bytes = split_bytes
        self._pool: ThreadPoolExecutor | None = None

    def _copy_runs(self, src: int, runs: np.ndarray) -> None:
        bb, dest, move = self._bb, self._dest, ctypes.memmove
        for l0, r0, n in runs.tolist():
            # Row writes (invariant 7): OUR rows only, by this process, inside the post of a piece that is reported
            # after this returns; the source is the peer's read-only mapping.
            move(dest + l0 * bb, src + r0 * bb, n * bb)

    def copy(self, source: SameHostSource, runs: np.ndarray) -> None:
        nbytes = int(runs[:, 2].sum()) * self._bb
        # The peer's files are mapped here, but another process owns them: shrunk under the mapping, a page past
        # the end would be a SIGBUS that kills this worker (the adapter would fail its jobs and restart it: no
        # wrong byte, but every load in flight lost).  vLLM never shrinks a live region; a file that did is
        # refused here, before we touch it (only a race with our own copy remains: same_host = false removes it).
        if not source.region.sizes_ok():
            raise TransferFailed("the peer's region file shrank under its mapping")
        if self.threads == 1 or nbytes < self.split_bytes:
            self._copy_runs(source.address, runs)
        else:
            parts = split_runs(runs, self._bb, -(-nbytes // self.threads))
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="p2pw-copy")
            futures = [self._pool.submit(self._copy_runs, source.address, p) for p in parts[1:]]
            try:
                self._copy_runs(source.address, parts[0])
            finally:
                wait(futures)  # every part ended before we return (or raise): nothing copies into our rows later
            for f in futures:
                f.result()
        if not source.alive():
            raise TransferFailed(
                f"the peer's worker (pid {source.pid}) exited during the copy: its vLLM may have reused the rows"
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
