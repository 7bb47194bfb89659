"""Compiled fast path: the whole forward as one ``torch.compile``d tensor function.

The eager fast path still makes ~80 passes over [B, T] memory. For the common configurations
the whole forward — ratios, rules, weights, loss, derivative and every metric's partial sum —
is one pure tensor function, which torch.compile (inductor: C++/OpenMP on CPU, Triton on GPU)
fuses into a handful of loops. Sums accumulate in fp64 inside those loops, counts of a bool in int32
(exact). Same formulas and derivatives as ``kernels/eager.py`` (see its docstring).

What a loop over the tokens costs on the CPU (issue #44; docs/performance-journal.md, 2026-11-26, the CPU
loss guard): each fp64 accumulator is two vector registers and two conversions a step, and each exp a call into
Sleef across which the live accumulators are spilled. So the core derives what it can from sums it
already has (Σ π_old·m from the rows' sums, expm1 and max(ρ, 1/ρ) from ρ), counts in integers, and for
token-mean keeps the loss's sum in the loop over the tokens, which then stores only the derivative:
one loop over the tokens and one over the rows, ~60 % of the time of the three loops before. The
metrics' partial sums leave the graph as one fp64 vector (``_metric_vector``, ``Metrics.from_flat``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from typing import NamedTuple

import torch

from offpolicy.core import ops
from offpolicy.core.config import LossConfig, rule_name
from offpolicy.core.correction import validate_inputs
from offpolicy.core.kernels.common import (
    RATIO_LOG_CLAMP,
    CoefLoss,
    CoefTokens,
    bounds_of,
    bounds_tensor,
    per_config,
    row_aggregation,
)
from offpolicy.core.kernels.eager import KINDS
from offpolicy.core.metrics import FlatLayout, Metrics

log = logging.getLogger(__name__)

NAME = "compiled"


def supports(config: LossConfig, ref_logprobs: torch.Tensor | None) -> bool:
    """Kinds ppo / cispo / reinforce without KL, score centering or a ratio value cap; corrections with fixed-bound ratio rules only,
    no batch normalisation, no segment level, no data-chosen (ess / quantile) bounds and no
    count after the first n rules (an integer denominator)."""
    return (config.kind in KINDS and ref_logprobs is None and config.score_centering is None
            and config.ratio_value_cap is None and core_spec(config, True, True) is not None)


class CoreSpec(NamedTuple):
    """The structure the compiled core specialises on (one compile per distinct spec). Which bounds
    are set is structure; their numbers are not: they enter the graph as a tensor (``common.bounds_of``,
    the Triton rung's vector), so a data-chosen bound that ``resolve_thresholds`` fixes anew every step
    does not recompile."""

    corrected: bool
    anchor: str
    log_clamp: float  # a setting of the configuration, never chosen from data
    rules: tuple[tuple[str, bool, bool], ...]  # ratio rules: (level, has low, has high)
    sequential: bool
    weight: tuple[str, str, bool, bool] | None  # (level, mode, has low, has high)
    fixed_denominator: bool
    kind: str
    clip_low: bool  # ε_low is set
    clip_high: bool
    dual_clip: bool
    has_old: bool
    unreduced: bool
    row_loss: bool  # the loss's per-row sums are needed (a sequence aggregation); token-mean needs their total


def core_spec(config: LossConfig, has_old: bool, reduce: bool) -> CoreSpec | None:
    """The spec of ``config``, or None when the compiled core does not cover it."""
    corr = config.correction
    clips = (config.clip_low is not None, config.clip_high is not None, config.dual_clip is not None)
    if corr is None:
        return CoreSpec(False, "old", 20.0, (), False, None, False, config.kind, *clips, has_old, not reduce,
                        config.agg != "token-mean")
    if any(getattr(r, "stat", None) != "ratio" for r in corr.reject):
        return None
    if corr.weight is not None and (corr.weight.normalize or corr.weight.level == "segment"):
        return None
    if corr.data_dependent:  # ess / quantile bounds need a sort of the whole call: the reference's job
        return None
    if not isinstance(corr.denominator, str):  # a count after the first n rules: the reference's job
        return None
    weight = None
    if corr.weight is not None and corr.anchor != "rollout":
        weight = (corr.weight.level, corr.weight.mode, corr.weight.low is not None, corr.weight.high is not None)
    rules = tuple((r.level, r.low is not None, r.high is not None) for r in corr.reject)
    return CoreSpec(True, corr.anchor, ops.effective_log_clamp(corr.log_clamp), rules,
                    corr.reject_mode == "sequential", weight, corr.denominator == "fixed", config.kind,
                    *clips, has_old or corr.anchor == "rollout", not reduce, config.agg != "token-mean")


def _band(x, low, high):
    keep = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        keep = keep & (x >= low)
    if high is not None:
        keep = keep & (x <= high)
    return keep


def _f(mode, low, high, x):
    if mode == "truncate":
        return x if low is None and high is None else x.clamp(min=low, max=high)
    return x * _band(x, low, high)


def _expm1(x, ex):
    """expm1(x) given ex = exp(x): the Taylor series to x⁷/7! for |x| < 1/16, else ex − 1 (the Triton
    rung's ``_expm1``, whose docstring gives the error)."""
    series = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (1.0 / 720 + x * (1.0 / 5040)))))))
    return torch.where(x.abs() < 0.0625, series, ex - 1.0)


