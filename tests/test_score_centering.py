"""Score centering (arXiv 2609.20807; docs/estimators.md#score-centering): exact gradients on tabular
policies.

A one-step (bandit) softmax policy p = softmax(θ) over V tokens, a sampler q. The batch holds every
outcome a once (row a samples token a), and the expectation under q of a per-token loss is
Σ_a q_a ℓ_a — computed by enumeration, no sampling noise. For each configuration the test writes
down c_v, the coefficient of ∇log p_v the loss gives token v (IS weight × the kind's score factor),
by hand, and checks

    E_q[∇ℓ_centred] = E_q[∇ℓ_uncentred] + Σ_a q_a A_a Σ_v q_v c_v(a) ∇log p_v       (the drift, removed)

with ∇_θ log p_v = e_v − p, and E_q[∇ℓ_uncentred] = −Σ_a q_a A_a c_a(a) (e_a − p) against that same
hand-written c.
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.core.config import RatioRule
from offpolicy.core.errors import ConfigError

TOL = dict(rtol=2e-5, atol=2e-6)  # the answers are float64; the library computes in fp32
F64 = torch.float64

THETA = torch.tensor([0.3, -0.5, 1.1, 0.0, -1.2], dtype=F64)
Q = torch.tensor([0.30, 0.10, 0.35, 0.15, 0.10], dtype=F64)  # the sampler, not the trainer
ADV = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=F64)  # A as a function of the sampled token
OLD = torch.tensor([0.25, 0.15, 0.30, 0.20, 0.10], dtype=F64)  # π_old (anchor old)


def _batch(theta, q, support, old=None):
    """Rows a ∈ support sample token a; the support of every row is ``support`` (exact: p and q, old
    renormalised over it). Returns the policy_loss tensors ([n, 1]) and the support's ([n, 1, K])."""
    ids = torch.tensor(support)
    logp = torch.log_softmax(theta[ids], -1)  # trainer, renormalised over the set
    logq = torch.log(q[ids] / q[ids].sum())
    n = len(support)
    tensors = dict(
        logprobs=logp.unsqueeze(-1).float(),
        rollout_logprobs=logq.unsqueeze(-1).float(),
        advantages=ADV[ids].unsqueeze(-1).float(),
        mask=torch.ones(n, 1),
        support_ids=ids.expand(n, -1).unsqueeze(1),
        support_logprobs=logp.expand(n, -1).unsqueeze(1).float(),
        support_logq=logq.expand(n, -1).unsqueeze(1).float(),
    )
    if old is not None:
        logo = torch.log(old[ids] / old[ids].sum())
        tensors["old_logprobs"] = logo.unsqueeze(-1).float()
        tensors["support_logo"] = logo.expand(n, -1).unsqueeze(1).float()
    return tensors


def expected_grad(cfg, support, centred, theta=THETA, q=Q, old=None):
    """E_q[∇_θ ℓ] by enumeration, ℓ the unreduced per-token loss of row a weighted by q_a."""
    theta = theta.detach().clone().requires_grad_(True)
    t = _batch(theta, q, support, old)
    ids = torch.tensor(support)
    qs = (q[ids] / q[ids].sum()).float()
    config = cfg if centred else cfg.model_copy(update={"score_centering": None})
    support = op.Support(t["support_ids"], t["support_logq"], "exact", logprobs=t["support_logprobs"],
                         old_logprobs=t.get("support_logo")) if centred else None
    per_token, _, _ = op.policy_loss(t["logprobs"], t.get("old_logprobs"), t["advantages"], t["mask"],
                                     t["rollout_logprobs"], config, reduce=False, support=support)
    (per_token.squeeze(-1) * qs).sum().backward()
    return theta.grad


