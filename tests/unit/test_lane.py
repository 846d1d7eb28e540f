"""A session's same-host lane (p2pworker/control/lane.py) and how it is opened (p2pworker/data/handover.py's lane
mode): frames of any size arrive whole and in order, what the socket cannot take waits in a bounded outbox, and a
lane exists only between the two ends of one session: the server accepts a lane only for a key one of its sessions
was told, proves that key before the dialer proves it, and a dialer refuses a server that cannot.

One process; the "peer" is a handover thread of this process, or a socket this test plays by hand."""

from __future__ import annotations

import errno
import os
import secrets
import select
import socket
import threading
import time

import pytest

from p2pworker.control.lane import CHUNK_BYTES, Lane, LaneBroken, LaneClosed
from p2pworker.errors import P2PError
from p2pworker.data import handover, samehost
from p2pworker.data.handover import LaneDial, LaneRefused
from p2pworker.shm import KVRegion

pytestmark = pytest.mark.timeout(60)


def pair() -> tuple[Lane, Lane]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return Lane(a), Lane(b)


def drain(lane: Lane, n: int, timeout_s: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} frames"
        select.select([lane.fileno()], [], [], 0.05)
        got += lane.recv()
    return got


def test_frames_of_any_size_arrive_whole_and_in_order():
    a, b = pair()
    try:
        frames = [b"", b"x", os.urandom(CHUNK_BYTES - 1), os.urandom(CHUNK_BYTES), os.urandom(CHUNK_BYTES + 1),
                  os.urandom(3 * CHUNK_BYTES + 17), b"last"]
        got: list[bytes] = []
        for f in frames:  # read as we go: the default socket buffer need not hold them all
            a.send(f)
            while a.backlog:
                got += b.recv()
                a.flush()
        got += drain(b, len(frames) - len(got))
        assert got == frames
        assert a.frames_out == len(frames) and b.frames_in == len(frames)
    finally:
        a.close()
        b.close()


def test_what_the_socket_cannot_take_waits_in_order_and_goes_out_later():
    a, b = pair()
    try:
        frames = [os.urandom(40_000 + i) for i in range(600)]  # 24 MB: more than the socket takes unread
        for f in frames:
            a.send(f)  # never blocks
        assert a.backlog, "the test must fill the socket"
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < len(frames):
            assert time.monotonic() < deadline
            got += b.recv()
            a.flush()
        assert got == frames and not a.backlog
    finally:
        a.close()
        b.close()


def test_frames_past_max_frame_bytes_are_refused_by_the_sender():
    a, b = pair()
    try:
        a.send(os.urandom((4 << 20) - 100))
        with pytest.raises(P2PError, match="exceeds max_frame_bytes"):
            a.send(os.urandom(4 << 20))
        assert a.state.value == "up"  # refused, not broken: the session decides (it closes, as for the link)
    finally:
        a.close()
        b.close()


def test_a_peer_that_stops_reading_breaks_the_lane_at_the_outbox_bound_in_frames():
    """Bounded in frames, as the control link's high-water mark: the frames of one MAX_JOB_KEYS job (~130 of up to
    ~1 MB) wait for the peer; only a peer that stops reading for good breaks the lane."""
    a, b = pair()
    a = Lane(a.sock, max_queued=200)
    try:
        for _ in range(140):
            a.send(os.urandom(1 << 20))  # ~140 MB, far more than the socket holds: waits, in order
        assert a.backlog
        with pytest.raises(LaneBroken, match="has not read"):
            for _ in range(1000):
                a.send(b"x" * 100)
    finally:
        a.close()
        b.close()


def test_frames_the_peer_sent_before_closing_arrive_even_when_linux_reports_the_reset_first():
    """The peer closed with our frames unread: Linux reports ECONNRESET before the frames it sent last.  They are
    read first (its Bye, its reason), then the lane's end."""
    a, b = pair()
    a.send(b"unread by b")
    b.send(b"bye")
    b.close()
    assert a.recv() == [b"bye"]
    with pytest.raises(LaneClosed):
        a.recv()
    a.close()


