"""Control plane on loopback: handshake and auth, heartbeats, reconnect, bounds, hostile frames."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import msgspec
import pytest
import zmq

from p2pworker.control.base import DownCause
from p2pworker.control import ControlConfig, LinkDown, LinkUp, Received, ZmqControl, default_port
from p2pworker.control.base import LinkState
from p2pworker.control.zmq_wire import (
    DEALER_MOVES,
    K_AUTH,
    K_BYE,
    K_CHALLENGE,
    K_DATA,
    K_HELLO,
    K_PING,
    K_REJECT,
    K_RESET,
    K_WELCOME,
    ROUTER_MOVES,
    Act,
    HandshakeHello,
    dealer_move,
    router_move,
)
from p2pworker.errors import AuthError, Backpressure, P2PError, PeerLost, PeerUnreachable
from tests.helpers.peers import control_acceptor
from tests.helpers.ports import free_port

SECRET = "test-secret"


def cfg(**kw) -> ControlConfig:
    base = dict(port=0, secret=SECRET, heartbeat_interval_s=0.2, heartbeat_liveness=3)
    base.update(kw)
    return ControlConfig(**base)


def pump(ctls: dict, until, timeout_s: float = 5.0) -> list:
    """Poll every transport until ``until(events)`` holds; returns [(name, event)]."""
    events: list = []
    deadline = time.monotonic() + timeout_s
    while not until(events):
        assert time.monotonic() < deadline, f"condition not met in {timeout_s} s; events: {events}"
        for name, ctl in ctls.items():
            events += [(name, ev) for ev in ctl.poll(5)]
    return events


def drain_for(ctls: dict, seconds: float) -> list:
    """Poll every transport for ``seconds``; returns [(name, event)]."""
    events: list = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for name, ctl in ctls.items():
            events += [(name, ev) for ev in ctl.poll(5)]
    return events


def of(events, name, kind):
    return [e for n, e in events if n == name and isinstance(e, kind)]


@pytest.fixture
def pair():
    a, b = ZmqControl(cfg(), node_id="A"), ZmqControl(cfg(), node_id="B")
    yield a, b
    a.close()
    b.close()


def test_handshake_then_ordered_data_both_ways(pair):
    a, b = pair
    link = a.connect(b.address)
    for i in range(5):
        a.send(link, b"early-%d" % i)  # queued until the handshake completes, then sent in order
    ev = pump({"a": a, "b": b}, lambda e: len(of(e, "b", Received)) == 5)
    up_a, up_b = of(ev, "a", LinkUp), of(ev, "b", LinkUp)
    assert up_a[0].node_id == "B" and up_a[0].outbound
    assert up_b[0].node_id == "A" and not up_b[0].outbound
    assert [r.payload for r in of(ev, "b", Received)] == [b"early-%d" % i for i in range(5)]
    b.send(up_b[0].link, b"reply")
    ev = pump({"a": a, "b": b}, lambda e: of(e, "a", Received))
    assert of(ev, "a", Received)[0] == Received(link, b"reply")


def test_empty_poll_allocates_nothing(pair):
    a, _ = pair
    assert a.poll() is a.poll()


@pytest.fixture
def pair_b_clocked():
    """A pair whose acceptor ``b`` reads a clock the test moves (``now[0]``): its tick comes due only when told."""
    now = [time.monotonic()]
    a, b = ZmqControl(cfg(), node_id="A"), ZmqControl(cfg(), node_id="B", clock=lambda: now[0])
    yield a, b, now
    a.close()
    b.close()


def test_quiet_only_when_an_outer_poll_found_none_of_its_sockets_readable(pair_b_clocked):
    """The worker skips ``poll(0)`` when ``quiet(readable)`` holds for what its own poll over ``sockets()`` found:
    never with a frame waiting on one of our sockets, an event queued, or the tick due."""
    a, b, now = pair_b_clocked
    link = a.connect(b.address)
    pump({"a": a, "b": b}, lambda e: of(e, "a", LinkUp) and of(e, "b", LinkUp))
    outer = zmq.Poller()
    for sock in b.sockets():
        outer.register(sock, zmq.POLLIN)
    a.send(link, b"x")
    deadline = time.monotonic() + 5
    while not (ready := {s for s, _ in outer.poll(50)}):
        assert time.monotonic() < deadline, "the frame never made b's router readable"
    assert not b.quiet(ready), "a frame waits on b's router"
    assert [e.payload for e in b.poll(0) if isinstance(e, Received)] == [b"x"]
    assert b.quiet(set())  # idle now: b's clock stood still, so its tick is not due
    now[0] += 1.0  # past the tick (at most 0.25 s apart): poll(0) has work
    assert not b.quiet(set())


def test_wrong_secret_is_rejected_before_any_data(pair):
    a, b = pair
    evil = ZmqControl(cfg(secret="wrong"), node_id="EVIL")
    try:
        link = evil.connect(b.address)
        evil.send(link, b"nixl-metadata")
        ev = pump({"evil": evil, "b": b}, lambda e: of(e, "evil", LinkDown))
        assert "failed to prove the shared secret" in of(ev, "evil", LinkDown)[0].reason
        ev += drain_for({"evil": evil, "b": b}, 0.5)
        assert not of(ev, "b", Received) and not of(ev, "b", LinkUp)
        with pytest.raises(PeerLost, match="failed"):
            evil.send(link, b"again")
    finally:
        evil.close()


def _raw_dealer(address: str):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 3000)
    s.connect(address)
    return ctx, s


def _serve_until(b: ZmqControl, sock, timeout_s: float = 3.0):
    deadline = time.monotonic() + timeout_s
    events = []
    while time.monotonic() < deadline:
        events += list(b.poll(5))
        try:
            return sock.recv_multipart(zmq.NOBLOCK), events
        except zmq.Again:
            pass
    raise AssertionError("no answer from the acceptor")


def test_hostile_handshakes_are_refused_and_the_acceptor_lives_on(pair):
    a, b = pair
    ctx, s = _raw_dealer(b.address)
    try:
        s.send_multipart([K_DATA, b"unauthenticated data"])  # data before any handshake
        (kind, _), ev = _serve_until(b, s)
        assert kind == K_RESET and not [e for e in ev if isinstance(e, Received)]
        s.send_multipart([K_HELLO, msgspec.msgpack.encode(HandshakeHello(99, "old", b"n" * 16))])
        (kind, body), _ = _serve_until(b, s)
        assert kind == K_REJECT and b"version 99, expected 1" in body
        s.send_multipart([K_HELLO, msgspec.msgpack.encode(HandshakeHello(1, "forger", b"n" * 16))])
        _serve_until(b, s)  # the challenge
        s.send_multipart([K_AUTH, msgspec.msgpack.encode([b"\x00" * 32])])  # a forged proof
        (kind, body), ev = _serve_until(b, s)
        assert kind == K_REJECT and body == b"authentication failed"
        assert not [e for e in ev if isinstance(e, LinkUp)]
        s.send_multipart([K_HELLO, b"\xc1not msgpack"])
        (kind, _), _ = _serve_until(b, s)
        assert kind == K_REJECT
        # a node id that is not UTF-8 (msgspec raises UnicodeDecodeError, not a MsgspecError)
        s.send_multipart([K_HELLO, b"\x93\x01\xa2\xff\xfe\xc4\x10" + b"n" * 16])
        (kind, _), _ = _serve_until(b, s)
        assert kind == K_REJECT
        assert b.counters["unauthenticated_frames"] >= 1 and b.counters["rejected_handshakes"] >= 2
    finally:
        s.close()
        ctx.term()
    link = a.connect(b.address)  # an honest peer still gets in
    a.send(link, b"hi")
    pump({"a": a, "b": b}, lambda e: of(e, "b", Received))


def test_a_peer_gone_before_the_welcome_never_comes_up(pair):
    """A peer that proves the secret and vanishes before the acceptor answers: no LinkUp without a LinkDown
    (found by tests/fault: every such race leaked a session in the worker)."""
    from p2pworker.control.zmq_wire import K_CHALLENGE, HandshakeAuth, HandshakeChallenge, handshake_proof

    _, b = pair
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 2000)
    s.setsockopt(zmq.RCVTIMEO, 3000)
    s.connect(b.address)
    nonce = b"c" * 16
    try:
        s.send_multipart([K_HELLO, msgspec.msgpack.encode(HandshakeHello(1, "ghost", nonce))])
        (kind, body), _ = _serve_until(b, s)
        assert kind == K_CHALLENGE
        ch = msgspec.msgpack.decode(body, type=HandshakeChallenge)
        proof = handshake_proof(SECRET.encode(), b"client", nonce, ch.nonce, "ghost", ch.node_id)
        s.send_multipart([K_AUTH, msgspec.msgpack.encode(HandshakeAuth(proof))])
    finally:
        s.close()  # flushes the proof (linger), then the connection is gone
        ctx.term()
    time.sleep(0.2)
    ev = drain_for({"b": b}, 1.0)
    ups, downs = of(ev, "b", LinkUp), of(ev, "b", LinkDown)
    assert len(ups) == len(downs), (ups, downs)


def test_oversized_frames_are_refused_on_both_ends(pair):
    a, b = pair
    small = ZmqControl(cfg(max_frame_bytes=64 << 10), node_id="SMALL")
    try:
        link = small.connect(b.address)
        with pytest.raises(P2PError, match="exceeds max_frame_bytes=65536"):
            small.send(link, b"x" * (64 << 10))
        honest = a.connect(small.address)
        pump({"a": a, "small": small}, lambda e: of(e, "small", LinkUp))
        ctx, s = _raw_dealer(small.address)  # a hostile sender of a 1 MiB frame
        try:
            s.send_multipart([K_DATA, b"x" * (1 << 20)])
            ev = drain_for({"small": small}, 0.5)
            assert not of(ev, "small", Received)
        finally:
            s.close()
            ctx.term()
        a.send(honest, b"still here")  # the receiver lives on and serves honest peers
        pump({"a": a, "small": small}, lambda e: [r for r in of(e, "small", Received) if r.payload == b"still here"])
    finally:
        small.close()


def test_unreachable_and_unresolvable_addresses(pair):
    a, _ = pair
    with pytest.raises(PeerUnreachable, match="cannot resolve"):
        a.connect("no-such-host.invalid:5710")
    with pytest.raises(PeerUnreachable, match="expected host:port"):
        a.connect("localhost")
    dead_port = free_port()  # nobody listens there
    t0 = time.monotonic()
    link = a.connect(f"127.0.0.1:{dead_port}")
    ev = pump({"a": a}, lambda e: of(e, "a", LinkDown))
    took_s = time.monotonic() - t0
    assert took_s <= 0.6 + 0.5, f"unreachable peer reported after {took_s:.2f} s (deadline 0.6 s + slack)"
    down = of(ev, "a", LinkDown)[0]
    assert down.cause is DownCause.REFUSED and "connection refused" in down.reason, down
    with pytest.raises(PeerLost, match="down"):
        a.send(link, b"x")
    ev = drain_for({"a": a}, 1.5)
    assert not of(ev, "a", LinkDown), "a link that never came up was reported down twice"


def test_bounded_queue_raises_backpressure():
    a = ZmqControl(cfg(hwm=10), node_id="A")
    try:
        port = free_port()
        link = a.connect(f"127.0.0.1:{port}")
        for i in range(10):
            a.send(link, b"m")
        with pytest.raises(Backpressure, match="10 messages queued"):
            a.send(link, b"one too many")
    finally:
        a.close()


def test_auth_needs_a_secret_or_an_explicit_off(monkeypatch, caplog):
    monkeypatch.delenv("P2PWORKER_SECRET", raising=False)
    with pytest.raises(AuthError, match="no shared secret"):
        ZmqControl(ControlConfig(port=0))
    monkeypatch.setenv("P2PWORKER_SECRET", "from-env")
    ZmqControl(ControlConfig(port=0)).close()
    with caplog.at_level(logging.WARNING):
        a = ZmqControl(ControlConfig(port=0, auth=False), node_id="A")
        b = ZmqControl(ControlConfig(port=0, auth=False), node_id="B")
    assert "authentication is DISABLED" in caplog.text
    try:
        link = a.connect(b.address)
        a.send(link, b"open")
        pump({"a": a, "b": b}, lambda e: of(e, "b", Received))
    finally:
        a.close()
        b.close()


def test_default_port_follows_vllm_convention(monkeypatch):
    base = free_port()
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", str(base))
    assert default_port(2) == base + 2
    ctl = ZmqControl(cfg(port=None, dp_index=1), node_id="dp1")
    try:
        assert ctl.address == f"tcp://127.0.0.1:{base + 1}"
    finally:
        ctl.close()


@pytest.mark.timeout(60)
def test_killed_peer_is_declared_dead_once_and_a_restart_reconnects(children):
    port = free_port()
    q = children.ctx.Queue()
    a = ZmqControl(cfg(reconnect_min_s=0.05, reconnect_max_s=0.4), node_id="A")
    try:
        proc = children.start(control_acceptor, port, SECRET, "B1", 0.2, q)
        address = q.get(timeout=30)
        link = a.connect(address)
        a.send(link, b"ping")
        ev = pump({"a": a}, lambda e: of(e, "a", Received))
        assert of(ev, "a", LinkUp)[0].node_id == "B1"
        assert of(ev, "a", Received)[0].payload == b"echo:ping"

        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        ev = pump({"a": a}, lambda e: of(e, "a", LinkDown))
        detect_s = time.monotonic() - killed
        # deadline 0.6 s (0.2 s x 3) + one 50 ms tick; 0.5 s of slack for a loaded 2-core host
        assert detect_s <= 0.6 + 0.5, f"dead peer noticed after {detect_s:.2f} s (deadline 0.6 s)"
        proc.join(5)
        ev = drain_for({"a": a}, 1.0)  # retries in the background...
        assert not of(ev, "a", LinkDown), "a dead peer was reported more than once"

        proc2 = children.start(control_acceptor, port, SECRET, "B2", 0.2, q)  # same address, new process
        assert q.get(timeout=30) == address
        ev = pump({"a": a}, lambda e: of(e, "a", LinkUp), timeout_s=10)
        assert of(ev, "a", LinkUp)[0].node_id == "B2"
        a.send(link, b"again")
        ev = pump({"a": a}, lambda e: of(e, "a", Received))
        assert of(ev, "a", Received)[0].payload == b"echo:again"
        a.send(link, b"exit")
        children.join_ok(proc2)
    finally:
        a.close()


def test_the_link_tables_deliver_nothing_before_up():
    """DEALER_MOVES / ROUTER_MOVES, read as tables: in no state but UP does any frame deliver data, and before
    an inbound identity is UP only HELLO and AUTH (when CHALLENGED) do anything but a RESET."""
    kinds = [K_HELLO, K_CHALLENGE, K_AUTH, K_WELCOME, K_REJECT, K_RESET, K_PING, K_DATA, K_BYE, b"?"]
    for state in LinkState:
        for kind in kinds:
            if state is not LinkState.UP:
                assert dealer_move(state, kind) is not Act.DELIVER
    for state in (None, LinkState.CHALLENGED):
        for kind in kinds:
            act = router_move(state, kind)
            allowed = {K_HELLO: Act.HELLO, K_AUTH: Act.AUTH if state is LinkState.CHALLENGED else None}
            assert act is (allowed.get(kind) or Act.UNAUTHENTICATED), (state, kind, act)
    assert {a for a in DEALER_MOVES.values()} | {a for a in ROUTER_MOVES.values()} <= set(Act)


def test_every_router_row_before_up_answers_as_the_table_says(pair):
    """Each frame kind from an unauthenticated routing id, through a real ROUTER: the reply the table promises
    (HELLO: a CHALLENGE; anything else: RESET), and nothing delivered."""
    _, b = pair
    expect = {Act.HELLO: K_CHALLENGE, Act.UNAUTHENTICATED: K_RESET}
    for kind in (K_HELLO, K_CHALLENGE, K_AUTH, K_WELCOME, K_PING, K_DATA, K_BYE, b"?"):
        act = router_move(None, kind)
        body = msgspec.msgpack.encode(HandshakeHello(1, "probe", b"n" * 16)) if kind == K_HELLO else b"x"
        ctx, s = _raw_dealer(b.address)
        try:
            s.send_multipart([kind, body])
            (reply, _), ev = _serve_until(b, s)
            assert reply == expect[act], (kind, act, reply)
            assert not [e for e in ev if isinstance(e, (Received, LinkUp))]
        finally:
            s.close()
            ctx.term()


def test_a_wildcard_bind_advertises_a_dialable_address(monkeypatch):
    """Peers cannot dial 0.0.0.0: the address a worker reports is advertise_host, else $POD_IP, else its name."""
    from p2pworker.control.zmq_config import advertised

    assert advertised("tcp://0.0.0.0:5710", "10.1.2.3") == "tcp://10.1.2.3:5710"
    assert advertised("tcp://127.0.0.1:5710", None) == "tcp://127.0.0.1:5710"
    assert advertised("tcp://0.0.0.0:5710", None, env={"POD_IP": "10.9.8.7"}) == "tcp://10.9.8.7:5710"
    assert advertised("tcp://[::]:5710", None, env={"POD_IP": "fd00::7"}) == "tcp://[fd00::7]:5710"
    assert not advertised("tcp://0.0.0.0:5710", None, env={}).startswith("tcp://0.0.0.0:")
    # a real socket (bound on loopback only: a wildcard bind is tested inside the emulated hosts, test_hosts.py)
    a = ZmqControl(cfg(host="127.0.0.1", advertise_host="localhost"), node_id="A")
    b = ZmqControl(cfg(), node_id="B")
    try:
        assert a.address.startswith("tcp://localhost:") and a.bound_address.startswith("tcp://127.0.0.1:")
        link = b.connect(a.address)
        ev = pump({"a": a, "b": b}, lambda e: of(e, "b", LinkUp))
        assert of(ev, "b", LinkUp)[0].link == link
    finally:
        a.close()
        b.close()


def first_down(a: ZmqControl, address: str, timeout_s: float = 5.0) -> tuple[LinkDown, float]:
    """Dial ``address`` from ``a``: the link's first LinkDown and the seconds it took."""
    t0 = time.monotonic()
    a.connect(address)
    ev = pump({"a": a}, lambda e: of(e, "a", LinkDown), timeout_s=timeout_s)
    return of(ev, "a", LinkDown)[0], time.monotonic() - t0


