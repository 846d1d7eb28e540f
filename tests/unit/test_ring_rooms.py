"""The ring's rooms on their own, over a plain buffer of header words: role claims and peer liveness
(ring_peer.Ends), the bells and sleep flags (ring_bells.Bells), the words each end owns (ring_layout)."""

from __future__ import annotations

import os
import select

import pytest

from p2pworker.errors import PeerDead, RingError
from p2pworker.shm.liveness import self_identity
from p2pworker.shm.ring_bells import Bells
from p2pworker.shm.ring_layout import (END_WORDS, HEADER_BYTES, STATE_ATTACHED, STATE_CLOSED, W_CONS_SLEEPING,
                                       W_PROD_SLEEPING, Role, unlink_all)
from p2pworker.shm.ring_peer import Ends, PeerStatus


@pytest.fixture
def words():
    w = memoryview(bytearray(HEADER_BYTES)).cast("Q")
    yield w
    w.release()


def test_each_end_owns_its_own_words_and_the_roles_pair_up():
    assert {r.peer for r in Role} == set(Role) and all(r.peer.peer is r for r in Role)
    prod, cons = END_WORDS[Role.PRODUCER], END_WORDS[Role.CONSUMER]
    assert (prod.sleeping, cons.sleeping) == (W_PROD_SLEEPING, W_CONS_SLEEPING)
    owned = [set(vars(e).values()) for e in (prod, cons)]
    assert not owned[0] & owned[1]
    assert all(w * 8 < HEADER_BYTES for e in owned for w in e)


def test_a_claim_writes_this_process_and_the_peer_reads_it_until_it_closes(words):
    prod, cons = Ends("r", Role.PRODUCER, words), Ends("r", Role.CONSUMER, words)
    assert cons.peer_status() is PeerStatus.PENDING and not cons.peer_status().gone
    prod.claim()
    assert cons.peer_status() is PeerStatus.ALIVE and cons.peer_pid == os.getpid()
    cons.check_peer()  # alive: nothing raised
    with pytest.raises(RingError, match=f"producer role of ring 'r' is held by live pid {os.getpid()}"):
        Ends("r", Role.PRODUCER, words).claim()
    prod.mark_closed()
    assert words[END_WORDS[Role.PRODUCER].state] == STATE_CLOSED
    assert cons.peer_status() is PeerStatus.CLOSED and cons.peer_status().gone
    with pytest.raises(PeerDead, match="closed the ring"):
        cons.check_peer()
    Ends("r", Role.PRODUCER, words).claim()  # a closed end may be claimed again


def test_an_attached_peer_whose_process_is_gone_is_dead_and_its_role_free(words):
    pid, start = self_identity()
    mine = END_WORDS[Role.CONSUMER]
    words[mine.pid], words[mine.start], words[mine.state] = pid, start + 1, STATE_ATTACHED  # another start: reused
    prod = Ends("r", Role.PRODUCER, words)
    assert prod.peer_status() is PeerStatus.DEAD
    with pytest.raises(PeerDead, match="consumer.*exited or was killed"):
        prod.check_peer()
    Ends("r", Role.CONSUMER, words).claim()  # a dead holder does not keep the role
    assert prod.peer_status() is PeerStatus.ALIVE


@pytest.fixture
def bells(shm_prefix, words):
    name = f"{shm_prefix}bells"
    made = [Bells(name, Role.PRODUCER, words, create=True)]
    made.append(Bells(name, Role.CONSUMER, words, create=False))
    yield made
    for b in made:
        b.close()
    unlink_all(name)


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_bell_rings_only_for_a_side_that_armed_and_disarm_empties_it(bells, words):
    prod, cons = bells
    assert prod.fileno() != cons.fileno()
    prod.ring_peer()
    assert not _readable(cons.fileno())  # the consumer did not say it may sleep: no write
    assert not cons.arm(lambda: False) and words[W_CONS_SLEEPING] == 1
    prod.ring_peer()
    assert words[W_CONS_SLEEPING] == 0 and _readable(cons.fileno())
    cons.sleep(1000)  # returns at once: the bell is readable
    cons.disarm()
    assert not _readable(cons.fileno())
    assert cons.arm(lambda: True) and words[W_CONS_SLEEPING] == 0  # ready after the fence: do not sleep


def test_wake_peer_rings_regardless_and_watch_returns_on_its_interrupt(bells, words):
    prod, cons = bells
    cons.wake_peer()
    assert _readable(prod.fileno())
    prod.disarm()
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        cons.watch(lambda: False, 10_000, r)  # the interrupt is readable: no wait
        assert words[W_CONS_SLEEPING] == 0
        cons.watch(lambda: True, 10_000, -1)  # woken before any poll
    finally:
        os.close(r)
        os.close(w)
    cons.close()
    cons.close()  # idempotent
