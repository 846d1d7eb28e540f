"""Pure helpers of the data plane and the fingerprint."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pworker.data.base import SMALL_ROWS, XferState, check_rows, coalesce, rows_to_runs, split_runs
from p2pworker.errors import FingerprintMismatch, TransferFailed
from p2pworker.fingerprint import Fingerprint


def test_coalesce_contiguous_on_both_sides_only():
    runs = coalesce([1, 2, 3, 10, 11, 40, 41], [5, 6, 7, 20, 22, 0, 1])
    assert runs.tolist() == [[1, 5, 3], [10, 20, 1], [11, 22, 1], [40, 0, 2]]
    assert coalesce([], []).shape == (0, 3)
    assert coalesce(np.arange(512), np.arange(512) + 7).tolist() == [[0, 7, 512]]


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000)), max_size=200))
def test_coalesce_then_split_covers_every_row_once_in_order(pairs):
    lr = np.array([p[0] for p in pairs], dtype=np.int64)
    rr = np.array([p[1] for p in pairs], dtype=np.int64)
    runs = coalesce(lr, rr)
    for piece in split_runs(runs, block_bytes=1024, max_piece_bytes=5 * 1024) if len(runs) else []:
        assert piece[:, 2].sum() <= 5
    expanded = [(l0 + i, r0 + i) for l0, r0, n in runs.tolist() for i in range(n)]
    assert expanded == [(int(a), int(b)) for a, b in zip(lr, rr)]
    pieces = split_runs(runs, block_bytes=1024, max_piece_bytes=5 * 1024)
    again = [(l0 + i, r0 + i) for p in pieces for l0, r0, n in p.tolist() for i in range(n)]
    assert again == expanded


def test_split_runs_bounds_piece_bytes_and_keeps_at_least_one_row():
    runs = coalesce(np.arange(100), np.arange(100))
    pieces = split_runs(runs, block_bytes=1 << 20, max_piece_bytes=8 << 20)
    assert [int(p[:, 2].sum()) for p in pieces] == [8] * 12 + [4]
    assert len(split_runs(runs, block_bytes=1 << 20, max_piece_bytes=1)) == 100


def test_check_rows_rejects_bad_mappings():
    check_rows([0, 1], [2, 3], 4, 4)
    with pytest.raises(TransferFailed, match="2 local rows but 1 remote"):
        check_rows([0, 1], [2], 4, 4)
    with pytest.raises(TransferFailed, match="no rows"):
        check_rows([], [], 4, 4)
    with pytest.raises(TransferFailed, match="local rows outside"):
        check_rows([4], [0], 4, 4)
    with pytest.raises(TransferFailed, match="peer's 0..3"):
        check_rows([0], [-1], 4, 4)


def _numpy_way(lr, rr, lb, rb):
    try:
        a, b = check_rows(np.array(lr, dtype=np.int64), np.array(rr, dtype=np.int64), lb, rb)
    except TransferFailed as e:
        return str(e)
    return coalesce(a, b).tolist(), int(a.size)


@given(st.lists(st.tuples(st.integers(-1, 64), st.integers(-1, 64), st.integers(1, 6), st.booleans()), max_size=20),
       st.integers(0, 3), st.sampled_from([4, 64, 70]), st.sampled_from([4, 64, 70]))
def test_row_lists_take_the_plain_python_way_to_the_same_runs_and_refusals(stretches, extra, lb, rb):
    """rows_to_runs on lists (<= SMALL_ROWS rows, plain Python) gives what check_rows + coalesce give on arrays:
    the same runs, the same count, the same refusal text.  Rows come as stretches contiguous on the local side and,
    or not, on the remote side."""
    lr, rr = [], []
    for l0, r0, n, both in stretches:
        lr += range(l0, l0 + n)
        rr += range(r0, r0 + n) if both else [r0 + 2 * i for i in range(n)]
    rr += [1] * (extra if extra == 3 else 0)  # sometimes a length mismatch
    try:
        runs, n = rows_to_runs(lr, rr, lb, rb)
        got = (runs.tolist(), n)
    except TransferFailed as e:
        got = str(e)
    assert got == _numpy_way(lr, rr, lb, rb)
    # past SMALL_ROWS (and for arrays) the numpy way itself runs
    big = list(range(SMALL_ROWS + 1))
    assert rows_to_runs(big, big, SMALL_ROWS + 1, SMALL_ROWS + 1)[0].tolist() == [[0, 0, SMALL_ROWS + 1]]


def test_nixl_states_map_to_the_enum_and_unknown_is_err():
    assert XferState.from_nixl("DONE") is XferState.DONE
    assert XferState.from_nixl("PROC") is XferState.PROC
    assert XferState.from_nixl("ERR") is XferState.ERR
    assert XferState.from_nixl("WEIRD") is XferState.ERR


def test_fingerprint_mismatch_names_both_values():
    a = Fingerprint.build(block_bytes=16384, protocol_version=1, identity={"model": "m", "dtype": "bf16"})
    b = Fingerprint.build(block_bytes=32768, protocol_version=1, identity={"model": "m", "dtype": "fp16"})
    assert a.digest != b.digest and len(a.digest) == 16
    a.check(Fingerprint.build(block_bytes=16384, protocol_version=1, identity={"dtype": "bf16", "model": "m"}))
    with pytest.raises(FingerprintMismatch) as ei:
        a.check(b)
    msg = str(ei.value)
    assert "block_bytes: local=16384 remote=32768" in msg
    assert "model.dtype: local='bf16' remote='fp16'" in msg
    assert ei.value.diffs["block_bytes"] == (16384, 32768)
    c = Fingerprint.build(block_bytes=16384, protocol_version=2)
    assert "<absent>" in str(pytest.raises(FingerprintMismatch, a.check, c).value)