def test_a_refused_dial_is_known_at_once_not_at_the_deadline():
    """With a long handshake deadline (10 s here), a port nobody listens on is reported down within 0.5 s (the
    socket monitor sees libzmq's failed connect): a pull addressed there recomputes at once.  Counted."""
    a = ZmqControl(cfg(heartbeat_interval_s=5.0, heartbeat_liveness=2), node_id="A")
    try:
        down, took_s = first_down(a, f"127.0.0.1:{free_port()}")
        assert down.cause is DownCause.REFUSED
        assert took_s < 0.5, f"refused connect reported after {took_s:.2f} s"
        assert a.counters["connect_refused"] >= 1
    finally:
        a.close()


def test_a_port_that_does_not_speak_the_protocol_is_a_failed_handshake_before_the_deadline():
    """An HTTP server's port (it answers our greeting with garbage and hangs up): down with cause HANDSHAKE_FAILED,
    well before the 10 s deadline."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            with c:
                c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    a = ZmqControl(cfg(heartbeat_interval_s=5.0, heartbeat_liveness=2), node_id="A")
    try:
        down, took_s = first_down(a, f"127.0.0.1:{srv.getsockname()[1]}", timeout_s=15.0)
        assert down.cause is DownCause.HANDSHAKE_FAILED, down
        assert took_s < 2.0, f"a non-ZMTP peer reported after {took_s:.2f} s"
    finally:
        a.close()
        stop.set()
        t.join(2)
        srv.close()


def test_a_silent_peer_is_a_failed_handshake_at_the_deadline_not_later():
    """A port whose kernel accepts TCP but whose process never speaks (a stopped worker, a wedged listener): no
    monitor event tells it apart from a slow peer, so the deadline does (here 0.2 s x 3 = 0.6 s): down with cause
    HANDSHAKE_FAILED and a reason that says TCP was accepted, within the deadline plus slack; reported once."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # never accept(): the kernel completes the TCP handshake, nobody sends a greeting
    a = ZmqControl(cfg(), node_id="A")
    try:
        down, took_s = first_down(a, f"127.0.0.1:{srv.getsockname()[1]}", timeout_s=10.0)
        assert down.cause is DownCause.HANDSHAKE_FAILED and "accepted TCP" in down.reason, down
        assert 0.5 <= took_s <= 0.6 + 1.0, f"a silent peer reported after {took_s:.2f} s (deadline 0.6 s)"
        assert a.counters["handshake_failed"] >= 1
        assert not of(drain_for({"a": a}, 1.0), "a", LinkDown), "reported twice"
    finally:
        a.close()
        srv.close()


