"""Random interleavings of everything that can happen to a pair of sessions, checked against the invariants.

Invariants (DESIGN.md 1 and the session issue):
- every submitted job is reported exactly once (the Reporter raises on a duplicate or unknown report);
- a producer writes only into rows the consumer granted for that request, key by key, and only from
  rows of store jobs that are still open (a reported job's rows belong to vLLM again);
- a load reports only keys it asked for.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pworker.errors import RemoteProtocolError
from p2pworker.protocol import messages as m
from p2pworker.session import JobDone, State
from tests.unit.session_harness import Pair

REQS = ["r0", "r1"]
KEYS = [b"k%d" % i for i in range(4)]

store_op = st.tuples(st.just("store"), st.sampled_from(REQS), st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
load_op = st.tuples(st.just("load"), st.sampled_from(REQS), st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
deliver_all = st.tuples(st.just("deliver"), st.none())
complete_op = st.tuples(st.just("complete"), st.integers(0, 1000), st.booleans() | st.just(True) | st.just(True))
rare = [
    st.tuples(st.just("finish"), st.sampled_from(REQS)),
    st.tuples(st.just("lookup"), st.lists(st.sampled_from(KEYS), max_size=3)),
    st.tuples(st.just("deliver"), st.integers(1, 6)),
    st.tuples(st.just("submit_fail"), st.booleans()),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 5.0, 21.0, 31.0, 61.0])),
    st.tuples(st.just("tick")),
    st.tuples(st.just("answer")),
]
# one_of picks its branches about evenly: the core PD flow is listed several times over
op = st.one_of(*([store_op] * 4 + [load_op] * 4 + [deliver_all] * 5 + [complete_op] * 4 + rare))
kill = st.none() | st.tuples(st.floats(0, 1), st.sampled_from(["a", "b", "both"]))  # where, as a fraction of the ops


class Model:
    def __init__(self, seed: int):
        self.p = Pair().handshake()
        self.rng = random.Random(seed)
        self.next_job = 1
        self.next_lookup = 1
        self.opened: set[int] = set()
        self.loads: dict[int, set[bytes]] = {}
        self.store_rows: dict[int, dict[bytes, int]] = {}  # open store job -> key -> local row
        self.granted: dict[tuple[str, int], dict[bytes, int]] = {}  # (request, round) -> key -> consumer row
        self.reported: dict[int, JobDone] = {}
        self.free_rows = list(range(64))
        self.checked_writes = 0

    def job(self) -> int:
        j = self.next_job
        self.next_job += 1
        self.opened.add(j)
        return j

    def step(self, o) -> None:
        p, kind = self.p, o[0]
        if kind == "store":
            j = self.job()
            rows = self.rng.sample(range(64), len(o[2]))
            self.store_rows[j] = dict(zip(o[2], rows))
            p.b.lot.store(j, o[1], o[2], rows)
        elif kind == "load":
            j = self.job()
            self.loads[j] = set(o[2])
            p.sa.load(j, o[1], o[2], self.rng.sample(range(64), len(o[2])))
        elif kind == "finish":
            p.b.lot.request_finished(o[1])
        elif kind == "lookup":
            p.sa.lookup(self.next_lookup, o[1], "r0")
            self.next_lookup += 1
        elif kind == "deliver":
            self.deliver(o[1])
        elif kind == "complete" and p.b.data.pending:
            tids = sorted(p.b.data.pending)
            p.b.complete(tids[o[1] % len(tids)], o[2], "" if o[2] else "injected")
        elif kind == "submit_fail":
            p.b.data.fail_submit = o[1]
        elif kind == "advance":
            p.clock.advance(o[1])
        elif kind == "tick":
            p.sa.tick()
            p.sb.tick()
            p.b.lot.tick()
        elif kind == "answer":
            for s in (p.sa, p.sb):
                for lookup_id, n in list(s._serving.items()):
                    s.answer_lookup(lookup_id, [True] * n)
        elif kind == "kill":
            if o[1] in ("a", "both"):
                p.sa.close("killed")
            if o[1] in ("b", "both"):
                p.sb.close("killed")
        self.check()

    def deliver(self, n=None) -> None:
        try:
            self.p.deliver(n)
        except RemoteProtocolError as e:  # the sessions themselves never produce invalid frames
            raise AssertionError(f"an honest peer caused a protocol error: {e}") from e

    def check(self) -> None:
        p = self.p
        for frame in p.wire_a_to_b:
            msg = m.decode(frame)
            if isinstance(msg, m.Fetch):
                self.granted[(msg.request_id, msg.round)] = dict(zip(msg.keys, msg.rows))
        p.wire_a_to_b.clear()
        for ev in p.a.events() + p.b.events():
            if isinstance(ev, JobDone):
                assert ev.job_id in self.opened, f"report for unknown job {ev.job_id}"
                assert ev.job_id not in self.reported, f"job {ev.job_id} reported twice"
                self.reported[ev.job_id] = ev
                if ev.kind == "load":
                    assert set(ev.keys) <= self.loads[ev.job_id]
                else:
                    self.store_rows.pop(ev.job_id, None)
        for peer, tid, local_rows, remote_rows in p.b.data.writes[self.checked_writes:]:
            owner = p.b.ctx.write_owner.get(tid)
            assert owner is not None, "a write nobody owns"
            _, parcel, fetch = owner
            keys = fetch.inflight[tid]
            grant = self.granted[(parcel.request_id, fetch.round)]
            for key, lrow, rrow in zip(keys, local_rows, remote_rows):
                assert grant.get(key) == rrow, f"wrote {key!r} into row {rrow}, granted {grant.get(key)}"
                open_rows = [rows[key] for rows in self.store_rows.values() if key in rows]
                assert lrow in open_rows, f"read {key!r} from row {lrow} that no open store job holds"
        self.checked_writes = len(p.b.data.writes)

    def finish(self) -> None:
        """Let everything run out: every job must then have been reported."""
        p = self.p
        p.b.data.fail_submit = False
        for _ in range(4):
            self.deliver()
            self.check()  # before completing: completed writes leave write_owner
            p.b.complete_all()
            p.clock.advance(100)
            p.sa.tick()
            p.sb.tick()
            p.b.lot.tick()
            for s in (p.sa, p.sb):
                for lookup_id, n in list(s._serving.items()):
                    s.answer_lookup(lookup_id, [False] * n)
            self.check()
        assert p.a.reporter.open_jobs == 0 and p.b.reporter.open_jobs == 0
        assert set(self.reported) == self.opened, f"never reported: {self.opened - set(self.reported)}"
        assert not p.a.reporter._lookups


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=5, max_size=80), kill, st.integers(0, 2**32))
def test_random_interleavings_keep_every_invariant(ops, kill_at, seed):
    model = Model(seed)
    kill_index = None if kill_at is None else int(kill_at[0] * (len(ops) - 1))
    for i, o in enumerate(ops):
        if i == kill_index:
            model.step(("kill", kill_at[1]))  # peer death, once, at a random point
        model.step(o)
    model.finish()
    if model.p.sa.state is State.ACTIVE and model.p.sb.state is State.ACTIVE:
        assert model.p.sa.counters["protocol_errors"] == 0
