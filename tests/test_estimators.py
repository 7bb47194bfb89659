"""New estimators (issue #14) and data-chosen bounds (issue #12 item 2): M2PO, NeMo-RL's sequence
log-prob error, prime-rl's probability trust region, ROLL's segment weights, AReaL's loglinear
proximal policy, ESS / quantile bounds and ``resolve_thresholds``.

Goldens are derived by hand from the formulas in the docstrings (arithmetic in the comments);
properties run on random batches with hypothesis (modest example counts).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.core import kernels, thresholds
from offpolicy.core.errors import ConfigError

LN2, LN4 = math.log(2), math.log(4)


def one_row(rho, base=-2.0):
    """π_old and μ of one row with ratios ``rho`` (log π_old = base, log μ = base − log ρ)."""
    rho = torch.tensor([rho], dtype=torch.float32)
    old = torch.full_like(rho, base)
    return old, old - torch.log(rho)


def weights(rho, **cfg):
    old, mu = one_row(rho)
    out = op.correct(old, mu, torch.ones_like(old), cfg)
    return out.weights[0].tolist(), out


def kept(rho, *rules, **cfg):
    old, mu = one_row(rho)
    out = op.correct(old, mu, torch.ones_like(old), {"reject": list(rules), **cfg})
    return out.mask[0].int().tolist(), out


# =========================================================================== ESS cap (issue #12)
def test_ess_cap_by_hand():
    # ρ = [0.5, 1, 1, 4], target 0.9. Raw ESS = (6.5)²/(4·18.25) = 0.5788 < 0.9, so cut. The cap lies
    # in [1, 4]: fixed 0.5, 1, 1 (A = 2.5, B = 2.25), m = 1 capped, n = 4:
    # (2.5 + c)² = 0.9·4·(2.25 + c²) ⇔ 2.6c² − 5c + 1.85 = 0 ⇔ c = (5 ± 2.4)/5.2 → largest c = 37/26 = 1.423077
    w, out = weights([0.5, 1, 1, 4], weight={"level": "token", "mode": "truncate", "high": {"rule": "ess", "target": 0.9}})
    assert w[:3] == pytest.approx([0.5, 1, 1]) and w[3] == pytest.approx(37 / 26, rel=1e-6)
    assert out.metrics["weight_high"] == pytest.approx(37 / 26, rel=1e-6)
    assert out.metrics["is_ess"] >= 0.9 - 1e-9 and out.metrics["is_ess"] == pytest.approx(0.9, abs=1e-6)


def test_ess_cap_is_max_weight_when_raw_weights_pass():
    # raw ESS 0.5788 ≥ 0.5: nothing to cut, the cap is max w = 4 and the weights are the raw ratios
    w, out = weights([0.5, 1, 1, 4], weight={"level": "token", "mode": "truncate", "high": {"rule": "ess", "target": 0.5}})
    assert w == pytest.approx([0.5, 1, 1, 4])
    assert out.metrics["weight_high"] == pytest.approx(4.0)


def test_ess_cap_at_sequence_level_uses_rows():
    # two rows, products ρ = 1·1 = 1 and 3·3 = 9 (units are rows): raw ESS = 100/(2·82) = 0.61 < 0.8;
    # cap c ∈ [1, 9]: (1 + c)² = 0.8·2·(1 + c²) ⇔ 0.6c² − 2c + 0.6 = 0 ⇔ c = (2 + √(4 − 1.44))/1.2 = 3
    old = torch.full((2, 2), -3.0)
    mu = old - torch.log(torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    out = op.correct(old, mu, torch.ones(2, 2), {"weight": {"level": "sequence", "mode": "truncate",
                                                             "high": {"rule": "ess", "target": 0.8}}})
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0], [3.0, 3.0]]), rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 60), spread=st.sampled_from([0.05, 0.5, 2.0]),
       target=st.floats(0.05, 1.0))
def test_ess_cap_meets_target_and_is_maximal(seed, n, spread, target):
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(n, generator=g) * spread)
    c = thresholds.ess_cap(w, target)
    capped = w.clamp(max=c)
    assert thresholds.ess(capped) >= target - 1e-9
    if c < float(w.max()):  # a slightly larger cap breaks the target: the least-biased cap
        assert thresholds.ess(w.clamp(max=c * (1 + 1e-4))) < target


# =========================================================================== quantile bounds
def test_quantile_bounds_by_hand():
    # ρ = [0.5, 1, 1, 4], n = 4. high q = 0.75: v_(⌈3⌉) = v_(3) = 1 → truncate 4 → 1
    w, out = weights([0.5, 1, 1, 4], weight={"level": "token", "mode": "truncate", "high": {"rule": "quantile", "q": 0.75}})
    assert w == pytest.approx([0.5, 1, 1, 1]) and out.metrics["weight_high"] == pytest.approx(1.0)
    # low q = 0.25: v_(⌊1⌋+1) = v_(2) = 1 → 0.5 → 1
    w, _ = weights([0.5, 1, 1, 4], weight={"level": "token", "mode": "truncate", "low": {"rule": "quantile", "q": 0.25}})
    assert w == pytest.approx([1, 1, 1, 4])
    # as a rejection band [v_(⌊0.25·4⌋+1), v_(⌈0.75·4⌉)] = [1, 1]: drops 0.5 and 4
    k, out = kept([0.5, 1, 1, 4], {"stat": "ratio", "level": "token", "low": {"rule": "quantile", "q": 0.25},
                                   "high": {"rule": "quantile", "q": 0.75}})
    assert k == [0, 1, 1, 0]
    assert out.metrics["reject/0_ratio_token/low"] == 1.0 and out.metrics["reject/0_ratio_token/high"] == 1.0


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 80), q=st.floats(0.0, 1.0))
def test_quantile_rule_masks_about_one_minus_q(seed, n, q):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(1, n, generator=g) * 3 - 0.1
    mu = (old + torch.randn(1, n, generator=g)).clamp(max=0.0)
    out = op.correct(old, mu, torch.ones(1, n), {"reject": [{"stat": "ratio", "level": "token",
                                                             "high": {"rule": "quantile", "q": q}}]})
    dropped = int((out.mask == 0).sum())
    ratios = torch.exp(old - mu)
    # exactly n − ⌈q·n⌉ (index at least 1) when the ratios are distinct, at most that with ties
    want = n - min(max(math.ceil(q * n - 1e-9), 1), n)
    assert dropped <= want
    if torch.unique(ratios).numel() == n:
        assert dropped == want


# =========================================================================== M2PO
def test_m2po_by_hand():
    # ρ = [0.5, 1, 1, 4]: m2 = (log ρ)² = [ln²2 = 0.4805, 0, 0, ln²4 = 1.9218], mean 0.6006
    # τ = 0.5: drop 1.9218 → mean(0.4805, 0, 0) = 0.1602 < 0.5 → keep 3
    k, out = kept([0.5, 1, 1, 4], {"stat": "m2", "high": 0.5})
    assert k == [1, 1, 1, 0]
    assert out.metrics["reject/0_m2_token/m2_before"] == pytest.approx((LN2**2 + LN4**2) / 4, rel=1e-6)
    assert out.metrics["reject/0_m2_token/m2_after"] == pytest.approx(LN2**2 / 3, rel=1e-6)
    assert out.metrics["reject/0_m2_token/masked_fraction"] == 0.25
    # τ = 0.1: 0.1602 ≥ 0.1 too → drop 0.4805 → mean(0, 0) = 0 < 0.1 → keep 2
    assert kept([0.5, 1, 1, 4], {"stat": "m2", "high": 0.1})[0] == [0, 1, 1, 0]
    # τ = 1: mean 0.6006 < 1 already → keep all (strict <, AReaL)
    assert kept([0.5, 1, 1, 4], {"stat": "m2", "high": 1.0})[0] == [1, 1, 1, 1]
    # never below: ρ = [2, 4], τ = 0.1: suffix means 1.2, 0.4805 ≥ 0.1 → keep only the smallest (ρ = 2)
    assert kept([2, 4], {"stat": "m2", "high": 0.1})[0] == [1, 0]


@settings(max_examples=50, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 60), tau=st.sampled_from([0.01, 0.04, 0.2, 1.0]))
def test_m2po_keeps_mean_below_tau_and_drops_no_more_than_needed(seed, n, tau):
    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(n, generator=g) * 0.5
    old = torch.full((1, n), -3.0)
    mu = old - lr[None]
    out = op.correct(old, mu, torch.ones(1, n), {"reject": [{"stat": "m2", "high": tau}]})
    keep = out.mask[0].bool()
    m2 = (out.log_ratio[0].double()) ** 2
    assert keep.any()
    if bool((~keep).any()):
        assert float(m2[keep].mean()) < tau or int(keep.sum()) == 1  # the rest is below τ (or the 1 kept)
        # minimal: the smallest dropped value back in would not be below τ (distinct values)
        back = keep.clone()
        back[torch.nonzero(~keep).reshape(-1)[m2[~keep].argmin()]] = True
        if torch.unique(m2).numel() == n:
            assert float(m2[back].mean()) >= tau
    else:
        assert float(m2.mean()) < tau or n == 1


def _areal_m2po_functions():
    """AReaL 1.0.4's _apply_m2po_masking and _get_m2po_loss_mask, taken from its source file (its
    module imports swanlab & co at import time; these two functions need only torch)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("areal")
    if spec is None:
        pytest.skip("AReaL not installed")
    path = spec.submodule_search_locations[0] + "/trainer/ppo/actor.py"
    tree = ast.parse(open(path).read())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("_apply_m2po_masking", "_get_m2po_loss_mask")]
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), namespace)
    return namespace["_apply_m2po_masking"]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), tau=st.sampled_from([0.01, 0.04, 0.3]))
