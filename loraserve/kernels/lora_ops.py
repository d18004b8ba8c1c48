"""Fused multi-LoRA linear update for mixed adapters in one batch (Triton).

API
---
``add_lora_linear(y, x, lora_a, lora_b, token_slots, meta=None)`` adds, in place,

    y[t, slice_i] += (x[t] @ lora_a[i][s].T) @ lora_b[i][s].T    for s = token_slots[t] >= 0

* ``x``: [T, K]; ``y``: [T, sum N_i] (rows may be strided; any column stride);
* ``lora_a``: list of [S, R, K] (one per output slice, all the same shape and
  strides); ``lora_b``: list of [S, N_i, R]; slice i writes columns
  ``sum(N_0..N_{i-1}) .. + N_i`` of y. A lower-rank adapter is zero-padded.
* ``token_slots``: int [T], -1 = no adapter. Rows of such tokens are never
  read or written, so they stay bit-identical.
* fp16, bf16 or fp32 (x, y, A and B of one dtype). The scale is 1.0 (folded
  into B upstream).

How it runs: tokens are grouped by slot (``LoRAMetadata``, one sort per step),
then per group of up to 3 slices a shrink (``lora_shrink``: ``x_tile @ A[slot].T``
in fp32, split over K) and an expand (``lora_expand``: the shrink rounded once
to the weight dtype, times ``B[slot].T``, added to y in fp32). Each tile reads
its adapter's A/B once, so decode batches (one token per request) and prefill
batches share one code path; split-K gives decode enough programs to use the
whole GPU. At decode batch sizes (``ONE_LAUNCH_TOKENS``) the two run as one
launch instead (``lora_one_launch``), which saves the gap between two dependent
launches.

Launch configs come from ``lora_config`` (a tuned JSON per GPU in
``loraserve/kernels/configs/``, else heuristics).

CUDA graphs
-----------
The launch grids depend only on T, S and the shapes (host ints): at most
``cdiv(T, BLOCK_M) + S`` token tiles, of which programs past the real number of
tiles exit at once. The op allocates nothing when given a metadata object:

    meta = LoRAMetadata(max_tokens=T, num_slots=S, device="cuda")   # once
    meta.update(token_slots)                                         # every step
    add_lora_linear(y, x, lora_a, lora_b, token_slots, meta)         # every layer

``meta.update`` uses only static-shape torch ops (sort, searchsorted), so it
can run eagerly before ``graph.replay()`` or be captured in the graph itself.
Keep the same ``meta`` object (same buffers) for a captured graph; the op
reads T from ``x`` and checks it against the last ``update``. One ``meta`` per
stream: the workspace and split-K counters are reused by every call.
The fp32 workspace lives in ``meta`` and grows on the first (eager) call that
needs more; run one warm-up step over every layer shape before capturing (as
torch requires anyway), or pass ``workspace_numel`` (``lora_shrink.workspace_numel``)
when building the metadata. Growing it during capture raises.

Without ``meta`` the op builds one itself (allocates: eager use only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .lora_common import MAX_SLICES_PER_LAUNCH, check_meta, check_operands
from .lora_config import expand_config, shrink_config, silu_config
from .lora_expand import launch_expand
from .lora_meta import LoRAMetadata, build_lora_metadata
from .lora_one_launch import launch_one
from .lora_shrink import launch_shrink

# Token counts at which a call's shrink and expand share one launch (one_launch).
ONE_LAUNCH_TOKENS = (64, 256)


def one_launch(num_tokens: int, scfg: dict[str, int], ecfg: dict[str, int]) -> bool:
    """Whether a call runs as one launch: at decode batch sizes, where the gap
    between two launches is a good part of the op, and when both configs tile
    tokens alike."""
    return ONE_LAUNCH_TOKENS[0] <= num_tokens <= ONE_LAUNCH_TOKENS[1] and (
        scfg["BLOCK_M"] == ecfg["BLOCK_M"]
    )


def launch_configs(num_tokens: int, k: int, widths: Sequence[int], rank: int) -> tuple:
    """The launch configs of a call with these shapes, hashable. Calls that share them
    (and dtypes and strides) run the same compiled kernels: batch-size ints are not
    specialized."""
    step = MAX_SLICES_PER_LAUNCH
    ecfg = expand_config(num_tokens, sum(widths), rank)
    scfgs = [
        shrink_config(num_tokens, k, rank, len(widths[g : g + step]))
        for g in range(0, len(widths), step)
    ]
    shrink = tuple(tuple(sorted(c.items())) for c in scfgs)
    expand = tuple(sorted(ecfg.items()))
    # Per slice group: one launch, or shrink then expand.
    one = tuple(one_launch(num_tokens, c, ecfg) for c in scfgs)
    if len(widths) == 2 and widths[0] == widths[1]:
        # A gate/up pair: the model may run it through silu_and_mul_lora instead.
        silu = tuple(sorted(silu_config(num_tokens, widths[0], rank).items()))
        return shrink, expand, one, silu
    return shrink, expand, one


def prefers_one_launch(num_tokens: int, k: int, widths: Sequence[int], rank: int) -> bool:
    """Whether add_lora_linear runs a call of these shapes as one launch (then its
    shrink cannot run beside the base projection)."""
    if len(widths) > MAX_SLICES_PER_LAUNCH:
        return False
    scfg = shrink_config(num_tokens, k, rank, len(widths))
    return one_launch(num_tokens, scfg, expand_config(num_tokens, sum(widths), rank))


def add_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    token_slots: torch.Tensor,
    meta: LoRAMetadata | None = None,
) -> None:
    """In place: ``y[t, slice_i] += (x[t] @ lora_a[i][s].T) @ lora_b[i][s].T``, s = slot of t.

    ``meta`` (from ``build_lora_metadata`` / ``LoRAMetadata.update`` on the same
    ``token_slots``) makes the call allocation- and sync-free; when given,
    ``token_slots`` itself is not read again.
    """
    check_operands(y, x, lora_a, lora_b)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    num_slots, rank, _ = lora_a[0].shape
    if meta is None:
        meta = build_lora_metadata(token_slots, num_slots)
    check_meta(meta, num_tokens, num_slots)
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    # One expand config over all slices (as launch_configs names it).
    ecfg = expand_config(num_tokens, sum(widths), rank)
    step = MAX_SLICES_PER_LAUNCH
    for g in range(0, len(lora_a), step):
        a_grp, b_grp, o_grp = lora_a[g : g + step], lora_b[g : g + step], offsets[g : g + step]
        scfg = shrink_config(num_tokens, x.shape[1], rank, len(a_grp))
        if one_launch(num_tokens, scfg, ecfg):
            launch_one(y, x, a_grp, b_grp, o_grp, meta, scfg, ecfg)
        else:
            ws = launch_shrink(x, a_grp, meta, scfg)
            launch_expand(y, b_grp, o_grp, meta, ws, ecfg)