def test_a_zmtp_peer_that_hangs_up_mid_handshake_is_a_dropped_handshake():
    """A peer that completes ZMTP (libzmq's greeting) and closes before answering our HELLO: down at once with cause
    HANDSHAKE_DROPPED (not at the deadline, 10 s here), counted."""
    ctx = zmq.Context()
    srv = ctx.socket(zmq.ROUTER)
    srv.setsockopt(zmq.LINGER, 0)
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    a = ZmqControl(cfg(heartbeat_interval_s=5.0, heartbeat_liveness=2), node_id="A")
    try:
        t0 = time.monotonic()
        a.connect(f"127.0.0.1:{port}")
        srv.setsockopt(zmq.RCVTIMEO, 3000)
        srv.recv_multipart()  # our HELLO: the ZMTP handshake is done
        srv.close()
        ev = pump({"a": a}, lambda e: of(e, "a", LinkDown), timeout_s=5.0)
        took_s = time.monotonic() - t0
        (down,) = of(ev, "a", LinkDown)
        assert down.cause is DownCause.HANDSHAKE_DROPPED, down
        assert took_s < 2.0, f"a dropped handshake reported after {took_s:.2f} s (deadline 10 s)"
        assert a.counters["handshake_dropped"] >= 1
    finally:
        a.close()
        ctx.term()


