"""CPU tests of the Triton LoRA op under TRITON_INTERPRET=1 (GPU tests: test_kernels_gpu.py)."""

import pytest
import torch

# On a CPU box conftest.py has put Triton in interpreter mode before any import.
pytest.importorskip("triton")

from loraserve.kernels import activation, lora_activation, lora_ops, lora_shrink  # noqa: E402
from loraserve.kernels.lora_meta import LoRAMetadata, build_lora_metadata  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU interpreter tests; the GPU has test_kernels_gpu.py"
)


def reference(y, x, lora_a, lora_b, slots):
    """Plain torch: the shrink in fp32, rounded once to the weight dtype, expand in fp32."""
    out = y.clone()
    off = 0
    valid = slots >= 0
    idx = slots.clamp(min=0).long()
    for a, b in zip(lora_a, lora_b, strict=True):
        n = b.shape[1]
        xa = torch.einsum("tk,trk->tr", x.double(), a[idx].double()).to(x.dtype)
        delta = torch.einsum("tr,tnr->tn", xa.double(), b[idx].double())
        new = (y[:, off : off + n].double() + delta).to(y.dtype)
        out[:, off : off + n] = torch.where(valid[:, None], new, y[:, off : off + n])
        off += n
    return out


def make_case(t, k, r, s, widths, dtype, seed, frac_none=0.25):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    lora_a = [(torch.randn(s, r, k, generator=g) / k**0.5).to(dtype) for _ in widths]
    lora_b = [(torch.randn(s, n, r, generator=g) / r**0.5).to(dtype) for n in widths]
    y = torch.randn(t, sum(widths), generator=g).to(dtype)
    slots = torch.randint(0, s, (t,), generator=g, dtype=torch.int32)
    none = torch.rand(t, generator=g) < frac_none
    slots[none] = -1
    return y, x, lora_a, lora_b, slots


TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def check(y, x, lora_a, lora_b, slots, meta=None):
    want = reference(y, x, lora_a, lora_b, slots)
    got = y.clone()
    lora_ops.add_lora_linear(got, x, lora_a, lora_b, slots, meta)
    none = slots < 0
    # Rows without an adapter: untouched, bit for bit.
    assert torch.equal(got[none], y[none])
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item() + 1e-6
    assert err <= TOL[y.dtype] * scale, f"max err {err} (scale {scale})"
    return got


@pytest.mark.parametrize(
    "t,k,r,s,widths",
    [
        (1, 67, 1, 1, [40]),
        (1, 300, 16, 8, [64, 16, 16]),
        (3, 67, 8, 2, [33, 7]),
        (3, 300, 64, 3, [48]),
        (17, 200, 16, 4, [32, 8, 8]),
        (17, 67, 1, 8, [24, 50]),
        (130, 96, 8, 8, [40, 40]),
        (130, 300, 64, 5, [20, 12, 12]),
        (130, 45, 16, 1, [70]),
    ],
)
def test_fp32_odd_shapes(t, k, r, s, widths):
    check(*make_case(t, k, r, s, widths, torch.float32, seed=t * 1000 + k + r))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,r,widths", [(1, 8, [48, 16]), (17, 16, [32, 8, 8]), (130, 64, [40])])
def test_half_dtypes(dtype, t, r, widths):
    check(*make_case(t, 150, r, 4, widths, dtype, seed=t + r))


def test_all_tokens_without_adapter():
    y, x, a, b, slots = make_case(17, 67, 8, 3, [16, 8], torch.float32, seed=1)
    slots.fill_(-1)
    got = y.clone()
    lora_ops.add_lora_linear(got, x, a, b, slots)
    assert torch.equal(got, y)


def test_one_slot_all_tokens_and_more_than_three_slices():
    # Four slices take two launch pairs; all tokens on the last slot.
    y, x, a, b, slots = make_case(17, 100, 8, 4, [8, 24, 16, 40], torch.float32, seed=2)
    slots.fill_(3)
    check(y, x, a, b, slots)


def test_strided_output_view_and_input():
    # y is a column window of a wider base-layer output; x a strided row view.
    y_full, x_full, a, b, slots = make_case(17, 134, 8, 3, [40, 24], torch.float32, seed=3)
    outside = y_full[:, :8].clone()
    x = x_full[:, :67]
    y = y_full[:, 8:40]
    a = [t[:, :, :67].contiguous() for t in a]
    b = [b[0][:, :20].contiguous(), b[1][:, :12].contiguous()]
    want = reference(y, x, a, b, slots)
    lora_ops.add_lora_linear(y, x, a, b, slots)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(y_full[:, :8], outside)


def test_metadata_reuse_and_smaller_batch():
    meta = LoRAMetadata(max_tokens=130, num_slots=6, device="cpu")
    for t, seed in [(130, 4), (17, 5), (3, 6)]:
        y, x, a, b, slots = make_case(t, 67, 16, 6, [16, 8, 8], torch.float32, seed=seed)
        meta.update(slots)
        check(y, x, a, b, slots, meta)
    # Slot counts/starts describe the grouping.
    assert int(meta.slot_count.sum()) == int((slots >= 0).sum())