def test_m2po_matches_areal_mask(seed, tau):
    apply = _areal_m2po_functions()
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 9
    prox = -torch.rand(B, T, generator=g) * 3 - 0.2
    mu = (prox + torch.randn(B, T, generator=g) * 0.4).clamp(max=-1e-3)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[0, 0] = True
    want = apply(mu, prox, mask, tau)  # AReaL: old_logp = μ, prox_logp = π_prox (our π_old)
    ours = op.correct(prox, mu, mask, "areal:m2po" if tau == 0.04 else {"reject": [{"stat": "m2", "high": tau}],
                                                                        "log_clamp": None})
    torch.testing.assert_close(ours.mask.bool(), want.bool())


# =========================================================================== NeMo-RL / prime-rl rules
def test_mult_error_by_hand():
    # row 0: ρ = [2, 0.5] → exp|log ρ| = [2, 2], mean 2 ≤ 2 kept; row 1: ρ = [4, 1] → [4, 1], mean 2.5 > 2 dropped
    old = torch.full((2, 2), -2.0)
    mu = old - torch.log(torch.tensor([[2.0, 0.5], [4.0, 1.0]]))
    out = op.correct(old, mu, torch.ones(2, 2), {"reject": [{"stat": "mult_error", "high": 2.0}]})
    assert out.mask.int().tolist() == [[1, 1], [0, 0]]