def test_the_monitor_table_reads_every_dial_outcome_and_subscribes_to_exactly_its_events():
    """MONITOR_MOVES as data: a refused connect is only known before TCP came up; once ZMTP is up a hang-up is a
    dropped handshake; TCP without ZMTP that ends is a failed one; the subscription is the table's events, no more
    (CONNECT_DELAYED would only wake the loop)."""
    from p2pworker.control.zmq_wire import ANY, MONITOR_EVENTS, MONITOR_MOVES, Wire

    assert MONITOR_MOVES[(Wire.DIALING, zmq.Event.CONNECT_RETRIED)] is DownCause.REFUSED
    assert (Wire.TCP, zmq.Event.CONNECT_RETRIED) not in MONITOR_MOVES  # a retry after a drop: already down
    assert MONITOR_MOVES[(Wire.TCP, zmq.Event.DISCONNECTED)] is DownCause.HANDSHAKE_FAILED
    assert MONITOR_MOVES[(Wire.ZMTP, zmq.Event.DISCONNECTED)] is DownCause.HANDSHAKE_DROPPED
    assert MONITOR_MOVES[(Wire.UP, zmq.Event.DISCONNECTED)] is DownCause.CLOSED  # an UP link's connection ended
    assert MONITOR_MOVES[(ANY, zmq.Event.CONNECTED)] is Wire.TCP
    assert MONITOR_MOVES[(ANY, zmq.Event.HANDSHAKE_SUCCEEDED)] is Wire.ZMTP
    assert set(DownCause) - {DownCause.OTHER} <= set(MONITOR_MOVES.values())  # every cause has a way in
    events = {ev for _, ev in MONITOR_MOVES}
    assert MONITOR_EVENTS == sum(int(ev) for ev in events)
    assert not MONITOR_EVENTS & int(zmq.Event.CONNECT_DELAYED)


