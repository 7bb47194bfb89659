"""k3 = ρ − 1 − log ρ read as expm1(log ρ) − log ρ everywhere (issue #30): near ρ = 1, where an fp32 engine
and an fp32 trainer sit, exp(log ρ) rounds to fp32's spacing at 1 (2⁻²³ ≈ 1.2e-7) and ρ − 1 − log ρ
loses the whole value (diagnose read 3e-9 where fp64 gives 6e-11).

The golden case, by hand: log μ = −1/2 and log π = −1/2 ± 2⁻¹³ (both exact in fp32), so log ρ = x = ±2⁻¹³
exactly and k3 = x²/2 + x³/6 + x⁴/24 + … = 2⁻²⁷ ± 2⁻³⁹/6 + O(2⁻⁵²):
    x = +2⁻¹³: k3 = 7.450580597e-9 + 3.03e-13;   x = −2⁻¹³: k3 = 7.450580597e-9 − 3.03e-13
mean over the two = 2⁻²⁷ = 7.450580597e-9 (the cubic terms cancel). The float form gives 0 for x = +2⁻¹³:
exp rounds 1 + 2⁻¹³ + 2⁻²⁷ to 1 + 2⁻¹³ (2⁻²⁷ is under half of fp32's spacing at 1).
"""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.measure import diagnose
from offpolicy.measure.diagnose import Sample
from offpolicy.policy.batch import Batch

X = 2.0**-13
K3_PLUS = X * X / 2 + X**3 / 6 + X**4 / 24  # k3 at log ρ = +x, by the series
K3_MINUS = X * X / 2 - X**3 / 6 + X**4 / 24
MEAN_K3 = (K3_PLUS + K3_MINUS) / 2


def golden() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rollout = torch.full((1, 2), -0.5)
    trainer = rollout + torch.tensor([[X, -X]])  # exact: −1/2 + 2⁻¹³ needs 13 bits
    mask = torch.ones(1, 2)
    assert torch.equal(trainer - rollout, torch.tensor([[X, -X]]))
    return trainer, rollout, mask


def test_correct_kl_k3_is_exact_near_one():
    trainer, rollout, mask = golden()
    kl = op.correct(trainer, rollout, mask).metrics["kl_k3"]
    assert kl == pytest.approx(MEAN_K3, rel=1e-4)


def test_k3_rejection_reads_the_value_not_zero():
    # per token k3 ≈ 7.45e-9: a bound of 5e-9 rejects both tokens (the float form read 0 for x = +2⁻¹³ and kept it)
    trainer, rollout, mask = golden()
    cfg = op.CorrectionConfig(reject=[{"stat": "k3", "level": "token", "high": 5e-9}])
    out = op.correct(trainer, rollout, mask, cfg)
    assert out.mask.sum() == 0


@pytest.mark.parametrize("implementation", ["reference", "eager", "triton"])
def test_every_rung_reads_kl_k3_and_approx_kl_exactly(implementation):
    if implementation == "triton":
        pytest.importorskip("triton", reason="triton not installed (install.sh installs it)")
    trainer, rollout, mask = golden()
    cfg = op.LossConfig(kind="ppo",
                        correction=op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0}))
    logprobs = rollout.clone().requires_grad_(True)  # π_θ vs π_old = trainer: log r = ∓2⁻¹³, k3 of −x
    _, m = op.policy_loss(logprobs, trainer, torch.ones(1, 2), mask, rollout_logprobs=rollout, config=cfg,
                          implementation=implementation)
    assert m["kl_k3"] == pytest.approx(MEAN_K3, rel=1e-4)
    assert m["approx_kl"] == pytest.approx(MEAN_K3, rel=1e-4)  # log r = −x per token: the same two values


def test_kl_penalty_k3_value():
    # k3 = exp(ref − log π) − (ref − log π) − 1 with log π − ref = x: expm1(−x) + x = x²/2 − x³/6 + …
    trainer, rollout, _ = golden()
    value = op.kl_penalty(trainer, rollout, kind="k3")
    assert value[0, 0].item() == pytest.approx(K3_MINUS, rel=1e-4)
    assert value[0, 1].item() == pytest.approx(K3_PLUS, rel=1e-4)


def test_diagnose_breakdown_kl_k3():
    trainer, rollout, mask = golden()
    zeros = torch.zeros(1, 2, dtype=torch.long)
    batch = Batch(input_ids=zeros, attention_mask=zeros, positions=zeros, response_ids=zeros, mask=mask,
                  rollout_logprobs=rollout, versions=torch.zeros(1, dtype=torch.long))
    rows = diagnose.breakdowns(Sample(batch, trainer, None))["by_position"]
    assert len(rows) == 1 and rows[0]["kl_k3"] == pytest.approx(MEAN_K3, rel=1e-4)


def test_compiled_rung_reads_kl_k3_and_approx_kl_exactly():
    """The compiled rung at a width inductor vectorises (≥ 16 tokens a row): its C++ backend writes expm1
    as exp − 1 in vector loops (torch/_inductor/codegen/cpp.py, CppVecOverrides.expm1), which read k3 = 0
    here; the core now takes expm1 from the Taylor series near 0, as the Triton rung does."""
    trainer, rollout, _ = golden()
    trainer, rollout = trainer.repeat(2, 32), rollout.repeat(2, 32)  # [2, 64]: ±x alternating, the same mean
    mask = torch.ones(2, 64)
    cfg = op.LossConfig(kind="ppo",
                        correction=op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0}))
    logprobs = rollout.clone().requires_grad_(True)
    _, m = op.policy_loss(logprobs, trainer, torch.ones(2, 64), mask, rollout_logprobs=rollout, config=cfg,
                          implementation="compiled")
    assert m["kl_k3"] == pytest.approx(MEAN_K3, rel=1e-4)
    assert m["approx_kl"] == pytest.approx(MEAN_K3, rel=1e-4)