def test_prob_diff_by_hand():
    # π = [0.5, 0.5, 0.2], μ = [0.2, 0.8, 0.5] → d = π − μ = [0.3, −0.3, −0.3]; A = [1, 1, −1]
    pi = torch.log(torch.tensor([[0.5, 0.5, 0.2]]))
    mu = torch.log(torch.tensor([[0.2, 0.8, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    rule = {"stat": "prob_diff", "low": 0.2, "high": 0.2}
    # by advantage: token 0 (A > 0, d = 0.3 > 0.2) dropped; token 1 (A > 0, d = −0.3, only high tested) kept;
    # token 2 (A ≤ 0, d = −0.3 < −0.2) dropped
    out = op.correct(None, mu, torch.ones(1, 3), {"anchor": "rollout", "reject": [{**rule, "by_advantage": True}]},
                     logprobs=pi, advantages=adv)
    assert out.mask.int().tolist() == [[0, 1, 0]]
    # symmetric (IPO): |d| = 0.3 > 0.2 everywhere → all dropped
    out = op.correct(None, mu, torch.ones(1, 3), {"anchor": "rollout", "reject": [rule]}, logprobs=pi)
    assert out.mask.int().tolist() == [[0, 0, 0]]
    with pytest.raises(ValueError, match="by_advantage needs advantages"):
        op.correct(None, mu, torch.ones(1, 3), {"anchor": "rollout", "reject": [{**rule, "by_advantage": True}]},
                   logprobs=pi)


# =========================================================================== segment weights (ROLL)
def test_segment_weights_by_hand():
    # mask 1 1 0 1 1 1 0 1 → segments {0,1}, {3,4,5}, {7}; log ρ = 0.1 0.3 · 0.2 0.2 0.5 · −0.4
    # means 0.2, 0.3, −0.4 → w = e^0.2, e^0.3, e^−0.4 on each segment (capped at 1.3 in the 2nd call)
    m = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1.0]])
    lr = torch.tensor([[0.1, 0.3, 0.0, 0.2, 0.2, 0.5, 0.0, -0.4]])
    e2, e3, e4 = math.exp(0.2), math.exp(0.3), math.exp(-0.4)
    out = op.correct(lr - 1, torch.full_like(lr, -1.0), m, {"weight": {"level": "segment", "mode": "truncate"}})
    torch.testing.assert_close(out.weights, torch.tensor([[e2, e2, 0, e3, e3, e3, 0, e4]]), rtol=1e-6, atol=1e-7)
    out = op.correct(lr - 1, torch.full_like(lr, -1.0), m, {"weight": {"level": "segment", "mode": "truncate", "high": 1.3}})
    torch.testing.assert_close(out.weights, torch.tensor([[e2, e2, 0, 1.3, 1.3, 1.3, 0, e4]]), rtol=1e-6, atol=1e-7)
    # a rejected token inside a segment leaves the segment's mean but not its boundaries:
    # reject ρ > 1.5 (the 0.5 → e^0.5 = 1.65) → segment 2 mean over {0.2, 0.2} = 0.2
    out = op.correct(lr - 1, torch.full_like(lr, -1.0), m, {"weight": {"level": "segment", "mode": "truncate"},
                                                             "reject": [{"stat": "ratio", "level": "token", "high": 1.5}]})
    torch.testing.assert_close(out.weights, torch.tensor([[e2, e2, 0, e2, e2, 0, 0, e4]]), rtol=1e-6, atol=1e-7)


def test_single_segment_equals_geometric():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 7, generator=g) - 0.1
    mu = (old + 0.3 * torch.randn(5, 7, generator=g)).clamp(max=0)
    mask = torch.arange(7)[None] < torch.tensor([[7], [3], [5], [1], [6]])  # contiguous: one segment per row
    seg = op.correct(old, mu, mask, {"weight": {"level": "segment", "mode": "truncate", "high": 1.2}}).weights
    geo = op.correct(old, mu, mask, {"weight": {"level": "geometric", "mode": "truncate", "high": 1.2}}).weights
    torch.testing.assert_close(seg, geo)