def hand(coef, support, theta=THETA, q=Q):
    """(E_q[∇ℓ_uncentred], drift) from the hand-written c_v(a) (``coef(a, p, q)`` → [K] over the support)."""
    ids = torch.tensor(support)
    p = torch.softmax(theta[ids], -1)
    qs = q[ids] / q[ids].sum()
    k = len(support)
    score = torch.zeros(k, theta.numel(), dtype=F64)  # ∇_θ log p_v over the set = e_v − p (on the set's ids)
    for i, v in enumerate(support):
        score[i, ids] -= p
        score[i, v] += 1.0
    uncentred = torch.zeros(theta.numel(), dtype=F64)
    drift = torch.zeros(theta.numel(), dtype=F64)
    for i, a in enumerate(support):
        c = coef(ADV[a], p, qs)
        uncentred -= qs[i] * ADV[a] * c[i] * score[i]
        drift += qs[i] * ADV[a] * (qs * c) @ score
    return uncentred, drift


def _split(grad_fn_cfg, support, coef, old=None):
    centred = expected_grad(grad_fn_cfg, support, True, old=old)
    uncentred = expected_grad(grad_fn_cfg, support, False, old=old)
    hand_uncentred, drift = hand(coef, support)
    torch.testing.assert_close(uncentred, hand_uncentred, **TOL)
    torch.testing.assert_close(centred, uncentred + drift, **TOL)
    return centred, uncentred, drift


FULL = [0, 1, 2, 3, 4]


def scored(logprobs, rollout_logprobs, form="exact", old_logprobs=None):
    """A support of K ids 0 … K − 1 at each position, scored: ``op.Support`` over ``[B, T, K]`` log-probs."""
    ids = torch.arange(logprobs.shape[-1]).expand(logprobs.shape)
    return op.Support(ids, rollout_logprobs, form, logprobs=logprobs, old_logprobs=old_logprobs)


def test_reinforce_with_truncated_token_weight():
    cfg = op.LossConfig(kind="reinforce", score_centering="exact",
                        correction={"anchor": "current", "weight": {"level": "token", "mode": "truncate", "high": 1.2}})
    _, _, drift = _split(cfg, FULL, lambda a, p, q: (p / q).clamp(max=1.2))
    assert drift.abs().max() > 1e-3  # the cap makes q·w ≠ p: there is a drift to remove


def test_ipo_form_prob_diff_mask_and_value_cap():
    # prime-rl's IPO: bypass (π_old = μ), PPO without a clip, value cap, |p − q| ≤ 0.1 trust region
    cfg = op.LossConfig(kind="ppo", clip_low=None, clip_high=None, ratio_value_cap=1.3, score_centering="exact",
                        correction={"anchor": "rollout", "reject": [{"stat": "prob_diff", "low": 0.1, "high": 0.1}],
                                    "denominator": "fixed"})

    def coef(a, p, q):
        return (p / q).clamp(max=1.3) * ((p - q).abs() <= 0.1).to(F64)

    _, _, drift = _split(cfg, FULL, coef)
    assert drift.abs().max() > 1e-3


def test_ppo_anchor_old_masked_weight_clip_depends_on_the_sign_of_a():
    cfg = op.LossConfig(kind="ppo", score_centering="exact",
                        correction={"weight": {"level": "token", "mode": "mask", "low": 0.8, "high": 1.2}})
    o = OLD

    def coef(a, p, q):
        rho = o / q
        r = p / o
        active = (r <= 1.2) if a >= 0 else (r >= 0.8)
        return rho * ((rho >= 0.8) & (rho <= 1.2)).to(F64) * r * active.to(F64)

    _split(cfg, FULL, coef, old=o)


def test_cispo_with_token_band_rule():
    cfg = op.LossConfig(kind="cispo", clip_high=0.5, score_centering="exact",
                        correction={"anchor": "rollout",
                                    "reject": [{"stat": "ratio", "level": "token", "low": 0.6, "high": 1.6}]})

    def coef(a, p, q):
        rho = p / q
        return rho.clamp(max=1.5) * ((rho >= 0.6) & (rho <= 1.6)).to(F64)

    _split(cfg, FULL, coef)


def test_exact_over_a_kept_set():
    # the engine kept {0, 2, 3}: p and q renormalised over it, the drift is over the set
    cfg = op.LossConfig(kind="reinforce", score_centering="exact",
                        correction={"anchor": "current", "weight": {"level": "token", "mode": "truncate", "high": 1.2}})
    _split(cfg, [0, 2, 3], lambda a, p, q: (p / q).clamp(max=1.2))


