"""Differential fuzz (issue #9): random valid configurations and hostile inputs through every
rung of ``offpolicy.core.kernels.IMPLEMENTATIONS``, against the float64 oracle in ``tests/oracle.py``
(written from docs/specification.md, not from our code).

What is generated: every kind, anchor (or no correction), weight level (segment included)/mode/
bounds (numbers, quantile and ESS bounds)/normalize, up to three rejection rules of every stat and
level (m2, mult_error and prob_diff included, quantile bands now and then), both reject modes, both denominators,
log_clamp 20 / 3 / null, every ``nonfinite`` policy, the dual clip, every aggregation with
max_len / global normalisers, a KL term of every estimator (with and without kl_is_weight);
inputs of 1–5 rows × 1–7 tokens in fp32, bf16 or fp16 with a bool or a float mask, fully
padded rows, length-1 rows, log-ratios up to ±120 (far past exp's fp32 range), and NaN/±inf
planted on valid and on padding tokens.

What is asserted, per rung that ``supports`` the configuration:
* ``nonfinite: error`` with a bad valid token → every rung raises ``ValueError``;
* otherwise loss and gradient are finite, and so is every metric unless nothing survives
  (then a mean over an empty selection reads NaN = "no data", by design of ``Metrics``), and
  the loss and gradient agree with the oracle evaluated on the *same* (upcast) input values:
  |Δloss| ≤ 2e-4·(1 + Σ|ℓ-terms|/N) and |Δgrad| ≤ 2e-4·(1 + max|grad|) elementwise
  (fp32 arithmetic against float64; a bf16/fp16 gradient is compared with the oracle's
  saturated at the dtype's largest finite value, as the library returns it; cases whose outcome hinges on a value within 1e-4
  of a band or clip edge — where fp32 rounding may legitimately decide the other way — are
  detected by perturbing the oracle and skipped);
* every metric of a fast rung equals the reference's within 1e-4 relative (+1e-5 absolute).

Default: ``OFFPOLICY_FUZZ_EXAMPLES`` (300 if unset) hypothesis examples, derandomized.
``OFFPOLICY_FUZZ_EXAMPLES=5000 python3 -m pytest -q tests/test_fuzz.py`` runs the big one.
The Triton rung runs under ``TRITON_INTERPRET=1`` (set in conftest) when ``import triton`` works.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

import offpolicy as op
import oracle
from offpolicy.core import kernels
from offpolicy.core.errors import ConfigError

EXAMPLES = int(os.environ.get("OFFPOLICY_FUZZ_EXAMPLES", "300"))
# Inductor compiles once per configuration (~1.5 s each): by default the compiled rung's core runs
# under torch.compiler's "force_eager" stance (its Python semantics, every example), while
# tests/test_fused.py compiles it for real on fixed configurations; OFFPOLICY_FUZZ_COMPILE=1 compiles here.
COMPILE = os.environ.get("OFFPOLICY_FUZZ_COMPILE", "0") == "1"
# Triton's CPU interpreter costs ~0.5 s a call: every TRITON_EVERY-th example by default, all in the big run
TRITON_EVERY = int(os.environ.get("OFFPOLICY_FUZZ_TRITON_EVERY", "1" if EXAMPLES > 300 else "8"))
_counter = [0]
NAN, INF = float("nan"), float("inf")


def _available(name: str) -> bool:
    try:
        rung = kernels.get(name)
    except (ImportError, ValueError):
        return False
    return getattr(rung, "available", lambda: True)()


RUNGS = [name for name in getattr(kernels, "IMPLEMENTATIONS", ("reference", "eager", "compiled")) if _available(name)]
if os.environ.get("OFFPOLICY_FUZZ_RUNGS"):  # e.g. "reference,eager": to bisect a failure by rung
    RUNGS = [name for name in RUNGS if name in os.environ["OFFPOLICY_FUZZ_RUNGS"].split(",")]

# ------------------------------------------------------------------------------ configurations
bound = st.sampled_from([None, 0.0, 0.1, 0.5, 0.8, 1.0, 1.2, 2.0, 5.0])


# data-chosen bounds (issue #12): drawn now and then in place of a number
quantile_low = st.sampled_from([{"rule": "quantile", "q": 0.0}, {"rule": "quantile", "q": 0.2}])
quantile_high = st.sampled_from([{"rule": "quantile", "q": 0.5}, {"rule": "quantile", "q": 0.9},
                                 {"rule": "quantile", "q": 1.0}])


@st.composite
def weights(draw):
    level = draw(st.sampled_from(["token", "sequence", "geometric", "token", "sequence", "geometric", "segment"]))
    mode = draw(st.sampled_from(["truncate", "mask"]))
    low, high = draw(bound), draw(bound)
    if high == 0.0:
        high = None
    if low is not None and high is not None and low > high:
        low, high = high, low
    if mode == "mask" and low is None and high is None:
        high = 2.0
    adaptive = draw(st.integers(0, 5))
    if adaptive == 0:
        low, high = draw(quantile_low), draw(quantile_high)
    elif adaptive == 1:
        high = {"rule": "ess", "target": draw(st.sampled_from([0.3, 0.8, 0.99]))} if mode == "truncate" else draw(quantile_high)
    return {"level": level, "mode": mode, "low": low, "high": high, "normalize": draw(st.booleans())}


directions = st.sampled_from(["mu_pi", "pi_mu"])  # verl's KL estimators, or AReaL's (issue #26)


@st.composite
def rules(draw):
    stat = draw(st.sampled_from(["ratio", "k1", "k2", "k3", "opsm", "binary_kl", "ratio", "m2", "mult_error",
                                 "prob_diff"]))
    if stat == "ratio":
        level = draw(st.sampled_from(["token", "sequence", "geometric", "any_token"]))
        low, high = draw(bound), draw(bound)
        if high == 0.0:
            high = None
        if low is not None and high is not None and low > high:
            low, high = high, low
        if low is None and high is None:
            low = 0.5
        if draw(st.integers(0, 4)) == 0:
            low, high = draw(st.sampled_from([None, {"rule": "quantile", "q": 0.1}])), draw(quantile_high)
        return {"stat": stat, "level": level, "low": low, "high": high}
    if stat == "m2":
        return {"stat": stat, "high": draw(st.sampled_from([0.001, 0.04, 0.5, 10.0]))}
    if stat == "mult_error":
        return {"stat": stat, "high": draw(st.sampled_from([1.0, 1.1, 2.0]))}
    if stat == "prob_diff":
        return {"stat": stat, "low": draw(st.sampled_from([None, 0.05, 0.2])), "high": draw(st.sampled_from([0.05, 0.2])),
                "by_advantage": draw(st.booleans())}
    if stat == "k1":
        level = draw(st.sampled_from(["token", "seq_sum", "seq_mean"]))
        low = draw(st.sampled_from([None, -1.0, -0.2]))
        high = draw(st.sampled_from([None, 0.2, 1.0] if low is not None else [0.2, 1.0]))
        return {"stat": stat, "level": level, "low": low, "high": high, "direction": draw(directions)}
    if stat in ("k2", "k3"):
        level = draw(st.sampled_from(["token", "seq_sum", "seq_mean", "seq_max"]))
        return {"stat": stat, "level": level, "high": draw(st.sampled_from([0.0, 0.05, 0.5, 3.0])),
                "direction": draw(directions)}
    if stat == "opsm":
        return {"stat": stat, "delta": draw(st.sampled_from([-0.1, 0.0, 0.05, 1.0]))}
    if draw(st.booleans()):  # binary_kl per token (issue #46), optionally split by the advantage's sign
        rule = {"stat": stat, "level": "token", "high": draw(st.sampled_from([0.0, 0.01, 0.3])),
                "direction": draw(st.sampled_from(["mu_pi", "pi_mu", "both"]))}
        if draw(st.booleans()):
            rule.update(by_advantage=True, high_negative=draw(st.sampled_from([None, 0.0, 0.05])))
        return rule
    return {"stat": stat, "high": draw(st.sampled_from([0.0, 0.01, 0.3]))}


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["ppo", "gspo", "cispo", "sapo", "reinforce"]))
    loss: dict = {"kind": kind}
    if kind in ("ppo", "gspo", "cispo"):
        loss["clip_low"] = draw(st.sampled_from([None, 0.1, 0.2, 0.9]))
        loss["clip_high"] = draw(st.sampled_from([None, 0.2, 0.28, 3.0]))
    if kind in ("ppo", "gspo"):
        loss["dual_clip"] = draw(st.sampled_from([None, None, 3.0, 1.5]))
    if kind == "gspo":
        loss["gspo_form"] = draw(st.sampled_from(["token", "sequence"]))
    if kind == "sapo":
        loss["sapo_level"] = draw(st.sampled_from(["token", "sequence"]))
        loss["sapo_tau_pos"] = draw(st.sampled_from([0.5, 1.0, 2.0]))
        loss["sapo_tau_neg"] = draw(st.sampled_from([1.05, 3.0]))
    agg = draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]))
    loss["agg"] = agg
    if agg == "token-mean":
        loss["global_tokens"] = draw(st.sampled_from([None, None, 0.5, 3.0, 40.0]))
    else:
        loss["global_seqs"] = draw(st.sampled_from([None, None, 0.5, 2.0, 7.0]))
    if agg == "seq-mean-token-sum-norm":
        loss["max_len"] = draw(st.sampled_from([None, 1, 10]))
    anchor = draw(st.sampled_from([None, "old", "old", "rollout", "current"]))
    if anchor == "current":  # reinforce only: the config refuses ppo/cispo (π_θ/π_old counted twice)
        loss["kind"] = "reinforce"
        loss.pop("clip_low", None), loss.pop("clip_high", None), loss.pop("dual_clip", None)
    has_weight = False
    if anchor is not None:
        corr: dict = {"anchor": anchor}
        if anchor != "rollout" and draw(st.booleans()):
            corr["weight"] = draw(weights())
            has_weight = True
        corr["reject"] = draw(st.lists(rules(), max_size=3))
        corr["reject_mode"] = draw(st.sampled_from(["independent", "sequential"]))
        corr["denominator"] = draw(st.sampled_from(["fixed", "renormalize"]))
        corr["log_clamp"] = draw(st.sampled_from([20.0, 3.0, None]))
        corr["nonfinite"] = draw(st.sampled_from(["error", "mask_token", "mask_sequence", "neutral"]))
        loss["correction"] = corr
    if draw(st.integers(0, 3)) == 0:
        loss["kl_coef"] = draw(st.sampled_from([0.0, 0.1, 1.0]))
        loss["kl_kind"] = draw(st.sampled_from(["k1", "k2", "k3", "k1+", "k2+", "k3+"]))
        if has_weight and loss["kl_coef"] > 0 and draw(st.booleans()):
            loss["correction"]["kl_is_weight"] = True
    try:
        return op.LossConfig(**loss)
    except ConfigError:
        assume(False)


# ------------------------------------------------------------------------------ inputs
@st.composite
def inputs(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    shape = draw(st.sampled_from(["random", "length1", "full"]))
    if shape == "length1":
        lengths = torch.ones(B, dtype=torch.long)
    elif shape == "full":
        lengths = torch.full((B,), T)
    lengths[draw(st.integers(0, B - 1))] = max(1, int(lengths.max()))  # at least one valid token
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if draw(st.booleans()):  # holes in the middle (tool-output tokens)
        mask &= torch.rand(B, T, generator=g) > 0.2
        mask[0, 0] = True
    spread = draw(st.sampled_from([0.05, 0.5, 3.0, 120.0]))  # 120: log-ratios past exp's fp32 range
    old = -torch.rand(B, T, generator=g) * 4 - 0.01
    rollout = (old + spread * torch.randn(B, T, generator=g)).clamp(max=0.0)
    logprobs = (old + min(spread, 3.0) * 0.3 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    ref = (old + 0.5 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    if draw(st.booleans()):
        adv = torch.randn(B, T, generator=g)
    t = {"logprobs": logprobs, "old": old, "rollout": rollout, "adv": adv, "ref": ref}
    bad_valid = draw(st.lists(st.tuples(st.sampled_from(["logprobs", "old", "rollout", "adv"]),
                                        st.integers(0, B * T - 1), st.sampled_from([NAN, INF, -INF])), max_size=3))
    for name, pos, value in bad_valid:
        t[name].view(-1)[pos] = value
    pad = ~mask
    for name in ("logprobs", "old", "rollout", "adv", "ref"):  # garbage on padding must never be read
        t[name] = torch.where(pad, torch.tensor(NAN), t[name])
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]))
    t = {k: v.to(dtype) for k, v in t.items()}
    t["mask"] = mask if draw(st.booleans()) else mask.to(dtype)
    return t


# ------------------------------------------------------------------------------ running
def run(rung: str, t, cfg):
    lp = t["logprobs"].clone().requires_grad_(True)
    with torch.compiler.set_stance("default" if COMPILE else "force_eager"):
        loss, metrics = op.policy_loss(lp, t["old"], t["adv"], t["mask"], rollout_logprobs=t["rollout"], config=cfg,
                                       ref_logprobs=t["ref"] if cfg.kl_coef > 0 else None, implementation=rung)
    loss.backward()
    return loss.detach(), lp.grad, metrics.to_dict()


def near_an_edge(t, cfg) -> bool:
    """Whether nudging the inputs by ~1e-4 changes the oracle's loss a lot (a band or clip edge
    decides the outcome; fp32 may round to either side)."""
    base = oracle.policy_loss(t["logprobs"], t["old"], t["adv"], t["mask"], t["rollout"], cfg, t["ref"])
    for sign in (1.0, -1.0):
        for name in ("logprobs", "old", "rollout"):
            nudged = dict(t)
            nudged[name] = t[name].double() + sign * 2e-4 * torch.linspace(0.3, 1.0, t[name].numel()).view_as(t[name])
            nudged[name] = nudged[name].clamp(max=0.0)
            other = oracle.policy_loss(nudged["logprobs"], nudged["old"], t["adv"], t["mask"], nudged["rollout"], cfg,
                                       t["ref"])
            if abs(other.loss - base.loss) > 1e-2 * (1 + abs(base.loss)) or bool(other.loss_mask.ne(base.loss_mask).any()):
                return True
    return False


def _kl_ref(cfg):
    return cfg.kl_coef > 0


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, report_multiple_bugs=False,
          phases=[Phase.explicit, Phase.generate],  # shrinking these inputs takes minutes; the failure prints as is
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(cfg=configs(), t=inputs())
def test_every_rung_agrees_with_the_float64_oracle(cfg, t):
    ref_in = t["ref"] if _kl_ref(cfg) else None
    try:
        want = oracle.policy_loss(t["logprobs"], t["old"], t["adv"], t["mask"], t["rollout"], cfg, ref_in)
    except ValueError:
        want = None
    ran = {}
    _counter[0] += 1
    for rung in RUNGS:
        if rung != "reference" and not kernels.get(rung).supports(cfg, ref_in):
            continue
        if rung == "triton" and _counter[0] % TRITON_EVERY:
            continue
        if want is None:
            with pytest.raises(ValueError):
                run(rung, t, cfg)
            continue
        loss, grad, metrics = run(rung, t, cfg)
        assert torch.isfinite(loss), (rung, loss)
        assert bool(torch.isfinite(grad).all()), (rung, grad)
        if want.loss_mask.any():  # an empty selection reports NaN (0/0: "no data"), see the docstring
            bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
            assert not bad, (rung, bad)
        ran[rung] = (loss, grad, metrics)
    if want is None or not ran:
        return
    edge = near_an_edge(t, cfg)
    for rung, (loss, grad, metrics) in ran.items():
        if not edge:
            scale = 1.0 + float(want.grad.abs().max())
            assert abs(float(loss) - want.loss) <= 2e-4 * (1 + abs(want.loss) + scale), (rung, float(loss), want.loss)
            # the gradient comes back in the input's dtype: its own rounding (bf16 2^-8, fp16 2^-11) on top
            tol = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[grad.dtype]
            big = torch.finfo(grad.dtype).max  # fp16 gradients saturate at 65504 instead of overflowing
            torch.testing.assert_close(grad.double(), want.grad.clamp(-big, big), rtol=tol, atol=tol * min(scale, big), msg=rung)
        if rung != "reference" and "reference" in ran:
            ref_m = ran["reference"][2]
            for key in ref_m.keys() & metrics.keys():
                a, b = metrics[key], ref_m[key]
                assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (rung, key, a, b)
