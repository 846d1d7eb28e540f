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
    ... no more than handover.MAX_FILES            UNUSABLE
    its handover socket has our naming             NO_SOCKET        a peer pointing us at another service
    ... in our network namespace                   NO_SOCKET        another network namespace
    the peer's worker hands us its files'          NO_SOCKET        it did not answer within 1 s, or refused
      descriptors on its local socket, for the
      token it told us (p2pworker.data.handover)
    the kernel names the socket's process          NO_PROCESS       a worker in a PID namespace not visible
      (SO_PEERCRED), and a pidfd of it shows no                     here, or it exited during the handover
      exit (SO_PEERPIDFD, or pidfd_open while it
      waits for our ack)
    the descriptors are the files it names, each   NOT_HELD         a peer naming files it does not hold, or
      open for reading                                              cannot read (O_PATH, write-only)
    every path opens here, without following       NO_FILE          a private /dev/shm (another mount namespace)
      a link or blocking
    ... a regular file, the very one handed over   OTHER_FILE       a same-named file in another /dev/shm
      (st_dev, st_ino of the descriptor we map)
    ... large enough for the peer's geometry       UNUSABLE         (or mmap failed)

The first seven need no I/O with the peer (:func:`precheck`); the rest is a round trip to the peer's handover
thread, run when we dial the peer (we mean to read from it) or, on a link the peer dialed, at our first read from
it (a PD producer accepting 64 consumers never reads from them: no handover for those links).

Then :class:`SameHostSource` is the peer's region mapped PROT_READ here plus a pidfd of its worker.  A copy is
one ``memmove`` per run (ctypes releases the GIL, so a large piece is split over ``copy_threads`` threads), and
runs synchronously inside the data transport's post, like NIXL's cma copy on one host: the piece is DONE when
the call returns, so the exactly-once and lease rules of :mod:`p2pworker.data.pieces` hold unchanged.

Trust: what we read is only what the peer's worker could open for reading itself (it hands over descriptors, not
names), and the process whose liveness we watch is the one the kernel says holds the handover socket the producer
named, in the network namespace the producer named, not a pid the peer advertised.  We still map
the path we open ourselves (checked to be the very file handed over): a container with its own /dev/shm keeps to
the backend, as its operator drew that line.  A process that may write the producer's file can shrink it while
we copy (SIGBUS: our worker dies, its jobs fail, no wrong byte); where that matters, set [data] same_host = false.

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
import fcntl
import itertools
import logging
import math
import os
import select
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from p2pworker.data import handover
from p2pworker.data.base import split_runs
from p2pworker.errors import RegionError, RegionIdentityError, TransferFailed
from p2pworker.protocol.peer_info import PeerDataInfo, RegionFile, SameHostInfo
from p2pworker.shm.prefault import Prefault, walk_refusal
from p2pworker.shm.region import SHM_DIR, KVRegion, RegionHandle, Segment, file_id

log = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class Refusal(enum.Enum):
    """Why a link does not use the same-host path (the value is what ``p2pworker inspect`` shows)."""

    OFF = "turned off here ([data] same_host = false)"
    NOT_OFFERED = "the peer does not offer its region file ([data] same_host = false there)"
    OTHER_BOOT = "another kernel (boot id differs): another host or VM"
    NOT_SHM = "the peer names a region file that is not directly under /dev/shm"
    NO_SOCKET = "the peer's worker does not hand over its files here (another network namespace, or no answer)"
    NO_PROCESS = "the peer's worker is not visible here (another PID namespace, or it exited)"
    NOT_HELD = "the peer's worker does not hold the files it names"
    NO_FILE = "the peer's region file does not open here (a private /dev/shm: another mount namespace)"
    OTHER_FILE = "the peer's region path opens another file here (device/inode differ)"
    UNUSABLE = "the peer's region file cannot be mapped for its geometry"


_FROM_HANDOVER = {handover.Failure.NO_ANSWER: Refusal.NO_SOCKET, handover.Failure.NO_PROCESS: Refusal.NO_PROCESS}


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


def net_namespace() -> tuple[int, int]:
    try:
        st = os.stat("/proc/self/ns/net")
    except OSError:
        return (0, 0)  # never equal to a peer's real one: the check fails closed
    return (st.st_dev, st.st_ino)


