"""PD transfer through vLLM's tiering manager: P2PWorkerTier (+ its worker) vs vLLM's in-tree `p2p` tier.

    .venv-vllm034/bin/python benchmarks/pd_tier.py [--blocks 3] [--reps 5] [--hog] [--tiers ours,intree]
        [--geometries 16384x64,16384x512,262144x64,262144x512] [--json F]

The results file (p2pworker/bench/results.py) is ``benchmarks/results/pd_tier.json`` by default (``pd_tier-hog.json``
with ``--hog``); what was measured before a failure is kept in it.

Two processes per tier kind, each a real ``TieringOffloadingManager`` (built through
``OffloadingSpecFactory`` exactly as vLLM does; scheduler side only, so it runs on the CPU) whose only
secondary tier is the one under test, on loopback with real NIXL.  Both schedulers step every 1 ms.  The
producer stores N chunks for a request with ``remote_decoder`` (the cascade parks them in the tier); the
consumer, given ``remote_prefiller``, runs lookup -> promotion -> lookup until every chunk is HIT and
checks the bytes.

Before and after a change, side by side: ``git worktree add /tmp/base REV``, then ``--tiers ours,ours-base
--base-tree /tmp/base`` runs this tree's tier and worker and REV's, alternated block by block like any two tiers.

Only one tier's processes are alive while it is measured (the in-tree tier's engines each spin a NIXL progress
thread: measured side by side, they would take the CPUs from the other tier): per geometry, ``--blocks`` blocks,
each starting a fresh pair of one tier, running ``--reps`` requests, and stopping it, the tiers alternated and the
order flipped every block.  ``--hog`` runs a busy neighbour process (a pure-Python spin) throughout.
Reported per geometry, medians over all blocks:

- fetch: first consumer lookup -> every chunk HIT; the first request of each block includes session setup
  ("cold": one sample per block), the others are "warm";
- scheduler-thread time inside tier calls (every SecondaryTierManager method, timed by wrapping the tier
  instance; only calls on the scheduler thread count), per call p50/p99 and per request in total,
  consumer and producer side.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)
from tests.helpers.ports import free_ports  # noqa: E402  (ports below the ephemeral range: no other bind(0) takes them)
from p2pworker.bench import results as results_file  # noqa: E402

BASE_TREE_ENV = "PD_TIER_BASE_TREE"  # --base-tree, for the spawned schedulers of kind ours-base
TIER_METHODS = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "on_new_request",
                "on_request_finished", "serve_external_requests", "has_pending_work", "on_schedule_end", "touch",
                "take_events", "get_stats")


_TERM = {"closing": 0, "pending": False}  # a SIGTERM that arrives while a pair closes waits for its cleanup


def _on_sigterm(*_) -> None:
    if _TERM["closing"]:
        _TERM["pending"] = True  # Pair.close exits once every scheduler is stopped and its files are gone
        return
    sys.exit("pd_tier: terminated (SIGTERM)")  # unwind like Ctrl-C: every finally runs (the open pair is closed)


class HarnessError(RuntimeError):
    """A scheduler process failed, died or did not answer in time: the run ends with this, never waits on."""


@dataclass(frozen=True)
class Failed:
    """What a scheduler sends instead of an answer when it raised (its traceback), before it exits."""

    role: str
    traceback: str


def engine_id(kind: str, role: str, pid: int) -> str:
    return f"pdbench{kind}{role}{pid}"


def region_path(kind: str, role: str, pid: int) -> Path:
    """vLLM's primary region file for that scheduler (SharedOffloadRegion: /dev/shm/vllm_offload_{engine_id}.mmap):
    a scheduler that had to be killed cannot unlink it itself."""
    return Path(f"/dev/shm/vllm_offload_{engine_id(kind, role, pid)}.mmap")


def _mk(cls, **kw):
    ok = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in kw.items() if k in ok})


TIERS = {"ours", "ours-base", "intree", "ideal", "ideal-nocopy"}


def build(kind: str, name: str, port: int, row: int, num_chunks: int, peer_port: int = 0,
          tier_extra: dict | None = None):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if kind.startswith("ours"):
        tier = {"type": "P2PWorkerTier", "module_path": "vllm_adapter.tier", "host": "127.0.0.1", "port": port}
    elif kind.startswith("ideal"):  # the floors: no peer, bytes staged in-process (benchmarks/ideal_tier.py)
        tier = {"type": "IdealTier", "module_path": "benchmarks.ideal_tier", "copy": kind == "ideal"}
    else:
        tier = {"type": "p2p", "host": "127.0.0.1", "port": port}
    tier.update(tier_extra or {})
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * row, "eviction_policy": "lru",
             "secondary_tiers": [tier]}
    config = OffloadingConfig(
        groups=(_mk(OffloadingGroupConfig, tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=row, enable_kv_cache_events=False, extra_config=extra,
        engine_id=engine_id(kind, name, os.getpid()),
        model=_mk(OffloadingModelConfig, name="bench", dtype="float16", max_model_len=1 << 20),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
    )
    spec = OffloadingSpecFactory.create_spec(config)
    return spec.get_manager()


def _hop_install(tier, role):
    """Per-hop tracing of the tier (CLOCK_MONOTONIC ns): submit, flush to the command ring (which thread), the
    JobFinished seen in _pump (which thread).  Rows: (ns, tag, info...)."""
    from p2pworker import api as _api

    TR = []
    main = threading.main_thread()

    def th():
        return "main" if threading.current_thread() is main else "poll"

    for name in ("submit_load", "submit_store"):
        f0 = getattr(tier, name)

        def w(job, _f0=f0, _name=name):
            TR.append((time.monotonic_ns(), _name, job.job_id, th()))
            return _f0(job)
        setattr(tier, name, w)
    fl0 = tier.outbox.flush

    def flush():
        before = [c.job_id for c in tier.outbox.commands if isinstance(c, (_api.LoadJob, _api.StoreJob))]
        t0 = time.monotonic_ns()
        r = fl0()
        if before:
            left = {c.job_id for c in tier.outbox.commands if isinstance(c, (_api.LoadJob, _api.StoreJob))}
            for j in before:
                if j not in left:
                    TR.append((time.monotonic_ns(), "flushed", j, th(), t0))
        return r
    tier.outbox.flush = flush
    fin0 = tier.jobs.finish

    def finish(job_id, success, *a, **k):
        TR.append((time.monotonic_ns(), "finished", job_id, th(), int(success)))
        return fin0(job_id, success, *a, **k)
    tier.jobs.finish = finish
    tier.instruments.trace = TR  # _BenchInstruments.on_pump writes the "pump" rows
    return TR


def _bench_instruments():
    """The tier's instruments for this benchmark: with $HOPTRACE_DIR, a "pump" row each time the tier collects
    events."""
    from vllm_adapter.instruments import TierInstruments

    class _BenchInstruments(TierInstruments):
        trace: list | None = None

        def on_pump(self) -> None:
            if self.trace is not None:
                self.trace.append((time.monotonic_ns(), "pump",
                                   "main" if threading.current_thread() is threading.main_thread() else "poll"))

    return _BenchInstruments()


def _hop_acc(mgr, tier):
    """Cumulative ns inside the manager's pieces of a lookup pass (reset per pass)."""
    ACC = {}

    def wrap(obj, name, label):
        f0 = getattr(obj, name)

        def f(*a, _f0=f0, **k):
            t0 = time.monotonic_ns()
            try:
                return _f0(*a, **k)
            finally:
                ACC[label] = ACC.get(label, 0) + time.monotonic_ns() - t0
        setattr(obj, name, f)

    wrap(mgr, "lookup", "mgr.lookup")
    wrap(mgr, "_maybe_process_finished_jobs", "mgr.poll")
    wrap(mgr.primary_tier, "lookup", "primary.lookup")
    wrap(mgr.primary_tier, "prepare_write", "primary.prepare_write")
    wrap(mgr._metrics, "on_lookup", "metrics.on_lookup")
    wrap(tier, "lookup", "tier.lookup")
    return ACC


