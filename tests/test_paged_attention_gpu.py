"""GPU tests of the Triton paged attention: real sizes in bf16/fp16/fp32 and CUDA graphs."""

import pytest
import torch
from paged_attention_utils import (
    decode_rotary,
    make_batch,
    pad_like_a_graph,
    reference,
    rotated,
    run_kernels,
    run_with_new_kv,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

if torch.cuda.is_available():
    from loraserve.kernels import paged_attention as pa

HQ, HK, D, BS = 32, 8, 128, 16
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def run(b, window=None, out=None, **kw):
    return run_kernels(b, b["q"].shape[-1] ** -0.5, window, out, **kw)


def check(b, window=None, **kw):
    dtype = b["q"].dtype
    scale = b["q"].shape[-1] ** -0.5
    want, want_cache = reference(b, scale, window, dtype=torch.float32)
    got, got_cache = run(b, window, **kw)
    assert torch.equal(got_cache, want_cache.to(dtype))
    rt = b["real_t"]
    err = (got[:rt].float() - want).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err}"


def decode_specs(n, seed, max_ctx=2048):
    g = torch.Generator().manual_seed(seed)
    return [(int(c), 1) for c in torch.randint(0, max_ctx, (n,), generator=g)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 7, 32, 64, 256])
def test_decode_real_sizes(dtype, batch):
    # Each batch size of the H200's decode tilings: 64 keys with 2 or 5 stages,
    # 128 keys (batch 256).
    b = make_batch(decode_specs(batch, batch), HQ, HK, D, BS, dtype, seed=batch, device="cuda")
    check(b, max_query_len=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_decode_with_the_rotary_and_kv_write_in_the_launch(dtype, batch):
    # Batch 1 and 7 split the keys, 64 does not; three padding rows as a graph pads.
    b = make_batch(decode_specs(batch, batch + 1), HQ, HK, D, BS, dtype, pad_tokens=3,
                   seed=batch, device="cuda")
    b = pad_like_a_graph(b)
    rope, positions = decode_rotary(b)
    scale = D**-0.5
    want, want_cache = reference(rotated(b, rope, positions), scale, None, torch.float32)
    got, got_cache = run_with_new_kv(b, rope, positions, scale)
    # The rotated k in the cache may differ from torch's by one rounding (FMA).
    torch.testing.assert_close(got_cache.float(), want_cache, atol=TOL[dtype], rtol=TOL[dtype])
    rt = b["real_t"]
    err = (got[:rt].float() - want).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_prefill_chunked_decode(dtype):
    specs = [(0, 700), (1000, 256), (0, 1), (513, 77)] + decode_specs(40, 3)
    b = make_batch(specs, HQ, HK, D, BS, dtype, pad_tokens=5, pad_seqs=2, seed=1, device="cuda")
    check(b, max_query_len=b["max_query_len"])
    check(b)  # no bound given: the tiling assumes T
    check(b, window=300, max_query_len=b["max_query_len"])


def test_prefill_batches_of_any_shape_share_one_compiled_kernel():
    # Sequence counts of 1, 3 and 16, block tables 7 and 16 wide: each a new
    # specialisation (1, multiples of 16) of a kernel that specialises on them.
    from triton import knobs

    compiles = []

    def count(**kw):
        compiles.append(str(kw.get("repr", kw.get("key"))))
        return False

    batches = [[(0, 100)], [(0, 37), (60, 40), (5, 64)], [(0, 256)] * 16]
    hook, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, count
    try:
        for i, specs in enumerate(batches):
            b = make_batch(specs, HQ, HK, D, BS, torch.bfloat16, seed=10 + i, device="cuda")
            check(b, max_query_len=b["max_query_len"])
    finally:
        knobs.runtime.jit_cache_hook = hook
    attention = [c for c in compiles if c.startswith("attn_kernel[")]
    assert len(attention) <= 1, attention


@pytest.mark.parametrize("head_dim,hq,hk", [(64, 16, 16), (64, 14, 2), (256, 8, 1)])
def test_other_shapes(head_dim, hq, hk):
    specs = [(0, 300), (100, 20)] + decode_specs(6, 5, 600)
    b = make_batch(specs, hq, hk, head_dim, BS, torch.bfloat16, seed=2, device="cuda")
    check(b, max_query_len=300)
    check(b, window=64)


@pytest.mark.parametrize("num_splits", [2, 16, 64])
def test_forced_splits(num_splits):
    b = make_batch(decode_specs(3, 9), HQ, HK, D, BS, torch.bfloat16, seed=3, device="cuda")
    check(b, max_query_len=1, num_splits=num_splits)


def _copy_into(static, b):
    for name in (
        "q",
        "k",
        "v",
        "cache",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "block_tables",
    ):
        static[name].copy_(b[name])


@pytest.mark.parametrize("batch,max_query_len", [(1, 1), (8, 1), (64, 1), (16, 64)])
def test_cuda_graph_replay_with_new_batch(batch, max_query_len):
    """Capture once, then replay over new seq_lens, block tables and query splits."""
    dtype = torch.bfloat16
    num_blocks, max_blocks = batch * 140 + 8, 140
    t = batch if max_query_len == 1 else batch * 8

    def new_batch(seed):
        g = torch.Generator().manual_seed(seed)
        n_real = int(torch.randint(1, batch + 1, (1,), generator=g))
        if max_query_len == 1:
            specs = decode_specs(n_real, seed)
        else:
            budget, specs = t, []
            for _ in range(n_real):
                n = int(
                    torch.randint(
                        1,
                        min(max_query_len, budget - (n_real - len(specs)) + 1) + 1,
                        (1,),
                        generator=g,
                    )
                )
                c = int(torch.randint(0, 1500, (1,), generator=g))
                specs.append((c, n))
                budget -= n
        used = sum(n for _, n in specs)
        return make_batch(
            specs,
            HQ,
            HK,
            D,
            BS,
            dtype,
            pad_tokens=t - used,
            pad_seqs=batch - len(specs),
            seed=seed,
            device="cuda",
            num_blocks=num_blocks,
            max_blocks=max_blocks,
        )

    static = new_batch(0)
    out = torch.zeros_like(static["q"])
    ws = pa.make_workspace(HQ, D, "cuda")
    scale = D**-0.5

    def step():
        pa.write_kv_cache(static["k"], static["v"], static["cache"], static["slot_mapping"])
        pa.paged_attention(
            static["q"],
            static["cache"],
            out,
            static["query_start_loc"],
            static["seq_lens"],
            static["block_tables"],
            scale,
            max_query_len=max_query_len,
            workspace=ws,
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seed in (1, 2, 3):
        b = new_batch(seed)
        _copy_into(static, b)
        graph.replay()
        torch.cuda.synchronize()
        want, want_cache = reference(b, scale, None, dtype=torch.float32)
        assert torch.equal(static["cache"], want_cache.to(dtype))
        rt = b["real_t"]
        err = (out[:rt].float() - want).abs().max().item()
        assert err < TOL[dtype], f"seed {seed}: max abs error {err}"
        assert torch.isfinite(out).all()