def serve(region: KVRegion) -> handover.HandoverServer:
    """The handover socket through which same-host peers get our region's files (the owner closes it)."""
    return handover.HandoverServer([seg.path for seg in region.handle.segments], region.file_ids)


def local_info(region: KVRegion, server: handover.HandoverServer) -> SameHostInfo:
    """What we offer a same-host peer: our kernel, the files behind our region as mapped, and where (and with
    which token) our worker hands their descriptors over."""
    files = tuple(
        RegionFile(seg.path, dev, ino, seg.nbytes, seg.file_offset)
        for seg, (dev, ino) in zip(region.handle.segments, region.file_ids)
    )
    return SameHostInfo(boot_id(), server.name, server.token, files, region.handle.data_offset, net_namespace())


class SameHostSource:
    """A peer's region mapped read-only here, and a pidfd of the worker that holds its leases.  Owned by one
    remote record of the data transport; :meth:`close` unmaps (only once nothing copies from it)."""

    def __init__(self, info: PeerDataInfo, sh: SameHostInfo, timeout_s: float = handover.TIMEOUT_S, *,
                 prefault: bool = False) -> None:
        self.pid = 0
        self._pidfd: int | None = None
        self._prefault: Prefault | None = None
        self._released = False  # the unmap is done or handed to the walk
        self._poll = select.poll()
        try:
            handed = handover.receive(sh.socket, sh.token, len(sh.files), timeout_s)
        except handover.HandoverRefused as e:
            raise NotSameHost(_FROM_HANDOVER[e.failure], e.detail) from e
        try:
            self.pid, self._pidfd = handed.pid, handed.pidfd
            self._poll.register(self._pidfd, select.POLLIN)  # readable once the process exited
            held = []
            for fd in handed.fds:
                fl = fcntl.fcntl(fd, fcntl.F_GETFL)
                # Open for reading: the peer could read the file itself.  An O_PATH or write-only descriptor needs
                # no read permission (O_PATH: only search on /dev/shm), and we must not read for it what it cannot.
                readable = not fl & os.O_PATH and fl & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR)
                held.append(file_id(fd) if readable else None)
            named = [(f.dev, f.ino) for f in sh.files]
            if held != named:
                # A peer naming files it did not hand over: they are not its own to offer (a third engine's region
                # would be read with OUR permissions on its behalf).
                raise NotSameHost(Refusal.NOT_HELD, f"handed {len(held)} file(s), not the {len(named)} it names")
            handle = RegionHandle(
                segments=tuple(Segment(f.path, f.nbytes, f.file_offset) for f in sh.files),
                num_blocks=info.num_blocks, block_bytes=info.block_bytes, data_offset=sh.data_offset,
            )
            try:
                # We map the path we open ourselves, checked to be the very file handed over: a consumer with its
                # own /dev/shm (a container) does not see the producer's file by its path, and keeps to the backend.
                self.region = KVRegion.attach_readonly(handle, tuple(held))
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
        finally:
            handed.close_fds()  # the identity proof is done; the map holds our own descriptors
        self.address = self.region.address
        if prefault:  # off the loop: the first copies out of a fresh mapping fault per page (p2pworker.shm.prefault)
            try:
                self._prefault = Prefault(self.region.address, self.region.nbytes, name=f"pid {self.pid}",
                                          refusal=walk_refusal(self.region.fds))
            except Exception as e:  # no thread to be had, say: copies fault as they would without it
                log.warning("not pre-faulting the region of pid %d: %s: %s", self.pid, type(e).__name__, e)

    @property
    def prefault(self) -> Prefault | None:
        """The pre-fault walk of the peer's region; None when ``prefault`` was off or its thread could not start."""
        return self._prefault

    def prefault_status(self) -> dict | None:
        return None if self._prefault is None else self._prefault.status()

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
        """Unmap (now, or by the pre-fault walk as it leaves the mapping) and drop the pidfd.  Idempotent; the caller
        guarantees no copy from it is running."""
        self._close_pidfd()
        region = getattr(self, "region", None)
        if region is None or self._released:
            return
        self._released = True
        if self._prefault is None:
            region.close()
        elif not self._prefault.stop_then(region.close):
            # unmapping under the walk could let it populate whatever is mapped at that address next: it unmaps
            log.warning("the pre-fault walk of pid %d's region is still inside it: unmapped as it leaves", self.pid)