def _core(lp, old, roll, adv, m, bounds, spec: CoreSpec):
    """Everything of the fast path that touches [B, T] memory; returns tensors only. ``bounds``: the
    fp32 vector of ``bounds_of`` (0-d slices of it stand where the spec sets a bound; an open bound's
    ±inf is never read).

    Sums over the tokens in fp64 (products of fp32 values that can cancel — w², (ρ − 1)(ρ + 1), ρ² — in
    fp64, as before); counts in int32; Σ m, Σ π_train·m, Σ μ·m and Σ log ρ·m as sums of the per-row sums
    that the ppl and chi2_seq metrics need anyway; the surviving count from its rows likewise."""
    f64 = torch.float64
    n_rules = len(spec.rules)

    def bound(i: int, is_set: bool):
        return bounds[i] if is_set else None

    valid = m > 0
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    out = {}
    # counts of a bool are integer sums (exact; in the vector loop a quarter of an fp64 sum's work),
    # read as fp64; int64 only where the tokens could overflow int32 (a shape guard, never met in practice)
    ints = torch.int32 if m.numel() < 2**31 else torch.int64

    def count(x, dim=None):
        return (x.sum(dtype=ints) if dim is None else x.sum(dim, dtype=ints)).to(f64)

    m_rows = m.sum(-1, dtype=f64)
    # Σ m is the sum of the rows' Σ m. NaN/inf in any input, padding included, sends the call to the readable
    # path (its nonfinite policy), an m ∉ {0, 1} to its error: two counts. (A sum of finite inputs that
    # overflows fp32 counts as non-finite too: the readable path then answers, as correctly. Two sums, not
    # one of five: inductor stores an expression of over 4 inputs that is read twice, as isfinite does.)
    scalars = {"n": m_rows.sum(), "nonfinite": count(~(torch.isfinite(lp + old) & torch.isfinite(roll + adv + m))),
               "nonbinary": count((m != 0) & (m != 1))}
    maxima = {"lp_max": (lp * m).amax()}
    keep, km = valid, m
    if spec.corrected:
        trainer = old if spec.anchor == "old" else lp
        L = spec.log_clamp
        lr = (trainer - roll).clamp(-L, L)
        ratio = torch.exp(lr)
        em1 = _expm1(lr, ratio)
        lr_m, em1_m = lr * m, em1 * m
        tm, rm = trainer * m, roll * m
        rows = torch.stack([tm.sum(-1, dtype=f64), rm.sum(-1, dtype=f64), lr_m.sum(-1, dtype=f64), m_rows])
        scalars.update(
            trainer_sum=rows[0].sum(), rollout_sum=rows[1].sum(),
            kl_k1=-rows[2].sum(), kl_k3=(em1_m - lr_m).sum(dtype=f64),
            chi2=(em1_m.double() * (em1.double() + 2.0)).sum(), rho=(ratio * m).sum(dtype=f64),
            rho2=(ratio.double() * ratio.double() * m.double()).sum(), abs_lr=lr_m.abs().sum(dtype=f64),
            mult_err=(torch.maximum(ratio, 1.0 / ratio) * m).sum(dtype=f64),
            prob_diff=(torch.exp(tm) - torch.exp(rm)).abs().sum(dtype=f64),
        )
        maxima.update(trainer_max=tm.amax(), rollout_max=rm.amax(), abs_lr_max=lr_m.abs().amax(),
                      prob_diff_max=(torch.exp(tm) - torch.exp(rm)).abs().amax())
        out["rows"] = rows
        removed = []
        for i, (level, has_low, has_high) in enumerate(spec.rules):
            low, high = bound(2 * i, has_low), bound(2 * i + 1, has_high)
            seen = keep if spec.sequential else valid
            seen_f = seen.to(lr.dtype)
            if level == "token":
                ok = _band(ratio, low, high)
            elif level == "any_token":
                ok = (~((~_band(ratio, low, high)) & seen).any(-1)).unsqueeze(-1)
            else:
                row = (lr * seen_f).sum(-1)
                if level == "geometric":
                    row = row / seen_f.sum(-1).clamp(min=1)
                ok = _band(torch.exp(row.clamp(-L, L)), low, high).unsqueeze(-1)
            new = seen & ok
            removed.append(count(seen & ~new, -1))
            keep = keep & new
        out["removed"] = torch.stack(removed) if removed else None
        km = keep.to(lp.dtype)
        if spec.weight is not None:
            level, mode, has_low, has_high = spec.weight
            low, high = bound(2 * n_rules, has_low), bound(2 * n_rules + 1, has_high)
            if level == "token":
                w = _f(mode, low, high, ratio) * km
                unit, unit_mask = ratio, keep
            else:
                row = (lr * km).sum(-1)
                if level == "geometric":
                    row = row / km.sum(-1).clamp(min=1)
                unit = torch.exp(row.clamp(-L, L))
                unit_mask = km.sum(-1) > 0
                w = _f(mode, low, high, unit).unsqueeze(-1) * km
            scalars["above"] = count((unit > high) & unit_mask) if high is not None else zero.double()
            scalars["below"] = count((unit < low) & unit_mask) if low is not None else zero.double()
            scalars["units"] = count(unit_mask)
        else:
            w = km
        w64 = w.double()
        keep_rows = count(keep, -1)
        scalars.update(w_sum=w64.sum(), w2_sum=(w64 * w64).sum(), n_keep=keep_rows.sum())
        maxima.update(w_max=torch.where(keep, w, -torch.inf).amax(), w_min_neg=-torch.where(keep, w, torch.inf).amin())
    else:
        w = m
    if spec.has_old:
        maxima["old_max"] = (old * m).amax()
        log_r = (lp - old).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
        r = torch.exp(log_r)
        scalars["approx_kl"] = ((_expm1(log_r, r) - log_r) * km).sum(dtype=f64)
    adv_w = adv * w
    lo, hi = bound(2 * n_rules + 2, spec.clip_low), bound(2 * n_rules + 3, spec.clip_high)
    dual_c = bound(2 * n_rules + 4, spec.dual_clip)
    if spec.kind == "reinforce":
        per_token, coef = -adv_w * lp, -adv_w
    elif spec.kind == "cispo":
        kept = r if lo is None and hi is None else r.clamp(min=lo, max=hi)
        per_token, coef = -kept * adv_w * lp, -kept * adv_w
        scalars["clip"] = count((kept != r) & keep)
    else:
        clipped = torch.where(adv > 0, r if hi is None else r.clamp(max=hi), r if lo is None else r.clamp(min=lo))
        per_token = -adv_w * clipped
        active = clipped == r
        scalars["clip"] = count((~active) & (adv != 0) & keep)
        # clamp's derivative is 0 past ±RATIO_LOG_CLAMP: no gradient through r there
        active = active & ((lp - old).abs() <= RATIO_LOG_CLAMP)
        if dual_c is not None:
            dual = (adv < 0) & (clipped > dual_c)
            scalars["dual"] = count(dual & keep)
            per_token = torch.where(dual, -adv_w * dual_c, per_token)
            active = active & ~dual
        coef = torch.where(active, -adv_w * r, zero)
    den = m if (spec.fixed_denominator or not spec.corrected) else km
    km_rows = keep_rows if spec.corrected else m_rows
    den_rows = m_rows if (spec.fixed_denominator or not spec.corrected) else km_rows
    # token-mean needs Σ ℓ alone: a sum over all tokens, in the loop over the tokens that makes the other
    # scalars, rather than a row sum that would need ρ and r again in the loop over the rows
    if spec.row_loss:
        out["loss_rows"] = per_token.sum(-1, dtype=f64)
    else:
        scalars["loss_sum"] = per_token.sum(dtype=f64)
    out["count_rows"] = torch.stack([den_rows, km_rows])
    out["coef"] = coef
    out["per_token"] = per_token if spec.unreduced else None
    out["den"] = den if spec.unreduced else None
    names_s, names_m = sorted(scalars), sorted(maxima)
    out["scalars"] = torch.stack([scalars[k] for k in names_s])
    out["maxima"] = torch.stack([maxima[k] for k in names_m])
    out["metrics"] = _metric_vector(spec, scalars, maxima, out)
    return out, names_s, names_m


