"""Presets of the asynchronous-RL systems (issue #14) and the async guard of ``offpolicy train``.

Goldens are derived by hand from the frameworks' code (AReaL 1.0.4: areal/utils/functional/
functional.py ``ppo_actor_loss_fn`` / ``apply_rejection_sampling``); the AReaL parity against its
own function lives in ``test_areal_parity.py``.
"""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

import offpolicy as op
from conftest import FAST
from offpolicy.core.errors import ConfigError
from offpolicy.train.config import load_train_config


# ------------------------------------------------------------------ AReaL presets, by hand
def _areal_loss(preset: str, rho: tuple[float, float], p: float = 0.5) -> float:
    """One row, two valid tokens, π_θ = π_prox = p (PPO ratio 1, no clip), A = 1."""
    prox = torch.full((1, 2), math.log(p))
    mu = prox - torch.log(torch.tensor([rho]))
    theta = prox.clone().requires_grad_(True)
    adv = torch.ones(1, 2)
    loss, _ = op.policy_loss(theta, prox, adv, torch.ones(1, 2), mu, preset, implementation="reference")
    return loss.item()


# ρ = (2, 8): token mask drops ρ=8 > 5 → −(1·2)/2 (fixed denominator: 2 tokens before rejection) = −1
#   token clamp: −(min(2,5) + min(8,5))/2 = −3.5
#   geometric mean exp((ln 2 + ln 8)/2) = 4 ≤ 5 → row kept, weight 4 on both tokens: −(4+4)/2 = −4
#   decoupled without rejection_sampling: no behaviour weight → −(1+1)/2 = −1
# ρ = (2, 32): geometric mean exp((ln 2 + ln 32)/2) = 8 > 5 → seq_mask drops the row: 0/2 = 0;
#   seq_clamp: w = min(8, 5) = 5 → −5
@pytest.mark.parametrize(
    "preset, rho, want",
    [
        ("areal:token_mask", (2.0, 8.0), -1.0),
        ("areal:token_clamp", (2.0, 8.0), -3.5),
        ("areal:seq_mask", (2.0, 8.0), -4.0),
        ("areal:seq_clamp", (2.0, 8.0), -4.0),
        ("areal:decoupled", (2.0, 8.0), -1.0),
        ("areal:seq_mask", (2.0, 32.0), 0.0),
        ("areal:seq_clamp", (2.0, 32.0), -5.0),
    ],
)
def test_areal_goldens(preset, rho, want):
    assert _areal_loss(preset, rho) == pytest.approx(want, rel=1e-6, abs=1e-7)


# ------------------------------------------------------------------ NeMo-RL presets, by hand
# NeMo-RL ClippedPGLossFn (nemo_rl/algorithms/loss_functions.py): same one-row set-up as above.
# ρ = (2, 8): tis min(ρ, 2) → −(2+2)/2 = −2; icepop keeps ρ ∈ [0.5, 5] → −(2 + 0)/2 = −1
#   (the zeroed token still counts in the denominator);
# seq-mask-tis: geometric mean 4 ∉ [0.999, 1.002] → row weight 0 → 0.
# ρ = (1.001, 1.001): geometric mean 1.001 ∈ band → raw token weights: −(1.001+1.001)/2 = −1.001
@pytest.mark.parametrize(
    "preset, rho, want",
    [
        ("nemorl:tis", (2.0, 8.0), -2.0),
        ("nemorl:icepop", (2.0, 8.0), -1.0),
        ("nemorl:seq-mask-tis", (2.0, 8.0), 0.0),
        ("nemorl:seq-mask-tis", (1.001, 1.001), -1.001),
    ],
)
def test_nemorl_goldens(preset, rho, want):
    assert _areal_loss(preset, rho) == pytest.approx(want, rel=1e-6, abs=1e-7)