def precheck(enabled: bool, info: PeerDataInfo) -> NotSameHost | None:
    """The checks of the table above that need no I/O with the peer (the flags, the boot id, the paths): the
    refusal, or None when the peer is a same-host candidate (then :func:`open_source` decides)."""
    if not enabled:
        return NotSameHost(Refusal.OFF)
    sh = info.same_host
    if sh is None:
        return NotSameHost(Refusal.NOT_OFFERED)
    ours = boot_id()
    if not ours or sh.boot_id != ours:
        return NotSameHost(Refusal.OTHER_BOOT, f"{sh.boot_id!r} vs ours {ours!r}")
    for f in sh.files:  # before anything opens them: only vLLM-style region files, by plain names
        if os.path.dirname(f.path) != SHM_DIR or os.path.basename(f.path) in ("", ".", ".."):
            return NotSameHost(Refusal.NOT_SHM, f.path)
    if len(sh.files) > handover.MAX_FILES:
        return NotSameHost(Refusal.UNUSABLE, f"{len(sh.files)} region files (more than {handover.MAX_FILES})")
    # We connect to the name the peer gives and send it a token: only to a p2pworker handover socket's name, never
    # to another local service's abstract socket a peer picked
    if not handover.NAME_RE.fullmatch(sh.socket) or len(sh.token) != handover.TOKEN_BYTES:
        return NotSameHost(Refusal.NO_SOCKET, f"not a p2pworker handover socket: {sh.socket[:80]!r}")
    # Its socket is bound in the network namespace it names; in any other, that name is not its: whoever bound
    # it there (another peer told the name) could hand over its files while the producer's worker is not the
    # process we would watch
    if tuple(sh.net_ns) != net_namespace():
        return NotSameHost(Refusal.NO_SOCKET, "another network namespace")
    return None


def open_source(enabled: bool, info: PeerDataInfo, *, prefault: bool = False) -> SameHostSource:
    """The checks of the table above, in order; raises :class:`NotSameHost` naming the first that fails.  Any
    other failure while checking (peer input we did not foresee) is a refusal too: the link then uses the
    backend, and the worker lives on (invariant 3)."""
    early = precheck(enabled, info)
    if early is not None:
        raise early
    try:
        return SameHostSource(info, info.same_host, prefault=prefault)
    except NotSameHost:
        raise
    except Exception as e:
        raise NotSameHost(Refusal.UNUSABLE, f"{type(e).__name__}: {e}") from e


AUTO_COPY_MIN_CPUS = 4


