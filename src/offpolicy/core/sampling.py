"""The sampling contract (``SamplingConfig``) and the trainer-side log-probs on the sampler's truncated support
(docs/specification.md §6).

An engine that samples with temperature τ, top-k and top-p reports *processed* log-probs:
the log-softmax of logits/τ renormalised over the kept tokens (vLLM ``processed_logprobs``).
For the ratio π/μ to compare like with like, the trainer must compute π the same way:

    z = logits / τ
    top-k:  keep tokens with z ≥ the k-th largest z (ties kept)
    top-p:  sort the top-k-renormalised probabilities descending; keep the smallest prefix
            whose mass reaches p (the token that crosses p is kept; at least one token). Equal
            probabilities are ordered by token id, the larger id first (``top_p_keep``)
    min-p:  keep tokens whose probability is at least min_p × the most likely token's
    log π̃(v) = z_v − logsumexp_{kept} z   on kept tokens, −inf elsewhere

min-p's place in that order differs by engine, and with top_p < 1 and min_p > 0 the kept sets differ:
vLLM applies min-p to the whole distribution first, then top-k/top-p over what is left (``min_p_first``);
transformers' warpers, and with them the hf engine, apply top-k → top-p → min-p (``min_p_last``). min-p and
top-k commute (both cut at a logit relative to the largest), top-p does not: after min-p it takes its nucleus of
the renormalised remainder. The kept set follows the engine that sampled: ``SamplingConfig.min_p_order``, set
from the engine (``offpolicy.engines.min_p_order``) and carried with the rollouts' sampling config.

``outside_mass`` = 1 − Σ_{kept} softmax(z): how much of the untruncated distribution the
sampler could never produce — large values mean the ratio is being taken on a small support.

The rules of the sampling values are written once, in ``RULES``: ``SamplingConfig`` (what the engines and the
trainer's head take), ``TrainConfig``'s and ``DiagnoseConfig``'s flat keys (``temperature``, ``top_p``,
``top_k``, typed with ``Temperature``, ``TopP``, ``TopK``) and ``renormalize_logprobs`` all check them there.
top_k = -1 is "no top-k"; 0 is refused (vLLM and transformers also read 0 as off — one spelling here, so
that "is the support truncated?" has one answer, ``SamplingConfig.truncates``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
from pydantic import AfterValidator, Field, model_validator

from offpolicy.core.config import _Strict
from offpolicy.core.metrics import Metrics

# field → (the rule, what a value must be): the one statement of each rule
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (lambda n: n >= 1, "a number of tokens ≥ 1"),
    "temperature": (lambda t: math.isfinite(t) and t > 0,
                    "a finite number > 0 (greedy decoding, temperature 0, samples no distribution whose log-probs "
                    "a ratio could compare; a small value such as 0.1 samples almost greedily)"),
    "top_p": (lambda p: 0 < p <= 1, "in (0, 1]; 1 keeps the whole distribution"),  # NaN fails too
    "top_k": (lambda k: k == -1 or k >= 1,
              "-1 (no top-k; vLLM also reads 0 as off, offpolicy takes -1 only) or a number of tokens ≥ 1"),
    "min_p": (lambda p: 0 <= p < 1, "in [0, 1); 0 is off (min-p keeps the tokens with at least min_p × the most "
              "likely token's probability)"),  # NaN fails too
}
MIN_P_ORDERS = ("min_p_first", "min_p_last")  # vLLM's order; transformers' (and the hf engine's)
# the most top log-probs an engine is asked for a token: vLLM's default --max-logprobs (ModelConfig.max_logprobs,
# 0.32), above which a request is refused — train's score_centering_head and diagnose's --head-logprobs
HEAD_LOGPROBS_MAX = 20
DIAGNOSE_MAX_TOKENS = 64  # diagnose's response limit where sampling.max_tokens is unset (SamplingSettings)


def broken_rule(**values: Any) -> tuple[str, str] | None:
    """The first of ``values`` (field=value, fields of ``RULES``) that breaks its rule, as (field, what it must
    be); None when every one holds."""
    for name, value in values.items():
        holds, must = RULES[name]
        if not holds(value):
            return name, must
    return None


def truncates(top_k: int, top_p: float, min_p: float) -> bool:
    """The one answer to "is the sampler's support truncated?": top-k on (``top_k`` ≥ 1), top-p < 1 or min-p > 0
    (``SamplingConfig.truncates``, ``SamplingSettings.truncates``)."""
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


def _rule(name: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if not RULES[name][0](value):
            raise ValueError(f"expected {RULES[name][1]}")
        return value
    return AfterValidator(check)


# the sampling keys' types (SamplingSettings: train's ``sampling.top_p=0.9``, diagnose's ``--top-p``)
MaxTokens = Annotated[int, _rule("max_tokens")]
Temperature = Annotated[float, _rule("temperature")]
TopP = Annotated[float, _rule("top_p")]
TopK = Annotated[int, _rule("top_k")]
MinP = Annotated[float, _rule("min_p")]


class SamplingConfig(_Strict):
    """What an engine samples with and the trainer renormalises over (module doc; docs/specification.md §6):
    the response limit, the temperature, top-p and top-k, each checked by its rule in ``RULES``. Frozen."""

    max_tokens: MaxTokens = Field(16, description="response limit, in tokens")
    temperature: Temperature = Field(1.0, description="τ: the logits are divided by it before top-k/top-p")
    top_p: TopP = Field(1.0, description="nucleus mass in (0, 1]; 1 keeps everything")
    top_k: TopK = Field(-1, description="tokens kept by top-k; -1 = no top-k")
    min_p: MinP = Field(0.0, description="min-p in [0, 1): keep the tokens with at least min_p × the most likely "
                        "token's probability; 0 = off")
    min_p_order: Literal["min_p_first", "min_p_last"] = Field(
        "min_p_last", description="where min-p sits among the truncations, as the engine that sampled applies it: "
        "min_p_first (vLLM: min-p, then top-k/top-p over what is left), min_p_last (transformers and the hf "
        "engine: top-k → top-p → min-p); matters only with min_p > 0 and top_p < 1")
    head_logprobs: int = Field(0, ge=0, le=1024, description="k > 0: the engine also returns the k most likely ids "
                               "of each token's sampling distribution with their log μ (``Rollouts.head``: score "
                               "centering's head support); changes nothing the engine samples")

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_finite(cls, data: Any) -> Any:
        """Not _Strict's blanket refusal: each field's rule refuses NaN and ±inf in its own words."""
        return data

    @property
    def truncates(self) -> bool:
        """Whether the sampler's support is truncated: top-k on (``top_k`` ≥ 1) or top-p < 1. Then the engine's
        kept set (``Rollouts.kept``) is worth recording and replaying and the outside-mass metrics apply. A top-k
        of at least the vocabulary counts as on (the config does not know the vocabulary); it keeps every token,
        as ``renormalize_logprobs`` computes it, and leaves no mass outside."""
        return truncates(self.top_k, self.top_p, self.min_p)

    def support(self) -> dict[str, Any]:
        """The arguments ``renormalize_logprobs`` takes from this config: the sampler's support, as one bundle."""
        return {"top_p": self.top_p, "top_k": self.top_k, "temperature": self.temperature, "min_p": self.min_p,
                "min_p_order": self.min_p_order}