def test_a_closed_peer_or_a_datagram_out_of_framing_breaks_the_lane():
    a, b = pair()
    b.close()
    with pytest.raises(LaneClosed, match="closed its lane"):  # the peer's end is gone: a lost peer
        drain(a, 1)
    a.close()
    with pytest.raises(LaneBroken):
        a.send(b"after close")

    x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lane = Lane(y)
    x.send(b"Zgarbage")
    with pytest.raises(LaneBroken, match="out of framing"):
        drain(lane, 1)
    lane.close()
    x.close()

    x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lane = Lane(y, max_frame_bytes=100_000)
    for _ in range(3):
        x.send(b"M" + b"z" * 40_000)  # never a last chunk: the frame grows past the bound
    with pytest.raises(LaneBroken, match="past 100000 bytes"):
        drain(lane, 1)
    lane.close()
    x.close()


# ---------------------------------------------------------------- opening a lane through the handover socket
@pytest.fixture
def server(shm_prefix):
    with KVRegion.create(shm_prefix + "lane", 8, 4096) as region:
        srv = samehost.serve(region)
        yield srv
        srv.close()


IDS = handover.lane_ids("dialer-node", "acceptor-node")


def dial(srv: handover.HandoverServer, key: bytes, token: bytes | None = None, timeout_s: float = 2.0,
         ids: bytes = IDS, took: list | None = None, take: bool = True) -> LaneDial:
    """A dial driven to its end, the acceptor's loop played here (it takes the lane and says so, as the worker's
    LaneHost.take does): returns the dial once taken, or raises LaneRefused.  ``took`` collects what the loop took."""
    d = LaneDial(srv.name, srv.token if token is None else token, key, ids, time.monotonic() + timeout_s)
    try:
        while True:
            assert time.monotonic() < d.deadline, "no answer"
            select.select([d.fileno(), srv.wake_fd], [], [], 0.05)
            for link, k, sock in (srv.take_lanes() if take else ()):
                sock.send(handover.LANE_TAKEN)
                if took is not None:
                    took.append((link, k, sock))
                else:
                    sock.close()
            if d.step():
                return d
    except BaseException:
        d.close()
        raise


