"""One optimizer step of the trainer on its device: the corrected loss over a ``Scorer``'s
micro-batches (``offpolicy.policy.score``: precision, trimming, device moves) and the update — the
helpers ``loop.py`` calls between "π_old" and "sync".

Micro-batching is exact (issue #21): with micro-batches b = 1 … M of one optimizer step,

    L = Σ_b Σ_{t ∈ b} ℓ_t / N_global,     ∇L = Σ_b ∇(Σ_{t ∈ b} ℓ_t / N_global)

where N_global is the step's count (tokens for token-mean, rows for the seq-mean aggregations)
from ``op.with_global_normalizer``: each micro-batch's backward adds its share of the one
big batch's gradient. Counting the surviving tokens of a correction needs log π_old (and, for
rules on π_θ, log π_θ) before the backward passes, and so does top-k/top-p sampling (a token the
engine drew outside the trainer's support leaves the loss, ``within_support``): a no-grad forward
per micro-batch gives them; this costs one extra forward, paid only when the step splits into
more than one micro-batch.

Exact for every option (issue #32): a bound chosen from the data (quantile, ESS, M2PO) and
``weight.normalize``'s mean are fixed over the whole step by ``op.resolve_thresholds`` — split or
not, so both report the same metrics; each micro-batch's per-token tensors are widened back to
the step's response width, so per-row reductions (sequence ratios, row means) sum the same
columns; the loss is aggregated in float64 and recorded once per optimizer step. A float64
model gives the unsplit step's loss, gradient and every metric to ~1e-16 (tested to 1e-10).

Host synchronisation: nothing here reads a device value on the host — the batch's lengths are
read from its CPU copy, metrics stay tensors (``Metrics``) until the one copy per step in the
log stage. ``with_global_normalizer`` reads its count once per split step, and
``resolve_thresholds`` its bounds once per step (that is the price of micro-batching under a
correction whose count or bound depends on the data).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

import offpolicy as op
from offpolicy.core import ops
from offpolicy.core.centering import Support
from offpolicy.core.config import M2Rule
from offpolicy.core.kernels.common import row_aggregation
from offpolicy.core.metrics import Metrics
from offpolicy.policy.batch import Batch
from offpolicy.policy.score import Scorer, device_index, widen


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


def step_config(loss_cfg: op.LossConfig, parts: list[dict[str, torch.Tensor]],
                metrics: Metrics | None = None) -> op.LossConfig:
    """The loss config of one optimizer step, the same for each of its micro-batches ``parts``:
    data-chosen bounds and ``weight.normalize``'s mean taken over the whole step
    (``op.resolve_thresholds``, which records the chosen numbers in ``metrics``) — for one
    micro-batch too, so a split and an unsplit step report the same metrics — and, for several
    micro-batches, the step's global count (``op.with_global_normalizer``: the loss of each
    micro-batch divides by it, so they add up to the whole batch's)."""
    cfg = loss_cfg
    if loss_cfg.correction is not None and loss_cfg.correction.step_dependent:
        cfg = op.resolve_thresholds(loss_cfg, parts, metrics=metrics)
    if len(parts) == 1:
        return cfg
    needed = {"mask"} if cfg.correction is None else set(parts[0])
    return op.with_global_normalizer(cfg, [{k: v for k, v in p.items() if k in needed} for p in parts])


def accumulate(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor, mb: Batch,
               loss_cfg: op.LossConfig, metrics: Metrics, backward: bool = True, split: bool = False,
               support: Support | None = None) -> torch.Tensor:
    """One micro-batch's corrected loss, backpropagated (gradients add up in ``.grad``; not with
    ``backward=False``, which only measures); returns its value, detached, in float64.

    ``policy_loss`` gives the per-token terms (``reduce=False``); they are aggregated here with the
    loss's own rule (``row_aggregation``: Σ / N_tokens, or the row means over N_rows) in float64,
    so that the micro-batches' values add up to the whole step's to float64 rounding whatever the
    split. The per-call ``loss`` metric is left out: ``optimizer_step`` records the step's. ``support``: score
    centering's support of the micro-batch, scored (``Support``: log p_v with grad, log q_v, log π_old(v)
    ``[b, T, K]``).
    """
    per_token, agg_mask, m = op.policy_loss(logprobs, old_logprobs, advantages, mb.mask,
                                            rollout_logprobs=mb.rollout_logprobs, config=loss_cfg, reduce=False,
                                            support=support)
    numerator, count, _ = row_aggregation(per_token.double().sum(-1), agg_mask.double().sum(-1), loss_cfg,
                                          per_token.shape[-1])
    loss = numerator / count.clamp(min=1)
    if backward:
        loss.backward()
    metrics.update(m.renamed(lambda key: None if key == "loss" else key))
    drift_and_split_metrics(logprobs, old_logprobs, advantages, mb, loss_cfg, metrics, split)
    return loss.detach()


