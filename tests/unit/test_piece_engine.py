"""PieceTransport rules with a scripted backend: exactly-once reports, nothing released while it can land."""

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

    def __init__(self, region, **kw):
        super().__init__(region, **kw)
        self.state: dict[int, XferState] = {}
        self.calls: list[tuple] = []
        self.post_error: Exception | None = None
        self._h = 0

    def local_info(self):
        return PeerDataInfo("fake", "me", self._region.address, self._region.num_blocks, self._bb)

    def _remote_add(self, peer, info):
        self.calls.append(("add", peer.remote_name))

    def _remote_forget(self, peer):
        self.calls.append(("forget", peer.remote_name))

    def _post_piece(self, t, piece):
        if self.post_error:
            raise self.post_error
        self._h += 1
        self.state[self._h] = XferState.PROC
        self.calls.append(("post", t.tid, int(piece[:, 2].sum())))
        return XferState.PROC, self._h

    def _check_handle(self, h):
        st = self.state[h]
        if isinstance(st, Exception):
            raise st
        return st

    def _release_handle(self, h):
        self.calls.append(("release", h))

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
    tid = tr.write_blocks("p", np.arange(10), np.arange(10))  # 10 rows -> pieces of 4, 4, 2
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
    tid = tr.write_blocks("p", np.arange(12), np.arange(12))
    tr.poll()
    tr.finish_all(RuntimeError("nixlRemoteDisconnectError"))
    done, failed = collect(tr)
    assert done == [] and len(failed) == 1
    assert failed[0][0] == tid and "nixlRemoteDisconnectError" in failed[0][1]
    assert len([c for c in tr.calls if c[0] == "post"]) == 1  # nothing posted after the failure


def test_post_exception_fails_the_transfer(tr):
    tr.post_error = RuntimeError("boom")
    tid = tr.write_blocks("p", [0], [0])
    assert collect(tr) == ([], [(tid, "fake post failed: RuntimeError: boom")])


def test_remove_peer_waits_for_posted_pieces_before_forgetting(tr):
    tid = tr.write_blocks("p", np.arange(8), np.arange(8))
    tr.poll()  # one piece PROC
    tr.remove_peer("p")
    assert ("forget", "peer-1") not in tr.calls, "remote handle dropped while a write can still land"
    d, f = tr.poll()
    assert list(d) == [] and list(f) == []  # not reported while in flight
    with pytest.raises(TransferFailed, match="unknown data peer"):
        tr.write_blocks("p", [0], [0])
    tr.finish_all()
    done, failed = collect(tr)
    assert done == [] and failed == [(tid, "cancelled")]
    assert ("forget", "peer-1") in tr.calls


def test_close_refuses_to_deregister_under_a_live_transfer(tr):
    tr.write_blocks("p", np.arange(4), np.arange(4))
    tr.poll()
    assert tr.close(timeout_s=0.05) is False
    assert ("deregister",) not in tr.calls
    tr.finish_all()
    assert tr.close(timeout_s=1) is True
    assert tr.calls[-1] == ("deregister",)
    assert tr.close() is True  # idempotent


def test_cancel_with_wait_reports_once(tr):
    t1 = tr.write_blocks("p", np.arange(8), np.arange(8))
    t2 = tr.write_blocks("p", np.arange(8, 12), np.arange(8, 12))
    tr.poll()
    tr.finish_all()
    tr.cancel([t1, t2], wait=True, timeout_s=1)
    done, failed = collect(tr)
    assert sorted(failed) == [(t1, "cancelled"), (t2, "cancelled")] and done == []
    tr.cancel([t1, t2])  # cancelling reported transfers is a no-op
    assert collect(tr) == ([], [])


def test_readding_a_peer_retires_the_old_incarnation(tr):
    tid = tr.write_blocks("p", np.arange(4), np.arange(4))
    tr.poll()
    tr.add_peer("p", PeerDataInfo("fake", "peer-2", 0, 64, 4096))  # restarted peer
    assert ("add", "peer-2") in tr.calls and ("forget", "peer-1") not in tr.calls
    tr.finish_all()
    done, failed = collect(tr)
    assert failed == [(tid, "cancelled")]
    assert ("forget", "peer-1") in tr.calls
    t2 = tr.write_blocks("p", [0], [0])
    tr.poll()
    tr.finish_all()
    assert collect(tr) == ([t2], [])
