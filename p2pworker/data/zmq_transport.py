"""Fallback data transport over ZMQ, pull direction: slower than NIXL, but it really moves the bytes.

Used when NIXL cannot be imported, started or registered and the data backend
is ``auto``.  Each process binds one ROUTER "data socket" (its producer side:
it serves reads of its own rows) and keeps one DEALER per remote agent (its
consumer side).  One posted piece is one round trip::

    consumer: DEALER per remote agent                    producer: ROUTER (data socket)
      [b"R", token, ReadHeader]             ───────►     check the token and every run against
                                                         its own geometry; copy the rows out NOW
      [b"D", DataHeader, run_0, run_1, ...] ◄───────     (an error reply carries no run frames)

    ReadHeader = msgpack [tid, seq, [[remote_start, count], ...]]
    DataHeader = msgpack [tid, seq, error]           error "" = ok, then one frame per run

The token is a random secret the producer handed out only over the
authenticated control channel (compared in constant time).  The consumer does
the copy itself, and only into a piece that is still open::

    piece (tid, seq)  OPEN ──D, in time, every frame the length of its local run──► copied, DONE
                        │  ──D with an error────────────────────────────────────► failed (producer's reason)
                        │  ──D with a missing frame or a wrong length───────────► failed, nothing copied
                        │  ──no D within ack_timeout_s──────────────────────────► failed
                        └  ──its transfer cancelled─────────────────────────────► abandoned at once
    a D for a piece not OPEN (abandoned, timed out, answered, reported): dropped, counted in late_replies

So no row is written for a transfer that was cancelled, timed out or
reported, whenever the producer's reply arrives; that is why this backend,
unlike NIXL, may abandon posted pieces on cancel.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from p2pworker.data.base import PeerDataInfo, XferState
from p2pworker.data.pieces import PieceTransport, Remote, Transfer
from p2pworker.errors import TransferFailed
from p2pworker.shm.region import KVRegion

log = logging.getLogger(__name__)

KIND_READ = b"R"
KIND_DATA = b"D"

_REQUEST_MAX_BYTES = 4 << 20  # a ReadHeader: ~10 bytes per run, a run per row at worst


class ReadHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    tid: int
    seq: int
    runs: list[tuple[int, int]]  # (remote_start, count): rows of the producer's region


class DataHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    tid: int
    seq: int
    error: str = ""


_read_dec = msgspec.msgpack.Decoder(ReadHeader)
_data_dec = msgspec.msgpack.Decoder(DataHeader)
_enc = msgspec.msgpack.Encoder()


class _Dealer(NamedTuple):
    """``Remote.state``: the socket to one remote agent's data socket, and its token."""

    sock: zmq.Socket
    token: bytes


@dataclass(eq=False)
class _OpenPiece:
    sock: zmq.Socket  # the DEALER the request went out on: only its producer may answer
    local_runs: list[tuple[int, int]]  # (local_start, count), in request order: where the frames go
    deadline: float
    result: str | None = None  # None: waiting; "": copied; otherwise why it failed


