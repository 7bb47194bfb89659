"""An approximate proximal policy π_old without its forward pass (AReaL ``prox_logp_method:
loglinear``, areal/trainer/ppo/actor.py ``compute_prox_logp_approximations``, 1.0.4).

Decoupled PPO needs log π_old (AReaL: π_prox), the trainer's log-probs with the weights at the
start of the update — one extra forward over the batch. Under staleness the weights that sampled
a token (version v_μ), the proximal weights (v_prox = v_θ − 1) and the weights being trained
(v_θ) are ordered in time, and AReaL interpolates log π linearly in the version:

    α_t        = clamp((v_prox − v_μ,t) / (v_θ − v_μ,t), 0, 1)     (α = 0 where v_θ ≤ v_μ,t
                                                                    or v_μ,t < 0: not generated)
    log π_old  = log μ + α · (sg(log π_θ) − log μ)

so a batch one version behind (v_μ = v_prox) gets π_old = μ, and older ones lean towards π_θ.
Use the result as ``old_logprobs`` of ``policy_loss`` with ``correction.anchor: old``; it is
detached and fp32. A non-finite input gives a non-finite π_old on that token, which ``correct``'s
``nonfinite`` policy then handles (never silently).
"""

from __future__ import annotations

import torch


def loglinear_alpha(versions: torch.Tensor, current_version: int | float) -> torch.Tensor:
    """α = clamp((v_θ − 1 − v_μ) / (v_θ − v_μ), 0, 1), 0 where v_θ − v_μ ≤ 0 or v_μ < 0; fp32,
    on ``versions``' device, same shape."""
    v_mu = versions.to(torch.float32)
    gap = float(current_version) - v_mu  # v_θ − v_μ
    generated = versions >= 0
    safe_gap = torch.where(gap > 0, gap, torch.ones((), dtype=gap.dtype, device=gap.device))
    alpha = torch.where((gap > 0) & generated, (gap - 1.0) / safe_gap, torch.zeros((), dtype=gap.dtype, device=gap.device))
    return alpha.clamp(0.0, 1.0)


def loglinear_proximal(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    versions: torch.Tensor | int,
    current_version: int,
) -> torch.Tensor:
    """log π_old ≈ log μ + α (sg(log π_θ) − log μ) (module docstring), detached fp32 ``[B, T]``.

    Args:
        logprobs:         [B, T] log π_θ of this forward (detached here).
        rollout_logprobs: [B, T] log μ from the engine.
        versions:         policy version that generated each token: an int (the whole batch),
                          [B] (per row) or [B, T] (per token, e.g. partial rollouts spanning a
                          weight update); negative = not generated (α = 0).
        current_version:  v_θ, the version this update produces; the proximal weights are v_θ − 1.

    Raises:
        ValueError: shapes that do not match.
    """
    if logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and rollout_logprobs {tuple(rollout_logprobs.shape)} must match")
    v = torch.as_tensor(versions, device=logprobs.device)
    if v.dim() == 1:
        if v.shape[0] != logprobs.shape[0]:
            raise ValueError(f"versions has {v.shape[0]} rows but logprobs has {logprobs.shape[0]}")
        v = v.unsqueeze(-1)
    elif v.dim() > 2 or (v.dim() == 2 and v.shape != logprobs.shape):
        # [B, T, 1] would broadcast into expand's RuntimeError; say which shapes are meant instead
        raise ValueError(f"versions {tuple(v.shape)} must be a scalar, [B] or {tuple(logprobs.shape)}")
    alpha = loglinear_alpha(v, current_version).expand(logprobs.shape)
    mu = rollout_logprobs.detach().float()
    theta = logprobs.detach().float()
    # α = 0 keeps μ exactly (no 0·(−inf) = NaN from a bad π_θ where it is not used)
    return torch.where(alpha > 0, mu + alpha * (theta - mu), mu)
