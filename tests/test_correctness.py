"""Issue #9: one test per defect, each failing on the code before its fix (the docstring names
the item). The random search that found them lives in tests/test_fuzz.py."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from conftest import random_batch
from offpolicy.core import kernels
from offpolicy.core.errors import ConfigError

RUNGS = [n for n in ("reference", "eager", "compiled") if n in kernels.IMPLEMENTATIONS]
DEVICE_CONFIGS = [
    op.LossConfig(),
    op.LossConfig(kind="reinforce"),
    op.LossConfig(kind="reinforce", correction=op.CorrectionConfig(anchor="current",
                  weight={"level": "sequence", "mode": "mask", "high": 5.0})),
    op.LossConfig(correction=op.CorrectionConfig(
        weight={"level": "token", "mode": "truncate", "high": 2.0, "normalize": True},
        reject=[{"stat": "k1", "level": "token", "low": -1.0, "high": 1.0}, {"stat": "k3", "level": "seq_max", "high": 1.0}])),
    op.LossConfig(correction=op.CorrectionConfig(reject=[{"stat": "opsm", "delta": 0.0}, {"stat": "binary_kl", "high": 0.3}])),
    op.LossConfig(agg="seq-mean-token-mean", correction=op.CorrectionConfig(anchor="rollout",
                  reject=[{"stat": "ratio", "level": "geometric", "low": 0.5, "high": 2.0}])),
]


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("cfg", DEVICE_CONFIGS, ids=range(len(DEVICE_CONFIGS)))
def test_every_tensor_takes_the_inputs_device(rung, cfg):
    """Item 1: the default device is `meta` while the inputs are on the CPU, so any tensor the
    library creates without ``device=`` (``torch.zeros(())``, ``torch.tensor(floats)``) lands on
    meta and mixing it with the inputs raises — as a CUDA run did with the CPU default."""
    if not kernels.get(rung).supports(cfg, None):
        pytest.skip(f"{rung} does not cover this configuration")
    b = random_batch(1)
    with torch.device("meta"):
        lp = b["logprobs"].clone().requires_grad_(True)
        loss, metrics = op.policy_loss(lp, b["old"], b["adv"], b["mask"], b["rollout"], cfg, implementation=rung)
        loss.backward()
        values = metrics.to_dict()
    assert loss.device.type == "cpu" and lp.grad.device.type == "cpu"
    assert math.isfinite(values["offpolicy/loss"])


def test_the_device_check_fails_on_one_device_less_tensor(monkeypatch):
    """The check above can fail: re-introduce one ``torch.zeros(())`` (here inside the masked
    sum every rung's correction uses) and the same call raises."""
    from offpolicy.core import ops
    real = ops.masked_sum
    monkeypatch.setattr(ops, "masked_sum", lambda *a, **k: real(*a, **k) + torch.zeros(()))
    b = random_batch(1)
    with torch.device("meta"), pytest.raises(RuntimeError, match="device"):
        op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], b["rollout"], DEVICE_CONFIGS[3],
                       implementation="reference")


@pytest.mark.parametrize("rung", RUNGS)
def test_anchor_old_without_old_logprobs_raises_the_same_error_everywhere(rung):
    """Item 2: the compiled rung used π_θ as π_old under REINFORCE; every rung must raise."""
    b = random_batch(0)
    cfg = op.LossConfig(kind="reinforce", correction=op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0}))
    with pytest.raises(ConfigError, match="anchor 'old' compares log π_old with log μ, so old_logprobs is required"):
        op.policy_loss(b["logprobs"], None, b["adv"], b["mask"], b["rollout"], cfg, implementation=rung)


def _neutral(anchor="old", **extra):
    return op.LossConfig(correction=op.CorrectionConfig(anchor=anchor, nonfinite="neutral", **extra))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["old", "rollout"])
def test_neutral_never_lets_a_bad_ratio_input_reach_the_loss(bad, where):
    """Item 3: a NaN/±inf π_old reached PPO's ratio (NaN loss; −inf μ gave 4e7). Neutral now
    replaces the bad side by the other side: the token's loss is that of ρ = 1 and r = π_θ/μ
    (bad π_old) or π_θ/π_old (bad μ). Golden: one token, π_θ = π_old = μ = −1 except the bad
    one, A = 1 → r = 1, ℓ = −1, loss = −1, dloss/dlogπ = −1."""
    lp = torch.tensor([[-1.0]], requires_grad=True)
    old, mu = torch.tensor([[-1.0]]), torch.tensor([[-1.0]])
    (old if where == "old" else mu)[0, 0] = bad
    loss, metrics = op.policy_loss(lp, old, torch.ones(1, 1), torch.ones(1, 1), mu, _neutral(), implementation="reference")
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and lp.grad.item() == pytest.approx(-1.0)
    assert all(math.isfinite(v) for v in metrics.to_dict().values())