def test_failed_dials_are_logged_once_per_address_and_counted_each_time(caplog):
    """Three dials of one refused address (the worker dials again after each backoff): three counted failures, one
    WARNING naming the address; another address gets its own line.  Every failed dial's DEALER and monitor are
    closed: the transport holds no socket for a link that went down."""
    dead, other = free_port(), free_port()
    a = ZmqControl(cfg(), node_id="A")
    idle_sockets = len(a.sockets())
    try:
        with caplog.at_level(logging.WARNING, logger="p2pworker.control.zmq_control"):
            for address in (f"127.0.0.1:{dead}",) * 3 + (f"127.0.0.1:{other}",):
                n = len(of(drain_for({"a": a}, 0.0), "a", LinkDown))
                a.connect(address)
                pump({"a": a}, lambda e, n=n: len(of(e, "a", LinkDown)) > 0)
        assert a.counters["connect_refused"] >= 4
        lines = [r.getMessage() for r in caplog.records if "connection refused" in r.getMessage()]
        assert sum(f":{dead}" in m for m in lines) == 1, lines
        assert sum(f":{other}" in m for m in lines) == 1, lines
        assert len(a.sockets()) == idle_sockets, "a DEALER or monitor left open after its link went down"
    finally:
        a.close()


def test_a_dial_libzmq_refuses_is_a_clear_error_that_leaves_no_socket_or_link(pair):
    """An address libzmq itself refuses (here a host name with a space, passed unresolved as the worker's loop
    does): connect() raises PeerUnreachable naming it, and neither the DEALER nor its socket monitor, nor a
    half-made link, is left behind; the transport goes on serving."""
    a, b = pair
    before = len(a.sockets())
    for _ in range(3):
        with pytest.raises(PeerUnreachable, match="cannot dial control address 'bad host:5710'"):
            a.connect("bad host:5710", resolve=False)
    assert len(a.sockets()) == before
    link = a.connect(b.address)
    pump({"a": a, "b": b}, lambda e: of(e, "a", LinkUp))
    assert a.link(link) is not None and a.link(link).state is LinkState.UP


