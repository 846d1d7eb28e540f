"""Per-hop tracing of a worker, through the worker's one test hook: P2PWORKER_HOOK=benchmarks.hops.trace_hook:install.

The worker's own hops come from its named instrument points (p2pworker/instruments.py): commands taken, messages
sent and frames received, reads settled, events put, sleeps, the stop.  Inside the rooms it wraps public methods
of classes only (the control and lane sockets' send/recv/poll, the session's entry points, the data plane's
read_blocks and same-host copy): a renamed one fails the install with an AttributeError, never silently.  Rows
"<ns> <tag> [info...] cpu=<thread CPU ns>" (CLOCK_MONOTONIC, as time.monotonic_ns in the scheduler processes) are
written to $HOPTRACE_DIR/worker_<name>.txt when the worker stops; benchmarks/hops/analyze.py and pulls.py align
them with the scheduler's and the client's rows.  See benchmarks/hops/README.md.
"""
import os
import time

from p2pworker import api
from p2pworker.control import lane as lmod
from p2pworker.control import zmq_control
from p2pworker.data import pieces, samehost
from p2pworker.instruments import Instruments
from p2pworker.protocol import messages as m
from p2pworker.session import session as smod

T = []
now = time.monotonic_ns
_cpu = time.thread_time_ns
OUT = os.environ.get("HOPTRACE_DIR", "")
_last = {"sent": ("?", "-"), "timeout": -1}  # the message on_send announced (the socket wraps name it too)


def rec(tag, *info):
    T.append((now(), tag, *info, "cpu=%d" % _cpu()))


def _name(msg) -> tuple[str, str]:
    return type(msg).__name__, getattr(msg, "request_id", "-")


class Trace(Instruments):
    """The rows at the worker's instrument points."""

    def __init__(self, worker):
        self.worker = worker

    def on_command(self, cmd):
        rec("cmd", type(cmd).__name__, getattr(cmd, "job_id", -1), getattr(cmd, "request_id", "-"))

    def on_send(self, link, msg, lane):
        _last["sent"] = _name(msg)
        rec("send0", *_last["sent"])

    def on_received(self, link, frame, lane):
        try:
            msg = m.decode(frame)  # a copy, decoded for its name: the session decodes the frame itself next
        except Exception:  # noqa: BLE001  (the session reports a bad frame; the trace only names it)
            rec("dec", "undecodable", "-")
            return
        rec("dec", *_name(msg))

    def on_read_settled(self, transfer_id, ok):
        rec("read_result", ok)

    def on_event(self, ev):
        if isinstance(ev, api.JobFinished):
            rec("evt_put", ev.kind, ev.job_id)

    def on_sleep(self, timeout_s):
        _last["timeout"] = int(timeout_s * 1e6)
        rec("sleep0", 1)

    def on_woke(self):
        rec("sleep1", _last["timeout"])  # us of the timeout it slept with

    def on_stop(self):
        os.makedirs(OUT, exist_ok=True)
        with open(f"{OUT}/worker_{self.worker.cfg.name}.txt", "w") as f:
            for row in T:
                f.write(" ".join(map(str, row)) + "\n")


def install(w):
    """The worker hook (in the worker process only): the instrument points, and the public methods below."""
    if not OUT:
        raise SystemExit("trace_hook: set $HOPTRACE_DIR (where the rows go)")
    w.instruments = Trace(w)
    _wrap_sockets()
    _wrap_rooms()


def _wrap(cls, name, before, after):
    f0 = getattr(cls, name)  # AttributeError here: the method was renamed (the install fails, loudly)

    def f(self, *a, **k):
        before(a)
        try:
            return f0(self, *a, **k)
        finally:
            after(a)
    setattr(cls, name, f)


def _wrap_sockets():
    for cls in (zmq_control.ZmqControl, lmod.Lane):
        _wrap(cls, "send", lambda a: None, lambda a: rec("sent", *_last["sent"]))

    def rx(cls, name):
        f0 = getattr(cls, name)

        def f(self, *a, **k):
            out = f0(self, *a, **k)
            if out:
                rec("rx", len(out))
            return out
        setattr(cls, name, f)
    rx(zmq_control.ZmqControl, "poll")
    rx(lmod.Lane, "recv")


def _wrap_rooms():
    _wrap(samehost.Copier, "copy", lambda a: rec("copy0", int(a[1][:, 2].sum()), "runs=%d" % len(a[1])),
          lambda a: rec("copy1"))
    _wrap(pieces.PieceTransport, "read_blocks", lambda a: rec("rb0"), lambda a: rec("rb1"))
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