def _hop_dump(TR, role):
    d = os.environ["HOPTRACE_DIR"]
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/sched_{role}_{os.getpid()}.txt", "w") as f:
        for row in TR:
            f.write(" ".join(map(str, row)) + "\n")


class Timed:
    """Wraps a tier instance's methods; records durations of scheduler-thread calls."""

    def __init__(self, tier):
        self.calls: dict[str, list[float]] = {}
        self.off_thread_s = 0.0
        main = threading.main_thread()
        for name in TIER_METHODS:
            fn = getattr(tier, name, None)
            if fn is None:
                continue

            def wrap(*a, _fn=fn, _name=name, **kw):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    dt = time.perf_counter() - t0
                    if threading.current_thread() is main:
                        self.calls.setdefault(_name, []).append(dt)
                    else:
                        self.off_thread_s += dt

            setattr(tier, name, wrap)

    def take(self) -> dict[str, list[float]]:
        out, self.calls = self.calls, {}
        return out


def key(rid: str, i: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(hashlib.sha256(f"{rid}/{i}".encode()).digest(), 0)


def payload(rid: str, i: int, row: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{rid}/{i}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(-128, 128, row, dtype=np.int8)


class _Scheduler:
    """One scheduler process's manager, its tier (wrapped: timed, and traced with $HOPTRACE_DIR) and the commands
    the parent sends it."""

    def __init__(self, kind: str, role: str, row: int, mgr, kv):
        self.kind, self.row, self.mgr, self.kv = kind, row, mgr, kv
        tier = mgr.secondary_tiers[0]
        if kind.startswith("ours"):  # the tier's named points (vllm_adapter/instruments.py)
            tier.instruments = _bench_instruments()
        # $HOPTRACE_DIR set: per-hop trace of our tier (benchmarks/hops/: the workers' side is trace_hook.py)
        self.TR = _hop_install(tier, role) if kind.startswith("ours") and os.environ.get("HOPTRACE_DIR") else None
        self.ACC = _hop_acc(mgr, tier) if self.TR is not None else None
        self.timed = Timed(tier)
        self.lock = getattr(mgr, "lock", None) or threading.Lock()
        # last: the primary region's rows, released (view = None) before the manager shuts down; never held in a
        # method's local, which a traceback would keep
        self.view = np.asarray(tier._primary_kv_view)

    def step(self, new=()) -> None:
        with self.lock:
            self.mgr.on_schedule_end(self.kv.ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=[]))

    def loop(self, conn) -> None:
        """Step every 1 ms; between steps, run the parent's commands and answer each, until "quit"."""
        while True:
            if not conn.poll(0.001):
                self.step()
                continue
            cmd = conn.recv()
            if cmd[0] == "quit":
                return
            run = self.COMMANDS.get(cmd[0])
            if run is not None:
                conn.send(run(self, *cmd[1:]))

    def store(self, rid: str, n: int) -> str:
        """What prefill does: primary store, then the cascade parks it in the tier."""
        mgr, TR = self.mgr, self.TR
        self.timed.take()  # from here on: the producer's tier calls for this request (store + cascade)
        if TR is not None:
            TR.append((time.monotonic_ns(), "store_cmd", rid))
        ctx = self.kv.ReqContext(req_id=rid, kv_transfer_params={"remote_decoder": {"kv_request_id": rid}})
        keys = [key(rid, i) for i in range(n)]
        index = {k: i for i, k in enumerate(keys)}  # not keys.index: O(n) per key
        with self.lock:
            mgr.on_new_request(ctx)
            out = mgr.prepare_store(keys, ctx)
        for k, r in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist()):
            self.view[r] = payload(rid, index[k], self.row)
        with self.lock:
            mgr.complete_store(out.keys_to_store, ctx)
            mgr.on_request_finished(ctx)
        self.step([rid])
        if TR is not None:
            TR.append((time.monotonic_ns(), "store_stepped", rid))
        return "stored"

    def drain(self) -> dict:
        """Producer: wait until the tier reported its jobs, then report its calls."""
        deadline = time.monotonic() + 30
        while self.mgr._jobs and time.monotonic() < deadline:
            self.step()
            time.sleep(0.001)
        return {"calls": self.timed.take(), "left": len(self.mgr._jobs), "off_thread_s": self.timed.off_thread_s}

    def fetch(self, rid: str, n: int, pport: int) -> dict:
        """What decode does: lookups until every key is HIT, then load the rows and compare their bytes."""
        mgr = self.mgr
        ctx = self.kv.ReqContext(req_id=f"d-{rid}", kv_transfer_params={"remote_prefiller": {
            "kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": pport}})
        keys = [key(rid, i) for i in range(n)]
        if self.kind.startswith("ideal"):  # its bytes are staged before the clock starts: no source
            from benchmarks import ideal_tier

            ideal_tier.STAGED.update((k, payload(rid, i, self.row)) for i, k in enumerate(keys))
        self.timed.take()
        t0 = time.perf_counter()
        with self.lock:
            mgr.on_new_request(ctx)
        res, pass_s = self._lookup_passes(rid, ctx, keys)
        dt = time.perf_counter() - t0
        ok = all(r is self.kv.LookupResult.HIT for r in res) and self._load(rid, ctx, keys)
        with self.lock:
            mgr.on_request_finished(ctx)
        if self.kind.startswith("ideal"):
            ideal_tier.STAGED.clear()
        return {"s": dt, "ok": ok, "results": sorted({r.name for r in res}), "calls": self.timed.take(),
                "off_thread_s": self.timed.off_thread_s, "passes": len(pass_s), "pass_s": pass_s}

    def _lookup_passes(self, rid: str, ctx, keys: list) -> tuple[list, list[float]]:
        """Passes of lookups over every key, each followed by a step and a 1 ms sleep, until every key is HIT, one
        is a MISS, or 60 s passed: (the last pass's results, each pass's seconds)."""
        mgr, TR, ACC, LookupResult = self.mgr, self.TR, self.ACC, self.kv.LookupResult
        first = True
        deadline = time.monotonic() + 60
        pass_s: list[float] = []  # each pass of lookups over every key (vLLM's manager + the tier)
        while True:
            if TR is not None:
                ACC.clear()
                TR.append((time.monotonic_ns(), "lk0", rid, "cpu=%d" % time.thread_time_ns()))
            tp = time.perf_counter()
            with self.lock:
                res = [mgr.lookup(k, ctx) for k in keys]
            pass_s.append(time.perf_counter() - tp)
            if TR is not None:
                TR.append((time.monotonic_ns(), "lk1", rid, ",".join(sorted({r.name for r in res})),
                           "cpu=%d" % time.thread_time_ns(),
                           ";".join(f"{k}={v // 1000}" for k, v in sorted(ACC.items()))))
            if all(r is LookupResult.HIT for r in res) or time.monotonic() > deadline:
                return res, pass_s
            if any(r is LookupResult.MISS for r in res):
                return res, pass_s
            self.step([ctx.req_id] if first else ())
            first = False
            if TR is not None:
                TR.append((time.monotonic_ns(), "stepped", rid))
            time.sleep(0.001)
            if TR is not None:
                TR.append((time.monotonic_ns(), "slept", rid))

    def _load(self, rid: str, ctx, keys: list) -> bool:
        """Every key HIT: load them into the primary tier; True when their rows hold the bytes stored."""
        with self.lock:
            spec_l = self.mgr.prepare_load(keys, ctx)
        rows = spec_l.chunk_ids.tolist()
        # ideal-nocopy moves no byte by design: every key HIT is all it can show
        ok = self.kind == "ideal-nocopy" or all((self.view[r] == payload(rid, i, self.row)).all()
                                                for i, r in enumerate(rows))
        with self.lock:
            self.mgr.complete_load(keys, ctx)
        return ok

    COMMANDS = {"store": store, "drain": drain, "fetch": fetch}