# =========================================================================== loglinear proximal policy
def test_loglinear_alpha_and_values_by_hand():
    from offpolicy.core.proximal import loglinear_alpha

    # v_θ = 6 (prox 5): v_μ = 5 → (5−5)/(6−5) = 0; 4 → 1/2; 3 → 2/3; 6 → gap 0 → 0; 7 → gap < 0 → 0; −1 → not generated → 0
    alpha = loglinear_alpha(torch.tensor([5, 4, 3, 6, 7, -1]), 6)
    torch.testing.assert_close(alpha, torch.tensor([0, 0.5, 2 / 3, 0, 0, 0]))
    # log μ = −3, log π_θ = −1, α = 2/3: −3 + 2/3·2 = −5/3
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    got = op.loglinear_proximal(lp, torch.tensor([[-3.0, -3.0]]), torch.tensor([3]), current_version=6)
    torch.testing.assert_close(got, torch.tensor([[-5 / 3, -5 / 3]]))
    assert not got.requires_grad
    # α = 0 keeps μ exactly, even where π_θ is −inf (no 0·inf)
    got = op.loglinear_proximal(torch.tensor([[-math.inf]]), torch.tensor([[-2.0]]), 5, current_version=6)
    assert got.tolist() == [[-2.0]]


# =========================================================================== every rung = the reference
NEW_OPTIONS = {
    "ess": {"weight": {"level": "token", "mode": "truncate", "high": {"rule": "ess", "target": 0.9}}},
    "ess_seq": {"weight": {"level": "sequence", "mode": "truncate", "high": {"rule": "ess", "target": 0.7}}},
    "quantile_w": {"weight": {"level": "geometric", "mode": "mask", "low": {"rule": "quantile", "q": 0.1},
                              "high": {"rule": "quantile", "q": 0.9}}},
    "quantile_rule": {"reject": [{"stat": "ratio", "level": "token", "high": {"rule": "quantile", "q": 0.8}}],
                      "weight": {"level": "token", "mode": "truncate", "high": 2.0}},
    "m2": {"reject": [{"stat": "m2", "high": 0.04}]},
    "m2_seq": {"reject": [{"stat": "ratio", "level": "token", "high": 3.0}, {"stat": "m2", "high": 0.04}],
               "reject_mode": "sequential"},
    "mult_error": {"reject": [{"stat": "mult_error", "high": 1.4}], "weight": {"level": "token", "mode": "truncate", "high": 2.0}},
    "prob_diff": {"anchor": "rollout", "reject": [{"stat": "prob_diff", "low": 0.05, "high": 0.05, "by_advantage": True}]},
    "segment": {"weight": {"level": "segment", "mode": "truncate", "high": 1.2}},
}


