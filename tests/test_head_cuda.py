"""The head's CUDA-only path (issue #44 item 2): under bf16 autocast the weight gradient is accumulated by the
GEMM itself, ``torch.addmm(..., out_dtype=float32, out=d_weight)`` — bf16 operands, an fp32 accumulator and
an fp32 output written into the fp32 master gradient, with no [V, H] temporary. The CPU torch has no
``out_dtype`` GEMM, so the CPU suite runs the other branch; these run where CUDA is (scripts/device_check.sh).

* the accumulation is fp32: the product of the bf16 operands lands within fp32 rounding of the float64
  product of the same bf16 values (a bf16 accumulator would be ~1e-2 off), and it adds to what was there;
* the whole bf16 head backward on CUDA at a real vocabulary equals float64's within bf16's rounding.
"""

from __future__ import annotations

import pytest
import torch

from offpolicy.engines import SamplingConfig
from offpolicy.policy.head import LinearHead, _add_weight_grad, token_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the out_dtype GEMM path runs on CUDA only")


def test_the_weight_gradient_is_accumulated_in_fp32_by_the_gemm():
    g = torch.Generator().manual_seed(0)
    vocab, width, n = 4096, 256, 512
    d_lin = torch.randn(n, vocab, generator=g).to(torch.bfloat16)
    h = torch.randn(n, width, generator=g).to(torch.bfloat16)
    start = torch.randn(vocab, width, generator=g)
    want = start.double() + d_lin.double().t() @ h.double()
    d_weight = start.cuda()
    _add_weight_grad(d_weight, d_lin.cuda(), h.cuda())
    assert d_weight.dtype == torch.float32
    torch.testing.assert_close(d_weight.cpu().double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("vocab", [49_152, 151_936])
def test_the_bf16_head_backward_on_cuda_equals_float64(vocab):
    g = torch.Generator().manual_seed(1)
    width, n = 128, 700  # several chunks (chunk_tokens on CUDA: a 128 MiB budget)
    master = torch.randn(vocab, width, generator=g) / 4
    hidden0 = torch.randn(n, width, generator=g)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.randn(n, generator=g)
    sampling = SamplingConfig(temperature=0.8)
    grads = {}
    for precision, device in (("bf16", "cuda"), ("fp64", "cpu")):
        dtype = torch.float64 if precision == "fp64" else torch.float32
        weight = master.to(device, dtype, copy=True).requires_grad_(True)
        hidden = hidden0.to(device, dtype, copy=True).requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            lp, _, _ = token_logprobs(hidden, tokens.to(device), LinearHead(weight, None, None), sampling, chunk=256)
        (lp * weights.to(device, lp.dtype)).sum().backward()
        assert weight.grad.dtype == dtype
        grads[precision] = (weight.grad.cpu().double(), hidden.grad.cpu().double())
    for got, want in zip(grads["bf16"], grads["fp64"]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
