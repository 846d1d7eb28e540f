"""The worker's rooms that hold no I/O, without processes: the peer book (p2pworker/worker/peers.py) and the name
resolver (p2pworker/worker/resolver.py)."""

from __future__ import annotations

import threading

from p2pworker.worker.peers import RECONNECT_MAX_S, RECONNECT_MIN_S, RETRY_FORGET_S, PeerBook, addr_key
from p2pworker.worker.resolver import Resolver
from tests.helpers.session import Clock


def test_forget_is_the_one_way_a_link_leaves_the_book_and_it_is_idempotent():
    book = PeerBook()
    book.add("p:1", "out-1")
    book.was_up.add("out-1")
    assert book.forget("out-1") == "p:1"
    assert not book.links and not book.addr_of and not book.was_up
    assert book.forget("out-1") is None  # again: nothing, no error


def test_forget_of_a_superseded_link_keeps_the_addresss_newer_link():
    book = PeerBook()
    book.add("p:1", "out-1")
    book.add("p:1", "out-2")  # a fresh link for the same address
    assert book.forget("out-1") == "p:1"
    assert book.links == {"p:1": "out-2"} and book.addr_of == {"out-2": "p:1"}


def test_backoff_doubles_per_failure_up_to_its_cap_and_starts_afresh_after_a_quiet_minute():
    book, now = PeerBook(), 0.0
    delays = []
    for _ in range(8):
        b = book.backoff("p:1", "refused", now)
        delays.append(round(b.not_before - now, 6))
    assert delays[0] == RECONNECT_MIN_S and delays[-1] == RECONNECT_MAX_S
    assert all(b == min(2 * a, RECONNECT_MAX_S) for a, b in zip(delays, delays[1:]))
    assert book.blocked("p:1", now) is not None and book.blocked("p:1", now + RECONNECT_MAX_S) is None
    later = now + RECONNECT_MAX_S + RETRY_FORGET_S + 1
    book.backoff("other:2", "x", later)  # any backoff sweeps entries quiet for RETRY_FORGET_S
    assert "p:1" not in book.retry
    assert book.backoff("p:1", "refused", later).not_before == later + RECONNECT_MIN_S


def test_an_unreachable_address_is_logged_once_and_the_log_set_is_bounded():
    book = PeerBook()
    assert book.first_failure("p:1") and not book.first_failure("p:1")
    for i in range(5000):
        book.first_failure(f"h{i}:1")
    assert len(book.unreachable_logged) <= 1024


def test_addr_key_drops_the_scheme():
    assert addr_key("tcp://h:1") == "h:1" and addr_key("h:1") == "h:1"


class FakeLookup:
    made: list = []

    def __init__(self, host, port, started):
        self.host, self.port, self.started = host, port, started
        self.error = None
        self.done = threading.Event()
        FakeLookup.made.append(self)


def test_literals_dial_at_once_names_wait_for_one_lookup_and_resolved_names_are_trusted_for_the_ttl():
    FakeLookup.made = []
    clock = Clock(100.0)
    r = Resolver(clock, FakeLookup, ttl_s=30.0, timeout_s=5.0)
    assert r.resolve("10.0.0.1:5710", "a") == "10.0.0.1:5710" and r.resolve("[::1]:5710", "b") == "[::1]:5710"
    assert r.resolve("prefill:5710", "c") is None and r.resolve("prefill:5710", "d") is None
    assert len(FakeLookup.made) == 1 and "prefill:5710" in r and bool(r)
    assert r.settle() == []  # not done yet
    FakeLookup.made[0].done.set()
    (s,) = r.settle()
    assert (s.key, s.error, s.cmds) == ("prefill:5710", None, ["c", "d"]) and not r
    clock.now += 29.0
    assert r.resolve("prefill:5710", "e") == "prefill:5710"  # within the ttl
    clock.now += 2.0
    assert r.resolve("prefill:5710", "f") is None and len(FakeLookup.made) == 2  # looked up again


def test_a_failed_or_slow_lookup_settles_with_its_error_and_a_shutdown_takes_what_waits():
    FakeLookup.made = []
    clock = Clock(100.0)
    r = Resolver(clock, FakeLookup, ttl_s=30.0, timeout_s=5.0)
    r.resolve("bad:1", "a")
    r.resolve("slow:1", "b")
    r.resolve("late:1", None)  # a session opened for no command (OpenSession): nothing to rerun or fail
    FakeLookup.made[0].error = "Name or service not known"
    FakeLookup.made[0].done.set()
    (s,) = r.settle()
    assert s.key == "bad:1" and "cannot resolve it: Name or service not known" in s.error and s.cmds == ["a"]
    clock.now += 5.0
    (s,) = [x for x in r.settle() if x.key == "slow:1"]
    assert "took more than 5 s" in s.error and s.cmds == ["b"]
    r.resolve("slow2:1", "c")
    assert r.take_waiting() == ["c"] and not r
