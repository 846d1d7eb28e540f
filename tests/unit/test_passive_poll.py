"""How long the worker's loop sleeps while it holds leases (p2pworker.worker.poll_timeout_s), and the offer time it
reads (ParkingLot.last_offer_at, set by the session when it offers rows)."""

from __future__ import annotations

import math

from p2pworker.config import WorkerConfig
from p2pworker.worker import poll_timeout_s
from tests.helpers.session import KEYS, Pair

CFG = WorkerConfig()


def timeout(busy=False, now=100.0, next_tick=100.0625, offering=0, last_offer_at=-math.inf) -> float:
    return poll_timeout_s(CFG, busy=busy, now=now, next_tick=next_tick, offering=offering,
                          last_offer_at=last_offer_at)


def test_idle_until_the_next_timer_busy_while_our_reads_are_in_flight():
    assert timeout() == 0.0625 and timeout(next_tick=101.0) == CFG.idle_poll_s
    assert timeout(next_tick=99.0) == 0.0  # a timer is due: do not sleep
    assert timeout(busy=True, offering=3, last_offer_at=100.0) == CFG.busy_poll_s


def test_leases_poll_fastest_right_after_an_offer_then_at_the_passive_rate():
    assert CFG.passive_burst_poll_s < CFG.passive_poll_s < CFG.idle_poll_s
    assert timeout(offering=1, last_offer_at=100.0 - CFG.passive_burst_s / 2) == CFG.passive_burst_poll_s
    assert timeout(offering=1, last_offer_at=100.0 - CFG.passive_burst_s) == CFG.passive_poll_s  # window over
    assert timeout(offering=1) == CFG.passive_poll_s  # offered long ago, still leased (a slow consumer)
    assert timeout(offering=0, last_offer_at=100.0) == 0.0625  # nothing offered under a lease: nobody can read
    off = WorkerConfig(passive_burst_s=0.0)
    assert poll_timeout_s(off, busy=False, now=1.0, next_tick=2.0, offering=1,
                          last_offer_at=1.0) == off.passive_poll_s


def test_the_producer_counts_leases_with_offered_rows_and_records_when_it_offers():
    p = Pair().handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()  # Fetch before any store: a lease, nothing offered, nothing to poll for
    assert (p.b.lot.leases, p.b.lot.offering, p.b.lot.last_offer_at) == (1, 0, -math.inf)
    p.clock_b.advance(5.0)
    p.b.store(1, "req", KEYS[:2], [20, 21])
    assert p.b.lot.offering == 1 and p.b.lot.last_offer_at == p.clock_b()
    p.b.store(2, "req", KEYS[2:], [22, 23])
    assert p.b.lot.offering == 1  # one lease, however many offers
    p.deliver()
    p.pull_all()  # the consumer reads and releases
    assert (p.b.lot.leases, p.b.lot.offering) == (0, 0)
