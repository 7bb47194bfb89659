"""An independent float64 oracle of ``policy_loss``, written from docs/specification.md §2–§7 (not from our code).

It is deliberately slow and literal: Python loops over rows where the specification speaks of rows,
float64 everywhere, autograd only for the gradient with respect to log π_θ. The only import
from ``offpolicy`` is the configuration classes (their field names are the contract).

Conventions taken from docs/specification.md where it leaves a choice to the implementation, written here once:

* ``log_clamp: null`` means "fp32 range only": the bound is 60 (exp(88.7) overflows fp32, and a
  weight is still multiplied by A and summed over tokens: e^60 ≈ 1e26 leaves room for that).
  A log-ratio ``L`` is clamped to [−min(L, 60), min(L, 60)] before every exp, including the
  row sums of the sequence level (docs/specification.md §2 "clamped the same way").
* Non-finite values (docs/specification.md §6) on valid tokens, by policy:
  ``mask_token`` drops the token, ``mask_sequence`` drops the row, ``neutral`` — for a bad
  value of a *ratio input* (the anchor's trainer side or log μ) the value is replaced by the
  other side's value, so log ρ_t = 0 (ρ_t = 1) and, under anchor ``old``, PPO's π_old of that
  token is that same replacement (never the non-finite value); a token whose two ratio inputs
  are both bad, or whose π_θ / A (/ π_old under anchor ``current``) is bad, is dropped like
  ``mask_token``. The neutral token stays in every statistic with ρ_t = 1.
  Which inputs are checked: π_θ, A, the ratio inputs, and π_old when the loss uses it.
* Everything rejected: the loss is 0 with zero gradient (docs/specification.md §9 "we return a zero loss").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offpolicy.core.config import LossConfig

FP32_LOG_LIMIT = 60.0
RATIO_CLAMP = 20.0  # PPO's own ratio r = exp(clamp(log π_θ − log π_old, ±20)) (docs/specification.md §5)
D = torch.float64


def _bound(log_clamp: float | None) -> float:
    return FP32_LOG_LIMIT if log_clamp is None else min(float(log_clamp), FP32_LOG_LIMIT)


def _in_band(x: float, low: float | None, high: float | None) -> bool:
    return (low is None or x >= low) and (high is None or x <= high)


@dataclass
class OracleResult:
    loss: float
    grad: torch.Tensor  # d loss / d log π_θ, float64 [B, T]
    loss_mask: torch.Tensor  # bool [B, T] surviving tokens
    agg_mask: torch.Tensor  # bool [B, T] the denominator's mask


def policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, cfg: LossConfig, ref_logprobs=None) -> OracleResult:
    """docs/specification.md §5 with the correction of docs/specification.md §2–§4, §6. Inputs of any float dtype; math in float64."""
    lp_in = logprobs.detach().to(D)
    B, T = lp_in.shape
    valid = mask.bool() if mask.dtype == torch.bool else mask != 0
    valid = valid.clone()
    adv = advantages.detach().to(D)
    mu = None if rollout_logprobs is None else rollout_logprobs.detach().to(D)
    old = None if old_logprobs is None else old_logprobs.detach().to(D)
    ref = None if ref_logprobs is None else ref_logprobs.detach().to(D)
    corr = cfg.correction
    anchor = None if corr is None else corr.anchor
    if anchor == "rollout":
        old = mu.clone()  # bypass: π_old := μ
    L = _bound(None if corr is None else corr.log_clamp) if corr is not None else FP32_LOG_LIMIT

    # ---------------------------------------------------------------- §6 sanitize
    fin = torch.isfinite
    if corr is not None:
        trainer = old.clone() if anchor == "old" else lp_in.clone()
        rollout = mu.clone()
        ratio_bad_t = valid & ~fin(trainer)
        ratio_bad_m = valid & ~fin(rollout)
        loss_bad = valid & (~fin(lp_in) | ~fin(adv))
        if anchor == "current" and old is not None:  # a π_old that was passed is checked
            loss_bad |= valid & ~fin(old)
        policy = corr.nonfinite
        any_bad = ratio_bad_t | ratio_bad_m | loss_bad
        if policy == "error":
            if bool(any_bad.any()):
                raise ValueError("non-finite")
        elif policy == "mask_token":
            valid &= ~any_bad
        elif policy == "mask_sequence":
            valid &= ~any_bad.any(dim=1, keepdim=True)
        else:  # neutral
            valid &= ~loss_bad & ~(ratio_bad_t & ratio_bad_m)
            fix_t = valid & ratio_bad_t
            fix_m = valid & ratio_bad_m
            trainer = torch.where(fix_t, rollout, trainer)
            rollout = torch.where(fix_m, trainer, rollout)
            if anchor == "old":
                old = trainer.clone()
            elif anchor == "rollout":
                old = rollout.clone()
    else:
        bad = valid & (~fin(lp_in) | ~fin(adv) | (~fin(old) if old is not None else torch.zeros_like(valid)))
        if bool(bad.any()):
            raise ValueError("non-finite")

    # ---------------------------------------------------------------- §2 log-ratio, §4 rejection, §3 weights
    weights = torch.ones(B, T, dtype=D)
    keep = valid.clone()
    if corr is not None:
        log_rho = torch.zeros(B, T, dtype=D)
        for b in range(B):
            for t in range(T):
                if valid[b, t]:
                    log_rho[b, t] = max(-L, min(L, float(trainer[b, t] - rollout[b, t])))
        rho = torch.exp(log_rho)
        keep = valid.clone()
        for rule in corr.reject:
            seen = keep.clone() if corr.reject_mode == "sequential" else valid.clone()
            rule_keep = _rule(rule, seen, log_rho, rho, trainer, rollout, lp_in, adv, L)
            keep &= rule_keep & seen
        if corr.weight is not None and anchor != "rollout":
            weights = _weights(corr.weight, keep, log_rho, L, input_valid=mask.bool() if mask.dtype == torch.bool else mask != 0)
        weights = torch.where(keep, weights, torch.zeros((), dtype=D))

    # ---------------------------------------------------------------- §5 the loss, with grad
    lp = torch.where(keep, lp_in, torch.zeros((), dtype=D)).requires_grad_(True)
    zero = torch.zeros((), dtype=D)
    o = None if old is None else torch.where(keep, old, zero)
    a = torch.where(keep, adv, zero)
    per_token = _token_loss(cfg, lp, o, a, keep)
    per_token = per_token * weights
    if ref is not None and cfg.kl_coef > 0:
        r_ = torch.where(keep, ref, zero)
        kl = _kl(lp, r_, cfg.kl_kind)
        kw = weights if (corr is not None and corr.kl_is_weight) else torch.ones_like(weights)
        per_token = per_token + cfg.kl_coef * kl * kw
    per_token = torch.where(keep, per_token, zero)
    agg_mask = valid if (corr is not None and corr.denominator == "fixed") else keep
    loss = _aggregate(per_token, agg_mask, cfg, T)
    loss.backward()
    return OracleResult(loss=float(loss.detach()), grad=lp.grad.detach(), loss_mask=keep, agg_mask=agg_mask)


# ---------------------------------------------------------------- data-chosen bounds (issue #12)
def _quantile(values: list[float], q: float, side: str) -> float | None:
    """Order statistic: upper v_(⌈q·n⌉), lower v_(⌊q·n⌋+1), 1-based, clamped to [1, n]."""
    if not values:
        return None
    v = sorted(values)
    n = len(v)
    k = math.ceil(q * n - 1e-9) if side == "high" else math.floor(q * n + 1e-9) + 1
    return v[min(max(k, 1), n) - 1]


def _ess(w: list[float]) -> float:
    s2 = sum(x * x for x in w)
    return 1.0 if not w or s2 == 0 else sum(w) ** 2 / (len(w) * s2)


def _ess_cap(w: list[float], target: float) -> float | None:
    """Largest c with ESS(min(w, c)) ≥ target, by bisection on c (ESS is non-increasing in c)."""
    if not w:
        return None
    if _ess(w) >= target:
        return max(w)
    lo, hi = 0.0, max(w)
    lo = min(w)  # ESS(min w) = 1
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _ess([min(x, mid) for x in w]) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def _resolve(bound, values: list[float], side: str):
    kind = getattr(bound, "rule", None)
    if kind == "quantile":
        return _quantile(values, bound.q, side)
    if kind == "ess":
        return _ess_cap(values, bound.target)
    return bound


def _m2_keep(seen, log_rho, tau) -> torch.Tensor:
    """M2PO as the config documents it: s = m2 sorted descending, k = min{i : mean(s[i:]) < τ};
    drop every token with m2 ≥ s[k−1]; if no suffix is below τ keep only m2 ≤ min."""
    idx = [(b, t) for b in range(seen.shape[0]) for t in range(seen.shape[1]) if seen[b, t]]
    m2 = {p: float(log_rho[p]) ** 2 for p in idx}
    keep = torch.ones_like(seen)
    if not idx:
        return keep
    s = sorted(m2.values(), reverse=True)
    n = len(s)
    k = next((i for i in range(n) if sum(s[i:]) / (n - i) < tau), None)
    for p in idx:
        if k is None:
            keep[p] = m2[p] <= s[-1]
        elif k > 0:
            keep[p] = m2[p] < s[k - 1]
    return keep


def _rule(rule, seen, log_rho, rho, trainer, rollout, lp, adv, L) -> torch.Tensor:
    B, T = seen.shape
    keep = torch.ones(B, T, dtype=torch.bool)
    stat = rule.stat
    if stat == "m2":
        return _m2_keep(seen, log_rho, rule.high)
    if stat == "ratio" and (getattr(rule.low, "rule", None) or getattr(rule.high, "rule", None)):
        if rule.level in ("token", "any_token"):
            units = [float(rho[b, t]) for b in range(B) for t in range(T) if seen[b, t]]
        else:
            units = []
            for b in range(B):
                idx = [t for t in range(T) if seen[b, t]]
                if idx:
                    s_ = sum(float(log_rho[b, t]) for t in idx) / (len(idx) if rule.level == "geometric" else 1)
                    units.append(math.exp(max(-L, min(L, s_))))
        low, high = _resolve(rule.low, units, "low"), _resolve(rule.high, units, "high")
        rule = type("Fixed", (), {"stat": "ratio", "level": rule.level, "low": low, "high": high})()
    for b in range(B):
        idx = [t for t in range(T) if seen[b, t]]
        if stat == "ratio":
            if rule.level == "token":
                for t in idx:
                    keep[b, t] = _in_band(float(rho[b, t]), rule.low, rule.high)
                continue
            if rule.level == "any_token":
                ok = all(_in_band(float(rho[b, t]), rule.low, rule.high) for t in idx)
            else:
                s = sum(float(log_rho[b, t]) for t in idx)
                if rule.level == "geometric":
                    s /= max(len(idx), 1)
                ok = _in_band(math.exp(max(-L, min(L, s))), rule.low, rule.high)
        elif stat in ("k1", "k2", "k3"):
            def k(t):
                x = float(log_rho[b, t])
                if getattr(rule, "direction", "mu_pi") == "pi_mu":  # AReaL: estimators of KL(π ‖ μ)
                    return x if stat == "k1" else (0.5 * x * x if stat == "k2" else math.exp(-x) - 1.0 + x)
                return -x if stat == "k1" else (0.5 * x * x if stat == "k2" else math.exp(x) - 1.0 - x)

            if rule.level == "token":
                for t in idx:
                    keep[b, t] = _in_band(k(t), rule.low, rule.high)
                continue
            vals = [k(t) for t in idx]
            if rule.level == "seq_sum":
                v = sum(vals)
            elif rule.level == "seq_mean":
                v = sum(vals) / max(len(vals), 1)
            else:
                v = max(vals) if vals else -math.inf
            ok = _in_band(v, rule.low, rule.high)
        elif stat == "mult_error":
            vals = [math.exp(abs(float(log_rho[b, t]))) for t in idx]
            ok = (sum(vals) / max(len(vals), 1)) <= rule.high
        elif stat == "prob_diff":
            for t in idx:
                d = math.exp(float(trainer[b, t])) - math.exp(float(rollout[b, t]))
                high = rule.high is not None and d > rule.high
                low = rule.low is not None and d < -rule.low
                if rule.by_advantage:
                    keep[b, t] = not (high if float(adv[b, t]) > 0 else low)
                else:
                    keep[b, t] = not (high or low)
            continue
        elif stat == "opsm":
            n = max(len(idx), 1)
            mean_a = sum(float(adv[b, t]) for t in idx) / n
            drift = sum(float(rollout[b, t] - lp[b, t]) for t in idx) / n
            ok = not (mean_a < 0 and drift > rule.delta)
        else:  # binary_kl: KL(Bern(μ) ‖ Bern(π_train)) of the sampled token, ≥ 0
            eps = 1e-6

            def bkl1(x: float, y: float) -> float:
                p, q = min(max(math.exp(x), eps), 1 - eps), min(max(math.exp(y), eps), 1 - eps)
                return max(0.0, p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q)))

            def bkl(t):
                mu, pi = float(rollout[b, t]), float(trainer[b, t])
                direction = getattr(rule, "direction", "mu_pi")
                if direction == "mu_pi":
                    return bkl1(mu, pi)
                return bkl1(pi, mu) if direction == "pi_mu" else max(bkl1(mu, pi), bkl1(pi, mu))

            if rule.level == "token":
                for t in idx:
                    v, a_t = bkl(t), float(adv[b, t]) if rule.by_advantage else 0.0
                    if not rule.by_advantage:
                        keep[b, t] = v <= rule.high
                        continue
                    hn = rule.high if rule.high_negative is None else rule.high_negative
                    pi_t, mu_t = float(trainer[b, t]), float(rollout[b, t])
                    rose, fell = pi_t > mu_t, pi_t < mu_t
                    keep[b, t] = not ((a_t > 0 and rose and v > rule.high) or (a_t < 0 and fell and v > hn))
                continue
            ok = sum(bkl(t) for t in idx) / max(len(idx), 1) <= rule.high
        keep[b, :] = ok
    return keep


def _f(w, x: float) -> float:
    if w.mode == "truncate":
        if w.low is not None:
            x = max(x, w.low)
        if w.high is not None:
            x = min(x, w.high)
        return x
    return x if _in_band(x, w.low, w.high) else 0.0


def _segments(input_valid, b: int) -> list[list[int]]:
    """Maximal runs of consecutive mask = 1 positions of row b (ROLL's segments)."""
    runs, cur = [], []
    for t in range(input_valid.shape[1]):
        if input_valid[b, t]:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def _weights(w, keep, log_rho, L, input_valid=None) -> torch.Tensor:
    B, T = keep.shape
    out = torch.zeros(B, T, dtype=D)
    # units: (positions, raw ratio) — a token, a row or a segment of the input mask
    units: list[tuple[list[tuple[int, int]], float]] = []
    for b in range(B):
        idx = [t for t in range(T) if keep[b, t]]
        if w.level == "token":
            units += [([(b, t)], math.exp(float(log_rho[b, t]))) for t in idx]
        elif w.level == "segment":
            for run in _segments(input_valid, b):
                kept = [t for t in run if keep[b, t]]
                if kept:
                    s = sum(float(log_rho[b, t]) for t in kept) / len(kept)
                    units.append(([(b, t) for t in kept], math.exp(max(-L, min(L, s)))))
        elif idx:
            s = sum(float(log_rho[b, t]) for t in idx)
            if w.level == "geometric":
                s /= len(idx)
            units.append(([(b, t) for t in idx], math.exp(max(-L, min(L, s)))))
    values = [r for _, r in units]
    fixed = type("Fixed", (), {"mode": w.mode, "low": _resolve(w.low, values, "low"),
                               "high": _resolve(w.high, values, "high")})()
    for positions, r in units:
        v = _f(fixed, r)
        for p in positions:
            out[p] = v
    if w.normalize:
        if w.level in ("token", "segment"):
            n = int(keep.sum())
            mean = float(out[keep].sum()) / max(n, 1)
        else:
            rows = [b for b in range(B) if bool(keep[b].any())]
            mean = sum(float(out[b][keep[b]].mean()) for b in rows) / max(len(rows), 1)
        if mean > 1e-8:
            out = out / mean
    return out


def _clip(x, lo, hi):
    if lo is None and hi is None:
        return x
    return x.clamp(min=None if lo is None else 1 - lo, max=None if hi is None else 1 + hi)


def _token_loss(cfg: LossConfig, lp, old, a, keep):
    kind = cfg.kind
    if kind == "reinforce":
        return -a * lp
    if (kind == "gspo" and cfg.gspo_form == "sequence") or (kind == "sapo" and cfg.sapo_level == "sequence"):
        return _sequence_form_loss(cfg, lp, old, a, keep)
    r = torch.exp((lp - old).clamp(-RATIO_CLAMP, RATIO_CLAMP))
    if kind == "ppo":
        loss = torch.maximum(-a * r, -a * _clip(r, cfg.clip_low, cfg.clip_high))
        if cfg.dual_clip is not None:
            loss = torch.where(a < 0, torch.minimum(loss, -cfg.dual_clip * a), loss)
        return loss
    if kind == "cispo":
        return -_clip(r.detach(), cfg.clip_low, cfg.clip_high) * a * lp
    if kind == "sapo":
        tau = torch.where(a > 0, torch.tensor(cfg.sapo_tau_pos, dtype=D), torch.tensor(cfg.sapo_tau_neg, dtype=D))
        return -(4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * a
    # gspo: s = exp(mean_t(log π_θ − log π_old)) per row over the loss mask; s_t = sg(s)·π_θ/sg(π_θ)
    n = keep.sum(dim=1).clamp(min=1).to(D)
    seq = (torch.where(keep, lp - old, torch.zeros((), dtype=D)).sum(dim=1) / n).detach()
    s = torch.exp(seq.clamp(-RATIO_CLAMP, RATIO_CLAMP))[:, None] * torch.exp(lp - lp.detach())
    loss = torch.maximum(-a * s, -a * _clip(s, cfg.clip_low, cfg.clip_high))
    if cfg.dual_clip is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -cfg.dual_clip * a), loss)
    return loss


