"""The trainer's linear layers on the CPU through oneDNN instead of torch's default GEMM.

On the CPU torch runs an fp32 ``F.linear`` through its BLAS (MKL in the PyPI wheels), which on the AMD
EPYC (Zen 5) of the benchmark box reaches about half of what oneDNN's JIT kernels reach on the same
matrices: 2–3.4× per call for the embedded model's shapes, and the model's forward + backward 153 → 77 ms
on one thread (docs/performance.md#the-embedded-defaults-step-issue-49). vLLM's CPU engine already samples
through oneDNN. Torch ships oneDNN's linear as ``torch.ops.mkldnn._linear_pointwise`` (inductor's CPU
linear), with no derivative, so ``OneDNNLinearFunction`` gives it one from the same op:

    y = x Wᵀ + b,   ∂L/∂x = g W,   ∂L/∂W = gᵀ x,   ∂L/∂b = Σ_rows g

Same math as ``F.linear``; only the order of the fp32 sums differs (the GEMM library's blocking), as between
any two BLAS builds. Inputs outside oneDNN's fp32 path (another dtype or device, autocast, no rows) go
through ``F.linear`` unchanged.

A private op, so gated (``offpolicy.speed.gates.ONEDNN_LINEAR``): on a torch that is not a version it was checked
against (exactly; a local build tag such as ``+cpu`` aside), the layers stay ``F.linear`` and the run's header says
why.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from offpolicy.speed.gates import ONEDNN_LINEAR, decide


# without a gradient, inputs of fewer rows than this go through F.linear (OneDNNLinear.forward), unless the layer has
# ONEDNN_WIDE_OUT outputs or more (a head, a wide MLP projection): a decode step streams its weight, and there oneDNN
# is ahead at any row count (SmolLM2's head [32, 576]·[576, 49,152] at one thread: 73 against 54 GFLOP/s; 4 rows: 20
# against 13; [32, 1536]·[1536, 8,960]: 23 against 34 ms)
ONEDNN_MIN_ROWS = 128
ONEDNN_WIDE_OUT = 8192


def onednn_available() -> bool:
    """Whether this torch has oneDNN's CPU linear (built with mkldnn, and its ``_linear_pointwise`` op)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x Wᵀ + b`` for a 2-D ``x`` [M, K] and ``weight`` [N, K] through oneDNN (no post-op)."""
    # the bias contiguous: oneDNN reads the strides of x and W, not of b (a strided b gave wrong sums)
    return torch.ops.mkldnn._linear_pointwise(x, weight, None if bias is None else bias.contiguous(), "none", [], "")


def _takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN's fp32 path takes ``x Wᵀ + b``: fp32 CPU tensors, some rows, no CPU autocast."""
    fp32 = torch.float32
    return (x.device.type == "cpu" and x.dtype == fp32 and weight.dtype == fp32 and x.numel() > 0
            and (bias is None or bias.dtype == fp32) and not torch.is_autocast_enabled("cpu"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of a 2-D ``x`` without autograd, through oneDNN where it takes the inputs
    (``weight`` may be a transposed view: oneDNN reads the strides). For the trainer's head, which writes its own
    backward and calls this only where the model's layers are ``OneDNNLinear`` (the gate passed, the config allows
    it)."""
    if _takes(x, weight, bias):
        return _gemm(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinearFunction(torch.autograd.Function):
    """``F.linear`` through oneDNN, forward and backward (formulas in the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1])
        return _gemm(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        # transposed views, not copies: oneDNN reads the strides (a .contiguous() copy of each cost ~10 ms of
        # the embedded model's step, and the results are the same to the bit)
        if ctx.needs_input_grad[0]:  # g W = g (Wᵀ)ᵀ: oneDNN's x Wᵀ with Wᵀ [K, N] as its weight
            grad_x = _gemm(g, weight.t(), None).reshape(x.shape)
        if ctx.needs_input_grad[1]:  # gᵀ x = gᵀ (xᵀ)ᵀ: [N, M] times [M, K]
            grad_w = _gemm(g.t(), x.reshape(-1, x.shape[-1]).t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose fp32 CPU calls go through ``OneDNNLinearFunction``; the same parameters,
    state dict and ``isinstance``. ``use_onednn_linear`` turns a model's layers into it in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _takes(x, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled():
            return OneDNNLinearFunction.apply(x, self.weight, self.bias)
        # no gradient (an engine's generate, a scoring forward): no autograd node, whose ~10 µs a call was a
        # tenth of a decode step; and few rows (a decode step's) through F.linear, where oneDNN's gain turns
        # into a loss (64 rows of the embedded model: 0.6–1.4× by shape, docs/performance.md), but for a wide
        # layer (ONEDNN_WIDE_OUT)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] < ONEDNN_MIN_ROWS and self.out_features < ONEDNN_WIDE_OUT:
            return F.linear(x, self.weight, self.bias)
        return _gemm(rows, self.weight, self.bias).reshape(*x.shape[:-1], self.weight.shape[0])


def use_onednn_linear(model: torch.nn.Module, mode: Literal["auto", "onednn", "torch"], device: torch.device,
                      dtype: str) -> str:
    """With ``mode`` auto or onednn, on a CPU trainer in fp32: every ``nn.Linear`` of ``model`` (exactly that
    class: subclasses keep their own forward) becomes a ``OneDNNLinear``, where this torch is one the path was
    checked against (``ONEDNN_LINEAR``). Returns what the linear layers run through and why, for the run's
    header.

    Raises:
        ValueError: ``trainer.cpu_linear=onednn`` where this torch has no oneDNN linear.
    """
    if mode == "torch":
        return "torch's F.linear (set in the config)"
    if device.type != "cpu" or dtype != "fp32":
        return f"torch's F.linear ({device.type}, {dtype}: oneDNN's linear here is for an fp32 CPU trainer)"
    if not onednn_available():
        if mode == "onednn":
            raise ValueError("trainer.cpu_linear=onednn: this torch has no oneDNN linear (torch.ops.mkldnn."
                             "_linear_pointwise; torch.backends.mkldnn.is_available() is False). Fix: "
                             "trainer.cpu_linear=auto or torch (diagnose: --trainer-cpu-linear)")
        return "torch's F.linear (this torch has no oneDNN linear)"
    gate = decide(ONEDNN_LINEAR)
    if not gate.fast:
        return f"{gate.reason} (trainer.cpu_linear={mode})"
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for layer in layers:
        layer.__class__ = OneDNNLinear
    return f"oneDNN ({len(layers)} layers; trainer.cpu_linear={mode}; {gate.checked}: checked)"
