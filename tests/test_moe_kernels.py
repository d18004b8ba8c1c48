"""The MoE Triton kernels (grouped GEMM over experts, MoE LoRA) against the torch
path, in Triton's interpreter on a CPU (small shapes) and compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from loraserve.model.moe_ops import ExpertsLoRA, add_expert_lora, torch_moe_experts

# On a CPU box conftest.py has put Triton in interpreter mode before any import.
pytest.importorskip("triton")

from loraserve.kernels.moe_experts import fused_moe_experts  # noqa: E402
from loraserve.kernels.moe_gemm import align_rows  # noqa: E402
from loraserve.kernels.moe_lora import add_moe_lora, align_lora_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    probs = torch.randn(num_tokens, num_experts, generator=gen).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def _lora(num_tokens, num_slots, num_experts, rank, hidden, inter, dtype, gen, used_rank=None):
    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.2).to(DEVICE, dtype)

    lora = ExpertsLoRA(
        torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32).to(DEVICE),
        rand(num_slots, num_experts, rank, hidden), rand(num_slots, num_experts, 2 * inter, rank),
        rand(num_slots, num_experts, rank, inter), rand(num_slots, num_experts, hidden, rank),
    )
    if used_rank is not None:  # a smaller adapter, zero-padded in its slot
        for t in (lora.gate_up_a, lora.down_a):
            t[:, :, used_rank:] = 0
    return lora


@pytest.mark.parametrize("groups,block_m", [(1, 16), (5, 16), (12, 32)])
def test_align_rows_puts_each_row_once_in_its_group_block(groups, block_m):
    gen = torch.Generator().manual_seed(groups)
    group_of_row = torch.randint(-1, groups, (37,), generator=gen).to(DEVICE)
    aligned = align_rows(group_of_row, groups, block_m)
    rows = aligned.sorted_rows.view(-1, block_m).cpu()
    block_group = aligned.block_group.cpu()
    seen = []
    for block, g in zip(rows, block_group.tolist(), strict=True):
        real = block[block < 37].tolist()
        if g < 0:
            assert not real
            continue
        assert real and all(int(group_of_row[r]) == g for r in real)
        seen += real
    want = [r for r in range(37) if int(group_of_row[r]) >= 0]
    assert sorted(seen) == want


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("with_lora", [False, True])
def test_fused_moe_experts_match_torch(dtype, atol, with_lora):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k, slots = 9, 32, 48, 6, 2, 3
    x = (torch.randn(tokens, hidden, generator=gen)).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(DEVICE, dtype)
    weights, ids = _routing(tokens, experts, top_k, gen)
    lora = (_lora(tokens, slots, experts, 16, hidden, inter, dtype, gen, used_rank=5)
            if with_lora else None)
    want = torch_moe_experts(x.float(), w13.float(), w2.float(), weights, ids,
                             _as_fp32(lora))
    got = fused_moe_experts(x, w13, w2, weights.to(dtype), ids, lora)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)
    if with_lora:  # the adapters change the result: the test sees them
        base = torch_moe_experts(x.float(), w13.float(), w2.float(), weights, ids)
        assert (base - want).abs().max() > 10 * atol


def _as_fp32(lora: ExpertsLoRA | None) -> ExpertsLoRA | None:
    if lora is None:
        return None
    return ExpertsLoRA(lora.token_slots, lora.gate_up_a.float(), lora.gate_up_b.float(),
                       lora.down_a.float(), lora.down_b.float())


@pytest.mark.parametrize("top_k,rank", [(1, 16), (2, 8), (2, 1)])
def test_add_moe_lora_matches_torch(top_k, rank):
    """Slot widths below a dot's 16 (max_lora_rank 1 and 8) are masked, not read."""
    gen = torch.Generator().manual_seed(top_k)
    tokens, k, n, experts, slots = 11, 40, 24, 4, 2
    lora_a = (torch.randn(slots, experts, rank, k, generator=gen) * 0.2).to(DEVICE)
    lora_b = (torch.randn(slots, experts, n, rank, generator=gen) * 0.2).to(DEVICE)
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    _, ids = _routing(tokens, experts, top_k, gen)
    x = torch.randn(tokens, k, generator=gen).to(DEVICE)
    y = torch.randn(tokens * top_k, n, generator=gen).to(DEVICE)
    want = y.clone()
    rows_of = ids.flatten().cpu()
    row_slots = token_slots.repeat_interleave(top_k)
    for e in range(experts):
        rows = torch.nonzero(rows_of == e).flatten()
        part = want[rows.to(DEVICE)]
        add_expert_lora(part, x[(rows // top_k).to(DEVICE)], row_slots[rows].to(DEVICE),
                        lora_a, lora_b, e)
        want[rows.to(DEVICE)] = part
    aligned = align_lora_rows(token_slots.to(DEVICE), ids.flatten(), top_k, experts, slots)
    add_moe_lora(y, x, lora_a, lora_b, aligned, in_div=top_k)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_fused_moe_experts_on_gpu_match_torch(dtype, tokens):
    """Mixtral-like proportions (8 experts, top-2), compiled kernels. In fp32 the
    kernels equal the torch path. In bf16 both round their intermediates (the
    gate/up output, the activation, the down output) to bf16, each at its own
    points: the kernels must then be as close to the exact (fp32) result as torch's
    own bf16 path is, not closer than a fixed tolerance that the rounding alone can
    exceed at these magnitudes (outputs of about 10 with the adapters)."""
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, top_k, slots = 256, 512, 8, 2, 4
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.05).to(DEVICE, dtype)
    weights, ids = _routing(tokens, experts, top_k, gen)
    lora = _lora(tokens, slots, experts, 16, hidden, inter, dtype, gen, used_rank=8)
    exact = torch_moe_experts(x.float(), w13.float(), w2.float(), weights, ids,
                              _as_fp32(lora))
    got = fused_moe_experts(x, w13, w2, weights.to(dtype), ids, lora).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-4)
        return
    torch_bf16 = torch_moe_experts(x, w13, w2, weights.to(dtype), ids, lora).float()
    ours, theirs = (got - exact).abs(), (torch_bf16 - exact).abs()
    scale = exact.abs().mean()
    # Mean and worst error, each within twice torch's and a small floor.
    assert ours.mean() <= 2 * theirs.mean() + 1e-3 * scale, (ours.mean(), theirs.mean())
    assert ours.max() <= 2 * theirs.max() + 1e-2 * scale, (ours.max(), theirs.max())
