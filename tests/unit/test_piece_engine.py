"""PieceTransport rules with a scripted backend: exactly-once reports, nothing released while it can land,
one remote agent shared by every peer key that names it."""

from __future__ import annotations

import numpy as np
import pytest

from p2pworker.data.base import PeerDataInfo, XferState
from p2pworker.data.pieces import PieceTransport
from p2pworker.errors import TransferFailed
from p2pworker.shm import KVRegion


class Scripted(PieceTransport):
    """Posts stay PROC until the test completes them; every hook call is recorded."""

    backend = "fake"

    def __init__(self, region, *, abandons: bool = False, **kw):
        super().__init__(region, **kw)
        self.state: dict[int, XferState] = {}
        self.calls: list[tuple] = []
        self.post_error: Exception | None = None
        self.abandons = abandons  # like the ZMQ fallback: nothing lands once a piece is abandoned
        self._h = 0

    def local_info(self):
        return PeerDataInfo("fake", "me", self._region.address, self._region.num_blocks, self._bb)

    def _remote_add(self, name, info):
        if name == "refuse-me":
            raise TransferFailed("metadata refused")
        self.calls.append(("add", name))

    def _remote_forget(self, remote):
        self.calls.append(("forget", remote.name))

    def _post_piece(self, t, piece):
        if self.post_error:
            raise self.post_error
        self._h += 1
        self.state[self._h] = XferState.PROC
        self.calls.append(("post", t.tid, int(piece[:, 2].sum())))
        return XferState.PROC, self._h

    def _check_handle(self, h):
        st = self.state[h]
        if st == "abandoned":
            pytest.fail(f"abandoned handle {h} checked again")  # BaseException: not turned into ERR
        if isinstance(st, Exception):
            raise st
        return st

    def _release_handle(self, h):
        self.calls.append(("release", h))

    def _abandon_handle(self, h):
        if not self.abandons:
            return False
        self.calls.append(("abandon", h))
        self.state[h] = "abandoned"
        return True

    def _progress(self):
        pass

    def _deregister(self):
        self.calls.append(("deregister",))

    def finish_all(self, state=XferState.DONE):
        for h, st in self.state.items():
            if st is XferState.PROC:
                self.state[h] = state


@pytest.fixture
def tr(shm_prefix):
    with KVRegion.create(shm_prefix + "r", 64, 4096) as reg:
        t = Scripted(reg, max_piece_bytes=4 * 4096, post_budget_bytes=8 * 4096)
        t.add_peer("p", PeerDataInfo("fake", "peer-1", 0, 64, 4096))
        yield t
        t.finish_all()
        t.close(timeout_s=0.1)


def collect(tr, rounds=50):
    done, failed = [], []
    for _ in range(rounds):
        d, f = tr.poll()
        done += d
        failed += f
    return done, failed


def test_pieces_are_posted_one_at_a_time_within_budget(tr):
    tid = tr.read_blocks("p", np.arange(10), np.arange(10))  # 10 rows -> pieces of 4, 4, 2
    tr.poll()
    assert [c for c in tr.calls if c[0] == "post"] == [("post", tid, 4)]
    tr.finish_all()
    tr.poll()
    tr.finish_all()
    tr.poll()
    tr.finish_all()
    done, failed = collect(tr)
    assert done == [tid] and failed == []
    assert [c[2] for c in tr.calls if c[0] == "post"] == [4, 4, 2]


def test_failed_piece_fails_transfer_once_and_drops_the_rest(tr):
    tid = tr.read_blocks("p", np.arange(12), np.arange(12))
    tr.poll()
    tr.finish_all(RuntimeError("nixlRemoteDisconnectError"))
    done, failed = collect(tr)
    assert done == [] and len(failed) == 1
    assert failed[0][0] == tid and "nixlRemoteDisconnectError" in failed[0][1]
    assert len([c for c in tr.calls if c[0] == "post"]) == 1  # nothing posted after the failure


def test_post_exception_fails_the_transfer(tr):
    tr.post_error = RuntimeError("boom")
    tid = tr.read_blocks("p", [0], [0])
    assert collect(tr) == ([], [(tid, "fake post failed: RuntimeError: boom")])


def test_remove_peer_waits_for_posted_pieces_before_forgetting(tr):
    tid = tr.read_blocks("p", np.arange(8), np.arange(8))
    tr.poll()  # one piece PROC
    tr.remove_peer("p")
    assert ("forget", "peer-1") not in tr.calls, "remote handle dropped while a read can still land"
    d, f = tr.poll()
    assert list(d) == [] and list(f) == []  # not reported while in flight
    with pytest.raises(TransferFailed, match="unknown data peer"):
        tr.read_blocks("p", [0], [0])
    tr.finish_all()
    done, failed = collect(tr)
    assert done == [] and failed == [(tid, "cancelled")]
    assert ("forget", "peer-1") in tr.calls


def test_close_refuses_to_deregister_under_a_live_transfer(tr):
    tr.read_blocks("p", np.arange(4), np.arange(4))
    tr.poll()
    assert tr.close(timeout_s=0.05) is False
    assert ("deregister",) not in tr.calls
    tr.finish_all()
    assert tr.close(timeout_s=1) is True
    assert tr.calls[-1] == ("deregister",)
    assert tr.close() is True  # idempotent


def test_cancel_with_wait_reports_once(tr):
    t1 = tr.read_blocks("p", np.arange(8), np.arange(8))
    t2 = tr.read_blocks("p", np.arange(8, 12), np.arange(8, 12))
    tr.poll()
    tr.finish_all()
    tr.cancel([t1, t2], wait=True, timeout_s=1)
    done, failed = collect(tr)
    assert sorted(failed) == [(t1, "cancelled"), (t2, "cancelled")] and done == []
    tr.cancel([t1, t2])  # cancelling reported transfers is a no-op
    assert collect(tr) == ([], [])