def _metric_plan(spec: CoreSpec) -> tuple[tuple[str | tuple[int, str], str, tuple[str, ...]], ...]:
    """The rung's metrics in the order of its flat vector: (key, or (rule index, suffix) for a rule's
    key; reducer; the names of its partial sums among ``_metric_vector``'s quantities). The keys,
    reducers and values that ``correct`` and the readable loss record; the loss's own pair follows."""
    plan: list[tuple[str | tuple[int, str], str, tuple[str, ...]]] = []
    if spec.corrected:
        plan += [("nonfinite_tokens", "sum", ("zero", "one")), ("valid_tokens", "sum", ("n", "one")),
                 ("kl_k1", "mean", ("kl_k1", "n")), ("kl_k3", "mean", ("kl_k3", "n")),
                 ("chi2_token", "mean", ("chi2", "n")), ("ess", "ess", ("rho", "rho2", "n"))]
        plan += [(key, "mean", (key, "n_rows")) for key in ("chi2_seq", "ppl_train", "ppl_rollout", "log_ppl_diff",
                                                           "ppl_ratio")]
        plan += [("abs_logp_diff_mean", "mean", ("abs_lr", "n")), ("abs_logp_diff_max", "max", ("abs_lr_max", "n")),
                 ("mult_prob_error", "mean", ("mult_err", "n")), ("prob_diff_mean", "mean", ("prob_diff", "n")),
                 ("prob_diff_max", "max", ("prob_diff_max", "n"))]
        for i in range(len(spec.rules)):
            plan += [((i, "masked_fraction"), "mean", (f"removed_{i}", "n")),
                     ((i, "masked_fraction_seq"), "mean", (f"removed_rows_{i}", "n_rows"))]
        plan += [("masked_fraction", "mean", ("masked", "n")), ("masked_fraction_seq", "mean", ("masked_rows", "n_rows"))]
        if spec.weight is not None:
            plan += [("fraction_above_high", "mean", ("above", "units")),
                     ("fraction_below_low", "mean", ("below", "units"))]
        plan += [("is_mean", "mean", ("w_sum", "n_keep")), ("is_std", "std", ("w_sum", "w2_sum", "n_keep")),
                 ("is_ess", "ess", ("w_sum", "w2_sum", "n_keep")), ("is_min", "min", ("w_min", "n_keep")),
                 ("is_max", "max", ("w_max", "n_keep"))]
    if spec.kind != "reinforce":
        plan.append(("clip_fraction", "mean", ("clip", "n_keep")))
    if spec.kind == "ppo" and spec.dual_clip:
        plan.append(("dual_clip_fraction", "mean", ("dual", "n_keep")))
    if spec.has_old:
        plan.append(("approx_kl", "mean", ("approx_kl", "n_keep")))
    return tuple(plan)