def test_constant_advantage_leaves_no_expected_update():
    # the paper's point: with A the same for every outcome, the uncentred update is pure drift
    # E_q[A]·E_q[∇log p] ≠ 0 (towards the sampler); the centred one is exactly 0
    global ADV
    saved = ADV
    ADV = torch.full_like(saved, 2.0)
    try:
        cfg = op.LossConfig(kind="reinforce", score_centering="exact")
        centred, uncentred, _ = _split(cfg, FULL, lambda a, p, q: torch.ones_like(p))
    finally:
        ADV = saved
    assert uncentred.abs().max() > 1e-2
    torch.testing.assert_close(centred, torch.zeros_like(centred), **TOL)


def test_exact_importance_weight_has_nothing_to_centre():
    # w = p/q untruncated: Σ_v q_v w_v ∇log p_v = Σ_v p_v ∇log p_v = 0, so centring changes no gradient
    cfg = op.LossConfig(kind="reinforce", score_centering="exact",
                        correction={"anchor": "current", "weight": {"level": "token", "mode": "truncate"}})
    _, _, drift = _split(cfg, FULL, lambda a, p, q: p / q)
    torch.testing.assert_close(drift, torch.zeros_like(drift), **TOL)


def test_head_with_a_proportional_tail_equals_exact_over_the_vocabulary():
    # q's tail outside the head H = {0, 2} is exactly λ·p there: the head form's model is then the truth,
    # so its gradient equals the exact form's over the whole vocabulary
    p = torch.softmax(THETA, -1)
    head = [0, 2]
    q = torch.zeros_like(p)
    q[head] = torch.tensor([0.45, 0.30], dtype=F64)
    tail = [1, 3, 4]
    q[tail] = p[tail] * (1 - q[head].sum()) / p[tail].sum()
    corr = {"anchor": "rollout", "reject": [{"stat": "ratio", "level": "token", "low": 0.5, "high": 1.5}],
            "denominator": "fixed"}
    exact_cfg = op.LossConfig(kind="ppo", clip_low=None, clip_high=None, score_centering="exact", correction=corr)
    head_cfg = exact_cfg.model_copy(update={"score_centering": "head"})

    def grad(cfg, support):
        theta = THETA.detach().clone().requires_grad_(True)
        logp_all = torch.log_softmax(theta, -1)
        rows = torch.arange(5)
        sup = torch.tensor(support)
        per_token, _, _ = op.policy_loss(
            logp_all[rows].unsqueeze(-1).float(), None, ADV.unsqueeze(-1).float(), torch.ones(5, 1),
            q.log()[rows].unsqueeze(-1).float(), cfg, reduce=False,
            support=op.Support(sup.expand(5, -1).unsqueeze(1), q.log()[sup].expand(5, -1).unsqueeze(1).float(),
                               cfg.score_centering, logprobs=logp_all[sup].expand(5, -1).unsqueeze(1).float()))
        (per_token.squeeze(-1) * q.float()).sum().backward()
        return theta.grad

    full = grad(exact_cfg, FULL)
    torch.testing.assert_close(grad(head_cfg, head), full, **TOL)
    # and centring did something: the uncentred gradient differs
    theta = THETA.detach().clone().requires_grad_(True)
    logp_all = torch.log_softmax(theta, -1)
    per_token, _, _ = op.policy_loss(logp_all.unsqueeze(-1).float(), None, ADV.unsqueeze(-1).float(), torch.ones(5, 1),
                                     q.log().unsqueeze(-1).float(), exact_cfg.model_copy(update={"score_centering": None}),
                                     reduce=False)
    (per_token.squeeze(-1) * q.float()).sum().backward()
    assert (theta.grad - full).abs().max() > 1e-3