def _serve(kind: str, role: str, port: int, row: int, num_chunks: int, conn, peer_port: int = 0,
           tier_extra: dict | None = None) -> None:
    """One scheduler: steps every 1 ms; runs commands from the parent between steps."""
    os.environ.setdefault("P2PWORKER_SECRET", "pd-tier-bench")
    if kind == "ours-base":  # another revision's tier and worker: its tree first on this process's path and theirs
        _use_base_tree(os.environ[BASE_TREE_ENV])
    from vllm.v1.kv_offload import base as kv

    try:
        mgr = build(kind, role, port, row, num_chunks, peer_port, tier_extra)
        if kind == "ours-base":
            try:
                _check_base_tree(os.environ[BASE_TREE_ENV])
            except BaseException:
                mgr.shutdown()
                raise
    except BaseException:
        # vLLM's get_manager already undid what it built (tiers shut down, region unlinked); the parent gets why
        conn.send(Failed(role, traceback.format_exc()))
        raise
    sched = None
    try:  # from here on the manager exists: whatever happens, it is shut down (its region file unlinked)
        sched = _Scheduler(kind, role, row, mgr, kv)
        conn.send("ready")
        sched.loop(conn)
    except Exception:
        with contextlib.suppress(OSError):  # the parent may be gone (that may be what raised)
            conn.send(Failed(role, traceback.format_exc()))  # in place of the answer the parent waits for
        raise
    finally:
        try:
            if sched is not None and sched.TR is not None:
                _hop_dump(sched.TR, role)
        finally:
            if sched is not None:
                sched.view = None
            mgr.shutdown()
        with contextlib.suppress(OSError):
            conn.send("closed")


