"""What the LoRA kernels share: the token tile -> adapter slot lookup, the
checks of a call's operands, and the dot precision per dtype.

Every LoRA kernel walks tokens in tiles of up to BLOCK_M that share one adapter
slot (``LoRAMetadata`` sorts a step's tokens by slot once), so each tile reads
its adapter's weights once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loraserve import envs

from .lora_config import next_pow2
from .lora_meta import LoRAMetadata

# Slices handled by one launch (pair); more slices use more launches.
MAX_SLICES_PER_LAUNCH = 3
# Triton compiles a variant per value class (1, multiple of 16, other) of each int
# argument it specializes. Batch-size ints vary across CUDA graph sizes: leaving
# them unspecialized keeps graph capture at one compile per launch config.
BATCH_INTS = ["num_tokens", "num_slots"]


@triton.jit
def slot_tile(
    pid_m,
    slot_start_ptr,
    slot_count_ptr,
    num_slots,
    num_tokens,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WITH_REST: tl.constexpr,
):
    """Map a token-tile index to (slot, first sorted position, rows left).

    Tiles are numbered slot by slot; every slot with c tokens owns cdiv(c, BLOCK_M)
    tiles. A program whose index is past the last tile gets slot == num_slots;
    with WITH_REST the tokens without an adapter (sorted last) own the tiles
    after those, as slot num_slots, and rows_left <= 0 marks the spare programs.
    """
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_slots
    cnt = tl.load(slot_count_ptr + offs_s, mask=smask, other=0)
    start = tl.load(slot_start_ptr + offs_s, mask=smask, other=0)
    ntiles = (cnt + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(ntiles, axis=0)
    slot = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    sel = offs_s == slot
    row0 = (pid_m - tl.sum(tl.where(sel, cum - ntiles, 0), axis=0)) * BLOCK_M
    rows_left = tl.sum(tl.where(sel, cnt, 0), axis=0) - row0
    pos0 = tl.sum(tl.where(sel, start, 0), axis=0) + row0
    if WITH_REST:
        if slot >= num_slots:
            row0 = (pid_m - tl.sum(ntiles, axis=0)) * BLOCK_M
            pos0 = tl.sum(cnt, axis=0) + row0
            rows_left = num_tokens - pos0
    return slot, pos0, rows_left


@triton.jit
def pick(i, v0, v1, v2):
    # Runtime choice among up to three per-slice values (pointers or ints).
    v = v0
    if i == 1:
        v = v1
    if i == 2:
        v = v2
    return v


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_token_tiles(num_tokens: int, block_m: int, num_groups: int) -> int:
    """Upper bound on the token tiles of a batch whose tokens fall in num_groups
    groups: each group adds at most one partial tile, and a tile holds at least
    one token. Programs past the real count exit at once."""
    return min(cdiv(num_tokens, block_m) + num_groups, num_tokens)


def block_s(num_slots: int) -> int:
    """Width of the slot vector a program scans to find its tile's slot."""
    return max(16, next_pow2(num_slots))


def dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast to fp32 before the dot, input precision) for operands of ``dtype``."""
    # Triton's CPU interpreter computes bf16 dots wrongly (seen with triton 3.9);
    # upcasting there is exact (bf16 products fit fp32). On a GPU: native dots,
    # and fp32 stays fp32 (no tf32 rounding) since fp32 LoRA is for exactness.
    if dtype == torch.bfloat16 and envs.triton_interpret():
        return True, "ieee"
    return False, ("ieee" if dtype == torch.float32 else "tf32")


def check_operands(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
) -> None:
    """Raise ValueError unless y, x, A and B fit ``add_lora_linear``'s contract."""
    if len(lora_a) != len(lora_b) or not lora_a:
        raise ValueError("lora_a and lora_b need one entry per output slice")
    if x.dim() != 2 or y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, K], [T, N]")
    a0 = lora_a[0]
    s, r, k = a0.shape
    if k != x.shape[1]:
        raise ValueError(f"lora_a K={k} != x K={x.shape[1]}")
    for a in lora_a:
        if a.shape != a0.shape or a.stride() != a0.stride():
            raise ValueError("all lora_a slices must share shape and strides")
    n_total = 0
    for b in lora_b:
        if b.dim() != 3 or b.shape[0] != s or b.shape[2] != r:
            raise ValueError(f"lora_b entry {tuple(b.shape)} does not match [S={s}, N, R={r}]")
        if b.stride()[1:] != lora_b[0].stride()[1:]:
            raise ValueError("all lora_b slices must share their N and R strides")
        n_total += b.shape[1]
    if n_total != y.shape[1]:
        raise ValueError(f"sum of slice widths {n_total} != y width {y.shape[1]}")
    for t in (*lora_a, *lora_b, y):
        if t.dtype != x.dtype:
            raise ValueError("x, y, lora_a and lora_b must share one dtype")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")


def check_meta(meta: LoRAMetadata, num_tokens: int, num_slots: int) -> None:
    if meta.num_tokens != num_tokens or meta.num_slots != num_slots:
        raise ValueError(
            f"metadata built for T={meta.num_tokens}, S={meta.num_slots}; "
            f"call has T={num_tokens}, S={num_slots}"
        )