def _metric_vector(spec: CoreSpec, scalars: dict, maxima: dict, out: dict) -> torch.Tensor:
    """Every metric's partial sums, fp64, in ``_metric_plan``'s order: built in the graph from the sums
    and rows (a ~20-op assembly on the host took ~0.5 ms a call after the graph had streamed the batch
    through the caches), read by ``Metrics.from_flat`` without a copy per key."""
    f64 = torch.float64
    q = {k: v.to(f64) for k, v in scalars.items()}
    q.update({k: v.to(f64) for k, v in maxima.items()})
    q["zero"], q["one"] = torch.zeros_like(q["n"]), torch.ones_like(q["n"])
    q.setdefault("n_keep", q["n"])
    if spec.corrected:
        trainer_rows, rollout_rows, lr_rows, counts = out["rows"]
        rows = counts > 0
        q["n_rows"] = rows.sum().to(f64)
        safe = counts.clamp(min=1)
        mean_train, mean_rollout = trainer_rows / safe, rollout_rows / safe
        seq = lr_rows.clamp(-spec.log_clamp, spec.log_clamp)
        cap = ops.FP32_EXP_LIMIT
        diff = mean_rollout - mean_train
        for key, value in (("chi2_seq", torch.expm1(2.0 * seq)), ("ppl_train", torch.exp((-mean_train).clamp(-cap, cap))),
                           ("ppl_rollout", torch.exp((-mean_rollout).clamp(-cap, cap))), ("log_ppl_diff", diff),
                           ("ppl_ratio", torch.exp(diff.clamp(-cap, cap)))):
            q[key] = torch.where(rows, value, 0.0).sum()
        if out["removed"] is not None:
            for i, removed in enumerate(out["removed"]):
                q[f"removed_{i}"], q[f"removed_rows_{i}"] = removed.sum(), (removed > 0).sum().to(f64)
        q["masked"] = q["n"] - q["n_keep"]
        q["masked_rows"] = ((counts - out["count_rows"][1]) > 0).sum().to(f64)
        q.setdefault("below", q["zero"])
        q.setdefault("above", q["zero"])
        q["w_min"] = -q["w_min_neg"]
    return torch.stack([q[name] for _, _, names in _metric_plan(spec) for name in names])