def test_metadata_mismatch_raises():
    y, x, a, b, slots = make_case(3, 67, 8, 2, [8], torch.float32, seed=7)
    meta = build_lora_metadata(slots[:2], 2)
    with pytest.raises(ValueError):
        lora_ops.add_lora_linear(y, x, a, b, slots, meta)


@pytest.mark.parametrize("fuse_slices", [0, 1])
def test_large_split_k_path(monkeypatch, fuse_slices):
    # Force many K splits with a narrow K block (the decode configuration).
    def cfg(num_tokens, k, rank, num_slices):
        return {"BLOCK_M": 16, "BLOCK_K": 16, "SPLIT_K": 8, "num_warps": 4, "num_stages": 1,
                "FUSE_SLICES": fuse_slices}

    monkeypatch.setattr(lora_ops, "shrink_config", cfg)
    y, x, a, b, slots = make_case(19, 100, 16, 2, [16, 8, 8], torch.float32, seed=8)
    meta = build_lora_metadata(slots, 2)
    # Twice on one metadata object: the split-K arrival counters must reset.
    for _ in range(2):
        check(y, x, a, b, slots, meta)
        assert int(meta.locks.abs().sum()) == 0


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("t,s,widths", [(1, 2, [40, 8]), (21, 3, [40, 24, 9]), (70, 4, [16, 8])])
def test_shrink_of_all_slices_in_one_program_equals_one_each(monkeypatch, split_k, t, s, widths):
    # FUSE_SLICES: one program reads its x tile once for every slice's A (prefill
    # sizes). K = 67 leaves a ragged last K block.
    def cfg(fuse):
        return lambda *_: {"BLOCK_M": 16, "BLOCK_K": 16, "SPLIT_K": split_k, "num_warps": 4,
                           "num_stages": 1, "FUSE_SLICES": fuse}

    y, x, a, b, slots = make_case(t, 67, 8, s, widths, torch.float32, seed=t + 10 * split_k)
    meta = build_lora_metadata(slots, s)
    monkeypatch.setattr(lora_ops, "shrink_config", cfg(0))
    each = check(y, x, a, b, slots, meta)
    monkeypatch.setattr(lora_ops, "shrink_config", cfg(1))
    for _ in range(2):  # twice on one metadata object: the split-K counters must reset
        fused = check(y, x, a, b, slots, meta)
        assert torch.equal(fused, each)
        assert int(meta.locks.abs().sum()) == 0


def test_several_n_blocks_per_program_across_slices(monkeypatch):
    # 16-wide N blocks, 4 to a program: programs span slice boundaries and the last
    # one runs past the final block.
    def cfg(num_tokens, n_total, rank):
        return {"BLOCK_M": 16, "BLOCK_N": 16, "N_ITERS": 4, "num_warps": 4, "num_stages": 1}

    monkeypatch.setattr(lora_ops, "expand_config", cfg)
    y, x, a, b, slots = make_case(21, 67, 8, 3, [40, 24, 9], torch.float32, seed=9)
    check(y, x, a, b, slots)


@pytest.mark.parametrize("widths", [[16, 8, 8, 24], [16, 8, 8]])
@pytest.mark.parametrize("t", [1, 5, 64, 300])
def test_launch_configs_name_the_configs_a_call_launches(monkeypatch, t, widths):
    # Graph capture warms the LoRA ops once per launch_configs value: it must change
    # whenever the configs the call launches (or how: one launch or two) change.
    launched = []
    for name in ("launch_shrink", "launch_expand", "launch_one"):
        real = getattr(lora_ops, name)

        def record(*args, real=real, name=name, **kwargs):
            launched.append((name, [a for a in args if isinstance(a, dict)]))
            return real(*args, **kwargs)

        monkeypatch.setattr(lora_ops, name, record)
    y, x, a, b, slots = make_case(t, 67, 8, 2, widths, torch.float32, seed=t)
    lora_ops.add_lora_linear(y, x, a, b, slots)
    shrink, expand, one = lora_ops.launch_configs(t, 67, widths, 8)
    # Per slice group: (shrink config, expand config).
    groups = []
    for name, cfgs in launched:
        if name == "launch_expand":
            groups[-1].append(cfgs[0])
        else:
            groups.append(list(cfgs))
    assert [tuple(sorted(g[0].items())) for g in groups] == list(shrink)
    assert all(tuple(sorted(g[1].items())) == expand for g in groups)
    assert list(one) == [name == "launch_one" for name, _ in launched if name != "launch_expand"]


def test_workspace_numel_matches_call():
    y, x, a, b, slots = make_case(17, 300, 16, 4, [32, 8, 8], torch.float32, seed=9)
    need = lora_shrink.workspace_numel(17, 300, 16, 3)
    meta = build_lora_metadata(slots, 4, workspace_numel=need)
    ws = meta.workspace
    check(y, x, a, b, slots, meta)
    assert meta.workspace is ws  # big enough: no growth


def test_one_token():
    check(*make_case(1, 300, 16, 3, [64, 16, 16], torch.float32, seed=60))