# ---------------------------------------------------------------- our own stalls are not the peer's silence
def test_the_run_clock_stops_while_we_stall_and_judges_again_one_tick_after():
    """liveness.RunClock as data: a gap between two looks counts up to stall_s; past it the clock stops (and never
    jumps back when the look confirms it); the tick right after a stall judges nobody, the next one does, even when
    every look stalls (a dead peer is never hidden for ever)."""
    from p2pworker.control.liveness import CLOCK_MOVES, JUDGING, Event, Phase, RunClock, stall_bound_s

    assert set(CLOCK_MOVES) == {(p, e) for p in Phase for e in Event}  # every phase answers every event
    assert stall_bound_s(0.25) == 0.5 and stall_bound_s(0.05) == 0.2  # two ticks, never under MIN_STALL_S
    clk = RunClock(100.0, 0.5)
    assert clk.look(100.3) == 0.0 and clk.now(100.3) == pytest.approx(100.3)  # an ordinary gap counts in full
    assert clk.now(104.3) == pytest.approx(100.8)  # stopped 0.5 s after the last look...
    assert clk.look(104.3) == pytest.approx(4.0)  # ...which the look confirms: a stall of 4 s, 3.5 s not counted
    assert clk.now(104.3) == pytest.approx(100.8) and clk.excluded_s == pytest.approx(3.5)
    assert clk.phase is Phase.RESUMED and not clk.tick()  # read what queued meanwhile first
    assert clk.phase is Phase.WAITED and clk.tick() and clk.phase is Phase.RUNNING
    judged = []
    for i in range(6):  # a loop that stalls at every look: judged every other tick
        clk.look(105.0 + i)
        judged.append(clk.tick())
    assert judged == [False, True] * 3 and all(p in JUDGING for p in (Phase.RUNNING, Phase.WAITED))
    assert clk.hint(110.5, 3.0) == "declared us lost while this process did not run for 1.0 s"
    assert clk.hint(120.0, 3.0) == ""  # a stall long past: no peer's verdict is ours to explain