# ------------------------------------------------------------------ ROLL presets, by hand
# ROLL compute_train_infer_correction, upper_bound 1.2; one row, ρ = (0.5, 2), A = 1, ratio 1:
#   token: −(min(0.5,1.2) + min(2,1.2))/2 = −(0.5+1.2)/2 = −0.85
#   geometric: exp((ln 0.5 + ln 2)/2) = 1 → −1;  sequence: 0.5·2 = 1 → −1
# ρ = (1.1, 1.1): geometric 1.1 → −1.1; sequence 1.21 → capped 1.2 → −1.2
@pytest.mark.parametrize(
    "preset, rho, want",
    [
        ("roll:token_is", (0.5, 2.0), -0.85),
        ("roll:geometric_is", (0.5, 2.0), -1.0),
        ("roll:sequence_is", (0.5, 2.0), -1.0),
        ("roll:geometric_is", (1.1, 1.1), -1.1),
        ("roll:sequence_is", (1.1, 1.1), -1.2),
    ],
)
def test_roll_goldens(preset, rho, want):
    assert _areal_loss(preset, rho) == pytest.approx(want, rel=1e-6, abs=1e-7)


# ------------------------------------------------------------------ issue #14: new estimators, by hand
# Same one-row set-up (π_θ = π_prox = 0.5, A = 1, PPO ratio 1 unless the anchor is rollout).
# areal:m2po, ρ = (1.1, 1.5): m2 = (ln 1.1)² = 0.00908, (ln 1.5)² = 0.1644, mean 0.0867 ≥ 0.04 → drop 0.1644
#   → mean 0.00908 < 0.04; no weight, denominator = survivors (AReaL edits loss_mask first): −1/1 = −1
# nemorl:tis-seq-error, ρ = (1.5, 1/1.5): mean exp|ln ρ| = 1.5 ≤ 2 kept; min(ρ, 2) → −(1.5 + 0.6667)/2;
#   ρ = (2, 8): mean(2, 8) = 5 > 2 → row dropped → 0
# nemorl:icepop-seq-error (π = 0.05), ρ = (1.5, 0.4): mean(1.5, 2.5) = 2 ≤ 2 kept; 0.4 ∉ [0.5, 5] → weight 0
#   → −(1.5 + 0)/2 (the zeroed token stays in the denominator: the mask is not edited)
# prime-rl (anchor rollout: the loss's ratio is π_θ/μ = ρ, no clip, fixed denominator 2):
#   icepop ρ = (2, 10): 10 > 8 dropped → −(2 + 0)/2 = −1;
#   icepop_seq_veto (π = 0.05) ρ = (2, 0.1): min 0.1 < 0.125 → row dropped → 0; icepop alone keeps ρ = 2 → −1
#   dppo ρ = (2, 1.25): μ = (0.25, 0.4), π − μ = (0.25, 0.1); A > 0 and 0.25 > 0.2 → dropped → −(0 + 1.25)/2,
#     plus kl_tau·Σ (ln ρ)² over BOTH tokens (the dropped one too) / 2: 1e-3·((ln 2)² + (ln 1.25)²)/2
#   ipo ρ = (2, 1.1): |π − μ| = (0.25, 0.0455) → first dropped → −1.1/2, plus 1e-3·((ln 2)² + (ln 1.1)²)/2
@pytest.mark.parametrize(
    "preset, rho, want, p",
    [
        ("areal:m2po", (1.1, 1.5), -1.0, 0.5),
        ("nemorl:tis-seq-error", (1.5, 1 / 1.5), -(1.5 + 1 / 1.5) / 2, 0.5),
        ("nemorl:tis-seq-error", (2.0, 8.0), 0.0, 0.05),
        ("nemorl:icepop-seq-error", (1.5, 0.4), -0.75, 0.05),
        ("prime-rl@008468c:icepop", (2.0, 10.0), -1.0, 0.05),
        ("prime-rl@008468c:icepop_seq_veto", (2.0, 0.1), 0.0, 0.05),
        ("prime-rl@008468c:icepop", (2.0, 0.1), -1.0, 0.05),
        ("prime-rl:dppo", (2.0, 1.25), -0.625 + 1e-3 * (math.log(2) ** 2 + math.log(1.25) ** 2) / 2, 0.5),
        ("prime-rl@559b447:ipo", (2.0, 1.1), -0.55 + 1e-3 * (math.log(2) ** 2 + math.log(1.1) ** 2) / 2, 0.5),
        ("roll:segment_is", (1.1, 1.1), -1.1, 0.5),
    ],
)
def test_new_estimator_preset_goldens(preset, rho, want, p):
    assert _areal_loss(preset, rho, p) == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_roll_segment_is_weights_each_turn():
    # one row, mask [1, 0, 1] (a masked tool output between two turns), ρ = (1.44, ·, 0.81), A = 1, ratio 1:
    # segment weights min(1.44, 1.2) = 1.2 and 0.81 → −(1.2 + 0.81)/2 = −1.005 (geometric would give
    # min(√(1.44·0.81), 1.2) = 1.08 on both → −1.08)
    prox = torch.full((1, 3), math.log(0.5))
    mu = prox - torch.log(torch.tensor([[1.44, 1.0, 0.81]]))
    theta = prox.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, _ = op.policy_loss(theta, prox, torch.ones(1, 3), mask, mu, "roll:segment_is")
    assert loss.item() == pytest.approx(-1.005, rel=1e-6)
    geo, _ = op.policy_loss(theta, prox, torch.ones(1, 3), mask, mu, "roll:geometric_is")
    assert geo.item() == pytest.approx(-1.08, rel=1e-6)