def batch(seed=0, B=6, T=10, noise=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3 - 0.05
    mu = (old + noise * torch.randn(B, T, generator=g)).clamp(max=0)
    lp = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=g) > 0.25  # holes: several segments per row
    mask[:, 0] = True
    return lp, old, mu, adv, mask


@pytest.mark.parametrize("name", sorted(NEW_OPTIONS))
@pytest.mark.parametrize("kind", ["ppo", "reinforce"])
def test_auto_equals_reference(name, kind):
    cfg = op.LossConfig(kind=kind, correction=NEW_OPTIONS[name])
    lp, old, mu, adv, mask = batch(1)
    results = {}
    for impl in ("reference", "auto", *[r for r in ("eager", "compiled") if kernels.get(r).supports(cfg, None)]):
        theta = lp.clone().requires_grad_(True)
        with torch.compiler.set_stance("force_eager"):
            loss, metrics = op.policy_loss(theta, old, adv, mask, mu, cfg, implementation=impl)
        loss.backward()
        results[impl] = (loss.detach(), theta.grad, metrics.to_dict())
    ref_loss, ref_grad, ref_m = results.pop("reference")
    assert ref_m["offpolicy/masked_fraction"] < 1.0
    for impl, (loss, grad, metrics) in results.items():
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=impl)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7, msg=impl)
        for key in ref_m.keys() & metrics.keys():
            assert metrics[key] == pytest.approx(ref_m[key], rel=1e-4, abs=1e-5, nan_ok=True), (impl, key)


def test_data_chosen_bounds_route_away_from_fixed_kernels():
    for name in ("ess", "quantile_w", "segment"):
        cfg = op.LossConfig(correction=NEW_OPTIONS[name])
        assert not kernels.get("eager").supports(cfg, None)
        assert not kernels.get("compiled").supports(cfg, None)
        assert kernels.get("triton").spec_of(cfg, True) is None
    for name in ("m2", "quantile_rule", "mult_error", "prob_diff"):  # rejection runs through the shared rule code
        assert kernels.get("eager").supports(op.LossConfig(correction=NEW_OPTIONS[name]), None)


