"""A session's same-host lane: its messages over a local ``SOCK_SEQPACKET`` connection instead of ZMQ.

Why: on one host a ZMQ message wakes four threads (our I/O thread, the peer's I/O thread, then the peer's loop;
the same back), and a Fetch/Offer round trip between two sleeping workers took 410-520 us here against 41 us
over a local socket pair (benchmarks/hops' profile, benchmarks/README.md).  The lane is opened by the session that
dialed the control link, to its peer's handover socket, once both ends proved the key that session sent in its Hello
(:class:`p2pworker.data.handover.LaneDial`).  The control link stays: heartbeats, liveness, the handshake.

Order: each direction switches once.  A worker whose lane is up sends ``LaneUp`` on the control link and every
later message of that session on the lane; its peer reads the lane only after that ``LaneUp``, so a session sees
one ordered stream from each peer, as before.

Invariant 7: a lane carries session messages only and writes no row; a Release (which unpins a producer's rows)
is read from it only after that session's peer proved the session's key and said LaneUp.  Invariant 8: frames up
to the control link's max_frame_bytes, in datagrams of CHUNK_BYTES; the outbox is bounded in frames (a job of
MAX_JOB_KEYS keys is ~130 of them), not bytes.

Frames: a message may be larger than what one datagram carries (a socket's buffer bounds it), so each goes as
datagrams of at most ``CHUNK_BYTES``, the first byte saying whether more follow.  What the socket cannot take now
waits in an outbox (bounded in frames: ``MAX_OUTBOX_FRAMES``, past which the lane is broken, as a ZMQ link past its
high-water mark), flushed on every loop turn.
"""

from __future__ import annotations

import collections
import enum
import errno
import socket

from p2pworker.errors import P2PError

CHUNK_BYTES = 64 << 10
MORE, LAST = b"M", b"E"
MAX_OUTBOX_FRAMES = 1000  # as the control link's hwm (the worker passes its setting): past it, the lane is broken
MAX_FRAME_BYTES = 4 << 20  # as the control link's default max_frame_bytes (the worker passes its setting)
SOCKET_BUFFER_BYTES = 4 << 20  # asked for; the kernel caps it (net.core.wmem_max)


class LaneBroken(P2PError):
    pass


class LaneClosed(LaneBroken):
    """The peer's end is gone: its worker closed the session's lane, or exited."""


_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)


def _broken(what: str, e: OSError) -> LaneBroken:
    if e.errno in _GONE:
        return LaneClosed(f"the peer closed its lane ({what}: {e.strerror})")
    return LaneBroken(f"lane {what}: {type(e).__name__}: {e}")


class LaneState(enum.Enum):
    UP = "up"  # proven; our messages go on it once LaneUp went out on the control link
    CLOSED = "closed"


class Lane:
    """One proven lane (either end).  ``reading``: the peer's LaneUp arrived, so its frames are read from here."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int | None = None, max_queued: int | None = None) -> None:
        self.max_frame_bytes = MAX_FRAME_BYTES if max_frame_bytes is None else max_frame_bytes
        # Frames, not bytes, as ZMQ's high-water mark: a job of MAX_JOB_KEYS keys (invariant 8) sends ~130 frames
        # of up to ~1 MB at once, which must wait here, not break the session.
        self.max_queued = MAX_OUTBOX_FRAMES if max_queued is None else max_queued
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            except OSError:
                pass  # the default buffer works too: the outbox and the chunks absorb it
        self.sock = sock
        self.state = LaneState.UP
        self.reading = False
        self._out: collections.deque[bytes] = collections.deque()
        self._queued = 0  # frames whose last datagram is still in _out
        self._partial: list[bytes] = []
        self._partial_bytes = 0
        self._then: LaneBroken | None = None  # what ended the lane after the frames recv() returned last
        self.frames_out = self.frames_in = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def backlog(self) -> bool:
        """Datagrams wait for room in the socket."""
        return bool(self._out)

    def send(self, frame: bytes) -> None:
        if self.state is LaneState.CLOSED:
            raise LaneBroken("the lane is closed")
        n = len(frame)
        if n > self.max_frame_bytes - 64:  # what the control link refuses too (the peer would drop it)
            raise P2PError(f"control payload of {n} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        if self._queued >= self.max_queued:
            raise LaneBroken(f"the peer has not read {self._queued} frames of its lane")
        for i in range(0, max(n, 1), CHUNK_BYTES):
            self._out.append((MORE if i + CHUNK_BYTES < n else LAST) + frame[i:i + CHUNK_BYTES])
        self._queued += 1
        self.frames_out += 1
        self.flush()

    def flush(self) -> None:
        out, sock = self._out, self.sock
        try:
            while out:
                sock.send(out[0])
                if out.popleft()[:1] == LAST:
                    self._queued -= 1
        except BlockingIOError:
            return  # full: the rest goes on a later loop turn, in order
        except OSError as e:
            raise _broken("send", e) from e

    def recv(self, max_frames: int = 256) -> list[bytes]:
        """Whole frames the peer sent (at most ``max_frames``, so one busy lane cannot starve the loop); raises
        :class:`LaneBroken` when the peer closed it or broke the framing."""
        if self._then is not None:
            raise self._then
        frames: list[bytes] = []
        sock = self.sock
        reset: LaneBroken | None = None
        while len(frames) < max_frames:
            try:
                d = sock.recv(CHUNK_BYTES + 1)
            except BlockingIOError:
                end = reset
                if end is None:
                    break
            except OSError as e:
                end = _broken("recv", e)
                if e.errno == errno.ECONNRESET and reset is None:
                    # Linux says "reset" (the peer closed with our frames unread) BEFORE the frames it sent last:
                    # read those first (its Bye, its reason), then the end
                    reset = end
                    continue
            else:
                end = None if d else (reset or LaneClosed("the peer closed its lane"))
            if end is not None:
                if frames:  # e.g. a Bye, then the close: the session sees the Bye (and its reason) first
                    self._then = end
                    break
                raise end
            frame = self._assemble(d)
            if frame is not None:
                frames.append(frame)
        self.frames_in += len(frames)
        return frames

    def _assemble(self, d: bytes) -> bytes | None:
        """One datagram onto the frame being read: the whole frame when the datagram was its last."""
        flag, body = d[:1], d[1:]
        if flag not in (MORE, LAST):
            raise LaneBroken("a lane datagram out of framing")
        self._partial.append(body)
        self._partial_bytes += len(body)
        if self._partial_bytes > self.max_frame_bytes:
            raise LaneBroken(f"a lane frame past {self.max_frame_bytes} bytes")
        if flag != LAST:
            return None
        frame = b"".join(self._partial)
        self._partial, self._partial_bytes = [], 0
        return frame

    def close(self) -> None:
        if self.state is not LaneState.CLOSED:
            self.state = LaneState.CLOSED
            self.sock.close()
            self._out.clear()
            self._queued = 0