def test_sequence_weight_is_the_rows_and_a_rejected_row_is_not_centred():
    # T = 2, positions independent; a sequence TIS weight: every support token of a row takes the row's
    # weight; a row the sequence rule rejects carries no centring term
    lp = torch.log(torch.tensor([[0.5, 0.3], [0.2, 0.6]]))
    lq = torch.log(torch.tensor([[0.4, 0.3], [0.5, 0.2]]))
    sup_p = torch.log(torch.tensor([[[0.5, 0.5], [0.3, 0.7]], [[0.2, 0.8], [0.6, 0.4]]]))
    sup_q = torch.log(torch.tensor([[[0.4, 0.6], [0.3, 0.7]], [[0.5, 0.5], [0.2, 0.8]]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    cfg = op.LossConfig(kind="reinforce", score_centering="exact",
                        correction={"anchor": "current", "weight": {"level": "sequence", "mode": "truncate", "high": 2.0},
                                    "reject": [{"stat": "ratio", "level": "sequence", "low": 0.5, "high": 2.5}]})
    sp = sup_p.clone().requires_grad_(True)
    per_token, _, _ = op.policy_loss(lp, None, adv, torch.ones(2, 2), lq, cfg, reduce=False,
                                     support=scored(sp, sup_q))
    per_token.sum().backward()
    # row 0: Π ρ = (0.5/0.4)(0.3/0.3) = 1.25 kept, w = 1.25; row 1: (0.2/0.5)(0.6/0.2) = 1.2 kept, w = 1.2
    expected = torch.zeros(2, 2, 2)
    expected[0] = 1.0 * torch.exp(sup_q[0]) * 1.25
    expected[1] = -1.0 * torch.exp(sup_q[1]) * 1.2
    torch.testing.assert_close(sp.grad, expected, **TOL)
    # a band that rejects row 1: its support gets no gradient
    cfg2 = cfg.model_copy(update={"correction": cfg.correction.model_copy(
        update={"reject": [RatioRule(stat="ratio", level="sequence", low=1.22, high=2.5)]})})
    sp = sup_p.clone().requires_grad_(True)
    per_token, _, _ = op.policy_loss(lp, None, adv, torch.ones(2, 2), lq, cfg2, reduce=False,
                                     support=scored(sp, sup_q))
    per_token.sum().backward()
    torch.testing.assert_close(sp.grad[1], torch.zeros(2, 2))
    torch.testing.assert_close(sp.grad[0], expected[0], **TOL)


def test_a_token_the_rule_rejected_is_still_centred_and_padding_counts_nowhere():
    # prime-rl: "applies to every loss token, including ones whose sampled token IPO masks"
    cfg = op.LossConfig(kind="reinforce", score_centering="exact",
                        correction={"anchor": "current", "reject": [{"stat": "ratio", "level": "token", "high": 1.1}],
                                    "denominator": "fixed"})
    lp = torch.log(torch.tensor([[0.6]]))
    lq = torch.log(torch.tensor([[0.3]]))  # ρ = 2: the sampled token is rejected
    sup_p = torch.log(torch.tensor([[[0.6, 0.4, 0.5]]]))
    sup_q = torch.log(torch.tensor([[[0.3, 0.7, 0.0]]]))  # the third entry is padding (q = 0, −inf)
    sp = sup_p.clone().requires_grad_(True)
    per_token, _, _ = op.policy_loss(lp, None, torch.tensor([[2.0]]), torch.ones(1, 1), lq, cfg, reduce=False,
                                     support=scored(sp, sup_q))
    per_token.sum().backward()
    # v = 0: ρ = 2 rejected (c = 0); v = 1: ρ = 0.4/0.7 kept (c = 1) → ∂/∂log p_1 = A·q_1 = 1.4
    torch.testing.assert_close(sp.grad, torch.tensor([[[0.0, 1.4, 0.0]]]), **TOL)
    torch.testing.assert_close(per_token, torch.tensor([[2.0 * 0.7 * math.log(0.4)]]), **TOL)


def test_only_the_reference_computes_it_and_the_config_is_checked():
    cfg = op.LossConfig(kind="ppo", score_centering="exact", correction={"anchor": "rollout"})
    lp = torch.log(torch.tensor([[0.5]]))
    for rung in ("eager", "compiled"):
        with pytest.raises(ValueError, match="does not cover"):
            op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg, implementation=rung,
                           support=scored(lp.unsqueeze(-1), lp.unsqueeze(-1)))
    unscored = op.Support(torch.zeros(1, 1, 1, dtype=torch.long), lp.unsqueeze(-1), "exact")
    with pytest.raises(ValueError, match="needs the trainer's log p_v.*Support.logprobs"):
        op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg, support=unscored)
    with pytest.raises(ValueError, match="support.form is 'head' but loss.score_centering is 'exact'"):
        op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg,
                       support=scored(lp.unsqueeze(-1), lp.unsqueeze(-1), "head"))
    with pytest.raises(ValueError, match=r"\[B, T\] = \(1, 1\)"):
        op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg,
                       support=scored(torch.zeros(2, 1, 1), torch.zeros(2, 1, 1)))
    # no support recorded (a host, diagnose, an engine without sets): no centring, and the metric says so
    plain, _ = op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg.model_copy(update={"score_centering": None}))
    bare, metrics = op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg)
    assert bare.item() == plain.item() and metrics["score_centering/applied"] == 0.0
    _, metrics = op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg,
                                support=scored(lp.unsqueeze(-1), lp.unsqueeze(-1)))
    assert metrics["score_centering/applied"] == 1.0
    with pytest.raises(ValueError, match="which is off"):
        op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, {"correction": {"anchor": "rollout"}},
                       support=scored(lp.unsqueeze(-1), lp.unsqueeze(-1)))
    with pytest.raises(ConfigError, match="kinds ppo, cispo and reinforce"):
        op.LossConfig(kind="gspo", score_centering="exact")
    with pytest.raises(ConfigError, match="resolve_thresholds"):
        op.LossConfig(kind="reinforce", score_centering="head",
                      correction={"anchor": "current", "reject": [{"stat": "m2", "high": 0.04}]})
    with pytest.raises(ConfigError, match="ratio_value_cap"):
        op.LossConfig(kind="cispo", ratio_value_cap=10.0)