def available_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota (a container limited to 2 CPUs
    on a 64-core node has 64 in its mask but 2 CPUs' worth of time).  cgroup v2 ``cpu.max`` ("max 100000" or
    "200000 100000"), else v1 ``cpu/cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; no readable quota: the mask.  Only
    the cgroup mounted at ``cgroup_root`` is read (a container's own, with a cgroup namespace or Docker's v1 mounts),
    not a parent's quota nor a host process's systemd slice: there the mask is used, as before."""
    cpus = len(os.sched_getaffinity(0))
    quota = period = None
    try:
        with open(os.path.join(cgroup_root, "cpu.max")) as f:
            q, p = f.read().split()[:2]
        if q != "max":
            quota, period = int(q), int(p)
    except (OSError, ValueError):
        try:
            with open(os.path.join(cgroup_root, "cpu", "cpu.cfs_quota_us")) as f:
                q = int(f.read())
            with open(os.path.join(cgroup_root, "cpu", "cpu.cfs_period_us")) as f:
                p = int(f.read())
            if q > 0:
                quota, period = q, p
        except (OSError, ValueError):
            pass
    if quota and period and period > 0:
        # rounded up: 1.5 CPUs of time still leave a second thread room to run (3.5 -> 4 -> two copy threads)
        cpus = min(cpus, max(1, math.ceil(quota / period)))
    return cpus


def auto_copy_threads(cpus: int) -> int:
    """``copy_threads = 0``: how many threads share a large same-host copy on a host where this process may run on
    ``cpus`` CPUs (:func:`available_cpus`).  Below 4, one (the loop's own): a helper waits for a core that vLLM's
    schedulers and the peer's worker need, and pd_tier on 2 CPUs was as fast or faster with one
    (benchmarks/README.md, "Copy threads").  Two from 4 up, where a helper can have a core of its own: a second
    thread doubled a 16 MiB copy (48-51 vs 24-35 GB/s) in a process that had both of this 2-CPU machine's cores to
    itself.  The threshold of 4 itself was not measured (no larger host here)."""
    return 1 if cpus < AUTO_COPY_MIN_CPUS else 2


class Copier:
    """Copies runs of rows from a :class:`SameHostSource` into our region: one ``memmove`` per run.  A piece of at
    least ``split_bytes`` is cut into chunks of ``chunk_bytes`` that ``threads`` threads (this one included) take
    in turn from one counter.  Synchronous: every byte is copied when :meth:`copy` returns, or it raised.  ``pool``:
    the helpers' executor, made at the first split copy when not given; a given one becomes the copier's, and
    :meth:`close` shuts it down."""

    def __init__(self, dest: KVRegion, *, threads: int = 1, split_bytes: int = 4 << 20,
                 chunk_bytes: int = 1 << 20, pool: ThreadPoolExecutor | None = None) -> None:
        self._dest = dest.address
        self._bb = dest.block_bytes
        self.threads = max(1, threads)
        self.split_bytes = split_bytes
        self.chunk_bytes = chunk_bytes
        self._pool = pool  # the helpers' threads: made at the first split copy unless given (close() shuts it down)
        self.chunks_by_helpers = 0  # chunks the pool's threads copied (tests: the helpers really ran)

    def copy_runs(self, src: int, runs: np.ndarray) -> None:
        """Copy ``runs`` (local row, remote row, rows) from the mapping at ``src``: one memmove each.  With
        :meth:`take_chunks`, the points a test overrides to stall or fail one thread's share."""
        bb, dest, move = self._bb, self._dest, ctypes.memmove
        for l0, r0, n in runs.tolist():
            # Row writes (invariant 7): OUR rows only, by this process, inside the post of a piece that is reported
            # after this returns; the source is the peer's read-only mapping.
            move(dest + l0 * bb, src + r0 * bb, n * bb)

    def take_chunks(self, src: int, chunks: list[np.ndarray], counter: Iterator[int]) -> int:
        """Copy chunks until none is left: returns how many this thread copied.  ``next(counter)`` is atomic (one C
        call under the GIL), so each chunk is taken by exactly one thread."""
        n = len(chunks)
        done = 0
        while (i := next(counter)) < n:
            self.copy_runs(src, chunks[i])
            done += 1
        return done

    def copy(self, source: SameHostSource, runs: np.ndarray) -> None:
        nbytes = int(runs[:, 2].sum()) * self._bb
        # The peer's files are mapped here, but another process owns them: shrunk under the mapping, a page past
        # the end would be a SIGBUS that kills this worker (the adapter would fail its jobs and restart it: no
        # wrong byte, but every load in flight lost).  vLLM never shrinks a live region; a file that did is
        # refused here, before we touch it (only a race with our own copy remains: same_host = false removes it).
        if not source.region.sizes_ok():
            raise TransferFailed("the peer's region file shrank under its mapping")
        if self.threads == 1 or nbytes < self.split_bytes:
            self.copy_runs(source.address, runs)
        else:
            # Chunks taken in turn, not one equal share per thread: on a busy box a helper may wait for a core, and
            # an equal split would leave this thread waiting for it with its own share done (pd_tier's 128 MiB
            # trace: loop thread 10.4 ms of CPU in a 22.4 ms load).  Whoever runs copies.
            chunks = split_runs(runs, self._bb, self.chunk_bytes)
            counter = itertools.count()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="p2pw-copy")
            futures: list[Future] = []
            try:
                for _ in range(min(self.threads - 1, len(chunks) - 1)):
                    futures.append(self._pool.submit(self.take_chunks, source.address, chunks, counter))
                self.take_chunks(source.address, chunks, counter)
            finally:
                # A helper still queued (no core for it yet) has copied nothing and would find no chunk left: cancel
                # it rather than wait for it.  Every other one is waited for: nothing copies into our rows once we
                # return or raise (invariant 7), whatever raised here (a submit refused, a helper's error).
                # (wait() on a cancelled future would still block until a pool thread dequeued it.)
                started = [f for f in futures if not f.cancel()]
                wait(started)
            for f in started:
                self.chunks_by_helpers += f.result()
        if not source.alive():
            raise TransferFailed(
                f"the peer's worker (pid {source.pid}) exited during the copy: its vLLM may have reused the rows"
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