def test_a_stall_of_both_ends_longer_than_the_deadline_drops_no_link(pair):
    """The starved host of the report, in one process: neither end reads its sockets for twice the deadline (0.6 s
    here), as when the host runs neither.  On waking, neither blames the other for that silence: no LinkDown, the
    stall counted on both, data still flows."""
    a, b = pair
    link = a.connect(b.address)
    ev = pump({"a": a, "b": b}, lambda e: of(e, "a", LinkUp) and of(e, "b", LinkUp))
    in_link = of(ev, "b", LinkUp)[0].link
    time.sleep(1.2)  # both loops stopped (libzmq's threads run on: what the peers sent waits in the sockets)
    ev = drain_for({"a": a, "b": b}, 1.0)  # past another deadline: judged on what arrived since
    assert not of(ev, "a", LinkDown) and not of(ev, "b", LinkDown), ev
    for ctl in (a, b):
        assert ctl.counters["heartbeat_lost"] == 0 and ctl.counters["stalls"] >= 1
        assert ctl.counters["stalled_ms"] >= 800, ctl.counters  # 1.2 s less the 0.2 s bound counted in full
    a.send(link, b"still here")
    b.send(in_link, b"and here")
    ev = pump({"a": a, "b": b}, lambda e: of(e, "a", Received) and of(e, "b", Received))
    assert of(ev, "b", Received)[0].payload == b"still here" and of(ev, "a", Received)[0].payload == b"and here"


