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
from offpolicy.speed.shared_prompt import SharedPrompts, plan

__all__ = ["Batch", "Counted", "SharedPrompts", "TENSORS", "shared_prompts", "to_batch"]


TENSORS = ("input_ids", "attention_mask", "positions", "response_ids", "mask", "rollout_logprobs", "versions")


def shared_prompts(batch: Batch) -> SharedPrompts | None:
    """The plan of a forward that computes each repeated prompt once (``SharedPrompts``), from a CPU
    ``batch``; None where it would save nothing (no prompt repeats). The one planner's
    (``offpolicy.speed.shared_prompt.plan``)."""
    # positions[:, 0] = len(prompt) − 1 (``to_batch``)
    return plan(batch.input_ids, batch.attention_mask, batch.positions[:, 0] + 1)


class Counted(NamedTuple):
    """What the host works out for a micro-batch's forward before it goes to the device (``score.to_device``):
    the positions (``rows``, ``cols``, ``[N]`` each, on the device) where ``mask`` is 1, when the batch
    carries ``kept`` those positions' kept sets expanded (``FlatKept``, on the device, its bounds on the
    host), and where prompts repeat the plan that computes each once (``shared``). The head uses them while
    ``mask``, ``kept`` and ``input_ids`` are the batch's (``head.counted_positions``)."""

    mask: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    kept: KeptIds | None = None
    flat: FlatKept | None = None
    shared: SharedPrompts | None = None  # the forward with each repeated prompt once, made on the host


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
    """The rollouts as right-padded ``[B, L]`` rows and ``[B, T]`` response tensors. Built from the
    flattened token lists in one masked write per tensor: a loop over the rows cost ~1.5 ms of the
    embedded default's step (64 rows; issue #49)."""
    prompts, responses = rollouts.prompt_ids, rollouts.response_ids
    rows = len(rollouts)
    prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    response_len = torch.tensor([len(r) for r in responses], dtype=torch.long)
    width = int((prompt_len + response_len).max())
    t_max = max(1, int(response_len.max()))
    # row-major, as boolean indexing fills: each row's prompt then its response
    attention = (torch.arange(width) < (prompt_len + response_len)[:, None]).long()
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    input_ids[attention.bool()] = torch.tensor([t for p, r in zip(prompts, responses) for t in (*p, *r)],
                                               dtype=torch.long)
    # the logits at index len(prompt) − 1 + t predict response token t
    positions = (prompt_len[:, None] - 1 + torch.arange(t_max)).clamp(max=width - 1)
    counted = torch.arange(t_max) < response_len[:, None]
    response = torch.full((rows, t_max), pad_id, dtype=torch.long)
    response[counted] = torch.tensor([t for r in responses for t in r], dtype=torch.long)
    mask = counted.float()
    rollout_lp = torch.zeros((rows, t_max))
    for i, (r, lps) in enumerate(zip(responses, rollouts.logprobs)):
        if lps is None or len(lps) != len(r):
            raise ValueError(f"rollout row {i}: {len(r)} response tokens but "
                             f"{'no' if lps is None else len(lps)} log-probs from the engine")
    rollout_lp[counted] = torch.tensor([x for lps in rollouts.logprobs for x in lps], dtype=torch.float32)
    versions = torch.full((rows,), rollouts.version, dtype=torch.long)
    kept = None if rollouts.kept is None else rollouts.kept.pad(t_max)
    return Batch(input_ids, attention, positions, response, mask, rollout_lp, versions, kept=kept)
