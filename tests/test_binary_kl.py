"""Token-level binary-KL masks (issue #46 item 2): bkl_t = max(0, KL(Bern(μ) ‖ Bern(π_train))).

Hand-derived values, the fp32 clamp at zero (OpenRLHF #1354), the advantage-split form of SkyRL
0.4.0's DPPO Binary-KL, validation, and the kernel ladder (eager computes it, compiled and triton
refuse it by name and ``auto`` falls to a rung that computes it). The float64 oracle of
tests/test_fuzz.py covers random configurations.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.core import kernels, ops
from offpolicy.core.config import ConfigError


def _bkl64(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def _naive_fp32(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """OpenRLHF 0.11.2's formula (openrlhf/models/loss.py), fp32, no clamp at zero."""
    p = log_p.exp().clamp(1e-6, 1 - 1e-6)
    q = log_q.exp().clamp(1e-6, 1 - 1e-6)
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()


# --------------------------------------------------------------------------- the value
def test_hand_derived_values():
    # p = 1/2, q = 1/4: ½ ln 2 + ½ ln(½ / ¾) = ½ ln(4/3) = 0.1438410
    # p = 1/4, q = 1/2: ¼ ln ½ + ¾ ln(¾ / ½) = 0.1308120
    # p = 1/2, q = 9/10: ½ ln(5/9) + ½ ln 5 = ½ ln(25/9) = 0.5108256
    got = ops.binary_kl(torch.tensor([0.5, 0.25, 0.5]).log(), torch.tensor([0.25, 0.5, 0.9]).log())
    torch.testing.assert_close(got, torch.tensor([0.5 * math.log(4 / 3), 0.25 * math.log(0.5) + 0.75 * math.log(1.5),
                                                  0.5 * math.log(25 / 9)]), rtol=1e-6, atol=0)
    assert got.dtype == torch.float32


def test_fp32_negatives_are_clamped_to_zero():
    """log μ = −1, log π = −1 − 1.19e-7 (one fp32 step): the exact KL is (p − q)²/(2q(1 − q)) ≈ 4e-15,
    the textbook fp32 sum of its two cancelling terms is −3.15e-8 (OpenRLHF #1354's negative KL);
    ours is ≥ 0 and within 1e-13 of the float64 value."""
    log_mu = torch.tensor([-1.0, -0.1])
    log_pi = torch.tensor([-1.0000001, -0.1000001])
    naive = _naive_fp32(log_mu, log_pi)
    assert bool((naive < 0).all()), naive  # the inputs do show the defect
    got = ops.binary_kl(log_mu, log_pi)
    assert bool((got >= 0).all())
    exact = [_bkl64(math.exp(float(a)), math.exp(float(b))) for a, b in zip(log_mu.double(), log_pi.double())]
    assert max(exact) < 1e-13
    torch.testing.assert_close(got.double(), torch.tensor(exact, dtype=torch.float64), atol=1e-13, rtol=0)


@settings(max_examples=60, deadline=None)
@given(st.floats(-12.0, -1e-3), st.floats(-1e-5, 1e-5))
def test_never_negative_and_close_to_float64(log_p, delta):
    lp = torch.tensor([log_p], dtype=torch.float32)
    lq = (lp + delta).clamp(max=0.0)
    got = float(ops.binary_kl(lp, lq))
    p = min(max(math.exp(float(lp)), 1e-6), 1 - 1e-6)
    q = min(max(math.exp(float(lq)), 1e-6), 1 - 1e-6)
    assert got >= 0.0
    exact = max(0.0, _bkl64(p, q))
    # |d| ≤ 1e-5: the rounding of terms of size |d| (the textbook fp32 form errs by up to 1e-7 here)
    assert abs(got - exact) <= 1e-11 + 1e-5 * exact


# --------------------------------------------------------------------------- the token rule
MU = [[0.5, 0.5, 0.5]]
PI = [[0.25, 0.5, 0.9]]  # bkl = [0.1438, 0, 0.5108]; π fell, stayed, rose


