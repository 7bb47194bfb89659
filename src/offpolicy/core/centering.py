"""Score centering (Marek & Ryabinin, arXiv 2609.20807): the loss's sampler-expected score, subtracted.

At a token t the policy loss pushes log p(a_t) with a coefficient −A_t·c_a, where c_v is what the loss
gives token v had v been sampled there — the IS weight times the loss kind's own score factor (see
``score_coefficients``). Sampled from q, the update's expectation is E_q[A·c·∇log p]; its part
E_q[A]·E_q[c·∇log p] (the *drift*) does not vanish when c·q ≠ p (a truncated or masked weight, no
weight at all, a sampler that is not the trainer), and moves the trainer towards the sampler. Score
centering adds, per token (docs/estimators.md#score-centering):

    C_t = sg(A_t) · Σ_{v ∈ S_t} sg(q_v · c_v) · log p_v

so the token's gradient becomes −A_t·[c_a·∇log p_a − Σ_v q_v c_v ∇log p_v] and its expectation loses
E_q[A]·E_q[c·∇log p]. Two supports S_t:

* ``exact``: S_t is the engine's whole kept set (replayed): q over it sums to 1, p is the trainer's
  distribution renormalised over it, and the sum is the sampler's expectation itself.
* ``head``: S_t is a top-k head H of the full-vocabulary distributions; outside it q (and π_old) are
  modelled as rescaled copies of p that keep their measured tail masses, p_T = 1 − Σ_H p,
  q_T = 1 − Σ_H q (each floored at ``score_centering_tail_floor``). Every tail token then has the same
  ratio, so the same coefficient c_T, evaluated on one pseudo-token with the tail's log-probs, and
  with Σ_V p_v ∇log p_v = 0:

      Σ_{v ∉ H} q_v c_v ∇log p_v = (q_T / p_T)·c_T·Σ_{v ∉ H} p_v ∇log p_v = −(q_T c_T / p_T)·Σ_{v ∈ H} p_v ∇log p_v

  so C_t = sg(A_t)·Σ_{v ∈ H} sg(q_v c_v − (q_T c_T / p_T)·p_v)·log p_v.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from offpolicy.core import ops
from offpolicy.core.config import LossConfig
from offpolicy.core.correction import Correction, RuleInputs, _RULES, is_token_rule, weight_fn
from offpolicy.core.kept_set import KeptIds
from offpolicy.core.kernels.common import RATIO_LOG_CLAMP, UpcastSaturating
from offpolicy.core.metrics import Metrics

FORMS = ("exact", "head")
_TENSORS = ("ids", "rollout_logprobs", "logprobs", "old_logprobs")  # Support's [B, T, K] fields


@dataclass(frozen=True)
class Support:
    """Score centering's support S_t of each response token, as one bundle (docs/estimators.md#score-centering):
    K token ids v per position, what the sampler gave each, and — once a model scored them — the trainer's.

    ``ids``               ``[B, T, K]`` int64: the support's token ids, each position's in its first slots, 0 where
                          padded (K: the largest set).
    ``rollout_logprobs``  ``[B, T, K]`` float: log q_v of the sampler; −inf exactly where padded (``mask``).
    ``form``              which support and how p is normalised over it: ``exact``, the engine's kept set
                          (top-k/top-p; p renormalised over it, as replay scores y_t), or ``head``, the sampler's
                          top-k head of the untruncated distribution (p over the full vocabulary; the tail is
                          modelled). It must be the loss's ``score_centering``.
    ``logprobs``          ``[B, T, K]`` float: the trainer's log p_v, with grad (0 where padded); None until a
                          model scored the ids (``offpolicy.policy.head``; a host: ``support_logprobs``).
                          ``policy_loss`` needs it.
    ``old_logprobs``      ``[B, T, K]`` float: log π_old(v), for kinds ppo / cispo under anchor old; else None.

    ``mask`` ``[B, T, K]`` bool: True on the ids that are there (log q > −inf), False on padding.

    Raises (on construction):
        ValueError: a form other than ``exact``/``head``, a tensor that is not ``[B, T, K]``, shapes that differ,
            int ids or float log-probs of another kind.
    """

    ids: torch.Tensor
    rollout_logprobs: torch.Tensor
    form: str
    logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"Support.form must be one of {', '.join(FORMS)}; got {self.form!r}")
        if self.ids.dim() != 3 or self.ids.is_floating_point():
            raise ValueError(f"Support.ids must be an integer [B, T, K] tensor; got {self.ids.dtype} "
                             f"{tuple(self.ids.shape)}")
        for name in _TENSORS[1:]:  # the log-probs
            tensor = getattr(self, name)
            if tensor is None:
                continue
            if tensor.shape != self.ids.shape:
                raise ValueError(f"Support.{name} must have the ids' shape [B, T, K] = {tuple(self.ids.shape)}; "
                                 f"got {tuple(tensor.shape)}")
            if not tensor.is_floating_point():
                raise ValueError(f"Support.{name} must be a float tensor; got dtype {tensor.dtype}")

    @property
    def mask(self) -> torch.Tensor:
        """``[B, T, K]`` bool: the support's ids (True), not its padding (log q = −inf)."""
        return self.rollout_logprobs != float("-inf")

    @staticmethod
    def of(sets: KeptIds, form: str) -> Support:
        """``[B, T]`` sets that carry their log q_v (``KeptIds.logprobs``) as a dense support.

        Raises:
            ValueError: sets without log q_v."""
        ids, logq = sets.padded()
        if logq is None:
            raise ValueError("score centering needs the sampler's log q_v of each support id; these sets carry none")
        return Support(ids, logq, form)

    def scored(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor | None = None) -> Support:
        """This support with the trainer's log p_v (and log π_old(v)) of its ids, ``[B, T, K]`` each."""
        return replace(self, logprobs=logprobs, old_logprobs=old_logprobs)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Support:
        """This support with ``fn`` applied to each of its ``[B, T, K]`` tensors (those it has)."""
        tensors = {name: getattr(self, name) for name in _TENSORS}
        return replace(self, **{name: None if tensor is None else fn(tensor) for name, tensor in tensors.items()})

    def select(self, rows: torch.Tensor) -> Support:
        """The support of ``rows`` (an index of B)."""
        return self._map(lambda t: t[rows])

    def cut(self, width: int) -> Support:
        """The first ``width`` response columns, and only as many of the K slots as the largest set among them
        uses (each position's ids fill its first slots): a micro-batch of short sets does not carry the
        batch's largest K. A CPU support (its sizes are read on the host)."""
        rollout = self.rollout_logprobs[:, :width]
        k = int((rollout != float("-inf")).sum(dim=-1).max()) if rollout.numel() else 0  # only −inf pads
        return self._map(lambda t: t[:, :width, :k])

    def to(self, device: torch.device, non_blocking: bool = False) -> Support:
        """On ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))


def validate_support(cfg: LossConfig, mask: torch.Tensor, support: Support | None) -> None:
    """A support is given only when ``score_centering`` is set, of its form, scored by the trainer, and ``[B, T, K]``
    over the loss's ``[B, T]``. With ``score_centering`` set and none given, the loss is not centred (prime-rl:
    "samples without sampler mask logprobs get no centering"): a host, ``diagnose`` or a trainer that records no
    support runs the rest of the loss, and the metric ``score_centering/applied`` says 0.

    Raises:
        ValueError: a support with centering off, of the other form, without the trainer's log p_v or (kinds ppo /
            cispo under anchor old) log π_old(v), or of another [B, T].
    """
    if support is None:
        return  # none recorded: no centring (as prime-rl), reported as score_centering/applied = 0
    if not isinstance(support, Support):
        raise ValueError(f"support must be an offpolicy.Support; got {type(support).__name__}")
    if cfg.score_centering is None:
        raise ValueError("support= feeds score centering, which is off: set loss.score_centering to 'exact' or "
                         "'head', or leave support out")
    if support.form != cfg.score_centering:
        raise ValueError(f"support.form is {support.form!r} but loss.score_centering is {cfg.score_centering!r}: "
                         "exact centres over the whole kept set, head models the tail outside a top-k head. Record "
                         "the support the loss centres over, or set loss.score_centering to the support's form")
    if support.logprobs is None:
        raise ValueError(f"score_centering '{cfg.score_centering}' needs the trainer's log p_v of the support ids, "
                         "with grad: Support.logprobs (support.scored(logprobs); offpolicy.core.centering."
                         "support_logprobs gathers them from logits)")
    if support.ids.shape[:2] != mask.shape:
        raise ValueError(f"support must be [B, T, K] with [B, T] = {tuple(mask.shape)}; got "
                         f"{tuple(support.ids.shape)}")
    anchor = cfg.correction.anchor if cfg.correction is not None else "old"
    if cfg.kind in ("ppo", "cispo") and anchor == "old" and support.old_logprobs is None:
        raise ValueError(f"score centering with kind '{cfg.kind}' and anchor 'old' needs Support.old_logprobs "
                         "(log π_old of the support's ids): the ratio π_θ/π_old of every support token")


def score_coefficients(cfg: LossConfig, corr: Correction | None, lp: torch.Tensor, lq: torch.Tensor,
                       lo: torch.Tensor | None, adv: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor:
    """c_v ``[B, T, K]`` (detached, fp32): the coefficient of ∇log p_v the loss gives token v if v were the
    sampled token at t, everything else in the row unchanged:

        c_v = w_v · κ_v,    w_v = keep_v · f(ρ_v) / mean_w   (token-level weight; the row's or segment's
                                                             weight at a row level; 1 without a weight
                                                             or under anchor rollout)
        keep_v = every token-level reject rule evaluated at v (ratio / k1–k3 / binary_kl token, prob_diff)
        κ_v    = reinforce: 1;  cispo: clip(r_v, 1 − ε_low, 1 + ε_high);
                 ppo: r̃_v · 1[unclipped branch active]   (A ≥ 0: r̃ ≤ 1 + ε_high; A < 0: r̃ ≥ 1 − ε_low and
                 r̃ ≤ dual_clip), r̃_v = min(r_v, ratio_value_cap)

    with ρ_v = π_train(v)/q_v (π_train = π_old under anchor old, sg(p) otherwise; log clamped) and
    r_v = p_v/π_old(v) (π_old = q under anchor rollout; log clamped at ±20). ``lp`` is sg(log p),
    ``lq`` log q, ``lo`` log π_old (anchor old), all finite; ``adv`` is A_t ``[B, T]``; ``row_weight``
    ``[B, T]`` the row's (segment's) weight under a row-level weight."""
    corr_cfg = cfg.correction
    anchor = corr_cfg.anchor if corr_cfg is not None else "old"
    coef = torch.ones_like(lp)
    if corr_cfg is not None:
        clamp = ops.effective_log_clamp(corr_cfg.log_clamp)
        trainer = lo if anchor == "old" else lp
        log_rho = (trainer - lq).clamp(-clamp, clamp)
        a = adv.unsqueeze(-1)
        inputs = RuleInputs(log_ratio=log_rho, trainer=trainer, rollout=lq, current=lp,
                            advantages=a.expand_as(lp), clamp=clamp)
        everywhere = torch.ones_like(lp, dtype=torch.bool)
        for rule in corr_cfg.reject:
            if is_token_rule(rule):
                coef = coef * _RULES[type(rule)](rule, inputs, everywhere).to(coef.dtype)
        w = corr_cfg.weight
        if w is not None and anchor != "rollout":
            if w.level == "token":
                coef = coef * weight_fn(w, ops.safe_exp(log_rho, clamp)) / corr.weight_mean
            else:
                coef = coef * row_weight.unsqueeze(-1)
    if cfg.kind == "reinforce":
        return coef
    old = lq if anchor == "rollout" else lo
    ratio = torch.exp((lp - old).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))
    if cfg.kind == "cispo":
        low = None if cfg.clip_low is None else 1.0 - cfg.clip_low
        high = None if cfg.clip_high is None else 1.0 + cfg.clip_high
        return coef * (ratio if low is None and high is None else ratio.clamp(min=low, max=high))
    if cfg.ratio_value_cap is not None:
        ratio = ratio.clamp(max=cfg.ratio_value_cap)
    positive = (adv >= 0).unsqueeze(-1)
    up = ratio <= 1.0 + cfg.clip_high if cfg.clip_high is not None else torch.ones_like(positive)
    down = ratio >= 1.0 - cfg.clip_low if cfg.clip_low is not None else torch.ones_like(positive)
    if cfg.dual_clip is not None:
        down = down & (ratio <= cfg.dual_clip)
    return coef * ratio * torch.where(positive, up, down).to(ratio.dtype)


def score_centering_term(cfg: LossConfig, corr: Correction | None, valid: torch.Tensor, advantages: torch.Tensor,
                         support: Support, metrics: Metrics) -> torch.Tensor:
    """C_t ``[B, T]`` (0 off the centred tokens), with its gradient through ``support.logprobs`` (a support
    ``validate_support`` passed).

    The centred tokens are the valid tokens of the rows every row-level reject rule kept — a token a
    token-level rule rejected is centred too (its own term c_a·log p_a is 0; the expectation over the
    support is not). Support entries with log q = −inf are padding (q_v = 0) and count nowhere.
    Records ``score_centering/coef_mass`` = mean_t Σ_{v∈S_t} q_v c_v (the tail's q_T c_T included).

    A NaN or +inf log q, or a non-finite trainer or π_old log-prob, at a support entry of a centred token follows
    ``correction.nonfinite`` (no correction: ``error``): ``error`` raises; ``mask_token`` and ``neutral`` leave
    that token uncentred, ``mask_sequence`` its row; ``score_centering/nonfinite_tokens`` counts the tokens left.

    Raises:
        ValueError: a non-finite support value under ``nonfinite: error``.
    """
    centred = corr.row_mask.bool() if corr is not None else valid
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    trainer_lp, old_lp = support.logprobs, support.old_logprobs
    lq_in = support.rollout_logprobs.float()
    lp_in = UpcastSaturating.apply(trainer_lp) if trainer_lp.dtype in (torch.float16, torch.bfloat16) \
        else trainer_lp.float()
    filled = lq_in != float("-inf")  # [B, T, K]: what is not padding (``Support.mask``)
    entry = centred.unsqueeze(-1) & filled
    broken = [(name, entry & ~torch.isfinite(tensor)) for name, tensor in (
        ("Support.rollout_logprobs", lq_in), ("Support.logprobs", trainer_lp),
        ("Support.old_logprobs", old_lp)) if tensor is not None]
    bad_token = torch.zeros_like(centred)
    for _, bad in broken:
        bad_token |= bad.any(dim=-1)
    if bool(bad_token.any()):  # one host read a call
        policy = cfg.correction.nonfinite if cfg.correction is not None else "error"
        if policy == "error":
            name, count = next((name, int(bad.sum())) for name, bad in broken if bool(bad.any()))
            raise ValueError(f"{name} has {count} non-finite value(s) (NaN or +inf; only −inf pads) in the support of "
                             "a centred token: a support id the trainer or the sampler did not score. Fix the source, "
                             "or set correction.nonfinite to mask_token, mask_sequence or neutral to leave such tokens "
                             "uncentred")
        if policy == "mask_sequence":
            bad_token = bad_token.any(dim=-1, keepdim=True) & centred
        centred = centred & ~bad_token
    metrics.sum("score_centering/nonfinite_tokens", bad_token.sum())
    present = centred.unsqueeze(-1) & filled  # [B, T, K]
    lp = torch.where(present, lp_in, zero)  # the gradient path
    lp_sg = lp.detach()
    lq = torch.where(present, lq_in, zero)
    lo = None if old_lp is None else torch.where(present, old_lp.float(), zero)
    adv = torch.where(centred, advantages.float().detach(), zero)
    row_weight = None
    corr_cfg = cfg.correction
    if corr_cfg is not None and corr_cfg.weight is not None and corr_cfg.weight.level != "token" \
            and corr_cfg.anchor != "rollout":
        kept = corr.mask.bool()
        if corr_cfg.weight.level == "segment":
            row_weight = corr.weights
        else:  # one value per row: the one its surviving tokens carry
            row_weight = ops.broadcast_rows(ops.masked_max(corr.weights, kept, dim=-1), corr.weights)
        row_weight = torch.where(kept.any(dim=-1, keepdim=True), row_weight, zero)
    q = torch.where(present, torch.exp(lq), zero)
    coef = q * score_coefficients(cfg, corr, lp_sg, lq, lo, adv, row_weight)
    coef = torch.where(present, coef, zero)
    mass = coef.sum(dim=-1)
    if cfg.score_centering == "head":
        floor = cfg.score_centering_tail_floor
        p = torch.where(present, torch.exp(lp_sg), zero)
        log_p_tail = torch.log((1.0 - p.sum(dim=-1)).clamp(min=floor))  # [B, T]
        log_q_tail = torch.log((1.0 - q.sum(dim=-1)).clamp(min=floor))
        log_o_tail = None
        if lo is not None:
            o = torch.where(present, torch.exp(lo), zero)
            log_o_tail = torch.log((1.0 - o.sum(dim=-1)).clamp(min=floor)).unsqueeze(-1)
        c_tail = torch.exp(log_q_tail).unsqueeze(-1) * score_coefficients(
            cfg, corr, log_p_tail.unsqueeze(-1), log_q_tail.unsqueeze(-1), log_o_tail, adv,
            row_weight)  # [B, T, 1]: q_T · c_T of the tail's pseudo-token
        tail_has_tokens = centred & present.any(dim=-1)
        c_tail = torch.where(tail_has_tokens.unsqueeze(-1), c_tail, zero)
        coef = torch.where(present, coef - (c_tail / torch.exp(log_p_tail).unsqueeze(-1)) * p, zero)
        mass = mass + c_tail.squeeze(-1)
    metrics.mean("score_centering/coef_mass", mass, centred)
    term = adv * (coef.detach() * lp).sum(dim=-1)
    return torch.where(centred, term, zero)


def support_logprobs(logits: torch.Tensor, ids: torch.Tensor, present: torch.Tensor, form: str) -> torch.Tensor:
    """log p_v ``[B, T, K]`` of the trainer at the support ids (``ids`` int64 ``[B, T, K]``, ``present``
    bool: False where a row is padded), from its logits ``[B, T, V]`` (already divided by the sampling
    temperature), with grad:

        exact: z_v − logsumexp_{u ∈ S_t} z_u   (renormalised over the kept set, as replay scores y_t)
        head:  z_v − logsumexp_{u ∈ V} z_u     (the full-vocabulary distribution)

    Padded entries are 0 (they carry no coefficient). For a large V call it on one chunk of positions at
    a time: it holds ``[B, T, K]`` plus one logsumexp over ``[B, T, V]``."""
    if form not in ("exact", "head"):
        raise ValueError(f"form must be 'exact' or 'head'; got {form!r}")
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, float64 for a float64 model
    gathered = torch.gather(z, -1, ids)  # [B, T, K]
    if form == "head":
        norm = torch.logsumexp(z, dim=-1, keepdim=True)
    else:
        # a position with no support keeps its (finite) logits in the logsumexp: an all −inf one has a NaN
        # backward, which ``where`` would not stop
        inside = present | ~present.any(dim=-1, keepdim=True)
        norm = torch.logsumexp(torch.where(inside, gathered, torch.full_like(gathered, float("-inf"))), dim=-1,
                               keepdim=True)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    return torch.where(present, gathered - norm, zero)
