"""Golden cases for every loss kind, the dual clip, every aggregation and both denominators
(docs/specification.md §5), each computed on paper — the arithmetic is in the comments."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op


def run(lp, old, adv, mask, cfg, rollout=None, ref=None, reduce=True):
    lp = lp.clone().requires_grad_(True)
    out = op.policy_loss(lp, old, adv, mask, rollout_logprobs=rollout, config=cfg, ref_logprobs=ref, reduce=reduce)
    if reduce:
        out[0].backward()
    return out, lp.grad


def row(values):
    return torch.tensor([values], dtype=torch.float32)


def test_ppo_clip_and_dual_clip():
    # r = [0.5, 1, 1.5, 1.5, 4], A = [1, 1, 1, −1, −1], ε = 0.2, c = 3
    r = row([0.5, 1.0, 1.5, 1.5, 4.0])
    adv = row([1.0, 1.0, 1.0, -1.0, -1.0])
    old = torch.full_like(r, -5.0)
    lp = old + r.log()
    cfg = op.LossConfig(kind="ppo", dual_clip=3.0)
    (loss, m), grad = run(lp, old, adv, torch.ones_like(r), cfg)
    # ℓ = max(−rA, −clip(r)A): [max(−.5,−.8), −1, max(−1.5,−1.2), max(1.5,1.2), max(4,1.2)]
    #   = [−0.5, −1, −1.2, 1.5, 4]; dual clip on A < 0: min(4, 3·1) = 3  → Σ = 1.8, mean 0.36
    assert loss.item() == pytest.approx(0.36, rel=1e-6)
    # ∂ℓ/∂lp = −A·r on the unclipped branch, 0 when the clip or the dual clip is active; /5
    torch.testing.assert_close(grad, row([-0.5, -1.0, 0.0, 1.5, 0.0]) / 5)
    assert m["clip_fraction"] == pytest.approx(1 / 5)  # token 2
    assert m["dual_clip_fraction"] == pytest.approx(1 / 5)  # token 4
    # approx_kl = mean(r − 1 − log r)
    assert m["approx_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in [0.5, 1, 1.5, 1.5, 4]) / 5, rel=1e-5)
    assert m["loss"] == pytest.approx(0.36, rel=1e-6)


def test_ppo_asymmetric_clip():
    # r = 1.25, A = 1: ε_high = 0.28 leaves it unclipped (ℓ = −1.25); ε_high = 0.2 clips to −1.2
    r, adv, old = row([1.25]), row([1.0]), row([-2.0])
    lp = old + r.log()
    (loss, _), _ = run(lp, old, adv, torch.ones_like(r), op.LossConfig(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx(-1.25, rel=1e-6)
    (loss, _), _ = run(lp, old, adv, torch.ones_like(r), op.LossConfig(clip_low=0.2, clip_high=0.2))
    assert loss.item() == pytest.approx(-1.2, rel=1e-6)


def test_gspo_sequence_ratio():
    # log r = [ln 2, 0] → s = exp(ln2 / 2) = √2; ε = 3e-4 / 4e-4
    old = row([-3.0, -3.0])
    lp = old + row([math.log(2.0), 0.0])
    mask = torch.ones_like(old)
    # A = −1: ℓ_t = max(s, clip(s)) = √2, ∂ℓ_t/∂lp_t = s → mean: loss √2, grad √2/2 each
    (loss, _), grad = run(lp, old, row([-1.0, -1.0]), mask, op.LossConfig(kind="gspo"))
    assert loss.item() == pytest.approx(math.sqrt(2), rel=1e-6)
    torch.testing.assert_close(grad, row([math.sqrt(2) / 2] * 2))
    # A = +1: ℓ_t = max(−√2, −1.0004) = −1.0004, clipped → zero gradient
    (loss, m), grad = run(lp, old, row([1.0, 1.0]), mask, op.LossConfig(kind="gspo"))
    assert loss.item() == pytest.approx(-1.0004, rel=1e-6)
    assert grad.abs().max() == 0
    assert m["clip_fraction"] == 1.0


def test_cispo():
    # r = [0.5, 2], clip (none, 1.2) → [0.5, 1.2]; A = 1; lp = [−1, −2]
    lp = row([-1.0, -2.0])
    old = lp - row([math.log(0.5), math.log(2.0)])
    (loss, m), grad = run(lp, old, row([1.0, 1.0]), torch.ones_like(lp), op.LossConfig(kind="cispo"))
    # ℓ = −w·A·lp = [0.5, 2.4] → mean 1.45; ∂ℓ/∂lp = −w·A / 2 = [−0.25, −0.6]
    assert loss.item() == pytest.approx(1.45, rel=1e-6)
    torch.testing.assert_close(grad, row([-0.25, -0.6]))
    assert m["clip_fraction"] == pytest.approx(0.5)


def test_sapo_gate_has_slope_one_at_ratio_one():
    lp = row([-1.0, -1.0])
    adv = row([1.0, -1.0])
    (loss, _), grad = run(lp, lp.clone(), adv, torch.ones_like(lp), op.LossConfig(kind="sapo"))
    # gate = (4/τ)·σ(0) = 2/τ: ℓ = [−2/1, +2/1.05]; mean = (−2 + 1.904762)/2
    assert loss.item() == pytest.approx((-2 + 2 / 1.05) / 2, abs=1e-6)
    # ∂ℓ/∂lp = −A·(4/τ)·τ·σ(0)(1−σ(0))·r = −A → [−1, 1] / 2
    torch.testing.assert_close(grad, row([-0.5, 0.5]))


def test_reinforce():
    lp = row([-1.0, -2.0])
    (loss, m), grad = run(lp, None, row([2.0, -1.0]), torch.ones_like(lp), op.LossConfig(kind="reinforce"))
    # ℓ = −A·lp = [2, −2] → 0; ∂ℓ/∂lp = −A/2 = [−1, 0.5]
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(grad, row([-1.0, 0.5]))
    assert "approx_kl" not in m  # no π_old, no approx KL


# ----------------------------------------------------------------------- aggregation
# REINFORCE with A = 1 makes ℓ = −lp, so choosing lp = −ℓ sets the per-token losses directly:
# ℓ = [[1, 2, 3], [4, 5, ·], [·, ·, ·]] (row 1 padded at the end, row 2 fully padded)
LOSSES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")], [float("nan")] * 3])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float32)


@pytest.mark.parametrize(
    "agg, extra, expected",
    [
        ("token-mean", {}, 15 / 5),  # Σℓ / n_tokens
        ("token-mean", {"global_tokens": 10}, 15 / 10),
        ("seq-mean-token-mean", {}, (6 / 3 + 9 / 2) / 2),  # mean over the 2 non-empty rows
        ("seq-mean-token-mean", {"global_seqs": 4}, (6 / 3 + 9 / 2) / 4),
        ("seq-mean-token-sum", {}, (6 + 9) / 2),
        ("seq-mean-token-sum-norm", {}, (6 / 3 + 9 / 3) / 2),  # max_len defaults to T = 3
        ("seq-mean-token-sum-norm", {"max_len": 5}, (6 / 5 + 9 / 5) / 2),
    ],
)
def test_aggregations(agg, extra, expected):
    cfg = op.LossConfig(kind="reinforce", agg=agg, **extra)
    (loss, m), grad = run(-LOSSES, None, torch.ones_like(LOSSES), MASK, cfg)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(grad).all() and grad[2].abs().max() == 0 and grad[1, 2] == 0
    key = "offpolicy/loss"
    assert m.to_dict()[key] == pytest.approx(expected, rel=1e-6)


def test_denominator_fixed_vs_renormalize():
    # token rule rejects the ρ = 4 token of row 0: ℓ = [[1, 2, ✗], [4, 5, ·]]
    lp = -torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    rollout = lp - torch.tensor([[0.0, 0.0, math.log(4.0)], [0.0, 0.0, 0.0]])
    old = lp.clone()
    rule = [{"stat": "ratio", "level": "token", "high": 3.0}]

    def loss_with(denominator, agg):
        corr = op.CorrectionConfig(reject=rule, denominator=denominator)
        cfg = op.LossConfig(kind="reinforce", agg=agg, correction=corr)
        return op.policy_loss(lp, old, torch.ones_like(lp), mask, rollout_logprobs=rollout, config=cfg)[0].item()

    assert loss_with("renormalize", "token-mean") == pytest.approx(12 / 4)  # 1+2+4+5 over 4 survivors
    assert loss_with("fixed", "token-mean") == pytest.approx(12 / 5)  # … over the 5 valid tokens
    assert loss_with("renormalize", "seq-mean-token-mean") == pytest.approx((3 / 2 + 9 / 2) / 2)
    assert loss_with("fixed", "seq-mean-token-mean") == pytest.approx((3 / 3 + 9 / 2) / 2)


def test_weights_multiply_after_clip_and_kl_is_not_weighted():
    # one token: r = 1.5, A = 1 → clipped ℓ = −1.2; weight w = min(ρ, 2) with ρ = π_old/μ = 4 → 2
    # ℓ·w = −2.4; KL term β·k1 with lp − ref = −0.5 → +0.1·(−0.5) unweighted → −2.45
    old = row([-2.0])
    lp = old + math.log(1.5)
    rollout = old - math.log(4.0)
    ref = lp + 0.5
    corr = op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0})
    cfg = op.LossConfig(correction=corr, kl_coef=0.1, kl_kind="k1")
    (loss, m), _ = run(lp, old, row([1.0]), torch.ones_like(lp), cfg, rollout=rollout, ref=ref)
    assert loss.item() == pytest.approx(-2.45, rel=1e-6)
    assert m["kl_ref"] == pytest.approx(-0.5, rel=1e-6)
    # kl_is_weight: the KL term is weighted too → −2.4 + 0.1·(−0.5)·2 = −2.5
    corr_w = op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0}, kl_is_weight=True)
    cfg_w = op.LossConfig(correction=corr_w, kl_coef=0.1, kl_kind="k1")
    (loss, _), _ = run(lp, old, row([1.0]), torch.ones_like(lp), cfg_w, rollout=rollout, ref=ref)
    assert loss.item() == pytest.approx(-2.5, rel=1e-6)


def test_bypass_uses_rollout_as_old():
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(2, 4, generator=g) - 0.1
    rollout = lp - 0.3 * torch.rand(2, 4, generator=g)
    old = lp + 5.0  # garbage: bypass must ignore it (it would also be a positive log-prob)
    adv = torch.randn(2, 4, generator=g)
    mask = torch.ones(2, 4)
    bypass = op.LossConfig(correction=op.CorrectionConfig(anchor="rollout"))
    (loss_bypass, _), g1 = run(lp, old.clamp(max=0), adv, mask, bypass, rollout=rollout)
    (loss_plain, _), g2 = run(lp, rollout, adv, mask, op.LossConfig())
    assert loss_bypass.item() == pytest.approx(loss_plain.item(), rel=1e-6)
    torch.testing.assert_close(g1, g2)


def test_reduce_false_returns_per_token_loss_and_mask():
    lp = -torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    rollout = lp - torch.tensor([[0.0, 0.0, math.log(4.0)], [0.0, 0.0, 0.0]])
    corr = op.CorrectionConfig(reject=[{"stat": "ratio", "level": "token", "high": 3.0}], denominator="renormalize")
    cfg = op.LossConfig(kind="reinforce", correction=corr)
    per_token, agg_mask, metrics = op.policy_loss(lp, lp, torch.ones_like(lp), mask, rollout_logprobs=rollout,
                                                  config=cfg, reduce=False)
    torch.testing.assert_close(per_token, torch.tensor([[1.0, 2.0, 0.0], [4.0, 5.0, 0.0]]))
    torch.testing.assert_close(agg_mask, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    # the host's own token-mean over this mask reproduces our reduced loss
    loss, _ = op.policy_loss(lp, lp, torch.ones_like(lp), mask, rollout_logprobs=rollout, config=cfg)
    assert (per_token.sum() / agg_mask.sum()).item() == pytest.approx(loss.item())
    fixed = cfg.model_copy(update={"correction": corr.model_copy(update={"denominator": "fixed"})})
    _, agg_fixed, _ = op.policy_loss(lp, lp, torch.ones_like(lp), mask, rollout_logprobs=rollout, config=fixed,
                                     reduce=False)
    torch.testing.assert_close(agg_fixed, mask)


def test_all_rejected_gives_zero_loss_and_zero_grad():
    lp = row([-1.0, -2.0])
    rollout = lp - 3.0  # ρ = e³ ≈ 20 for both tokens
    corr = op.CorrectionConfig(reject=[{"stat": "ratio", "level": "token", "high": 2.0}])
    (loss, m), grad = run(lp, lp.clone(), row([1.0, 1.0]), torch.ones_like(lp), op.LossConfig(correction=corr),
                          rollout=rollout)
    assert loss.item() == 0.0
    assert grad.abs().max() == 0.0
    assert m["masked_fraction"] == 1.0
    assert math.isnan(m["loss"])  # no token contributed: the metric says so instead of a silent 0


def test_missing_inputs_are_named():
    lp = row([-1.0])
    corr = op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0})
    with pytest.raises(ValueError, match="rollout_logprobs"):
        op.policy_loss(lp, lp, row([1.0]), torch.ones_like(lp), config=op.LossConfig(correction=corr))
    with pytest.raises(ValueError, match="needs old_logprobs"):
        op.policy_loss(lp, None, row([1.0]), torch.ones_like(lp), config=op.LossConfig(kind="ppo"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        op.policy_loss(lp, lp, row([1.0]), torch.ones_like(lp), config=op.LossConfig(kl_coef=0.1))


def test_gspo_forms_differ_in_gradient_not_where_a_and_w_are_flat():
    # issue #26. π_θ = π_old (s = 1, inside any clip), A = (1, 3), IS weights w = ρ = (1, 2) from
    # μ = π_old − (0, ln 2) (anchor old, raw token weight), token-mean over N = 2.
    old = row([-2.0, -2.0])
    rollout = old - row([0.0, math.log(2.0)])
    adv, mask = row([1.0, 3.0]), torch.ones(1, 2)
    corr = {"weight": {"level": "token", "mode": "truncate"}}
    token = op.LossConfig(kind="gspo", clip_low=0.2, clip_high=0.2, correction=corr)
    seq = op.LossConfig(kind="gspo", clip_low=0.2, clip_high=0.2, gspo_form="sequence", correction=corr)
    # token form: ℓ_t = −A_t·s_t, ∂/∂lp_j = −A_j·s·w_j/N → loss (−1·1 − 3·2)/2 = −3.5, grad (−0.5, −3)
    (loss, _), grad = run(old, old, adv, mask, token, rollout)
    assert loss.item() == pytest.approx(-3.5, rel=1e-6)
    torch.testing.assert_close(grad, row([-0.5, -3.0]))
    # sequence form: Ā = 2, ℓ_t = −Ā·s; loss Σ_t w_t(−2)/2 = −3; ∂s/∂lp_j = s/n = 1/2, so
    # ∂/∂lp_j = (−Ā)(1/2)·Σ_t w_t / N = −2·0.5·3/2 = −1.5 on both tokens (the mean weight, spread)
    (loss, _), grad = run(old, old, adv, mask, seq, rollout)
    assert loss.item() == pytest.approx(-3.0, rel=1e-6)
    torch.testing.assert_close(grad, row([-1.5, -1.5]))
    # A_t = Ā and w_t flat (no correction): both forms give loss −2 and gradient −A·s/N = (−1, −1)
    flat = row([2.0, 2.0])
    for cfg in (token.model_copy(update={"correction": None}), seq.model_copy(update={"correction": None})):
        (loss, _), grad = run(old, old, flat, mask, cfg)
        assert loss.item() == pytest.approx(-2.0, rel=1e-6)
        torch.testing.assert_close(grad, row([-1.0, -1.0]))


def test_gspo_dual_clip_and_sapo_at_sequence_level():
    # log r = (ln 4, ln 4) → s = 4; A = −1; ε = 0.2, c = 3: max(−A·s, −A·clip(s)) = max(4, 1.2) = 4,
    # dual clip min(4, 3) = 3 on both tokens → loss 3, no gradient (the constant branch)
    old = row([-3.0, -3.0])
    lp = old + math.log(4.0)
    adv, mask = row([-1.0, -1.0]), torch.ones(1, 2)
    for form in ("token", "sequence"):
        cfg = op.LossConfig(kind="gspo", clip_low=0.2, clip_high=0.2, dual_clip=3.0, gspo_form=form)
        (loss, m), grad = run(lp, old, adv, mask, cfg)
        assert loss.item() == pytest.approx(3.0, rel=1e-6) and m["dual_clip_fraction"] == pytest.approx(1.0)
        torch.testing.assert_close(grad, torch.zeros(1, 2))
    # SAPO at sequence level, s = 1 (π_θ = π_old), A = (1, 3) → Ā = 2 > 0, τ_pos = 1:
    # gate = (4/τ)σ(0) = 2 → ℓ_t = −2·2 = −4, loss −4; ∂gate/∂s = 4σ'(0) = 1, ∂s/∂lp_j = 1/2,
    # so ∂/∂lp_j = Σ_t (−Ā)(1/2)/N = −2·(1/2)·2/2 = −1 on both tokens. Token level for contrast:
    # ℓ_t = −2·A_t = (−2, −6), loss −4, ∂/∂lp_j = −A_j/N = (−0.5, −1.5).
    adv = row([1.0, 3.0])
    (loss, _), grad = run(old, old, adv, mask, op.LossConfig(kind="sapo", sapo_level="sequence"))
    assert loss.item() == pytest.approx(-4.0, rel=1e-6)
    torch.testing.assert_close(grad, row([-1.0, -1.0]))
    (loss, _), grad = run(old, old, adv, mask, op.LossConfig(kind="sapo"))
    assert loss.item() == pytest.approx(-4.0, rel=1e-6)
    torch.testing.assert_close(grad, row([-0.5, -1.5]))