def test_new_presets_are_listed_with_summaries():
    from cli_inprocess import run_cli  # the CLI in this process (tests/cli_inprocess.py)

    out = run_cli("presets")
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("areal:decoupled", "areal:token_mask", "areal:token_clamp", "areal:seq_mask", "areal:seq_clamp",
                 "nemorl:tis", "nemorl:icepop", "nemorl:seq-mask-tis", "roll:token_is", "roll:geometric_is",
                 "roll:sequence_is", "roll:segment_is", "areal:m2po", "nemorl:tis-seq-error",
                 "nemorl:icepop-seq-error", "nemorl:tis-score-centering", "nemorl:icepop-score-centering",
                 "prime-rl@008468c:icepop", "prime-rl@008468c:icepop_seq_veto",
                 "prime-rl:dppo", "prime-rl@559b447:ipo", "prime-rl:ipo", "prime-rl:ipo_score_centering",
                 "prime-rl:icepop", "prime-rl:ppo", "prime-rl:cispo"):
        assert name in out.stdout
        assert op.presets.get(name).summary and op.presets.get(name).note


# ------------------------------------------------------------------ async guard
def test_staleness_without_correction_is_refused_in_python():
    with pytest.raises(ConfigError, match=r"max_staleness=2 .*preset=none"):
        load_train_config(None, ["max_staleness=2", "preset=null"])
    # each way out is accepted: an explicit opt-out, a preset, an explicit loss.correction
    assert load_train_config(None, ["max_staleness=2", "preset=none"]).loss_config().correction is None
    assert load_train_config(None, ["max_staleness=2"]).loss_config().correction is not None
    cfg = load_train_config(None, ["max_staleness=2", "preset=null", "loss.correction.anchor=old"])
    assert cfg.loss_config().correction is not None
    # synchronous training without a correction stays allowed (μ differs from π_old only by numerics)
    assert load_train_config(None, ["preset=null"]).loss_config().correction is None


def _train(*args: str, cache) -> subprocess.CompletedProcess:
    import os

    from cli_inprocess import run_cli  # the CLI in this process (tests/cli_inprocess.py)

    return run_cli("train", *args, env={**os.environ, "OFFPOLICY_CACHE": str(cache)})


