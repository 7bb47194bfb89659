"""Golden cases for weighting and rejection, derived by hand from docs/specification.md §3–§4.

The batch is ``conftest.golden_batch``: ρ = [[0.5, 1, 4], [2, 1, ·], [1, 1, 1], [·, ·, ·]].
Every expected number below is written with its arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from conftest import BASE

CBRT2 = 2 ** (1 / 3)  # geometric mean of row 0: (0.5·1·4)^(1/3)
SQRT2 = math.sqrt(2)  # geometric mean of row 1: (2·1)^(1/2)


def weights_for(gb, **cfg) -> torch.Tensor:
    return op.correct(gb["old"], gb["rollout"], gb["mask"], op.CorrectionConfig(**cfg)).weights


def kept_for(gb, *rules, **cfg) -> list[list[int]]:
    out = op.correct(gb["old"], gb["rollout"], gb["mask"], op.CorrectionConfig(reject=list(rules), **cfg))
    return out.mask.int().tolist()


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- weighting
def test_no_weight_is_the_mask(gb):
    close(weights_for(gb), [[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]])


def test_token_truncate_upper_only(gb):
    # min(ρ, 2): 0.5→0.5, 4→2, 2→2
    close(weights_for(gb, weight={"level": "token", "mode": "truncate", "high": 2.0}),
          [[0.5, 1, 2], [2, 1, 0], [1, 1, 1], [0, 0, 0]])


def test_token_truncate_two_sided(gb):
    # clamp(ρ, 0.8, 2): 0.5→0.8
    close(weights_for(gb, weight={"level": "token", "mode": "truncate", "low": 0.8, "high": 2.0}),
          [[0.8, 1, 2], [2, 1, 0], [1, 1, 1], [0, 0, 0]])


def test_token_mask_keeps_value_inside_band(gb):
    # ρ·1[0.6 ≤ ρ ≤ 3]: 0.5→0, 4→0, 2→2 (value kept, not capped)
    close(weights_for(gb, weight={"level": "token", "mode": "mask", "low": 0.6, "high": 3.0}),
          [[0, 1, 0], [2, 1, 0], [1, 1, 1], [0, 0, 0]])


def test_sequence_truncate_is_a_product(gb):
    # row 0: 0.5·1·4 = 2 → min(2, 1.5) = 1.5; row 1: 2·1 = 2 → 1.5; row 2: 1
    close(weights_for(gb, weight={"level": "sequence", "mode": "truncate", "high": 1.5}),
          [[1.5, 1.5, 1.5], [1.5, 1.5, 0], [1, 1, 1], [0, 0, 0]])


def test_sequence_mask_zeroes_rows(gb):
    # Π ρ ≤ 1.5 keeps row 2 only; products of rows 0 and 1 are 2
    close(weights_for(gb, weight={"level": "sequence", "mode": "mask", "high": 1.5}),
          [[0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]])


def test_geometric_truncate(gb):
    # row 0: 2^(1/3) = 1.259921 < 1.3 stays; row 1: √2 = 1.414 → 1.3
    close(weights_for(gb, weight={"level": "geometric", "mode": "truncate", "high": 1.3}),
          [[CBRT2] * 3, [1.3, 1.3, 0], [1, 1, 1], [0, 0, 0]])


def test_geometric_mask(gb):
    # band [0.9, 1.3]: row 0 (1.26) kept at its value, row 1 (1.414) zeroed
    close(weights_for(gb, weight={"level": "geometric", "mode": "mask", "low": 0.9, "high": 1.3}),
          [[CBRT2] * 3, [0, 0, 0], [1, 1, 1], [0, 0, 0]])


def test_token_normalize_divides_by_mean_over_valid_tokens(gb):
    # weights 0.5,1,2 | 2,1 | 1,1,1 → sum 9.5 over 8 valid tokens → mean 1.1875
    m = 9.5 / 8
    close(weights_for(gb, weight={"level": "token", "mode": "truncate", "high": 2.0, "normalize": True}),
          [[0.5 / m, 1 / m, 2 / m], [2 / m, 1 / m, 0], [1 / m] * 3, [0, 0, 0]])


def test_sequence_normalize_divides_by_mean_over_rows(gb):
    # row weights 1.5, 1.5, 1 over 3 non-empty rows → mean 4/3 (the padded row does not count)
    m = 4 / 3
    close(weights_for(gb, weight={"level": "sequence", "mode": "truncate", "high": 1.5, "normalize": True}),
          [[1.5 / m] * 3, [1.5 / m, 1.5 / m, 0], [1 / m] * 3, [0, 0, 0]])


def test_weight_metrics_ignore_padding(gb):
    out = op.correct(gb["old"], gb["rollout"], gb["mask"],
                     op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0}))
    m = out.metrics
    # weights over the 8 valid tokens: 0.5, 1, 2, 2, 1, 1, 1, 1 → mean 9.5/8, min 0.5, max 2
    assert m["is_mean"] == pytest.approx(9.5 / 8)
    assert m["is_min"] == pytest.approx(0.5)
    assert m["is_max"] == pytest.approx(2.0)
    # E[w²] = (0.25+1+4+4+1+1+1+1)/8 = 13.25/8; std = sqrt(13.25/8 − (9.5/8)²)
    assert m["is_std"] == pytest.approx(math.sqrt(13.25 / 8 - (9.5 / 8) ** 2))
    # raw ratios above 2: only the 4 → 1/8; below low: no low bound → 0
    assert m["fraction_above_high"] == pytest.approx(1 / 8)
    assert m["fraction_below_low"] == 0.0


def test_mismatch_metrics_by_hand(gb):
    m = op.correct(gb["old"], gb["rollout"], gb["mask"]).metrics
    ratios = [0.5, 1, 4, 2, 1, 1, 1, 1]
    logs = [math.log(r) for r in ratios]
    n = 8
    assert m["kl_k1"] == pytest.approx(sum(-x for x in logs) / n)  # mean(log μ − log π)
    assert m["kl_k3"] == pytest.approx(sum(r - 1 - x for r, x in zip(ratios, logs)) / n)
    assert m["chi2_token"] == pytest.approx(sum(r * r for r in ratios) / n - 1)
    # chi2_seq: rows' products 2, 2, 1 → mean(4, 4, 1) − 1 = 2
    assert m["chi2_seq"] == pytest.approx(2.0)
    assert m["abs_logp_diff_max"] == pytest.approx(math.log(4))
    assert m["ess"] == pytest.approx((sum(ratios) / n) ** 2 / (sum(r * r for r in ratios) / n))
    # ppl_train per row: exp(−mean log π_old) with log π_old = −3 + log ρ
    rows = [[0.5, 1, 4], [2, 1], [1, 1, 1]]
    ppl_train = [math.exp(-sum(BASE + math.log(r) for r in row) / len(row)) for row in rows]
    assert m["ppl_train"] == pytest.approx(sum(ppl_train) / 3, rel=1e-5)
    assert m["ppl_rollout"] == pytest.approx(math.exp(3.0), rel=1e-5)
    # log_ppl_diff per row = mean log μ − mean log π_old = −mean log ρ
    diffs = [-sum(math.log(r) for r in row) / len(row) for row in rows]
    assert m["log_ppl_diff"] == pytest.approx(sum(diffs) / 3, abs=1e-6)
    assert m["ppl_ratio"] == pytest.approx(sum(math.exp(d) for d in diffs) / 3, rel=1e-5)
    # prob_diff = |μ·ρ − μ| with μ = e^−3
    mu = math.exp(BASE)
    assert m["prob_diff_max"] == pytest.approx(3 * mu, rel=1e-5)
    assert m["prob_diff_mean"] == pytest.approx(sum(abs(mu * r - mu) for r in ratios) / n, rel=1e-5)
    assert m["valid_tokens"] == 8


# --------------------------------------------------------------------------- rejection
ALL = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]]


@pytest.mark.parametrize(
    "rule, expected",
    [
        # token band [0.6, 3]: drops 0.5 and 4 in row 0
        ({"stat": "ratio", "level": "token", "low": 0.6, "high": 3.0}, [[0, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]),
        # Π ρ in [0.5, 1.5]: rows 0, 1 have product 2 → dropped
        ({"stat": "ratio", "level": "sequence", "low": 0.5, "high": 1.5}, [[0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]),
        # geometric in [0.8, 1.3]: row 0 1.26 kept, row 1 1.414 dropped
        ({"stat": "ratio", "level": "geometric", "low": 0.8, "high": 1.3}, [[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]]),
        # any token outside [0.4, 3]: row 0 has a 4
        ({"stat": "ratio", "level": "any_token", "low": 0.4, "high": 3.0}, [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]),
        # verl legacy veto (low 1e-4 only): nothing that small
        ({"stat": "ratio", "level": "any_token", "low": 1e-4}, ALL),
        # k1 = −log ρ per token in [−0.5, 0.5]: row 0 k1 = [0.69, 0, −1.39] keeps the middle; row 1 [−0.69, 0]
        ({"stat": "k1", "level": "token", "low": -0.5, "high": 0.5}, [[0, 1, 0], [0, 1, 0], [1, 1, 1], [0, 0, 0]]),
        # k2 = ½(log ρ)² ≤ 0.3: row 0 [0.24, 0, 0.96] drops the last; row 1 [0.24, 0] kept
        ({"stat": "k2", "level": "token", "high": 0.3}, [[1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]),
        # k3 = ρ−1−log ρ, row max ≤ 0.2: row 0 max k3(4) = 1.61, row 1 k3(2) = 0.31 → both dropped
        ({"stat": "k3", "level": "seq_max", "high": 0.2}, [[0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]),
        # Σ k1 in [−0.5, 0.5]: rows 0 and 1 sum to −log 2 = −0.69 → dropped
        ({"stat": "k1", "level": "seq_sum", "low": -0.5, "high": 0.5}, [[0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]),
        # mean k1 in [−0.3, 0.3]: row 0 −0.231 kept, row 1 −0.347 dropped
        ({"stat": "k1", "level": "seq_mean", "low": -0.3, "high": 0.3}, [[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]]),
        # mean k2 ≤ 0.3: row 0 (0.240+0+0.961)/3 = 0.400 dropped; row 1 0.120 kept
        ({"stat": "k2", "level": "seq_mean", "high": 0.3}, [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]),
        # Σ k3 ≤ 0.5: row 0 0.193+0+1.614 dropped; row 1 0.307 kept
        ({"stat": "k3", "level": "seq_sum", "high": 0.5}, [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]),
    ],
)
def test_rejection_rules(gb, rule, expected):
    assert kept_for(gb, rule) == expected


def test_rules_are_anded(gb):
    # token band drops row 0's ends; geometric [0.8, 1.3] drops row 1
    got = kept_for(gb, {"stat": "ratio", "level": "token", "low": 0.6, "high": 3.0},
                   {"stat": "ratio", "level": "geometric", "low": 0.8, "high": 1.3})
    assert got == [[0, 1, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]


def test_sequential_mode_sees_the_reduced_mask(gb):
    rules = ({"stat": "ratio", "level": "token", "low": 0.4, "high": 3.0},
             {"stat": "ratio", "level": "geometric", "low": 0.7, "high": 1.1})
    # independent: geometric on the full row 0 is 1.26 > 1.1 → row 0 gone
    assert kept_for(gb, *rules) == [[0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]
    # sequential: the token rule first drops ρ = 4; row 0's geometric mean becomes √0.5 = 0.707 ∈ band
    assert kept_for(gb, *rules, reject_mode="sequential") == [[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]


def test_opsm(gb):
    # current = π_old, so mean_t(log μ − log π_θ) = −mean log ρ: row 0 −0.231, row 1 −0.347, row 2 0
    adv = torch.tensor([[-1.0] * 3, [-1.0] * 3, [1.0] * 3, [0.0] * 3])
    logprobs = torch.nan_to_num(gb["old"], nan=0.0)
    out = op.correct(gb["old"], gb["rollout"], gb["mask"],
                     op.CorrectionConfig(reject=[{"stat": "opsm", "delta": -0.3}]),
                     logprobs=logprobs, advantages=adv)
    # row 0: A < 0 and −0.231 > −0.3 → dropped; row 1: −0.347 ≤ −0.3 → kept; row 2: A > 0 → kept
    assert out.mask.int().tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]


def test_opsm_needs_logprobs_and_advantages(gb):
    with pytest.raises(ValueError, match="opsm.*logprobs"):
        op.correct(gb["old"], gb["rollout"], gb["mask"], op.CorrectionConfig(reject=[{"stat": "opsm", "delta": 0.1}]))


def test_binary_kl(gb):
    def bkl(p: float, q: float) -> float:
        return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

    mu = math.exp(BASE)
    row0 = sum(bkl(mu, mu * r) for r in (0.5, 1, 4)) / 3  # ≈ 0.0427
    row1 = sum(bkl(mu, mu * r) for r in (2, 1)) / 2  # ≈ 0.0118
    assert row1 < 0.02 < row0
    out = op.correct(gb["old"], gb["rollout"], gb["mask"],
                     op.CorrectionConfig(reject=[{"stat": "binary_kl", "high": 0.02}]))
    assert out.mask.int().tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]


def test_rejection_metrics(gb):
    out = op.correct(gb["old"], gb["rollout"], gb["mask"], op.CorrectionConfig(reject=[
        {"stat": "ratio", "level": "token", "low": 0.6, "high": 3.0},  # removes 2 of 8 tokens, touches 1 of 3 rows
        {"stat": "ratio", "level": "sequence", "low": 0.5, "high": 1.5},  # removes rows 0, 1: 5 tokens, 2 rows
    ]))
    m = out.metrics
    assert m["reject/0_ratio_token/masked_fraction"] == pytest.approx(2 / 8)
    assert m["reject/0_ratio_token/masked_fraction_seq"] == pytest.approx(1 / 3)
    assert m["reject/1_ratio_sequence/masked_fraction"] == pytest.approx(5 / 8)
    assert m["reject/1_ratio_sequence/masked_fraction_seq"] == pytest.approx(2 / 3)
    assert m["masked_fraction"] == pytest.approx(5 / 8)  # only row 2 survives: 3 of 8 tokens
    assert m["masked_fraction_seq"] == pytest.approx(2 / 3)


def test_weights_are_computed_on_the_surviving_mask(gb):
    # token rule drops ρ = 4 first; sequence TIS then sees row 0 = 0.5·1 = 0.5 (not 2)
    out = op.correct(gb["old"], gb["rollout"], gb["mask"], op.CorrectionConfig(
        reject=[{"stat": "ratio", "level": "token", "high": 3.0}],
        weight={"level": "sequence", "mode": "truncate", "high": 10.0}))
    close(out.weights, [[0.5, 0.5, 0], [2, 2, 0], [1, 1, 1], [0, 0, 0]])


def test_everything_rejected_reports_full_masking(gb):
    out = op.correct(gb["old"], gb["rollout"], gb["mask"],
                     op.CorrectionConfig(reject=[{"stat": "ratio", "level": "token", "low": 5.0}]))
    assert out.mask.sum() == 0
    assert out.weights.sum() == 0
    assert out.metrics["masked_fraction"] == 1.0
    assert math.isnan(out.metrics["is_mean"])  # an empty key reports NaN, never a silent 0


def test_log_clamp_bounds_the_ratio():
    mask = torch.ones(1, 2)
    rollout = torch.tensor([[-60.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0]])  # log ρ = 59 → clamped to 20
    out = op.correct(old, rollout, mask, op.CorrectionConfig(weight={"level": "token", "mode": "truncate"}))
    assert out.weights[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    unclamped = op.correct(old, rollout, mask,
                           op.CorrectionConfig(weight={"level": "token", "mode": "truncate"}, log_clamp=None))
    assert unclamped.weights[0, 0].item() == pytest.approx(math.exp(59.0), rel=1e-4)
    assert torch.isfinite(unclamped.weights).all()


def test_anchor_current_uses_detached_logprobs(gb):
    logprobs = torch.nan_to_num(gb["rollout"], nan=0.0) + torch.tensor([[math.log(2.0), 0, 0]] * 4)
    logprobs.requires_grad_(True)
    out = op.correct(None, gb["rollout"], gb["mask"],
                     op.CorrectionConfig(anchor="current", weight={"level": "token", "mode": "truncate", "high": 5.0}),
                     logprobs=logprobs)
    assert not out.weights.requires_grad
    close(out.weights, [[2, 1, 1], [2, 1, 0], [2, 1, 1], [0, 0, 0]])


def test_anchor_rollout_applies_no_weight_but_rejects(gb):
    logprobs = torch.nan_to_num(gb["old"], nan=0.0)
    out = op.correct(None, gb["rollout"], gb["mask"],
                     op.CorrectionConfig(anchor="rollout", reject=[{"stat": "ratio", "level": "token", "high": 3.0}]),
                     logprobs=logprobs)
    close(out.weights, [[1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]])


def test_correct_accepts_preset_names_and_dicts(gb):
    by_name = op.correct(gb["old"], gb["rollout"], gb["mask"], "verl:decoupled_token_is").weights
    by_dict = op.correct(gb["old"], gb["rollout"], gb["mask"],
                         {"weight": {"level": "token", "mode": "truncate", "high": 2.0}}).weights
    torch.testing.assert_close(by_name, by_dict)