def taken(srv: handover.HandoverServer, timeout_s: float = 2.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        select.select([srv.wake_fd], [], [], 0.05)
        got = srv.take_lanes()
        if got:
            return got
    return []


def test_a_session_key_the_server_expects_opens_a_lane_both_ends_can_talk_over(server):
    key = secrets.token_bytes(handover.LANE_KEY_BYTES)
    server.expect_lane(key, IDS, "in-7")
    took: list = []
    d = dial(server, key, took=took)
    (link, got_key, sock), = took
    assert (link, got_key) == ("in-7", key)
    ours, theirs = Lane(d.sock), Lane(sock)
    try:
        ours.send(b"fetch")
        theirs.send(b"offer")
        assert drain(theirs, 1) == [b"fetch"] and drain(ours, 1) == [b"offer"]
    finally:
        ours.close()
        theirs.close()


def test_no_lane_for_a_key_no_session_of_the_server_was_told(server):
    server.expect_lane(secrets.token_bytes(32), IDS, "in-1")
    with pytest.raises(LaneRefused, match="no session there expects our key"):
        dial(server, secrets.token_bytes(32))
    key = secrets.token_bytes(32)
    server.expect_lane(key, IDS, "in-2")
    server.forget_lane(key)  # its session ended
    with pytest.raises(LaneRefused, match="no session there expects our key"):
        dial(server, key)
    with pytest.raises(LaneRefused):
        dial(server, key, token=secrets.token_bytes(handover.TOKEN_BYTES))  # the handover token is checked first
    assert taken(server, timeout_s=0.3) == []


def test_a_dialer_that_cannot_prove_the_key_gets_no_lane(server):
    """A local process that learned a lane's id (never its key) and the handover token: its proof fails, the server
    closes, and the session on that link gets nothing."""
    key = secrets.token_bytes(32)
    server.expect_lane(key, IDS, "in-3")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(2)
        s.connect("\0" + server.name)
        nonce = os.urandom(handover.NONCE_BYTES)
        s.send(handover.MAGIC + handover.MODE_LANE + server.token + handover.lane_id(key) + nonce)
        proof = s.recv(100)
        assert proof[:1] == handover.SERVER_PROOF  # the server proves first (it knows the key)
        s.send(handover.CLIENT_PROOF + os.urandom(handover.MAC_BYTES))
        assert s.recv(100) == b""  # closed
    finally:
        s.close()
    assert taken(server, timeout_s=0.3) == []


def test_a_dialer_refuses_a_server_that_does_not_know_the_key_and_tells_it_nothing():
    """Whoever binds the handover name in the producer's place (it exited, say) cannot prove the session's key: the
    dialer refuses it before sending its own proof, so there is nothing to replay."""
    name = handover.NAME_PREFIX + secrets.token_hex(8)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(1)
    seen: list[bytes] = []

    def impostor():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(2)
            seen.append(conn.recv(200))
            conn.send(handover.SERVER_PROOF + os.urandom(handover.NONCE_BYTES + handover.MAC_BYTES))
            try:
                seen.append(conn.recv(200))  # b"" (closed), never a proof
            except OSError:
                seen.append(b"")

    t = threading.Thread(target=impostor)
    t.start()
    key = secrets.token_bytes(32)
    d = LaneDial(name, secrets.token_bytes(handover.TOKEN_BYTES), key, IDS, time.monotonic() + 2)
    with pytest.raises(LaneRefused, match="failed the session proof"):
        while True:
            select.select([d.fileno()], [], [], 0.05)
            if d.step():
                break
    d.close()
    t.join(5)
    listener.close()
    assert seen[0].endswith(handover.lane_id(key) + seen[0][-handover.NONCE_BYTES:])
    assert key not in seen[0] and seen[1] == b"", seen


def test_lanes_never_taken_are_closed_with_the_server(shm_prefix):
    with KVRegion.create(shm_prefix + "lane2", 8, 4096) as region:
        srv = samehost.serve(region)
        key = secrets.token_bytes(32)
        srv.expect_lane(key, IDS, "in-9")
        with pytest.raises(LaneRefused, match="did not take the lane"):
            _proved_then_server_closed(srv, key)


def _proved_then_server_closed(srv: handover.HandoverServer, key: bytes) -> None:
    """Prove a lane, let it wait untaken, close the server: the dialer, still waiting for "K", is refused."""
    d = LaneDial(srv.name, srv.token, key, IDS, time.monotonic() + 2)
    try:
        deadline = time.monotonic() + 2
        while not srv.lanes_waiting:
            assert time.monotonic() < deadline
            select.select([d.fileno()], [], [], 0.05)
            d.step()
        srv.close()  # the lane nobody took is closed with it
        while True:
            assert time.monotonic() < deadline
            select.select([d.fileno()], [], [], 0.05)
            d.step()
    finally:
        d.close()


def test_a_lane_the_loop_did_not_take_is_never_used(server):
    """The acceptor's loop closes a lane instead of taking it (its session ended meanwhile): the dialer is refused
    before it moved anything there."""
    key = secrets.token_bytes(32)
    server.expect_lane(key, IDS, "in-4")
    d = LaneDial(server.name, server.token, key, IDS, time.monotonic() + 2)
    try:
        with pytest.raises(LaneRefused, match="did not take the lane"):
            while True:
                assert time.monotonic() < d.deadline
                select.select([d.fileno(), server.wake_fd], [], [], 0.05)
                for _, _, sock in server.take_lanes():
                    sock.close()
                d.step()
    finally:
        d.close()


def test_a_lane_proves_whom_it_joins_not_only_the_key(server):
    """A peer that passed our session's key on to a third worker (naming that worker's socket as its own) cannot
    have our session joined to that worker's: the node ids are in both proofs."""
    key = secrets.token_bytes(32)
    server.expect_lane(key, handover.lane_ids("C", "D"), "in-5")  # D's session with C, given our key by C
    with pytest.raises(LaneRefused, match="failed the session proof"):
        dial(server, key, ids=handover.lane_ids("A", "C"))  # we are A, and think we dialed C
    assert taken(server, timeout_s=0.3) == []


def test_the_wake_pipe_is_readable_only_while_lanes_wait(server):
    """Bursts of lanes proven while the loop takes them: once it took them all, the wake pipe is empty (a byte
    left behind would make every poll of the loop return at once, a core spinning)."""
    ids = IDS
    for burst in range(20):
        keys = [secrets.token_bytes(32) for _ in range(8)]
        for i, k in enumerate(keys):
            server.expect_lane(k, ids, f"in-{burst}-{i}")
        dials = [LaneDial(server.name, server.token, k, ids, time.monotonic() + 2) for k in keys]
        got = 0
        deadline = time.monotonic() + 5
        while got < len(keys):
            assert time.monotonic() < deadline
            for d in dials:
                try:
                    d.step()
                except LaneRefused:
                    pass  # its lane was taken and closed below: refused, as it should be
            for _, _, sock in server.take_lanes():  # races the thread's hand-overs on purpose
                got += 1
                sock.close()
        for d in dials:
            d.close()
        assert not server.lanes_waiting
        assert select.select([server.wake_fd], [], [], 0)[0] == [], f"burst {burst}: a wake byte left behind"


def test_a_dial_out_of_descriptors_is_a_refusal_not_an_error(server, monkeypatch):
    def no_fds(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(handover.socket, "socket", no_fds)
    with pytest.raises(LaneRefused, match="Too many open files"):
        LaneDial(server.name, server.token, secrets.token_bytes(32), IDS, time.monotonic() + 1)


def test_frames_sent_before_the_close_arrive_before_the_close_is_seen():
    """A Bye and then the close: the session must see the Bye (and its reason) before the lane's end."""
    a, b = pair()
    a.send(b"release")
    a.send(b"bye")
    a.close()
    assert b.recv() == [b"release", b"bye"]
    with pytest.raises(LaneClosed):
        b.recv()
    b.close()


def test_a_send_that_finds_the_lane_closed_still_ends_with_the_peers_bye_reason():
    """The peer sent an Offer and its Bye, then closed its end; our send this loop turn comes before we read, and
    fails (EPIPE).  The session ends with the peer's own reason (read from what is queued), not "peer lost"; with
    nothing queued, or before the peer's LaneUp (its frames are not on the lane then), the peer is lost."""
    from p2pworker.protocol import messages as m
    from p2pworker.session import close_text
    from p2pworker.worker import lane_end_reason

    for queued, reading, expect in (
        ([m.Offer("r", 1, [b"k"], [3]), m.Bye("worker shutting down (SIGTERM)")], True,
         "peer said bye: worker shutting down (SIGTERM)"),
        ([], True, "peer lost: same-host lane: the peer closed its lane"),
        ([m.Bye("not read: no LaneUp yet")], False, "peer lost: same-host lane: the peer closed its lane"),
    ):
        a, b = pair()
        try:
            a.reading = reading
            for msg in queued:
                b.send(m.encode(msg))
            b.close()
            with pytest.raises(LaneClosed) as err:
                a.send(m.encode(m.Release("r", 1, [b"k"])))
            assert close_text(*lane_end_reason(a, err.value)).startswith(expect), (queued, reading)
        finally:
            a.close()
