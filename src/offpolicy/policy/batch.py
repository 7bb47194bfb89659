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
from offpolicy.core.centering import Support
from offpolicy.core.kept_set import FlatKept, KeptIds
from offpolicy.speed.shared_prompt import PackLayout, SharedPrompts, layout

__all__ = ["Batch", "Counted", "PackLayout", "SharedPrompts", "Support", "TENSORS", "pack_layout", "to_batch"]


TENSORS = ("input_ids", "attention_mask", "positions", "response_ids", "mask", "rollout_logprobs", "versions")


def pack_layout(batch: Batch, rows: torch.Tensor | None = None, budget: int | None = None) -> PackLayout | None:
    """The one pack plan of a step: which pack each of ``rows`` (default: all) of the CPU ``batch`` goes in, row i
    of the layout being ``rows[i]`` (``offpolicy.speed.shared_prompt.layout``; ``budget``: the micro-batches'
    tokens, which bound a long prompt's packs). Its micro-batches take whole packs of it (``PackLayout.take``,
    ``policy.score.micro_batches``); None where no prompt repeats."""
    rows = slice(None) if rows is None else rows
    # positions[:, 0] = len(prompt) − 1 (``to_batch``)
    return layout(batch.input_ids[rows], batch.attention_mask[rows], batch.positions[rows, 0] + 1, budget=budget)


class Counted(NamedTuple):
    """What the host works out for a micro-batch's forward before it goes to the device (``score.to_device``):
    the positions (``rows``, ``cols``, ``[N]`` each, on the device) where ``mask`` is 1, when the batch
    carries ``kept`` those positions' kept sets expanded (``FlatKept``, on the device, its bounds on the
    host), and where prompts repeat the packs that compute each once (``shared``: the step's, ``PackLayout.build``).
    The head uses them while ``mask``, ``kept`` and ``input_ids`` are the batch's (``head.counted_positions``)."""

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
    # [B, T] the engine's kept set of each response token (``offpolicy.core.kept_set``), replayed by the trainer's
    # head; None: the engine recorded none and the trainer recomputes top-k/top-p on its own logits
    kept: KeptIds | None = field(default=None, repr=False, compare=False)
    # score centering's support of each response token (``offpolicy.Support``: ids and log q, not yet scored); None
    # where centering is off
    support: Support | None = field(default=None, repr=False, compare=False)

    def select(self, rows: torch.Tensor) -> Batch:
        return Batch(*(getattr(self, f)[rows] for f in TENSORS), kept=None if self.kept is None else self.kept[rows],
                     support=None if self.support is None else self.support.select(rows))


def to_batch(rollouts: Rollouts, pad_id: int, support: str | None = None) -> Batch:
    """The rollouts as right-padded ``[B, L]`` rows and ``[B, T]`` response tensors. Built from the
    flattened token lists in one masked write per tensor: a loop over the rows cost ~1.5 ms of the
    embedded default's step (64 rows; issue #49). ``support`` (score centering's form, ``exact`` or
    ``head``): the support the batch carries (``Support``), from the engine's kept sets or its head.

    Raises:
        ValueError: a token without its log-prob, or a support the engine did not record."""
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
    return Batch(input_ids, attention, positions, response, mask, rollout_lp, versions, kept=kept,
                 support=None if support is None else Support.of(recorded_support(rollouts, support).pad(t_max),
                                                                 support))


def recorded_support(rollouts: Rollouts, form: str) -> KeptIds:
    """The sets score centering's ``form`` reads from the rollouts: the kept sets with their log q_v (``exact``)
    or the top-k head (``head``).

    Raises:
        ValueError: the engine recorded no such sets, naming what records them."""
    if form == "exact":
        if rollouts.kept is None or rollouts.kept.logprobs is None:
            raise ValueError("score_centering 'exact' centres over the engine's kept sets with each kept id's log q_v, "
                             "and these rollouts carry none: the hf engine records them under top-k/top-p sampling "
                             "(vLLM returns no q over its mask). Fix: engine=hf with top_k or top_p < 1, or "
                             "score_centering 'head'")
        return rollouts.kept
    if form == "head":
        if rollouts.head is None:
            raise ValueError("score_centering 'head' centres over the sampler's top-k head, and these rollouts carry "
                             "none: ask the engine for it (SamplingConfig.head_logprobs = k; the hf and vLLM engines "
                             "return it)")
        return rollouts.head
    raise ValueError(f"score centering's support is 'exact' or 'head'; got {form!r}")
