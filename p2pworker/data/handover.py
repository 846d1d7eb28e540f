"""Handing our region's files to a same-host peer: the file descriptors themselves, over an abstract AF_UNIX
socket, to whoever presents our token (told only to authenticated peers, in the Hello's PeerDataInfo).

Why descriptors and not names: a path and a pid in the Hello are the peer's word.  A peer holding the shared
secret could name ANOTHER local process and a file that process maps, and the consumer would read that file with
its own permissions into rows the peer then fetches.  A descriptor is proof instead: a peer can hand over only
files it holds open for reading itself, and the kernel, not the peer, says which process holds the socket they
came over (the one that called ``listen()``: ``SO_PEERCRED``, translated into our PID namespace, 0 when that
process is not visible here; ``SO_PEERPIDFD``).  The producer names the socket and its network namespace in its
Hello, so in the consumer's namespace that name is the producer's own (an abstract name is bound once per
namespace).  Left open: a token holder could bind the name in the short window after the producer's worker closed
its handover socket at shutdown (a per-session token and a proof from the server would close it; lanes have that
proof).

Wire: ``SOCK_SEQPACKET``, one connection per handover, answered one at a time by the producer's handover thread::

    consumer's loop (bounded: TIMEOUT_S)           producer's handover thread
    connect("\\0" + name)                 ─────►   accept
    SO_PEERPIDFD: a pidfd of the listener's
      process (Linux 6.5+), mode P; older: mode A
    MAGIC + mode + token                   ─────►   compare in constant time; wrong: close, nothing sent
                                           ◄─────   b"F" + SCM_RIGHTS, <= FDS_PER_MESSAGE descriptors a message,
                                                    as many messages as the region has segment files
    SO_PEERCRED: the sender's pid here             mode P: close
    mode P: the pidfd must not show an exit;       mode A: wait for the ack or the close (<= timeout_s)
    mode A: pidfd_open(pid), then the
      connection must still be open (the
      sender waits): it lived while the pidfd
      was opened, so the pid was not reused;
      then the ack                         ─────►   close

Lane mode (MODE_LANE, no files): a session that dialed us proves the key it sent in its Hello, we prove it first,
and the proven connection goes to the worker's loop as that session's lane (:class:`LaneDial` has the wire;
p2pworker.control.lane what is sent over it).

The thread is the worker's only long-lived thread besides the copy pool: it reads no session state; it opens our
own region's files read-only (by path, checked to be the very files we map), hands them over and closes them.  It
serves all connections at once, each for at most ``timeout_s``: a local process without the token gets nothing,
and one that connects and stalls delays nobody (one that floods connections can crowd consumers out: they then
use the backend; see HandoverServer).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import math
import os
import platform
import re
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from p2pworker.errors import RegionIdentityError
from p2pworker.shm.region import READONLY_OPEN_FLAGS, file_id

log = logging.getLogger(__name__)

MAGIC = b"p2pwHO1\0"
MODE_PIDFD = b"P"  # the consumer holds a pidfd from SO_PEERPIDFD: hand over and close
MODE_ACK = b"A"  # the consumer opens our pidfd by pid: stay connected until its ack (or close)
MODE_LANE = b"L"  # no files: both ends prove a session's lane key, and the connection becomes that session's lane
ACK = b"A"
TOKEN_BYTES = 32
HELLO_BYTES = len(MAGIC) + 1 + TOKEN_BYTES
LANE_KEY_BYTES = 32  # chosen by the dialing session, told to its peer only in its Hello (authenticated link)
LANE_ID_BYTES = NONCE_BYTES = 16
LANE_HELLO_BYTES = HELLO_BYTES + LANE_ID_BYTES + NONCE_BYTES
MAC_BYTES = 32
SERVER_PROOF = b"S"  # + server nonce + HMAC(key, "server" | ids | client nonce + server nonce)
CLIENT_PROOF = b"C"  # + HMAC(key, "client" | ids | server nonce + client nonce)
LANE_TAKEN = b"K"  # the acceptor's loop took the lane for the session: the dialer may move its messages there
NAME_PREFIX = "p2pworker-ho-"
NAME_RE = re.compile(re.escape(NAME_PREFIX) + "[0-9a-f]{16}")  # what a peer may name (HandoverServer.name)
# The kernel takes at most SCM_MAX_FD (253) descriptors in one message; a region may have more segment files.
FDS_PER_MESSAGE = 200
# Bounds the consumer's add_peer (it runs on the worker's loop) and each step of the producer's answer.  A
# handover on one host takes well under a millisecond; a producer that does not answer in this long is treated
# as not on this host (the link uses the backend).
TIMEOUT_S = 1.0
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
# <asm-generic/socket.h>; Python 3.11 does not name it.  Other architectures number socket options otherwise:
# there we ask only when Python names it (else the mode A path).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77 if platform.machine() in ("x86_64", "aarch64") else None)
MAX_CONNS = 256  # connections a handover thread holds at once (each for at most timeout_s)
ACCEPTS_PER_WAKE = 64
ACCEPT_PAUSE_S = 0.1
# A region of more segment files than this is not offered (each is a descriptor on both sides during a handover,
# and the consumer keeps one per file); vLLM's CPU tier uses one file, or >= 1 GiB segments.  Not a limit a job
# reaches (invariant 8): a job's size never changes how many files the region has.
MAX_FILES = 1024


class Failure(enum.Enum):
    NO_ANSWER = "no answer on its local socket"  # another network namespace, token refused, timed out
    NO_PROCESS = "not visible here"  # the sender's pid is 0 here (another PID namespace) or it exited


class HandoverRefused(Exception):
    def __init__(self, failure: Failure, detail: str) -> None:
        super().__init__(f"{failure.value}: {detail}")
        self.failure = failure
        self.detail = detail


@dataclass
class Handed:
    """What a handover gave the consumer: the sender's pid as the kernel names it here, a pidfd of that process
    (the caller owns it), and the descriptors it sent (the caller closes them)."""

    pid: int
    pidfd: int
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


def _open_checked(paths: Sequence[str], ids: Sequence[tuple[int, int]]) -> list[int]:
    """Our region's files, read-only, each checked to be the file we map (a path may name another by now)."""
    fds: list[int] = []
    try:
        for path, want in zip(paths, ids, strict=True):
            fds.append(os.open(path, READONLY_OPEN_FLAGS))
            if file_id(fds[-1]) != tuple(want):
                raise RegionIdentityError(f"{path} is no longer the file this worker maps")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def lane_id(key: bytes) -> bytes:
    """What a lane's dialer names its key by on the wire (the key itself never crosses the local socket)."""
    return hashlib.sha256(b"p2pw-lane-id|" + key).digest()[:LANE_ID_BYTES]


