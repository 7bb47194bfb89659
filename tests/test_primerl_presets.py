"""prime-rl's newest losses as presets (issue #56 item 2): IPO (eps 0.3, value cap 1e4, no KL), IPO with
score centering, IcePop [0.2, 5], PPO [0.8, 1.2] with the value cap, CISPO [0, 5] — each against goldens
derived by hand and against a literal transcription of prime-rl's code (src/prime_rl/trainer/rl/loss.py
IPOLoss / IcePopLoss / PPOLoss / CISPOLoss and compute_loss's division by rl_scale, as read for
docs/presets.md), loss and gradient. The older forms keep their commits (prime-rl@559b447:ipo,
prime-rl@008468c:icepop: tests/test_frameworks_ext.py)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op

LN = math.log


def _row(preset, pi, mu, adv, **support):
    """One row of tokens with π_θ = ``pi``, μ = ``mu``; returns (loss, ∂loss/∂log π_θ)."""
    lp = torch.log(torch.tensor([pi], dtype=torch.float32)).requires_grad_(True)
    loss, _ = op.policy_loss(lp, None, torch.tensor([adv], dtype=torch.float32), torch.ones(1, len(pi)),
                             torch.log(torch.tensor([mu], dtype=torch.float32)), preset, **support)
    loss.backward()
    return loss.item(), lp.grad[0].tolist()


# ipo: |π − μ| = (0.1, 0.6) → the second is dropped; −(0.5/0.4)/2 (rl_scale = 2 loss tokens) = −0.625,
#   ∂/∂log π = (−1.25/2, 0)
# ipo value cap: ρ = 0.02/1e-6 = 2e4 > 1e4, |Δp| = 0.02 kept → value 1e4 with the gradient of ρ there:
#   −(1e4 + 1)/2 = −5000.5, ∂ = (−5000, −0.5)   (uncapped it would be −10000.5)
# icepop: ρ = (0.19, 4.9): 0.19 < 0.2 dropped, 4.9 ≤ 5 kept → −4.9/2 = −2.45, ∂ = (0, −2.45)
# ppo, A = +1: r = (1.5, 0.5) → min(1.5, 1.2) = 1.2 (clipped, no gradient), min(0.5, 0.8) = 0.5 →
#   −(1.2 + 0.5)/2 = −0.85, ∂ = (0, −0.25); A = −1: −min(−1.5, −1.2) = 1.5 (unclipped), −min(−0.5, −0.8) = 0.8
#   (clipped) → 1.15, ∂ = (0.75, 0)
# cispo: ρ = (8, 0.5) → w = (min(8, 5), 0.5) detached: −(5·ln 0.8 + 0.5·ln 0.2)/2, ∂ = (−2.5, −0.25)
@pytest.mark.parametrize("preset, pi, mu, adv, want, grad", [
    ("prime-rl:ipo", (0.5, 0.7), (0.4, 0.1), (1.0, 1.0), -0.625, (-0.625, 0.0)),
    ("prime-rl:ipo", (0.02, 0.5), (1e-6, 0.5), (1.0, 1.0), -5000.5, (-5000.0, -0.5)),
    ("prime-rl:icepop", (0.019, 0.49), (0.1, 0.1), (1.0, 1.0), -2.45, (0.0, -2.45)),
    ("prime-rl:ppo", (0.6, 0.2), (0.4, 0.4), (1.0, 1.0), -0.85, (0.0, -0.25)),
    ("prime-rl:ppo", (0.6, 0.2), (0.4, 0.4), (-1.0, -1.0), 1.15, (0.75, 0.0)),
    ("prime-rl:cispo", (0.8, 0.2), (0.1, 0.4), (1.0, 1.0), -(5 * LN(0.8) + 0.5 * LN(0.2)) / 2, (-2.5, -0.25)),
])
def test_newest_prime_rl_goldens(preset, pi, mu, adv, want, grad):
    loss, g = _row(preset, pi, mu, adv)
    assert loss == pytest.approx(want, rel=1e-5)
    assert g == pytest.approx(grad, rel=1e-5, abs=1e-6)


def test_ipo_score_centering_golden():
    # one token, the engine's kept set {a, b, c}: π over it (0.6, 0.3, 0.1), q (0.2, 0.45, 0.35); a sampled.
    # |π − q| = (0.4, 0.15, 0.25): a is outside eps 0.3 → its pg term is 0, but it is centred all the same.
    # coef_v = q_v·min(π_v/q_v, 1e4)·1[|Δ| ≤ 0.3] = (0, 0.3, 0.1); A = 2, rl_scale 1:
    # loss = 2·(0.3·ln 0.3 + 0.1·ln 0.1), ∂/∂log p_v = 2·coef_v = (0, 0.6, 0.2); through the set's
    # softmax, ∂/∂z = g − (Σ g)·p = (−0.48, 0.36, 0.12): the drift towards b and c is removed.
    z = torch.log(torch.tensor([0.6, 0.3, 0.1])).requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    sup_q = torch.log(torch.tensor([[[0.2, 0.45, 0.35]]]))
    loss, _ = op.policy_loss(logp[:1].view(1, 1), None, torch.tensor([[2.0]]), torch.ones(1, 1), sup_q[..., 0],
                             "prime-rl:ipo_score_centering",
                             support=op.Support(torch.arange(3).view(1, 1, 3), sup_q, "exact", logprobs=logp.view(1, 1, 3)))
    loss.backward()
    assert loss.item() == pytest.approx(2 * (0.3 * LN(0.3) + 0.1 * LN(0.1)), rel=1e-5)
    torch.testing.assert_close(z.grad, torch.tensor([-0.48, 0.36, 0.12]), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- literal transcription of prime-rl's code
def _capped(log_ratio, cap):
    return torch.exp(log_ratio.detach().clamp(max=math.log(cap)) + (log_ratio - log_ratio.detach()))


def prime_rl_loss(kind, trainer, inference, adv, loss_mask, mask_trainer=None, mask_inference=None):
    """prime-rl's per-sample losses summed over the samples (rows) and divided by rl_scale = Σ loss_mask
    (rl_weights absent: 1 a token), written out from its code with its default configs:
    IPOLoss(eps 0.3, max_importance_ratio 1e4[, score_centering]), IcePopLoss(0.2, 5), PPOLoss(0.8, 1.2,
    1e4), CISPOLoss(0, 5); adv_tau 1."""
    total = trainer.sum() * 0.0
    for b in range(trainer.shape[0]):
        m = loss_mask[b]
        t, i, a = trainer[b][m], inference[b][m], adv[b][m]
        log_ratio = t - i
        if kind in ("ipo", "ipo_score_centering"):
            larger, smaller = torch.maximum(t, i), torch.minimum(t, i)
            abs_diff = torch.exp(larger) * -torch.expm1(smaller - larger)
            keep = ~(abs_diff > 0.3)
            loss = (-a[keep] * _capped(log_ratio[keep], 1e4)).sum()
            if kind == "ipo_score_centering":
                tm, im = mask_trainer[b][m], mask_inference[b][m]
                with torch.no_grad():
                    valid = im.isfinite()
                    q, p = im.exp(), tm.exp()
                    ratio = (tm - im).clamp(max=math.log(1e4)).exp()
                    coef = torch.where(valid & ((p - q).abs() <= 0.3), q * ratio, 0.0)
                loss = loss + (a * (coef * tm).sum(-1)).sum()
        elif kind == "icepop":
            d = log_ratio.detach()
            keep = ~((d < math.log(0.2)) | (d > math.log(5.0)))
            loss = (-a[keep] * torch.exp(log_ratio[keep])).sum()
        elif kind == "ppo":
            ratio = _capped(log_ratio, 1e4)
            loss = (-torch.minimum(a * ratio, a * ratio.clamp(0.8, 1.2))).sum()
        else:  # cispo
            w = log_ratio.detach().clamp(max=math.log(5.0)).exp()
            loss = (-w * a * t).sum()
        total = total + loss
    return total / loss_mask.sum()


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, K = 3, 6, 4
    logits = torch.randn(B, T, K, generator=g, dtype=torch.float64) * 1.5
    q_logits = logits + torch.randn(B, T, K, generator=g, dtype=torch.float64)
    sup_q = torch.log_softmax(q_logits, -1)
    sup_q[0, 1, 3] = float("-inf")  # a shorter kept set: padding
    sup_q[0, 1, :3] = torch.log_softmax(q_logits[0, 1, :3], -1)
    sampled = torch.randint(0, 3, (B, T), generator=g)
    mu = sup_q.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    mu[1, 4:] = 0.0
    mu[2, 0] = -15.0  # an engine that gave this token almost nothing: ρ > 1e4, the value cap acts
    return logits, sup_q, sampled, mu, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["ipo", "ipo_score_centering", "icepop", "ppo", "cispo"])
def test_presets_match_prime_rls_code(kind, seed):
    logits, sup_q, sampled, mu, adv, mask = _batch(seed)
    present = torch.isfinite(sup_q)

    def trainer_side(z):
        masked = torch.where(present, z, torch.full_like(z, float("-inf")))
        sup_p = torch.log_softmax(masked, -1)  # replayed over the kept set
        lp = sup_p.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
        return lp, torch.where(present, sup_p, torch.zeros_like(sup_p))

    z_ours = logits.clone().float().requires_grad_(True)
    lp, sup_p = trainer_side(z_ours)
    support = None
    if kind == "ipo_score_centering":  # the vocabulary is the K ids: the support's ids are 0 … K − 1
        support = op.Support(torch.arange(sup_q.shape[-1]).expand(sup_q.shape), sup_q.float(), "exact",
                             logprobs=sup_p)
    ours, _ = op.policy_loss(lp, None, adv.float(), mask.float(), mu.float(), f"prime-rl:{kind}", support=support)
    ours.backward()

    z_ref = logits.clone().requires_grad_(True)
    lp_ref, sup_p_ref = trainer_side(z_ref)
    want = prime_rl_loss(kind, lp_ref, mu, adv, mask, sup_p_ref, torch.where(present, sup_q, float("-inf")))
    want.backward()
    assert ours.item() == pytest.approx(want.item(), rel=2e-5, abs=1e-6)
    torch.testing.assert_close(z_ours.grad.double(), z_ref.grad, rtol=2e-4, atol=1e-5)


def test_the_old_forms_keep_their_commits_and_the_new_ones_differ():
    old_ipo, new_ipo = op.LossConfig.from_preset("prime-rl@559b447:ipo"), op.LossConfig.from_preset("prime-rl:ipo")
    assert old_ipo.correction.reject[0].high == 0.1 and old_ipo.kl_coef == 0.002
    assert new_ipo.correction.reject[0].high == 0.3 and new_ipo.kl_coef == 0.0 and new_ipo.ratio_value_cap == 1e4
    old_pop, new_pop = (op.LossConfig.from_preset(n).correction.reject[0]
                        for n in ("prime-rl@008468c:icepop", "prime-rl:icepop"))
    assert (old_pop.low, old_pop.high) == (0.125, 8.0) and (new_pop.low, new_pop.high) == (0.2, 5.0)
    assert "removed upstream" in op.presets.get("prime-rl:dppo").summary.lower()
    assert "#3418" in op.presets.get("prime-rl:dppo").note
