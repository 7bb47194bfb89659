"""From engine rollouts to the ``[B, T]`` tensors the loss reads.

Rows are prompt + response, right-padded; response-aligned tensors are ``[B, T]`` with
T = the longest response. The trainer's log-probs of these tokens, on the same support the engine
sampled from (temperature, top-k, top-p — docs/specification.md §6), come from ``offpolicy.policy.head``
(``trainer_logprobs``) through ``offpolicy.policy.score``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from offpolicy.engines import Rollouts
from offpolicy.kept_set import FlatKept, KeptIds

__all__ = ["Batch", "Counted", "TENSORS", "to_batch"]


TENSORS = ("input_ids", "attention_mask", "positions", "response_ids", "mask", "rollout_logprobs", "versions")


class Counted(NamedTuple):
    """What the host works out for a micro-batch's forward before it goes to the device (``score.to_device``):
    the positions (``rows``, ``cols``, ``[N]`` each, on the device) where ``mask`` is 1 and, when the batch
    carries ``kept``, those positions' kept sets expanded (``FlatKept``, on the device, its bounds on the
    host). The head uses them while ``mask`` and ``kept`` are the batch's (``head.counted_positions``)."""

    mask: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    kept: KeptIds | None = None
    flat: FlatKept | None = None


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, T] index in L of the logits that predict response token t
    response_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1 on response tokens (EOS included)
    rollout_logprobs: torch.Tensor  # [B, T] log μ(y_t) from the engine
    versions: torch.Tensor  # [B] policy version that sampled each row
    # the positions where ``mask`` is 1 (and their kept sets), worked out on the host before the batch went
    # to the device (``score.to_device``), valid while ``mask`` and ``kept`` are those very objects
    counted: Counted | None = field(default=None, repr=False, compare=False)
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
