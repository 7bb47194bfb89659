"""Issue #46 item 5: the metrics the field added in 2026, on the golden batch (hand-derived).

``conftest.golden_batch``: ρ = [[0.5, 1, 4], [2, 1, ·], [1, 1, 1], [·, ·, ·]]; k3(ρ) = ρ − 1 − ln ρ.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import offpolicy as op
from offpolicy.core.metrics import Metrics
from offpolicy.train.update import drift_and_split_metrics

K3 = {r: r - 1 - math.log(r) for r in (0.5, 2.0, 4.0)}  # 0.193147, 0.306853, 1.613706
ADV = torch.tensor([[1.0, 0.0, -1.0], [1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])


def _split(gb, advantages=ADV, **cfg) -> dict[str, float]:
    config = op.CorrectionConfig(**cfg)
    out = op.correct(gb["old"], gb["rollout"], gb["mask"], config, advantages=advantages)
    return op.split_metrics(out, config, advantages).to_dict()


def test_kl_on_kept_and_masked_tokens_and_the_masked_advantage_signs(gb):
    # the band [0.6, 1.5] masks ρ = 0.5 (A = +1), 4 (A = −1) and 2 (A = +1); the kept tokens all have ρ = 1
    m = _split(gb, reject=[{"stat": "ratio", "level": "token", "low": 0.6, "high": 1.5}])
    assert m["offpolicy/kl_k3_masked"] == pytest.approx((K3[0.5] + K3[4.0] + K3[2.0]) / 3, rel=1e-6)  # 0.704569
    assert m["offpolicy/kl_k3_kept"] == pytest.approx(0.0, abs=1e-7)
    assert m["offpolicy/masked_advantage_positive"] == pytest.approx(2 / 3)
    assert m["offpolicy/masked_advantage_negative"] == pytest.approx(1 / 3)


def test_nothing_masked_reports_no_data_not_zero(gb):
    m = _split(gb)
    assert math.isnan(m["offpolicy/kl_k3_masked"]) and math.isnan(m["offpolicy/masked_advantage_positive"])
    # every valid token kept: the mean k3 of all 8 tokens
    assert m["offpolicy/kl_k3_kept"] == pytest.approx((K3[0.5] + K3[4.0] + K3[2.0]) / 8, rel=1e-6)
    assert "offpolicy/masked_advantage_positive" not in _split(gb, advantages=None)


@pytest.mark.parametrize("level, above", [
    # token: raw row means (0.5+1+4)/3 = 1.833 > 1.5, (2+1)/2 = 1.5 (not above), 1 — the clamped weights'
    # row means (0.8+1+1.5)/3 = 1.1, 1.5, 1 never exceed the cap, which is why verl #6806 reads the raw ones
    ("token", 1 / 3),
    ("sequence", 2 / 3),  # products 2, 2, 1
    ("geometric", 0.0),  # 2^(1/3) = 1.26, √2 = 1.41, 1
])
def test_sequence_fraction_from_raw_weights(gb, level, above):
    m = _split(gb, weight={"level": level, "mode": "truncate", "low": 0.8, "high": 1.5})
    assert m["offpolicy/seq_fraction_above_high"] == pytest.approx(above)
    assert m["offpolicy/seq_fraction_below_low"] == 0.0


def test_sequence_fraction_below_low_and_only_with_a_weight(gb):
    m = _split(gb, weight={"level": "token", "mode": "truncate", "low": 1.2, "high": 5.0})
    assert m["offpolicy/seq_fraction_below_low"] == pytest.approx(1 / 3)  # row 2's mean 1 < 1.2; 1.83, 1.5 are not
    assert "offpolicy/seq_fraction_above_high" in m and m["offpolicy/seq_fraction_above_high"] == 0.0
    no_weight = _split(gb, reject=[{"stat": "ratio", "level": "token", "high": 3}])
    assert "offpolicy/seq_fraction_above_high" not in no_weight


def test_split_metrics_merge_like_one_batch(gb):
    """Means and count ratios: two halves merged = the whole batch."""
    cfg = op.CorrectionConfig(reject=[{"stat": "ratio", "level": "token", "low": 0.6, "high": 1.5}],
                              weight={"level": "token", "mode": "truncate", "high": 1.5})
    mask = gb["mask"].clone()
    mask[3, 0] = 1  # every part needs a valid token: row 3 gets one (ρ = 1)
    old, rollout = gb["old"].nan_to_num(-3.0), gb["rollout"].nan_to_num(-3.0)

    def part(rows):
        out = op.correct(old[rows], rollout[rows], mask[rows], cfg, advantages=ADV[rows])
        return op.split_metrics(out, cfg, ADV[rows])

    whole = part(slice(0, 4)).to_dict()
    merged = part(slice(0, 2)).merge(part(slice(2, 4))).to_dict()
    assert whole.keys() == merged.keys()
    for key, value in whole.items():
        assert merged[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("anchor, want", [("old", [0.1, 0.3]), ("rollout", [0.5, 0.2])])
def test_minibatch_drift_is_against_the_ratios_denominator(anchor, want):
    """|log π_θ − log π_ref|: π_old under anchor old, μ under anchor rollout (SkyRL #1813)."""
    logprobs = torch.tensor([[-1.0, -2.0, -5.0]])
    old = torch.tensor([[-1.1, -2.3, -5.0]])
    mb = SimpleNamespace(mask=torch.tensor([[1.0, 1.0, 0.0]]), rollout_logprobs=torch.tensor([[-1.5, -1.8, -1.0]]))
    cfg = op.LossConfig(correction=op.CorrectionConfig(anchor=anchor))
    metrics = Metrics()
    drift_and_split_metrics(logprobs, old, torch.ones(1, 3), mb, cfg, metrics)
    values = metrics.to_dict()
    assert values["offpolicy/drift/abs_logp_mean"] == pytest.approx(sum(want) / 2, rel=1e-5)
    assert values["offpolicy/drift/abs_logp_max"] == pytest.approx(max(want), rel=1e-5)
    assert "offpolicy/kl_k3_kept" in values
    no_corr = Metrics()
    drift_and_split_metrics(logprobs, None, torch.ones(1, 3), mb, op.LossConfig(), no_corr)
    assert no_corr.to_dict()["offpolicy/drift/abs_logp_mean"] == pytest.approx(0.35, rel=1e-5)  # vs μ: 0.5, 0.2
