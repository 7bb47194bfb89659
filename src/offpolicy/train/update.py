"""One optimizer step of the trainer on its device: micro-batches by tokens, the precision
context, the corrected loss and the update — the helpers ``loop.py`` calls between "π_old" and
"sync".

Micro-batching is exact (issue #21): with micro-batches b = 1 … M of one optimizer step,

    L = Σ_b Σ_{t ∈ b} ℓ_t / N_global,     ∇L = Σ_b ∇(Σ_{t ∈ b} ℓ_t / N_global)

where N_global is the step's count (tokens for token-mean, rows for the seq-mean aggregations)
from ``op.with_global_normalizer``: each micro-batch's backward adds its share of the one
big batch's gradient. Counting the surviving tokens of a correction needs log π_old (and, for
rules on π_θ, log π_θ) before the backward passes, and so does top-k/top-p sampling (a token the
engine drew outside the trainer's support leaves the loss, ``within_support``): a no-grad forward
per micro-batch gives them; this costs one extra forward, paid only when the step splits into
more than one micro-batch.

Host synchronisation: nothing here reads a device value on the host — the batch's lengths are
read from its CPU copy, metrics stay tensors (``Metrics``) until the one copy per step in the
log stage. ``with_global_normalizer`` reads its count once per split step (that is the price of
micro-batching under a correction whose count depends on the data).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch

import offpolicy as op
from offpolicy.engines import SamplingConfig
from offpolicy.metrics import Metrics
from offpolicy.train.batch import Batch
from offpolicy.train.head import trainer_logprobs, truncates


def load_policy(path, device: torch.device):
    """The trainer's model: fp32 master weights on ``device`` — what ``train`` updates and what
    ``diagnose`` scores with (its bf16 is ``precision``'s autocast too, never bf16 weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def precision(device: torch.device, trainer_dtype: str) -> contextlib.AbstractContextManager:
    """The forward's compute dtype: bf16 autocast over fp32 master weights, or nothing (fp32).

    fp32 master weights + bf16 compute is what FSDP's MixedPrecision (param_dtype bf16, fp32
    sharded master copy) and verl's actor use; the optimizer state and the update stay fp32, so
    small updates are not lost to bf16's 8-bit mantissa. Log-probs are taken in fp32 from the
    bf16 logits (``trainer_logprobs`` casts before the log-sum-exp).
    """
    if trainer_dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_batches(batch: Batch, rows: torch.Tensor, budget: int | None) -> list[torch.Tensor]:
    """``rows`` split into groups of at most ``budget`` padded tokens each (rows × the group's
    longest prompt + response); a row longer than the budget goes alone. Rows are taken
    shortest first, so rows of similar length share a group and little is padding. ``batch``
    must be on the CPU (its lengths are read on the host). ``budget=None``: one group."""
    if budget is None:
        return [rows]
    lengths = batch.attention_mask[rows].sum(dim=1)  # [b] prompt + response tokens
    order = torch.argsort(lengths, stable=True)
    groups: list[list[int]] = []
    widest = 0
    for i in order.tolist():
        width = int(lengths[i])
        if groups and (len(groups[-1]) + 1) * max(widest, width) <= budget:
            groups[-1].append(i)
            widest = max(widest, width)
        else:
            groups.append([i])
            widest = width
    return [rows[torch.tensor(g, dtype=torch.long)] for g in groups]


def trim(batch: Batch) -> Batch:
    """``batch`` without the padding columns no row uses (CPU batch: lengths read on the host).
    Response tensors keep their first T' columns and inputs their first L' (rows are right-padded),
    so a trimmed micro-batch's ``[b, T']`` tensors are a prefix of the full batch's."""
    width = max(1, int(batch.attention_mask.sum(dim=1).max()))
    t_max = max(1, int(batch.mask.sum(dim=1).max()))
    return Batch(batch.input_ids[:, :width], batch.attention_mask[:, :width],
                 batch.positions[:, :t_max].clamp(max=width - 1), batch.response_ids[:, :t_max],
                 batch.mask[:, :t_max], batch.rollout_logprobs[:, :t_max], batch.versions)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(*(getattr(batch, f).to(device, non_blocking=True) for f in batch.__dataclass_fields__))


def forward(policy, mb: Batch, sampling: SamplingConfig, device: torch.device, trainer_dtype: str,
            metrics: Metrics | None = None) -> torch.Tensor:
    """log π(y_t) ``[b, T']`` fp32 of a device micro-batch under the configured precision."""
    with precision(device, trainer_dtype):
        logprobs = trainer_logprobs(policy, mb, sampling, metrics)
    return logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))


@torch.no_grad()
def old_logprobs(policy, batch: Batch, sampling: SamplingConfig, device: torch.device, trainer_dtype: str,
                 micro_batch_tokens: int | None) -> torch.Tensor:
    """log π_old ``[B, T]`` fp32 on ``device`` for the whole CPU ``batch``, in micro-batches; the
    columns past a micro-batch's longest response stay 0 (masked everywhere). The rows' order goes
    to the device once, after the last forward, without a host wait (``device_index``)."""
    groups = micro_batches(batch, torch.arange(len(batch.mask)), micro_batch_tokens)
    parts = []
    for rows in groups:
        mb = to_device(trim(batch.select(rows)), device)
        logprobs = forward(policy, mb, sampling, device, trainer_dtype)  # [b, T'] fp32 (fp64 for a fp64 model)
        parts.append(torch.nn.functional.pad(logprobs, (0, batch.mask.shape[1] - logprobs.shape[1])))
    order = torch.cat(groups)  # row of each stacked part
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return torch.cat(parts)[device_index(inverse, device)]  # [B, T]


