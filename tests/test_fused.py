"""The fused fast path equals the readable path (the oracle): loss, gradient and every metric
within 1e-5 relative, on golden batches and on hypothesis-generated ones — padding, fully padded
rows, extreme ratios, every weighting, rule, anchor, aggregation and non-finite policy."""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import offpolicy as op
from offpolicy.core.kernels import compiled, eager
from test_properties import batches

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
CORRECTIONS = [
    None,
    {},
    {"weight": {"level": "token", "mode": "truncate", "high": 2.0}},
    {"weight": {"level": "token", "mode": "truncate", "low": 0.5, "high": 2.0, "normalize": True}},
    {"weight": {"level": "token", "mode": "mask", "low": 0.5, "high": 5.0}, "denominator": "fixed"},
    {"weight": {"level": "sequence", "mode": "truncate", "high": 2.0, "normalize": True}},
    {"weight": {"level": "geometric", "mode": "mask", "low": 0.8, "high": 1.25}},
    {"weight": {"level": "token", "mode": "truncate", "high": 2.0},
     "reject": [{"stat": "ratio", "level": "any_token", "low": 1e-3}, {"stat": "k3", "level": "seq_mean", "high": 0.3},
                {"stat": "ratio", "level": "token", "low": 0.2, "high": 5.0}], "reject_mode": "sequential"},
    {"reject": [{"stat": "k1", "level": "seq_sum", "low": -0.7, "high": 0.7}, {"stat": "opsm", "delta": 0.05},
                {"stat": "binary_kl", "high": 0.01}], "denominator": "fixed"},
    {"anchor": "rollout", "reject": [{"stat": "ratio", "level": "geometric", "low": 0.9, "high": 1.1}]},
    {"weight": {"level": "token", "mode": "truncate"}, "log_clamp": None},
    # AReaL's direction of the KL statistics (issue #26): k1 = log ρ, k3 = 1/ρ − 1 + log ρ
    {"reject": [{"stat": "k1", "level": "seq_mean", "low": -0.05, "high": 0.3, "direction": "pi_mu"},
                {"stat": "k3", "level": "seq_max", "high": 0.6, "direction": "pi_mu"},
                {"stat": "k3", "level": "token", "high": 0.4, "direction": "pi_mu"}],
     "weight": {"level": "token", "mode": "truncate", "high": 2.0}, "denominator": "fixed"},
]


def both(batch, cfg: op.LossConfig, reduce: bool = True):
    results = []
    for impl in ("reference", "auto"):  # auto = the fused path wherever it applies
        lp = batch["logprobs"].clone().requires_grad_(True)
        out = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"], rollout_logprobs=batch["rollout"],
                             config=cfg, reduce=reduce, implementation=impl)
        value = out[0] if reduce else (out[0] * torch.linspace(0.5, 1.5, out[0].shape[-1])).sum()
        value.backward()
        results.append((out, lp.grad))
    return results


