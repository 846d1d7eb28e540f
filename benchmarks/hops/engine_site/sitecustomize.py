"""Per-step rows of a `vllm serve` engine core, for benchmarks/hops/pulls.py: where the puller engine's time goes
between its worker's JobFinished and the first token.

Loaded by Python's site machinery when this directory leads ``PYTHONPATH`` and ``$HOPTRACE_DIR`` is set (the
benchmark puts it there for its engines; every other process finds ``HOPTRACE_DIR`` unset and this module does
nothing).  It imports nothing of vLLM itself: it waits for three modules to load and then wraps, by public name,

* ``EngineCore.step`` (and ``step_with_batch_queue``, its form with async scheduling): a row per step that ran
  the model or returned outputs (``step <ran> <outputs>``), with how many empty steps came before it;
* ``OffloadingConnector.get_num_new_matched_tokens``: a row when it answers a request (``match <tokens>
  <async>``);
* ``P2PWorkerTier.get_finished_jobs``: a row when it returns jobs (``fin <n>``).

A renamed method fails loudly at import.  Rows "<ns> <tag> [info...] cpu=<thread CPU ns>" (CLOCK_MONOTONIC, like the
workers' rows of trace_hook.py) go, line-buffered, to ``$HOPTRACE_DIR/engine_<$HOPTRACE_ROLE>_<pid>.txt``: vLLM's
engine core process ends with ``os._exit``, so nothing is kept for an exit handler.
"""

import importlib.abc
import importlib.util
import os
import sys
import threading
import time

OUT = os.environ.get("HOPTRACE_DIR", "")
ROLE = os.environ.get("HOPTRACE_ROLE", "engine")
TARGETS = {  # module -> (class, methods)
    # step_with_batch_queue: the engine's step with async scheduling or pipeline parallelism (GPU)
    "vllm.v1.engine.core": ("EngineCore", ("step", "step_with_batch_queue")),
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector": ("OffloadingConnector",
                                                                           ("get_num_new_matched_tokens",)),
    "vllm_adapter.tier": ("P2PWorkerTier", ("get_finished_jobs",)),
}
_file = None
_lock = threading.Lock()  # 0.33's tier-poll thread writes fin rows beside the scheduler thread
_empty = [0]


def rec(tag, *info):
    global _file
    line = " ".join((str(time.monotonic_ns()), tag, *map(str, info), f"cpu={time.thread_time_ns()}")) + "\n"
    with _lock:
        if _file is None:
            _file = open(os.path.join(OUT, f"engine_{ROLE}_{os.getpid()}.txt"), "a", buffering=1)
        _file.write(line)


def _step(orig):
    def step(self, *a, **k):
        t0 = time.monotonic_ns()
        outputs, executed = orig(self, *a, **k)
        if executed or outputs:
            rec("step", int(executed), len(outputs or {}), f"t0={t0}", f"empty_before={_empty[0]}")
            _empty[0] = 0
        else:
            _empty[0] += 1
        return outputs, executed
    return step


def _match(orig):
    def get_num_new_matched_tokens(self, request, num_computed_tokens, *a, **k):
        n, load_async = orig(self, request, num_computed_tokens, *a, **k)
        rec("match", request.request_id, n, int(bool(load_async)))
        return n, load_async
    return get_num_new_matched_tokens


def _fin(orig):
    def get_finished_jobs(self, *a, **k):
        jobs = list(orig(self, *a, **k))
        if jobs:
            rec("fin", len(jobs), *(j.job_id for j in jobs))
        return jobs
    return get_finished_jobs


WRAPS = {"step": _step, "step_with_batch_queue": _step, "get_num_new_matched_tokens": _match,
         "get_finished_jobs": _fin}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        cls_name, meths = TARGETS[self.name]
        cls = getattr(module, cls_name)
        for meth in meths:
            setattr(cls, meth, WRAPS[meth](getattr(cls, meth)))  # AttributeError when vLLM or the tier renamed it


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)  # find the real spec without coming back here
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, name)
        return spec


if OUT:
    sys.meta_path.insert(0, _Finder())