@pytest.mark.parametrize("name", ["ess", "m2", "segment", "quantile_rule", "prob_diff"])
def test_new_options_keep_the_inputs_device(name):
    """The default device is meta while the inputs are on the CPU: nothing may be created without device=."""
    lp, old, mu, adv, mask = batch(2)
    cfg = op.LossConfig(correction=NEW_OPTIONS[name])
    with torch.device("meta"):
        theta = lp.clone().requires_grad_(True)
        loss, metrics = op.policy_loss(theta, old, adv, mask, mu, cfg, implementation="reference")
        loss.backward()
        values = metrics.to_dict()
        resolved = op.resolve_thresholds(cfg, [{"old_logprobs": old, "rollout_logprobs": mu, "mask": mask,
                                                "logprobs": lp, "advantages": adv}])
        approx = op.loglinear_proximal(lp, mu, 1, 3)
    assert loss.device.type == "cpu" and theta.grad.device.type == "cpu" and approx.device.type == "cpu"
    assert math.isfinite(values["offpolicy/loss"]) and not resolved.correction.data_dependent


# =========================================================================== whole steps: resolve_thresholds
# weight.normalize divides by the batch's mean weight: per call, each micro-batch would use its own (issue #32)
NORMALIZE = {
    "normalize_token": {"weight": {"level": "token", "mode": "truncate", "high": 2.0, "normalize": True}},
    "normalize_seq": {"weight": {"level": "sequence", "mode": "truncate", "high": 3.0, "normalize": True}},
    "normalize_ess": {"weight": {"level": "geometric", "mode": "truncate", "high": {"rule": "ess", "target": 0.8},
                                 "normalize": True}},
}


@pytest.mark.parametrize("name", ["ess", "ess_seq", "quantile_w", "quantile_rule", "m2", "m2_seq", "segment",
                                  *NORMALIZE])