def _use_base_tree(tree: str) -> None:
    """Import the tier (and start the worker) from ``tree``: nothing of ours is imported in this spawned process
    yet.  The worker is started as ``python -m p2pworker.cli``, which puts its working directory first on its path
    (before PYTHONPATH): so the working directory is the tree too.  _check_base_tree verifies both."""
    mine = [m for m in sys.modules if m.split(".")[0] in ("p2pworker", "vllm_adapter")]
    if mine:
        raise RuntimeError(f"ours-base: {mine[:3]} imported before the base tree was put first")
    sys.path.insert(0, tree)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    os.chdir(tree)


def _check_base_tree(tree: str) -> None:
    """The tier this process built and every worker it started run ``tree``'s code, or this raises."""
    tier_file = os.path.realpath(sys.modules["vllm_adapter.tier"].__file__)
    if not tier_file.startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"ours-base: the tier came from {tier_file}, not from {tree}")
    kids = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            kids.update(f.read().split())
    workers = []
    for pid in kids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"p2pworker.cli" in f.read():
                    workers.append((pid, os.path.realpath(os.readlink(f"/proc/{pid}/cwd"))))
    if not workers or any(cwd != os.path.realpath(tree) for _, cwd in workers):
        raise RuntimeError(f"ours-base: workers {workers} do not all run in {tree}")


