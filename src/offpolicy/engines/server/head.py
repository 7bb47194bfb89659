"""The sampler's head from a server: each token's k most likely ids with their log μ
(``SamplingConfig.head_logprobs`` = k), read from the (id, log-prob) pairs an endpoint sent (``read_head``; the
pairs themselves by each protocol's module: ``completions.completion_head_rows``, ``masks.generate_head_rows``),
gathered as ``Rollouts.head`` (``head_from_rows``) and summarised for the report (``head_report``).
"""

from __future__ import annotations

import math
from typing import Any

from offpolicy.core.kept_set import KeptIds
from offpolicy.engines.server.transport import ENDPOINTS, ServerError

# Each token's k most likely ids with their log μ (``SamplingConfig.head_logprobs`` = k): score centering's
# ``head`` support (docs/estimators.md, "Score centering"), what a vLLM server can give where it sends no log-prob
# of its sampling mask's ids (docs/diagnose.md, "The sampler's head from a server").
HEAD_FIELDS = {None: "choices[0].logprobs.top_logprobs", "vllm": "choices[0].logprobs.content[t].top_logprobs"}
# vLLM's API writes −inf (an id outside a truncated sampler's support) and NaN as this number
# (vllm/entrypoints/openai/completion/serving.py, scale_out/token_in_token_out/serving.py, 0.32)
OUTSIDE_SUPPORT = -9999.0
HEAD_TOLERANCE = 1e-4  # the sampled id's entry against its log μ: two copies of one fp32 number, JSON-rounded


def head_asked(engine: str | None, k: int) -> int:
    """How many top log-probs a request asks for a head of ``k``: k on ``/v1/completions``, whose vLLM 0.32 sends
    the sampled id beside the k most likely (k + 1 entries where it ranks lower); k + 1 on
    ``/inference/v1/generate``, whose vLLM 0.32 cuts that list to its first ``logprobs`` entries, the sampled id
    first (``_create_tokens_logprobs``): asked k it would drop the k-th most likely id whenever the sampled one
    ranks below it."""
    return k + 1 if engine == "vllm" else k


def read_head(rows: list[list[tuple[int, Any]]], ids: list[int], values: list[float], k: int, asked: int,
              where: str, field: str, vocab_size: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Each token's head from the (id, log-prob) pairs the server sent for it (``asked`` of them, or ``asked``
    + 1 with the sampled id beside them): the ``k`` most likely (by value, ties by id — the completions API
    sends no rank), ids ascending, log μ aligned; entries at vLLM's −inf stand-in (``OUTSIDE_SUPPORT``: ids a
    truncated sampler cannot draw) left out, as the in-process engines leave them out. Checked: every value a
    finite log-probability ≤ 0, no id sent twice with two values, every id a row of --model's embedding, the
    sampled id's value its log μ (``values``, within ``HEAD_TOLERANCE``) wherever it was sent, and the head's
    probabilities summing to at most 1.

    Raises:
        ServerError: fewer than ``asked`` distinct ids for a token (a short head: never read as a smaller one),
            or a check above fails; each names ``where``, the token and the fix.
    """
    heads_ids, heads_lps = [], []
    limit = math.inf if vocab_size is None else vocab_size
    for t, (pairs, y, sampled) in enumerate(zip(rows, ids, values)):
        seen: dict[int, float] = {}
        for v_id, value in pairs:
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value)
                    or value > HEAD_TOLERANCE):
                raise ServerError(f"{where}, token {t}: {field} holds {value!r} for id {v_id}, not a log-probability "
                                  "≤ 0 (a vLLM --logprobs-mode *_logits returns logits: start it with --logprobs-mode "
                                  "processed_logprobs)")
            if not 0 <= v_id < limit:
                raise ServerError(f"{where}, token {t}: {field} names id {v_id}, outside --model's vocabulary: the "
                                  "server runs another model than --model")
            value = max(float(value), OUTSIDE_SUPPORT)
            if v_id in seen and abs(seen[v_id] - value) > 1e-6:
                raise ServerError(f"{where}, token {t}: {field} gives id {v_id} two log-probs ({seen[v_id]:.6g} and "
                                  f"{value:.6g})")
            seen[v_id] = value
        if len(seen) < asked:
            raise ServerError(f"{where}, token {t}: the server sent {len(seen)} top log-probs, asked for {asked} "
                              f"({field}; --head-logprobs {k}): a short head would be read as the sampler's top-{k}. "
                              "A vLLM server caps them at its --max-logprobs (default 20): restart it with a larger "
                              "one, or ask a smaller --head-logprobs")
        if y in seen and abs(seen[y] - sampled) > HEAD_TOLERANCE:
            raise ServerError(f"{where}, token {t}: {field} gives the sampled id {y} log-prob {seen[y]:.6g}, its "
                              f"log μ is {sampled:.6g}: the top log-probs are not of the distribution it sampled from")
        top = sorted(seen.items(), key=lambda e: (-e[1], e[0]))[:k]
        head = sorted((v_id, value) for v_id, value in top if value > OUTSIDE_SUPPORT)
        mass = math.fsum(math.exp(value) for _, value in head)
        if mass > 1 + 1e-3:
            raise ServerError(f"{where}, token {t}: the head's probabilities sum to {mass:.6g} > 1: {field} is not "
                              "one distribution's top log-probs")
        heads_ids.append([v_id for v_id, _ in head])
        heads_lps.append([value for _, value in head])
    return heads_ids, heads_lps


def head_from_rows(rows: list[dict[str, Any]]) -> KeptIds:
    """The responses' heads as ``KeptIds`` ``[B, longest]`` with ``logprobs`` (``Rollouts.head``): ids ascending
    within a position, log μ aligned, positions past a response's end empty."""
    return KeptIds.from_rows([r["head"][0] for r in rows], [r["head"][1] for r in rows])


def head_report(engine: str | None, rows: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """What the report says about the heads: k, what was asked of which endpoint, how many tokens carried one,
    its mean size, the mean and least head mass Σ_{v∈head} q_v per token (the share of the sampler's mass the
    head covers; head score centering models the rest as a proportional tail), and how often the sampled id was
    in it."""
    sizes = [len(h) for r in rows for h in r["head"][0]]
    masses = [math.fsum(math.exp(v) for v in lps) for r in rows for lps in r["head"][1]]
    inside = sum(y in h for r in rows for y, h in zip(r["ids"], r["head"][0]))
    tokens = len(sizes)
    asked = head_asked(engine, k)
    return {"k": k, "endpoint": ENDPOINTS[engine],
            "asked": (f"sampling_params.logprobs: {asked} (output_mode 'tokens'; the {k} most likely kept)"
                      if engine == "vllm" else f"logprobs: {asked}"),
            "tokens": tokens, "tokens_with_head": sum(1 for n in sizes if n),
            "ids_mean": sum(sizes) / tokens if tokens else 0.0, "ids_min": min(sizes, default=0),
            "mass_mean": math.fsum(masses) / tokens if tokens else 0.0, "mass_min": min(masses, default=0.0),
            "sampled_in_head_share": inside / tokens if tokens else 0.0,
            "logprobs": (f"checked: every token's top-{k} sent, finite and ≤ 0, the sampled id's equal to log μ "
                         f"(within {HEAD_TOLERANCE:g}) where it is among them, each head's mass ≤ 1; ids a truncated "
                         "sampler cannot draw (vLLM's −9999) left out")}
