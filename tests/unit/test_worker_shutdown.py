"""The worker's orderly stop (p2pworker/worker/shutdown.py) without processes: a recording stand-in for every room the
stop touches, so the order itself is what the tests read.

Invariant 7 (docs/invariants.md): a posted read may land in our rows until the data plane says it settled, so no
load is reported, no row unmapped and nothing deregistered before ``data.close`` returned True; a read that does
not settle ends the process (``abort``) before any of that.
"""

from __future__ import annotations

import types

import pytest

from p2pworker.worker.shutdown import StopRooms, shut_down


class _Stop(Exception):
    """Stands in for os._exit in Worker.abort: nothing after it runs in the real process."""


def _worker(calls: list[str], *, settles: bool = True, outbox_waiting: int = 0):
    def rec(name, ret=None):
        def f(*_a, **_k):
            calls.append(name)
            return ret
        return f

    session = types.SimpleNamespace(cancel_loads=rec("session.cancel_loads", ["cancel"]),
                                    close=rec("session.close", ["bye"]))
    host = types.SimpleNamespace(sessions={"in-1": session},
                                 run=lambda link, s, actions: calls.append(f"host.run {actions[0]}"))
    outbox = types.SimpleNamespace(waiting=outbox_waiting, pending=[None] * outbox_waiting, flush=rec("outbox.flush"))

    def abort(why):
        calls.append("abort")
        raise _Stop(why)

    core = types.SimpleNamespace(
        stop_reason="test", cfg=types.SimpleNamespace(shutdown_timeout_s=1.0), clock=lambda: 0.0,
        data=types.SimpleNamespace(close=rec("data.close", settles)),
        ctx=types.SimpleNamespace(lot=types.SimpleNamespace(shutdown=rec("lot.shutdown", 0))),
        ctl=types.SimpleNamespace(close=rec("ctl.close")),
        att=types.SimpleNamespace(region=types.SimpleNamespace(close=rec("region.close"))),
        evt=types.SimpleNamespace(close=rec("evt.close")),
        cmd=types.SimpleNamespace(close=rec("cmd.close"), peer_alive=lambda: False),
        abort=abort,
    )
    rooms = StopRooms(commands=types.SimpleNamespace(fail_queued=rec("commands.fail_queued")), host=host,
                      runner=types.SimpleNamespace(poll_data=rec("runner.poll_data")), outbox=outbox,
                      switch=types.SimpleNamespace(close_all=rec("lanes.close_all")),
                      servers=(types.SimpleNamespace(close=rec("admin.close")),))
    return core, rooms


def test_the_stop_drains_reads_before_it_reports_closes_or_unmaps_anything():
    calls: list[str] = []
    shut_down(*_worker(calls))
    assert calls == [
        "commands.fail_queued",  # queued jobs fail first: nothing new is started
        "session.cancel_loads", "host.run cancel",  # loads cancelled; reported only once their reads settle
        "data.close",  # every posted read settled (True) ...
        "runner.poll_data",  # ... and only then the cancelled loads are reported
        "session.close", "host.run bye",
        "lot.shutdown",  # leased rows stay unreported until this process exits
        "lanes.close_all", "ctl.close",
        "outbox.flush",  # the last events, then the region and the rings
        "region.close", "admin.close", "evt.close", "cmd.close",
    ]


def test_reads_that_do_not_settle_end_the_process_before_any_report_or_unmap():
    calls: list[str] = []
    with pytest.raises(_Stop):
        shut_down(*_worker(calls, settles=False))
    end = calls.index("abort")
    assert calls[end - 1] == "data.close"
    before = calls[:end]
    assert "runner.poll_data" not in before and "region.close" not in before and "lot.shutdown" not in before
    # (what the stand-in's finally runs after it never runs in the worker: os._exit does not return)


def test_events_the_adapter_cannot_take_are_given_up_without_waiting_for_a_gone_adapter():
    calls: list[str] = []
    shut_down(*_worker(calls, outbox_waiting=3))  # peer_alive() is False: no wait
    assert calls.count("outbox.flush") == 1 and calls[-4:] == ["region.close", "admin.close", "evt.close",
                                                                "cmd.close"]
