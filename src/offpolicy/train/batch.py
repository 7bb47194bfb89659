"""From engine rollouts to the ``[B, T]`` tensors the loss reads.

Rows are prompt + response, right-padded; response-aligned tensors are ``[B, T]`` with
T = the longest response. The trainer's log-probs of these tokens, on the same support the engine
sampled from (temperature, top-k, top-p — docs/specification.md §6), come from ``offpolicy.train.head``
(``trainer_logprobs``, re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offpolicy.engines import Rollouts
from offpolicy.kept_set import KeptIds
from offpolicy.train.head import token_entropy, trainer_logprobs

__all__ = ["Batch", "grpo_advantages", "to_batch", "token_entropy", "trainer_logprobs"]


TENSORS = ("input_ids", "attention_mask", "positions", "response_ids", "mask", "rollout_logprobs", "versions")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, T] index in L of the logits that predict response token t
    response_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1 on response tokens (EOS included)
    rollout_logprobs: torch.Tensor  # [B, T] log μ(y_t) from the engine
    versions: torch.Tensor  # [B] policy version that sampled each row
    # (mask, rows, cols): the positions where ``mask`` is 1, worked out on the host before the batch went
    # to the device (``update.to_device``), valid while ``mask`` is that very tensor (``head.counted_positions``)
    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    # [B, T] the engine's kept set of each response token (``offpolicy.kept_set``), replayed by the trainer's
    # head; None: the engine recorded none and the trainer recomputes top-k/top-p on its own logits
    kept: KeptIds | None = field(default=None, repr=False, compare=False)

    def select(self, rows: torch.Tensor) -> Batch:
        return Batch(*(getattr(self, f)[rows] for f in TENSORS), kept=None if self.kept is None else self.kept[rows])


def to_batch(rollouts: Rollouts, pad_id: int) -> Batch:
    rows = len(rollouts)
    width = max(len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids))
    t_max = max(1, max(len(r) for r in rollouts.response_ids))
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    positions = torch.zeros((rows, t_max), dtype=torch.long)
    response = torch.full((rows, t_max), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, t_max))
    rollout_lp = torch.zeros((rows, t_max))
    for i, (prompt, resp, lps) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.logprobs)):
        seq = prompt + resp
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        n = len(resp)
        positions[i] = torch.arange(len(prompt) - 1, len(prompt) - 1 + t_max).clamp(max=width - 1)
        if n:
            response[i, :n] = torch.tensor(resp)
            mask[i, :n] = 1
            rollout_lp[i, :n] = torch.tensor(lps, dtype=torch.float32)
    versions = torch.full((rows,), rollouts.version, dtype=torch.long)
    kept = None if rollouts.kept is None else rollouts.kept.pad(t_max)
    return Batch(input_ids, attention, positions, response, mask, rollout_lp, versions, kept=kept)


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
    low = grouped.min(dim=1, keepdim=True).values
    high = grouped.max(dim=1, keepdim=True).values
    shifted = grouped - low  # exact; 0 everywhere in a group of equal rewards
    centred = shifted - shifted.mean(dim=1, keepdim=True)
    advantages = centred / (shifted.std(dim=1, keepdim=True) + eps)
    tol = TIE_ULPS * torch.finfo(rewards.dtype).eps * grouped.abs().max(dim=1, keepdim=True).values
    tied = (high - low) <= tol  # [G, 1]
    return torch.where(tied, torch.zeros_like(advantages), advantages).view(-1).to(rewards.dtype)
