"""CPU tests of the Triton paged attention under TRITON_INTERPRET=1 (GPU: *_gpu.py)."""

import pytest
import torch

# On a CPU box conftest.py has put Triton in interpreter mode before any import.
pytest.importorskip("triton")

from paged_attention_utils import (  # noqa: E402
    decode_rotary,
    make_batch,
    pad_like_a_graph,
    reference,
    rotated,
    run_kernels,
    run_with_new_kv,
)

from loraserve.kernels import attention_tiling  # noqa: E402
from loraserve.kernels import paged_attention as pa  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU interpreter tests; the GPU has the _gpu file"
)


def run_kernel(b, scale, window, **kw):
    return run_kernels(b, scale, window, **kw)


def check(b, window=None, atol=1e-5, **kw):
    d = b["q"].shape[-1]
    scale = d**-0.5
    want, want_cache = reference(b, scale, window)
    got, got_cache = run_kernel(b, scale, window, **kw)
    assert torch.equal(got_cache, want_cache)
    rt = b["real_t"]
    torch.testing.assert_close(got[:rt], want, atol=atol, rtol=atol)


MIXED = [(0, 7), (5, 1), (20, 1), (13, 9), (0, 1), (37, 3), (16, 16)]
DECODE = [(3, 1), (40, 1), (15, 1), (16, 1), (0, 1)]


@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_batch_gqa(block_size):
    b = make_batch(MIXED, 4, 2, 16, block_size, seed=block_size)
    check(b, max_query_len=b["max_query_len"])


def test_mixed_batch_no_bound_and_splits():
    # No max_query_len: the tiling assumes T; and a forced split of the keys.
    b = make_batch(MIXED, 8, 2, 16, 16, seed=1)
    check(b)
    check(b, num_splits=3)


@pytest.mark.parametrize("block_size", [16, 4])
def test_decode_split_kv(block_size):
    b = make_batch(DECODE, 8, 2, 32, block_size, seed=2)
    check(b, max_query_len=1, num_splits=1)
    check(b, max_query_len=1, num_splits=4)
    # The split that merged put every tile's counter back.
    assert int(pa._lock_buffer(torch.device("cpu")).abs().sum()) == 0
    check(b, max_query_len=1)
    # Default choice for one sequence (the interpreter counts 4 SMs, so it splits).
    cpu = torch.device("cpu")
    assert attention_tiling.choose_num_splits(1, 1, 2, 1, 4, 32, torch.float32, cpu) > 1
    one = make_batch(DECODE[1:2], 8, 2, 32, block_size, seed=3)
    check(one, max_query_len=1)


@pytest.mark.parametrize("block_size", [64, 6])
def test_decode_key_tiles_and_blocks_that_do_not_line_up(block_size):
    # The decode loop takes a key's block and row from per-lane offsets when the
    # key tile and the block size divide one another: 64 is a block longer than a
    # tile; 6 divides no tile, so the loop computes them per key. Windows and
    # splits move a tile's first key.
    b = make_batch(DECODE + [(90, 1)], 8, 2, 32, block_size, seed=4)
    for kw in ({"num_splits": 1}, {"num_splits": 3}, {"num_splits": 2, "window": 7}):
        check(b, max_query_len=1, **kw)


def test_int64_cache_offsets(monkeypatch):
    # Caches of 2**31 elements or more address with int64; test-sized ones fit int32.
    big = torch.empty((2, 2**17, 16, 8, 128), device="meta")[0]
    assert not pa.offsets_fit_int32(big) and pa.offsets_fit_int32(big[: 2**13])
    monkeypatch.setattr(pa, "offsets_fit_int32", lambda cache: False)
    check(make_batch(MIXED, 4, 2, 16, 4, seed=5), max_query_len=None)
    check(make_batch(DECODE, 8, 2, 32, 16, seed=5), max_query_len=1, num_splits=2, window=9)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_keys_past_the_end_read_block0_only(num_splits):
    # Key lanes past a sequence's end load their keys and values unmasked from
    # block 0 (zeros) and nowhere else: the rows past each sequence's end in its
    # own last block, and every other free block, hold NaN.
    b = make_batch(DECODE, 8, 2, 32, 16, seed=7)
    cache, size = b["cache"], 16
    used = {blk for table in b["meta"].block_tables for blk in table}
    for blk in set(range(1, cache.shape[1])) - used:
        cache[:, blk] = float("nan")
    for table, seq_len in zip(b["meta"].block_tables, b["meta"].seq_lens, strict=True):
        if table and seq_len % size:
            cache[:, table[-1], seq_len % size :] = float("nan")
    scale = 32**-0.5
    want, _ = reference(b, scale, None)
    got, _ = run_kernel(b, scale, None, max_query_len=1, num_splits=num_splits)
    torch.testing.assert_close(got[: b["real_t"]], want, atol=1e-5, rtol=1e-5)


def test_sliding_window():
    b = make_batch(MIXED, 4, 1, 16, 4, seed=3)
    check(b, window=5, max_query_len=b["max_query_len"])
    check(b, window=8, num_splits=2)