class SamplingSettings(_Strict):
    """What the engine samples with and the trainer renormalises over, as a user sets it — ``sampling.*`` in
    ``offpolicy train``, ``--max-tokens`` / ``--temperature`` / ``--top-p`` / ``--top-k`` / ``--min-p`` in
    ``offpolicy diagnose``; each value checked by its rule in ``RULES``. ``config`` makes the engines' contract
    (``SamplingConfig``) of it, with what the run adds: the resolved response limit, min-p's place (the engine's)
    and the head the engine returns."""

    max_tokens: MaxTokens | None = Field(
        None, description="response limit, in tokens. Unset: train = the task's own (10 for reverse/addition, "
        "max_len + 10 = 160 for walk, 128 for count, 256 for task=dataset); diagnose = "
        f"{DIAGNOSE_MAX_TOKENS} (walk's answers run to 150 tokens: set 160)")
    temperature: Temperature = Field(1.0, description="τ, > 0: the engine's logits are divided by it")
    top_p: TopP = Field(1.0, description="nucleus mass in (0, 1]; 1 keeps everything")
    top_k: TopK = Field(-1, description="tokens kept by top-k; -1 = no top-k (0 is refused: one spelling of off)")
    min_p: MinP = Field(0.0, description="min-p in [0, 1): keep the tokens with at least min_p × the most likely "
                        "token's probability; 0 = off. Where it sits among the truncations follows the engine "
                        "(vLLM, in-process or a server: first; hf and an SGLang server: after top-k and top-p)")

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_finite(cls, data: Any) -> Any:
        """Not _Strict's blanket refusal: each field's rule refuses NaN and ±inf in its own words."""
        return data

    @property
    def truncates(self) -> bool:
        """``SamplingConfig.truncates`` of these values (``truncates``)."""
        return truncates(self.top_k, self.top_p, self.min_p)

    def config(self, max_tokens: int | None = None, head_logprobs: int = 0,
               min_p_order: str = "min_p_last") -> SamplingConfig:
        """The engines' contract: these values, ``max_tokens`` where this section leaves it unset, min-p's place
        among the truncations (the sampling engine's: ``offpolicy.engines.min_p_order``) and the head to return."""
        limit = self.max_tokens if self.max_tokens is not None else max_tokens
        if limit is None:
            raise ValueError("sampling.max_tokens is unset and the command gave no default for it")
        return SamplingConfig(max_tokens=limit, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, min_p_order=min_p_order, head_logprobs=head_logprobs)