class Pair:
    """One tier's two schedulers (P stores, D fetches), each a spawned process.  Every wait on them is bounded and
    also ends as soon as one of them exits; any failure stops both and removes what a killed one left in /dev/shm.
    """

    START_S = 180.0  # both schedulers import vLLM and build their manager (ours also starts its worker)

    def __init__(self, kind: str, row: int, num_chunks: int, ports: tuple[int, int] | None = None,
                 tier_extra: dict[str, dict] | None = None):
        """``tier_extra``: per role ("P", "D"), keys added to that scheduler's tier config."""
        ctx = mp.get_context("spawn")
        self.kind = kind
        self.pport, dport = ports or free_ports(2)
        (p_conn, a), (d_conn, b) = ctx.Pipe(), ctx.Pipe()
        self.conns = {"P": p_conn, "D": d_conn}  # the parent's end of each scheduler's pipe
        extra = tier_extra or {}
        cap = num_chunks * 2 + 8
        self.procs = {"P": ctx.Process(target=_serve, args=(kind, "P", self.pport, row, cap, a, 0, extra.get("P")),
                                       daemon=True),
                      "D": ctx.Process(target=_serve, args=(kind, "D", dport, row, cap, b, self.pport, extra.get("D")),
                                       daemon=True)}
        try:
            try:
                for p in self.procs.values():
                    p.start()
            finally:
                a.close()  # the children hold their ends now: ours closed, a dead child's pipe reads as EOF
                b.close()
            deadline = time.monotonic() + self.START_S
            for role in self.conns:
                got = self._answer(role, deadline - time.monotonic(), f"starting (bound {self.START_S:g} s)")
                if got != "ready":
                    raise HarnessError(f"{kind}: scheduler {role} answered {got!r} at start, not 'ready'")
        except BaseException:
            self.close()
            raise

    def _error(self, failed: Failed, doing: str) -> HarnessError:
        return HarnessError(f"{self.kind}: scheduler {failed.role} failed while {doing}:\n{failed.traceback}")

    def _failed(self, roles, doing: str) -> HarnessError | None:
        """The first ``Failed`` waiting on those roles' pipes (a scheduler sends it just before it exits)."""
        for r in roles:
            try:
                if self.conns[r].poll(0) and isinstance(msg := self.conns[r].recv(), Failed):
                    return self._error(msg, doing)
            except (EOFError, OSError):
                pass
        return None

    def _answer(self, role: str, timeout: float, doing: str):
        """The next message from ``role``; a ``Failed``, a scheduler's exit or ``timeout`` raise HarnessError."""
        conn = self.conns[role]
        deadline = time.monotonic() + timeout
        while True:
            # checked before the read: a scheduler's Failed, sent just before it exited, is still read (once)
            dead = {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}
            try:
                if conn.poll(0 if dead else 0.05):
                    msg = conn.recv()
                    if isinstance(msg, Failed):
                        raise self._error(msg, doing)
                    return msg
            except (EOFError, OSError):
                time.sleep(0.01)  # that scheduler is gone (its pipe is at EOF): its exit code comes in a moment
            if dead:
                # the reason may wait on the other pipe: D failed its start while we waited for P's "ready"
                raise self._failed(dead, doing) or HarnessError(
                    f"{self.kind}: scheduler(s) exited while {doing}: "
                    + ", ".join(f"{r} (pid {self.procs[r].pid}) with {c}" for r, c in dead.items()))
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.kind}: no answer within {timeout:g} s while {doing}")

    def _send(self, role: str, msg, doing: str) -> None:
        try:
            self.conns[role].send(msg)
        except OSError as e:  # its end of the pipe is closed: it exited (or is exiting)
            self.procs[role].join(5)
            raise self._failed([role], doing) or HarnessError(
                f"{self.kind}: scheduler {role} is gone while {doing} ({e}; exit code {self.procs[role].exitcode})")

    def request(self, rid: str, n: int) -> dict:
        self._send("P", ("store", rid, n), f"storing {rid}")
        if (got := self._answer("P", 60, f"storing {rid}")) != "stored":
            raise HarnessError(f"{self.kind}: the producer answered {got!r} to a store")
        self._send("D", ("fetch", rid, n, self.pport), f"fetching {rid}")
        out = self._answer("D", 120, f"fetching {rid}")  # the fetch itself gives up after 60 s
        if not out["ok"]:  # a contender that does not deliver has no throughput to compare
            raise HarnessError(f"{self.kind}: request {rid}: the consumer's lookups ended {out['results']} after "
                               f"{out['s']:.3f} s ({out['passes']} passes): want every key HIT with the right bytes")
        self._send("P", ("drain",), f"draining {rid}")
        prod = self._answer("P", 60, f"draining {rid}")
        out["producer_calls"] = prod["calls"]
        out["producer_off_thread_s"] = prod["off_thread_s"]
        return out

    def close(self) -> None:
        """Quit both (bounded), kill what did not exit, and unlink the region file of any scheduler that did not
        exit cleanly (ours: its worker sees the adapter gone and removes its own files).  A SIGTERM meanwhile is
        acted on after that."""
        _TERM["closing"] += 1
        try:
            self._stop()
        finally:
            _TERM["closing"] -= 1
        if _TERM["pending"] and not _TERM["closing"]:
            _TERM["pending"] = False
            sys.exit("pd_tier: terminated (SIGTERM)")

    def _stop(self) -> None:
        deadline = time.monotonic() + 60
        try:
            for c in self.conns.values():
                with contextlib.suppress(OSError, ValueError):  # that scheduler is gone already
                    c.send(("quit",))
            started = [p for p in self.procs.values() if p.pid is not None]
            for c in self.conns.values():
                try:  # its "closed" comes after mgr.shutdown(); stop waiting as soon as every one exited
                    while time.monotonic() < deadline and not c.poll(0.05):
                        if all(p.exitcode is not None for p in started):
                            break
                    if c.poll(0):
                        c.recv()
                except Exception:  # EOF, or a stream left mid-message by an interrupted read: we only wait here
                    pass
        finally:  # also after a Ctrl-C above: nothing left running, no region file left
            for role, p in self.procs.items():
                if p.pid is None:
                    continue  # never started
                p.join(max(0.0, deadline - time.monotonic()) + 1)
                if p.is_alive():
                    p.kill()
                    p.join(5)
                if p.exitcode != 0:
                    region_path(self.kind, role, p.pid).unlink(missing_ok=True)
            for c in self.conns.values():
                c.close()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def summarize(blocks: list[list[dict]], row: int, n: int) -> dict:
    """``blocks``: per block, its requests in order (the first one cold)."""
    cold = [b[0]["s"] for b in blocks]
    warm = [r for b in blocks for r in (b[1:] or b)]
    fetch = [r["s"] for r in warm]
    out = {"cold_ms": round(statistics.median(cold) * 1e3, 1), "cold_ms_each": [round(c * 1e3, 1) for c in cold],
           "warm_ms": round(statistics.median(fetch) * 1e3, 1),
           "warm_GBps": round(row * n / statistics.median(fetch) / 1e9, 3),
           "warm_samples": len(fetch), "all_ok": all(r["ok"] for b in blocks for r in b),
           # the floor under any tier: a lookup pass over every key (mostly vLLM's manager), then a step and a 1 ms
           # sleep per further pass; a secondary tier needs >= 2 passes (promote, then HIT)
           "warm_passes": statistics.median(r["passes"] for r in warm),
           "first_pass_ms": round(statistics.median(r["pass_s"][0] for r in warm) * 1e3, 3),
           "later_pass_ms": round(statistics.median(x for r in warm for x in r["pass_s"][1:] or [0.0]) * 1e3, 3)}
    for side, field, off in (("consumer", "calls", "off_thread_s"),
                             ("producer", "producer_calls", "producer_off_thread_s")):
        per_call: list[float] = []
        per_req: list[float] = []
        by_name: dict[str, list[float]] = {}
        for r in warm:
            tot = 0.0
            for name, ds in r[field].items():
                if name == "has_pending_work":
                    continue  # polled every step whether the tier has work or not; reported separately
                per_call += ds
                by_name.setdefault(name, []).extend(ds)
                tot += sum(ds)
            per_req.append(tot)
        out[side] = {"per_call_p50_us": round(_pct(per_call, 0.5) * 1e6, 1),
                     "per_call_p99_us": round(_pct(per_call, 0.99) * 1e6, 1),
                     "per_request_ms": round(statistics.median(per_req) * 1e3, 3),
                     "calls_per_request": round(len(per_call) / max(1, len(warm)), 1),
                     # 0.33's tier-poll thread (tolerates_off_thread_polling) holds the manager lock too
                     "off_thread_ms_per_block": round(statistics.median(b[-1][off] for b in blocks) * 1e3, 3),
                     "by_method_us": {k: {"n": len(v), "p50": round(_pct(v, 0.5) * 1e6, 1),
                                          "p99": round(_pct(v, 0.99) * 1e6, 1), "max": round(max(v) * 1e6, 1)}
                                      for k, v in sorted(by_name.items())}}
    return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=3, help="fresh pairs per geometry and tier, tiers alternated")
    ap.add_argument("--reps", type=int, default=5, help="requests per block (the first one is cold)")
    ap.add_argument("--hog", action="store_true", help="a busy neighbour process spins throughout")
    ap.add_argument("--geometries", default="16384x64,16384x512,262144x64,262144x512", help="ROW_BYTESxCHUNKS,...")
    ap.add_argument("--tiers", default="ours,intree",
                    help="ours, ours-base (ours from --base-tree: another revision, alternated with this one), "
                         "intree, ideal (a floor: vLLM's own passes and one in-process copy on a thread), "
                         "ideal-nocopy (vLLM's own passes alone; no byte check; benchmarks/ideal_tier.py)")
    ap.add_argument("--json", metavar="FILE", help="the results file (default: benchmarks/results/pd_tier.json, "
                    "pd_tier-hog.json with --hog)")
    ap.add_argument("--replot", metavar="FILE", help="print the figures of this results file again; start nothing")
    ap.add_argument("--hops", metavar="DIR", help="trace our tier's schedulers and workers into DIR and print where a "
                    "warm fetch's time goes, per hop (benchmarks/hops/analyze.py; --tiers ours)")
    ap.add_argument("--base-tree", metavar="DIR", help="a checkout of another revision (git worktree add DIR REV) "
                    "for --tiers ours-base; its schedulers import the tier from DIR and start DIR's worker")
    a = ap.parse_args()
    unknown = set(a.tiers.split(",")) - TIERS
    if unknown:
        ap.error(f"--tiers {sorted(unknown)}: not one of {sorted(TIERS)}")
    return a


