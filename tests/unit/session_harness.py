"""An in-memory pair of sessions: fake clock, fake data transport that records writes, frames in lists."""

from __future__ import annotations

from p2pworker.data.base import PeerDataInfo
from p2pworker.errors import TransferFailed
from p2pworker.fingerprint import Fingerprint
from p2pworker.protocol import messages as m
from p2pworker.session import ParkingLot, Reporter, Session, SessionConfig, SessionContext

BLOCK = 4096


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class FakeData:
    """Records every write; results are delivered by the test (``complete``)."""

    def __init__(self) -> None:
        self.peers: dict[str, PeerDataInfo] = {}
        self.writes: list[tuple[str, int, list[int], list[int]]] = []
        self.pending: dict[int, str] = {}
        self.cancelled: set[int] = set()
        self.fail_submit = False
        self.removed: list[str] = []
        self._next = 1

    def add_peer(self, peer_id, info):
        if info.block_bytes != BLOCK:
            raise TransferFailed(f"block_bytes={info.block_bytes}, local block_bytes={BLOCK}")
        self.peers[peer_id] = info

    def remove_peer(self, peer_id):
        self.peers.pop(peer_id, None)
        self.removed.append(peer_id)

    def write_blocks(self, peer_id, local_rows, remote_rows):
        if self.fail_submit:
            raise TransferFailed("injected submit failure")
        if peer_id not in self.peers:
            raise TransferFailed(f"unknown data peer {peer_id!r}")
        tid = self._next
        self._next += 1
        self.writes.append((peer_id, tid, list(local_rows), list(remote_rows)))
        self.pending[tid] = peer_id
        return tid

    def cancel(self, ids, wait=False, timeout_s=5.0):
        self.cancelled.update(ids)


def info(node: str, num_blocks: int = 64, block_bytes: int = BLOCK) -> PeerDataInfo:
    return PeerDataInfo("fake", node, 0, num_blocks, block_bytes)


class Side:
    def __init__(self, node: str, clock: Clock, *, fingerprint: Fingerprint | None = None, num_blocks: int = 64,
                 block_bytes: int = BLOCK, config: SessionConfig | None = None):
        self.node = node
        self.data = FakeData()
        self.reporter = Reporter()
        self.lot = ParkingLot(self.reporter, clock, block_bytes=block_bytes, park_timeout_s=60.0)
        self.ctx = SessionContext(
            node_id=node, data_info=info(node, num_blocks, block_bytes),
            fingerprint=fingerprint or Fingerprint.build(block_bytes=BLOCK, protocol_version=m.PROTOCOL_VERSION),
            data=self.data, reporter=self.reporter, lot=self.lot, clock=clock, config=config or SessionConfig(),
        )
        self.outbox: list[bytes] = []
        self.session: Session | None = None

    def new_session(self, expected_peer_id=None) -> Session:
        self.outbox = []
        self.session = Session(self.ctx, self.outbox.append, expected_peer_id=expected_peer_id)
        return self.session

    def complete(self, tid: int, ok: bool = True, reason: str = "") -> None:
        self.data.pending.pop(tid, None)
        self.ctx.on_write_result(tid, ok, reason)

    def complete_all(self, ok: bool = True) -> None:
        for tid in list(self.data.pending):
            self.complete(tid, ok, "" if ok else "injected failure")

    def events(self):
        return self.reporter.take()


class Pair:
    """A (consumer, initiator) <-> B (producer, acceptor)."""

    def __init__(self, **kw):
        self.clock = Clock()
        self.a = Side("A", self.clock, **kw.pop("a", {}))
        self.b = Side("B", self.clock, **kw.pop("b", {}))
        self.sa = self.a.new_session()
        self.sb = self.b.new_session()
        self.wire_a_to_b: list[bytes] = []  # every frame A sent, for checks

    def deliver(self, max_frames: int | None = None) -> int:
        """Move frames both ways until quiet (or ``max_frames``)."""
        n = 0
        while self.a.outbox or self.b.outbox:
            for src, dst in ((self.a, self.sb), (self.b, self.sa)):
                while src.outbox:
                    if max_frames is not None and n >= max_frames:
                        return n
                    frame = src.outbox.pop(0)
                    if src is self.a:
                        self.wire_a_to_b.append(frame)
                    n += 1
                    dst.receive(frame)
        return n

    def handshake(self) -> "Pair":
        self.sa.start()
        self.deliver()
        return self


def sample_messages() -> dict[type, m.Message]:
    """One valid instance of every message type."""
    fp = Fingerprint.build(block_bytes=BLOCK, protocol_version=m.PROTOCOL_VERSION)
    return {
        m.Hello: m.Hello(m.PROTOCOL_VERSION, "X", info("X"), fp),
        m.HelloAck: m.HelloAck(m.PROTOCOL_VERSION, "X", True, info("X"), fp),
        m.Fetch: m.Fetch("r", 0, [b"k"], [1]),
        m.TransferDone: m.TransferDone("r", 0, []),
        m.AbortFetch: m.AbortFetch("r", 0),
        m.AbortAck: m.AbortAck("r", 0),
        m.Lookup: m.Lookup(1, "r", [b"k"]),
        m.LookupResp: m.LookupResp(1, [True]),
        m.Probe: m.Probe(m.PROTOCOL_VERSION),
        m.ProbeInfo: m.ProbeInfo(m.PROTOCOL_VERSION, "X", fp, "fake", 64, BLOCK),
        m.Bye: m.Bye("bye"),
    }