def test_async_guard_as_a_user_types_it(offpolicy_cache, tmp_path):
    refused = _train("max_staleness=2", "preset=null", f"out_dir={tmp_path / 'refused'}", cache=offpolicy_cache)
    assert refused.returncode != 0
    text = refused.stdout + refused.stderr
    assert "max_staleness=2" in text and "NeMo-RL" in text and "preset=none" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]  # a config error, not a crash
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_async_guard_opt_out_trains(offpolicy_cache, tmp_path):
    out = tmp_path / "optout"
    run = _train(*FAST, "steps=1", "max_staleness=2", "preset=none", f"out_dir={out}", "--no-progress",
                 cache=offpolicy_cache)
    assert run.returncode == 0, (run.stdout + run.stderr)[-2000:]
    assert (out / "metrics.jsonl").read_text().strip()


# ------------------------------------------------------------------ prox_logp: loglinear (AReaL)
def test_prox_logp_option_is_validated():
    assert load_train_config(None, []).prox_logp == "forward"
    assert load_train_config(None, ["prox_logp=loglinear", "minibatches=4"]).prox_logp == "loglinear"
    with pytest.raises(ConfigError, match="prox_logp"):
        load_train_config(None, ["prox_logp=linear"])


@pytest.mark.slow
def test_loglinear_run_skips_the_pi_old_forward(offpolicy_cache, tmp_path):
    import json

    out = tmp_path / "loglinear"
    run = _train(*FAST, "steps=2", "minibatches=2", "max_staleness=1", "prox_logp=loglinear", f"out_dir={out}",
                 "--no-progress", cache=offpolicy_cache)
    assert run.returncode == 0, (run.stdout + run.stderr)[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time/pi_old"] < 1e-3 for r in rows)  # no forward: nothing timed
    assert all(math.isfinite(r["offpolicy/loss"]) for r in rows)


# ------------------------------------------------------------------ prime-rl's KL term (kl_to / kl_mask)
def _prime_rl_loss(theta, mu, adv, mask, keep, kl_tau, kl_mask_type, squared):
    """prime-rl's per-token loss, written out from its code (not imported: prime-rl needs CUDA-era
    deps). HEAD 559b447 src/prime_rl/trainer/rl/loss.py default_loss_fn / ipo_loss_fn:
    per_token = −keep·A·exp(log π_θ − log μ) + kl_tau·loss_mask·(log π_θ − log μ)², summed and
    divided by loss_scale = Σ loss_mask. 008468c compute_loss: kl_tau·Σ_{kl_mask} (log π_θ − log μ)
    (k1, not squared) with kl_mask = loss_mask (all) / loss_mask & is_masked (masked) / keep (unmasked)."""
    log_ratio = theta - mu
    region = {"all": mask, "masked": mask & ~keep, "unmasked": keep}[kl_mask_type]
    kl = log_ratio**2 if squared else log_ratio
    per_token = -(keep * adv * torch.exp(log_ratio)) + kl_tau * region * kl
    return per_token.sum() / mask.sum()


def _prime_rl_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    mu = torch.log(torch.rand(B, T, generator=g) * 0.9 + 0.05)
    theta = (mu + 1.5 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)  # π_θ ≤ 1; some ρ past [1/8, 8]
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, 3:] = False
    return theta, mu, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("preset, kl_overrides, kl_tau, kl_mask_type, squared", [
    ("prime-rl:dppo", {}, 1e-3, "all", True),               # HEAD defaults: the preset as shipped
    ("prime-rl@559b447:ipo", {}, 1e-3, "all", True),
    ("prime-rl:dppo", {"kl_coef": 0.2}, 0.1, "all", True),   # a kl_tau large enough to matter
    ("prime-rl@008468c:icepop", {"kl_coef": 0.05, "kl_kind": "k1", "kl_to": "rollout", "kl_mask": "valid"}, 0.05, "all", False),
    ("prime-rl@008468c:icepop", {"kl_coef": 0.05, "kl_kind": "k1", "kl_to": "rollout", "kl_mask": "rejected"}, 0.05,
     "masked", False),
    ("prime-rl@008468c:icepop", {"kl_coef": 0.05, "kl_kind": "k1", "kl_to": "rollout", "kl_mask": "kept"}, 0.05,
     "unmasked", False),
])
def test_prime_rl_kl_term_matches_its_code(seed, preset, kl_overrides, kl_tau, kl_mask_type, squared):
    theta, mu, adv, mask = _prime_rl_batch(seed)
    cfg = op.presets.loss(preset).model_copy(update=kl_overrides)
    cfg = op.LossConfig(**cfg.model_dump())  # re-validate the overrides
    lp = theta.clone().requires_grad_(True)
    ours, metrics = op.policy_loss(lp, None, adv, mask.float(), mu, cfg)
    ours.backward()
    # prime-rl's keep mask, from its rule as written (prob_diff by A's sign / |Δp| / the ratio band)
    p_diff = theta.exp() - mu.exp()
    if preset == "prime-rl:dppo":
        keep = mask & ~torch.where(adv > 0, p_diff > 0.2, p_diff < -0.2)
    elif preset == "prime-rl@559b447:ipo":
        keep = mask & ~(p_diff.abs() > 0.1)
    else:
        rho = (theta - mu).exp()
        keep = mask & ~((rho < 0.125) | (rho > 8.0))
    assert (~keep & mask).any() and keep.any(), "the batch must have both kept and rejected tokens"
    ref_lp = theta.clone().double().requires_grad_(True)
    want = _prime_rl_loss(ref_lp, mu.double(), adv.double(), mask, keep, kl_tau, kl_mask_type, squared)
    want.backward()
    assert ours.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(lp.grad.double(), ref_lp.grad, rtol=1e-5, atol=1e-7)
    # the KL gradient reaches the rejected tokens exactly when prime-rl's does
    rejected = mask & ~keep
    assert bool((lp.grad[rejected] != 0).any()) == (kl_mask_type in ("all", "masked"))
    assert math.isfinite(metrics["kl_ref"])


