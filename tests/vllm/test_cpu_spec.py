"""CPUCopyOffloadingWorker (vllm_adapter/cpu_spec.py) against vLLM's own transfer specs: the block ids of 0.32/0.33 and,
where the running vLLM has them, 0.34's DevicePointers, made by vLLM's own resolve_device_pointers.  A store then a
load must move exactly the named engine blocks to and from the named chunk rows, for every KV tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from vllm_adapter.contract import VLLM
from vllm_adapter.cpu_spec import CPUCopyOffloadingWorker

PAGE, BLOCKS, BPC, CHUNKS = 64, 12, 2, 6
SPEC_KINDS = ["block_ids"] + (["device_pointers"] if VLLM.device_pointers else [])  # what this vLLM hands a worker


class Region:
    """The shared region's worker views (SharedOffloadRegion.create_next_worker_view) over one private buffer."""

    def __init__(self, tensors: int):
        self.buf = torch.zeros(CHUNKS, tensors * BPC * PAGE, dtype=torch.int8)
        self._next = 0

    def create_next_worker_view(self, size: int) -> torch.Tensor:
        view = self.buf[:, self._next:self._next + size]
        self._next += size
        return view

    def cleanup(self) -> None:
        pass


def kv_caches() -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(7)
    tensors = [CanonicalKVCacheTensor(tensor=torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, generator=gen),
                                      page_size_bytes=PAGE) for _ in range(2)]
    # one group, one data ref per tensor; the second ref's page is unpadded to 48 bytes (only those are copied)
    refs = [[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE), CanonicalKVCacheRef(tensor_idx=1,
                                                                                        page_size_bytes=48)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def engine_spec(kind: str, blocks: list[int], first: int, caches: CanonicalKVCaches):
    spec = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[first])
    if kind == "block_ids":
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(spec, caches)


@pytest.mark.parametrize("kind", SPEC_KINDS)
def test_a_store_then_a_load_moves_exactly_the_named_blocks_and_rows(kind):
    caches = kv_caches()
    engine = [t.tensor.clone() for t in caches.tensors]
    region = Region(len(caches.tensors))
    worker = CPUCopyOffloadingWorker(caches, BPC, region)
    blocks, first, rows = [9, 3, 5], 1, [4, 1]  # starts inside its first chunk: positions 1..3 -> rows 4, 1, 1
    assert worker.submit_store(1, engine_spec(kind, blocks, first, caches), CPULoadStoreSpec(rows))
    host = region.buf.view(CHUNKS, len(caches.tensors), BPC, PAGE)
    for pos, block in zip(range(first, first + len(blocks)), blocks):
        row, sub = rows[pos // BPC], pos % BPC
        assert torch.equal(host[row, 0, sub], engine[0][block])
        assert torch.equal(host[row, 1, sub, :48], engine[1][block, :48])
    assert not host[rows[0], :, 0].any(), "a position before the load's first block was written"
    for t in caches.tensors:
        t.tensor.zero_()
    assert worker.submit_load(2, CPULoadStoreSpec(rows), engine_spec(kind, blocks, first, caches))
    for block in range(BLOCKS):
        if block in blocks:
            assert torch.equal(caches.tensors[0].tensor[block], engine[0][block])
            assert torch.equal(caches.tensors[1].tensor[block, :48], engine[1][block, :48])
            assert not caches.tensors[1].tensor[block, 48:].any()  # padding is not the layer's: not copied
        else:
            assert not caches.tensors[0].tensor[block].any(), f"block {block} was written by a load not naming it"
    done = worker.get_finished()
    assert [(r.job_id, r.success) for r in done] == [(1, True), (2, True)]
    worker.shutdown()


@pytest.mark.parametrize("kind", SPEC_KINDS)
def test_a_spec_that_does_not_name_its_blocks_and_rows_exactly_is_refused(kind):
    """Fewer chunk rows than the blocks need; and (DevicePointers) an address that is no block's start."""
    caches = kv_caches()
    worker = CPUCopyOffloadingWorker(caches, BPC, Region(len(caches.tensors)))
    with pytest.raises(AssertionError):
        worker.submit_store(1, engine_spec(kind, [1, 2], 0, caches), CPULoadStoreSpec([0, 1, 2]))
    if kind == "device_pointers":
        spec = engine_spec(kind, [1, 2], 0, caches)
        spec.ptrs[0] += np.uint64(3)
        with pytest.raises(AssertionError, match="outside"):
            worker.submit_store(2, spec, CPULoadStoreSpec([0]))
    worker.shutdown()
