"""From engine rollouts to the ``[B, T]`` tensors the loss reads, and the trainer's log-probs.

Rows are prompt + response, right-padded; response-aligned tensors are ``[B, T]`` with
T = the longest response. The trainer computes log π(y_t) on the same support the engine
sampled from (``renormalize_logprobs``: temperature, top-k, top-p — SPEC §6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offpolicy.engines import Rollouts, SamplingConfig
from offpolicy.metrics import Metrics
from offpolicy.sampling import outside_mass_metrics, renormalize_logprobs


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, T] index in L of the logits that predict response token t
    response_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1 on response tokens (EOS included)
    rollout_logprobs: torch.Tensor  # [B, T] log μ(y_t) from the engine
    versions: torch.Tensor  # [B] policy version that sampled each row

    def select(self, rows: torch.Tensor) -> Batch:
        return Batch(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))


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
    return Batch(input_ids, attention, positions, response, mask, rollout_lp, versions)


def trainer_logprobs(model, batch: Batch, sampling: SamplingConfig, metrics: Metrics | None = None) -> torch.Tensor:
    """log π(y_t) ``[B, T]`` fp32 under ``model`` on the engine's sampling support.

    With top-k/top-p and ``metrics`` given, the mass the sampler truncated away is recorded
    there (``outside_mass``, ``outside_mass_max``; see ``outside_mass_metrics``). With ``metrics``
    given, the mean token entropy of the sampling distribution is recorded as ``entropy`` too
    (``token_entropy``; the denominator of prime-rl's mismatch KL / entropy, issue #25).

    Without truncation (top_k = -1, top_p = 1) log π(y_t) = z_{y_t} − logsumexp_v z_v with
    z = logits / τ: one gather and one reduction, never the ``[B, T, V]`` log-softmax. With
    top-k/top-p the support depends on the whole row, so ``renormalize_logprobs`` builds it.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, L, V]
    index = batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    # at least fp32 (bf16/fp16 logits are cast up; a float64 model stays float64, for exactness tests)
    response_logits = logits.gather(1, index).to(torch.promote_types(logits.dtype, torch.float32))  # [B, T, V]
    if sampling.top_k == -1 and sampling.top_p == 1.0:
        z = response_logits / sampling.temperature if sampling.temperature != 1.0 else response_logits
        token_lp = z.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
        if metrics is not None:
            metrics.mean("entropy", token_entropy(z.detach().log_softmax(-1)), batch.mask.bool())
    else:
        logprobs, outside = renormalize_logprobs(response_logits, top_p=sampling.top_p, top_k=sampling.top_k,
                                                 temperature=sampling.temperature, return_outside_mass=True)
        token_lp = logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        if metrics is not None:
            outside_mass_metrics(outside.detach(), batch.mask, metrics)
            metrics.mean("entropy", token_entropy(logprobs.detach()), batch.mask.bool())
    return torch.where(batch.mask.bool(), token_lp, torch.zeros((), device=token_lp.device))


@torch.no_grad()
def token_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """H_t = −Σ_v p_v log p_v of each position's distribution, ``[B, T, V]`` log-probs → ``[B, T]`` fp32.

    prime-rl's ``compute_entropy`` (src/prime_rl/trainer/rl/loss.py) takes the same quantity from the
    logits as logsumexp(z) − Σ softmax(z)·z; tokens outside a top-k/top-p support have log p = −inf and
    p = 0, and contribute 0 (not 0 · −inf = NaN).
    """
    p = logprobs.float().exp()
    return -torch.where(p > 0, p * logprobs.float(), torch.zeros((), device=p.device)).sum(-1)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i − mean_group r) / (std_group r + ε); ``[B] → [B]``, groups are consecutive rows."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + eps)).view(-1)
