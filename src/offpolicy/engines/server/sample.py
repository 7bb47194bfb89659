"""Rollouts from an inference server a user already runs (``generate``): one request per prompt, sent concurrently
(``concurrency``) through the transport (``transport``) in the protocol the run asked for — ``/v1/completions``
(``completions``), or an endpoint that returns sampling masks (``masks``) — with each token's head where asked
(``head``); nothing is returned before every response is in and checked.

``offpolicy diagnose --engine-url URL`` measures the engine users deploy (``vllm serve``, ``trl vllm-serve``,
SGLang) rather than one offpolicy starts. Two things hold for every protocol:

* every sampling field is sent explicitly: a vLLM server started with ``--generation-config auto`` (its default)
  fills only the fields a request leaves out from the model's ``generation_config.json``
  (``GENERATION_CONFIG_FIELDS``), so none of its values can change μ behind the report's back
  (``generation_config_note`` says which it holds);
* ``cache_salt`` (vLLM; ``--no-cache-salt`` leaves it out for a server that refuses the field): one fresh salt per
  diagnose run (``run_cache_salt``), so no request is served from prefix-cache KV computed before the run — by
  weights the server held earlier, if a trainer updated them without resetting its cache (NeMo-RL #4018, SkyRL
  #1836). The run's own requests share it, so a prompt's prefix is still prefilled once.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from offpolicy.engines.base import Rollouts, SamplingConfig
from offpolicy.engines.server.completions import PROMPT_CHECK, TEXT_CHECK, TEXT_FORMS, completion_body, parse_completion
from offpolicy.engines.server.concurrency import run_all
from offpolicy.engines.server.head import head_from_rows, head_report
from offpolicy.engines.server.masks import (
    SGLANG_HEAD,
    kept_from_masks,
    mask_report,
    parse_sglang_generate,
    parse_vllm_generate,
    sglang_generate_body,
    vllm_generate_body,
)
from offpolicy.engines.server.transport import ENDPOINTS, ServerConfig, ServerError, client, request_json, served_model

# the sampling fields vLLM (ModelConfig.get_diff_sampling_param) takes from generation_config.json
# for a request that leaves them unset
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                            "frequency_penalty", "max_new_tokens")


def run_cache_salt() -> str:
    """A salt no earlier run used: 128 random bits (vLLM allows ≤ 128 characters, no '/' or '@')."""
    return f"offpolicy-diagnose-{secrets.token_hex(16)}"


def generation_config_note(model_path: Path | None, sent: dict[str, Any]) -> str | None:
    """Which sampling defaults the model's ``generation_config.json`` holds, and that the request
    overrides them (a vLLM server with ``--generation-config auto`` applies them to unset fields)."""
    path = None if model_path is None else Path(model_path) / "generation_config.json"
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    defaults = {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}
    if not defaults:
        return None
    shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
    sending = ", ".join(f"{k}={sent[k]}" for k in GENERATION_CONFIG_FIELDS if k in sent)
    return (f"the model's generation_config.json sets {shown}: a vLLM server started with --generation-config auto "
            f"(its default) applies them to any field a request leaves out; every request here sets {sending} "
            "explicitly, so μ is the stated distribution")


def generate(config: ServerConfig, tokenizer, prompts: list[list[int]], sampling: SamplingConfig, seed: int = 0,
             model_path: Path | None = None, console=None,
             vocab_size: int | None = None) -> tuple[Rollouts, dict[str, Any]]:
    """Sample one response per prompt from the server; returns the rollouts and what the report
    says about the server (URL, model, the request's fields, alignment evidence, notes, seconds).
    Request ``i`` carries seed ``seed · 1000003 + i`` (the vllm engine's per-request seeds);
    ``vocab_size`` is --model's number of embedding rows (a sampled id beyond it is refused).

    With ``sampling.head_logprobs`` = k each request also asks for every token's k most likely ids
    (``completion_body``, ``vllm_generate_body``): they come back as ``Rollouts.head`` and the report's
    ``head`` (``head_report``).

    Raises:
        ServerError: see ``request_json``, ``served_model``, ``parse_completion``; a head asked of SGLang
            (``SGLANG_HEAD``).
    """
    engine = config.sampling_mask
    head = sampling.head_logprobs
    if head and engine == "sglang":
        raise ServerError(SGLANG_HEAD)
    path = ENDPOINTS[engine]
    with client(config) as http:
        card = served_model(config, http)
        name = card["id"]
        salt = run_cache_salt() if config.cache_salt and engine != "sglang" else None  # SGLang takes no salt
        seeds = [seed * 1_000_003 + i for i in range(len(prompts))]
        if engine == "vllm":
            bodies = [vllm_generate_body(name, p, sampling, s, salt) for p, s in zip(prompts, seeds)]
        elif engine == "sglang":
            bodies = [sglang_generate_body(p, sampling, s, config.mask_logprobs) for p, s in zip(prompts, seeds)]
        else:
            bodies = [completion_body(name, p, sampling, s, salt) for p, s in zip(prompts, seeds)]
        results: list[dict[str, Any] | None] = [None] * len(prompts)

        def one(i: int, stop: threading.Event) -> None:
            answer = request_json(config, path, bodies[i], stop, http)
            if engine == "vllm":
                results[i] = parse_vllm_generate(answer, i, prompts[i], tokenizer, vocab_size, head)
            elif engine == "sglang":
                results[i] = parse_sglang_generate(answer, i, prompts[i], tokenizer, vocab_size, config.mask_logprobs)
            else:
                results[i] = parse_completion(answer, i, prompts[i], tokenizer, vocab_size, head)

        start = time.perf_counter()
        run_all(one, len(prompts), config.concurrency, console, name)
    seconds = time.perf_counter() - start
    rows = [r for r in results if r is not None]
    rollouts = Rollouts(prompt_ids=[list(p) for p in prompts], response_ids=[r["ids"] for r in rows],
                        logprobs=[r["logprobs"] for r in rows], finished=[r["finished"] for r in rows], version=0)
    if engine:
        rollouts.kept = kept_from_masks(rows)
    if head:
        rollouts.head = head_from_rows(rows)
    rollouts.validate("server")
    sent = {k: v for k, v in bodies[0].items() if k not in ("prompt", "token_ids", "input_ids", "seed", "cache_salt")}
    if "sampling_params" in sent:  # the per-request seed stays out of the request the report shows
        sent["sampling_params"] = {k: v for k, v in sent["sampling_params"].items()
                                   if k not in ("seed", "sampling_seed")}
    notes = []
    note = generation_config_note(model_path, {**sent, **sent.get("sampling_params", {})})
    if note:
        notes.append(note)
    short = sum(1 for r in rows if not r["finished"] and len(r["ids"]) < sampling.max_tokens)
    if short:
        notes.append(f"{short} response(s) ended before --max-tokens {sampling.max_tokens} without a stop token: the "
                     "server capped max_tokens (its max_model_len or --override-generation-config max_new_tokens); "
                     "the tokens it sampled are measured as they are")
    levels = {r["prompt"] for r in rows}  # the report states the weakest evidence any response gave
    prompt_level = "none" if "none" in levels else "count" if "count" in levels else "ids"
    text_level = ("tokens" if engine == "vllm" and head else "none" if any(r["text"] == "none" for r in rows)
                  else "checked")
    forms = {name: sum(name in r["text_form"] for r in rows) for name in TEXT_FORMS}
    text_check = TEXT_CHECK[text_level]
    if text_level == "checked" and any(forms.values()):
        text_check += " (" + "; ".join(f"{n} response(s) {TEXT_FORMS[k]}" for k, n in forms.items() if n) + ")"
    info = {
        "url": config.url, "served_model": name, "server_model_root": card.get("root"),
        "server_max_model_len": card.get("max_model_len"), "request": sent,
        "seeds": f"request i: seed·1000003 + i (seed {seed})", "requests": len(prompts),
        "concurrency": config.concurrency, "seconds": seconds,
        "endpoint": path,
        "prefix_cache": ("cache_salt: one fresh salt for this run's requests (no KV computed before the run is "
                         "reused)" if salt else "no cache_salt sent (SGLang's /generate takes none): the server may "
                         "reuse prefix-cache KV computed before the run" if engine == "sglang" else
                         "no cache_salt sent (--no-cache-salt): the server may reuse prefix-cache KV computed "
                         "before the run"),
        "sampling_mask": None if not engine else mask_report(engine, rows, config.mask_logprobs),
        "head": head_report(engine, rows, head) if head else None,
        "alignment": {"prompt_ids": PROMPT_CHECK[prompt_level],
                      "response_ids": "verified: returned as ids (" + {
                          "vllm": "choices[0].token_ids", "sglang": "output_ids"}.get(
                          engine, "return_token_ids / return_tokens_as_token_ids") + ")",
                      "text": text_check, "text_forms": forms},
        "notes": notes,
        # each response's text as the server sent it, and its form (diagnose's retokenisation check; not reported)
        "returned_text": [{"text": r["returned_text"], "form": list(r["text_form"])} for r in rows],
    }
    return rollouts, info
