"""The trainer's linear layers through oneDNN on the CPU (issue #49): the same values and gradients as
``F.linear`` to fp32 rounding, the same parameters, and ``F.linear`` wherever oneDNN's fp32 path does not apply."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from offpolicy.speed import cpu_linear
from offpolicy.speed.cpu_linear import OneDNNLinear, OneDNNLinearFunction, use_onednn_linear

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch has no oneDNN linear")


@pytest.fixture
def tiny_qwen2():
    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    return build_tiny_qwen2(build_char_tokenizer(), hidden_size=32, num_layers=2, intermediate_size=64, seed=3)


def reference(x, weight, bias):
    """``F.linear`` in float64, and its gradients for the loss Σ y ⊙ c."""
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    y = F.linear(x64, w64, b64)
    return y, x64, w64, b64


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 7, 24), (9, 24)])
def test_values_and_gradients_are_f_linear_s(bias, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)
    b = torch.randn(16, requires_grad=True) if bias else None
    c = torch.randn(*shape[:-1], 16)
    y = OneDNNLinearFunction.apply(x, w, b)
    (y * c).sum().backward()
    y64, x64, w64, b64 = reference(x, w, b)
    (y64 * c.double()).sum().backward()
    assert y.dtype == torch.float32 and y.shape == y64.shape
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)


def test_only_the_gradients_asked_for_and_strided_inputs():
    torch.manual_seed(1)
    x = torch.randn(24, 6).t()  # [6, 24], not contiguous
    frozen = torch.randn(16, 24)  # a frozen weight: no gradient computed for it
    x.requires_grad_()
    y = OneDNNLinearFunction.apply(x, frozen, None)
    y.sum().backward()
    torch.testing.assert_close(y, F.linear(x, frozen), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, torch.ones(6, 16) @ frozen, rtol=1e-5, atol=1e-5)
    assert frozen.grad is None


def test_outside_onednn_s_fp32_path_the_layer_is_f_linear(monkeypatch):
    layer = torch.nn.Linear(8, 4)
    layer.__class__ = OneDNNLinear
    used = []
    monkeypatch.setattr(OneDNNLinearFunction, "apply", lambda *a: used.append(a) or F.linear(*a))
    layer(torch.randn(3, 8))
    assert len(used) == 1
    layer(torch.randn(0, 8))  # no rows
    wide = torch.nn.Linear(8, 4).double()
    wide.__class__ = OneDNNLinear
    torch.testing.assert_close(wide(torch.ones(2, 8, dtype=torch.float64)), F.linear(torch.ones(2, 8).double(),
                                                                                     wide.weight, wide.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(3, 8)).dtype == torch.bfloat16  # autocast's own F.linear
    assert len(used) == 1


def test_a_model_s_linear_layers_become_onednn_ones_with_the_same_outputs(tiny_qwen2):
    model = tiny_qwen2.train()
    ids = torch.randint(3, 40, (4, 12))
    before = model(ids).logits
    keys = list(model.state_dict())
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    note = use_onednn_linear(model, "auto", torch.device("cpu"), "fp32")
    assert note.startswith(f"oneDNN ({len(linears)} layers; trainer.cpu_linear=auto; torch ") and note.endswith(": checked)")
    assert linears
    assert all(type(m) is OneDNNLinear for m in linears) and list(model.state_dict()) == keys
    after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    after.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    twin = copy.deepcopy(model)  # a copy computes with its own weights (the class, not a bound method, is swapped)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert not torch.equal(twin(ids).logits, model(ids).logits)


def test_where_onednn_s_linear_is_not_used(tiny_qwen2, monkeypatch):
    model = tiny_qwen2
    cpu = torch.device("cpu")
    assert use_onednn_linear(model, "torch", cpu, "fp32") == "torch's F.linear (set in the config)"
    assert "bf16" in use_onednn_linear(model, "auto", cpu, "bf16")
    assert "cuda" in use_onednn_linear(model, "onednn", torch.device("cuda"), "fp32")
    assert not any(type(m) is OneDNNLinear for m in model.modules())
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    assert use_onednn_linear(model, "auto", cpu, "fp32") == "torch's F.linear (this torch has no oneDNN linear)"
    with pytest.raises(ValueError, match=r"trainer.cpu_linear=onednn: this torch has no oneDNN linear.*Fix: trainer.cpu_linear=auto"):
        use_onednn_linear(model, "onednn", cpu, "fp32")


def test_without_a_gradient_few_rows_take_f_linear_but_a_vocabulary_wide_head_takes_onednn(monkeypatch):
    """A decode step's rows (fewer than ``ONEDNN_MIN_ROWS``) go through ``F.linear`` for the decoder's layers, where
    oneDNN is no faster, but through oneDNN for a layer as wide as a vocabulary (``ONEDNN_WIDE_OUT``), whose
    weight streaming oneDNN does faster at any row count; the same values either way."""
    calls = []
    real = cpu_linear._gemm
    monkeypatch.setattr(cpu_linear, "_gemm", lambda *a: calls.append(a[1].shape) or real(*a))
    narrow, wide = torch.nn.Linear(16, 64), torch.nn.Linear(16, cpu_linear.ONEDNN_WIDE_OUT, bias=False)
    for layer in (narrow, wide):
        layer.__class__ = OneDNNLinear
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(narrow(x), F.linear(x, narrow.weight, narrow.bias), rtol=1e-5, atol=1e-5)
        assert calls == []
        torch.testing.assert_close(wide(x), F.linear(x, wide.weight), rtol=1e-5, atol=1e-5)
        assert calls == [wide.weight.shape]
        narrow(torch.randn(cpu_linear.ONEDNN_MIN_ROWS, 16))
    assert len(calls) == 2


def test_the_functional_linear_routes_like_the_layer(monkeypatch):
    """``cpu_linear.linear`` (the trainer's head's GEMMs): oneDNN for fp32 CPU inputs, a transposed weight view
    included (the head's d_lin · W), and ``F.linear`` under autocast or in another dtype."""
    calls = []
    real = cpu_linear._gemm
    monkeypatch.setattr(cpu_linear, "_gemm", lambda *a: calls.append(1) or real(*a))
    x, w, d = torch.randn(5, 24), torch.randn(40, 24), torch.randn(5, 40)
    torch.testing.assert_close(cpu_linear.linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_linear.linear(d, w.t()), d @ w, rtol=1e-5, atol=1e-5)
    strided = torch.randn(80)[::2]  # oneDNN reads a bias as contiguous: a strided one is made so first
    torch.testing.assert_close(cpu_linear.linear(x, w, strided), F.linear(x, w, strided), rtol=1e-5, atol=1e-5)
    assert len(calls) == 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_linear.linear(x, w).dtype == torch.bfloat16
    assert cpu_linear.linear(x.double(), w.double()).dtype == torch.float64
    assert len(calls) == 3


def test_the_head_goes_through_onednn_where_the_model_s_layers_do(tiny_qwen2):
    """``linear_head`` marks a vocabulary-wide ``OneDNNLinear`` head (the embedded model's 64-token head stays on
    torch's GEMM, faster there), and the trainer's log-probs and gradients through oneDNN's head GEMMs equal
    ``F.linear``'s to fp32 rounding (the same model, its layers not swapped)."""
    from test_head import SAMPLINGS, ragged_batch, tiny_causal_lm, trainer_logprobs, value_and_grads

    from offpolicy.policy.head import linear_head

    cpu = torch.device("cpu")
    use_onednn_linear(tiny_qwen2, "auto", cpu, "fp32")
    assert type(tiny_qwen2.lm_head) is OneDNNLinear and not linear_head(tiny_qwen2).onednn
    plain = tiny_causal_lm("qwen2", cpu_linear.ONEDNN_WIDE_OUT, hidden=32).train()
    fast = copy.deepcopy(plain)
    assert not linear_head(plain).onednn
    use_onednn_linear(fast, "auto", cpu, "fp32")
    assert linear_head(fast).onednn
    batch = ragged_batch(plain, plain.config.vocab_size)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))
    for name in ("plain", "all"):
        want, want_grads = value_and_grads(lambda: trainer_logprobs(plain, batch, SAMPLINGS[name]), plain, batch,
                                           weights)
        got, grads = value_and_grads(lambda: trainer_logprobs(fast, batch, SAMPLINGS[name]), fast, batch, weights)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * (float(b.abs().max()) + 1e-30))