def test_neutral_replaces_only_the_bad_value():
    """Item 4: neutral set *both* log π_old and log μ to 0, so OPSM and ppl_train saw log p = 0.
    Golden: row of two tokens, log π_old = [−1, NaN], log μ = [−1, −3] → after neutral
    log π_train = [−1, −3] (the NaN takes μ's value), ppl_train = exp(2) = 7.389, ppl_rollout = exp(2)."""
    old = torch.tensor([[-1.0, float("nan")]])
    mu = torch.tensor([[-1.0, -3.0]])
    out = op.correct(old, mu, torch.ones(1, 2), {"nonfinite": "neutral"}).metrics.to_dict()
    assert out["offpolicy/ppl_train"] == pytest.approx(math.exp(2.0), rel=1e-5)
    assert out["offpolicy/ppl_rollout"] == pytest.approx(math.exp(2.0), rel=1e-5)
    assert out["offpolicy/kl_k1"] == pytest.approx(0.0, abs=1e-7)


def test_nonfinite_ref_logprobs_follow_the_policy():
    """Item 5: ref_logprobs was always checked with nonfinite=error. Under mask_token its bad
    token is dropped: the loss equals that of the batch without the token."""
    b = random_batch(0)
    ref = b["old"].clone()
    ref[0, 0] = float("nan")
    cfg = op.LossConfig(kl_coef=0.1, correction=op.CorrectionConfig(nonfinite="mask_token"))
    loss, _ = op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], b["rollout"], cfg, ref_logprobs=ref)
    mask = b["mask"].clone()
    mask[0, 0] = 0
    want, _ = op.policy_loss(b["logprobs"], b["old"], b["adv"], mask, b["rollout"], cfg, ref_logprobs=b["old"])
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs has 1 non-finite"):
        op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], b["rollout"],
                       op.LossConfig(kl_coef=0.1, correction=op.CorrectionConfig()), ref_logprobs=ref)


def test_correct_without_rollout_logprobs_says_what_is_missing():
    """Item 6 (and the suspicion that anchor 'rollout' without μ compared π_old with itself):
    AttributeError before; now a ValueError naming rollout_logprobs."""
    b = random_batch(0)
    for cfg in (None, {"anchor": "rollout"}):
        with pytest.raises(ValueError, match="correct\\(\\) needs rollout_logprobs"):
            op.correct(b["old"], None, b["mask"], cfg)


@pytest.mark.parametrize("config", [
    {"kind": "ppo", "clip_low": 0.1}, "verl:decoupled_token_is", op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0}),
])
def test_policy_loss_accepts_what_users_pass(config):
    """Item 7: a dict, a preset name or a CorrectionConfig raised AttributeError."""
    b = random_batch(0)
    loss, _ = op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], b["rollout"], config, implementation="reference")
    assert math.isfinite(loss.item())


def test_policy_loss_from_a_yaml_path_and_a_typed_error_otherwise(tmp_path):
    """Item 7: a YAML path loads; anything else is a ConfigError listing what is accepted."""
    b = random_batch(0)
    path = tmp_path / "loss.yaml"
    path.write_text("loss:\n  kind: cispo\n")
    loss, _ = op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], b["rollout"], str(path), implementation="reference")
    assert math.isfinite(loss.item())
    with pytest.raises(ConfigError, match="a preset name or a YAML path; got int"):
        op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], b["rollout"], 3)


@pytest.mark.parametrize("rung", RUNGS)
def test_unclamped_sequence_weight_cannot_overflow_the_loss(rung):
    """Item 8: log_clamp null + sequence TIS with no bound, on rows whose log-ratios sum to
    8·30 = 240: the weight was exp(87) = 6e37 and 8 tokens × 2 rows summed past fp32's 3.4e38
    → −inf. The bound is now exp(60): loss = −A·e^60 = −1.14e26 exactly (r = 1, A = 1)."""
    mask = torch.ones(2, 8)
    old = torch.full((2, 8), -0.1)
    mu = torch.full((2, 8), -30.1)
    cfg = op.LossConfig(correction=op.CorrectionConfig(log_clamp=None, weight={"level": "sequence", "mode": "truncate"}))
    lp = old.clone().requires_grad_(True)
    loss, _ = op.policy_loss(lp, old, torch.ones(2, 8), mask, mu, cfg, implementation=rung)
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(lp.grad).all())
    assert loss.item() == pytest.approx(-math.exp(60.0), rel=1e-5)


@pytest.mark.parametrize("field, agg", [("global_tokens", "token-mean"), ("global_seqs", "seq-mean-token-sum")])
def test_fractional_global_count_is_refused(field, agg):
    """Item 9: global_tokens in (0, 1) was silently clamped to 1 by the division guard. A global
    count is a count (≥ 1): a fraction is refused with the field's path."""
    with pytest.raises(ConfigError, match=f"LossConfig.{field}"):
        op.LossConfig(agg=agg, **{field: 0.5})
    assert getattr(op.LossConfig(agg=agg, **{field: 1.0}), field) == 1.0