@per_config(256)
def _layout(config: LossConfig, spec: CoreSpec) -> FlatLayout:
    """``Metrics.from_flat``'s layout of ``_metric_plan(spec)`` with the rules' keys and the loss's, made
    once per config object and spec (``per_config``)."""
    rules = config.correction.reject if config.correction is not None else []
    keys = [(key if isinstance(key, str) else f"reject/{rule_name(key[0], rules[key[0]])}/{key[1]}", reducer)
            for key, reducer, _ in _metric_plan(spec)]
    global_norm = config.global_tokens is not None or config.global_seqs is not None
    keys.append(("loss", "sum" if global_norm else "mean"))
    return FlatLayout.of(keys)


_compile_failed = False
COMPILE_MIN_TOKENS = 1 << 16


def preferred(mask: torch.Tensor) -> bool:
    """OFFPOLICY_COMPILE: "1" always, "0" never, "auto" (default) for batches of ≥ 65,536 tokens,
    where the one-off compile (~10–20 s per configuration) pays for itself within a few steps."""
    setting = os.environ.get("OFFPOLICY_COMPILE", "auto")
    if _compile_failed or setting == "0":
        return False
    return setting == "1" or mask.numel() >= COMPILE_MIN_TOKENS


COMPILED_CONFIGS = 64  # configurations whose compiled core a process keeps


@functools.lru_cache(maxsize=COMPILED_CONFIGS)
def _compiled(spec: CoreSpec):
    # dynamic shapes: one compile serves every [B, T]; dynamic_threads keeps the CPU kernel
    # OpenMP-parallel under dynamic shapes (without it inductor emits a serial loop: 10.9 vs 6.7 ms
    # at 256×4096 on 2 cores)
    # Every configuration is one more compiled version of the same code object (_core): dynamo's
    # default recompile_limit of 8 made the 9th configuration of a process run *uncompiled*, silently
    # (issue #9, suspicion confirmed by the fuzz). Allow as many as this cache holds (only raised).
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, COMPILED_CONFIGS)
    # cpp.max_horizontal_fusion_size: inductor's C++ backend puts at most 16 nodes in one loop by default;
    # the core's ~30 sums over the tokens then took two loops, the second reloading the inputs and ρ,
    # which the first stored for it. 64 makes them one loop that stores only the derivative.
    options = {"cpp.dynamic_threads": True, "cpp.max_horizontal_fusion_size": 64}
    return torch.compile(functools.partial(_core, spec=spec), dynamic=True, options=options)


