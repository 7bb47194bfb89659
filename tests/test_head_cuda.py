"""The head's CUDA-only path (issue #44 item 2): under bf16 autocast the weight gradient is accumulated by the
GEMM itself, ``torch.addmm(..., out_dtype=float32, out=d_weight)`` — bf16 operands, an fp32 accumulator and
an fp32 output written into the fp32 master gradient, with no [V, H] temporary. The CPU torch has no
``out_dtype`` GEMM, so the CPU suite runs the other branch; these run where CUDA is (scripts/device_check.sh).

* the accumulation is fp32: the product of the bf16 operands lands within fp32 rounding of the float64
  product of the same bf16 values (a bf16 accumulator would be ~1e-2 off), and it adds to what was there;
* the whole bf16 head backward on CUDA at a real vocabulary equals float64's within bf16's rounding;
* the trainer's packs (issue #57) score as the whole rows on CUDA, where SDPA takes their 4D mask.
"""

from __future__ import annotations

import pytest
import torch

from offpolicy.engines import SamplingConfig
from offpolicy.policy.head import LinearHead, _add_weight_grad, token_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA only: the head's out_dtype GEMM path, the packs on a GPU")


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
            lp = token_logprobs(hidden, tokens.to(device), LinearHead(weight, None, None), sampling, chunk=256).logprobs
        (lp * weights.to(device, lp.dtype)).sum().backward()
        assert weight.grad.dtype == dtype
        grads[precision] = (weight.grad.cpu().double(), hidden.grad.cpu().double())
    for got, want in zip(grads["bf16"], grads["fp64"]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize(("family", "precision"), [("qwen2", "fp32"), ("llama", "bf16"), ("qwen3", "fp32")])
def test_the_packs_on_cuda_score_as_the_whole_rows(family, precision):
    """Issue #57's packs on CUDA: the plan is made on the host and moved (``to_device``), the segments' 4D boolean
    mask is built on the GPU, and SDPA runs it through a CUDA kernel (the memory-efficient one takes an arbitrary
    mask). Against the same batch's whole rows on CUDA: the same −inf tokens; in fp32 the log-probs and gradients
    agree to fp32 rounding; under bf16 autocast the packed gradients are as close to the CPU float64 truth as the
    whole rows' are (≤ 1.5× their error), as on the CPU (tests/test_head.py)."""
    import copy

    from test_head import SAMPLINGS, grouped_batch, tiny_causal_lm, trainer_logprobs, value_and_grads

    from offpolicy.policy.batch import Batch, pack_layout
    from offpolicy.policy.head import shared_plan
    from offpolicy.policy.score import to_device
    from offpolicy.speed.shared_prompt import decision

    cuda = torch.device("cuda")
    model = tiny_causal_lm(family, 97, hidden=64).train().to(cuda)
    host = grouped_batch(97, groups=3, group_size=4, longest=12)
    batch = to_device(host, cuda, pack_layout(host))
    found = decision(model, "packed")
    if not found.fast and "is not a version this path was checked against" in found.reason:
        pytest.skip(f"the gate keeps the whole rows here: {found.reason}")  # the packs never run on this version
    plan = shared_plan(model, batch)
    assert plan is not None and plan.ids.device.type == "cuda" and plan.segments.device.type == "cuda"
    plain = Batch(*(getattr(batch, f) for f in ("input_ids", "attention_mask", "positions", "response_ids", "mask",
                                                   "rollout_logprobs", "versions")))
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2)).to(cuda)
    sampling = SAMPLINGS["top_p"]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        want, want_grads = value_and_grads(lambda: trainer_logprobs(model, plain, sampling), model, plain, weights)
        got, grads = value_and_grads(lambda: trainer_logprobs(model, batch, sampling), model, batch, weights)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert not torch.isnan(got).any() and all(torch.isfinite(g).all() for g in grads)
    if precision == "fp32":
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * (float(b.abs().max()) + 1e-30))
        return
    truth = copy.deepcopy(model).cpu().double()
    host_batch = to_device(host, torch.device("cpu"))
    host_plain = Batch(*(getattr(host_batch, f) for f in ("input_ids", "attention_mask", "positions", "response_ids",
                                                             "mask", "rollout_logprobs", "versions")))
    _, exact = value_and_grads(lambda: trainer_logprobs(truth, host_plain, sampling), truth, host_plain,
                               weights.cpu())
    for a, b, x in zip(grads, want_grads, exact):
        a, b = a.cpu().double(), b.cpu().double()
        assert float((a - x).norm()) <= 1.5 * float((b - x).norm()) + 1e-6 * float(x.norm())
