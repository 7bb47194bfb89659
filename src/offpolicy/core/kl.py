"""Per-token KL to a reference policy (docs/specification.md §5), after Schulman's "Approximating KL divergence".

With x = log π − log π_ref (log-ratio clamped to ±20):

    k1 = x
    k2 = ½ x²
    k3 = exp(−x) + x − 1         (value clamped to [−10, 10], verl's "low_var_kl")

Gradients, for samples y ~ π (exact, see tests/test_kl.py):
    E_π[∇k2] = E_π[x ∇log π]            = ∇ KL(π ‖ π_ref)   — the reverse KL we want
    E_π[∇k3] = E_π[(1 − π_ref/π) ∇log π] = ∇ KL(π_ref ‖ π)   — the *forward* KL
    E_π[∇k1] = E_π[∇log π]              = 0                 — no signal at all

so k1 and k3 are good *values* (unbiased / low-variance estimates of KL(π ‖ π_ref)) but
k3-as-a-loss optimises the other direction. A trailing ``+`` returns the named estimator's
value with k2's gradient (straight-through): k2 − sg(k2) + sg(value).
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3", "k1+", "k2+", "k3+")
_LOG_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3+") -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimate, ``[B, T] → [B, T]`` fp32; gradient flows through ``logprobs``.

    Raises:
        ValueError: unknown ``kind`` or mismatched shapes.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl_penalty: unknown kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_penalty: logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ in shape"
        )
    x = (logprobs.float() - ref_logprobs.float().detach()).clamp(-_LOG_CLAMP, _LOG_CLAMP)  # [B, T]
    base = kind.rstrip("+")
    if base == "k1":
        value = x
    elif base == "k2":
        value = 0.5 * x * x
    else:
        value = (torch.expm1(-x) + x).clamp(-_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)  # expm1: no fp32 floor near π = π_ref
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * x * x
    return k2 - k2.detach() + value.detach()