def test_readding_a_peer_retires_the_old_incarnation(tr):
    tid = tr.read_blocks("p", np.arange(4), np.arange(4))
    tr.poll()
    tr.add_peer("p", PeerDataInfo("fake", "peer-2", 0, 64, 4096))  # restarted peer
    assert ("add", "peer-2") in tr.calls and ("forget", "peer-1") not in tr.calls
    tr.finish_all()
    done, failed = collect(tr)
    assert failed == [(tid, "cancelled")]
    assert ("forget", "peer-1") in tr.calls
    t2 = tr.read_blocks("p", [0], [0])
    tr.poll()
    tr.finish_all()
    assert collect(tr) == ([t2], [])


def info(name, num_blocks=64, metadata=b""):
    return PeerDataInfo("fake", name, 0, num_blocks, 4096, metadata=metadata)


def test_keys_naming_one_agent_share_one_remote_until_the_last_goes(tr):
    tr.add_peer("in-ab12", info("peer-1"))  # the symmetric pair's second link to the same worker
    assert tr.calls.count(("add", "peer-1")) == 1, "an agent NIXL already holds was added again"
    assert tr.remotes() == {"peer-1": 2}
    tid = tr.read_blocks("in-ab12", np.arange(4), np.arange(4))
    tr.remove_peer("p")
    assert ("forget", "peer-1") not in tr.calls, "forgotten while another key still names it"
    tr.poll()
    tr.finish_all()
    assert collect(tr) == ([tid], [])
    tr.remove_peer("in-ab12")
    assert tr.calls[-1] == ("forget", "peer-1") and tr.remotes() == {}
    tr.add_peer("out-4", info("peer-1"))  # after the remove, loading it again is allowed
    assert tr.calls[-1] == ("add", "peer-1") and tr.remotes() == {"peer-1": 1}


def test_a_retiring_key_keeps_the_remote_until_its_posted_pieces_settle(tr):
    tr.add_peer("q", info("peer-1"))
    tid = tr.read_blocks("p", np.arange(4), np.arange(4))
    tr.poll()  # posted through "p"
    tr.remove_peer("p")
    tr.remove_peer("q")  # the last live key goes, but a read through "p" can still land
    assert ("forget", "peer-1") not in tr.calls and tr.remotes() == {"peer-1": 1}
    tr.finish_all()
    assert collect(tr) == ([], [(tid, "cancelled")])
    assert tr.calls[-1] == ("forget", "peer-1") and tr.remotes() == {}


def test_a_new_key_may_share_a_remote_held_only_by_a_retiring_key(tr):
    tr.read_blocks("p", np.arange(4), np.arange(4))
    tr.poll()
    tr.remove_peer("p")  # retiring, piece in flight
    tr.add_peer("r", info("peer-1"))  # a reconnect overlapping the old link
    assert tr.calls.count(("add", "peer-1")) == 1 and tr.remotes() == {"peer-1": 2}
    tr.finish_all()
    collect(tr)
    assert ("forget", "peer-1") not in tr.calls and tr.remotes() == {"peer-1": 1}


def test_same_agent_name_with_other_metadata_is_refused_while_the_old_one_is_held(tr):
    tr.read_blocks("p", np.arange(4), np.arange(4))
    tr.poll()
    with pytest.raises(TransferFailed, match=r"'peer-1' is already loaded with other metadata .*\['p'\]"):
        tr.add_peer("p2", info("peer-1", metadata=b"restarted"))
    assert "p2" not in tr.peers()
    with pytest.raises(TransferFailed, match="metadata refused"):
        tr.add_peer("bad", info("refuse-me"))
    assert "bad" not in tr.peers() and "refuse-me" not in tr.remotes()


def test_readding_the_only_key_of_an_idle_agent_reloads_it(tr):
    tr.add_peer("p", info("peer-1"))
    assert tr.calls[-2:] == [("forget", "peer-1"), ("add", "peer-1")]  # NIXL: remove before add again
    assert tr.remotes() == {"peer-1": 1}


@pytest.fixture
def abandoning(shm_prefix):
    with KVRegion.create(shm_prefix + "r", 64, 4096) as reg:
        t = Scripted(reg, abandons=True, max_piece_bytes=4 * 4096, post_budget_bytes=8 * 4096)
        t.add_peer("p", info("peer-1"))
        yield t
        t.close(timeout_s=0.1)


def test_a_backend_that_can_abandon_reports_a_cancel_at_once(abandoning):
    tr = abandoning
    tid = tr.read_blocks("p", np.arange(8), np.arange(8))
    tr.poll()  # one piece posted, never finished
    tr.cancel([tid])
    assert ("abandon", 1) in tr.calls and ("release", 1) not in tr.calls
    assert collect(tr, rounds=1) == ([], [(tid, "cancelled")])
    tr.remove_peer("p")
    assert tr.calls[-1] == ("forget", "peer-1")  # nothing of it can land: forgotten at once
    assert tr.close(timeout_s=0.01) is True


def test_a_backend_that_cannot_abandon_waits_for_the_posted_piece(tr):
    tid = tr.read_blocks("p", np.arange(8), np.arange(8))
    tr.poll()
    tr.cancel([tid])
    assert collect(tr, rounds=3) == ([], [])  # NIXL: the bytes may still land; not reported yet
    tr.finish_all()
    assert collect(tr) == ([], [(tid, "cancelled")])