def _prepare(a: argparse.Namespace) -> None:
    """What the chosen tiers and --hops need, set before any scheduler is spawned (they inherit the environment)."""
    if "ours-base" in a.tiers.split(","):
        if not a.base_tree or not os.path.isfile(os.path.join(a.base_tree, "vllm_adapter", "tier.py")):
            sys.exit("pd_tier: --tiers ours-base needs --base-tree DIR, a checkout with vllm_adapter/tier.py")
        os.environ[BASE_TREE_ENV] = os.path.abspath(a.base_tree)
    if "intree" in a.tiers.split(","):
        check_intree_nixl()
    if a.hops:  # benchmarks/hops/README.md
        os.makedirs(a.hops, exist_ok=True)
        os.environ.update(HOPTRACE_DIR=os.path.abspath(a.hops), P2PWORKER_HOOK="benchmarks.hops.trace_hook:install",
                          PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def main() -> None:
    a = _args()
    if a.replot:
        doc = results_file.load(a.replot, "pd_tier")
        for title, g in doc["result"]["geometries"].items():
            _print(f"{title} chunks, vLLM {doc['result']['vllm']} ({doc['date']}, {doc['revision']})", g)
        return
    _prepare(a)
    import vllm

    run = results_file.Run("pd_tier", "hog" if a.hog else "")
    results = {"vllm": vllm.__version__, "blocks": a.blocks, "reps": a.reps, "hog": a.hog, "tiers": a.tiers,
               "geometries": {}}
    if a.base_tree:
        results["base_revision"] = results_file.revision(a.base_tree)
    # `timeout` or a service manager stops us with SIGTERM: unwind like Ctrl-C, so every finally below runs (the
    # open pair is closed, the hog stopped) instead of leaving schedulers and a spinning hog behind
    signal.signal(signal.SIGTERM, _on_sigterm)
    hog = mp.get_context("spawn").Process(target=_spin, args=(os.getpid(),), daemon=True) if a.hog else None
    if hog is not None:
        hog.start()
    tiers = a.tiers.split(",")
    try:
        for geo in a.geometries.split(","):
            row, n = (int(x) for x in geo.split("x"))
            blocks: dict[str, list[list[dict]]] = {k: [] for k in tiers}
            for b in range(a.blocks):
                for k in (tiers if b % 2 == 0 else tiers[::-1]):  # alternated, order flipped every block
                    pair = Pair(k, row, n)  # only this tier's processes are alive now
                    try:
                        blocks[k].append([pair.request(f"r{b}-{i}-{k}-{geo}", n) for i in range(a.reps)])
                    finally:
                        pair.close()
            _report(results, blocks, row, n)
    except HarnessError as e:  # the pair is stopped and cleaned up already; say why, exit non-zero
        sys.exit(f"pd_tier: {e}")
    finally:
        if hog is not None:
            hog.kill()
            hog.join(5)
        print(f"results: {run.save(a.json, results)}")  # what was measured before a failure is kept
    if a.hops:
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hops", "analyze.py"), a.hops], check=False)


def check_intree_nixl() -> None:
    """vLLM's in-tree tier imports NIXL as ``nixl._api`` (the ``nixl`` meta package) and, without it, starts anyway
    and misses every fetch.  setup.sh installs only the ``nixl-cu13`` build (``nixl_cu13._api``, which ours uses)."""
    import importlib

    try:
        importlib.import_module("nixl._api")
    except ImportError as e:
        sys.exit(f"pd_tier: vLLM's in-tree p2p tier needs NIXL's meta package (it imports nixl._api: {e}); "
                 f"scripts/setup.sh --bench installs it, or: {sys.executable} -m pip install 'nixl==V' with V the "
                 f"version of the nixl-cu13 there (the meta package pins its builds to its own version)")


def _spin(parent: int) -> None:
    """The busy neighbour: a pure-Python spin that also ends when its parent is gone (even SIGKILLed)."""
    while os.getppid() == parent:
        for _ in range(1_000_000):  # ~20-50 ms of spinning between checks
            pass


def _report(results: dict, blocks: dict[str, list[list[dict]]], row: int, n: int) -> None:
    """One geometry's medians and ratios: printed, and kept in ``results``."""
    import vllm

    g = {k: summarize(v, row, n) for k, v in blocks.items()}
    if "ours" in g and "intree" in g:
        g["ratios"] = {
            "throughput_ours_over_intree": round(g["ours"]["warm_GBps"] / g["intree"]["warm_GBps"], 2),
            "cold_intree_over_ours": round(g["intree"]["cold_ms"] / g["ours"]["cold_ms"], 2),
            "consumer_sched_time_intree_over_ours": round(
                g["intree"]["consumer"]["per_request_ms"] / max(1e-9, g["ours"]["consumer"]["per_request_ms"]), 1),
            "producer_sched_time_intree_over_ours": round(
                g["intree"]["producer"]["per_request_ms"] / max(1e-9, g["ours"]["producer"]["per_request_ms"]), 1),
        }
    if "ours" in g and "ours-base" in g:  # this tree against the base revision, same blocks, alternated
        g.setdefault("ratios", {}).update({
            "warm_ours_over_base": round(g["ours"]["warm_ms"] / g["ours-base"]["warm_ms"], 2),
            "cold_ours_over_base": round(g["ours"]["cold_ms"] / g["ours-base"]["cold_ms"], 2),
            "consumer_sched_ours_over_base": round(
                g["ours"]["consumer"]["per_request_ms"] / max(1e-9, g["ours-base"]["consumer"]["per_request_ms"]), 2),
            "producer_sched_ours_over_base": round(
                g["ours"]["producer"]["per_request_ms"] / max(1e-9, g["ours-base"]["producer"]["per_request_ms"]), 2)})
    for floor in ("ideal", "ideal-nocopy"):  # warm time over a floor's: how far each contender is from it (in-tree
        # over ideal-nocopy bounds, in that run, the ratio any tier could reach against the in-tree tier)
        if floor in g:
            g.setdefault("ratios", {}).update({
                f"warm_{k}_over_{floor}": round(g[k]["warm_ms"] / g[floor]["warm_ms"], 2)
                for k in blocks if not k.startswith("ideal")})
    results["geometries"][f"{row // 1024} KiB x {n}"] = g
    _print(f"{row // 1024} KiB x {n} chunks ({row * n / 2**20:.0f} MiB), vLLM {vllm.__version__}", g)


def _print(title: str, g: dict) -> None:
    """One geometry's figures, as a run prints them and --replot prints them again from the results file."""
    print(f"== {title}", flush=True)
    for k, s in g.items():
        if k == "ratios":
            continue
        print(f"  {k:7s} cold {s['cold_ms']:7.1f} ms  warm {s['warm_ms']:7.1f} ms ({s['warm_GBps']:.2f} GB/s, "
              f"{s['warm_passes']:g} lookup passes: first {s['first_pass_ms']:.2f} ms, then "
              f"{s['later_pass_ms']:.2f} ms each)"
              f"  ok={s['all_ok']}  | consumer sched {s['consumer']['per_request_ms']:.3f} ms/req "
              f"(p50 {s['consumer']['per_call_p50_us']} / p99 {s['consumer']['per_call_p99_us']} us/call, "
              f"{s['consumer']['calls_per_request']} calls) | producer sched "
              f"{s['producer']['per_request_ms']:.3f} ms/req (p50 {s['producer']['per_call_p50_us']} / "
              f"p99 {s['producer']['per_call_p99_us']} us/call)", flush=True)
    if "ratios" in g:
        print(f"  ratios: {g['ratios']}", flush=True)


if __name__ == "__main__":
    main()