def test_many_query_tiles_per_sequence():
    # Small tiles so that sequences span several tiles and the tile-to-sequence
    # lookup crosses more than one search block.
    specs = [(0, 1)] * 130 + [(3, 11), (0, 9)]
    b = make_batch(specs, 2, 1, 16, 4, seed=4)
    cfg = pa.AttentionConfig(block_q=2, block_n=16, num_warps=4, num_stages=1)
    check(b, config=cfg)


def test_odd_group_and_head_dim():
    # Group 3 (padded to 4 rows) and head_dim 24 (padded to 32).
    b = make_batch(MIXED[:4], 6, 2, 24, 16, seed=5)
    check(b, max_query_len=b["max_query_len"])


def test_padding_is_harmless():
    b = make_batch(MIXED[:3], 4, 2, 16, 16, pad_tokens=5, pad_seqs=3, seed=6)
    check(b, max_query_len=b["max_query_len"])
    # Padding tokens and sequences take no part in a split launch's merge.
    check(b, max_query_len=b["max_query_len"], num_splits=2)
    db = make_batch(DECODE, 4, 2, 16, 16, pad_tokens=3, pad_seqs=3, seed=7)
    check(db, max_query_len=1)


def test_write_kv_cache_skips_padding_and_strided_input():
    b = make_batch(MIXED[:3], 4, 2, 16, 4, pad_tokens=2, seed=8)
    t = b["k"].shape[0]
    # k and v as column slices of one fused buffer, as a QKV projection gives them.
    kv = torch.cat([b["k"].reshape(t, -1), b["v"].reshape(t, -1)], dim=1)
    k = kv[:, :32].view(t, 2, 16)
    v = kv[:, 32:].view(t, 2, 16)
    cache = b["cache"].clone()
    pa.write_kv_cache(k, v, cache, b["slot_mapping"])
    want = b["cache"].clone()
    rt = b["real_t"]
    want[0].view(-1, 2, 16)[b["meta"].slot_mapping] = b["k"][:rt]
    want[1].view(-1, 2, 16)[b["meta"].slot_mapping] = b["v"][:rt]
    assert torch.equal(cache, want)


def test_workspace_checks():
    b = make_batch(DECODE, 4, 2, 16, 16, seed=9)
    ws = pa.make_workspace(4, 16, "cpu")
    assert ws.numel() == pa.workspace_numel(4, 16)
    check(b, max_query_len=1, num_splits=8, workspace=ws)
    with pytest.raises(ValueError):
        run_kernel(b, 0.25, None, num_splits=8, workspace=ws[:10])


def test_window_wider_than_key_tile():
    # Small key tiles so that the unmasked middle of the window is several tiles.
    cfg = pa.AttentionConfig(block_q=4, block_n=16, num_warps=4, num_stages=1)
    b = make_batch([(60, 1), (50, 9), (0, 40), (33, 1)], 4, 2, 16, 4, seed=10)
    check(b, window=37, config=cfg)
    check(b, config=cfg)
    check(b, window=37, config=cfg, num_splits=3)


def test_long_key_tiles_of_big_decode_batches():
    # The tiling the default picks for big decode batches in bf16 (128 keys a step).
    cfg = pa.AttentionConfig(block_q=1, block_n=128, num_warps=4, num_stages=3)
    b = make_batch([(300, 1), (129, 1), (5, 1), (255, 1)], 8, 2, 16, 16, seed=11)
    check(b, max_query_len=1, config=cfg, num_splits=1)
    check(b, max_query_len=1, config=cfg, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_with_the_rotary_and_kv_write_in_the_launch(num_splits, window):
    # new_kv: q and k arrive unrotated; the launch rotates them, writes k and v at
    # their slots and attends the new key from registers. Against the torch
    # rotary then the reference; padding as a decode graph pads (seq_len 1,
    # slot -1) stores nothing. One 1-token prompt (no cached keys) is in the batch.
    for block_size, dim in ((4, 32), (16, 24)):
        b = pad_like_a_graph(make_batch(DECODE, 8, 2, dim, block_size, pad_tokens=3, seed=12))
        rope, positions = decode_rotary(b)
        scale = dim**-0.5
        want, want_cache = reference(rotated(b, rope, positions), scale, window)
        got, got_cache = run_with_new_kv(b, rope, positions, scale, window,
                                         num_splits=num_splits)
        torch.testing.assert_close(got_cache, want_cache, atol=1e-6, rtol=1e-6)
        rt = b["real_t"]
        torch.testing.assert_close(got[:rt], want, atol=1e-5, rtol=1e-5)
    assert int(pa._lock_buffer(torch.device("cpu")).abs().sum()) == 0


def test_new_kv_only_for_decode():
    b = make_batch(MIXED, 4, 2, 16, 16, seed=13)
    rope, _ = decode_rotary(make_batch(DECODE, 4, 2, 16, 16, seed=13))
    positions = torch.zeros(b["q"].shape[0], dtype=torch.long)
    with pytest.raises(AssertionError, match="decode"):
        pa.paged_attention(b["q"], b["cache"].clone(), torch.empty_like(b["q"]),
                           b["query_start_loc"], b["seq_lens"], b["block_tables"], 0.25,
                           max_query_len=b["max_query_len"],
                           new_kv=pa.NewKV(b["k"], b["v"], positions, rope.cos, rope.sin,
                                           b["slot_mapping"]))