def lane_ids(dialer: str, acceptor: str) -> bytes:
    """Whom a lane joins, as each end's session names them (node ids): part of both proofs, so a peer that passed
    a session's key on to a third worker cannot have that worker's session joined to ours."""
    return f"{dialer}|{acceptor}".encode()


def lane_mac(key: bytes, side: bytes, ids: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, b"p2pw-lane|" + side + b"|" + ids + b"|" + first + second, hashlib.sha256).digest()


class _Stage(enum.Enum):
    HELLO = "waiting for the hello"
    ACK = "waiting for the ack (mode A)"
    LANE = "waiting for the lane's client proof"


class _Next(enum.Enum):
    KEEP = "keep"  # more to come on this connection
    CLOSE = "close"
    HANDED = "handed"  # a proven lane: now the worker's loop owns the socket


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    stage: _Stage = _Stage.HELLO
    key: bytes = b""  # lane: the session key both ends proved
    ids: bytes = b""  # lane: lane_ids() of the session it belongs to
    link: str = ""  # lane: the control link of that session
    nonces: bytes = b""  # lane: client nonce + server nonce


class HandoverServer:
    """Hands read-only descriptors of ``paths`` (whose identities must stay ``ids``) to any connection that
    presents :attr:`token`.  Runs one daemon thread from construction to :meth:`close` (idempotent).

    The thread serves every connection at once (non-blocking, one poll), each for at most ``timeout_s``: a local
    process that opens connections and sends nothing delays nobody.  At most MAX_CONNS are held; a new one then
    evicts the oldest still waiting for its hello.  A local process (any uid: the abstract name is listed in
    /proc/net/unix) that keeps opening connections faster than consumers send their hello can still have them
    dropped: they use the backend (a refusal, never a failure)."""

    def __init__(self, paths: Sequence[str], ids: Sequence[tuple[int, int]], *, timeout_s: float = TIMEOUT_S):
        self.paths = tuple(paths)
        self.ids = tuple(tuple(i) for i in ids)
        for fd in _open_checked(self.paths, self.ids):  # fail now, in the caller, if the files are not ours
            os.close(fd)
        self.timeout_s = timeout_s
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.name = NAME_PREFIX + secrets.token_hex(8)  # abstract: nothing in any filesystem to leak
        self._closed = False
        self._conns: dict[int, _Conn] = {}
        # Lanes (docs/protocol.md "Same-host lane"): the worker's loop says which session keys to expect (lane id ->
        # (key, link)); proven lanes wait in _ready for it, and a byte on the wake pipe tells its poll.  One lock: the
        # loop and this thread both touch them.
        self._lock = threading.Lock()
        self._expected: dict[bytes, tuple[bytes, bytes, str]] = {}  # lane id -> (key, lane_ids, link)
        self._ready: list[tuple[str, bytes, socket.socket]] = []
        self._wake_r = self._wake_w = -1
        self._listen_again_at: float | None = None  # accept failed (EMFILE ...): the listener is not polled until
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._stop_r = self._stop_w = -1
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(socket.SOMAXCONN)  # a burst of consumers connecting at once is not refused
            self._sock.setblocking(False)
            self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._thread = threading.Thread(target=self._serve, name="p2pw-handover", daemon=True)
            self._thread.start()
        except BaseException:
            self._release()
            raise

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        listener = self._sock.fileno()
        try:
            while True:
                now = time.monotonic()
                self._expire(poller, now)
                for fd, _ in poller.poll(self._wait_ms(now)):
                    if fd == self._stop_r:
                        return
                    if fd == listener:
                        self._accept(poller)
                    elif fd in self._conns:
                        self._on_readable(poller, fd)
        finally:
            for fd in list(self._conns):
                self._drop(poller, fd)

    def _expire(self, poller: select.poll, now: float) -> None:
        """Drop the connections past their deadline; listen again once an accept pause is over."""
        for fd, c in list(self._conns.items()):
            if c.deadline <= now:
                self._drop(poller, fd)
        if self._listen_again_at is not None and now >= self._listen_again_at:
            poller.modify(self._sock.fileno(), select.POLLIN)
            self._listen_again_at = None

    def _wait_ms(self, now: float) -> int | None:
        wakes = [c.deadline for c in self._conns.values()]
        if self._listen_again_at is not None:
            wakes.append(self._listen_again_at)
        # wake for the nearest deadline; idle, block: an idle worker pays nothing here
        return max(1, math.ceil((min(wakes) - now) * 1000)) if wakes else None

    def _on_readable(self, poller: select.poll, fd: int) -> None:
        try:
            nxt = self._step(self._conns[fd])
        except RegionIdentityError as e:  # ours, not the peer's: every consumer would be refused
            log.warning("same-host handover refused: %s", e)
            nxt = _Next.CLOSE
        except Exception as e:  # a peer's bad connection never ends the thread
            log.debug("same-host handover: a connection ended without one: %s", e)
            nxt = _Next.CLOSE
        if nxt is _Next.CLOSE:
            self._drop(poller, fd)
        elif nxt is _Next.HANDED:
            self._hand_lane(poller, fd)

    def _accept(self, poller: select.poll) -> None:
        for _ in range(ACCEPTS_PER_WAKE):  # a flood of connects must not keep us from deadlines and the stop pipe
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE and the like: the connection stays queued, so the listener would poll readable at once,
                # forever: stop listening for a while (the waiting consumer may time out and use the backend)
                if self._listen_again_at is None:
                    log.warning("same-host handover: accept failed (%s); pausing %.1f s", e, ACCEPT_PAUSE_S)
                poller.modify(self._sock.fileno(), 0)
                self._listen_again_at = time.monotonic() + ACCEPT_PAUSE_S
                return
            if len(self._conns) >= MAX_CONNS:
                # Full: drop the oldest still waiting for its hello (a real consumer sends it right after connect,
                # so a held-open idle connection goes first), not the newest.
                waiting = [(c.deadline, fd) for fd, c in self._conns.items() if c.stage is _Stage.HELLO]
                if not waiting:
                    conn.close()
                    continue
                self._drop(poller, min(waiting)[1])
            conn.setblocking(False)
            self._conns[conn.fileno()] = _Conn(conn, time.monotonic() + self.timeout_s)
            poller.register(conn.fileno(), select.POLLIN)

    def _drop(self, poller: select.poll, fd: int) -> None:
        c = self._conns.pop(fd)
        poller.unregister(fd)
        c.sock.close()

    def _step(self, c: _Conn) -> _Next:
        """One readable connection: what to do with it next."""
        if c.stage is _Stage.ACK:
            return _Next.CLOSE  # the ack, or the consumer's close: either way it is done with us
        if c.stage is _Stage.LANE:
            proof = c.sock.recv(1 + MAC_BYTES + 1)
            want = CLIENT_PROOF + lane_mac(c.key, b"client", c.ids, c.nonces[NONCE_BYTES:], c.nonces[:NONCE_BYTES])
            return _Next.HANDED if hmac.compare_digest(proof, want) else _Next.CLOSE
        hello = c.sock.recv(LANE_HELLO_BYTES + 1)  # sent right after connect, in one datagram
        mode, token = hello[len(MAGIC):len(MAGIC) + 1], hello[len(MAGIC) + 1:HELLO_BYTES]
        size = LANE_HELLO_BYTES if mode == MODE_LANE else HELLO_BYTES
        if len(hello) != size or not hello.startswith(MAGIC) or mode not in (MODE_PIDFD, MODE_ACK, MODE_LANE) \
                or not hmac.compare_digest(token, self.token):
            return _Next.CLOSE  # closed with nothing sent
        if mode == MODE_LANE:
            lid, nonce_c = hello[HELLO_BYTES:HELLO_BYTES + LANE_ID_BYTES], hello[HELLO_BYTES + LANE_ID_BYTES:]
            with self._lock:
                expected = self._expected.get(lid)
            if expected is None:
                return _Next.CLOSE  # no session of ours told us this key: the dialer keeps to its control link
            c.key, c.ids, c.link = expected
            nonce_s = secrets.token_bytes(NONCE_BYTES)
            c.nonces = nonce_c + nonce_s
            # We prove the key first: the dialer sends its own proof only to whoever knows it (so a process that
            # bound this name in our place learns nothing it could replay).
            c.sock.send(SERVER_PROOF + nonce_s + lane_mac(c.key, b"server", c.ids, nonce_c, nonce_s))
            c.stage = _Stage.LANE
            return _Next.KEEP
        fds = _open_checked(self.paths, self.ids)
        try:
            for i in range(0, len(fds), FDS_PER_MESSAGE):
                # a fresh connection's buffer takes these few small datagrams; if not, the send raises and the
                # consumer sees the close (a refusal: it uses the backend)
                socket.send_fds(c.sock, [b"F"], fds[i:i + FDS_PER_MESSAGE])
        finally:
            for fd in fds:
                os.close(fd)  # the consumer holds its own copies now
        if mode == MODE_ACK:
            # Until the ack we stay connected: the consumer checks that we still are after it opened our pidfd by
            # pid.  A consumer with SO_PEERPIDFD needs no such wait.
            c.stage = _Stage.ACK
            return _Next.KEEP
        return _Next.CLOSE

    def _hand_lane(self, poller: select.poll, fd: int) -> None:
        c = self._conns.pop(fd)
        poller.unregister(fd)
        with self._lock:  # the list and the wake byte change together: the pipe is readable iff lanes wait
            if self._closed:
                c.sock.close()
                return
            self._ready.append((c.link, c.key, c.sock))
            try:
                os.write(self._wake_w, b"L")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already: the loop is woken

    # ------------------------------------------------------------ lanes (called from the worker's loop)
    def expect_lane(self, key: bytes, ids: bytes, link: str) -> None:
        """Accept a lane proving ``key`` (a session's, from its peer's Hello) and ``ids`` (:func:`lane_ids`) for the
        session on ``link``."""
        with self._lock:
            self._expected[lane_id(key)] = (key, ids, link)

    def forget_lane(self, key: bytes) -> None:
        with self._lock:
            self._expected.pop(lane_id(key), None)

    @property
    def wake_fd(self) -> int:
        """Readable when proven lanes wait for :meth:`take_lanes`."""
        return self._wake_r

    @property
    def lanes_waiting(self) -> bool:
        return bool(self._ready)  # a list's truth under the GIL: a stale answer only defers to the next turn

    def take_lanes(self) -> list[tuple[str, bytes, socket.socket]]:
        """Proven lanes: (the session's link, the key it proved, the socket); the caller owns the sockets and tells
        the dialer it took one (:data:`LANE_TAKEN`) or closes it."""
        with self._lock:  # with _hand_lane's write under the same lock: no wake byte is left for an empty list
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            out, self._ready = self._ready, []
        return out

    def _release(self) -> None:
        self._sock.close()
        with self._lock:
            ready, self._ready = self._ready, []
        for _, _, sock in ready:  # proven lanes the loop never took
            sock.close()
        for fd in (self._stop_r, self._stop_w, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = self._wake_r = self._wake_w = -1

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=5.0)  # it never blocks but in poll: it ends at once
        if self._thread.is_alive():  # never seen; leave its descriptors to it rather than close them under it
            log.warning("same-host handover thread did not end; its socket stays open until the process exits")
            return
        self._release()


