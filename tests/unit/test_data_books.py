"""The data plane's books on their own (no backend, no region): which key holds which remote agent, and
transfers from submission to their one report."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from p2pworker.data.base import PeerDataInfo, TransferStats
from p2pworker.data.peer_book import Peer, PeerBook, Remote, RemotePath
from p2pworker.data.transfer_book import TransferBook
from p2pworker.errors import TransferFailed


def _info(agent: str = "w1", base: int = 0) -> PeerDataInfo:
    return PeerDataInfo("fake", agent, base, 64, 4096)


def test_keys_share_one_remote_per_incarnation_and_the_last_reference_forgets_it():
    book = PeerBook()
    assert book.known("a", _info()) is None  # first met: the transport makes and loads it
    remote = Remote("w1", _info())
    book.loaded(remote)
    a = book.register("a", remote, _info())
    assert book.known("b", _info()) is remote
    b = book.register("b", remote, _info())
    assert book.ref_counts() == {"w1": 2} and book.get("a") is a
    with pytest.raises(TransferFailed, match=r"peer c: agent 'w1' is already loaded .* \['a', 'b'\]"):
        book.known("c", _info(base=4096))  # a restarted peer under the same agent name
    assert book.retire("a") is a and book.retire("a") is None
    assert list(book.live) == ["b"] and book.records() == [b, a]
    assert book.reap(lambda p: True) == [] and book.retiring == [a]  # a read through it can still land
    assert book.reap(lambda p: False) == [a] and book.retiring == []
    assert book.drop(a) is None  # b still references it
    assert book.drop(b) is remote and book.remotes == {}


def test_an_unusable_remote_is_not_shared_and_its_old_keys_do_not_forget_the_new_one():
    book = PeerBook()
    old = Remote("w1", _info(), path=RemotePath.UNUSABLE)
    book.loaded(old)
    a = book.register("a", old, _info())
    assert book.known("b", _info(base=4096)) is None  # afresh, whatever it says now
    new = Remote("w1", _info(base=4096))
    book.loaded(new)
    book.register("b", new, _info(base=4096))
    assert book.drop(a) is None and book.remotes == {"w1": new}


def test_path_views_say_which_path_and_why_not_the_same_host_one():
    r = Remote("w1", _info(), refusal="other boot")
    views = {}
    for path in RemotePath:
        r.path = path
        views[path] = r.path_view("nixl")
    assert views == {RemotePath.UNDECIDED: ("undecided", "chosen at the first read from this peer (it dialed us)"),
                     RemotePath.SAME_HOST: ("same_host", ""), RemotePath.BACKEND: ("nixl", "other boot"),
                     RemotePath.UNUSABLE: ("unusable", "other boot")}


def _pieces(*counts: int) -> deque:
    return deque(np.array([[0, 0, c]]) for c in counts)


def test_a_transfer_is_reported_once_only_when_nothing_of_it_is_pending_or_posted():
    stats = TransferStats()
    book = TransferBook(stats)
    peer = Peer("p", Remote("w1", _info()), 0, 64)
    tid = book.submit(peer, _pieces(4, 2), 6 * 4096, t_submit=1.0)
    t = book.get(tid)
    assert peer.transfers == {tid} and len(book) == 1 and stats.submitted == 1 and stats.last_descriptors == 2
    assert t.ready and book.has_backlog()
    t.pieces.popleft()
    t.posted.append("h1")
    assert not t.ready and not book.has_backlog()  # one piece of a transfer at a time
    assert book.with_posted() == [t] and book.with_posted({tid + 1}) == [] and book.any_posted(peer)
    assert book.posted_count() == 1
    book.settle(t)
    assert book.take_reports() == ((), ())  # a piece can still land
    t.posted.clear()
    book.settle(t)
    assert book.take_reports() == ((), ())  # a piece is still to post
    t.pieces.clear()
    book.settle(t)
    assert book.take_reports() == ([tid], []) and book.take_reports() == ((), ())
    assert peer.transfers == set() and len(book) == 0
    assert (stats.done, stats.bytes_done, stats.per_peer_bytes) == (1, 6 * 4096, {"p": 6 * 4096})


def test_a_failed_transfer_is_reported_with_its_error_and_counts_no_bytes():
    stats = TransferStats()
    book = TransferBook(stats)
    peer = Peer("p", Remote("w1", _info()), 0, 64)
    first, second = (book.submit(peer, _pieces(1), 4096, t_submit=0.0) for _ in range(2))
    assert second == first + 1
    t = book.get(first)
    t.error = "cancelled"
    book.settle(t)  # pieces left, but an error: nothing more will be posted
    assert book.take_reports() == ([], [(first, "cancelled")])
    assert (stats.failed, stats.done, stats.bytes_done) == (1, 0, 0) and [x.tid for x in book.all()] == [second]
