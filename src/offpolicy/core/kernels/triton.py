"""Triton rung: the whole of ``correct`` + ``policy_loss`` in two or three kernel launches,
with no host synchronisation, capturable in a CUDA graph.

Same formulas, derivatives and metrics as the reference (``kernels/reference.py``, docs/specification.md §2–§7);
the layout of the work is what changes:

1. ``_row_stats`` (only when a decision needs a whole row: a sequence / geometric / any-token /
   k-statistic rule, a sequence or geometric weight, ``nonfinite: mask_sequence``): one
   program per (row, chunk of ``BLOCK`` tokens) writes partial row sums — per row rule
   Σ_seen log ρ_t (or Σ k_t, max k_t, #outside) and n_seen, the weight's Σ_keep log ρ_t and
   n_keep, the row's count of non-finite tokens — to ``[slots, B, chunks]``.
2. ``_tokens``: one program per (row, chunk) reduces its row's partials (a handful of loads),
   decides the row (rules in order, ``independent`` or ``sequential`` exactly as
   ``correction.apply_rejection``), then per token: sanitize → log ρ_t = clamp(log π_train − log μ,
   ±L) → token rules → weight w_t → per-token loss ℓ_t and its derivative c_t = ∂ℓ_t/∂log π_θ
   (the only [B, T] tensor kept for backward) → the partial sums of every metric, written to
   ``[slots, B, chunks]`` (no atomics: the result is deterministic).
3. ``_finish``: one program reduces the partials per row (row statistics: chi2_seq, ppl, the
   aggregation's row terms, rows touched by each rule), then over rows in fp64, and writes the
   loss, the per-row backward scale ∂L/∂ℓ_bt and one flat fp64 vector holding every metric's
   partial sums — ``Metrics`` views into it, so ``to_dict`` copies to the host once.

Input checks without a sync: the kernels count what the reference would refuse (a mask value
other than 0/1, a positive log-prob, a non-finite value under ``nonfinite: error``, a batch with
no valid token) and exclude those tokens from every sum. On the CPU (the Triton interpreter, used
by the tests) the counts are read at once and the batch goes to the reference, which raises its
exact message. On a GPU the check is deferred to the first host read of the metrics
(``Metrics.to_dict``), which raises the same ``ValueError`` — reading the counts earlier would be
a host synchronisation per step.

Covered (``supports``): kinds ppo / cispo / reinforce without a KL term; no correction, or any
anchor, any weight without ``normalize``, ratio and k1/k2/k3 rules, both reject modes, both
denominators, ``nonfinite`` error / mask_token / mask_sequence; every aggregation, the global
normalisers, ``reduce=False``. Routed down the ladder (compiled → eager → reference): gspo, sapo,
a KL term, ``weight.normalize`` (a batch-wide mean that needs a second sweep), the OPSM and
binary-KL rules, ``nonfinite: neutral``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple

import torch

from offpolicy.core import ops
from offpolicy.core.config import DivergenceRule, LossConfig, RatioRule, rule_name
from offpolicy.core.correction import validate_inputs
from offpolicy.core.kernels.common import (
    RATIO_LOG_CLAMP,
    CoefLoss,
    CoefTokens,
    bounds_of,
    bounds_tensor,
    per_config,
)
from offpolicy.core.metrics import FlatLayout, Metrics

NAME = "triton"
KINDS = ("ppo", "cispo", "reinforce")
BLOCK: int | None = None  # tokens per program; None = by row length (``_block``); tests set a small one


_CP = 8  # chunks a reduction reads at a time (a row of ≤ 8,192 tokens, or of ≤ 32,768 in the large class, in one)
_RB = 2048 // _CP  # rows per tile of the finishing program
BIG_BATCH = 1 << 20  # tokens (B·T) past which, or rows past 8,192 tokens, the large size class applies


def _block(B: int, T: int) -> int:
    """Tokens per program, one of two size classes (each a compiled variant of every kernel): 1,024,
    and 4,096 for rows longer than 8,192 tokens or batches of more than 2²⁰ tokens — there 1,024 would
    cut rows into > 8 chunks and the batch into > 1,024 programs, and the finishing program, which
    reduces B × chunks partials per slot, would take longer. 256×4096 → 1,024 programs of 1,024
    tokens; 1024×8192 → 2,048 of 4,096; 64×32768 → 512 of 4,096. (A third class, 2,048, cost a
    compile per kernel and spec for no measured gain.) Plain integer arithmetic: Triton's
    ``cdiv``/``next_power_of_2`` are ``ConstexprFunction``s since 3.5, ~10 µs a call."""
    if BLOCK is not None:
        return BLOCK
    return 4096 if T > 8192 or B * T > BIG_BATCH else 1024


# rule encodings (constexpr): (stat, level); the bounds are runtime values (``bounds_of``)
_STAT = {"ratio": 0, "k1": 1, "k2": 2, "k3": 3}
_PI_MU_STAT = {"k1": 4, "k2": 2, "k3": 5}  # direction pi_mu (AReaL): k1, k3 of −log ρ; k2 is symmetric
_LEVEL = {"token": 0, "sequence": 1, "geometric": 2, "any_token": 3, "seq_sum": 4, "seq_mean": 5, "seq_max": 6}
_ANCHOR = {"old": 0, "rollout": 1, "current": 2}
_KIND = {"ppo": 0, "cispo": 1, "reinforce": 2}
_AGG = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 3}
_NONFINITE = {"error": 0, "mask_token": 1, "mask_sequence": 2}

# partial-sum slots written by _tokens, [slot, B, chunk]; rule slots follow at _S_RULES
_TOKEN_SLOTS = (
    "n_input", "n_valid", "n_bad", "sum_lr", "sum_trainer", "sum_rollout", "sum_diff", "k3", "chi2", "rho", "rho2",
    "abs_lr", "prob_diff", "max_abs_lr", "max_prob_diff", "n_keep", "w_sum", "w2_sum", "w_max", "w_min", "above",
    "below", "units", "loss", "den", "clip", "dual", "approx_kl",
    # deferred input checks
    "bad_mask", "pos_lp", "pos_old", "pos_roll", "nf_lp", "nf_old", "nf_roll", "nf_adv",
    "mult_err",  # Σ exp(|log ρ|), NeMo-RL's token_mult_prob_error (added last: the slots above keep their numbers)
)
S = {name: i for i, name in enumerate(_TOKEN_SLOTS)}
_S_RULES = len(_TOKEN_SLOTS)
_MAX_SLOTS = ("max_abs_lr", "max_prob_diff", "w_max")  # reduced by max (w_min by min)


def available() -> bool:
    """Whether Triton is importable (it is part of torch's CUDA install; ``pip install triton`` on a CPU)."""
    return triton is not None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Spec(NamedTuple):
    """The structure the kernels specialise on (one compile per distinct spec, dtype and size class).
    Bounds are not part of it: they are runtime values (``bounds_of``), so a data-chosen cut that
    ``resolve_thresholds`` fixes anew every optimizer step does not compile the kernels anew."""

    corrected: bool
    anchor: int
    log_clamp: float  # L: a setting of the configuration, never chosen from data
    rules: tuple[tuple[int, int], ...]  # (stat, level) of each rule
    sequential: bool
    weight: tuple[int, int] | None  # (level 0 token / 1 sequence / 2 geometric, mode 0 truncate / 1 mask)
    fixed_denominator: bool
    nonfinite: int
    kind: int
    dual: bool  # a dual clip is set (its metric is reported)
    has_old: bool
    agg: int

    @property
    def needs_rows(self) -> bool:
        return any(level != 0 for _, level in self.rules) or (self.weight is not None and self.weight[0] != 0) \
            or self.nonfinite == 2


def spec_of(config: LossConfig, has_old: bool) -> Spec | None:
    """The kernels' spec of ``config``, or None when this rung does not cover it."""
    corr = config.correction
    dual = config.dual_clip is not None
    if corr is None:
        return Spec(False, 0, 20.0, (), False, None, False, 0, _KIND[config.kind], dual, has_old, _AGG[config.agg])
    if corr.nonfinite not in _NONFINITE or (corr.weight is not None and corr.weight.normalize):
        return None
    if corr.data_dependent or (corr.weight is not None and corr.weight.level == "segment"):
        return None  # a data-chosen bound sorts the whole call; segments: the reference's job
    if not isinstance(corr.denominator, str):
        return None  # a count after the first n rules: the reference's job
    rules = []
    for rule in corr.reject:
        if not isinstance(rule, (RatioRule, DivergenceRule)):
            return None
        stat = _PI_MU_STAT[rule.stat] if getattr(rule, "direction", "mu_pi") == "pi_mu" else _STAT[rule.stat]
        rules.append((stat, _LEVEL[rule.level]))
    weight = None
    if corr.weight is not None and corr.anchor != "rollout":
        w = corr.weight
        weight = ({"token": 0, "sequence": 1, "geometric": 2}[w.level], 0 if w.mode == "truncate" else 1)
    return Spec(True, _ANCHOR[corr.anchor], ops.effective_log_clamp(corr.log_clamp), tuple(rules),
                corr.reject_mode == "sequential", weight, corr.denominator == "fixed", _NONFINITE[corr.nonfinite],
                _KIND[config.kind], dual, has_old or corr.anchor == "rollout", _AGG[config.agg])


def supports(config: LossConfig, ref_logprobs: torch.Tensor | None) -> bool:
    """Kinds ppo / cispo / reinforce without KL, score centering or a ratio value cap; any correction but weight.normalize, the opsm,
    binary_kl, m2, mult_error and prob_diff rules, data-chosen (ess / quantile) bounds, the
    segment level, nonfinite 'neutral' and an integer denominator; Triton must be importable."""
    return (config.kind in KINDS and ref_logprobs is None and config.score_centering is None
            and config.ratio_value_cap is None and spec_of(config, True) is not None and available())


def preferred(mask: torch.Tensor) -> bool:
    """``auto`` takes this rung on CUDA tensors (``OFFPOLICY_TRITON=0`` turns it off)."""
    return mask.is_cuda and os.environ.get("OFFPOLICY_TRITON", "1") != "0"


# =============================================================================== the kernels
try:  # optional: part of torch's CUDA install; `pip install triton` on a CPU (TRITON_INTERPRET=1)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover — depends on the machine
    triton = None

if triton is not None:
    _RATIO_CLAMP = tl.constexpr(RATIO_LOG_CLAMP)
    _EXP_LIMIT = tl.constexpr(ops.FP32_EXP_LIMIT)
    _NSLOT = tl.constexpr(_S_RULES)
    # Triton specialises an int argument on being 1 and on divisibility by 16, and a pointer on
    # 16-byte alignment: sizes and strides that vary with every micro-batch would compile a variant
    # each (6 of `_tokens` over 40 trainer shapes). Not specialising costs nothing here: a row's start
    # row · stride is unknown anyway, so loads cannot be vectorised across it; the outputs the host
    # allocates start 16-byte aligned (``_aligned``) and keep their pointer specialisation.
    _SIZES = ("B", "T", "C", "s_lp", "s_old", "s_roll", "s_adv_b", "s_adv_t", "s_m")
    _INPUTS = ("lp_ptr", "old_ptr", "roll_ptr", "adv_ptr", "m_ptr")

    @triton.jit
    def _isfinite(x):
        return (x == x) & (tl.abs(x) < float("inf"))

    @triton.jit
    def _band(x, lo, hi):
        return (x >= lo) & (x <= hi)

    @triton.jit
    def _clamp(x, bound):
        return tl.minimum(tl.maximum(x, -bound), bound)

    @triton.jit
    def _expm1(x):
        """e^x − 1 without exp's cancellation near 0 (issue #30: k3 ≈ x²/2 read 1e-9 where it is 1e-11).
        |x| < 1/16: the Taylor series to x⁷/7! (the next term is below 2e-10 of x²/2, under fp32's
        precision); else exp(x) − 1, whose cancellation costs at most ~3e-5 of k3 ≥ 2e-3 there. Triton
        has no portable expm1 (libdevice's is CUDA-only and absent from the CPU interpreter)."""
        series = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (1.0 / 720 + x / 5040))))))
        return tl.where(tl.abs(x) < 0.0625, series, tl.exp(x) - 1.0)

    @triton.jit
    def _program_cols(T, BLOCK: tl.constexpr):
        """This program's row, its chunk of the row, the chunk's token columns and which lie inside the row."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        return row, chunk, cols, cols < T

    @triton.jit
    def _rule_value(STAT: tl.constexpr, ratio, lr, bounds_ptr, I: tl.constexpr, L: tl.constexpr):
        """Rule I's per-token statistic (STAT 0: ρ itself, else ``_k_stat``) and its band [lo, hi], read from
        the runtime bounds vector (two fp32 a rule: data-chosen bounds change no compile key)."""
        if STAT == 0:
            x = ratio
        else:
            x = _k_stat(STAT, lr, L)
        lo = tl.load(bounds_ptr + 2 * I)
        hi = tl.load(bounds_ptr + 2 * I + 1)
        return x, lo, hi

    @triton.jit
    def _k_stat(STAT: tl.constexpr, lr, L: tl.constexpr):
        """k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ = expm1(log ρ) − log ρ (verl rollout_rs; docs/specification.md §4);
        direction pi_mu (AReaL): 4 = k1 = log ρ, 5 = k3 = 1/ρ − 1 + log ρ."""
        if STAT == 1:
            v = -lr
        elif STAT == 2:
            v = 0.5 * lr * lr
        elif STAT == 4:
            v = lr
        elif STAT == 5:
            v = _expm1(_clamp(-lr, L)) + lr
        else:
            v = _expm1(_clamp(lr, L)) - lr
        return v

    @triton.jit
    def _weight_fn(x, MODE: tl.constexpr, LO, HI):
        """truncate: clamp(x, low, high); mask: x · 1[low ≤ x ≤ high] (docs/specification.md §3)."""
        if MODE == 0:
            w = tl.minimum(tl.maximum(x, LO), HI)
        else:
            w = tl.where(_band(x, LO, HI), x, 0.0)
        return w

    @triton.jit
    def _load(lp_ptr, old_ptr, roll_ptr, adv_ptr, m_ptr, row, cols, inb, s_lp, s_old, s_roll, s_adv_b, s_adv_t, s_m,
              CORRECTED: tl.constexpr, ANCHOR: tl.constexpr, OLD_IN: tl.constexpr):
        """One chunk of one row as fp32: (mask value, m_in, log π_θ, log π_old, log π_train, log μ, A)."""
        mval = tl.load(m_ptr + row * s_m + cols, mask=inb, other=0).to(tl.float32)
        m_in = inb & (mval != 0.0)
        lp = tl.load(lp_ptr + row * s_lp + cols, mask=m_in, other=0.0).to(tl.float32)
        adv = tl.load(adv_ptr + row * s_adv_b + cols * s_adv_t, mask=m_in, other=0.0).to(tl.float32)
        if CORRECTED:
            roll = tl.load(roll_ptr + row * s_roll + cols, mask=m_in, other=0.0).to(tl.float32)
        else:
            roll = lp
        if OLD_IN:
            old = tl.load(old_ptr + row * s_old + cols, mask=m_in, other=0.0).to(tl.float32)
        else:
            old = roll  # anchor rollout: π_old := μ (and unused without an old policy)
        if ANCHOR == 0:
            trainer = old
        else:
            trainer = lp
        return mval, m_in, lp, old, trainer, roll, adv

    @triton.jit
    def _bad(m_in, lp, old, roll, adv, CORRECTED: tl.constexpr, OLD_IN: tl.constexpr):
        """Valid tokens whose inputs the reference's sanitize would flag (docs/specification.md §6)."""
        fin = _isfinite(lp) & _isfinite(adv)
        if CORRECTED:
            fin = fin & _isfinite(roll)
        if OLD_IN:
            fin = fin & _isfinite(old)
        return m_in & ~fin

    @triton.jit
    def _row_total(p_ptr, slot, row, B, C, CP: tl.constexpr, IS_MAX: tl.constexpr):
        """Σ (or max) over the chunks of ``row`` of partial ``slot`` of a [slots, B, C] buffer, ``CP``
        chunks at a time (a fixed tile: the chunk count is a runtime value, not a specialisation)."""
        c = tl.arange(0, CP)
        at = p_ptr + (slot * B + row) * C
        if IS_MAX:
            total = tl.max(tl.load(at + c, mask=c < C, other=-float("inf")), axis=0)
            for c0 in range(CP, C, CP):
                total = tl.maximum(total, tl.max(tl.load(at + c0 + c, mask=c0 + c < C, other=-float("inf")), axis=0))
        else:
            total = tl.sum(tl.load(at + c, mask=c < C, other=0.0), axis=0)
            for c0 in range(CP, C, CP):
                total += tl.sum(tl.load(at + c0 + c, mask=c0 + c < C, other=0.0), axis=0)
        return total

    @triton.jit(do_not_specialize=_SIZES, do_not_specialize_on_alignment=_INPUTS)
    def _row_stats(lp_ptr, old_ptr, roll_ptr, adv_ptr, m_ptr, p1_ptr, bounds_ptr,
                   B, T, C, s_lp, s_old, s_roll, s_adv_b, s_adv_t, s_m,
                   CORRECTED: tl.constexpr, ANCHOR: tl.constexpr, OLD_IN: tl.constexpr, L: tl.constexpr,
                   RULES: tl.constexpr, SEQUENTIAL: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 1: per (row, chunk), the partial sums the row decisions need (see module docstring).
        Slots: 2i, 2i+1 → rule i's statistic and n_seen; 2n, 2n+1 → Σ log ρ and n over the tokens
        that pass every token rule (the weight's row ratio); 2n+2 → non-finite tokens."""
        row, chunk, cols, inb = _program_cols(T, BLOCK)
        mval, m_in, lp, old, trainer, roll, adv = _load(lp_ptr, old_ptr, roll_ptr, adv_ptr, m_ptr, row, cols, inb, s_lp,
                                                        s_old, s_roll, s_adv_b, s_adv_t, s_m, CORRECTED, ANCHOR, OLD_IN)
        bad = _bad(m_in, lp, old, roll, adv, CORRECTED, OLD_IN)
        valid = m_in & ~bad
        lr = tl.where(valid, _clamp(trainer - roll, L), 0.0)
        ratio = tl.exp(lr)
        base = row * C + chunk
        plane = B * C
        tok_ok = valid
        for i in tl.static_range(len(RULES)):
            if SEQUENTIAL:
                seen = tok_ok
            else:
                seen = valid
            x, lo, hi = _rule_value(RULES[i][0], ratio, lr, bounds_ptr, i, L)
            if RULES[i][1] == 0:
                tok_ok = tok_ok & _band(x, lo, hi)
            else:
                if RULES[i][1] == 3:  # any_token: how many seen tokens leave the band
                    a = tl.sum(tl.where(seen & ~_band(x, lo, hi), 1.0, 0.0), axis=0)
                elif RULES[i][1] == 6:  # seq_max
                    a = tl.max(tl.where(seen, x, -float("inf")), axis=0)
                elif RULES[i][0] == 0:  # sequence / geometric: Σ log ρ over the seen tokens
                    a = tl.sum(tl.where(seen, lr, 0.0), axis=0)
                else:  # seq_sum / seq_mean of k
                    a = tl.sum(tl.where(seen, x, 0.0), axis=0)
                tl.store(p1_ptr + (2 * i) * plane + base, a)
                tl.store(p1_ptr + (2 * i + 1) * plane + base, tl.sum(tl.where(seen, 1.0, 0.0), axis=0))
        n_rules: tl.constexpr = len(RULES)
        tl.store(p1_ptr + (2 * n_rules) * plane + base, tl.sum(tl.where(tok_ok, lr, 0.0), axis=0))
        tl.store(p1_ptr + (2 * n_rules + 1) * plane + base, tl.sum(tl.where(tok_ok, 1.0, 0.0), axis=0))
        tl.store(p1_ptr + (2 * n_rules + 2) * plane + base, tl.sum(tl.where(bad, 1.0, 0.0), axis=0))

    @triton.jit(do_not_specialize=_SIZES, do_not_specialize_on_alignment=_INPUTS)
    def _tokens(lp_ptr, old_ptr, roll_ptr, adv_ptr, m_ptr, p1_ptr, p2_ptr, coef_ptr, tok_ptr, den_ptr, bounds_ptr,
                B, T, C, s_lp, s_old, s_roll, s_adv_b, s_adv_t, s_m,
                CORRECTED: tl.constexpr, ANCHOR: tl.constexpr, OLD_IN: tl.constexpr, L: tl.constexpr,
                RULES: tl.constexpr, SEQUENTIAL: tl.constexpr, NONFINITE: tl.constexpr,
                HAS_WEIGHT: tl.constexpr, WLEVEL: tl.constexpr, WMODE: tl.constexpr, FIXED: tl.constexpr,
                KIND: tl.constexpr, UNREDUCED: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 2: sanitize → log ρ → rejection → weights → loss and derivative → partial sums.
        ``bounds_ptr``: fp32 (low, high) per rule, the weight's (low, high), 1 − ε_low, 1 + ε_high, c."""
        row, chunk, cols, inb = _program_cols(T, BLOCK)
        mval, m_in, lp, old, trainer, roll, adv = _load(lp_ptr, old_ptr, roll_ptr, adv_ptr, m_ptr, row, cols, inb, s_lp,
                                                        s_old, s_roll, s_adv_b, s_adv_t, s_m, CORRECTED, ANCHOR, OLD_IN)
        n_rules: tl.constexpr = len(RULES)
        WLO = tl.load(bounds_ptr + 2 * n_rules)
        WHI = tl.load(bounds_ptr + 2 * n_rules + 1)
        CLIP_LO = tl.load(bounds_ptr + 2 * n_rules + 2)
        CLIP_HI = tl.load(bounds_ptr + 2 * n_rules + 3)
        DUAL = tl.load(bounds_ptr + 2 * n_rules + 4)
        plane = B * C
        base = row * C + chunk
        # ----------------------------------------------------------- what the reference refuses
        bad_mask = inb & (mval != 0.0) & (mval != 1.0)
        pos_lp = m_in & _isfinite(lp) & (lp > 1e-6)
        no = m_in & ~m_in
        pos_old = no
        nf_old = no
        if OLD_IN:
            pos_old = m_in & _isfinite(old) & (old > 1e-6)
            nf_old = m_in & ~_isfinite(old)
        pos_roll = no
        nf_roll = no
        if CORRECTED:
            pos_roll = m_in & _isfinite(roll) & (roll > 1e-6)
            nf_roll = m_in & ~_isfinite(roll)
        bad = _bad(m_in, lp, old, roll, adv, CORRECTED, OLD_IN)
        valid = m_in & ~bad & ~bad_mask & ~pos_lp & ~pos_old & ~pos_roll
        alive = row >= 0  # rows are alive until a row rule fails
        if NONFINITE == 2:  # mask_sequence: a row with any non-finite valid token goes
            row_bad = _row_total(p1_ptr, 2 * n_rules + 2, row, B, C, CP, False)
            valid = valid & ((cols * 0.0 + row_bad) == 0.0)  # broadcast first: the interpreter's & wants blocks
            alive = alive & (row_bad == 0.0)
        # ----------------------------------------------------------- log ρ (docs/specification.md §2)
        lr = tl.where(valid, _clamp(trainer - roll, L), 0.0)
        ratio = tl.exp(lr)
        # ----------------------------------------------------------- rejection (docs/specification.md §4)
        tok_ok = valid
        for i in tl.static_range(n_rules):
            if SEQUENTIAL:
                seen = tok_ok & alive
            else:
                seen = valid
            x, lo, hi = _rule_value(RULES[i][0], ratio, lr, bounds_ptr, i, L)
            if RULES[i][1] == 0:
                ok = _band(x, lo, hi)
                removed = seen & ~ok
                tok_ok = tok_ok & ok
            else:
                a = _row_total(p1_ptr, 2 * i, row, B, C, CP, RULES[i][1] == 6)
                n_seen = _row_total(p1_ptr, 2 * i + 1, row, B, C, CP, False)
                if RULES[i][1] == 3:
                    passed = a == 0.0
                elif RULES[i][1] == 6:
                    passed = _band(a, lo, hi)
                elif RULES[i][0] == 0:
                    if RULES[i][1] == 2:
                        a = a / tl.maximum(n_seen, 1.0)
                    passed = _band(tl.exp(_clamp(a, L)), lo, hi)
                else:
                    if RULES[i][1] == 5:
                        a = a / tl.maximum(n_seen, 1.0)
                    passed = _band(a, lo, hi)
                removed = seen & (passed == 0)  # (a scalar: `~` misbehaves in the interpreter)
                alive = alive & passed
            tl.store(p2_ptr + (_NSLOT + i) * plane + base, tl.sum(tl.where(removed, 1.0, 0.0), axis=0))
        keep = tok_ok & alive
        keep_f = tl.where(keep, 1.0, 0.0)
        # ----------------------------------------------------------- weights (docs/specification.md §3)
        above = 0.0
        below = 0.0
        units = 0.0
        w = keep_f
        if HAS_WEIGHT:
            if WLEVEL == 0:
                w = _weight_fn(ratio, WMODE, WLO, WHI) * keep_f
                above = tl.sum(tl.where(keep & (ratio > WHI), 1.0, 0.0), axis=0)
                below = tl.sum(tl.where(keep & (ratio < WLO), 1.0, 0.0), axis=0)
                units = tl.sum(keep_f, axis=0)
            else:
                row_lr = _row_total(p1_ptr, 2 * n_rules, row, B, C, CP, False)
                row_n = _row_total(p1_ptr, 2 * n_rules + 1, row, B, C, CP, False)
                if WLEVEL == 2:
                    row_lr = row_lr / tl.maximum(row_n, 1.0)
                unit = tl.exp(_clamp(row_lr, L))
                w = _weight_fn(unit, WMODE, WLO, WHI) * keep_f
                counted = (chunk == 0) & alive & (row_n > 0.0)  # one count per non-empty surviving row
                above = tl.where(counted & (unit > WHI), 1.0, 0.0)
                below = tl.where(counted & (unit < WLO), 1.0, 0.0)
                units = tl.where(counted, 1.0, 0.0)
        # ----------------------------------------------------------- loss and derivative (docs/specification.md §5)
        adv_w = tl.where(keep, adv, 0.0) * w
        lp_k = tl.where(keep, lp, 0.0)
        raw_log_r = lp_k - tl.where(keep, old, 0.0)
        log_r = _clamp(raw_log_r, _RATIO_CLAMP)
        r = tl.exp(log_r)
        clip = 0.0
        dual = 0.0
        if KIND == 2:  # reinforce: ℓ = −A·w·log π_θ, c = −A·w
            per_token = -adv_w * lp_k
            coef = -adv_w
        elif KIND == 1:  # cispo: ℓ = −sg(clip(r))·A·w·log π_θ, c = −clip(r)·A·w
            kept = tl.minimum(tl.maximum(r, CLIP_LO), CLIP_HI)
            per_token = -kept * adv_w * lp_k
            coef = -kept * adv_w
            clip = tl.sum(tl.where(keep & (kept != r), 1.0, 0.0), axis=0)
        else:  # ppo: max(−A·r, −A·clip(r)) = −A·min(r, 1+ε_h) for A > 0 and −A·max(r, 1−ε_l) for A < 0
            clipped = tl.where(adv > 0, tl.minimum(r, CLIP_HI), tl.maximum(r, CLIP_LO))
            per_token = -adv_w * clipped
            active = clipped == r  # the gradient flows through the unclipped branch only
            clip = tl.sum(tl.where(keep & ~active & (adv != 0.0), 1.0, 0.0), axis=0)
            is_dual = (adv < 0) & (clipped > DUAL)  # −A·s > −c·A ⇔ s > c for A < 0
            dual = tl.sum(tl.where(keep & is_dual, 1.0, 0.0), axis=0)
            per_token = tl.where(is_dual, -adv_w * DUAL, per_token)
            # clamp's derivative is 0 past ±RATIO_LOG_CLAMP: no gradient through r there
            coef = tl.where(active & ~is_dual & (tl.abs(raw_log_r) <= _RATIO_CLAMP), -adv_w * r, 0.0)
        per_token = tl.where(keep, per_token, 0.0)
        out = row * T + cols
        tl.store(coef_ptr + out, tl.where(keep, coef, 0.0), mask=inb)
        if FIXED:
            den = tl.where(valid, 1.0, 0.0)
        else:
            den = keep_f
        if UNREDUCED:
            tl.store(tok_ptr + out, per_token, mask=inb)
            tl.store(den_ptr + out, den, mask=inb)
        # ----------------------------------------------------------- partial sums (docs/specification.md §7)
        em1 = tl.where(valid, _expm1(lr), 0.0)  # ρ − 1 exact near ρ = 1: k3 and χ² sum it
        if L > 44.0:  # ρ² overflows fp32 beyond log ρ = 44: square in fp64 (p2 is fp64)
            e64 = em1.to(tl.float64)
            chi2 = tl.sum(e64 * (e64 + 2.0), axis=0)
            rho64 = tl.where(valid, ratio, 0.0).to(tl.float64)
            rho2 = tl.sum(rho64 * rho64, axis=0)
        else:
            chi2 = tl.sum(em1 * (em1 + 2.0), axis=0)
            rho2 = tl.sum(tl.where(valid, ratio * ratio, 0.0), axis=0)
        tr_v = tl.where(valid, trainer, 0.0)
        ro_v = tl.where(valid, roll, 0.0)
        abs_lr = tl.abs(lr)
        prob_diff = tl.abs(tl.exp(tr_v) - tl.exp(ro_v))  # exp(0) − exp(0) = 0 off the valid tokens
        # weights sit near 1: sums of w − 1 keep the digits that E[w²] − E[w]² (is_std) cancels
        wd = tl.where(keep, w.to(tl.float64) - 1.0, 0.0)  # exact in fp64, summed in fp64
        p = p2_ptr + base
        tl.store(p + 0 * plane, tl.sum(tl.where(m_in, 1.0, 0.0), axis=0))
        tl.store(p + 1 * plane, tl.sum(tl.where(valid, 1.0, 0.0), axis=0))
        tl.store(p + 2 * plane, tl.sum(tl.where(bad, 1.0, 0.0), axis=0))
        tl.store(p + 3 * plane, tl.sum(lr, axis=0))
        tl.store(p + 4 * plane, tl.sum(tr_v, axis=0))
        tl.store(p + 5 * plane, tl.sum(ro_v, axis=0))
        tl.store(p + 6 * plane, tl.sum(ro_v - tr_v, axis=0))
        tl.store(p + 7 * plane, tl.sum(em1 - lr, axis=0))
        tl.store(p + 8 * plane, chi2)
        tl.store(p + 9 * plane, tl.sum(tl.where(valid, ratio, 0.0), axis=0))
        tl.store(p + 10 * plane, rho2)
        tl.store(p + 11 * plane, tl.sum(abs_lr, axis=0))
        tl.store(p + 12 * plane, tl.sum(prob_diff, axis=0))
        tl.store(p + 13 * plane, tl.max(abs_lr, axis=0))
        tl.store(p + 14 * plane, tl.max(prob_diff, axis=0))
        tl.store(p + 15 * plane, tl.sum(keep_f, axis=0))
        tl.store(p + 16 * plane, tl.sum(wd, axis=0))
        tl.store(p + 17 * plane, tl.sum(wd * wd, axis=0))
        tl.store(p + 18 * plane, tl.max(tl.where(keep, w, -float("inf")), axis=0))
        tl.store(p + 19 * plane, tl.min(tl.where(keep, w, float("inf")), axis=0))
        tl.store(p + 20 * plane, above)
        tl.store(p + 21 * plane, below)
        tl.store(p + 22 * plane, units)
        tl.store(p + 23 * plane, tl.sum(per_token, axis=0))
        tl.store(p + 24 * plane, tl.sum(den, axis=0))
        tl.store(p + 25 * plane, clip)
        tl.store(p + 26 * plane, dual)
        tl.store(p + 27 * plane, tl.sum(tl.where(keep, _expm1(log_r) - log_r, 0.0), axis=0))
        tl.store(p + 28 * plane, tl.sum(tl.where(bad_mask, 1.0, 0.0), axis=0))
        tl.store(p + 29 * plane, tl.sum(tl.where(pos_lp, 1.0, 0.0), axis=0))
        tl.store(p + 30 * plane, tl.sum(tl.where(pos_old, 1.0, 0.0), axis=0))
        tl.store(p + 31 * plane, tl.sum(tl.where(pos_roll, 1.0, 0.0), axis=0))
        tl.store(p + 32 * plane, tl.sum(tl.where(m_in & ~_isfinite(lp), 1.0, 0.0), axis=0))
        tl.store(p + 33 * plane, tl.sum(tl.where(nf_old, 1.0, 0.0), axis=0))
        tl.store(p + 34 * plane, tl.sum(tl.where(nf_roll, 1.0, 0.0), axis=0))
        tl.store(p + 35 * plane, tl.sum(tl.where(m_in & ~_isfinite(adv), 1.0, 0.0), axis=0))
        tl.store(p + 36 * plane, tl.sum(tl.where(valid, tl.exp(abs_lr), 0.0), axis=0))

    @triton.jit
    def _tile(p_ptr, slot, rows, rmask, B, C, CP: tl.constexpr):
        """[RB] fp64 row totals of partial ``slot`` for ``rows`` (``CP`` chunks at a time)."""
        c = tl.arange(0, CP)
        offs = (slot * B + rows[:, None]) * C + c[None, :]
        v = tl.load(p_ptr + offs, mask=rmask[:, None] & (c[None, :] < C), other=0.0)
        total = tl.sum(v.to(tl.float64), axis=1)
        for c0 in range(CP, C, CP):
            v = tl.load(p_ptr + offs + c0, mask=rmask[:, None] & (c0 + c[None, :] < C), other=0.0)
            total += tl.sum(v.to(tl.float64), axis=1)
        return total

    @triton.jit
    def _tile_extreme(p_ptr, slot, rows, rmask, B, C, CP: tl.constexpr, IS_MAX: tl.constexpr):
        c = tl.arange(0, CP)
        offs = (slot * B + rows[:, None]) * C + c[None, :]
        if IS_MAX:
            v = tl.max(tl.max(tl.load(p_ptr + offs, mask=rmask[:, None] & (c[None, :] < C), other=-float("inf")),
                              axis=1), axis=0)
            for c0 in range(CP, C, CP):
                v = tl.maximum(v, tl.max(tl.max(tl.load(p_ptr + offs + c0, mask=rmask[:, None] & (c0 + c[None, :] < C),
                                                        other=-float("inf")), axis=1), axis=0))
        else:
            v = tl.min(tl.min(tl.load(p_ptr + offs, mask=rmask[:, None] & (c[None, :] < C), other=float("inf")),
                              axis=1), axis=0)
            for c0 in range(CP, C, CP):
                v = tl.minimum(v, tl.min(tl.min(tl.load(p_ptr + offs + c0, mask=rmask[:, None] & (c0 + c[None, :] < C),
                                                        other=float("inf")), axis=1), axis=0))
        return v.to(tl.float64)

    @triton.jit
    def _put(acc, idx, at: tl.constexpr, value):
        return acc + tl.where(idx == at, value, 0.0)

    @triton.jit(do_not_specialize=("B", "C", "n_out"))
    def _finish(p2_ptr, raw_ptr, loss_ptr, scale_ptr, layout_ptr, B, C, n_out, global_count, max_len,
                L: tl.constexpr, N_RULES: tl.constexpr, AGG: tl.constexpr, HAS_GLOBAL: tl.constexpr,
                CP: tl.constexpr, RB: tl.constexpr, NRAW: tl.constexpr):
        """Pass 3 (one program): rows, then the batch, in fp64 (raw quantities at the indices of
        ``_R``); writes the first ``n_out`` to ``raw_ptr`` in the metrics' layout: raw_ptr[j] =
        raw[layout_ptr[j]] (a runtime int32 vector: the layout is data, not a specialisation)."""
        idx = tl.arange(0, NRAW)
        acc = tl.zeros([NRAW], dtype=tl.float64)
        hi = tl.full([NRAW], -float("inf"), tl.float64)  # running maxima (and −minima)
        for b0 in range(0, B, RB):
            rows = b0 + tl.arange(0, RB)
            rmask = rows < B
            n_in = _tile(p2_ptr, 0, rows, rmask, B, C, CP)
            n_val = _tile(p2_ptr, 1, rows, rmask, B, C, CP)
            n_keep = _tile(p2_ptr, 15, rows, rmask, B, C, CP)
            loss_r = _tile(p2_ptr, 23, rows, rmask, B, C, CP)
            den_r = _tile(p2_ptr, 24, rows, rmask, B, C, CP)
            for s in tl.static_range(0, 28):  # plain sums over rows and chunks → raw[2 + s]
                if s != 13 and s != 14 and s != 18 and s != 19:
                    acc = _put(acc, idx, 2 + s, tl.sum(_tile(p2_ptr, s, rows, rmask, B, C, CP), axis=0))
            for s in tl.static_range(28, 37):  # deferred checks and mult_err → raw[2 + s]
                acc = _put(acc, idx, 2 + s, tl.sum(_tile(p2_ptr, s, rows, rmask, B, C, CP), axis=0))
            hi = tl.maximum(hi, tl.where(idx == 15, _tile_extreme(p2_ptr, 13, rows, rmask, B, C, CP, True), -float("inf")))
            hi = tl.maximum(hi, tl.where(idx == 16, _tile_extreme(p2_ptr, 14, rows, rmask, B, C, CP, True), -float("inf")))
            hi = tl.maximum(hi, tl.where(idx == 20, _tile_extreme(p2_ptr, 18, rows, rmask, B, C, CP, True), -float("inf")))
            hi = tl.maximum(hi, tl.where(idx == 21, -_tile_extreme(p2_ptr, 19, rows, rmask, B, C, CP, False), -float("inf")))
            # row statistics over rows with a valid token (docs/specification.md §7)
            has = rmask & (n_val > 0.0)
            safe_n = tl.maximum(n_val, 1.0)
            seq = tl.minimum(tl.maximum(_tile(p2_ptr, 3, rows, rmask, B, C, CP), -L), L)
            mean_tr = _tile(p2_ptr, 4, rows, rmask, B, C, CP) / safe_n
            mean_ro = _tile(p2_ptr, 5, rows, rmask, B, C, CP) / safe_n
            diff = _tile(p2_ptr, 6, rows, rmask, B, C, CP) / safe_n
            acc = _put(acc, idx, 39, tl.sum(tl.where(has, 1.0, 0.0), axis=0))
            acc = _put(acc, idx, 40, tl.sum(tl.where(has, tl.exp(2.0 * seq) - 1.0, 0.0), axis=0))
            acc = _put(acc, idx, 41, tl.sum(tl.where(has, tl.exp(_clamp(-mean_tr, _EXP_LIMIT)), 0.0), axis=0))
            acc = _put(acc, idx, 42, tl.sum(tl.where(has, tl.exp(_clamp(-mean_ro, _EXP_LIMIT)), 0.0), axis=0))
            acc = _put(acc, idx, 43, tl.sum(tl.where(has, diff, 0.0), axis=0))
            acc = _put(acc, idx, 44, tl.sum(tl.where(has, tl.exp(_clamp(diff, _EXP_LIMIT)), 0.0), axis=0))
            in_rows = rmask & (n_in > 0.0)
            acc = _put(acc, idx, 45, tl.sum(tl.where(in_rows, 1.0, 0.0), axis=0))
            acc = _put(acc, idx, 46, tl.sum(tl.where(in_rows & (n_in - n_keep > 0.0), 1.0, 0.0), axis=0))
            acc = _put(acc, idx, 47, tl.sum(n_in - n_keep, axis=0))
            # the aggregation's numerator and count (docs/specification.md §5)
            if AGG == 1:
                num = tl.sum(tl.where(rmask, loss_r / tl.maximum(den_r, 1.0), 0.0), axis=0)
            elif AGG == 3:
                num = tl.sum(loss_r, axis=0) / max_len
            else:
                num = tl.sum(loss_r, axis=0)
            if AGG == 0:
                cnt = tl.sum(den_r, axis=0)
            else:
                cnt = tl.sum(tl.where(rmask & (den_r > 0.0), 1.0, 0.0), axis=0)
            acc = _put(acc, idx, 48, num)
            acc = _put(acc, idx, 49, cnt)
            for i in tl.static_range(N_RULES):
                removed = _tile(p2_ptr, 37 + i, rows, rmask, B, C, CP)
                acc = _put(acc, idx, 52 + 2 * i, tl.sum(removed, axis=0))
                acc = _put(acc, idx, 53 + 2 * i, tl.sum(tl.where(removed > 0.0, 1.0, 0.0), axis=0))
        count = tl.sum(tl.where(idx == 49, acc, 0.0), axis=0)
        if HAS_GLOBAL:
            count = count * 0.0 + global_count
        acc = tl.where(idx == 51, -tl.sum(tl.where(idx == 5, acc, 0.0), axis=0), acc)
        # Σw = Σ(w − 1) + n and Σw² = Σ(w − 1)² + 2Σ(w − 1) + n, in fp64 (see _tokens)
        n_keep_all = tl.sum(tl.where(idx == 17, acc, 0.0), axis=0)
        sum_d = tl.sum(tl.where(idx == 18, acc, 0.0), axis=0)
        sum_d2 = tl.sum(tl.where(idx == 19, acc, 0.0), axis=0)
        acc = tl.where(idx == 18, sum_d + n_keep_all, acc)
        acc = tl.where(idx == 19, sum_d2 + 2.0 * sum_d + n_keep_all, acc)
        acc = tl.where(idx == 49, count, acc)
        loss = tl.sum(tl.where(idx == 48, acc, 0.0), axis=0) / tl.maximum(count, 1.0)
        acc = _put(acc, idx, 50, loss)
        acc = tl.where(idx == 1, 1.0, acc)  # raw[0] = 0, raw[1] = 1: constants for the layout
        acc = tl.where((idx == 15) | (idx == 16) | (idx == 20), hi, acc)
        acc = tl.where(idx == 21, -hi, acc)
        for j in range(0, n_out):
            at = tl.load(layout_ptr + j)
            tl.store(raw_ptr + j, tl.sum(tl.where(idx == at, acc, 0.0), axis=0))
        tl.store(loss_ptr, loss.to(tl.float32))
        # ∂L/∂ℓ_bt per row: row_scale_b / max(count, 1)
        for b0 in range(0, B, RB):
            rows = b0 + tl.arange(0, RB)
            rmask = rows < B
            if AGG == 1:
                den_r = _tile(p2_ptr, 24, rows, rmask, B, C, CP)
                row_scale = 1.0 / tl.maximum(den_r, 1.0)
            elif AGG == 3:
                row_scale = tl.full([RB], 1.0, tl.float64) / max_len
            else:
                row_scale = tl.full([RB], 1.0, tl.float64)
            tl.store(scale_ptr + rows, (row_scale / tl.maximum(count, 1.0)).to(tl.float32), mask=rmask)


# =============================================================================== host side
# raw vector written by _finish: raw[2 + s] is token slot s summed over the batch (maxima and the
# minimum for slots 13, 14, 18, 19), then row statistics, the aggregation, and two per rule
_R = {"zero": 0, "one": 1, **{name: 2 + i for i, name in enumerate(_TOKEN_SLOTS)},
      "n_rows": 39, "chi2_seq": 40, "ppl_train": 41, "ppl_rollout": 42, "log_ppl_diff": 43, "ppl_ratio": 44,
      "n_input_rows": 45, "masked_rows": 46, "masked_tokens": 47, "loss_num": 48, "loss_count": 49,
      "loss_value": 50, "neg_sum_lr": 51}
_R_RULES = 52
_CHECKS = ("n_input", "bad_mask", "pos_lp", "pos_old", "pos_roll", "nf_lp", "nf_old", "nf_roll", "nf_adv")


def _layout(spec: Spec, rule_names: tuple[str, ...], has_global: bool) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """(key, reducer, raw indices of its partial sums) for every metric the reference records."""
    r = _R
    out: list[tuple[str, str, tuple[int, ...]]] = []
    if spec.corrected:
        n, rows = r["n_valid"], r["n_rows"]
        out += [
            ("nonfinite_tokens", "sum", (r["n_bad"], r["one"])), ("valid_tokens", "sum", (n, r["one"])),
            ("kl_k1", "mean", (r["neg_sum_lr"], n)), ("kl_k3", "mean", (r["k3"], n)),
            ("chi2_token", "mean", (r["chi2"], n)), ("chi2_seq", "mean", (r["chi2_seq"], rows)),
            ("ppl_train", "mean", (r["ppl_train"], rows)), ("ppl_rollout", "mean", (r["ppl_rollout"], rows)),
            ("log_ppl_diff", "mean", (r["log_ppl_diff"], rows)), ("ppl_ratio", "mean", (r["ppl_ratio"], rows)),
            ("abs_logp_diff_mean", "mean", (r["abs_lr"], n)), ("abs_logp_diff_max", "max", (r["max_abs_lr"], n)),
            ("mult_prob_error", "mean", (r["mult_err"], n)),
            ("prob_diff_mean", "mean", (r["prob_diff"], n)), ("prob_diff_max", "max", (r["max_prob_diff"], n)),
            ("ess", "ess", (r["rho"], r["rho2"], n)),
        ]
        for i, name in enumerate(rule_names):
            out += [(f"reject/{name}/masked_fraction", "mean", (_R_RULES + 2 * i, r["n_input"])),
                    (f"reject/{name}/masked_fraction_seq", "mean", (_R_RULES + 2 * i + 1, r["n_input_rows"]))]
        out += [("masked_fraction", "mean", (r["masked_tokens"], r["n_input"])),
                ("masked_fraction_seq", "mean", (r["masked_rows"], r["n_input_rows"]))]
        if spec.weight is not None:
            out += [("fraction_above_high", "mean", (r["above"], r["units"])),
                    ("fraction_below_low", "mean", (r["below"], r["units"]))]
        k = r["n_keep"]
        out += [("is_mean", "mean", (r["w_sum"], k)), ("is_std", "std", (r["w_sum"], r["w2_sum"], k)),
                ("is_min", "min", (r["w_min"], k)), ("is_max", "max", (r["w_max"], k)),
                ("is_ess", "ess", (r["w_sum"], r["w2_sum"], k))]
    k = r["n_keep"]
    if spec.kind in (0, 1):
        out.append(("clip_fraction", "mean", (r["clip"], k)))
    if spec.kind == 0 and spec.dual:
        out.append(("dual_clip_fraction", "mean", (r["dual"], k)))
    if spec.has_old:
        out.append(("approx_kl", "mean", (r["approx_kl"], k)))
    out.append(("loss", "sum", (r["loss_value"], r["one"])) if has_global else
               ("loss", "mean", (r["loss_num"], r["loss_count"])))
    return tuple(out)


def _index(layout) -> tuple[int, ...]:
    """The raw quantities ``_finish`` writes, in order: every metric's partial sums, then the checks."""
    return tuple(i for _, _, parts in layout for i in parts) + tuple(_R[name] for name in _CHECKS)


def _check_message(spec: Spec, shape: tuple[int, ...], counts: list[float]) -> str | None:
    """The reference's refusal for these counts (the order of ``_CHECKS``), or None."""
    n_input, bad_mask, pos_lp, pos_old, pos_roll, nf_lp, nf_old, nf_roll, nf_adv = counts
    old_name = "old_logprobs"
    if bad_mask:
        return f"mask must be 0/1 (1 = token counts); found {int(bad_mask)} other value(s)"
    for name, count in (("logprobs", pos_lp), (old_name, pos_old), ("rollout_logprobs", pos_roll)):
        if count:
            return (f"{name} has {int(count)} positive log-prob(s) on valid tokens: a log-prob is ≤ 0, so the "
                    "upstream gather or sign is wrong")
    if not n_input:
        return f"mask {shape} has no valid token: nothing to train on"
    if not spec.corrected or spec.nonfinite == 0:
        for name, count in (("logprobs", nf_lp), (old_name, nf_old), ("rollout_logprobs", nf_roll),
                            ("advantages", nf_adv)):
            if count:
                fix = ("fix the source or set correction.nonfinite to mask_token, mask_sequence or neutral"
                       if spec.corrected else "fix the source, or pass a correction with a nonfinite policy")
                return f"{name} has {int(count)} non-finite value(s) on valid tokens; {fix}"
    return None


class _Structure(NamedTuple):
    """What a plan's structure fixes — the spec and the rules' names, never a bound's number — worked
    out once per structure (``_structure``): configs that differ only in their bounds (a data-chosen
    cut, one config per optimizer step) share it, shapes and device copies included."""

    spec: Spec
    layout: tuple[tuple[str, str, tuple[int, ...]], ...]
    layout_global: tuple[tuple[str, str, tuple[int, ...]], ...]
    index: tuple[int, ...]
    index_global: tuple[int, ...]
    flat: FlatLayout  # Metrics.from_flat's layout of ``layout`` (built once)
    flat_global: FlatLayout
    n_raw: int  # entries of _finish's raw vector, a power of two
    launch: tuple[dict, dict, dict]  # the constexprs of (every kernel, _tokens, _finish) that the spec fixes
    shapes: dict  # (B, T, reduce, old_in, global, max_len, BLOCK) → _Shape: made once per shape
    device_index: dict  # device → (index int32, index_global int32): copied there once


class _Plan(NamedTuple):
    """One config's plan: its structure (shared) and its bounds, the only part that is per config."""

    structure: _Structure
    bounds: tuple[float, ...]  # bounds_of(config): runtime values of the kernels
    device_consts: dict  # device → (bounds fp32, index int32, index_global int32)


class _Shape(NamedTuple):
    """What one batch shape fixes for a plan, worked out once (plain integer arithmetic): where each
    part of the one workspace starts, and every launch's keyword arguments (grid and constexprs)."""

    C: int  # chunks per row
    n_buffer: int  # fp64 elements of the workspace
    at_coef: int  # fp32 offsets of the parts after the fp64 partial sums at its start
    at_scale: int
    at_loss: int
    at_tok: int
    at_den: int
    p1_shape: tuple[int, int, int] | None  # the row pre-pass's partials (their own allocation) or None
    rows_kw: dict
    tokens_kw: dict
    finish_kw: dict
    max_len: float


@functools.lru_cache(maxsize=256)
def _structure(spec: Spec, names: tuple[str, ...]) -> _Structure:
    """The metric layouts, launch constexprs (and, as they are used, shapes and device copies) of a
    spec with these rule names, made once per (spec, names): a bound that changes every step changes
    neither. (``spec.has_old`` holds whether π_old comes in.)"""
    layout, layout_global = _layout(spec, names, False), _layout(spec, names, True)
    n_raw = 1 << (_R_RULES + 2 * len(spec.rules) - 1).bit_length()
    w = spec.weight or (0, 0)
    launch = ({"CORRECTED": spec.corrected, "ANCHOR": spec.anchor, "L": spec.log_clamp, "RULES": spec.rules,
               "SEQUENTIAL": spec.sequential},
              {"NONFINITE": spec.nonfinite, "HAS_WEIGHT": spec.weight is not None, "WLEVEL": w[0], "WMODE": w[1],
               "FIXED": spec.fixed_denominator, "KIND": spec.kind, "CP": _CP},
              {"L": spec.log_clamp, "N_RULES": len(spec.rules), "AGG": spec.agg, "CP": _CP, "RB": _RB,
               "NRAW": n_raw, "num_warps": 16})  # _finish is one program: all its warps
    return _Structure(spec, layout, layout_global, _index(layout), _index(layout_global),
                      FlatLayout.of(tuple((k, r) for k, r, _ in layout)),
                      FlatLayout.of(tuple((k, r) for k, r, _ in layout_global)), n_raw, launch, {}, {})


@per_config(256)
def _plan(config: LossConfig, has_old: bool) -> _Plan | None:
    """``config``'s plan, worked out once per config object (``per_config``): its spec, the shared
    structure of that spec, and its bounds. Under a data-chosen bound each optimizer step brings a new
    config; its plan then costs ``spec_of`` + ``bounds_of`` and one small copy of the bounds to the
    device, the structure being found, not rebuilt."""
    spec = spec_of(config, has_old)
    if spec is None:
        return None
    names = tuple(rule_name(i, r) for i, r in enumerate(config.correction.reject)) if spec.corrected else ()
    return _Plan(_structure(spec, names), bounds_of(config), {})


def _device_consts(plan: _Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's bounds (fp32: ``bounds_tensor``, one copy per distinct vector) and its structure's
    metric layouts (int32, copied once per structure) on ``device``: a data-chosen bound changes the
    values of a vector, never the kernels nor the layouts."""
    consts = plan.device_consts.get(device)
    if consts is None:
        structure = plan.structure
        index = structure.device_index.get(device)
        if index is None:
            index = structure.device_index[device] = (
                torch.tensor(structure.index, dtype=torch.int32, device=device),
                torch.tensor(structure.index_global, dtype=torch.int32, device=device))
        consts = plan.device_consts[device] = (bounds_tensor(plan.bounds, device), *index)
    return consts


def _aligned(n: int) -> int:
    """``n`` fp32 elements rounded up to 16 bytes: where the next sub-buffer may start."""
    return (n + 3) & ~3


def _shape(structure: _Structure, B: int, T: int, unreduced: bool, old_in: bool, has_global: bool,
           max_len: int | None) -> _Shape:
    """The structure's ``_Shape`` for a [B, T] batch, made on first use (shared by every config of it).
    One workspace holds the per-chunk partial sums (fp64: sums such as Σ(w − 1)² feed differences of
    moments — is_std — and ρ² passes fp32's range past log ρ = 44), the derivative, the backward scale,
    the loss and, unreduced, the per-token loss and its denominator; each part starts 16-byte aligned
    whatever B, T and C (a pointer's alignment is a specialisation of the kernels: parts misaligned for
    some shapes compiled them again)."""
    key = (B, T, unreduced, old_in, has_global, max_len, BLOCK)  # BLOCK: a test's override of the size classes
    found = structure.shapes.get(key)
    if found is not None:
        return found
    spec = structure.spec
    block = _block(B, T)
    C = -(-T // block)
    n_rules = len(spec.rules)
    n_p2 = 2 * (_S_RULES + n_rules) * B * C  # in fp32 elements: the fp64 part at offset 0
    at_coef = _aligned(n_p2)
    at_scale = _aligned(at_coef + B * T)
    at_loss = _aligned(at_scale + B)
    at_tok = _aligned(at_loss + 1)
    at_den = _aligned(at_tok + B * T)
    end = at_den + B * T if unreduced else at_tok
    grid = (B, C)
    common = {**structure.launch[0], "OLD_IN": old_in, "BLOCK": block, "num_warps": 16 if block > 1024 else 4,
              "grid": grid, "warmup": False}
    found = _Shape(
        C, (end + 1) // 2, at_coef, at_scale, at_loss, at_tok, at_den,
        (2 * n_rules + 3, B, C) if spec.needs_rows else None,
        common, {**common, **structure.launch[1], "UNREDUCED": unreduced},
        {**structure.launch[2], "HAS_GLOBAL": has_global, "grid": (1,), "warmup": False},
        float(max_len if max_len is not None else T))
    if len(structure.shapes) > 64:
        structure.shapes.clear()
    structure.shapes[key] = found
    return found


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The guard every launch runs under: Triton launches on the *current* CUDA device and its current
    stream, so a batch on cuda:1 while cuda:0 is current (the default, and what an in-process vLLM
    sets) fails with "Pointer argument cannot be accessed from Triton" or races another stream.
    Makes the tensors' device current for the launch; nothing to do off CUDA (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else _NO_GUARD


_NO_GUARD = contextlib.nullcontext()  # reusable: nothing to enter


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, or a copy whose last dimension is contiguous, and its row stride): the kernels index rows
    by their stride."""
    row, col = x.stride()
    if col != 1:
        x = x.detach().contiguous()
        row = x.stride(0)
    return x, row


def policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config: LossConfig, reduce: bool,
                ref_logprobs: torch.Tensor | None = None):
    """The Triton rung of ``policy_loss``; None hands the call to the next rung.

    Returns None on the CPU without ``TRITON_INTERPRET=1`` (Triton compiles for GPUs only), when
    the batch holds something the reference must refuse (CPU only — on a GPU that refusal is
    raised by ``Metrics.to_dict``), or when anchor 'old' comes without ``old_logprobs``.
    """
    cuda = mask.is_cuda
    if triton is None or (not cuda and not _interpreted()):
        return None
    corr = config.correction
    plan = _plan(config, old_logprobs is not None)
    if plan is None:
        return None
    structure = plan.structure
    spec = structure.spec
    if spec.corrected and corr.anchor == "old" and old_logprobs is None:
        return None
    global_count = config.global_tokens if config.agg == "token-mean" else config.global_seqs
    shape = mask.shape
    # an empty batch ([2, 0]) has no valid token (and no block to launch): the reference's message
    if len(shape) != 2 or 0 in shape or logprobs.shape != shape or advantages.shape != shape \
            or not (logprobs.is_floating_point() and advantages.is_floating_point()) or any(
            t is not None and (t.shape != shape or not t.is_floating_point()) for t in (old_logprobs, rollout_logprobs)):
        validate_inputs(mask, logprobs=logprobs, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
                        advantages=advantages)  # raises the reference's message (shapes and dtypes: no sync)
    B, T = shape
    old_in = old_logprobs is not None and not (spec.corrected and corr.anchor == "rollout")
    unreduced = not reduce
    plan_shape = _shape(structure, B, T, unreduced, old_in, global_count is not None, config.max_len)
    # the kernels read pointers and strides: no detach needed (nothing they do enters autograd)
    lp, s_lp = _rows(logprobs)
    old, s_old = _rows(old_logprobs) if old_in else (lp, s_lp)
    roll, s_roll = _rows(rollout_logprobs) if spec.corrected else (lp, s_lp)
    m, s_m = _rows(mask)
    adv = advantages
    device = logprobs.device
    bounds, index, index_global = _device_consts(plan, device)
    n_flat = len(structure.index)  # a tuple's length (a tensor's len() goes through torch's Python layer)
    if global_count is not None:
        index, n_flat = index_global, len(structure.index_global)
    # one workspace (``_shape``), its fp32 parts views of it; the fp64 partial sums are its start
    # (the kernels take a pointer: no view needed). The metrics' vector is its own allocation:
    # the metrics outlive the step's buffers (which a view would keep alive).
    p2 = torch.empty(plan_shape.n_buffer, dtype=torch.float64, device=device)
    buffer = p2.view(torch.float32)
    coef = buffer.as_strided((B, T), (T, 1), plan_shape.at_coef)
    scale = buffer.as_strided((B, 1), (1, 1), plan_shape.at_scale)
    loss = buffer.as_strided((), (), plan_shape.at_loss)
    flat = torch.empty(n_flat, dtype=torch.float64, device=device)  # every metric's partial sums, then the checks
    if unreduced:
        per_token = buffer.as_strided((B, T), (T, 1), plan_shape.at_tok)
        den = buffer.as_strided((B, T), (T, 1), plan_shape.at_den)
    else:
        per_token = den = coef
    strides = (s_lp, s_old, s_roll, *adv.stride(), s_m)
    with on_device(device):
        if plan_shape.p1_shape is not None:
            p1 = torch.empty(plan_shape.p1_shape, dtype=torch.float32, device=device)
            _row_stats.run(lp, old, roll, adv, m, p1, bounds, B, T, plan_shape.C, *strides,
                           **plan_shape.rows_kw)
        else:
            p1 = p2
        _tokens.run(lp, old, roll, adv, m, p1, p2, coef, per_token, den, bounds, B, T, plan_shape.C,
                    *strides, **plan_shape.tokens_kw)
        _finish.run(p2, flat, loss, scale, index, B, plan_shape.C, n_flat,
                    float(global_count or 0.0), plan_shape.max_len, **plan_shape.finish_kw)

    if not cuda:
        if _check_message(spec, tuple(shape), flat[-len(_CHECKS):].tolist()) is not None:
            return None  # the reference raises its exact message (with the first positions)
        metrics = Metrics.from_flat(flat, structure.flat_global if global_count is not None else structure.flat)
    else:
        metrics = Metrics.from_flat(flat, structure.flat_global if global_count is not None else structure.flat)
        metrics.defer_check(flat[-len(_CHECKS):], functools.partial(_check_message, spec, tuple(shape)))
    if unreduced:
        return CoefTokens.apply(logprobs, per_token, coef), den, metrics
    return CoefLoss.apply(logprobs, loss, coef, scale), metrics
