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
    assert note.startswith(f"oneDNN ({len(linears)} layers; cpu_linear=auto; torch ") and note.endswith(": checked)")
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
    with pytest.raises(ValueError, match=r"cpu_linear=onednn: this torch has no oneDNN linear.*Fix: cpu_linear=auto"):
        use_onednn_linear(model, "onednn", cpu, "fp32")
