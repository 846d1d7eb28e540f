"""The worker's instrument points (p2pworker/instruments.py): the default does nothing and changes nothing, and the
worker calls every point it declares, so a hook that implements one is reached (renaming a worker method cannot
silently cut a hook off: hooks name only these points)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from p2pworker import api, worker
from p2pworker.instruments import Instruments
from p2pworker.protocol.messages import Bye
from p2pworker.session.reporter import JobDone


def _points() -> set[str]:
    return {n for n, f in inspect.getmembers(Instruments, inspect.isfunction) if n.startswith("on_")}


def test_the_default_instruments_do_nothing_and_pass_the_ready_through():
    ins = Instruments()
    ready = api.Ready("n", "127.0.0.1:1", "zmq", "d", "/tmp/a", api=api.RING_API, hold_s=1.0)
    assert ins.on_ready(ready) is ready
    assert ins.on_command(api.Drain()) is None
    assert ins.on_attach(None) is None
    assert ins.on_job_done(JobDone(1, "load", True, (), 0, 0.0, "")) is None
    watched = (ins.on_send("l", Bye("x"), False), ins.on_received("l", b"", True), ins.on_read_settled(1, True),
               ins.on_event(api.Drained()), ins.on_sleep(0.5), ins.on_woke(), ins.on_stop())
    assert watched == (None,) * 7


def test_the_worker_calls_every_instrument_point_and_nothing_else_of_them():
    trees = [ast.parse(p.read_text()) for p in Path(inspect.getsourcefile(worker)).parent.glob("*.py")]
    called = {node.func.attr for tree in trees for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "instruments"}
    assert _points() == {"on_command", "on_attach", "on_ready", "on_job_done", "on_send", "on_received",
                         "on_read_settled", "on_poll_data", "on_event", "on_sleep", "on_woke", "on_stop"}
    assert called == _points(), f"declared {sorted(_points())}, called {sorted(called)}"


def test_the_hooks_the_suite_uses_implement_only_declared_points():
    import tests.hooks.corrupt_loads as corrupt
    import tests.hooks.failed_attach_stuck as failed
    import tests.hooks.old_release as old
    import tests.hooks.stalled_reads as stalled
    import tests.hooks.stuck_attach as stuck
    import benchmarks.hops.trace_hook as trace  # the benchmarks' tracing hook: the same rule

    for module in (corrupt, failed, old, stalled, stuck, trace):
        classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
                   if issubclass(c, Instruments) and c is not Instruments]
        assert classes, f"{module.__name__}: no Instruments subclass"
        for cls in classes:
            own = {n for n in vars(cls) if n.startswith("on_")}
            assert own and own <= _points(), f"{cls.__name__} overrides {own - _points()} (not a point)"


def test_no_hook_overwrites_a_private_name_of_ours():
    """Hooks reach the worker through the points above; the tracing hook also wraps a few public methods of classes
    (a renamed one fails its install with AttributeError).  None may replace a private method or attribute: the
    names they set, wrap or loop over as attribute names are all public."""
    root = Path(inspect.getsourcefile(worker)).parents[2]
    modules = [*sorted((root / "tests" / "hooks").glob("*.py")), root / "benchmarks" / "hops" / "trace_hook.py"]
    for path in modules:
        tree = ast.parse(path.read_text())
        named = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str):
                named.append(node.args[1].value)  # setattr(obj, "name", ...), _wrap(cls, "name", ...)
            elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
                named += [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                named.append(node.attr)  # worker.instruments = ..., cls.method = ...
        private = [n for n in named if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{path.name} sets or wraps private names {private}"