def renormalize_logprobs(
    logits: torch.Tensor,
    top_p: float = 1.0,
    top_k: int = -1,
    temperature: float = 1.0,
    *,
    min_p: float = 0.0,
    min_p_order: str = "min_p_last",
    return_outside_mass: bool = False,
    keep: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[..., V]`` (fp32; float64 for float64 logits) over the top-k/top-p support of
    ``logits / temperature``. The trainer's head (``offpolicy.policy.head``) applies it to each chunk
    of response tokens, so this function is the one definition of log π̃ on the sampler's support.

    Args:
        logits: ``[..., V]`` raw logits (any float dtype).
        top_p: nucleus mass in (0, 1]; 1 keeps everything.
        top_k: number of tokens to keep; -1 (or ≥ V) keeps everything.
        temperature: > 0.
        min_p: in [0, 1); 0 keeps everything (module doc).
        min_p_order: ``min_p_last`` (transformers, the hf engine) or ``min_p_first`` (vLLM): where min-p sits among
            the truncations (module doc).
        return_outside_mass: also return ``[...]`` mass of the untruncated distribution that
            lies outside the kept support.
        keep: bool ``[..., V]``, the kept set to use instead of recomputing top-k/top-p on these
            logits — the engine's own set, replayed (``offpolicy.core.kept_set``). The formula is the same:
            log π̃(v) = z_v − logsumexp_{keep} z on kept tokens, −inf elsewhere.

    Raises:
        ValueError: a value against its rule (``RULES``): temperature ≤ 0 or not finite, top_p outside (0, 1],
            or top_k = 0 / below -1.
    """
    values = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    broken = broken_rule(**values)
    if broken is not None:
        name, must = broken
        raise ValueError(f"{name} must be {must}; got {values[name]}")
    if min_p_order not in MIN_P_ORDERS:
        raise ValueError(f"min_p_order must be one of {', '.join(MIN_P_ORDERS)}; got {min_p_order!r}")
    # at least fp32 (bf16/fp16 logits are cast up; float64 stays float64, for exactness tests)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [..., V]
    vocab = z.shape[-1]
    if keep is not None:
        if keep.shape != z.shape or keep.dtype != torch.bool:
            raise ValueError(f"keep must be a bool mask of the logits' shape {tuple(z.shape)}; got {keep.dtype} "
                             f"{tuple(keep.shape)}")
        return _masked_logprobs(z, keep, return_outside_mass)
    if (top_k == -1 or top_k >= vocab) and top_p == 1.0 and min_p == 0.0:
        # nothing truncated: the plain log-softmax (the same numbers as the masked path below, which
        # would subtract the same log-sum-exp from an unmasked copy of z), nothing outside the support
        logprobs = z - torch.logsumexp(z, dim=-1, keepdim=True)
        return (logprobs, torch.zeros_like(logprobs[..., 0])) if return_outside_mass else logprobs
    keep = torch.ones_like(z, dtype=torch.bool)
    first = min_p > 0.0 and min_p_order == "min_p_first"
    if first:  # vLLM: on the whole distribution, before top-k/top-p
        keep &= min_p_keep(torch.softmax(z, dim=-1), min_p)
    if 0 < top_k < vocab:
        ranked = z.masked_fill(~keep, float("-inf")) if first else z
        kth = torch.topk(ranked, top_k, dim=-1).values[..., -1:]  # [..., 1]
        keep &= z >= kth
    if top_p < 1.0:
        keep &= top_p_keep(torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1), top_p)
    if min_p > 0.0 and min_p_order == "min_p_last":  # transformers: after top-k and top-p, on their remainder
        keep &= min_p_keep(torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1), min_p)
    return _masked_logprobs(z, keep, return_outside_mass)


def min_p_keep(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """min-p's kept set of ``probs`` ``[..., V]``: the tokens with probability ≥ min_p × the largest, as vLLM
    (``apply_min_p``) and transformers (``MinPLogitsWarper``) compare them, on probabilities; the most likely token
    is always kept."""
    return probs >= min_p * probs.amax(dim=-1, keepdim=True)


def _masked_logprobs(z: torch.Tensor, keep: torch.Tensor, return_outside_mass: bool
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log π̃ = z − logsumexp_{keep} z on ``keep``, −inf elsewhere (and the mass of softmax(z) off ``keep``)."""
    kept_logits = z.masked_fill(~keep, float("-inf"))
    kept_lse = torch.logsumexp(kept_logits, dim=-1, keepdim=True)
    logprobs = kept_logits - kept_lse
    if not return_outside_mass:
        return logprobs
    # Σ_kept softmax(z) = exp(lse_kept − lse_all): one more reduction, no second [..., V] tensor
    inside = (kept_lse - torch.logsumexp(z, dim=-1, keepdim=True)).squeeze(-1).exp()
    return logprobs, (1.0 - inside).clamp(min=0.0)


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus of ``probs`` ``[..., V]`` as a bool mask: in descending order, each token whose mass
    strictly above it is < ``top_p`` (the token that crosses p is kept; the first always is).

    Ties at the cut are broken by token id, the larger id first: the order of a stable ascending sort,
    read backwards — the sort vLLM's and transformers' top-p take (ascending, then drop from the small
    end), which is stable for a real vocabulary on the GPU and on the CPU. The hf engine samples with
    this very function (``engines/hf.py``), so with exactly tied probabilities the trainer keeps the
    tokens the engine kept; a plain descending sort kept the smaller id instead.
    """
    ascending, order = probs.sort(dim=-1, stable=True)  # ties in id order
    descending = ascending.flip(-1)  # ties: the larger id first
    mass_before = descending.cumsum(dim=-1) - descending  # mass strictly above each token
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    # back to ascending order before the scatter: the flip lands on this bool [..., V], not on the int64 order
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted.flip(-1))


def outside_mass_metrics(outside_mass: torch.Tensor, mask: torch.Tensor, metrics: Metrics | None = None) -> Metrics:
    """Record the sampler's truncated-away mass on the tokens that count (issue #9 item 10).

    ``outside_mass`` ``[B, T]`` as returned by ``renormalize_logprobs(..., return_outside_mass=True)``
    at the sampled positions; ``mask`` ``[B, T]``. Adds ``outside_mass`` (mean over the mask) and
    ``outside_mass_max`` to ``metrics`` (a new ``Metrics`` if None) as partial sums, so merged
    micro-batches and all-reduced ranks report the big batch's values.
    """
    metrics = Metrics() if metrics is None else metrics
    keep = mask.bool()
    metrics.mean("outside_mass", outside_mass, keep)
    metrics.max("outside_mass_max", outside_mass, keep)
    return metrics