def test_kl_to_rollout_needs_no_ref_and_refuses_one():
    theta, mu, adv, mask = _prime_rl_batch(0)
    with pytest.raises(ValueError, match="ref_logprobs= must not be given"):
        op.policy_loss(theta, None, adv, mask.float(), mu, "prime-rl:dppo", ref_logprobs=mu)
    # the same loss through kl_to ref with ref_logprobs = μ: identical
    explicit = op.presets.loss("prime-rl:dppo").model_copy(update={"kl_to": "ref"})
    a, _ = op.policy_loss(theta, None, adv, mask.float(), mu, "prime-rl:dppo")
    b, _ = op.policy_loss(theta, None, adv, mask.float(), mu, explicit, ref_logprobs=mu)
    assert a.item() == b.item()


@pytest.mark.parametrize("fields, match", [
    ({"kl_to": "rollout"}, "kl_coef is 0"),
    ({"kl_coef": 0.1, "kl_mask": "valid"}, "there is no correction"),
    ({"kl_coef": 0.1, "kl_mask": "valid", "correction": {"anchor": "rollout", "reject": [
        {"stat": "ratio", "level": "token", "low": 0.5, "high": 2.0}]}}, "denominator 'fixed'"),
    ({"kl_coef": 0.1, "kl_mask": "rejected", "correction": {"anchor": "old", "kl_is_weight": True,
      "weight": {"level": "token", "mode": "truncate", "high": 2.0}, "denominator": "fixed"}}, "kl_is_weight"),
])
def test_kl_mask_and_kl_to_are_validated(fields, match):
    with pytest.raises(ConfigError, match=match):
        op.LossConfig(**fields)


def test_train_refuses_a_kl_to_a_reference_it_does_not_have():
    with pytest.raises(ConfigError, match="no reference model"):
        load_train_config(None, ["loss.kl_coef=0.1"])
    cfg = load_train_config(None, ["loss.kl_coef=0.01", "loss.kl_to=rollout"])
    assert cfg.loss_config().kl_to == "rollout"
    # prime-rl's presets bring their KL to μ and train as they are
    assert load_train_config(None, ["preset=prime-rl:dppo"]).loss_config().correction is not None
