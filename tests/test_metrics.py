"""Metrics: reducers, merge of micro-batches == one big batch (min/max included), NaN for empty."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from conftest import random_batch
from offpolicy.core.metrics import Metrics

FULL_CORRECTION = op.CorrectionConfig(
    weight={"level": "token", "mode": "truncate", "low": 0.5, "high": 2.0},
    reject=[
        {"stat": "ratio", "level": "any_token", "low": 0.05},
        {"stat": "k3", "level": "seq_mean", "high": 0.2},
        {"stat": "ratio", "level": "geometric", "low": 0.8, "high": 1.25},
    ],
)


def assert_same_metrics(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if math.isnan(a[key]):
            assert math.isnan(b[key]), key
        else:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


def test_reducers_by_hand():
    m = Metrics()
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    m.mean("mean", x, mask)
    m.min("min", x, mask)
    m.max("max", x, mask)
    m.std("std", x, mask)
    m.ess("ess", x, mask)
    m.sum("sum", torch.tensor(5.0))
    m.ratio("ratio", 3.0, 4.0)
    d = m.to_dict()
    assert d["offpolicy/mean"] == 2.0
    assert d["offpolicy/min"] == 1.0 and d["offpolicy/max"] == 3.0  # 100 is masked
    assert d["offpolicy/std"] == pytest.approx(math.sqrt(2 / 3))
    assert d["offpolicy/ess"] == pytest.approx(36 / (3 * 14))  # (Σw)² / (n Σw²)
    assert d["offpolicy/sum"] == 5.0 and d["offpolicy/ratio"] == 0.75


def test_merge_of_two_halves_equals_the_whole():
    b = random_batch(seed=11, b=8, t=12, noise=0.4)
    whole = op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], rollout_logprobs=b["rollout"],
                           config=op.LossConfig(correction=FULL_CORRECTION, dual_clip=3.0))[1]
    halves = [
        op.policy_loss(b["logprobs"][s], b["old"][s], b["adv"][s], b["mask"][s], rollout_logprobs=b["rollout"][s],
                       config=op.LossConfig(correction=FULL_CORRECTION, dual_clip=3.0))[1]
        for s in (slice(0, 3), slice(3, 8))
    ]
    merged = halves[0].merge(halves[1])
    assert_same_metrics(merged.to_dict(), whole.to_dict())
    # and min / max are the true extremes, not an average of halves
    assert merged["is_min"] == min(h["is_min"] for h in halves)
    assert merged["abs_logp_diff_max"] == max(h["abs_logp_diff_max"] for h in halves)


def test_merge_with_global_normaliser_sums_losses():
    b = random_batch(seed=2, b=6, t=5)
    n_tokens = float(b["mask"].sum())
    cfg = op.LossConfig(global_tokens=n_tokens)
    whole_loss, _ = op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], config=op.LossConfig())
    parts = [op.policy_loss(b["logprobs"][s], b["old"][s], b["adv"][s], b["mask"][s], config=cfg)
             for s in (slice(0, 2), slice(2, 6))]
    # gradient accumulation: Σ micro-batch losses with a global token count == the big batch
    assert sum(p[0].item() for p in parts) == pytest.approx(whole_loss.item(), rel=1e-5)
    assert parts[0][1].merge(parts[1][1])["loss"] == pytest.approx(whole_loss.item(), rel=1e-5)


def test_empty_key_reports_nan_and_keys_union_on_merge():
    a, b = Metrics(), Metrics()
    a.mean("only_a", torch.tensor([1.0]))
    b.max("only_b", torch.tensor([1.0]), torch.tensor([False]))  # recorded but empty
    merged = a.merge(b).to_dict()
    assert merged["offpolicy/only_a"] == 1.0
    assert math.isnan(merged["offpolicy/only_b"])


def test_one_key_one_reducer():
    m = Metrics()
    m.mean("x", torch.tensor([1.0]))
    with pytest.raises(ValueError, match="reducer"):
        m.max("x", torch.tensor([1.0]))


def test_lookup_and_prefix():
    m = Metrics()
    m.mean("kl_k1", torch.tensor([0.5]))
    assert m["offpolicy/kl_k1"] == m["kl_k1"] == 0.5
    assert "kl_k1" in m and "offpolicy/kl_k1" in m
    assert list(m.with_prefix("engine/").to_dict()) == ["offpolicy/engine/kl_k1"]
    with pytest.raises(KeyError, match="no metric 'nope'"):
        m["nope"]


def test_every_spec_metric_is_reported():
    b = random_batch(seed=4)
    _, m = op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], rollout_logprobs=b["rollout"],
                          config=op.LossConfig(correction=FULL_CORRECTION, dual_clip=3.0))
    spec = ["kl_k1", "kl_k3", "ppl_train", "ppl_rollout", "log_ppl_diff", "ppl_ratio", "chi2_token", "chi2_seq",
            "abs_logp_diff_mean", "abs_logp_diff_max", "mult_prob_error", "prob_diff_mean", "prob_diff_max", "ess",
            "is_mean", "is_std",
            "is_min", "is_max", "fraction_above_high", "fraction_below_low", "masked_fraction", "clip_fraction",
            "dual_clip_fraction", "approx_kl", "loss"]
    d = m.to_dict()
    for key in spec:
        assert f"offpolicy/{key}" in d, key
    assert any(k.startswith("offpolicy/reject/") and k.endswith("/masked_fraction") for k in d)
    assert all(isinstance(v, float) for v in d.values())
