"""The greedy argmax kernel against torch's argmax (CPU, under TRITON_INTERPRET=1;
on a GPU the same tests run compiled)."""

import pytest
import torch

# On a CPU box conftest.py has put Triton in interpreter mode before any import.
pytest.importorskip("triton")

from loraserve.kernels import argmax as kernel  # noqa: E402
from loraserve.kernels.argmax import argmax_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(3, 9000), (5, 4096), (1, 100), (2, 300000)])
def test_argmax_rows_is_argmax_first_of_ties_included(dtype, rows, vocab):
    g = torch.Generator().manual_seed(vocab + rows)
    # Small integers: most rows hold their maximum more than once, in several lanes.
    tied = torch.randint(-6, 6, (rows, vocab), generator=g).to(dtype).to(DEVICE)
    spread = torch.randn(rows, vocab, generator=g).to(dtype).to(DEVICE)
    # The maximum only in the last, partial stride; and a row all -inf (masked).
    late = spread.clone()
    late[:, -1] = 100.0
    late[0] = float("-inf")
    for logits in (tied, spread, late):
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    # Into a given buffer (a decode graph's row of sampled ids).
    buffer = torch.zeros(rows + 2, dtype=torch.long, device=DEVICE)
    argmax_rows(spread, out=buffer[1 : rows + 1])
    assert torch.equal(buffer[1 : rows + 1], spread.argmax(dim=-1))
    assert not buffer[0] and not buffer[-1]
    # Rows of a wider buffer (a strided view).
    wide = torch.randn(rows, vocab + 8, generator=g).to(dtype).to(DEVICE)
    assert torch.equal(argmax_rows(wide[:, :vocab]), wide[:, :vocab].argmax(dim=-1))
    # Rows cut into chunks put their counters back.
    assert int(kernel.counter_buffer("argmax", torch.device(DEVICE), 1).abs().sum()) == 0
