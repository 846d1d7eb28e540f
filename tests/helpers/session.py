"""An in-memory pair of sessions: per-side clocks, a fake data plane that records reads, frames in lists.

The harness performs the sessions' actions the way the worker does (sans-IO:
the sessions return what they want; nothing calls back into them), and keeps
a byte-level model of both regions so tests can check *what landed where*:

- ``Side.region[row]`` is the content of a row: the key whose KV it holds, or
  a canary / ``REUSED`` marker once the row went back to vLLM;
- a read is copied (``FakeData.copy``) and reported (``FakeData.settle``) as
  separate steps, so a test can delay, reorder or fail either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pworker.data.base import PeerDataInfo
from p2pworker.errors import TransferFailed
from p2pworker.fingerprint import Fingerprint
from p2pworker.protocol import messages as m
from p2pworker.session import (
    Abort,
    AddDataPeer,
    CancelReads,
    ParkingLot,
    PostRead,
    RemoveDataPeer,
    Reporter,
    Send,
    Session,
    SessionConfig,
    SessionContext,
)

BLOCK = 4096
KEYS = [b"k0", b"k1", b"k2", b"k3"]  # four block hashes, as vLLM names chunks
REUSED = b"<reused by vLLM>"


class Clock:
    """A clock tests set by hand (``now``, or ``t``, the same) and inject where the code takes one."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    @property
    def t(self) -> float:
        return self.now

    @t.setter
    def t(self, value: float) -> None:
        self.now = value

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


@dataclass(eq=False)
class Read:
    tid: int
    session: Session
    read_id: int
    local_rows: list[int]
    remote_rows: list[int]
    cancelled: bool = False
    copied: int = 0  # rows copied so far (a read may land partially before it fails)


@dataclass
class FakeData:
    """Reads are recorded, then copied and settled when the test says so."""

    peers: dict[str, PeerDataInfo] = field(default_factory=dict)
    reads: dict[int, Read] = field(default_factory=dict)  # not settled yet
    log: list[Read] = field(default_factory=list)
    fail_submit: bool = False
    removed: list[str] = field(default_factory=list)
    _next: int = 1

    def add_peer(self, key, info, now=True):
        if info.block_bytes != BLOCK:
            raise TransferFailed(f"block_bytes={info.block_bytes}, local block_bytes={BLOCK}")
        self.peers[key] = info

    def remove_peer(self, key):
        self.peers.pop(key, None)
        self.removed.append(key)
        for r in self.reads.values():
            if r.session.link == key:
                r.cancelled = True

    def read_blocks(self, key, session, read_id, local_rows, remote_rows) -> int:
        if self.fail_submit:
            raise TransferFailed("injected submit failure")
        if key not in self.peers:
            raise TransferFailed(f"unknown data peer {key!r}")
        tid = self._next
        self._next += 1
        r = self.reads[tid] = Read(tid, session, read_id, list(local_rows), list(remote_rows))
        self.log.append(r)
        return tid