def test_a_stalled_acceptor_blames_nobody_and_the_dialer_comes_back(pair):
    """Only the acceptor stalls (1 s, past the 0.6 s deadline): the dialer, which ran, declares it lost (real
    silence: nothing tells a stopped peer from a cut wire) and dials again.  The acceptor, waking, reads the old
    link's pings and takes the new handshake; the old link it drops because the dialer closed that connection (its
    first ping finds it gone), never for silence, now or a deadline later.  One link then, which carries data."""
    a, b = pair
    link = a.connect(b.address)
    ev = pump({"a": a, "b": b}, lambda e: of(e, "a", LinkUp) and of(e, "b", LinkUp))
    old = of(ev, "b", LinkUp)[0].link
    ev = drain_for({"a": a}, 1.0)  # b's loop stopped
    assert [d.reason for d in of(ev, "a", LinkDown)][0].startswith("heartbeat lost"), ev
    ev = pump({"a": a, "b": b}, lambda e: of(e, "b", LinkUp) and of(e, "a", LinkUp))
    ev += drain_for({"a": a, "b": b}, 1.0)  # past b's deadline: nothing declared lost late either
    assert all(d.reason.startswith("peer connection gone") for d in of(ev, "b", LinkDown)), ev
    assert b.link(old) is None and b.counters["heartbeat_lost"] == 0 and b.counters["stalls"] >= 1
    assert a.counters["heartbeat_lost"] == 1
    a.send(link, b"after")
    ev = pump({"a": a, "b": b}, lambda e: of(e, "b", Received))
    assert of(ev, "b", Received)[0].payload == b"after"


def test_a_stalled_dialer_blames_nobody_and_its_link_comes_back(pair):
    """Only the dialer stalls (1 s): the acceptor declares it lost and forgets the link.  The dialer, waking, does
    not blame the acceptor; its first ping is answered RESET, whose reason names its own stall, and the link is up
    again after one backoff."""
    a, b = pair
    link = a.connect(b.address)
    pump({"a": a, "b": b}, lambda e: of(e, "a", LinkUp) and of(e, "b", LinkUp))
    ev = drain_for({"b": b}, 1.0)  # a's loop stopped
    assert [d.reason for d in of(ev, "b", LinkDown)][0].startswith("heartbeat lost"), ev
    t0 = time.monotonic()
    ev = pump({"a": a, "b": b}, lambda e: of(e, "a", LinkUp))
    assert time.monotonic() - t0 < 1.0, "the link took more than a second to come back"
    (down,) = of(ev, "a", LinkDown)
    assert re.search(r"declared us lost while this process did not run for \d+\.\d s", down.reason), down
    assert "heartbeat" not in down.reason, down
    assert a.counters["heartbeat_lost"] == 0 and a.counters["stalls"] >= 1 and b.counters["heartbeat_lost"] == 1
    a.send(link, b"after")
    ev = pump({"a": a, "b": b}, lambda e: of(e, "b", Received))
    assert of(ev, "b", Received)[0].payload == b"after"


@pytest.mark.timeout(60)
def test_a_peer_that_links_and_drops_at_once_is_redialled_at_a_growing_backoff_and_a_stable_one_from_the_start():
    """A crash-looping peer (it completes the handshake, then its process goes away) must not be redialled every
    reconnect_min_s: a link that drops within a deadline of coming UP keeps doubling its backoff (to reconnect_max_s);
    one that stayed UP for a deadline starts again from reconnect_min_s (its drop is news)."""
    port = free_port()
    a = ZmqControl(cfg(reconnect_min_s=0.05, reconnect_max_s=0.4), node_id="A")  # deadline 0.6 s (0.2 s x 3)
    b = None
    try:
        backoffs = []
        link = None
        for hold_s in (0.0, 0.0, 0.0, 0.0, 1.0):
            b = ZmqControl(cfg(port=port), node_id="B")
            if link is None:
                link = a.connect(b.address)
            pump({"a": a, "b": b}, lambda e: of(e, "a", LinkUp), timeout_s=10)
            if hold_s:
                drain_for({"a": a, "b": b}, hold_s)  # up for longer than the deadline
            b.close()
            b = None
            pump({"a": a}, lambda e: of(e, "a", LinkDown))
            backoffs.append(a.link(link).backoff_s)  # the delay after the next failure
        assert backoffs[:4] == [0.1, 0.2, 0.4, 0.4], backoffs  # doubling, capped: not 0.05 s after every drop
        assert backoffs[4] == 0.1, backoffs  # it stayed up: redialled at reconnect_min_s (then doubling)
    finally:
        if b is not None:
            b.close()
        a.close()
