"""Token masks as the sampler takes them: packed bitmasks (bit j of word w allows
token 32 * w + j, xgrammar's layout), applied to the logits of the rows that have one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenMask:
    """One row's mask: row `row` of `table`, an int32 [rows, ceil(vocab / 32)] tensor
    on the host that holds the masks of one step."""

    table: torch.Tensor
    row: int


def apply_token_masks(logits: torch.Tensor, masks: list[TokenMask | None]) -> None:
    """Set the logits of every token a row's mask forbids to -inf, in place. Rows
    without a mask are not touched (nor copied)."""
    rows = [i for i, mask in enumerate(masks) if mask is not None]
    if not rows:
        return
    import xgrammar as xgr

    chosen = [masks[i] for i in rows]
    table = chosen[0].table
    if any(m.table is not table for m in chosen) or [m.row for m in chosen] != list(
            range(table.shape[0])):
        # Not one step's table in row order: gather the rows.
        table = torch.stack([m.table[m.row] for m in chosen])
    table = table.to(logits.device, non_blocking=True)
    vocab = logits.shape[-1]
    if len(rows) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, table, vocab_size=vocab)
        return
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    masked = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(masked, table, vocab_size=vocab)
    logits.index_copy_(0, index, masked)
