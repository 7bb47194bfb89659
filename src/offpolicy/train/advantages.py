"""GRPO's group-relative advantages of one step's rewards."""

from __future__ import annotations

import torch

TIE_ULPS = 4  # a group's spread up to this many units of roundoff of its largest |reward| counts as a tie


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i − mean_g r) / (std_g r + ε); ``[B] → [B]`` in ``rewards``' dtype, groups are consecutive rows.

    A group whose rewards are all equal has no signal: A = 0 exactly, whatever value they share. Taken
    naively, a float32 0.7 shared by 8 rows has a rounded mean, so every row got rounding / ε ≈ +0.06 —
    all one sign, a full-sized step under Adam, and the zero-advantage skip (``loop.py``) never fired.
    So, per group, in float64 after subtracting the group's minimum (the rewards are float32/64 values,
    so the shift is exact and a tied group becomes exactly 0 before any mean is taken):

        d_i = r_i − min_g r,     A_i = (d_i − mean_g d) / (std_g d + ε)
        A_i = 0 for the whole group if max_g r − min_g r ≤ 4 · u · max_g |r|

    with u the unit roundoff of ``rewards``' dtype (``finfo.eps``: 1.2e-7 float32, 2.2e-16 float64).
    The tolerance treats rewards equal up to a few roundings as equal: a partial-credit reward summed
    in another order (0.1 + 0.2 against 0.3) is the same reward, not a signal to amplify by 1/ε.
    Rewards further apart keep the usual formula (to float64 rounding).

    Raises:
        ValueError: a non-finite reward (it would reach every row's loss of its group).
    """
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards: {len(bad)} non-finite value(s) at rows {bad[:5]} (first: "
                         f"{rewards[bad[0]].item()}); the reward function must return a finite number")
    grouped = rewards.view(-1, group_size).double()  # [G, n]
    shifted = grouped - grouped.min(dim=1, keepdim=True).values  # exact; 0 everywhere in a group of equal rewards
    centred = shifted - shifted.mean(dim=1, keepdim=True)
    advantages = centred / (shifted.std(dim=1, keepdim=True) + eps)
    tied = tied_groups(rewards, group_size).unsqueeze(1)  # [G, 1]
    return torch.where(tied, torch.zeros_like(advantages), advantages).view(-1).to(rewards.dtype)


def tied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[G]`` bool: the groups whose rewards are all equal up to ``TIE_ULPS`` roundings,
    max_g r − min_g r ≤ 4 · u · max_g |r| (``grpo_advantages``' rule; their advantages are 0)."""
    grouped = rewards.view(-1, group_size).double()
    spread = grouped.amax(dim=1) - grouped.amin(dim=1)
    return spread <= TIE_ULPS * torch.finfo(rewards.dtype).eps * grouped.abs().amax(dim=1)
