"""Real vLLM tiering managers (0.32, 0.33 or 0.34, on the CPU) with P2PWorkerTier, driven like OffloadingConnector."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import time

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from vllm_adapter.contract import VLLM

ROW = 16384
# kv_connector_extra_config of an engine that idles between requests.  vLLM 0.32 (no tier-poll thread) and 0.33 with
# its thread off block on their input queue once the manager says no pending work, and call the tier no more until
# woken.  On 0.34 only a live tier-poll thread lets an engine idle (without it the manager answers has_pending_work
# True for our tier, and vLLM steps for ever); the thread then calls the tier while the engine sleeps.
IDLE_ENGINE: dict = {} if VLLM.idle_needs_poll_thread else {"tier_poll_interval_s": 0}


def _mk(cls, **kw):  # fields differ between 0.32 and 0.33
    ok = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in kw.items() if k in ok})


def key(i: int) -> bytes:
    return make_offload_key(hashlib.sha256(b"blk%d" % i).digest(), 0)


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(-128, 128, ROW, dtype=np.int8)


def payloads(ids, row: int) -> np.ndarray:
    """Chunk contents for many chunks at once (one vectorised call): chunk i starts with i as 8 bytes, so a chunk
    that landed in another chunk's row is caught, and the rest is a pattern that differs from row to row."""
    ids = np.asarray(ids, dtype=np.int64)
    out = ((ids[:, None] * 131 + np.arange(row)[None, :] * 7) % 251).astype(np.int8)
    out[:, :8] = ids.astype("<i8").view(np.int8).reshape(-1, 8)
    return out


class Engine:
    """One TieringOffloadingManager whose only secondary tier is P2PWorkerTier (with its worker)."""

    def __init__(self, name: str, port: int, num_chunks: int = 16, row: int = ROW, engine_extra: dict | None = None,
                 dp: tuple[int, int] = (0, 1), **tier_kw):
        """``engine_extra``: more kv_connector_extra_config keys (``{"tier_poll_interval_s": 0}``: vLLM 0.33 without
        its tier-poll thread, so the tier is called only from the scheduler's steps, as under 0.32).  ``dp``: (this
        rank's data-parallel index, the data-parallel size), as vLLM hands each DP rank's engine core its own."""
        tier = {"type": "P2PWorkerTier", "module_path": "vllm_adapter.tier", "host": "127.0.0.1", "port": port,
                "locality": "REMOTE", **tier_kw}
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * row,
                 "eviction_policy": "lru", "secondary_tiers": [tier], **(engine_extra or {})}
        config = OffloadingConfig(
            groups=(_mk(OffloadingGroupConfig, tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
            worker_kv_bytes_per_block=row, enable_kv_cache_events=False, extra_config=extra,
            engine_id=f"p2pwt{name}{os.getpid()}" + (f"_dp{dp[0]}" if dp[1] > 1 else ""),
            model=_mk(OffloadingModelConfig, name="tiny-test", dtype="float16", max_model_len=256),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=dp[0], data_parallel_size=dp[1],
                                              data_parallel_rank_local=None, is_parallelism_agnostic=True),
        )
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.mgr = self.spec.get_manager()
        self.tier = self.mgr.secondary_tiers[0]
        self.lock = getattr(self.mgr, "lock", contextlib.nullcontext())
        self.view = self.tier._primary_kv_view
        self.mmap_path = self.spec._scheduler_mmap.mmap_path
        self.row = row
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        self.stats = OffloadingConnectorStats()  # every get_stats payload summed, as vLLM's frontend does
        # what vLLM's Prometheus side declares for this spec (OffloadPromMetrics): observe() asserts that every
        # key of a payload is declared, and binds the declared label names to the payload's label values
        self.metric_defs = type(self.spec).build_metric_definitions(extra)

    def metric(self, name: str) -> dict:
        """What vLLM's /metrics would show for ``name`` so far: {label values: value}."""
        with self.lock:
            self._collect(self.mgr.get_stats())
        return dict(self.stats.data["data"].get(name, {}))

    def _collect(self, stats) -> None:
        assert stats is None or hasattr(stats, "is_empty"), stats
        if stats is not None and not stats.is_empty():
            types, values = stats.data["types"], stats.data["data"]
            for name, by_labels in values.items():
                assert name in self.metric_defs, f"{name} is reported but not declared: vLLM would assert"
                kind = type(self.metric_defs[name]).__name__.removeprefix("Offloading").removesuffix("Metadata")
                assert types[name] == kind.lower(), (name, types[name], kind)
                for labels in by_labels:
                    assert len(labels) == len(self.metric_defs[name].labelnames), (name, labels)
            self.stats.aggregate(stats)

    def step(self, new=()) -> None:
        """One scheduler step as OffloadingConnector runs it (incl. the metric hooks every step calls)."""
        with self.lock:
            self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=[]))
            self._collect(self.mgr.get_stats())
            if hasattr(self.mgr, "config_info"):
                self.mgr.config_info()

    def store(self, req_id: str, ids, params=None):
        """What the connector + GPU worker do for a prefill: primary store, then the cascade."""
        ctx = ReqContext(req_id=req_id, kv_transfer_params=params)
        keys = [key(i) for i in ids]
        with self.lock:
            pol = self.mgr.on_new_request(ctx)
            out = self.mgr.prepare_store(keys, ctx)
        rows = np.asarray(self.view)
        index = dict(zip(keys, ids))  # not keys.index(k): a 65,536-chunk request must not cost n^2
        which = [index[k] for k in out.keys_to_store]
        if self.row == ROW:
            for i, r in zip(which, out.store_spec.chunk_ids.tolist()):
                rows[r] = payload(i)
        elif which:
            rows[np.asarray(out.store_spec.chunk_ids)] = payloads(which, self.row).view(rows.dtype)
        del rows
        with self.lock:
            if out.keys_to_store:
                self.mgr.complete_store(out.keys_to_store, ctx)
            self.mgr.on_request_finished(ctx)
        self.step([req_id])
        return pol

    def check_loaded(self, ctx, ids) -> None:
        """vLLM's side of a finished load: prepare_load, every chunk's row byte-compared with what `store` wrote
        for it (the first differing chunk named), complete_load, the request finished."""
        keys = [key(i) for i in ids]
        with self.lock:
            spec = self.mgr.prepare_load(keys, ctx)
        rows = np.asarray(self.view)
        got = rows[np.asarray(spec.chunk_ids)].view(np.int8)
        want = np.stack([payload(i) for i in ids]) if self.row == ROW else payloads(ids, self.row)
        bad = np.flatnonzero((got != want).any(axis=1))
        del rows
        assert bad.size == 0, f"{bad.size} of {len(ids)} chunks differ after the load (first: chunk {ids[bad[0]]})"
        with self.lock:
            self.mgr.complete_load(keys, ctx)
            self.mgr.on_request_finished(ctx)

    def lookup(self, ctx, ids) -> list:
        with self.lock:
            return [self.mgr.lookup(key(i), ctx) for i in ids]

    def idle(self) -> bool:
        return not self.mgr._jobs

    @property
    def poll_thread(self) -> bool:
        """vLLM's tier-poll thread calls the tier between steps (0.33+, unless tier_poll_interval_s <= 0)."""
        return float(getattr(self.spec, "tier_poll_interval_s", 0.0) or 0.0) > 0

    def close(self) -> None:
        self.mgr.shutdown()  # without the lock, as vLLM does