def _sequence_form_loss(cfg: LossConfig, lp, old, a, keep):
    """GSPO (sequence form) / SAPO at sequence level, row by row: s = exp(mean_t(log π_θ − log
    π_old)) with its gradient, Ā = mean_t A over the row's kept tokens; every kept token of the
    row carries ℓ(s, Ā) (GSPO: −min(s·Ā, clip(s)·Ā), then the dual clip; SAPO: −(4/τ)σ(τ(s−1))·Ā)."""
    B, T = lp.shape
    rows = []
    for b in range(B):
        idx = [t for t in range(T) if bool(keep[b, t])]
        if not idx:
            rows.append(lp[b] * 0.0)  # still on π_θ's graph: an all-rejected batch has a zero gradient
            continue
        log_s = sum(lp[b, t] - old[b, t] for t in idx) / len(idx)
        s = torch.exp(log_s.clamp(-RATIO_CLAMP, RATIO_CLAMP))
        a_bar = sum(float(a[b, t]) for t in idx) / len(idx)
        if cfg.kind == "sapo":
            tau = cfg.sapo_tau_pos if a_bar > 0 else cfg.sapo_tau_neg
            value = -(4.0 / tau) * torch.sigmoid(tau * (s - 1.0)) * a_bar
        else:
            value = torch.maximum(-a_bar * s, -a_bar * _clip(s, cfg.clip_low, cfg.clip_high))
            if cfg.dual_clip is not None and a_bar < 0:
                value = torch.minimum(value, torch.tensor(-cfg.dual_clip * a_bar, dtype=D))
        rows.append(torch.stack([value if t in idx else lp[b, t] * 0.0 for t in range(T)]))
    return torch.stack(rows)