@per_config(256)
def _bounds(config: LossConfig, device: torch.device) -> torch.Tensor:
    """``bounds_of(config)`` as fp32 on ``device`` (``bounds_tensor``: one copy per distinct vector),
    looked up once per config object and device."""
    return bounds_tensor(bounds_of(config), device)


def _constant_floats():
    """The spec's float (the log clamp; bounds are a tensor input) as a constant of the graph. Under dynamo's default
    (``specialize_float=False``, torch ≥ 2.6) they are traced as symbolic inputs first; inductor cannot turn them
    into tensors, and dynamo restarts the whole analysis with them specialised (the log: "Restarting analysis due
    to _tensorify_python_scalars"): ~2 s more per configuration's first call on the 2-core box, for a graph that
    compiles once per spec anyway. The setting is read while tracing; the context costs microseconds on the calls
    that do not trace."""
    if hasattr(torch._dynamo.config, "specialize_float"):
        return torch._dynamo.config.patch(specialize_float=True)
    return contextlib.nullcontext()


def policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config: LossConfig, reduce: bool,
                ref_logprobs: torch.Tensor | None = None):
    """The compiled fast path; None when it does not apply or the readable path must handle the inputs."""
    global _compile_failed
    corr = config.correction
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs,
               "advantages": advantages}
    # an empty batch ([2, 0]) has no valid token: refuse it before compiling a graph for it
    if mask.dim() != 2 or mask.numel() == 0 or any(
            t is not None and (t.shape != mask.shape or not t.is_floating_point()) for t in tensors.values()):
        validate_inputs(mask, **tensors)
    spec = core_spec(config, old_logprobs is not None, reduce)
    if spec is None or (spec.kind != "reinforce" and not spec.has_old):
        return None
    f32 = torch.float32
    lp = logprobs.detach().to(f32)
    roll = rollout_logprobs.to(f32) if rollout_logprobs is not None else lp
    if corr is not None and corr.anchor == "rollout":
        old = roll
    else:
        old = old_logprobs.to(f32) if old_logprobs is not None else lp
    adv, m = advantages.to(f32), mask.to(f32)
    try:
        with torch.no_grad(), _constant_floats():
            out, names_s, names_m = _compiled(spec)(lp, old, roll, adv, m, _bounds(config, lp.device))
    except Exception as err:  # noqa: BLE001 — no compiler, unsupported backend: stay correct, go eager
        _compile_failed = True
        log.warning("offpolicy: torch.compile of the fused loss failed (%s); using the eager fast path", err)
        return None
    S = dict(zip(names_s, out["scalars"].tolist()))
    M = dict(zip(names_m, out["maxima"].tolist()))
    if S["nonfinite"] or not all(math.isfinite(v) for v in S.values()):
        return None  # NaN/inf somewhere: the readable path applies the nonfinite policy
    n = S["n"]
    binary = mask.dtype == torch.bool or S["nonbinary"] == 0
    positive = any(M[k] > 1e-6 for k in ("lp_max", "old_max", "trainer_max", "rollout_max") if k in M)
    if not binary or n == 0 or positive:
        validate_inputs(mask, **tensors)  # raises the readable path's message
    den_rows = out["count_rows"][0]
    if spec.row_loss:
        numerator, count, row_scale = row_aggregation(out["loss_rows"], den_rows, config, mask.shape[-1])
    else:  # token-mean: Σ ℓ is one of the scalars (a 0-d view, still on the device)
        _, count, row_scale = row_aggregation(den_rows, den_rows, config, mask.shape[-1])
        numerator = out["scalars"][names_s.index("loss_sum")]
    if config.global_tokens is not None or config.global_seqs is not None:
        loss_parts = torch.stack([numerator / count.clamp(min=1), torch.ones_like(numerator)])
    else:
        loss_parts = torch.stack([numerator, count])
    # every partial sum in one fp64 vector on the data's device (issue #9 item 1), the loss's last
    metrics = Metrics.from_flat(torch.cat([out["metrics"], loss_parts]), _layout(config, spec))
    scale = (row_scale / count.clamp(min=1)).to(f32).unsqueeze(-1)
    if not reduce:
        return CoefTokens.apply(logprobs, out["per_token"], out["coef"]), out["den"].clone(), metrics
    loss_value = (numerator / count.clamp(min=1)).to(f32)
    return CoefLoss.apply(logprobs, loss_value, out["coef"], scale), metrics
