"""Per-hop tracing of a worker, through the worker's one test hook: P2PWORKER_HOOK=benchmarks.hops.trace_hook:install.

Wraps (in the worker process only) the control send/receive, message decoding, the session's entry points, the
data plane's read_blocks and same-host copy, the loop's sleeps and the event ring puts.  Rows "<ns> <tag>
[info...] cpu=<thread CPU ns>" (CLOCK_MONOTONIC, as time.monotonic_ns in the scheduler processes) are written to
$HOPTRACE_DIR/worker_<name>.txt at shutdown; benchmarks/hops/analyze.py aligns them with pd_tier's scheduler-side
rows (written there when $HOPTRACE_DIR is set).  See benchmarks/hops/README.md.
"""
import os
import time

from p2pworker import api
from p2pworker.worker import actions as amod
from p2pworker.worker import lane_host as lhmod
from p2pworker.worker import loop as wmod
from p2pworker.control import zmq_control
from p2pworker.data import samehost
from p2pworker.protocol import messages as m

T = []
now = time.monotonic_ns
_last = {"enc": None, "timeout": None}
OUT = os.environ.get("HOPTRACE_DIR", "")


_cpu = time.thread_time_ns


def rec(tag, *info):
    T.append((now(), tag, *info, "cpu=%d" % _cpu()))


def install(w):
    """The worker hook: every wrap below, in the worker process only."""
    _trace_messages()
    _trace_control()
    _trace_data()
    _trace_commands(w)
    _trace_sleep_and_events(w)


def _trace_messages():
    enc0 = amod.encode

    def enc(msg):
        _last["enc"] = (type(msg).__name__, getattr(msg, "request_id", "-"))
        return enc0(msg)
    amod.encode = enc  # a session's messages (actions.py) and the LaneUp of a lane switch (lane_host.py)
    lhmod.encode = enc

    dec0 = m.decode

    def dec(frame):
        msg = dec0(frame)
        rec("dec", type(msg).__name__, getattr(msg, "request_id", "-"))
        return msg
    m.decode = dec


def _trace_control():
    send0 = zmq_control.ZmqControl.send

    def send(self, link, payload):
        rec("send0", *(_last["enc"] or ("?", "-")))
        r = send0(self, link, payload)
        rec("sent", *(_last["enc"] or ("?", "-")))
        return r
    zmq_control.ZmqControl.send = send

    from p2pworker.control import lane as lmod  # a same-host session's messages go on its lane after LaneUp
    lsend0 = lmod.Lane.send

    def lane_send(self, frame):
        rec("send0", *(_last["enc"] or ("?", "-")))
        r = lsend0(self, frame)
        rec("sent", *(_last["enc"] or ("?", "-")))
        return r
    lmod.Lane.send = lane_send
    lrecv0 = lmod.Lane.recv

    def lane_recv(self):
        out = lrecv0(self)
        if out:
            rec("rx", len(out))
        return out
    lmod.Lane.recv = lane_recv

    poll0 = zmq_control.ZmqControl.poll

    def poll(self, timeout_ms=0):
        out = poll0(self, timeout_ms)
        if out:
            rec("rx", len(out))
        return out
    zmq_control.ZmqControl.poll = poll


def _trace_data():
    cp0 = samehost.Copier.copy

    def copy(self, source, runs):
        rec("copy0", int(runs[:, 2].sum()), "runs=%d" % len(runs))
        try:
            return cp0(self, source, runs)
        finally:
            rec("copy1")
    samehost.Copier.copy = copy

    from p2pworker.session import session as smod
    for name in ("load", "receive", "on_read_result"):
        f0 = getattr(smod.Session, name)

        def mk(f0, name):
            def f(self, *a, **k):
                rec("S0", name)
                r = f0(self, *a, **k)
                rec("S1", name, len(r) if isinstance(r, list) else -1)
                return r
            return f
        setattr(smod.Session, name, mk(f0, name))
    from p2pworker.data import pieces
    rb0 = pieces.PieceTransport.read_blocks

    def read_blocks(self, *a):
        rec("rb0")
        r = rb0(self, *a)
        rec("rb1")
        return r
    pieces.PieceTransport.read_blocks = read_blocks


def _trace_commands(w):
    rr0 = w.runner.read_result

    def read_result(tid, ok, reason):
        rec("read_result", ok)
        return rr0(tid, ok, reason)
    w.runner.read_result = read_result

    h0 = w.commands.handle

    def handle(cmd):
        rec("cmd", type(cmd).__name__, getattr(cmd, "job_id", -1), getattr(cmd, "request_id", "-"))
        return h0(cmd)
    w.commands.handle = handle


def _trace_sleep_and_events(w):
    pt0 = wmod.poll_timeout_s

    def poll_timeout_s(*a, **k):
        r = pt0(*a, **k)
        _last["timeout"] = r
        return r
    wmod.poll_timeout_s = poll_timeout_s

    sl0 = w._sleep

    def sleep(busy):
        _last["timeout"] = None
        rec("sleep0", int(busy))
        r = sl0(busy)
        t = _last["timeout"]
        rec("sleep1", -1 if t is None else int(t * 1e6))  # us of the timeout it slept with (-1: did not sleep)
        return r
    w._sleep = sleep

    tp0 = w.evt.try_put

    def try_put(ev):
        r = tp0(ev)
        if r and isinstance(ev, api.JobFinished):
            rec("evt_put", ev.kind, ev.job_id)
        return r
    w.evt.try_put = try_put

    sd0 = w.shutdown

    def shutdown():
        try:
            os.makedirs(OUT, exist_ok=True)
            with open(f"{OUT}/worker_{w.cfg.name}.txt", "w") as f:
                for row in T:
                    f.write(" ".join(map(str, row)) + "\n")
        finally:
            sd0()
    w.shutdown = shutdown
