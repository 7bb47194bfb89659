"""Score centering's top-k tail estimator (issue #69 item 4; docs/estimators.md#score-centering): offpolicy's
``head`` form against the formulas of the paper (arXiv 2609.20807) as NeMo-RL nightly ships them, on tiny
vocabularies with every number derived by hand in the comments.

The estimator: the sampler's top-k head H is exact; outside it the sampler q is modelled as the trainer's p
rescaled, q_v = ρ·p_v with

    ρ = (1 − Σ_H q) / max(1 − Σ_H p, 1e-6).

Every tail token then has the ratio p_v/q_v = 1/ρ, so a tail token's coefficient is q_v·w(1/ρ) = α·p_v:

    token TIS [lo, hi]:  head  q_v·clamp(p_v/q_v, lo, hi) = clamp(p_v, lo·q_v, hi·q_v);  α = clamp(1, lo·ρ, hi·ρ)
    IcePop [lo, hi]:     head  p_v·1[lo ≤ p_v/q_v ≤ hi];                               α = 1[lo ≤ 1/ρ ≤ hi]
    untruncated IS:      head  p_v;                                                    α = 1

and with Σ_V p_v ∇log p_v = 0 the tail folds into the head: the centring term is
sg(A)·Σ_{v∈H} sg(head_v − α·p_v)·log p_v — untruncated, every coefficient is p_v − p_v = 0.

``policy_loss``'s per-token loss carries that term, so ∂loss/∂(support log p_v) = A·coef_v: the tests read the
coefficients off the support's gradient (the sampled token's own term goes through ``logprobs``, a separate
tensor). The trainer's p here is the anchor's π_train: ``anchor: current`` with kind reinforce (p = sg(π_θ)),
and the ``nemorl:*-score-centering`` presets (anchor old, PPO) at the step's start, where π_θ = π_old.

One difference, documented in docs/estimators.md: ``head`` floors BOTH tail masses at
``score_centering_tail_floor`` (1e-6, SkyRL #2244's and torchtitan's form), the paper's ρ only its denominator.
They differ only where 1 − Σ_H q < 1e-6; the tests below pin down by how much.
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op

TOL = dict(rtol=1e-5, atol=2e-7)  # the library computes in fp32 from fp32 log-probs of the numbers below


def head_support(lq, lp, old=None, form="head", ids=None):
    """The support ``op.Support`` of one position ``[1, 1, K]``: ids 0 … K − 1 (or ``ids``), scored."""
    ids = torch.arange(lq.shape[-1]) if ids is None else torch.tensor(ids)
    return op.Support(ids.view(lq.shape), lq, form, logprobs=lp, old_logprobs=old)


def coefficients(cfg, p_head, q_head, adv=1.0, anchor_old=False):
    """(coef_v over the head, ``score_centering/coef_mass``) of one position whose sampler head is ``q_head``
    and whose trainer log-probs over the same ids are ``p_head`` (full-vocabulary probabilities); the
    sampled token is the head's first id. ``anchor_old``: π_old = p (the step's start)."""
    lp = torch.log(torch.tensor(p_head)).view(1, 1, -1)
    lq = torch.log(torch.tensor(q_head)).view(1, 1, -1)
    support = lp.clone().requires_grad_(True)
    old = lp[..., 0] if anchor_old or cfg.kind != "reinforce" else None
    per_token, _, metrics = op.policy_loss(
        lp[..., 0].clone(), old, torch.tensor([[adv]]), torch.ones(1, 1), lq[..., 0], cfg, reduce=False,
        support=head_support(lq, support, lp.clone() if old is not None else None))
    per_token.sum().backward()
    return (support.grad / adv).view(-1), metrics["score_centering/coef_mass"]


def tis(low, high, **loss):
    return op.LossConfig(kind="reinforce", score_centering="head", **loss,
                         correction={"anchor": "current",
                                     "weight": {"level": "token", "mode": "truncate", "low": low, "high": high}})


def icepop(low, high):
    return op.LossConfig(kind="reinforce", score_centering="head",
                         correction={"anchor": "current",
                                     "weight": {"level": "token", "mode": "mask", "low": low, "high": high}})


UNTRUNCATED = op.LossConfig(kind="reinforce", score_centering="head",
                            correction={"anchor": "current", "weight": {"level": "token", "mode": "truncate"}})

# Golden A — V = 4, k = 2, token TIS [0.5, 2], the tail's lower bound binds (α > 1):
#   q = [0.45, 0.25 | 0.20, 0.10], H = {0, 1} (q's top 2): Σ_H q = 0.70, tail 0.30
#   p = [0.20, 0.70 | 0.06, 0.04]:                       Σ_H p = 0.90, tail 0.10
#   ρ = 0.30 / 0.10 = 3;  α = clamp(1, 0.5·3, 2·3) = clamp(1, 1.5, 6) = 1.5
#   head: v0 p/q = 0.444 < 0.5 → clamp(0.20, 0.225, 0.90) = 0.225;  v1 p/q = 2.8 > 2 → clamp(0.70, 0.125, 0.50) = 0.50
#   coef = [0.225 − 1.5·0.20, 0.50 − 1.5·0.70] = [−0.075, −0.55];  mass = 0.225 + 0.50 + 1.5·0.10 = 0.875
A_P, A_Q = [0.20, 0.70], [0.45, 0.25]
# Golden B — V = 4, k = 2, token TIS [0.5, 2], the tail's upper bound binds (α < 1):
#   q = [0.60, 0.35 | 0.04, 0.01]: Σ_H q = 0.95, tail 0.05;  p = [0.50, 0.30 | 0.15, 0.05]: Σ_H p = 0.80, tail 0.20
#   ρ = 0.05 / 0.20 = 0.25;  α = clamp(1, 0.125, 0.5) = 0.5   (each tail token has p/q = 1/ρ = 4 > 2)
#   head: v0 p/q = 0.833, v1 0.857, both inside → 0.50, 0.30
#   coef = [0.50 − 0.5·0.50, 0.30 − 0.5·0.30] = [0.25, 0.15];  mass = 0.80 + 0.5·0.20 = 0.90
B_P, B_Q = [0.50, 0.30], [0.60, 0.35]
# Golden C — V = 5, k = 3, IcePop [0.5, 5], a head token outside the band, the tail inside:
#   q = [0.40, 0.30, 0.20 | 0.06, 0.04]: tail 0.10;  p = [0.15, 0.60, 0.15 | 0.06, 0.04]: tail 0.10
#   ρ = 1, 1/ρ = 1 ∈ [0.5, 5] → α = 1
#   head: v0 p/q = 0.375 < 0.5 → 0;  v1 2.0 → 0.60;  v2 0.75 → 0.15
#   coef = [0 − 0.15, 0.60 − 0.60, 0.15 − 0.15] = [−0.15, 0, 0];  mass = 0.60 + 0.15 + 1·0.10 = 0.85
C_P, C_Q = [0.15, 0.60, 0.15], [0.40, 0.30, 0.20]
# Golden D — V = 5, k = 3, IcePop [0.5, 5], the tail outside the band:
#   q = [0.50, 0.30, 0.18 | 0.015, 0.005]: tail 0.02;  p = [0.40, 0.30, 0.15 | 0.10, 0.05]: tail 0.15
#   ρ = 0.02 / 0.15, 1/ρ = 7.5 > 5 → α = 0
#   head: p/q = 0.8, 1.0, 0.833, all inside → coef = [0.40, 0.30, 0.15];  mass = 0.85
D_P, D_Q = [0.40, 0.30, 0.15], [0.50, 0.30, 0.18]


@pytest.mark.parametrize(("p", "q", "adv", "coef", "mass"), [
    (A_P, A_Q, 2.0, [-0.075, -0.55], 0.875),
    (B_P, B_Q, -1.0, [0.25, 0.15], 0.90),
], ids=["A-tail-lower-bound", "B-tail-upper-bound"])
def test_token_tis_golden(p, q, adv, coef, mass):
    got, got_mass = coefficients(tis(0.5, 2.0), p, q, adv)
    torch.testing.assert_close(got, torch.tensor(coef), **TOL)
    assert got_mass == pytest.approx(mass, abs=1e-6)


@pytest.mark.parametrize(("p", "q", "coef", "mass"), [
    (C_P, C_Q, [-0.15, 0.0, 0.0], 0.85),
    (D_P, D_Q, [0.40, 0.30, 0.15], 0.85),
], ids=["C-tail-kept", "D-tail-masked"])
def test_icepop_golden(p, q, coef, mass):
    got, got_mass = coefficients(icepop(0.5, 5.0), p, q, adv=1.5)
    torch.testing.assert_close(got, torch.tensor(coef), **TOL)
    assert got_mass == pytest.approx(mass, abs=1e-6)


@pytest.mark.parametrize(("p", "q"), [(A_P, A_Q), (B_P, B_Q), (C_P, C_Q), (D_P, D_Q)], ids=list("ABCD"))
def test_untruncated_is_makes_the_coefficient_zero(p, q):
    # w = p/q: head q_v·p_v/q_v = p_v, α = ρ·(1/ρ) = 1, so coef_v = p_v − p_v = 0 whatever ρ (ρ = 3, 0.25,
    # 1 and 2/15 here); the sampler-expected weighted score is Σ_V p_v ∇log p_v = 0: nothing to centre.
    # The mass is Σ_H p + p_T = 1.
    got, mass = coefficients(UNTRUNCATED, p, q, adv=-2.0)
    torch.testing.assert_close(got, torch.zeros_like(got), rtol=0, atol=2e-7)
    assert mass == pytest.approx(1.0, abs=1e-6)


def test_nemorl_presets_give_the_goldens_at_the_steps_start():
    # nemorl:tis-score-centering: PPO, anchor old, TIS min(ρ, 2) (no lower bound: lo = 0). At the step's start
    # π_θ = π_old = p, so PPO's ratio is 1 and unclipped, and the formulas above hold with lo = 0:
    #   A: head [min(0.20, 2·0.45), min(0.70, 2·0.25)] = [0.20, 0.50]; α = clamp(1, 0, 6) = 1
    #      coef = [0.20 − 0.20, 0.50 − 0.70] = [0, −0.20]; mass = 0.20 + 0.50 + 0.10 = 0.80
    #   B: as golden B (the lower bound never bound there): [0.25, 0.15], mass 0.90
    cfg = op.LossConfig.from_preset("nemorl:tis-score-centering")
    assert cfg.score_centering == "head" and cfg.score_centering_tail_floor == 1e-6
    for p, q, coef, mass in ((A_P, A_Q, [0.0, -0.20], 0.80), (B_P, B_Q, [0.25, 0.15], 0.90)):
        got, got_mass = coefficients(cfg, p, q, adv=1.0, anchor_old=True)
        torch.testing.assert_close(got, torch.tensor(coef), **TOL)
        assert got_mass == pytest.approx(mass, abs=1e-6)
    # nemorl:icepop-score-centering: IcePop [0.5, 5] — goldens C and D as they stand
    cfg = op.LossConfig.from_preset("nemorl:icepop-score-centering")
    for p, q, coef in ((C_P, C_Q, [-0.15, 0.0, 0.0]), (D_P, D_Q, [0.40, 0.30, 0.15])):
        got, _ = coefficients(cfg, p, q, adv=-1.0, anchor_old=True)
        torch.testing.assert_close(got, torch.tensor(coef), **TOL)
    # off by default, as NeMo-RL ships it: the plain presets do not centre
    for name in ("nemorl:tis", "nemorl:icepop"):
        assert op.LossConfig.from_preset(name).score_centering is None
    # the centred preset is the plain one plus the option, nothing else
    plain = op.LossConfig.from_preset("nemorl:tis")
    assert op.LossConfig.from_preset("nemorl:tis-score-centering") == plain.model_copy(update={"score_centering": "head"})


# Where the two floors differ. Golden E — V = 4, k = 2, token TIS [0.5, 2], the sampler's head holds all of its
# mass (top-k sampling inside k, or a rounding to Σ_H q ≥ 1):
#   q = [0.70, 0.30 | 0, 0]: 1 − Σ_H q = 0 < 1e-6;  p = [0.60, 0.30 | 0.06, 0.04]: p_T = 0.10
#   head: p/q = 0.857, 1.0, inside → [0.60, 0.30]
#   paper (denominator floored only):  ρ = 0 / 0.10 = 0 → α = clamp(1, 0, 0) = 0 → coef [0.60, 0.30], mass 0.90
#   offpolicy head (both floored):     ρ = 1e-6 / 0.10 = 1e-5 → α = clamp(1, 5e-6, 2e-5) = 2e-5
#                                      → coef [0.60 − 1.2e-5, 0.30 − 6e-6] = [0.599988, 0.299994],
#                                        mass 0.90 + 2e-5·0.10 = 0.900002 (= the paper's + hi·floor)
E_P, E_Q = [0.60, 0.30], [0.70, 0.30]


def test_at_tail_floor_1e_6_where_the_sampler_tail_is_below_it():
    cfg = tis(0.5, 2.0, score_centering_tail_floor=1e-6)
    got, mass = coefficients(cfg, E_P, E_Q)
    torch.testing.assert_close(got, torch.tensor([0.599988, 0.299994]), rtol=0, atol=3e-7)
    assert mass == pytest.approx(0.900002, abs=2e-7)
    paper = torch.tensor([0.60, 0.30])
    assert ((paper - got) - torch.tensor([1.2e-5, 6e-6])).abs().max() < 3e-7  # α·p_v, α = hi·floor/p_T


def _logit_grads(cfg, probs, head, q_head, adv, paper_alpha):
    """∇_z of the centring term for p = softmax(z): offpolicy's ``head`` (through policy_loss) and the paper's
    coefficients written out (clamp(p_v, lo·q_v, hi·q_v) − α_paper·p_v, TIS [0.5, 2])."""
    z0 = torch.log(torch.tensor(probs, dtype=torch.float64))
    q = torch.tensor(q_head)
    z = z0.clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1)[head].float().view(1, 1, -1)
    lq = torch.log(q).view(1, 1, -1)
    with_term, _, _ = op.policy_loss(lp[..., 0].detach(), None, torch.tensor([[adv]]), torch.ones(1, 1),
                                     lq[..., 0], cfg, reduce=False, support=head_support(lq, lp, ids=head))
    with_term.sum().backward()
    ours = z.grad.clone()
    z = z0.clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1)[head]
    p = lp.detach().exp()
    coef = torch.minimum(torch.maximum(p, 0.5 * q.double()), 2.0 * q.double()) - paper_alpha * p
    (adv * (coef * lp).sum()).backward()
    return ours, z.grad


def test_the_floors_differ_in_the_coefficients_by_alpha_p_and_in_the_gradient_by_at_most_hi_floor():
    """The coefficients are not unique: adding β·p_v to every head coefficient adds β·Σ_H p_v ∇log p_v = −β·∇p_T
    to the gradient, which vanishes with the trainer's tail. So the floors' difference Δα = α_ours − α_paper is
    worth |A|·Δα·p_T·max|1_T − p| ≤ |A|·hi·floor per logit, however large Δα."""
    cfg = tis(0.5, 2.0)
    floor, hi, adv = 1e-6, 2.0, 3.0
    # golden E over the logits: Δα = 2e-5, Δα·p_T = 2e-6 = hi·floor
    ours, paper = _logit_grads(cfg, [0.60, 0.30, 0.06, 0.04], [0, 1], E_Q, adv, paper_alpha=0.0)
    diff = (ours.double() - paper).abs().max().item()
    assert 1e-7 < diff <= adv * hi * floor * 1.05
    # Golden G — the trainer's tail below the floor too: p = [0.6, 0.4 | 5e-10, 5e-10], q = [0.7, 0.3 | 0, 0].
    #   offpolicy: p_T and q_T both floored at 1e-6 → ρ = 1 → α = clamp(1, 0.5, 2) = 1 → coef [0.6 − 0.6, 0.4 − 0.4] = 0
    #   paper:     ρ = 0 / 1e-6 = 0 → α = 0 → coef [0.6, 0.4]: different by p_v, yet
    #   Σ_H p_v ∇log p_v = −∇p_T = O(1e-9): both gradients are ~0 and agree
    got, _ = coefficients(cfg, [0.6, 0.4], [0.7, 0.3])
    torch.testing.assert_close(got, torch.zeros(2), rtol=0, atol=2e-7)
    ours, paper = _logit_grads(cfg, [0.6, 0.4, 5e-10, 5e-10], [0, 1], [0.7, 0.3], adv, paper_alpha=0.0)
    assert paper.abs().max() < 1e-8 and ours.abs().max() < 1e-6
    assert (ours.double() - paper).abs().max().item() <= adv * hi * floor


def test_head_is_exact_where_the_tail_is_truly_proportional():
    """Whole-vocabulary check of the model behind the goldens: where q's tail IS ρ·p, the head form's gradient
    equals ``exact`` over the whole vocabulary (token TIS [0.5, 2] and IcePop [0.5, 5]; golden A's head)."""
    p = torch.tensor([0.20, 0.70, 0.06, 0.04])
    q = torch.tensor([0.45, 0.25, 0.0, 0.0])
    q[2:] = 3.0 * p[2:]  # ρ = 3: q's tail = [0.18, 0.12], Σ q = 1
    for cfg in (tis(0.5, 2.0), icepop(0.5, 5.0)):
        grads = []
        for form, ids in (("head", [0, 1]), ("exact", [0, 1, 2, 3])):
            z = torch.log(p).clone().requires_grad_(True)
            lp = torch.log_softmax(z, -1)[ids].view(1, 1, -1)
            lq = torch.log(q[ids]).view(1, 1, -1)
            per_token, _, _ = op.policy_loss(lp[..., 0].detach(), None, torch.tensor([[1.0]]), torch.ones(1, 1),
                                             lq[..., 0], cfg.model_copy(update={"score_centering": form}),
                                             reduce=False, support=head_support(lq, lp, form=form, ids=ids))
            per_token.sum().backward()
            grads.append(z.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
        assert grads[1].abs().max() > 1e-2  # the truncation left a drift to remove
    assert math.isclose(float(q.sum()), 1.0, abs_tol=1e-6)