def test_the_loose_support_arguments_of_0_1_name_the_support_bundle():
    """Issue #68: ``policy_loss`` takes score centering's support as one ``offpolicy.Support``; the three loose
    tensors it took before raise a TypeError naming ``support=`` and the field each became (0.x: no alias), and any
    other unknown keyword still fails as Python's would."""
    cfg = op.LossConfig(kind="reinforce", score_centering="exact", correction={"anchor": "current"})
    lp = torch.log(torch.tensor([[0.5]]))
    for name, field in (("support_logprobs", "logprobs"), ("support_rollout_logprobs", "rollout_logprobs"),
                        ("support_old_logprobs", "old_logprobs")):
        with pytest.raises(TypeError, match=rf"no longer takes {name}.*support=offpolicy.Support.*Support.{field}"):
            op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg, **{name: lp.unsqueeze(-1)})
    with pytest.raises(TypeError, match="unexpected keyword argument 'suport'"):
        op.policy_loss(lp, None, torch.ones(1, 1), torch.ones(1, 1), lp, cfg, suport=None)
    assert "Support" in op.__all__ and op.Support is op.core.centering.Support


def test_a_support_checks_its_own_shapes_and_form():
    """``Support`` is a frozen bundle: ids ``[B, T, K]`` int, every log-prob tensor of the ids' shape and float, a
    form ``exact`` or ``head``; ``mask`` is where log q > −inf; ``select``/``cut``/``scored`` keep the fields."""
    import dataclasses

    ids = torch.tensor([[[3, 5, 0]], [[4, 0, 0]]])
    lq = torch.log(torch.tensor([[[0.6, 0.4, 0.0]], [[1.0, 0.0, 0.0]]]))
    support = op.Support(ids, lq, "exact")
    assert support.mask.tolist() == [[[True, True, False]], [[True, False, False]]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        support.form = "head"
    with pytest.raises(ValueError, match="form must be one of exact, head"):
        op.Support(ids, lq, "top_k")
    with pytest.raises(ValueError, match="ids must be an integer"):
        op.Support(ids.float(), lq, "exact")
    with pytest.raises(ValueError, match=r"Support.logprobs must have the ids' shape"):
        op.Support(ids, lq, "exact", logprobs=torch.zeros(2, 1, 2))
    with pytest.raises(ValueError, match="Support.rollout_logprobs must be a float"):
        op.Support(ids, ids, "exact")
    lp = torch.full_like(lq, -0.5)
    done = support.scored(lp, lp - 1)
    assert done.ids is ids and done.logprobs is lp and support.logprobs is None
    first = done.select(torch.tensor([1])).cut(1)  # row 1 uses one slot
    assert first.ids.tolist() == [[[4]]] and first.old_logprobs.tolist() == [[[-1.5]]] and first.form == "exact"


def test_support_logprobs_from_logits_match_the_replayed_and_full_distributions():
    from offpolicy.core.centering import support_logprobs
    from offpolicy.core.sampling import renormalize_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g)
    keep = torch.rand(2, 3, 7, generator=g) < 0.5
    keep[..., 0] = True
    keep[1, 2] = False  # a position with no set: nothing present, nothing NaN
    ids = torch.arange(7).expand(2, 3, 7)
    z = logits.clone().requires_grad_(True)
    exact = support_logprobs(z, ids, keep, "exact")
    replayed = renormalize_logprobs(logits, keep=keep)
    torch.testing.assert_close(exact[keep], replayed[keep])
    assert (exact[~keep] == 0).all()
    exact.sum().backward()
    assert torch.isfinite(z.grad).all()
    head = support_logprobs(logits, ids[..., :3], torch.ones(2, 3, 3, dtype=torch.bool), "head")
    torch.testing.assert_close(head, torch.log_softmax(logits, -1)[..., :3])


