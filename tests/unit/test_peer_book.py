"""PeerBook's record of outbound links that went down after they were up: which of them a tick drops (long down, not
kept), in what order, and what a LinkUp or a forget takes out of it."""

from __future__ import annotations

from p2pworker.worker.peers import PeerBook

AFTER_S = 60.0


def book(*links: str) -> PeerBook:
    b = PeerBook()
    for i, link in enumerate(links):
        b.add(f"10.0.0.{i}:5710", link)
        b.was_up.add(link)
    return b


def test_a_link_down_for_the_window_is_dropped_and_a_younger_one_is_not():
    b = book("out-1", "out-2")
    b.went_down("out-1", 100.0)
    b.went_down("out-2", 130.0)
    assert b.long_down(159.9, AFTER_S) == []
    assert b.long_down(160.0, AFTER_S) == [("out-1", "10.0.0.0:5710")]
    assert b.long_down(200.0, AFTER_S) == [("out-1", "10.0.0.0:5710"), ("out-2", "10.0.0.1:5710")]


def test_a_second_link_down_keeps_the_first_time_and_a_link_up_clears_it():
    b = book("out-1")
    b.went_down("out-1", 100.0)
    b.went_down("out-1", 150.0)  # the transport reports each down once; a later one does not restart the window
    assert b.long_down(160.0, AFTER_S) == [("out-1", "10.0.0.0:5710")]
    b.came_up("out-1")
    assert b.long_down(1000.0, AFTER_S) == []
    b.went_down("out-1", 900.0)  # down again: a new window from then
    assert b.long_down(959.0, AFTER_S) == [] and b.long_down(960.0, AFTER_S) == [("out-1", "10.0.0.0:5710")]


def test_a_kept_address_is_never_dropped_and_does_not_hide_the_others():
    b = book("out-1", "out-2")
    b.kept.add("10.0.0.0:5710")  # the tier's peers: re-opened, never given up on
    b.went_down("out-1", 100.0)
    b.went_down("out-2", 110.0)
    assert b.long_down(500.0, AFTER_S) == [("out-2", "10.0.0.1:5710")]


def test_forget_takes_the_link_out_of_the_down_record():
    b = book("out-1")
    b.went_down("out-1", 100.0)
    assert b.forget("out-1") == "10.0.0.0:5710"
    assert b.down_since == {} and b.long_down(1000.0, AFTER_S) == []


def test_a_link_that_came_up_again_and_went_down_later_is_scanned_after_older_ones():
    """Oldest first, so the scan stops at the first young link: a re-down link moves to the end."""
    b = book("out-1", "out-2")
    b.went_down("out-1", 100.0)
    b.went_down("out-2", 120.0)
    b.came_up("out-1")
    b.went_down("out-1", 140.0)
    assert list(b.down_since) == ["out-2", "out-1"]
    assert b.long_down(185.0, AFTER_S) == [("out-2", "10.0.0.1:5710")]


def test_a_dropped_address_is_gone_until_a_link_to_it_comes_up():
    b = book("out-1")
    b.went_down("out-1", 100.0)
    b.forget("out-1")
    b.dropped("10.0.0.0:5710")
    assert list(b.gone) == ["10.0.0.0:5710"]
    b.add("10.0.0.0:5710", "out-2")  # a command named it: dialled again
    assert "10.0.0.0:5710" in b.gone  # a dial is not a link: still failed at once until it is up
    b.came_up("out-2")
    assert not b.gone and b.down_since == {}


def test_the_gone_addresses_are_bounded_oldest_forgotten_first():
    b = PeerBook(gone_max=3)
    for i in range(5):
        b.dropped(f"h{i}:1")
    b.dropped("h2:1")  # dropped again: the newest
    assert list(b.gone) == ["h3:1", "h4:1", "h2:1"]