def silu_and_mul_torch(gate_up):
    """silu(gate) * up, rounded as loraserve/kernels/activation.py rounds."""
    gate, up = gate_up.chunk(2, dim=-1)
    silu = torch.nn.functional.silu(gate.float()).to(gate.dtype)
    return (silu.float() * up.float()).to(gate.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,s,frac_none", [(1, 2, 0.0), (21, 3, 0.3), (70, 4, 0.5), (9, 2, 1.0)])
def test_silu_and_mul_lora_equals_expand_then_activation(monkeypatch, dtype, t, s, frac_none):
    # 16-wide blocks, 2 to a program, over a width of 40: the last program runs past
    # the final block; tiles of tokens without an adapter follow the slots' tiles.
    def cfg(num_tokens, width, rank):
        return {"BLOCK_M": 16, "BLOCK_N": 16, "N_ITERS": 2, "num_warps": 4, "num_stages": 1}

    monkeypatch.setattr(lora_activation, "silu_config", cfg)
    y, x, a, b, slots = make_case(t, 67, 8, s, [40, 40], dtype, seed=t + s, frac_none=frac_none)
    meta = build_lora_metadata(slots, s)
    gate_up = y.clone()
    got = lora_activation.silu_and_mul_lora(gate_up, x, a, b, meta)
    assert torch.equal(gate_up, y)  # the projection output is left as it was
    with_update = y.clone()
    lora_ops.add_lora_linear(with_update, x, a, b, slots, meta)
    want = activation.silu_and_mul(with_update)
    # The same update, rounded the same way, then the same activation kernel.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if dtype == torch.float32:
        # And against plain torch (reference above). (In bf16 the interpreter rounds
        # by truncation, which the line above matches and torch does not.)
        torch.testing.assert_close(got, silu_and_mul_torch(reference(y, x, a, b, slots)))
    none = slots < 0
    assert torch.equal(got[none], activation.silu_and_mul(y)[none])


def test_silu_and_mul_lora_rejects_other_layers():
    y, x, a, b, slots = make_case(5, 67, 8, 2, [40, 24], torch.float32, seed=3)
    with pytest.raises(ValueError, match="two slices"):
        lora_activation.silu_and_mul_lora(y, x, a, b, build_lora_metadata(slots, 2))


@pytest.mark.parametrize("t", [1, 64, 300])
def test_launch_configs_name_the_fused_activation_configs(monkeypatch, t):
    launched = []
    for module, name in ((lora_shrink, "launch_shrink"), (lora_activation, "launch_silu_and_mul")):
        real = getattr(module, name)

        def record(*args, real=real, **kwargs):
            launched.append(next(a for a in args if isinstance(a, dict)))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, record)
    y, x, a, b, slots = make_case(t, 67, 8, 2, [24, 24], torch.float32, seed=t)
    lora_activation.silu_and_mul_lora(y, x, a, b, build_lora_metadata(slots, 2))
    shrink, _, _, silu = lora_ops.launch_configs(t, 67, [24, 24], 8)
    assert [tuple(sorted(launched[0].items()))] == list(shrink)
    assert tuple(sorted(launched[1].items())) == silu


@pytest.mark.parametrize("split_k,fuse_slices", [(1, 0), (4, 0), (4, 1)])
@pytest.mark.parametrize("t,s,widths", [(1, 2, [40]), (21, 3, [40, 24, 9]), (70, 4, [16, 8, 8])])
def test_one_launch_equals_two(monkeypatch, split_k, fuse_slices, t, s, widths):
    # Shrink and expand in one grid, expand programs waiting on their tile's flag:
    # the same result as two launches, and the flags back at 0 for the next call.
    def scfg(num_tokens, k, rank, num_slices):
        return {"BLOCK_M": 16, "BLOCK_K": 16, "SPLIT_K": split_k, "num_warps": 4,
                "num_stages": 1, "FUSE_SLICES": fuse_slices}

    def ecfg(num_tokens, n_total, rank):
        return {"BLOCK_M": 16, "BLOCK_N": 16, "N_ITERS": 2, "num_warps": 4, "num_stages": 1}

    monkeypatch.setattr(lora_ops, "shrink_config", scfg)
    monkeypatch.setattr(lora_ops, "expand_config", ecfg)
    y, x, a, b, slots = make_case(t, 67, 8, s, widths, torch.float32, seed=t + split_k)
    meta = build_lora_metadata(slots, s)
    monkeypatch.setattr(lora_ops, "ONE_LAUNCH_TOKENS", (10**6, 10**6))
    two = y.clone()
    lora_ops.add_lora_linear(two, x, a, b, slots, meta)
    monkeypatch.setattr(lora_ops, "ONE_LAUNCH_TOKENS", (1, 10**6))
    launched = []
    real = lora_ops.launch_one
    monkeypatch.setattr(lora_ops, "launch_one", lambda *a, **k: launched.append(1) or real(*a, **k))
    for _ in range(2):  # twice on one metadata object: the flags must reset
        one = check(y, x, a, b, slots, meta)
        assert torch.equal(one, two)
        assert int(meta.tile_flags.abs().sum()) == 0 and int(meta.locks.abs().sum()) == 0
    assert launched
