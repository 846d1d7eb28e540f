"""Fallback data transport over ZMQ: slower than NIXL, but it really moves the bytes.

Used when NIXL cannot be imported or cannot create its backend and the data
backend is ``auto``.  Each process binds one ROUTER "data socket" and keeps a
DEALER per peer.  A piece travels as one multipart message::

    [b"W", token, header, run_0 bytes, run_1 bytes, ...]
    header = msgpack WriteHeader(tid, seq, runs=[[remote_start, count], ...])

The receiver checks the token (a random secret it handed out only over the
authenticated control channel), checks every run against its own geometry and
every frame's length BEFORE writing anything, copies the frames into its
region, and answers ``[b"A", AckHeader(tid, seq, error)]``.  A piece without
an ack within ``ack_timeout_s`` fails.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

import msgspec
import numpy as np
import zmq

from p2pworker.data.base import PeerDataInfo, XferState
from p2pworker.data.pieces import Peer, PieceTransport, Transfer
from p2pworker.shm.region import KVRegion

log = logging.getLogger(__name__)

KIND_WRITE = b"W"
KIND_ACK = b"A"


class WriteHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    tid: int
    seq: int
    runs: list[tuple[int, int]]


class AckHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    tid: int
    seq: int
    error: str = ""


_write_dec = msgspec.msgpack.Decoder(WriteHeader)
_ack_dec = msgspec.msgpack.Decoder(AckHeader)
_enc = msgspec.msgpack.Encoder()


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
        **kw: Any,
    ):
        super().__init__(region, **kw)
        self.agent_name = agent_name
        self.ack_timeout_s = ack_timeout_s
        self.max_pieces_per_poll = max_pieces_per_poll
        self._token = os.urandom(16)
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, self.max_piece_bytes + (1 << 20))
        self._router.setsockopt(zmq.RCVHWM, 256)
        self._router.bind(f"tcp://{host}:0")
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._acks: dict[tuple[int, int], str] = {}  # (tid, seq) -> error ("" = ok)
        self._seq = 0
        self._buf = region.buffer()
        self.received_bytes = 0
        self.rejected_writes = 0

    def local_info(self) -> PeerDataInfo:
        return self._info(endpoint=self.endpoint, token=self._token)

    # ------------------------------------------------------------ sender side
    def _remote_add(self, peer: Peer, info: PeerDataInfo) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1024)
        sock.connect(info.endpoint)
        peer.extra = (sock, info.token)

    def _remote_forget(self, peer: Peer) -> None:
        if peer.extra is not None:
            peer.extra[0].close(linger=0)
            peer.extra = None

    def _post_piece(self, t: Transfer, piece: np.ndarray) -> tuple[XferState, Any]:
        sock, token = t.peer.extra
        bb = self._bb
        self._seq += 1
        header = WriteHeader(t.tid, self._seq, [(int(r), int(n)) for _, r, n in piece.tolist()])
        frames = [KIND_WRITE, token, _enc.encode(header)]
        frames += [self._buf[int(l0) * bb : int(l0 + n) * bb] for l0, _, n in piece.tolist()]
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
        return XferState.PROC, (t.tid, self._seq, self._clock() + self.ack_timeout_s)

    def _check_handle(self, handle: Any) -> XferState:
        tid, seq, deadline = handle
        err = self._acks.pop((tid, seq), None)
        if err is None:
            if self._clock() >= deadline:
                raise TimeoutError(f"no acknowledgement within {self.ack_timeout_s} s")
            return XferState.PROC
        if err:
            raise RuntimeError(f"peer refused the write: {err}")
        return XferState.DONE

    def _release_handle(self, handle: Any) -> None:
        self._acks.pop((handle[0], handle[1]), None)

    # ------------------------------------------------------------ both sides
    def _progress(self) -> None:
        for _ in range(self.max_pieces_per_poll):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._receive(frames)
        for peer in list(self._peers.values()) + self._retiring:
            if peer.extra is None:
                continue
            sock = peer.extra[0]
            while True:
                try:
                    kind, raw = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except ValueError:
                    continue  # wrong frame count: not ours
                if kind == KIND_ACK:
                    try:
                        ack = _ack_dec.decode(raw)
                    except (msgspec.MsgspecError, UnicodeDecodeError):
                        continue
                    self._acks[(ack.tid, ack.seq)] = ack.error or ""

    def _receive(self, frames: list) -> None:
        ident = frames[0].bytes
        header = None
        try:
            if len(frames) < 4 or frames[1].bytes != KIND_WRITE:
                raise ValueError("malformed write")
            if not hmac.compare_digest(frames[2].bytes, self._token):
                raise PermissionError("bad write token")
            header = _write_dec.decode(frames[3].buffer)
            data = frames[4:]
            if len(data) != len(header.runs):
                raise ValueError(f"{len(header.runs)} runs but {len(data)} data frames")
            bb, nb = self._bb, self._region.num_blocks
            for (start, count), frame in zip(header.runs, data):
                if count <= 0 or start < 0 or start + count > nb:
                    raise ValueError(f"run [{start}, {start + count}) outside 0..{nb}")
                if len(frame.buffer) != count * bb:
                    raise ValueError(f"run of {count} rows carries {len(frame.buffer)} bytes")
            for (start, count), frame in zip(header.runs, data):
                self._buf[start * bb : (start + count) * bb] = frame.buffer
                self.received_bytes += count * bb
            error = ""
        except (ValueError, PermissionError, msgspec.MsgspecError) as e:  # UnicodeDecodeError is a ValueError
            self.rejected_writes += 1
            log.warning("rejected a data write: %s", e)
            error = str(e)
        if header is None:
            return  # nothing to acknowledge to
        try:
            self._router.send_multipart(
                [ident, KIND_ACK, _enc.encode(AckHeader(header.tid, header.seq, error))], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as e:
            log.debug("ack to a vanished writer: %s", e)

    def _deregister(self) -> None:
        self._buf.release()
        self._router.close(linger=0)