class Side:
    def __init__(self, node: str, clock: Clock, *, fingerprint: Fingerprint | None = None, num_blocks: int = 64,
                 block_bytes: int = BLOCK, config: SessionConfig | None = None, deferred_release: bool = False):
        self.node = node
        self.clock = clock
        self.data = FakeData()
        self.reporter = Reporter()
        self.lot = ParkingLot(self.reporter, clock, block_bytes=block_bytes, park_timeout_s=60.0)
        self.ctx = SessionContext(
            node_id=node, data_info=PeerDataInfo("fake", node, 0, num_blocks, block_bytes),
            fingerprint=fingerprint or Fingerprint.build(block_bytes=BLOCK, protocol_version=m.PROTOCOL_VERSION),
            reporter=self.reporter, lot=self.lot, clock=clock, config=config or SessionConfig(),
            deferred_release=deferred_release,
        )
        self.region: list[bytes] = [b"<empty>"] * num_blocks
        self.outbox: list[bytes] = []
        self.session: Session | None = None
        self.peer: Side | None = None
        self.landings: list[tuple[int, int, bytes]] = []  # (tid, our row, content) every byte that landed here
        self.land_hook = None  # called as each row lands, before anything else can happen (property tests)
        self.aborts: list[tuple[Session, str]] = []  # Abort actions: the worker would have exited (reads end with it)
        self._tids: dict[tuple[int, int], int] = {}

    def new_session(self, expected_peer_id=None, link: str = "link") -> Session:
        self.outbox = []
        self.session = Session(self.ctx, expected_peer_id=expected_peer_id, link=link)
        return self.session

    # -------------------------------------------------------- the worker's part
    def run(self, s: Session, actions) -> None:
        todo = list(actions)
        while todo:
            a = todo.pop(0)
            do = self._DO.get(type(a))
            if do is not None:
                todo = do(self, s, a, todo)

    # Each takes one action of session ``s`` and the actions still to run after it; returns those to run next.
    def _send(self, s: Session, a: Send, todo: list) -> list:
        if s is self.session:  # an older session's link is gone: what it sends is lost
            self.outbox.append(m.encode(a.msg))
        return todo

    def _add_data_peer(self, s: Session, a: AddDataPeer, todo: list) -> list:
        try:
            self.data.add_peer(s.link, a.info)
        except TransferFailed as e:
            return list(s.close(f"data plane refused the peer: {e}", bye=True))
        return todo

    def _remove_data_peer(self, s: Session, a: RemoveDataPeer, todo: list) -> list:
        self.data.remove_peer(s.link)
        return todo

    def _post_read(self, s: Session, a: PostRead, todo: list) -> list:
        try:
            tid = self.data.read_blocks(s.link, s, a.read_id, a.local_rows, a.remote_rows)
        except TransferFailed as e:
            todo += s.on_read_result(a.read_id, False, f"read refused: {e}")
            return todo
        self._tids[(id(s), a.read_id)] = tid
        return todo

    def _cancel_reads(self, s: Session, a: CancelReads, todo: list) -> list:
        for rid in a.read_ids:
            tid = self._tids.get((id(s), rid))
            if tid is not None and tid in self.data.reads:
                self.data.reads[tid].cancelled = True
        return todo

    def _abort(self, s: Session, a: Abort, todo: list) -> list:
        self.aborts.append((s, a.why))  # recorded, not performed: tests go on to see what settles later
        return todo

    _DO = {Send: _send, AddDataPeer: _add_data_peer, RemoveDataPeer: _remove_data_peer, PostRead: _post_read,
           CancelReads: _cancel_reads, Abort: _abort}

    def receive(self, frame: bytes) -> None:
        self.run(self.session, self.session.receive(frame))

    def load(self, job: int, request: str, keys, rows, *, ask: bool = False) -> None:
        self.run(self.session, self.session.load(job, request, keys, rows, ask=ask))

    def lookup(self, lookup_id: int, keys, request: str) -> None:
        self.run(self.session, self.session.lookup(lookup_id, keys, request))

    def store(self, job: int, request: str, keys, rows, *, content: bool = True) -> None:
        if content:
            for k, r in zip(keys, rows):
                self.region[r] = k
        news = self.lot.store(job, request, keys, rows)
        if news is not None:
            p, new = news
            self.run(p.lease.owner, p.lease.owner.pump(p, new))

    def finish(self, request: str) -> None:
        p = self.lot.request_finished(request)
        if p is not None:
            self.run(p.lease.owner, p.lease.owner.pump(p))

    def done(self, request: str) -> None:
        """The consumer's request ended: Done to the producer."""
        self.run(self.session, self.session.done(request))

    def reset(self, reason: str, loads: bool = True) -> None:
        """The worker's ResetCache: parked stores without a lease end now; ``loads`` also cancels our loads."""
        for p in self.lot.reset(reason):
            self.run(p.lease.owner, p.lease.owner.pump(p))
        if loads and self.session is not None:
            self.run(self.session, self.session.cancel_loads(reason))

    def tick(self) -> None:
        if self.session is not None:
            self.run(self.session, self.session.tick())
        self.lot.tick()

    def close(self, reason: str = "killed") -> None:
        self.run(self.session, self.session.close(reason))

    def answer(self, lookup_id: int, present) -> None:
        self.run(self.session, self.session.answer_lookup(lookup_id, present).actions)

    # -------------------------------------------------------- the data plane's part
    def copy(self, tid: int, peer: "Side", rows: int | None = None) -> None:
        """The read's copy runs now: ``rows`` of it (all by default) land in our region, whatever the
        session thinks.  That is what a stalled or resumed NIXL READ does."""
        r = self.data.reads[tid]
        upto = len(r.local_rows) if rows is None else min(len(r.local_rows), r.copied + rows)
        for i in range(r.copied, upto):
            content = peer.region[r.remote_rows[i]]
            self.region[r.local_rows[i]] = content
            self.landings.append((tid, r.local_rows[i], content))
            if self.land_hook is not None:
                self.land_hook(tid, r.local_rows[i], content)
        r.copied = upto

    def settle(self, tid: int, ok: bool = True, reason: str = "") -> None:
        """The data plane reports the read: nothing of it lands after this."""
        r = self.data.reads[tid]
        if ok:  # a cancelled read whose copy was posted may well report DONE: the session must discount it
            self.copy(tid, self.peer)  # DONE means every byte was copied
        del self.data.reads[tid]
        self.run(r.session, r.session.on_read_result(r.read_id, ok, reason or ("" if ok else "injected failure")))

    def copy_and_settle_all(self, peer: "Side", ok: bool = True) -> None:
        for tid in list(self.data.reads):
            if ok and not self.data.reads[tid].cancelled:
                self.copy(tid, peer)
            self.settle(tid, ok)

    def events(self):
        return self.reporter.take()