def run_until(engines, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        for e in engines:
            e.step()
        time.sleep(0.002)


def idle_steps(engine: Engine, timeout_s: float = 30.0) -> int:
    """An engine without requests: it steps only while the manager says it has pending work (then it blocks on its
    input queue).  Returns the steps taken; raises if the tier keeps it stepping past ``timeout_s``."""
    deadline, n = time.monotonic() + timeout_s, 0
    while engine.mgr.has_pending_work():
        assert time.monotonic() < deadline, f"has_pending_work still True after {timeout_s} s of idle steps"
        engine.step()
        n += 1
        time.sleep(0.002)
    return n


def idle_until(engine: Engine, done, why: str, timeout_s: float = 30.0) -> int:
    """An engine without requests until ``done()``: it steps while the manager says it has pending work
    (:func:`idle_steps`), then blocks on its input queue, where only vLLM's tier-poll thread still calls the tier.
    Fails with ``why`` when ``done()`` does not hold by then and no poll thread runs (vLLM would never call the tier
    again), or past ``timeout_s``.  Returns the steps taken."""
    deadline = time.monotonic() + timeout_s
    n = idle_steps(engine, timeout_s)
    while not done():
        assert engine.poll_thread, f"{why} (the engine blocks on its input queue, and no tier-poll thread runs)"
        assert time.monotonic() < deadline, f"{why} (within {timeout_s} s of the tier-poll thread alone)"
        time.sleep(0.002)
    return n


def pull(reader: Engine, address: str, rid: str, kv: str | None = None) -> ReqContext:
    """A new request on ``reader`` pulling its prefix from the worker at ``address`` (``remote_kv_source``, under
    ``kv`` or the request's own id), as vLLM starts it."""
    host, port = address.split(":")
    ctx = ReqContext(req_id=rid, kv_transfer_params={
        "remote_kv_source": {"kv_request_id": kv or rid, "remote_host": host, "remote_port": int(port)}})
    with reader.lock:
        reader.mgr.on_new_request(ctx)
    return ctx


def until_answered(reader: Engine, others: list[Engine], ctx: ReqContext, ids: list[int], timeout_s: float) -> list:
    """Scheduler passes over ``ctx`` (``others`` stepping too) until its lookups are all HIT (pulled) or all MISS
    (recompute); returns them."""
    deadline = time.monotonic() + timeout_s
    first = True
    while True:
        got = reader.lookup(ctx, ids)
        if got in ([LookupResult.HIT] * len(ids), [LookupResult.MISS] * len(ids)):
            return got
        assert time.monotonic() < deadline, f"not answered within {timeout_s} s: {got}"
        reader.step([ctx.req_id] if first else [])
        first = False
        run_until([reader, *others], lambda: reader.idle() and not reader.tier.lookups.pending, timeout_s=timeout_s)


__all__ = ["Engine", "LookupResult", "ReqContext", "key", "payload", "payloads", "run_until", "ROW", "IDLE_ENGINE",
           "idle_steps", "idle_until", "pull", "until_answered"]