def _kept(rule: dict, advantages: list[float] | None = None) -> list[int]:
    rollout, old = torch.tensor(MU).log(), torch.tensor(PI).log()
    adv = None if advantages is None else torch.tensor([advantages])
    out = op.correct(old, rollout, torch.ones(1, 3), op.CorrectionConfig(reject=[rule]), logprobs=old, advantages=adv)
    return out.mask.int()[0].tolist()


def test_token_level_drops_each_token_above_high():
    assert _kept({"stat": "binary_kl", "level": "token", "high": 0.2}) == [1, 1, 0]
    assert _kept({"stat": "binary_kl", "level": "token", "high": 0.1}) == [0, 1, 0]
    assert _kept({"stat": "binary_kl", "level": "token", "high": 0.0}) == [0, 1, 0]  # bkl = 0 exactly at p = q
    # the row mean (0.1438 + 0 + 0.5108)/3 = 0.2182 > 0.2: seq_mean drops the whole row
    assert _kept({"stat": "binary_kl", "high": 0.2}) == [0, 0, 0]


def test_by_advantage_drops_only_tokens_pushed_further_their_way():
    rule = {"stat": "binary_kl", "level": "token", "high": 0.2, "by_advantage": True, "high_negative": 0.1}
    # A > 0: token 2 rose (π 0.9 > μ 0.5) with 0.51 > 0.2 → dropped; token 0 fell → kept whatever its bkl
    assert _kept(rule, [1.0, 1.0, 1.0]) == [1, 1, 0]
    # A < 0: token 0 fell with 0.1438 > high_negative 0.1 → dropped; token 2 rose → kept
    assert _kept(rule, [-1.0, -1.0, -1.0]) == [0, 1, 1]
    # high_negative unset = high: 0.1438 ≤ 0.2 → kept
    assert _kept({**rule, "high_negative": None}, [-1.0, -1.0, -1.0]) == [1, 1, 1]
    # A = 0 never drops (SkyRL tests A > 0 and A < 0 only)
    assert _kept(rule, [0.0, 0.0, 0.0]) == [1, 1, 1]


def test_metric_reports_the_clamped_mean():
    rollout = torch.tensor([[-1.0, -0.1]])
    old = torch.tensor([[-1.0000001, -0.1000001]])
    out = op.correct(old, rollout, torch.ones(1, 2), op.CorrectionConfig(reject=[{"stat": "binary_kl", "level": "token",
                                                                                   "high": 1e-12}]))
    metrics = out.metrics.to_dict()
    naive = float(_naive_fp32(rollout, old).mean())
    assert naive < -1e-8  # what the textbook fp32 form would report
    assert 0.0 <= metrics["offpolicy/reject/0_binary_kl_token/binary_kl_mean"] < 1e-13
    assert out.mask.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("bad, match", [
    ({"level": "seq_mean", "by_advantage": True}, "need level 'token'"),
    ({"level": "token", "high_negative": 0.1}, "applies only with by_advantage"),
    ({"level": "token", "high": -0.1}, "greater than or equal to 0"),
])
def test_validation_names_the_option(bad, match):
    with pytest.raises(ConfigError, match=match):
        op.CorrectionConfig(reject=[{"stat": "binary_kl", "high": 0.1, **bad}])


def test_by_advantage_needs_advantages():
    with pytest.raises(ValueError, match="binary_kl.*advantages="):
        op.correct(torch.tensor(PI).log(), torch.tensor(MU).log(), torch.ones(1, 3),
                   op.CorrectionConfig(reject=[{"stat": "binary_kl", "level": "token", "high": 0.1,
                                                "by_advantage": True}]))