def drift_and_split_metrics(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                            mb: Batch, loss_cfg: op.LossConfig, metrics: Metrics, split: bool = True) -> None:
    """The field's 2026 metrics for one micro-batch (they add up over micro-batches and mini-batches):

    * ``drift/abs_logp_mean`` / ``drift/abs_logp_max``: |log π_θ − log π_ref| over the loss's tokens,
      π_ref the denominator of PPO's ratio (π_old; μ under anchor rollout or without a π_old) — SkyRL
      #1813's per-mini-batch drift of the policy from what the loss optimizes against: 0 at the first
      mini-batch of an on-policy step, growing over the step's mini-batches and PPO epochs;
    * with a correction and ``split`` (``offpolicy train split_metrics=true``), ``op.split_metrics``
      (kl_k3 on kept / masked tokens, the masked tokens'
      advantage signs, the raw-weight row fractions): one more ``correct`` on the micro-batch, O(B·T).
    """
    corr = loss_cfg.correction
    bypass = old_logprobs is None or (corr is not None and corr.anchor == "rollout")
    ref = mb.rollout_logprobs if bypass else old_logprobs
    mask = mb.mask.bool()
    drift = (logprobs.detach().float() - ref.float()).abs()
    metrics.mean("drift/abs_logp_mean", drift, mask)
    metrics.max("drift/abs_logp_max", drift, mask)
    if split and corr is not None:  # a reference ``correct``: it validates its inputs on the host
        out = op.correct(old_logprobs, mb.rollout_logprobs, mb.mask, corr, logprobs=logprobs.detach(),
                         advantages=advantages)
        metrics.update(op.split_metrics(out, corr, advantages))