def assert_equivalent(batch, cfg, reduce=True):
    (ref_out, ref_grad), (fast_out, fast_grad) = both(batch, cfg, reduce)
    torch.testing.assert_close(fast_grad, ref_grad, rtol=1e-5, atol=1e-7)
    # the loss is a sum of signed terms: its rounding error scales with Σ|terms|, not with the sum
    valid = batch["mask"].bool()
    terms = (batch["adv"][valid].abs() * (batch["logprobs"][valid].abs() + 1)).mean()
    torch.testing.assert_close(fast_out[0], ref_out[0], rtol=1e-5, atol=1e-6 * float(terms) + 1e-7)
    if not reduce:
        torch.testing.assert_close(fast_out[1], ref_out[1])
    ref_m, fast_m = ref_out[-1].to_dict(), fast_out[-1].to_dict()
    assert ref_m.keys() == fast_m.keys(), ref_m.keys() ^ fast_m.keys()
    for key, value in ref_m.items():
        if math.isnan(value):
            assert math.isnan(fast_m[key]), key
        else:
            assert math.isclose(fast_m[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, fast_m[key], value)
    for key in ref_m:
        assert ref_out[-1].reducer(key) == fast_out[-1].reducer(key), key


@given(batches(), st.sampled_from(["ppo", "cispo", "reinforce"]), st.sampled_from(AGGS),
       st.sampled_from(range(len(CORRECTIONS))), st.sampled_from([None, 3.0]))
def test_fused_equals_reference(batch, kind, agg, correction_index, dual_clip):
    correction = CORRECTIONS[correction_index]
    extra = {"dual_clip": dual_clip} if kind == "ppo" else {}
    cfg = op.LossConfig(kind=kind, agg=agg, correction=correction, **extra)
    assert_equivalent(batch, cfg)


@given(batches(lp_min=-200.0, max_shift=40.0), st.sampled_from(op.presets.names()))
def test_fused_equals_reference_on_every_preset_with_extreme_ratios(batch, name):
    cfg = op.LossConfig.from_preset(name)
    assume(eager.supports(cfg, None))  # every preset's loss kind is fused today
    assert_equivalent(batch, cfg)


@given(batches(), st.sampled_from(range(len(CORRECTIONS))), st.sampled_from(["fixed", "renormalize"]))
def test_fused_unreduced_equals_reference(batch, correction_index, denominator):
    correction = CORRECTIONS[correction_index]
    if correction is not None:
        correction = {**correction, "denominator": denominator}
    assert_equivalent(batch, op.LossConfig(correction=correction), reduce=False)


def test_global_normalisers():
    batch = next_batch()
    for cfg in (op.LossConfig(global_tokens=100.0, correction={}),
                op.LossConfig(agg="seq-mean-token-mean", global_seqs=7.0, correction={})):
        assert_equivalent(batch, cfg)


def next_batch(seed: int = 5):
    from conftest import random_batch

    return random_batch(seed=seed, b=6, t=9, noise=0.4)


@pytest.mark.parametrize("policy", ["error", "mask_token", "mask_sequence", "neutral"])
def test_nonfinite_inputs_take_the_readable_path(policy):
    batch = next_batch()
    batch["rollout"][2, 0] = float("nan")
    batch["old"][0, 1] = float("-inf")
    cfg = op.LossConfig(correction={"nonfinite": policy, "weight": {"level": "token", "mode": "truncate", "high": 2}})
    if policy == "error":
        with pytest.raises(ValueError, match="non-finite"):
            op.policy_loss(batch["logprobs"], batch["old"], batch["adv"], batch["mask"],
                           rollout_logprobs=batch["rollout"], config=cfg)
        return
    assert_equivalent(batch, cfg)


def test_nan_in_padding_is_handled():
    batch = next_batch()
    pad = batch["mask"] == 0
    assert pad.any()
    for key in ("old", "rollout", "logprobs", "adv"):
        batch[key] = torch.where(pad, torch.tensor(float("nan")), batch[key])
    assert_equivalent(batch, op.LossConfig(correction={"weight": {"level": "token", "mode": "truncate", "high": 2}}))


def test_fused_validation_messages_match():
    batch = next_batch()
    batch["old"][1, 0] = 0.5
    with pytest.raises(ValueError, match="old_logprobs has 1 positive log-prob"):
        op.policy_loss(batch["logprobs"], batch["old"], batch["adv"], batch["mask"], rollout_logprobs=batch["rollout"],
                       config=op.LossConfig(correction={}), implementation="fused")
    bad_mask = batch["mask"].clone()
    bad_mask[0, 0] = 0.5
    with pytest.raises(ValueError, match="mask must be 0/1"):
        op.policy_loss(batch["logprobs"], batch["old"].clamp(max=0), batch["adv"], bad_mask,
                       config=op.LossConfig(), implementation="fused")


def test_fused_is_the_default_where_supported_and_refuses_otherwise():
    batch = next_batch()
    assert eager.supports(op.LossConfig(), None) and not eager.supports(op.LossConfig(kind="gspo"), None)
    assert not eager.supports(op.LossConfig(kl_coef=0.1), batch["old"])
    with pytest.raises(ValueError, match="does not cover kind"):
        op.policy_loss(batch["logprobs"], batch["old"], batch["adv"], batch["mask"], config=op.LossConfig(kind="sapo"),
                       implementation="fused")
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss, _ = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"])
    assert loss.grad_fn is not None and "Coef" in type(loss.grad_fn).__name__


def test_bf16_inputs_give_bf16_grads():
    batch = next_batch()
    lp = batch["logprobs"].bfloat16().requires_grad_(True)
    loss, _ = op.policy_loss(lp, batch["old"].bfloat16(), batch["adv"], batch["mask"])
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16


class _NewFloatTensors(TorchDispatchMode):
    """The fp32 tensors of ``shape`` that ops create while on (outputs that are none of their inputs)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.made = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ptrs = {a.data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == self.shape \
                    and t.data_ptr() not in ptrs:
                self.made.append(str(func))
        return out


@pytest.mark.parametrize("reduce", [True, False])
def test_bf16_backward_makes_one_fp32_temporary(reduce):
    """Issue #44 item 3: π_θ's gradient is one fp32 [B, T] product, clamped in place and cast to bf16 —
    the out-of-place clamp made a second fp32 [B, T] while the product lived (a bf16 peak of 3.0 B·T
    fp32 on the GPU, goal 2.0). Counted on the analytic backward every fast rung shares."""
    batch = next_batch()
    lp = batch["logprobs"].bfloat16().requires_grad_(True)
    out = op.policy_loss(lp, batch["old"].bfloat16(), batch["adv"], batch["mask"], reduce=reduce,
                         implementation="eager")
    total = out[0] if reduce else out[0].sum()
    with _NewFloatTensors(lp.shape) as seen:
        total.backward()
    assert lp.grad.dtype == torch.bfloat16
    assert seen.made == ["aten.mul.Tensor"], seen.made


KINDS = ["ppo", "cispo", "reinforce"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_core_equals_reference(monkeypatch, kind):
    """The torch.compile'd core (the default for batches ≥ 65,536 tokens) against the oracle.

    Each correction is compiled once, under one of the three kinds (correction i under kind i mod 3), and
    each kind with four corrections: a graph costs ~8 s cold on one core (dynamo, AOT autograd and
    inductor's lowering, the C++ build a small share of it), and a fresh CI virtualenv starts cold, so the
    whole kind × correction product (36 graphs, ~5 minutes) checked nothing this diagonal does not — the
    kind and the correction are separate parts of one graph — at three times the cost. tests/test_fuzz.py
    draws random combinations through the compiled rung as well."""
    monkeypatch.setenv("OFFPOLICY_COMPILE", "1")
    before = compiled._compiled.cache_info().misses
    k = KINDS.index(kind)
    with dynamo_restarts() as restarts:
        # reduced (every aggregation in turn) or unreduced, alternately
        for seed in (1, 2):  # same shapes: the second seed reuses the compiled graphs (dynamic=True)
            batch = next_batch(seed)
            for i, correction in enumerate(CORRECTIONS):
                if i % len(KINDS) != k:
                    continue
                extra = {"dual_clip": 3.0} if kind == "ppo" and (i // 2) % 2 else {}
                if i % 2 == 0:
                    agg = AGGS[(i // 2) % len(AGGS)]
                    assert_equivalent(batch, op.LossConfig(kind=kind, agg=agg, correction=correction, **extra))
                else:
                    assert_equivalent(batch, op.LossConfig(kind=kind, correction=correction, **extra), reduce=False)
    assert compiled._compiled.cache_info().misses > before, "the compiled core was never used"
    assert not compiled._compile_failed, "torch.compile failed and the eager path answered instead"
    # the spec's floats are constants of the graph: dynamo traces each configuration once (torch 2.13 with
    # specialize_float=False logged "Restarting analysis due to ..._tensorify_python_scalars" at every one)
    assert restarts == [], restarts


@contextlib.contextmanager
def dynamo_restarts():
    """The "Restarting analysis" lines dynamo logs (at INFO) while the block runs."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if "Restarting analysis" in record.getMessage():
                seen.append(record.getMessage())

    logger = logging.getLogger("torch._dynamo.convert_frame")
    handler, level = Keep(logging.INFO), logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize("compile_setting, correction_index", [("0", 7), ("1", 2)])  # eager / compiled core
def test_fused_and_readable_metrics_merge_like_one_batch(monkeypatch, compile_setting, correction_index):
    """Partial sums, not just finished values, must match: a fused half merged with a readable
    half equals the whole batch (a metric recorded twice would double its weight)."""
    monkeypatch.setenv("OFFPOLICY_COMPILE", compile_setting)
    batch = next_batch(9)
    cfg = op.LossConfig(dual_clip=3.0, correction=CORRECTIONS[correction_index])
    parts = []
    fast = "compiled" if compile_setting == "1" else "eager"
    for rows, impl in ((slice(0, 3), fast), (slice(3, 6), "reference")):
        parts.append(op.policy_loss(batch["logprobs"][rows], batch["old"][rows], batch["adv"][rows],
                                    batch["mask"][rows], rollout_logprobs=batch["rollout"][rows], config=cfg,
                                    implementation=impl)[1])
    whole = op.policy_loss(batch["logprobs"], batch["old"], batch["adv"], batch["mask"],
                           rollout_logprobs=batch["rollout"], config=cfg, implementation="reference")[1].to_dict()
    merged = parts[0].merge(parts[1]).to_dict()
    for key, value in whole.items():
        assert math.isclose(merged[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, merged[key], value)


def test_compiled_core_derives_its_sums_from_the_rows():
    """The compiled core (run here uncompiled: the same tensor function) takes Σ m, Σ π_old·m, Σ μ·m,
    Σ log ρ·m and the surviving count from its per-row sums, counts in integers and finds NaN/inf and a
    non-0/1 mask by two counts (issue #44: fewer sums in its loop over the tokens): each equals the direct
    fp64 sum over the tokens within rounding, and a bad input is still seen."""
    batch = next_batch(3)
    cfg = op.LossConfig(kind="ppo", correction={"weight": {"level": "token", "mode": "truncate", "high": 2.0},
                                                "reject": [{"stat": "ratio", "level": "token", "low": 0.5, "high": 1.6}]})
    spec = compiled.core_spec(cfg, True, True)
    lp, old, roll, adv, m = (batch[k].float() for k in ("logprobs", "old", "rollout", "adv", "mask"))

    def sums(lp=lp, old=old, m=m):
        out, names, _ = compiled._core(lp, old, roll, adv, m, compiled._bounds(cfg, lp.device), spec)
        return dict(zip(names, out["scalars"].tolist()))

    s, d = sums(), torch.float64
    lr = (old - roll).clamp(-20, 20).double()
    ratio = lr.exp()
    keep = (m > 0) & (ratio >= 0.5) & (ratio <= 1.6)
    assert s["n"] == pytest.approx(m.double().sum().item(), rel=1e-12)
    assert s["trainer_sum"] == pytest.approx((old.double() * m).sum().item(), rel=1e-12)
    assert s["rollout_sum"] == pytest.approx((roll.double() * m).sum().item(), rel=1e-12)
    assert s["kl_k1"] == pytest.approx(-(lr * m).sum().item(), rel=1e-6)
    assert s["n_keep"] == keep.sum().item() and s["units"] == keep.sum().item()
    assert s["above"] == ((ratio > 2.0) & keep).sum().item()
    assert s["nonfinite"] == 0 and s["nonbinary"] == 0
    assert s["kl_k3"] == pytest.approx(((lr.exp() - 1 - lr) * m.to(d)).sum().item(), rel=1e-5)
    padding = (m == 0).nonzero()[0].tolist()
    with_nan = old.clone()
    with_nan[padding[0], padding[1]] = float("nan")  # in the padding: still the readable path's call
    assert sums(old=with_nan)["nonfinite"] == 1
    half = m.clone()
    half[0, 0] = 0.5
    assert sums(m=half)["nonbinary"] == 1
