"""GPU tests of the decode GEMM: Llama-3-8B layer shapes in bf16, CUDA graphs, the
linear layer's dispatch with the Triton ops."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

if torch.cuda.is_available():
    from loraserve.kernels import dense_gemm, pdl
    from loraserve.model import triton_ops
    from loraserve.model.linear import Linear

# (N, K) of qkv, o, gate/up, down and the LM head of Llama-3-8B.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def make(m, n, k, dtype=torch.bfloat16, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    return x, w, b


def reference(x, w, b):
    # fp32 products of the bf16 inputs, rounded once, as the kernel does.
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def assert_close_bf16(y, ref):
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 32, 64])
def test_layer_shapes_with_the_configs_in_use(m, n, k):
    x, w, _ = make(m, n, k)
    assert_close_bf16(dense_gemm.dense_linear(x, w), reference(x, w, None))


@pytest.mark.parametrize("split", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_k_bias_and_half_dtypes(split, dtype):
    x, w, b = make(24, 1000, 2048 + 64, dtype=dtype, bias=True)  # ragged N and K
    cfg = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}
    assert_close_bf16(dense_gemm.dense_linear(x, w, b, config=cfg), reference(x, w, b))


def test_in_a_cuda_graph_replays_equal_eager_and_counters_return_to_zero():
    n, k = 4096, 14336
    x, w, _ = make(32, n, k)
    cfg = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 4, "num_stages": 4}
    static_x = x.clone()
    dense_gemm.dense_linear(static_x, w, config=cfg)  # eager first: makes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = dense_gemm.dense_linear(static_x, w, config=cfg)
    for seed in (1, 2):
        new_x, _, _ = make(32, n, k, seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, dense_gemm.dense_linear(new_x, w, config=cfg))
        assert_close_bf16(static_y, reference(new_x, w, None))
    assert int(dense_gemm._lock_buffer(x.device).abs().sum()) == 0


@pytest.mark.parametrize("m", [1, 32, 64])
@pytest.mark.parametrize("split", [1, 4])
def test_gate_up_with_silu_and_mul_in_the_epilogue(m, split):
    from loraserve.kernels.activation import silu_and_mul

    x, w, b = make(m, 2 * 14336, 4096, bias=True)
    cfg = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": split, "num_warps": 4, "num_stages": 4}
    fused = dense_gemm.dense_linear(x, w, b, config=cfg, silu_mul=True)
    # The same GEMM unfused, then the activation kernel: each half rounded first.
    assert_close_bf16(fused, silu_and_mul(dense_gemm.dense_linear(x, w, b, config=cfg)))
    gate_up = reference(x, w, b).float()
    ref = F.silu(gate_up[:, :14336]).to(x.dtype).float() * gate_up[:, 14336:]
    assert_close_bf16(fused, ref.to(x.dtype))
    # The tuned (merged layer's) config, as the MLP runs it.
    assert_close_bf16(dense_gemm.dense_linear(x, w, b, silu_mul=True), ref.to(x.dtype))


def test_linear_silu_and_mul_fuses_decode_batches_only(monkeypatch):
    from loraserve.kernels.activation import silu_and_mul

    layer = Linear(512, 2 * 384, ops=triton_ops.TritonOps(), device="cuda",
                   dtype=torch.bfloat16)
    fused = []
    real = dense_gemm.dense_linear
    monkeypatch.setattr(triton_ops, "dense_linear",
                        lambda *a, **kw: fused.append(kw.get("silu_mul")) or real(*a, **kw))
    for tokens in (5, dense_gemm.MAX_TOKENS + 1):
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        want = silu_and_mul(F.linear(x, layer.weight, layer.bias))
        assert_close_bf16(layer.silu_and_mul(x), want)
    # The decode batch in one kernel with the activation; the other on cuBLAS.
    assert fused == [True]


def test_linear_runs_decode_batches_on_the_kernel_and_others_on_cublas(monkeypatch):
    ops = triton_ops.TritonOps()
    layer = Linear(512, 384, bias=True, ops=ops, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = dense_gemm.dense_linear
    monkeypatch.setattr(
        triton_ops, "dense_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    small = torch.randn(3, 7, 512, device="cuda", dtype=torch.bfloat16)  # 21 tokens
    out = layer(small)
    assert calls and out.shape == (3, 7, 384)
    assert_close_bf16(out, reference(small.view(-1, 512), layer.weight, layer.bias).view(3, 7, 384))
    calls.clear()
    big = torch.randn(dense_gemm.MAX_TOKENS + 1, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(layer(big), F.linear(big, layer.weight, layer.bias)) and not calls
    fp32 = Linear(512, 384, ops=ops, device="cuda")
    x32 = torch.randn(4, 512, device="cuda")
    assert torch.equal(fp32(x32), F.linear(x32, fp32.weight, fp32.bias)) and not calls


def test_pdl_chain_in_a_cuda_graph_equals_the_chain_without_pdl(monkeypatch):
    # GEMM -> norm -> GEMM -> SiLU-and-mul -> GEMM, each kernel launched early under
    # PDL: a read before the previous kernel's writes land would change the output.
    from loraserve.kernels.activation import silu_and_mul
    from loraserve.kernels.fused_norm_rope import rms_norm
    from loraserve.kernels.pdl import pdl_args

    x, w1, _ = make(32, 4096, 4096)
    _, w2, _ = make(1, 2 * 8192, 4096, seed=1)
    _, w3, _ = make(1, 4096, 8192, seed=2)
    norm_w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain(inp):
        h = rms_norm(dense_gemm.dense_linear(inp, w1), norm_w, 1e-5)
        return dense_gemm.dense_linear(silu_and_mul(dense_gemm.dense_linear(h, w2)), w3)

    if torch.cuda.get_device_capability()[0] >= 9:
        assert pdl_args(x.device)["PDL"]
    static_x = x.clone()
    chain(static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = chain(static_x)
    monkeypatch.setattr(pdl, "_device_supports", lambda device: False)
    for seed in range(10):
        new_x, _, _ = make(32, 4096, 4096, seed=100 + seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, chain(new_x)), f"replay {seed}"