def skyrl_2244_term(current, old, behavior, adv, mask, tis_cap, eps_low, eps_high, floor=1e-6):
    """SkyRL #2244's ``ppo_tis_score_centering_correction`` (open PR; skyrl_train/objective/score_centering.py
    on its branch), written out from its code: the per-token term added before the loss reduction, over
    the sampler's top-k head with the tail modelled as rescaled copies of p (log-ratios clipped at ±20)."""
    def ratio(a, b):
        return (a - b).clamp(-20, 20).exp()

    p_m, o_m, q_m = current.exp(), old.exp(), behavior.exp()
    p_tail = (1 - p_m.sum(-1)).clamp_min(floor)
    o_tail = (1 - o_m.sum(-1)).clamp_min(floor)
    q_tail = (1 - q_m.sum(-1)).clamp_min(floor)
    ppo_ratio = ratio(current, old)
    tis = ratio(old, behavior).clamp(max=tis_cap)
    positive = adv.unsqueeze(-1) >= 0
    active = torch.where(positive, ppo_ratio <= 1 + eps_high, ppo_ratio >= 1 - eps_low)
    head = q_m * tis * ppo_ratio * active
    tail_ratio = p_tail / o_tail
    tail_active = torch.where(adv >= 0, tail_ratio <= 1 + eps_high, tail_ratio >= 1 - eps_low)
    tail = (q_tail / p_tail) * (o_tail / q_tail).clamp(max=tis_cap) * tail_ratio * tail_active
    residual = head - tail.unsqueeze(-1) * p_m
    return (adv * (residual.detach() * current).sum(-1)).masked_fill(~mask, 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_head_form_is_skyrl_2244s_with_anchor_old_token_tis_and_ppo_clip(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, V, K = 2, 5, 12, 4
    z_p, z_o, z_q = (torch.randn(B, T, V, generator=g) for _ in range(3))
    z_o, z_q = z_p + 0.3 * z_o, z_p + 0.8 * z_q
    lq_full = torch.log_softmax(z_q, -1)
    head = lq_full.topk(K, dim=-1).indices  # the sampler's top-k ids
    sampled = torch.multinomial(lq_full.exp().view(-1, V), 1, generator=g).view(B, T)
    adv = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    lo_full = torch.log_softmax(z_o, -1)
    cfg = op.LossConfig(kind="ppo", clip_low=0.2, clip_high=0.28, score_centering="head",
                        correction={"weight": {"level": "token", "mode": "truncate", "high": 2.0}})

    def run(centred):
        z = z_p.clone().requires_grad_(True)
        lp_full = torch.log_softmax(z, -1)
        pick = sampled.unsqueeze(-1)
        support = op.Support(head, lq_full.gather(-1, head), "head", logprobs=lp_full.gather(-1, head),
                             old_logprobs=lo_full.gather(-1, head)) if centred else None
        per_token, _, _ = op.policy_loss(
            lp_full.gather(-1, pick).squeeze(-1), lo_full.gather(-1, pick).squeeze(-1), adv, mask.float(),
            lq_full.gather(-1, pick).squeeze(-1), cfg if centred else cfg.model_copy(update={"score_centering": None}),
            reduce=False, support=support)
        per_token.sum().backward()
        return per_token.detach(), z.grad

    with_term, g_with = run(True)
    without, g_without = run(False)
    z = z_p.clone().requires_grad_(True)
    lp_full = torch.log_softmax(z, -1)
    theirs = skyrl_2244_term(lp_full.gather(-1, head), lo_full.gather(-1, head), lq_full.gather(-1, head), adv, mask,
                             tis_cap=2.0, eps_low=0.2, eps_high=0.28)
    theirs.sum().backward()
    torch.testing.assert_close(with_term - without, theirs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_with - g_without, z.grad, rtol=1e-4, atol=1e-6)
    assert theirs.abs().max() > 1e-3


@pytest.mark.parametrize("where", ["rollout_logprobs", "logprobs", "old_logprobs"])
def test_a_non_finite_support_value_follows_the_nonfinite_policy(where):
    """Only −inf pads a support. A NaN (or +inf) log q, trainer or π_old log-prob in the support of a centred token
    is an error under ``nonfinite: error`` (and without a correction); under ``mask_token``/``neutral`` that token is
    left uncentred — the loss of the same batch with the token's support all padding — and under
    ``mask_sequence`` its row; ``score_centering/nonfinite_tokens`` counts them."""
    g = torch.Generator().manual_seed(0)
    b, t, k = 3, 4, 5
    lp = torch.randn(b, t, generator=g) - 2
    old = lp + 0.1 * torch.randn(b, t, generator=g)
    mu = lp + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.tensor([[1.0], [-1.0], [0.5]]).expand(b, t)
    sup = torch.randn(b, t, k, generator=g).log_softmax(-1)
    tensors = {"logprobs": sup.clone(), "rollout_logprobs": (sup + 0.05).clone(), "old_logprobs": (sup - 0.05).clone()}
    tensors[where][1, 2, 3] = float("nan")

    def loss(policy, support):
        cfg = op.LossConfig(score_centering="head", correction={"anchor": "old", "nonfinite": policy,
                                                                  "weight": {"level": "token", "mode": "truncate", "high": 2.0}})
        return op.policy_loss(lp, old, adv, torch.ones(b, t), mu, cfg, support=scored(form="head", **support))

    with pytest.raises(ValueError, match=f"Support.{where} has 1 non-finite value.*correction.nonfinite"):
        loss("error", tensors)
    with pytest.raises(ValueError, match=f"Support.{where}"):
        op.policy_loss(lp, old, adv, torch.ones(b, t), mu, op.LossConfig(score_centering="head"),
                       support=scored(form="head", **tensors))
    padded = {name: value.clone() for name, value in tensors.items()}
    padded["rollout_logprobs"][1, 2] = float("-inf")  # the token's support: all padding
    padded[where][1, 2] = 0.0 if where != "rollout_logprobs" else float("-inf")
    for policy, rows in (("mask_token", None), ("neutral", None), ("mask_sequence", 1)):
        got, metrics = loss(policy, tensors)
        if rows is not None:
            padded["rollout_logprobs"][rows] = float("-inf")
        want, _ = loss(policy, padded)
        assert torch.isfinite(got) and float(got) == pytest.approx(float(want), abs=1e-7)
        assert metrics["score_centering/nonfinite_tokens"] == (t if policy == "mask_sequence" else 1)
