"""GPU tests of the sampler's device paths."""

import pytest
import torch

from loraserve.model.triton_ops import TritonOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [128256, 32000, 50257])
def test_sampler_argmax_is_argmax_first_of_ties_included(dtype, vocab):
    g = torch.Generator(device="cuda").manual_seed(vocab)
    # Small integers: most rows hold their maximum more than once.
    tied = torch.randint(-40, 40, (32, vocab), device="cuda", generator=g).to(dtype)
    spread = torch.randn(32, vocab, device="cuda", generator=g).to(dtype)
    for logits in (tied, spread):
        assert torch.equal(TritonOps().argmax(logits), logits.argmax(dim=-1))
