"""Property tests (hypothesis) for the invariants of docs/specification.md §2–§7."""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.core.config import LossConfig

LOSS_KINDS = ["ppo", "gspo", "cispo", "sapo", "reinforce"]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@st.composite
def batches(draw, max_b: int = 5, max_t: int = 7, lp_min: float = -30.0, max_shift: float = 5.0):
    """Random right-padded batches with at least one valid token; finite log-probs ≤ 0."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    assume(sum(lengths) > 0)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    scale = draw(st.sampled_from([0.01, 0.3, 3.0]))

    def logprobs():
        return (torch.rand(b, t, generator=g) * lp_min).clamp(max=0.0)

    old = logprobs()
    rollout = (old + scale * max_shift * torch.randn(b, t, generator=g)).clamp(lp_min, 0.0)
    current = (old + scale * torch.randn(b, t, generator=g)).clamp(lp_min, 0.0)
    adv = torch.randn(b, 1, generator=g).expand(b, t) * draw(st.sampled_from([0.0, 1.0, 50.0]))
    return {"old": old, "rollout": rollout, "logprobs": current, "adv": adv.contiguous(), "mask": mask}


def preset_inputs(name: str, batch: dict, zero_mismatch: bool):
    cfg = op.presets.get(name).loss_config()
    rollout = batch["old"] if zero_mismatch else batch["rollout"]
    logprobs = batch["old"] if zero_mismatch else batch["logprobs"]
    return cfg, rollout, logprobs


@given(batches(), st.sampled_from(op.presets.names()))
def test_zero_mismatch_means_unit_weights_and_no_rejection(batch, name):
    # μ = π_old = π_θ: every preset must leave the batch untouched
    cfg, rollout, logprobs = preset_inputs(name, batch, zero_mismatch=True)
    out = op.correct(batch["old"], rollout, batch["mask"], cfg.correction, logprobs=logprobs,
                     advantages=batch["adv"])
    torch.testing.assert_close(out.weights, batch["mask"])
    torch.testing.assert_close(out.mask, batch["mask"])
    assert out.metrics["masked_fraction"] == 0.0
    assert abs(out.metrics["kl_k1"]) < 1e-7


@given(batches(), st.sampled_from(["token", "sequence", "geometric"]),
       st.floats(0.0, 1.0), st.floats(1.0, 10.0))
def test_truncated_weights_stay_in_the_band(batch, level, low, high):
    cfg = op.CorrectionConfig(weight={"level": level, "mode": "truncate", "low": low, "high": high})
    out = op.correct(batch["old"], batch["rollout"], batch["mask"], cfg)
    on = out.mask.bool()
    assert (out.weights[on] >= low * (1 - 1e-6)).all()
    assert (out.weights[on] <= high * (1 + 1e-6)).all()
    assert (out.weights[~on] == 0).all()


@given(batches(), st.sampled_from(["token", "sequence", "geometric", "any_token"]),
       st.floats(0.0, 1.0), st.floats(1.0, 20.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_tightening_a_band_never_unrejects(batch, level, low, high, tighten_low, tighten_high):
    tight_low = low + tighten_low * (1.0 - low)
    tight_high = high - tighten_high * (high - 1.0)
    loose = op.correct(batch["old"], batch["rollout"], batch["mask"],
                       {"reject": [{"stat": "ratio", "level": level, "low": low, "high": high}]})
    tight = op.correct(batch["old"], batch["rollout"], batch["mask"],
                       {"reject": [{"stat": "ratio", "level": level, "low": tight_low, "high": tight_high}]})
    assert not (tight.mask.bool() & ~loose.mask.bool()).any()


@given(batches(), st.sampled_from(["k1", "k2", "k3"]), st.sampled_from(["token", "seq_sum", "seq_mean", "seq_max"]),
       st.floats(0.0, 2.0), st.floats(0.0, 1.0))
def test_tightening_a_divergence_bound_never_unrejects(batch, stat, level, high, shrink):
    assume(not (stat == "k1" and level == "seq_max"))

    def rule(h):
        return {"stat": stat, "level": level, "high": h, **({"low": -h} if stat == "k1" else {})}

    loose = op.correct(batch["old"], batch["rollout"], batch["mask"], {"reject": [rule(high)]})
    tight = op.correct(batch["old"], batch["rollout"], batch["mask"], {"reject": [rule(high * shrink)]})
    assert not (tight.mask.bool() & ~loose.mask.bool()).any()


@given(batches(lp_min=-200.0, max_shift=40.0), st.sampled_from(op.presets.names()), st.sampled_from(AGGS))
def test_presets_give_finite_loss_and_grads(batch, name, agg):
    cfg = op.presets.get(name).loss_config(agg=agg)
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss, metrics = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"],
                                   rollout_logprobs=batch["rollout"], config=cfg)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[batch["mask"] == 0] == 0).all()
    values = metrics.to_dict()
    assert all(math.isfinite(v) or math.isnan(v) for v in values.values())
    everything_rejected = values.get("offpolicy/masked_fraction", 0.0) == 1.0
    if not everything_rejected:  # (an empty renormalised denominator reports NaN, never a silent 0)
        assert math.isfinite(values["offpolicy/loss"])


@given(batches(lp_min=-200.0, max_shift=40.0), st.sampled_from(LOSS_KINDS), st.sampled_from(AGGS),
       st.sampled_from([None, 3.0]), st.sampled_from(["k1", "k3+", "k2"]))
def test_every_loss_kind_is_finite(batch, kind, agg, dual_clip, kl_kind):
    cfg = LossConfig(kind=kind, agg=agg, dual_clip=dual_clip if kind == "ppo" else None, kl_coef=0.1, kl_kind=kl_kind)
    lp = batch["logprobs"].clone().requires_grad_(True)
    ref = (batch["old"] - 1.0).clamp(max=0.0)
    loss, _ = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"], config=cfg, ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


@given(batches(), st.integers(1, 4))
def test_merge_of_halves_equals_whole(batch, split_at):
    b = batch["mask"].shape[0]
    assume(b >= 2)
    split_at = min(split_at, b - 1)
    cfg = LossConfig(correction=op.CorrectionConfig(
        weight={"level": "sequence", "mode": "truncate", "high": 2.0},
        reject=[{"stat": "ratio", "level": "any_token", "low": 1e-3}, {"stat": "k2", "level": "seq_max", "high": 8.0}]))
    parts = []
    for s in (slice(0, split_at), slice(split_at, b)):
        if batch["mask"][s].sum() == 0:
            return  # a micro-batch with no valid token is refused by design
        parts.append(op.policy_loss(batch["logprobs"][s], batch["old"][s], batch["adv"][s], batch["mask"][s],
                                    rollout_logprobs=batch["rollout"][s], config=cfg)[1])
    whole = op.policy_loss(batch["logprobs"], batch["old"], batch["adv"], batch["mask"],
                           rollout_logprobs=batch["rollout"], config=cfg)[1].to_dict()
    merged = parts[0].merge(parts[1]).to_dict()
    assert merged.keys() == whole.keys()
    for key, value in whole.items():
        if math.isnan(value):
            assert math.isnan(merged[key]), key
        else:
            assert math.isclose(merged[key], value, rel_tol=1e-4, abs_tol=1e-6), (key, merged[key], value)