# --------------------------------------------------------------------------- the kernel ladder
def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 9
    rollout = -torch.rand(B, T, generator=g) * 3
    old = (rollout + 0.4 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    lp = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[:, 0] = 1
    return lp, old, adv, mask, rollout


TOKEN_RULES = [
    {"stat": "binary_kl", "level": "token", "high": 0.02},
    {"stat": "binary_kl", "level": "token", "high": 0.02, "by_advantage": True, "high_negative": 0.01},
]


@pytest.mark.parametrize("rule", TOKEN_RULES, ids=["plain", "by_advantage"])
@pytest.mark.parametrize("anchor", ["old", "rollout"])
def test_eager_equals_reference(rule, anchor):
    cfg = op.LossConfig(correction=op.CorrectionConfig(anchor=anchor, reject=[rule], denominator="fixed"))
    lp, old, adv, mask, rollout = _batch()
    out = {}
    for rung in ("reference", "eager"):
        x = lp.clone().requires_grad_(True)
        loss, metrics = op.policy_loss(x, old, adv, mask, rollout_logprobs=rollout, config=cfg, implementation=rung)
        loss.backward()
        out[rung] = (loss.detach(), x.grad, metrics.to_dict())
    masked = out["reference"][2]["offpolicy/reject/0_binary_kl_token/masked_fraction"]
    assert 0.05 < masked < 0.95  # the rule bites on this batch
    torch.testing.assert_close(out["eager"][0], out["reference"][0])
    torch.testing.assert_close(out["eager"][1], out["reference"][1])
    assert out["eager"][2].keys() == out["reference"][2].keys()
    for key, value in out["reference"][2].items():
        assert out["eager"][2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("rung", ["compiled", "triton"])
def test_compiled_and_triton_refuse_and_auto_falls_back(rung):
    cfg = op.LossConfig(correction=op.CorrectionConfig(reject=[TOKEN_RULES[0]]))
    assert not kernels.get(rung).supports(cfg, None) if rung == "compiled" else True
    lp, old, adv, mask, rollout = _batch(1)
    if rung == "triton":
        try:
            module = kernels.get("triton")
        except ImportError:
            pytest.skip("triton not importable")
        assert not module.supports(cfg, None)
    with pytest.raises(ValueError, match=f"implementation '{rung}' does not cover"):
        op.policy_loss(lp, old, adv, mask, rollout_logprobs=rollout, config=cfg, implementation=rung)
    auto, _ = op.policy_loss(lp, old, adv, mask, rollout_logprobs=rollout, config=cfg, implementation="auto")
    ref, _ = op.policy_loss(lp, old, adv, mask, rollout_logprobs=rollout, config=cfg, implementation="reference")
    torch.testing.assert_close(auto, ref)


# --------------------------------------------------------------------------- the frameworks' code
@pytest.mark.parametrize("preset, dppo_type, delta", [("skyrl:dppo_binary_kl", "binary_kl", 0.05),
                                                      ("skyrl:dppo_binary_tv", "binary_tv", 0.2)])
def test_skyrl_dppo_presets_match_skyrl(preset, dppo_type, delta):
    """SkyRL 0.4.0 ``dppo_policy_loss``: its loss is Σ −ρ·A·mask over the loss mask (``reduce_loss``
    sums; the advantages carry the token-mean normalisation) with ρ = π_θ/μ; the preset (anchor
    rollout, PPO without a clip, the by-advantage rule, a fixed denominator) is that sum over the
    valid-token count, loss and gradient, on a batch where no token's statistic lies within 1e-5 of
    a bound (SkyRL's ε = 1e-8 in place of our clamp moves bkl by < 1e-6)."""
    pytest.importorskip("skyrl")
    from host_packages import import_skyrl_module
    try:
        pu = import_skyrl_module()
        from skyrl.train.config.config import AlgorithmConfig
    except ImportError as err:
        pytest.skip(f"SkyRL's ppo_utils does not import here: {err}")
    lp, _, adv, mask, rollout = _batch(3)
    config = AlgorithmConfig(policy_loss_type="dppo")
    config.dppo.dppo_type, config.dppo.delta_high, config.dppo.delta_low = dppo_type, delta, delta
    stat = ops.binary_kl(rollout, lp) if dppo_type == "binary_kl" else (lp.exp() - rollout.exp()).abs()
    assert bool(((stat - delta).abs() > 1e-5).all())
    host_lp, ours_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    host_loss, _ = pu.dppo_policy_loss(host_lp, host_lp.detach(), adv, config, loss_mask=mask, rollout_logprobs=rollout)
    host_loss.backward()
    ours, metrics = op.policy_loss(ours_lp, rollout, adv, mask, rollout_logprobs=rollout, config=preset)
    (ours * mask.sum()).backward()
    assert 0 < metrics.to_dict()["offpolicy/masked_fraction"] < 1  # the mask bites
    torch.testing.assert_close(ours * mask.sum(), host_loss.to(ours.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_lp.grad, host_lp.grad, rtol=1e-5, atol=1e-6)


def test_openrlhf_token_gating_rejects_fp32_negatives_and_ours_does_not():
    """OpenRLHF 0.11.2 token-level binary_kl gating keeps bkl ∈ [low, high]; with the band [0, δ]
    its fp32 negatives (#1354) fail ``stat ≥ 0`` and valid on-policy tokens leave the loss. Ours
    clamps at zero: every token the host keeps we keep, and the on-policy ones too."""
    pytest.importorskip("openrlhf")
    from host_packages import import_openrlhf_loss
    try:
        host = import_openrlhf_loss()
    except ImportError as err:
        pytest.skip(f"OpenRLHF's loss does not import here: {err}")
    rollout = torch.tensor([[-1.0, -0.1, -0.5, -2.0]])
    old = torch.tensor([[-1.0000001, -0.1000001, -0.9, -2.0]])  # tokens 0, 1: one fp32 step apart; 3: equal
    lp, adv, mask = old.clone(), torch.ones(1, 4), torch.ones(1, 4)
    fn = host.PolicyLoss(is_correction_level="token", is_correction_gating="binary_kl", is_correction_mode="mask",
                         is_correction_threshold=(0.0, 0.05))
    host_kept = []
    for t in range(4):  # one token per call: the host's loss is −A·ρ = −1 where it keeps it, 0 where it drops it
        loss = fn(lp[:, t:t + 1], old[:, t:t + 1], adv[:, t:t + 1], action_mask=mask[:, t:t + 1],
                  rollout_log_probs=rollout[:, t:t + 1])[0]
        host_kept.append(int(float(loss) != 0.0))
    assert bool((_naive_fp32(rollout, old)[0, :2] < 0).all())
    assert host_kept == [0, 0, 0, 1]  # tokens 0, 1 rejected on a negative KL; 2 on bkl 0.069 > 0.05
    ours = op.correct(old, rollout, mask, op.CorrectionConfig(reject=[{"stat": "binary_kl", "level": "token",
                                                                        "high": 0.05}]))
    assert ours.mask.int().tolist() == [[1, 1, 0, 1]]


def test_direction_pi_mu_and_both_kpop():
    """π = 0.25 against μ = 0.5: mu_pi = ½ ln(4/3) = 0.1438, pi_mu = ¼ ln ½ + ¾ ln(3/2) = 0.1308;
    both (AReaL KPop, areal-project/AReaL #1405) keeps a token only if both directions are within."""
    base = {"stat": "binary_kl", "level": "token"}
    assert _kept({**base, "high": 0.135, "direction": "mu_pi"})[0] == 0
    assert _kept({**base, "high": 0.135, "direction": "pi_mu"})[0] == 1
    assert _kept({**base, "high": 0.135, "direction": "both"})[0] == 0
    assert _kept({**base, "high": 0.144, "direction": "both"})[0] == 1
    rollout, old = torch.tensor(MU).log(), torch.tensor(PI).log()
    cfg = op.CorrectionConfig(reject=[{**base, "high": 1.0, "direction": "pi_mu"}])
    out = op.correct(old, rollout, torch.ones(1, 3), cfg)
    # pi_mu per token: [0.1308, 0, 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.3681]; the metric is their mean
    expected = (0.25 * math.log(0.5) + 0.75 * math.log(1.5) + 0.9 * math.log(1.8) + 0.1 * math.log(0.2)) / 3
    mean = out.metrics.to_dict()["offpolicy/reject/0_binary_kl_token/binary_kl_mean"]
    assert mean == pytest.approx(expected, rel=1e-6)
