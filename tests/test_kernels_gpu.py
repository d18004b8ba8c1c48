"""GPU tests of the Triton LoRA op: real sizes in bf16 and CUDA-graph capture."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

if torch.cuda.is_available():
    from loraserve.kernels import lora_ops
    from loraserve.kernels.activation import silu_and_mul
    from loraserve.kernels.lora_activation import silu_and_mul_lora
    from loraserve.kernels.lora_meta import LoRAMetadata, build_lora_metadata
    from loraserve.kernels.lora_ops import add_lora_linear
    from loraserve.kernels.lora_shrink import workspace_numel


def reference(y, x, lora_a, lora_b, slots):
    """fp32 torch: shrink rounded once to the weight dtype (as the kernel does), expand."""
    out = y.clone()
    valid = slots >= 0
    idx = slots.clamp(min=0).long()
    off = 0
    for a, b in zip(lora_a, lora_b, strict=True):
        n = b.shape[1]
        xa = torch.bmm(x.float().unsqueeze(1), a[idx].float().transpose(1, 2)).to(x.dtype)
        delta = torch.bmm(xa.float(), b[idx].float().transpose(1, 2)).squeeze(1)
        new = (y[:, off : off + n].float() + delta).to(y.dtype)
        out[:, off : off + n] = torch.where(valid[:, None], new, y[:, off : off + n])
        off += n
    return out


def make(t, k, r, s, widths, dtype, n_active=None, frac_none=0.2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    x = torch.randn(t, k, generator=g, device=dev).to(dtype)
    a = [(torch.randn(s, r, k, generator=g, device=dev) / k**0.5).to(dtype) for _ in widths]
    b = [(torch.randn(s, n, r, generator=g, device=dev) / r**0.5).to(dtype) for n in widths]
    y = torch.randn(t, sum(widths), generator=g, device=dev).to(dtype)
    slots = random_slots(t, s, n_active or s, frac_none, g)
    return y, x, a, b, slots


def random_slots(t, s, n_active, frac_none, g):
    active = torch.randperm(s, generator=g, device="cuda")[:n_active].to(torch.int32)
    pick = torch.randint(0, n_active, (t,), generator=g, device="cuda")
    slots = active[pick]
    slots[torch.rand(t, generator=g, device="cuda") < frac_none] = -1
    return slots


def assert_matches(got, want, y_before, slots, tol):
    none = slots < 0
    assert torch.equal(got[none], y_before[none])
    diff = (got.float() - want.float()).norm() / (want.float() - y_before.float()).norm().clamp(
        min=1e-6
    )
    assert diff.item() < tol, f"relative error of the update {diff.item()}"
    assert torch.isfinite(got).all()


TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}

QKV = (4096, [4096, 1024, 1024])
SHAPES = {
    "qkv": QKV,
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}


@pytest.mark.parametrize("t", [1, 7, 64, 1000, 4096])
@pytest.mark.parametrize("r", [16, 64])
def test_bf16_qkv_real_sizes(t, r):
    k, widths = QKV
    y, x, a, b, slots = make(t, k, r, 32, widths, torch.bfloat16, n_active=min(32, 8), seed=t + r)
    want = reference(y, x, a, b, slots)
    got = y.clone()
    add_lora_linear(got, x, a, b, slots)
    assert_matches(got, want, y, slots, TOL[torch.bfloat16])


@pytest.mark.parametrize("name", ["o", "gate_up", "down"])
@pytest.mark.parametrize("t,r,n_active", [(1, 8, 1), (256, 16, 32), (2048, 64, 3)])
def test_bf16_other_layers(name, t, r, n_active):
    k, widths = SHAPES[name]
    y, x, a, b, slots = make(t, k, r, 32, widths, torch.bfloat16, n_active=n_active, seed=t)
    want = reference(y, x, a, b, slots)
    got = y.clone()
    add_lora_linear(got, x, a, b, slots)
    assert_matches(got, want, y, slots, TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("t", [5, 300])
def test_other_dtypes(dtype, t):
    y, x, a, b, slots = make(t, 1000, 16, 6, [512, 128, 128], dtype, seed=t)
    want = reference(y, x, a, b, slots)
    got = y.clone()
    add_lora_linear(got, x, a, b, slots)
    assert_matches(got, want, y, slots, TOL[dtype])


@pytest.mark.parametrize("r", [1, 128, 512])
def test_rank_extremes(r):
    y, x, a, b, slots = make(33, 2048, r, 4, [1024, 256], torch.bfloat16, seed=r)
    want = reference(y, x, a, b, slots)
    got = y.clone()
    add_lora_linear(got, x, a, b, slots)
    assert_matches(got, want, y, slots, TOL[torch.bfloat16])


def test_long_prefill_many_tokens():
    y, x, a, b, slots = make(20000, 4096, 16, 8, [4096], torch.bfloat16, n_active=5, seed=11)
    want = reference(y, x, a, b, slots)
    got = y.clone()
    add_lora_linear(got, x, a, b, slots)
    assert_matches(got, want, y, slots, TOL[torch.bfloat16])


@pytest.mark.parametrize("update_in_graph", [False, True])
@pytest.mark.parametrize("t", [1, 64, 512])
def test_cuda_graph_replay_with_new_slots(t, update_in_graph):
    k, widths = QKV
    s, r = 16, 16
    y0, x, a, b, slots = make(t, k, r, s, widths, torch.bfloat16, seed=100 + t)
    meta = LoRAMetadata(max_tokens=t, num_slots=s, device="cuda")
    meta.update(slots)
    meta.ensure_workspace(workspace_numel(t, k, r, len(widths)))
    y = y0.clone()
    static_slots = slots.clone()

    def step():
        if update_in_graph:
            meta.update(static_slots)
        add_lora_linear(y, x, a, b, static_slots, meta)

    # Warm up on a side stream (compiles the kernels), as torch asks before capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    g = torch.Generator(device="cuda").manual_seed(t)
    cases = [
        (1, 0.0),  # one adapter
        (s, 0.1),  # every slot
        (3, 0.5),  # a few, half the tokens without adapter
        (1, 1.0),  # no adapter at all
        (8, 0.0),
    ]
    for n_active, frac_none in cases:
        new_slots = random_slots(t, s, n_active, frac_none, g)
        static_slots.copy_(new_slots)
        x.copy_(torch.randn(x.shape, generator=g, device="cuda").to(x.dtype))
        y.copy_(torch.randn(y.shape, generator=g, device="cuda").to(y.dtype))
        before = y.clone()
        want = reference(before, x, a, b, new_slots)
        if not update_in_graph:
            meta.update(static_slots)
        graph.replay()
        torch.cuda.synchronize()
        if (new_slots < 0).all():
            assert torch.equal(y, before)
        else:
            assert_matches(y, want, before, new_slots, TOL[torch.bfloat16])


@pytest.mark.parametrize("t", [1, 16, 64])
def test_small_batches_bf16(t):
    k, widths = QKV
    y, x, a, b, slots = make(t, k, 16, 32, widths, torch.bfloat16, n_active=8, seed=t + 7)
    want = reference(y, x, a, b, slots)
    got = y.clone()
    add_lora_linear(got, x, a, b, slots)
    assert_matches(got, want, y, slots, TOL[torch.bfloat16])


@pytest.mark.parametrize("t", [1, 64, 1024])
def test_split_k_reduction_is_deterministic(t):
    # The last-arriving split sums the partials in a fixed order, so repeated
    # calls must agree bit for bit; a missing fence would show up as drift.
    k, widths = SHAPES["down"]
    y, x, a, b, slots = make(t, k, 16, 32, widths, torch.bfloat16, n_active=8, seed=t + 3)
    meta = build_lora_metadata(slots, 32)
    first = y.clone()
    add_lora_linear(first, x, a, b, slots, meta)
    for _ in range(20):
        again = y.clone()
        add_lora_linear(again, x, a, b, slots, meta)
        assert torch.equal(again, first)
    assert int(meta.locks.abs().sum()) == 0
    assert_matches(first, reference(y, x, a, b, slots), y, slots, TOL[torch.bfloat16])


@pytest.mark.parametrize("t,n_active,frac_none", [(1, 1, 0.0), (256, 32, 0.2), (4096, 8, 0.3)])
def test_silu_and_mul_lora_equals_expand_then_activation(t, n_active, frac_none):
    k, widths = SHAPES["gate_up"]
    y, x, a, b, slots = make(t, k, 16, 32, widths, torch.bfloat16, n_active, frac_none, seed=t)
    meta = LoRAMetadata(max_tokens=t, num_slots=32, device="cuda")
    meta.update(slots)
    gate_up = y.clone()
    got = silu_and_mul_lora(gate_up, x, a, b, meta)
    assert torch.equal(gate_up, y)
    with_update = y.clone()
    add_lora_linear(with_update, x, a, b, slots, meta)
    want = silu_and_mul(with_update)
    # One bf16 rounding step apart at most (the update's dot may tile differently).
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    none = slots < 0
    assert torch.equal(got[none], silu_and_mul(y)[none])
    # The update is there: it moves the result well beyond that tolerance.
    assert (got.float() - silu_and_mul(y).float())[~none].abs().max() > 0.1


@pytest.mark.parametrize("t", [1, 256])
def test_punica_linear_shrink_beside_in_a_cuda_graph(t):
    # At T=1 the wrapper runs the shrink on a side stream beside the base GEMM;
    # inside a captured graph that is a branch that must join before the expand.
    # At T=256 shrink and expand are one launch after the GEMM.
    from loraserve.lora.punica_triton import TritonPunicaWrapper

    k, widths = QKV
    y0, x, a, b, slots = make(t, k, 16, 8, widths, torch.bfloat16, n_active=8, seed=t)
    w = (torch.randn(sum(widths), k, device="cuda") / k**0.5).to(torch.bfloat16)
    punica = TritonPunicaWrapper(t, 8, torch.device("cuda"))
    punica.update_mapping(slots.tolist())
    meta_ref = LoRAMetadata(max_tokens=t, num_slots=8, device="cuda")
    meta_ref.update(slots)

    def base(inp):
        return inp @ w.t()

    want = base(x)
    add_lora_linear(want, x, a, b, slots, meta_ref)
    assert torch.equal(punica.linear(base, x, a, b), want)  # eager, warms up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = punica.linear(base, x, a, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = base(x)
    add_lora_linear(want, x, a, b, slots, meta_ref)
    assert torch.equal(out, want)


@pytest.mark.parametrize("name", ["qkv", "o", "down"])
@pytest.mark.parametrize("t", [64, 256])
def test_one_launch_equals_two_launches(monkeypatch, name, t):
    # At decode sizes shrink and expand share one launch, the expand programs
    # spinning on their tile's flag; repeated calls must agree with two launches
    # bit for bit, and leave the flags at 0.
    k, widths = SHAPES[name]
    y, x, a, b, slots = make(t, k, 16, 32, widths, torch.bfloat16, n_active=32, seed=t + k)
    meta = build_lora_metadata(slots, 32)
    assert lora_ops.prefers_one_launch(t, k, widths, 16)
    ones = []
    for _ in range(5):
        one = y.clone()
        add_lora_linear(one, x, a, b, slots, meta)
        ones.append(one)
    assert int(meta.tile_flags.abs().sum()) == 0 and int(meta.locks.abs().sum()) == 0
    monkeypatch.setattr(lora_ops, "ONE_LAUNCH_TOKENS", (0, 0))
    two = y.clone()
    add_lora_linear(two, x, a, b, slots, meta)
    assert all(torch.equal(one, two) for one in ones)
    assert_matches(two, reference(y, x, a, b, slots), y, slots, TOL[torch.bfloat16])


@pytest.mark.parametrize("name", ["qkv", "gate_up"])
@pytest.mark.parametrize("t", [256, 4096])
@pytest.mark.parametrize("fuse", [0, 1])
def test_shrink_slices_in_one_program_or_one_each(monkeypatch, name, t, fuse):
    # FUSE_SLICES forced on and off over the config in use: the same update, one
    # program per slice or one for all of a tile's slices, compiled (qkv at T=256
    # runs as one launch).
    real = lora_ops.shrink_config
    monkeypatch.setattr(
        lora_ops, "shrink_config", lambda *args: {**real(*args), "FUSE_SLICES": fuse}
    )
    k, widths = SHAPES[name]
    y, x, a, b, slots = make(t, k, 16, 32, widths, torch.bfloat16, n_active=32, seed=t + fuse)
    got = y.clone()
    add_lora_linear(got, x, a, b, slots)
    assert_matches(got, reference(y, x, a, b, slots), y, slots, TOL[torch.bfloat16])
