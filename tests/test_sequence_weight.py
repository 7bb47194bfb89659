"""The sequence weight Π ρ before truncation and the Π-ρ pre-check (issue #56, item 4): hand-derived shares,
the distribution, the bounds each preset exposes, and train's per-step collector against the whole batch."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.core import sequence_weight as sw
from offpolicy.train.sequence_weight import StepSequenceWeights
def batch(per_token: list[float], lengths: list[int], width: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """log ρ ``[B, width]``: row i holds ``per_token[i]`` on its first ``lengths[i]`` tokens (mask 1 there)."""
    lr = torch.zeros(len(lengths), width)
    mask = torch.zeros(len(lengths), width)
    for i, (x, n) in enumerate(zip(per_token, lengths)):
        lr[i, :n] = x
        mask[i, :n] = 1
    return lr, mask


def test_bounds_of_the_sequence_presets():
    bounds = {name: sw.sequence_bounds(op.presets.correction(name))[0] for name in op.presets.names()}
    assert bounds["trl:sequence_mask"] == [sw.SequenceBound("weight", "mask", None, 3.0)]
    assert bounds["trl:sequence_truncate"] == [sw.SequenceBound("weight", "clamp", None, 3.0)]
    assert bounds["skyrl:product_mask"] == [sw.SequenceBound("reject/0", "mask", 0.5, 2.0)]
    # token-level and geometric-mean presets have no Π-ρ stage
    for name in ("recommended", "trl:token_mask", "verl:decoupled_geo_rs", "roll:geometric_is"):
        assert bounds[name] == [] and not sw.is_sequence_level(op.presets.correction(name))
    # a bound chosen from the data has no fixed log C: skipped, named
    cfg = op.CorrectionConfig.from_dict({"weight": {"level": "sequence", "mode": "truncate",
                                                    "high": {"rule": "ess", "target": 0.5}}})
    assert sw.sequence_bounds(cfg) == ([], ["weight: a bound chosen from the data"])


def test_precheck_shares_by_hand():
    # four rows of 2, 10, 20, 30 tokens at log ρ = 0.05 each, one of 10 tokens at −0.05:
    # Σ log ρ = 0.1, 0.5, 1.0, 1.5, −0.5; m = (0.1 + 0.5 + 1.0 + 1.5 − 0.5) / 72 = 2.6 / 72
    lr, mask = batch([0.05, 0.05, 0.05, 0.05, -0.05], [2, 10, 20, 30, 10])
    m = 2.6 / 72
    out = sw.precheck(lr, mask, {"trl:sequence_mask": op.presets.correction("trl:sequence_mask"),
                                 "skyrl:product_mask": op.presets.correction("skyrl:product_mask")})
    assert out["mean_log_ratio"] == pytest.approx(m, rel=1e-6)
    rows = {r["preset"]: r for r in out["presets"]}
    # trl: C = 3, log 3 = 1.0986. measured: Σ = 1.5 only → 1/5. predicted n·m = 0.072, 0.36, 0.72, 1.08, 0.36 → 0/5
    assert rows["trl:sequence_mask"]["measured_outside"] == pytest.approx(1 / 5)
    assert rows["trl:sequence_mask"]["predicted_outside"] == 0.0
    # skyrl [0.5, 2]: log 2 = 0.693; measured: 1.0, 1.5 above, −0.5 inside (≥ log 0.5 = −0.693) → 2/5;
    # predicted: 0.72, 1.08 above → 2/5
    assert rows["skyrl:product_mask"]["measured_outside"] == pytest.approx(2 / 5)
    assert rows["skyrl:product_mask"]["predicted_outside"] == pytest.approx(2 / 5)
    assert not any(r["warn"] for r in out["presets"]) and out["warnings"] == []
    d = out["distribution"]
    assert (d["log_min"], d["log_max"]) == pytest.approx((-0.5, 1.5), rel=1e-6)
    assert d["log_median"] == pytest.approx(0.5, rel=1e-6)  # the lower median: a row's own value
    assert d["median"] == pytest.approx(math.exp(0.5), rel=1e-6) and d["max"] == pytest.approx(math.exp(1.5), rel=1e-6)
    assert d["length_median"] == 10


def test_precheck_warns_when_most_rows_cross_the_bound():
    # 0.02 a token: short rows stay inside log 3, but 80-token rows are at 1.6 > log 3 — predicted and measured
    lr, mask = batch([0.02, 0.02, 0.02], [80, 80, 10], width=80)
    out = sw.precheck(lr, mask, {"trl:sequence_truncate": op.presets.correction("trl:sequence_truncate")})
    (row,) = out["presets"]
    assert row["predicted_outside"] == pytest.approx(2 / 3) and row["measured_outside"] == pytest.approx(2 / 3)
    assert row["warn"]
    (line,) = out["warnings"]
    assert line.startswith("trl:sequence_truncate: weight (clamp) Π ρ outside [0, 3] — the sequence weight Π ρ "
                           "would clamp most rows: predicted 67%")
    assert "against log C = 1.1" in line


def test_drift_below_the_low_bound_is_predicted_from_the_length():
    # four rows of 100 tokens, Σ log ρ = −3.0, −0.4, −0.4, −0.4: one row below log 0.5 = −0.693 (measured 1/4),
    # but m = −4.2 / 400 = −0.0105 a token, so every 100-token row drifts to n·m = −1.05 < log 0.5 (predicted 4/4)
    lr = torch.full((4, 100), -0.004)
    lr[0] = -0.03
    mask = torch.ones(4, 100)
    out = sw.precheck(lr, mask, {"skyrl:product_mask": op.presets.correction("skyrl:product_mask")})
    assert out["mean_log_ratio"] == pytest.approx(-0.0105, rel=1e-5)
    (row,) = out["presets"]
    assert row["measured_outside"] == pytest.approx(1 / 4) and row["predicted_outside"] == 1.0 and row["warn"]
    assert "would mask most rows: predicted 100%" in out["warnings"][0] and "measured 25%" in out["warnings"][0]


def test_non_finite_tokens_and_a_per_token_clamp():
    lr, mask = batch([0.5, 0.5], [4, 4])
    lr[1, 2] = float("-inf")  # outside the trainer's support: left out
    s, n = sw.row_sums(lr, mask)
    assert s.tolist() == pytest.approx([2.0, 1.5]) and n.tolist() == [4, 3]
    s, _ = sw.row_sums(lr, mask, log_clamp=0.2)  # each token clamped before the sum, as correct() does
    assert s.tolist() == pytest.approx([0.8, 0.6])


def test_step_collector_over_micro_batches_equals_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 12, generator=g)
    rollout = old + 0.05 * torch.randn(6, 12, generator=g)
    rollout = rollout.clamp(max=0.0)
    mask = (torch.rand(6, 12, generator=g) > 0.2).float()
    cfg = op.presets.correction("skyrl:product_mask")
    collector = StepSequenceWeights.for_loss(cfg, 6, torch.device("cpu"))
    assert StepSequenceWeights.for_loss(op.presets.correction("recommended"), 6, torch.device("cpu")) is None

    class MB:  # the micro-batch fields old_of reads
        def __init__(self, rows):
            self.mask, self.rollout_logprobs = mask[rows, :9], rollout[rows, :9]

    mask[:, 9:] = 0  # micro-batches are trimmed to their longest response: the rest is padding
    old_of = collector.wrap(lambda rows, mb, lp: old[rows, :9])
    for rows in (torch.tensor([4, 0]), torch.tensor([1, 5, 2]), torch.tensor([3]), torch.tensor([0])):  # 0 again
        old_of(rows, MB(rows), None)
    whole = sw.precheck(old - rollout, mask, {"x": cfg})
    values = collector.values()
    for k in ("min", "median", "max"):
        assert values[f"seq_weight/log_{k}"] == pytest.approx(whole["distribution"][f"log_{k}"], abs=1e-6)
    assert values["seq_weight/measured_outside"] == whole["presets"][0]["measured_outside"]
    assert values["seq_weight/predicted_outside"] == whole["presets"][0]["predicted_outside"]


@pytest.mark.slow
def test_train_logs_the_weight_before_truncation_and_warns_as_typed(offpolicy_cache, tmp_path):
    """``offpolicy train preset=skyrl:product_mask`` with a noisy engine (σ = 2 on its logits: log ρ a token
    ≈ −KL(μ ‖ π), far below 0): the product of every row drops under 0.5, so the pre-check warns once, and
    each step logs the weight's distribution before truncation; ``initial_kl_rows`` logs the engine's KL to π_0."""
    import json
    import os

    from cli_inprocess import offpolicy
    from conftest import FAST

    out = tmp_path / "run"
    result = offpolicy("train", *FAST, "steps=2", "preset=skyrl:product_mask", "engine.logit_noise=2.0",
                       "initial_kl_rows=4", f"out_dir={out}", "--no-progress",
                       env={**os.environ, "OFFPOLICY_CACHE": str(offpolicy_cache)})
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())
    assert text.count("warning: skyrl:product_mask: reject/0 (mask) Π ρ outside [0.5, 2] — the sequence weight Π ρ "
                      "would mask most rows") == 1  # once a run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["seq_weight/log_min"] <= r["seq_weight/log_median"] <= r["seq_weight/log_max"]
        assert r["seq_weight/median"] == pytest.approx(math.exp(r["seq_weight/log_median"]), rel=1e-5)
        assert r["seq_weight/predicted_outside"] > 0.5
        assert r["sync/engine_kl_to_initial"] > 0.1  # σ = 2 logit noise: μ is far from π_0
    # the measured share is what the preset did: its sequence mask removed most rows
    assert rows[0]["seq_weight/measured_outside"] > 0.5 and rows[0]["offpolicy/masked_fraction_seq"] > 0.5