class Pair:
    """A (consumer, initiator) <-> B (producer, acceptor).  Each side has its own clock (offset apart):
    nothing may depend on them agreeing."""

    def __init__(self, *, skew_s: float = 12345.0, **kw):
        self.clock = Clock()
        self.clock_b = Clock(1000.0 + skew_s)
        self.a = Side("A", self.clock, **kw.pop("a", {}))
        self.b = Side("B", self.clock_b, **kw.pop("b", {}))
        self.a.peer, self.b.peer = self.b, self.a
        self.sa = self.a.new_session(link="out-1")
        self.sb = self.b.new_session(link="in-1")
        self.wire_a_to_b: list[bytes] = []  # every frame A sent, for checks

    def advance(self, s: float) -> None:
        self.clock.advance(s)
        self.clock_b.advance(s)

    def deliver(self, max_frames: int | None = None) -> int:
        """Move frames both ways until quiet (or ``max_frames``)."""
        n = 0
        while self.a.outbox or self.b.outbox:
            for src, dst in ((self.a, self.b), (self.b, self.a)):
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
        self.a.run(self.sa, self.sa.start())
        self.deliver()
        return self

    def pull_all(self, ok: bool = True) -> None:
        """Deliver, copy and settle until nothing moves."""
        for _ in range(10):
            self.deliver()
            if not self.a.data.reads:
                break
            self.a.copy_and_settle_all(self.b, ok)
        self.deliver()


def sample_messages() -> dict[type, m.Message]:
    """One valid instance of every message type."""
    fp = Fingerprint.build(block_bytes=BLOCK, protocol_version=m.PROTOCOL_VERSION)
    info = PeerDataInfo("fake", "X", 0, 64, BLOCK)
    return {
        m.Hello: m.Hello(m.PROTOCOL_VERSION, "X", info, fp),
        m.HelloAck: m.HelloAck(m.PROTOCOL_VERSION, "X", True, info, fp),
        m.Fetch: m.Fetch("r", 1, [b"k"], 1000),
        m.Offer: m.Offer("r", 1, [b"k"], [1]),
        m.Release: m.Release("r", 1, []),
        m.Done: m.Done("r"),
        m.Lookup: m.Lookup(1, "r", [b"k"]),
        m.LookupResp: m.LookupResp(1, [True]),
        m.Probe: m.Probe(m.PROTOCOL_VERSION),
        m.ProbeInfo: m.ProbeInfo(m.PROTOCOL_VERSION, "X", fp, "fake", 64, BLOCK),
        m.LaneUp: m.LaneUp(),
        m.Bye: m.Bye("bye"),
    }