class ZmqTransport(PieceTransport):
    backend = "zmq"

    def __init__(
        self,
        region: KVRegion,
        *,
        agent_name: str,
        host: str = "127.0.0.1",
        ack_timeout_s: float = 3.0,  # the default heartbeat deadline (1 s x 3)
        max_pieces_per_poll: int = 64,
        max_serve_bytes: int = 64 << 20,  # the largest read we serve in one reply (bounds our memory)
        **kw: Any,
    ):
        super().__init__(region, **kw)
        self.agent_name = agent_name
        self.ack_timeout_s = ack_timeout_s
        self.max_pieces_per_poll = max_pieces_per_poll
        self.max_serve_bytes = max_serve_bytes
        self._token = os.urandom(16)
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, _REQUEST_MAX_BYTES)
        self._router.setsockopt(zmq.RCVHWM, 256)
        self._router.setsockopt(zmq.SNDHWM, 256)
        # A reply that cannot be queued raises instead of vanishing, so it is counted; the
        # consumer's piece then fails at its deadline.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.bind(f"tcp://{host}:0")
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._open: dict[tuple[int, int], _OpenPiece] = {}  # (tid, seq) -> posted piece awaiting its reply
        self._seq = 0
        self._buf = region.buffer()
        self.received_bytes = 0  # copied into our rows
        self.served_bytes = 0  # copied out of our rows to readers
        self.rejected_reads = 0  # requests refused (token, geometry, size, malformed)
        self.rejected_replies = 0  # replies refused (malformed, wrong lengths, wrong socket)
        self.late_replies = 0  # replies for pieces no longer open: dropped, nothing copied
        self.dropped_replies = 0  # replies we could not queue to a reader

    def local_info(self) -> PeerDataInfo:
        return self._info(endpoint=self.endpoint, token=self._token)

    # ------------------------------------------------------------ consumer side
    def _remote_add(self, name: str, info: PeerDataInfo) -> Any:
        sock = None
        try:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1024)
            # Our own pieces bound what a reply may carry; a bigger frame is the producer's bug.
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_piece_bytes + (1 << 20))
            sock.connect(info.endpoint)
        except zmq.ZMQError as e:
            if sock is not None:
                sock.close(linger=0)
            raise TransferFailed(f"cannot connect to agent {name!r}'s data socket {info.endpoint!r}: {e}") from e
        return _Dealer(sock, info.token)

    def _remote_forget(self, remote: Remote) -> None:
        if remote.state is not None:
            remote.state.sock.close(linger=0)
            remote.state = None

    def _post_piece(self, t: Transfer, piece: np.ndarray) -> tuple[XferState, Any]:
        dealer: _Dealer = t.peer.remote.state
        runs = piece.tolist()
        self._seq += 1
        header = ReadHeader(t.tid, self._seq, [(r, n) for _, r, n in runs])
        dealer.sock.send_multipart([KIND_READ, dealer.token, _enc.encode(header)], flags=zmq.NOBLOCK)
        key = (t.tid, self._seq)
        self._open[key] = _OpenPiece(dealer.sock, [(l0, n) for l0, _, n in runs], self._clock() + self.ack_timeout_s)
        return XferState.PROC, key

    def _check_handle(self, handle: Any) -> XferState:
        op = self._open.get(handle)
        if op is None:  # not reachable: released and abandoned handles are never checked again
            return XferState.ERR
        if op.result is None:
            if self._clock() >= op.deadline:
                raise TimeoutError(f"no reply within {self.ack_timeout_s} s")
            return XferState.PROC
        if op.result:
            raise RuntimeError(op.result)
        return XferState.DONE

    def _release_handle(self, handle: Any) -> None:
        self._open.pop(handle, None)  # closed: a reply still on its way is dropped

    def _abandon_handle(self, handle: Any) -> bool:
        # We do the copy ourselves and only into an open piece: once closed, nothing lands.
        self._open.pop(handle, None)
        return True

    def _on_reply(self, sock: zmq.Socket, frames: list) -> None:
        try:
            if len(frames) < 2 or frames[0].bytes != KIND_DATA:
                raise ValueError("not a data reply")
            header = _data_dec.decode(frames[1].buffer)
        except (ValueError, msgspec.MsgspecError) as e:  # UnicodeDecodeError is a ValueError
            self.rejected_replies += 1
            log.warning("dropped a malformed data reply: %s", e)
            return
        op = self._open.get((header.tid, header.seq))
        if op is None or op.result is not None or self._clock() >= op.deadline:
            # Abandoned, timed out, answered or reported: the rows may be vLLM's again.
            self.late_replies += 1
            return
        if op.sock is not sock:
            self.rejected_replies += 1  # another producer may neither fill nor fail our piece
            return
        if header.error:
            op.result = f"the producer refused the read: {header.error}"
            return
        data, bb = frames[2:], self._bb
        # Check every frame BEFORE copying any: a half-copied piece would still be a failed one.
        if len(data) != len(op.local_runs) or any(
            len(f.buffer) != n * bb for (_, n), f in zip(op.local_runs, data)
        ):
            self.rejected_replies += 1
            op.result = (
                f"malformed reply: {len(data)} frame(s) for {len(op.local_runs)} run(s), "
                f"or a frame whose length is not its run's rows x {bb} bytes"
            )
            return
        # Row writes (invariant 7): this process copies a reply into its OWN rows, only for a piece still open
        # (cancel/time-out closes it first, and a closed piece's reply is dropped above), so nothing lands after
        # the transfer, and hence the load covering these rows, was reported.
        for (start, n), f in zip(op.local_runs, data):
            self._buf[start * bb : (start + n) * bb] = f.buffer
            self.received_bytes += n * bb
        op.result = ""

    # ------------------------------------------------------------ producer side
    def _serve(self, frames: list) -> None:
        ident = frames[0].bytes
        header = None
        served = 0
        try:
            if len(frames) != 4 or frames[1].bytes != KIND_READ:
                raise ValueError("malformed read request")
            header = _read_dec.decode(frames[3].buffer)
            if not hmac.compare_digest(frames[2].bytes, self._token):
                raise PermissionError("bad read token")
            if not header.runs:
                raise ValueError("a read of no rows")
            bb, nb = self._bb, self._region.num_blocks
            rows = 0
            for start, count in header.runs:
                if count <= 0 or start < 0 or start + count > nb:
                    raise ValueError(f"run [{start}, {start + count}) outside 0..{nb}")
                rows += count
            if rows * bb > self.max_serve_bytes:
                raise ValueError(f"a read of {rows * bb} bytes, above max_serve_bytes={self.max_serve_bytes}")
            reply = [ident, KIND_DATA, _enc.encode(DataHeader(header.tid, header.seq))]
            reply += [self._buf[start * bb : (start + count) * bb] for start, count in header.runs]
            served = rows * bb
        except (ValueError, PermissionError, msgspec.MsgspecError) as e:
            self.rejected_reads += 1
            log.warning("refused a data read: %s", e)
            if header is None:
                return  # nothing to answer to
            reply = [ident, KIND_DATA, _enc.encode(DataHeader(header.tid, header.seq, str(e)[:500]))]
        try:
            # copy=True: the bytes leave our region now, not when ZMQ gets round to sending them.
            self._router.send_multipart(reply, flags=zmq.NOBLOCK, copy=True)
            self.served_bytes += served
        except zmq.ZMQError as e:
            self.dropped_replies += 1
            log.debug("reply to a vanished or saturated reader: %s", e)

    # ------------------------------------------------------------ both sides
    def _progress(self) -> None:
        for _ in range(self.max_pieces_per_poll):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._serve(frames)
        for remote in list(self.peer_book.remotes.values()):
            if remote.state is None:
                continue
            sock = remote.state.sock
            for _ in range(self.max_pieces_per_poll):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_reply(sock, frames)

    def _deregister(self) -> None:
        self._open.clear()
        self._buf.release()
        self._router.close(linger=0)