def apply(policy, optimizer: torch.optim.Optimizer, max_grad_norm: float, metrics: Metrics) -> None:
    """Clip, step, clear: the grad norm is recorded as a tensor (no host read)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics.mean("grad_norm", grad_norm.reshape(1))


def rule_names(loss_cfg: op.LossConfig):
    """Metric key → the name the configured rule reports under: ``resolve_thresholds`` turns an
    m2 rule into its fixed k2 equivalent (``reject/<i>_k2_token``), reported here as the m2 rule
    it is (``reject/<i>_m2_token``), as an unresolved call would."""
    corr = loss_cfg.correction
    m2 = [] if corr is None else [i for i, r in enumerate(corr.reject) if isinstance(r, M2Rule)]
    if not m2:
        return lambda key: key
    swaps = {f"reject/{i}_k2_token/": f"reject/{i}_m2_token/" for i in m2}

    def rename(key: str) -> str:
        head = key[: key.find("/", len("reject/")) + 1] if key.startswith("reject/") else ""
        return swaps[head] + key[len(head):] if head in swaps else key
    return rename


def _part(mb: Batch, advantages: torch.Tensor, logprobs: torch.Tensor, old: torch.Tensor | None) -> dict:
    """What ``correct`` reads of one micro-batch, for the step-level counts and bounds."""
    part = {"mask": mb.mask, "rollout_logprobs": mb.rollout_logprobs, "logprobs": logprobs, "advantages": advantages}
    if old is not None:
        part["old_logprobs"] = old
    return part


def optimizer_step(scorer: Scorer, optimizer, batch: Batch, rows: torch.Tensor, advantages: torch.Tensor, *,
                   old_of: Callable[[torch.Tensor, Batch, torch.Tensor | None], torch.Tensor | None],
                   loss_cfg: op.LossConfig, max_grad_norm: float, metrics: Metrics,
                   update: bool = True, split_metrics: bool = False, old_support: torch.Tensor | None = None,
                   step_start: bool = False) -> None:
    """One optimizer step of ``scorer.model`` on ``rows`` of the CPU ``batch`` (``advantages`` ``[B, T]``
    CPU), in ``scorer``'s micro-batches, precision and sampling support.

    ``update=False`` measures without updating: the same forwards under ``no_grad``, the same
    correction and metrics (the mismatch of μ against π_θ: ``kl_k3``, ``ess``, the rejected
    shares, …), but no backward, no ``loss`` and no optimizer step — a step whose gradient is
    known to be 0 (``loop.py``) still reports what the engine's μ was against the trainer.

    ``old_of(rows, mb, logprobs)`` gives log π_old of a device micro-batch: from a π_old forward,
    from ``logprobs`` (the update's own forward, detached, when π_old = sg(π_θ)), or AReaL's
    log-linear proximal. ``split_metrics`` adds ``op.split_metrics`` (``drift_and_split_metrics``).

    Score centering (``loss.score_centering``, the batch carrying its ``Batch.support``): each micro-batch's forward
    also gives log p_v of the support ids (``Scores.support_logprobs``), and ``old_support`` ``[B, T, K]``
    (device) log π_old(v) from the π_old forward; None: the update's own, detached, as ``old_of`` does for π_old.

    Whatever the split, the step computes and reports the same numbers (issue #32): the config is
    fixed over the whole step (``step_config``); each micro-batch's per-token tensors are widened
    back to the step's response width T before the loss, so every per-row reduction (sequence
    ratios, row means) runs over the same columns as the unsplit step's; every metric is a
    partial sum that adds up over the micro-batches; and ``loss`` is recorded once per optimizer
    step — the step's full-batch loss, L = Σ_b Σ_{t∈b} ℓ_t / N_step — so the logged
    ``offpolicy/loss`` is the mean over the optimizer steps (mini-batches × PPO epochs) of each
    step's loss.

    ``step_start``: the weights are still the step's starting π_θ (the first optimizer step of the batch, or a
    measuring pass), so ``MISMATCH_KEY`` is recorded on these rows' tokens (``mismatch_k3``).
    """
    if not update:
        with torch.no_grad():
            _step(scorer, batch, rows, advantages, old_of, loss_cfg, metrics, backward=False, split=split_metrics,
                  old_support=old_support, step_start=step_start)
        return
    optimizer.zero_grad(set_to_none=True)
    total = _step(scorer, batch, rows, advantages, old_of, loss_cfg, metrics, backward=True, split=split_metrics,
                  old_support=old_support, step_start=step_start)
    if total is None:
        return
    metrics.mean("loss", total.reshape(1))
    apply(scorer.model, optimizer, max_grad_norm, metrics)


MISMATCH_KEY = "kl_k3_start"  # logged as offpolicy/kl_k3_start


def mismatch_k3(logprobs: torch.Tensor, view: Batch, metrics: Metrics) -> None:
    """k3 of the trainer's π_θ at the start of the step against the engine's μ, on the sampled tokens of ``view``
    (``[b, T]``, the loss's tokens): ρ = π_θ/μ, k3 = ρ − 1 − log ρ, the log-ratio clamped as every ratio is
    (``ops.k3``). ``offpolicy/kl_k3`` is the correction's own statistic, taken on the ratio its anchor uses —
    π_old/μ, or π_θ/μ averaged over the step's mini-batches under bypass — so it measures different things by
    preset; this one is the same for every preset (the science amendment's mismatch column, docs/science.md),
    recorded on the first mini-batch's rows (before any update of the step) or a measuring pass's."""
    x = logprobs.detach().float() - view.rollout_logprobs.float()
    mask = view.mask.bool()  # a NaN on a kept token stays in (a non-finite policy must show), padding does not
    metrics.mean(MISMATCH_KEY, ops.k3(torch.where(mask, x, torch.zeros_like(x)), None), mask)


def _step(scorer: Scorer, batch: Batch, rows: torch.Tensor, advantages: torch.Tensor, old_of,
          loss_cfg: op.LossConfig, metrics: Metrics, backward: bool, split: bool = False,
          old_support: torch.Tensor | None = None, step_start: bool = False) -> torch.Tensor | None:
    """The forwards, the correction and (``backward``) the backward passes of one optimizer step
    (``optimizer_step``'s docstring); records the step's metrics but ``loss`` in ``metrics`` and
    returns the step's loss (float64, detached), or None for rows without a response token."""
    rows = rows[batch.mask[rows].sum(dim=1) > 0]  # a row without a response token has no loss term
    if rows.numel() == 0:
        return None
    width = int(batch.mask[rows].sum(dim=1).max())  # the step's response width (the CPU batch: no sync)
    micro = scorer.micro_batches(batch, rows)  # whole packs of the step's one pack plan
    groups = [part.rows for part in micro]
    mbs = [scorer.to_device(batch, part) for part in micro]
    advs = [advantages[g][:, :width].to(scorer.device, non_blocking=True) for g in groups]
    truncated = scorer.sampling.truncates

    def loss_inputs(g, mb, logprobs, support_metrics=None):
        """(the micro-batch's loss view at the step's width, without the tokens outside the
        trainer's support; log π_θ; log π_old), all ``[b, width]``."""
        mb, logprobs, old = within_support(mb, logprobs, old_of(g, mb, logprobs), support_metrics)
        view = replace(mb, mask=widen(mb.mask, width), rollout_logprobs=widen(mb.rollout_logprobs, width))
        return view, widen(logprobs, width), None if old is None else widen(old, width)

    def centring(g, mb, scores):
        """Score centering's support of the micro-batch, scored (log p_v, log π_old(v)), ``[b, width, K]``; or
        None."""
        if mb.support is None:
            return None
        lp = scores.support_logprobs
        old = lp.detach() if old_support is None else \
            old_support[device_index(g, scorer.device), : lp.shape[1], : lp.shape[2]]
        sup = mb.support
        return Support(widen(sup.ids, width), widen(sup.rollout_logprobs, width, float("-inf")), sup.form,
                       logprobs=widen(lp, width), old_logprobs=widen(old, width))

    def counts(view: Batch) -> bool:
        # under top-k/top-p a micro-batch can lose every token to the support (one host read, only then)
        return not truncated or bool(view.mask.any())

    step = Metrics()
    total = torch.zeros((), dtype=torch.float64, device=scorer.device)
    if len(groups) == 1:  # the update's own forward gives π_θ for the step's bounds: no extra forward
        (g,), (mb,), (adv,) = groups, mbs, advs
        scores = scorer.forward(mb, metrics, support=True)
        view, logprobs, old = loss_inputs(g, mb, scores.logprobs, metrics if truncated else None)
        if step_start:
            mismatch_k3(logprobs, view, metrics)
        if counts(view):
            parts = [{"mask": view.mask}] if loss_cfg.correction is None else [_part(view, adv, logprobs.detach(), old)]
            total = accumulate(logprobs, old, adv, view, step_config(loss_cfg, parts, step), step, backward, split,
                               centring(g, mb, scores))
    else:
        # the step's count and bounds need each micro-batch's surviving tokens before any backward:
        # a correction's inputs, and under top-k/top-p the tokens inside the trainer's support
        # the forward's own metrics (entropy, outside mass) come from the first forward of each micro-batch —
        # also of one whose tokens all fall outside the trainer's support, which gets no second forward: the
        # whole batch's forward covers its tokens too, so the split reports the same numbers (issue #43)
        first_pass = loss_cfg.correction is not None or truncated  # else the count needs the masks only
        parts, kept = [], []
        for g, mb, adv in zip(groups, mbs, advs):
            if not first_pass:
                parts.append({"mask": widen(mb.mask, width)})
                kept.append(True)
                continue
            with torch.no_grad():  # π_θ is the same for every micro-batch of this step
                view, current, old = loss_inputs(g, mb, scorer.forward(mb, metrics).logprobs,
                                                 metrics if truncated else None)
            kept.append(counts(view))
            if kept[-1]:
                parts.append({"mask": view.mask} if loss_cfg.correction is None else _part(view, adv, current, old))
        cfg = step_config(loss_cfg, parts, step) if parts else loss_cfg
        for g, mb, adv, keep in zip(groups, mbs, advs, kept):
            if not keep:
                continue
            # π_old from the update's own forward where it is sg(π_θ), as in the unsplit step (the
            # no-grad forward above may take other kernels and differ in the last bit)
            scores = scorer.forward(mb, None if first_pass else metrics, support=True)
            view, logprobs, old = loss_inputs(g, mb, scores.logprobs)
            if step_start:
                mismatch_k3(logprobs, view, metrics)
            total = total + accumulate(logprobs, old, adv, view, cfg, step, backward, split,
                                       centring(g, mb, scores))
    metrics.update(step.renamed(rule_names(loss_cfg)))
    return total
