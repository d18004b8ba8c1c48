"""The fused RMSNorm, rotary and SiLU-and-multiply kernels against the model's
torch code (CPU, under TRITON_INTERPRET=1; on a GPU the same tests run compiled)."""

import pytest
import torch

# On a CPU box conftest.py has put Triton in interpreter mode before any import.
pytest.importorskip("triton")

from transformers import LlamaConfig  # noqa: E402

from loraserve import envs  # noqa: E402
from loraserve.kernels import activation  # noqa: E402
from loraserve.kernels import fused_norm_rope as fused  # noqa: E402
from loraserve.model.llama import RMSNorm  # noqa: E402
from loraserve.model.rope import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(7, hidden, generator=gen).to(dtype).to(DEVICE)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    norm = norm.to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

    # The model's norm, built with the default (torch) ops.
    want = norm(x)
    torch.testing.assert_close(fused.rms_norm(x, norm.weight, 1e-5), want, **tol)

    summed = x + residual
    want = norm(summed)
    res = residual.clone()
    got = fused.rms_norm(x, norm.weight, 1e-5, residual=res)
    # The residual now holds the rounded sum. Triton's CPU interpreter rounds bf16
    # by truncation, so only compiled kernels are held to bit equality there.
    if dtype == torch.bfloat16 and envs.triton_interpret():
        torch.testing.assert_close(res, summed, **tol)
    else:
        assert torch.equal(res, summed)
    torch.testing.assert_close(got, want, **tol)


def rope_inputs(dtype, heads, kv_heads, head_dim, seed):
    """A rotary table for 64 positions, and q, k, v [5, heads, D] as strided views
    of one QKV buffer, with their positions."""
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim)
    rope = RotaryEmbedding(config, 64).to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = (t.view(5, -1, head_dim) for t in qkv.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    return rope, q, k, v, torch.tensor([0, 3, 17, 40, 63], device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 1, 24)])
def test_rotary_matches_torch(dtype, heads, kv_heads, head_dim):
    rope, q, k, _, positions = rope_inputs(dtype, heads, kv_heads, head_dim, seed=head_dim)
    want_q, want_k = rope(positions, q, k)
    q2, k2 = q.clone(), k.clone()
    fused.rotary_embedding_(q2, k2, positions, rope.cos, rope.sin)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q2, want_q, **tol)
    torch.testing.assert_close(k2, want_k, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 1, 24)])
def test_rotary_that_writes_the_kv_cache(dtype, heads, kv_heads, head_dim):
    # The same rotation, and k and v (strided views of one QKV buffer) stored at
    # their slots of a paged cache of 4-token blocks; slot -1 (padding) stores nothing.
    rope, q, k, v, positions = rope_inputs(dtype, heads, kv_heads, head_dim, seed=head_dim + 1)
    slots = torch.tensor([9, -1, 0, 22, 5], device=DEVICE)
    cache = torch.zeros(2, 6, 4, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    q_plain, k_plain = q.clone(), k.clone()
    fused.rotary_embedding_(q_plain, k_plain, positions, rope.cos, rope.sin)
    fused.rotary_embedding_(q, k, positions, rope.cos, rope.sin, (v, cache, slots))
    assert torch.equal(q, q_plain) and torch.equal(k, k_plain)
    want = torch.zeros_like(cache)
    real = slots >= 0
    want[0].view(-1, kv_heads, head_dim)[slots[real]] = k_plain[real]
    want[1].view(-1, kv_heads, head_dim)[slots[real]] = v[real]
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 1500])
def test_silu_and_mul_matches_torch(dtype, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(5, 2 * width, generator=gen) * 3).to(dtype).to(DEVICE)
    gate, up = gate_up.split(width, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = activation.silu_and_mul(gate_up)
    # bf16: the CPU interpreter rounds by truncation, up to two ulps off here.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