_FD = struct.Struct("i")


def _recv_fds(s: socket.socket) -> tuple[bytes, list[int], int]:
    """One datagram and the descriptors it carries, received close-on-exec (socket.recv_fds would leave them
    inheritable by any process we start)."""
    msg, ancdata, flags, _ = s.recvmsg(16, socket.CMSG_SPACE(FDS_PER_MESSAGE * _FD.size), socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD.size
            fds.extend(x for (x,) in _FD.iter_unpack(data[:usable]))
    return msg, fds, flags


def peer_pidfd(s: socket.socket) -> int | None:
    """A pidfd of the process at the other end (SO_PEERPIDFD, Linux 6.5+), None where the kernel has none."""
    if SO_PEERPIDFD is None:
        return None
    try:
        return s.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        return None


def _ask(s: socket.socket, name: str, token: bytes, n_files: int, handed: Handed, left: Callable[[], float]) -> bool:
    """Connect to ``name``, present ``token`` and take the descriptors into ``handed``.  True when the sender waits
    for our ack (no pidfd from the kernel here)."""
    s.settimeout(left())
    s.connect("\0" + name)  # an abstract name: exists only in this network namespace
    pidfd = peer_pidfd(s)  # the listener's process, as the kernel recorded it at connect
    if pidfd is not None:
        handed.pidfd = pidfd
    mode_ack = pidfd is None
    s.settimeout(left())
    s.sendall(MAGIC + (MODE_ACK if mode_ack else MODE_PIDFD) + token)
    while len(handed.fds) < n_files:
        s.settimeout(left())
        msg, fds, flags = _recv_fds(s)
        handed.fds.extend(fds)  # first, so that they are closed whatever follows
        if not msg:
            raise HandoverRefused(Failure.NO_ANSWER, f"{name} closed without handing over files "
                                                     f"(our token refused, or it exited)")
        if msg != b"F" or flags & socket.MSG_CTRUNC or not fds:
            raise HandoverRefused(Failure.NO_ANSWER, f"{name} answered out of protocol")
    return mode_ack


def _pidfd_of_waiting_sender(s: socket.socket, pid: int, handed: Handed) -> None:
    """Older kernels: open the pidfd by pid, then make sure the sender is still connected (it waits for our ack in
    this mode): its socket open means its thread group is not gone, so the pid was not reaped and reused, and the
    pidfd names it (a process still exiting: its pidfd shows the exit soon, and every copy checks that after it
    ran)."""
    try:
        handed.pidfd = os.pidfd_open(pid)
    except OSError as e:
        raise HandoverRefused(Failure.NO_PROCESS, f"pidfd_open({pid}): {e}") from e
    s.setblocking(False)  # with a timeout set, Python would wait for data even under MSG_DONTWAIT
    try:
        extra = s.recv(1)
    except BlockingIOError:
        pass
    except OSError as e:
        raise HandoverRefused(Failure.NO_PROCESS, f"pid {pid} during the handover: {e}") from e
    else:
        why = "closed the handover before our ack (it may have exited)" if not extra else "sent more"
        raise HandoverRefused(Failure.NO_PROCESS, f"pid {pid} {why}")


def receive(name: str, token: bytes, n_files: int, timeout_s: float = TIMEOUT_S) -> Handed:
    """Ask the handover socket ``name`` for its descriptors.  Returns at most about ``timeout_s`` later, with
    the descriptors, the sender's pid as the kernel names it here and a pidfd of it, or raises
    :class:`HandoverRefused`.  Nothing received is left open when it raises."""
    deadline = time.monotonic() + timeout_s

    def left() -> float:  # a hard deadline for the whole handover, however the peer paces its messages
        rest = deadline - time.monotonic()
        if rest <= 0:
            raise TimeoutError(f"no handover within {timeout_s} s")
        return rest

    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    handed = Handed(pid=0, pidfd=-1)
    try:
        try:
            mode_ack = _ask(s, name, token, n_files, handed, left)
        except (OSError, ValueError) as e:  # refused, no such name here, timed out, reset
            raise HandoverRefused(Failure.NO_ANSWER, f"{name}: {type(e).__name__}: {e}") from e
        pid, _, _ = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if pid <= 0:
            raise HandoverRefused(Failure.NO_PROCESS, "its worker runs in a PID namespace not visible here")
        handed.pid = pid
        if handed.pidfd < 0:
            _pidfd_of_waiting_sender(s, pid, handed)
        # Whichever way the pidfd came: a process that already exited (then its vLLM may reuse the rows) is refused.
        p = select.poll()
        p.register(handed.pidfd, select.POLLIN)
        if p.poll(0):
            raise HandoverRefused(Failure.NO_PROCESS, f"pid {pid} exited during the handover")
        if mode_ack:
            try:
                s.send(ACK)  # a one-byte datagram into an idle socket's buffer: never blocks
            except OSError:
                pass  # what we hold is already checked; the sender only stops waiting
        return handed
    except BaseException:
        handed.close_fds()
        if handed.pidfd >= 0:
            os.close(handed.pidfd)
        raise
    finally:
        s.close()


class LaneRefused(Exception):
    """No lane: the session keeps to its control link (never an error for its jobs)."""


class LaneDial:
    """The dialing session's end of a lane until the server proved the key: non-blocking, driven by the worker's
    loop (readable: :meth:`step`), given up at ``deadline`` by its owner.

    Wire (``SOCK_SEQPACKET`` to the peer's handover socket)::

        MAGIC + "L" + token + lane_id(key) + client nonce   ─────►  did a session of ours get this key?
                                                                      no: close
        verify; wrong: refuse (not our peer)     ◄─────  "S" + server nonce + HMAC(key, server | ids | nonces)
        "C" + HMAC(key, client | ids | nonces)   ─────►  verify; wrong: close; right: to the worker's loop,
                                                          which checks the session is still there
        commit: LaneUp on the control link,      ◄─────  "K" (taken; its LaneUp goes out on the control link),
          then every message on the lane                  or close (no lane: the session stays on the link)

    ``ids`` (:func:`lane_ids`): both ends' node ids as this session knows them; the acceptor checks them against
    its own session's.
    """

    def __init__(self, name: str, token: bytes, key: bytes, ids: bytes, deadline: float) -> None:
        self.name = name
        self.key = key
        self.ids = ids
        self.deadline = deadline
        self.proved = False  # our proof went out: waiting for LANE_TAKEN
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self.sock: socket.socket | None = None
        try:
            self.sock = socket.socket(socket.AF_UNIX,
                                      socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
            # An abstract local socket: connect completes at once, or fails (EAGAIN: its backlog is full).
            self.sock.connect("\0" + name)
            self.sock.send(MAGIC + MODE_LANE + token + lane_id(key) + self._nonce)
        except OSError as e:  # EMFILE included: no lane, never an error for the session
            if self.sock is not None:
                self.sock.close()
            raise LaneRefused(f"{name}: {type(e).__name__}: {e}") from e

    def fileno(self) -> int:
        return self.sock.fileno()

    def step(self) -> bool:
        """The socket was readable: True once the acceptor's loop took the lane (``sock`` is then the lane, nothing
        of the lane's framing read from it yet); raises :class:`LaneRefused`."""
        try:
            msg = self.sock.recv(1 + NONCE_BYTES + MAC_BYTES + 1)
        except BlockingIOError:
            return False
        except OSError as e:
            raise LaneRefused(f"{self.name}: {type(e).__name__}: {e}") from e
        if self.proved:
            if msg == LANE_TAKEN:
                return True
            raise LaneRefused(f"{self.name} did not take the lane" if not msg else f"{self.name} answered "
                                                                                   f"out of protocol")
        if not msg:
            raise LaneRefused(f"{self.name} closed: no session there expects our key")
        nonce_s, mac = msg[1:1 + NONCE_BYTES], msg[1 + NONCE_BYTES:]
        if len(msg) != 1 + NONCE_BYTES + MAC_BYTES or msg[:1] != SERVER_PROOF or \
                not hmac.compare_digest(mac, lane_mac(self.key, b"server", self.ids, self._nonce, nonce_s)):
            # whoever holds that name does not know the key our session gave its peer (or names other ends)
            raise LaneRefused(f"{self.name} failed the session proof")
        try:
            self.sock.send(CLIENT_PROOF + lane_mac(self.key, b"client", self.ids, nonce_s, self._nonce))
        except OSError as e:
            raise LaneRefused(f"{self.name}: {type(e).__name__}: {e}") from e
        self.proved = True
        return False

    def close(self) -> None:
        self.sock.close()