def _kl(lp, ref, kind):
    x = (lp - ref).clamp(-20.0, 20.0)
    base = kind.rstrip("+")
    value = x if base == "k1" else (0.5 * x * x if base == "k2" else (torch.exp(-x) + x - 1).clamp(-10.0, 10.0))
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * x * x
    return k2 - k2.detach() + value.detach()


def _aggregate(per_token, m, cfg: LossConfig, T: int):
    if cfg.agg == "token-mean":
        n = cfg.global_tokens if cfg.global_tokens is not None else float(m.sum())
        return per_token.sum() / max(n, 1.0) if cfg.global_tokens is None else per_token.sum() / n
    rows = []
    for b in range(per_token.shape[0]):
        n_b = int(m[b].sum())
        s = per_token[b].sum()
        if cfg.agg == "seq-mean-token-mean":
            rows.append(s / max(n_b, 1))
        elif cfg.agg == "seq-mean-token-sum":
            rows.append(s)
        else:
            rows.append(s / float(cfg.max_len if cfg.max_len is not None else T))
    total = torch.stack(rows).sum()
    n_rows = cfg.global_seqs if cfg.global_seqs is not None else float(sum(bool(m[b].any()) for b in range(m.shape[0])))
    return total / n_rows if cfg.global_seqs is not None else total / max(n_rows, 1.0)