def device_index(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU index on ``device`` without a host wait: on CUDA through pinned memory, non-blocking (a
    plain ``.to(device)`` waits for every kernel queued before it)."""
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def within_support(mb: Batch, logprobs: torch.Tensor, old: torch.Tensor | None, metrics: Metrics | None = None
                   ) -> tuple[Batch, torch.Tensor, torch.Tensor | None]:
    """Drop the tokens the engine sampled outside the trainer's top-k/top-p support from the loss.

    A bf16 engine and a fp32 trainer can keep different top-k/top-p sets, so a token the engine
    drew can have log π̃ = −inf under π_θ or π_old (``trainer_logprobs`` marks exactly those with
    −inf). Its ratio π̃/μ is 0 and PPO's π_θ/π_old is undefined: it leaves ``mb.mask`` like a
    rejected token, the log-probs there become 0, and ``outside_support_tokens`` (count) and
    ``outside_support_share`` (of the tokens that counted) record it. NaN is not touched: it meets
    the loss's ``nonfinite`` policy. Returns (micro-batch with the mask, log π_θ, log π_old).
    """
    outside = logprobs == float("-inf")
    if old is not None:
        outside |= old == float("-inf")
    counted = mb.mask.bool()
    if metrics is not None:
        metrics.sum("outside_support_tokens", (outside & counted).sum())
        metrics.mean("outside_support_share", outside.float(), counted)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(outside, zero, logprobs)
    old = None if old is None else torch.where(outside, zero.to(old.dtype), old)
    return replace(mb, mask=mb.mask * ~outside), logprobs, old


def step_config(loss_cfg: op.LossConfig, parts: list[dict[str, torch.Tensor]]) -> op.LossConfig:
    """The loss config for one optimizer step: unchanged for one micro-batch (the loss divides by
    its own count), with the step's global count for several (``op.with_global_normalizer``)."""
    if len(parts) == 1:
        return loss_cfg
    needed = {"mask"} if loss_cfg.correction is None else set(parts[0])
    return op.with_global_normalizer(loss_cfg, [{k: v for k, v in p.items() if k in needed} for p in parts])


def accumulate(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor, mb: Batch,
               loss_cfg: op.LossConfig, metrics: Metrics) -> None:
    """One micro-batch's corrected loss, backpropagated (gradients add up in ``.grad``)."""
    loss, m = op.policy_loss(logprobs, old_logprobs, advantages, mb.mask, rollout_logprobs=mb.rollout_logprobs,
                             config=loss_cfg)
    loss.backward()
    metrics.update(m)


def apply(policy, optimizer: torch.optim.Optimizer, max_grad_norm: float, metrics: Metrics) -> None:
    """Clip, step, clear: the grad norm is recorded as a tensor (no host read)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics.mean("grad_norm", grad_norm.reshape(1))


def optimizer_step(policy, optimizer, batch: Batch, rows: torch.Tensor, advantages: torch.Tensor, *,
                   old_of: Callable[[torch.Tensor, Batch, torch.Tensor | None], torch.Tensor | None],
                   loss_cfg: op.LossConfig, sampling: SamplingConfig, device: torch.device, trainer_dtype: str,
                   micro_batch_tokens: int | None, max_grad_norm: float, metrics: Metrics) -> None:
    """One optimizer step on ``rows`` of the CPU ``batch`` (``advantages`` ``[B, T]`` CPU).

    ``old_of(rows, mb, logprobs)`` gives log π_old of a device micro-batch: from a π_old forward,
    from ``logprobs`` (the update's own forward, detached, when π_old = sg(π_θ)), or AReaL's
    log-linear proximal; ``logprobs`` is None when asked before the update's forward.
    """
    optimizer.zero_grad(set_to_none=True)
    groups = micro_batches(batch, rows, micro_batch_tokens)
    mbs = [to_device(trim(batch.select(g)), device) for g in groups]
    advs = [advantages[g][:, : mb.mask.shape[1]].to(device, non_blocking=True) for g, mb in zip(groups, mbs)]
    cfg, olds = loss_cfg, [None] * len(groups)
    if len(groups) > 1:
        parts = []
        for i, (g, mb, adv) in enumerate(zip(groups, mbs, advs)):
            part = {"mask": mb.mask}
            # the step's count needs the surviving tokens: a correction's, and those inside the support
            if loss_cfg.correction is not None or truncates(sampling):
                with torch.no_grad():  # π_θ is the same for every micro-batch of this step
                    current = forward(policy, mb, sampling, device, trainer_dtype)
                olds[i] = old_of(g, mb, current)
                inside, current, old = within_support(mb, current, olds[i])
                if truncates(sampling) and not bool(inside.mask.any()):
                    continue  # every token outside the support: nothing to count
                part["mask"] = inside.mask
                if loss_cfg.correction is not None or truncates(sampling):
                    part.update(rollout_logprobs=mb.rollout_logprobs, logprobs=current, advantages=adv)
                    if old is not None:
                        part["old_logprobs"] = old
            parts.append(part)
        cfg = step_config(loss_cfg, parts) if parts else loss_cfg
    for g, mb, adv, old in zip(groups, mbs, advs, olds):
        logprobs = forward(policy, mb, sampling, device, trainer_dtype, metrics)
        mb, logprobs, old = within_support(mb, logprobs, old if old is not None else old_of(g, mb, logprobs), metrics)
        if truncates(sampling) and not bool(mb.mask.any()):
            continue  # every token outside the support: no loss to take (one host read, top-k/top-p only)
        accumulate(logprobs, old, adv, mb, cfg, metrics)
    apply(policy, optimizer, max_grad_norm, metrics)