def test_all_zero_weights_give_an_ess_of_zero_not_nan():
    """Found by the fuzz: a mask-mode weight that zeroes every surviving token reported
    is_ess = 0/0 = NaN; with tokens left and no weight, the effective sample size is 0."""
    old = torch.tensor([[-1.0, -1.0]])
    mu = torch.tensor([[-1.1, -1.2]])  # ρ = e^0.1, e^0.2 < 2 = low: every weight 0
    out = op.correct(old, mu, torch.ones(1, 2), {"weight": {"level": "token", "mode": "mask", "low": 2.0}})
    assert out.metrics.to_dict()["offpolicy/is_ess"] == 0.0


def test_more_than_eight_configurations_stay_compiled():
    """Suspicion (confirmed): dynamo's recompile_limit (8) made the 9th configuration of a process
    fall back to uncompiled execution with only a log warning. Building the compiled core now
    raises the limit to the number of configurations it caches."""
    import torch._dynamo.config as dynamo_config

    from offpolicy.core.kernels import compiled

    old = dynamo_config.recompile_limit
    try:
        dynamo_config.recompile_limit = 8
        compiled._compiled.cache_clear()
        compiled._compiled(compiled.core_spec(op.LossConfig(), True, True))  # builds, compiles lazily
        assert dynamo_config.recompile_limit >= compiled.COMPILED_CONFIGS
    finally:
        dynamo_config.recompile_limit = max(old, compiled.COMPILED_CONFIGS)


def test_anchor_current_with_cispo_would_correct_staleness_twice():
    """Suspected in issue #9, confirmed: CISPO's weight sg(clip(π_θ/π_old)) times anchor current's
    sg(π_θ)/μ is (π_θ/π_old)²·π_old/μ. With π_θ ≠ π_old (a second mini-batch) the per-token weight
    on A·∇log π_θ is no longer the importance weight π_θ/μ, so the combination is refused; anchor
    'old' with CISPO gives exactly π_θ/μ inside the clip band."""
    b = random_batch(seed=5, b=4, t=6, noise=0.3)
    with pytest.raises(ConfigError, match="twice"):
        op.LossConfig(kind="cispo", correction={"anchor": "current", "weight": {"level": "token", "mode": "truncate"}})
    # the accepted form: anchor old, unbounded weight, clip wide enough not to bite
    cfg = op.LossConfig(kind="cispo", clip_low=None, clip_high=None,
                        correction={"anchor": "old", "weight": {"level": "token", "mode": "truncate"}})
    lp = b["logprobs"].clone().requires_grad_(True)
    op.policy_loss(lp, b["old"], b["adv"], b["mask"], rollout_logprobs=b["rollout"], config=cfg)[0].backward()
    # d/d log π_θ of −w·A·log π_θ / N with w = π_θ/μ: the IS-weighted REINFORCE gradient
    n = b["mask"].sum()
    want = -(b["logprobs"] - b["rollout"]).exp() * b["adv"] * b["mask"] / n
    torch.testing.assert_close(lp.grad, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rung", [n for n in kernels.IMPLEMENTATIONS if n != "reference"])
@pytest.mark.parametrize("anchor", ["rollout", None])
def test_ppo_gives_no_gradient_where_the_ratio_log_is_clamped(rung, anchor):
    """Found by the 3000-example fuzz: with log(π_θ/π_old) past the ±20 clamp and A < 0 (PPO's
    unclipped branch), the reference's gradient is 0 (clamp's derivative), while the fast rungs
    used r = e^20 as the derivative (a gradient of 4.8e7)."""
    rung_module = kernels.get(rung)
    if not getattr(rung_module, "available", lambda: True)():
        pytest.skip(f"{rung} is not available here")
    mask = torch.ones(2, 3)
    lp = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.4, -0.6]])
    old = torch.tensor([[-34.5, -1.2, -0.1], [-0.2, -21.0, -0.5]])  # Δ = 34 and 20.6 past the clamp
    adv = torch.tensor([[-1.0] * 3, [-2.0] * 3])
    cfg = op.LossConfig(correction={"anchor": "rollout"} if anchor else None)
    grads = {}
    for name in ("reference", rung):
        x = lp.clone().requires_grad_(True)
        loss, _ = op.policy_loss(x, None if anchor else old, adv, mask, rollout_logprobs=old if anchor else None,
                                 config=cfg, implementation=name)
        loss.backward()
        grads[name] = x.grad
    assert grads["reference"][0, 0] == 0 and grads["reference"][1, 1] == 0
    torch.testing.assert_close(grads[rung], grads["reference"], rtol=1e-5, atol=1e-7)