def test_resolve_thresholds_makes_micro_batches_one_batch(name):
    """Split a batch in three micro-batches: with the resolved config and a global token count, the
    summed losses and gradients equal the per-call loss of the whole batch."""
    lp, old, mu, adv, mask = batch(4, B=9)
    cfg = op.LossConfig(correction={**NEW_OPTIONS, **NORMALIZE}[name])
    whole = lp.clone().requires_grad_(True)
    want, _ = op.policy_loss(whole, old, adv, mask, mu, cfg, implementation="reference")
    want.backward()
    parts = [slice(0, 3), slice(3, 6), slice(6, 9)]
    mbs = [{"old_logprobs": old[s], "rollout_logprobs": mu[s], "mask": mask[s], "logprobs": lp[s], "advantages": adv[s]}
           for s in parts]
    fixed = op.resolve_thresholds(cfg, mbs)
    assert not fixed.correction.data_dependent and not fixed.correction.step_dependent
    fixed = op.with_global_normalizer(fixed, mbs)
    theta = lp.clone().requires_grad_(True)
    total = sum(op.policy_loss(theta[s], old[s], adv[s], mask[s], mu[s], fixed)[0] for s in parts)
    total.backward()
    torch.testing.assert_close(total.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(theta.grad, whole.grad, rtol=1e-5, atol=1e-7)


def test_per_call_bounds_differ_from_the_whole_batch():
    """Guard against a vacuous test above: per micro-batch, the ESS cap is not the whole batch's."""
    lp, old, mu, adv, mask = batch(4, B=9)
    cfg = op.CorrectionConfig(**NEW_OPTIONS["ess"])
    caps = [op.correct(old[s], mu[s], mask[s], cfg).metrics["weight_high"] for s in (slice(0, 3), slice(3, 6))]
    whole = op.correct(old, mu, mask, cfg).metrics["weight_high"]
    assert caps[0] != pytest.approx(whole) or caps[1] != pytest.approx(whole)


# =========================================================================== configuration errors
@pytest.mark.parametrize("cfg, message", [
    ({"weight": {"level": "token", "mode": "mask", "high": {"rule": "ess", "target": 0.9}}},
     r"weight.high: \{rule: ess\} chooses a truncation cap, so it needs mode 'truncate'"),
    ({"weight": {"level": "token", "mode": "truncate", "low": {"rule": "ess", "target": 0.9}}},
     r"weight.low: \{rule: ess, target: 0.9\} chooses an upper cap"),
    ({"weight": {"level": "token", "mode": "truncate", "high": {"rule": "ess", "target": 1.5}}},
     r"weight.high.target: Input should be less than or equal to 1 \(got"),
    ({"weight": {"level": "token", "mode": "truncate", "high": {"rule": "median"}}},
     r"weight.high: a data-chosen bound needs rule 'ess' .* or 'quantile' .*got rule='median'"),
    ({"weight": {"level": "token", "mode": "truncate", "high": -2}}, r"weight.high: a ratio bound must be > 0; got -2"),
    ({"weight": {"level": "token", "mode": "truncate", "low": {"rule": "quantile", "q": 0.9},
                 "high": {"rule": "quantile", "q": 0.2}}}, r"low quantile q=0.9 is above high quantile q=0.2; swap"),
    ({"reject": [{"stat": "ratio", "level": "token", "high": {"rule": "ess", "target": 0.5}}]},
     r"high=\{rule: ess\} is a truncation cap for weight.high, not a rejection band"),
    ({"reject": [{"stat": "m2", "high": 0}]}, r"reject.0.m2.high: Input should be greater than 0"),
    ({"reject": [{"stat": "mult_error", "high": 0.5}]}, r"reject.0.mult_error.high: Input should be greater than or equal to 1"),
    ({"reject": [{"stat": "prob_diff"}]}, r"reject rule 'prob_diff' needs low and/or high"),
])
def test_config_errors_name_field_value_and_fix(cfg, message):
    with pytest.raises(ConfigError, match=message):
        op.CorrectionConfig(**cfg)


# =========================================================================== across ranks (gloo)
_DIST_CFG = op.CorrectionConfig(
    reject=[{"stat": "m2", "high": 0.04}, {"stat": "ratio", "level": "geometric", "high": {"rule": "quantile", "q": 0.8}}],
    weight={"level": "token", "mode": "truncate", "high": {"rule": "ess", "target": 0.95}},
    reject_mode="sequential",
)
_RANK_ROWS = [[slice(0, 2), slice(2, 3)], [slice(3, 7), slice(7, 9)]]  # uneven ranks, two micro-batches each


def _dist_rank(rank: int) -> dict:
    lp, old, mu, adv, mask = batch(5, B=9)
    mbs = [{"old_logprobs": old[s], "rollout_logprobs": mu[s], "mask": mask[s]} for s in _RANK_ROWS[rank]]
    return op.resolve_thresholds(_DIST_CFG, mbs).model_dump()


@pytest.mark.slow
def test_resolve_thresholds_all_gathers_over_ranks(tmp_path):
    from conftest import on_gloo_ranks

    ranks = on_gloo_ranks(_dist_rank, tmp_path)
    lp, old, mu, adv, mask = batch(5, B=9)
    every = [{"old_logprobs": old[s], "rollout_logprobs": mu[s], "mask": mask[s]} for r in _RANK_ROWS for s in r]
    want = op.resolve_thresholds(_DIST_CFG, every).model_dump()
    for got in ranks:
        assert got == want
    # and what one rank alone would pick differs (the gather matters)
    alone = op.resolve_thresholds(_DIST_CFG, [{"old_logprobs": old[s], "rollout_logprobs": mu[s], "mask": mask[s]}
                                              for s in _RANK_ROWS[0]]).model_dump()
    assert alone != want


def test_resolve_thresholds_when_m2po_drops_nothing():
    """The step's M2PO cut is +inf when the whole step's second moment is already below τ; the resolved
    rule must still be a valid (finite) config that keeps every token — it raised in the trainer, whose
    every step now resolves its bounds (issue #32)."""
    lp, old, mu, adv, mask = batch(4, B=9)
    mu = old + 0.01 * (mu - old)  # (log ρ)² ≈ 1e-4 ≪ τ
    cfg = op.LossConfig(correction={"reject": [{"stat": "m2", "high": 0.04}]})
    parts = [{"old_logprobs": old[s], "rollout_logprobs": mu[s], "mask": mask[s]} for s in (slice(0, 4), slice(4, 9))]
    fixed = op.resolve_thresholds(cfg, parts)
    assert op.LossConfig(**fixed.model_dump()) == fixed  # a config that loads again (no inf inside)
    assert op.correct(old, mu, mask, fixed.correction).mask.sum() == mask.sum()
