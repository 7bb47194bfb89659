"""What the engine returned, checked for what the mismatch statistics cannot see (issue #69): ``diagnose``'s
``engine_checks`` section, each part a summary STAT that ``--fail-above`` gates (docs/diagnose.md, "Log-probs
that cannot be the sampler's").

* ``recomputed``: engine and trainer log-probs identical on every token (at least ``RECOMPUTED_MIN_TOKENS``) while
  the engine's dtype, device or backend differs from the trainer's — two different programs do not agree to the
  bit, so the "engine" log-probs were recomputed on the trainer's weights, not sampled: ρ is exactly 1 and every
  correction is silently off (tinker-cloud #66: a hosted trainer returned its own log-probs as the sampler's);
* ``zero_logprobs``: engine log-probs exactly 0 where the trainer's log-prob over the same kept set is below
  ``ZERO_BELOW`` and the set holds more than one token — a sampler cannot draw with probability 1 from a set whose
  other tokens carry ≥ 1 % of the mass (tinker-cookbook #396: sampling-time log-probs were 0 on many more tokens
  than the same sequences' recomputed ones). A one-token kept set, or p ≥ 0.99 rounded in bf16, gives an honest 0
  and is not counted;
* ``entropy_gap``: the trainer's exact entropy over the kept set against the engine's, on the tokens whose
  top-k (or kept-set) log-probs cover at least ``COVERAGE`` of the engine's mass, else "not reported"
  (tinker-cookbook #396: the sampling-time distribution had a much lower entropy than the recomputed one);
* ``retokenization``: where the engine returned text (a server's completions, a host's dump with text), prompt
  + response re-encoded with the trainer's tokenizer against the sampled ids (Agent Lightning v1.0.3, #646: a
  re-tokenised prefix that is not the sampled one);

and the engine on record beside them (``server_record``: what a server says about itself).
"""

from __future__ import annotations

from typing import Any

import torch

from offpolicy.core.kept_set import KeptIds

RECOMPUTED_MIN_TOKENS = 256  # below this, identical log-probs can be luck (an fp32 engine on a short batch)
ZERO_BELOW = -0.01  # log π below this: p < 0.99 under the trainer, never rounded to log p = 0 in bf16
COVERAGE = 0.99  # the engine's log-probs must cover this much of its mass for its entropy to be reported
SIDES = ("backend", "dtype", "device")
DTYPE_NAMES = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
               "float32": "fp32", "float": "fp32", "torch.float32": "fp32"}


def _name(value: Any) -> str | None:
    """A side's value as compared: dtypes under one spelling (``bfloat16`` → ``bf16``), ``None`` where unknown."""
    if value in (None, "", "auto", "as served", "unknown") or str(value).startswith("not reported"):
        return None
    return DTYPE_NAMES.get(str(value), str(value))


def recomputed(exact: dict[str, Any], engine: dict[str, Any] | None, trainer: dict[str, Any] | None,
               min_tokens: int = RECOMPUTED_MIN_TOKENS, determinism: Any = None) -> dict[str, Any]:
    """Do the engine's log-probs look recomputed on the trainer's weights? ``exact`` is ``diagnose.exactness``'s
    section (every log-ratio 0 to the bit, over every sampled token); ``engine`` and ``trainer`` are each side's
    ``backend``, ``dtype`` and ``device`` (None or a missing key: not on record).

    ``flagged`` when every log-ratio is exactly 0 on at least ``min_tokens`` tokens and a known ``backend``,
    ``dtype`` or ``device`` differs between the sides — but for a backend alone where the engine runs with a
    determinism switch (``determinism``, the engine record's list: vLLM's batch-invariant mode, SGLang's
    deterministic inference): a true on-policy setup (slime's, on those switches) is exact by design across
    backends, never across dtypes or devices. ``measured`` says whether the check could decide: a single differing
    token decides (not recomputed); identical log-probs need ``min_tokens`` tokens and sides on record."""
    engine, trainer = engine or {}, trainer or {}
    tokens, identical = exact["tokens"], exact["exact"]
    known = [k for k in SIDES if _name(engine.get(k)) is not None and _name(trainer.get(k)) is not None]
    differs = [k for k in known if _name(engine[k]) != _name(trainer[k])]
    out = {"identical": identical, "tokens": tokens, "differing_tokens": exact["differing_tokens"],
           "min_tokens": min_tokens, "engine": {k: engine.get(k) for k in SIDES},
           "trainer": {k: trainer.get(k) for k in SIDES}, "differs_in": differs, "flagged": False, "measured": True}
    if not identical:
        out["verdict"] = (f"no: the engine's log-probs differ from the trainer's on {exact['differing_tokens']} of "
                          f"{tokens} tokens (sampled, not recomputed)")
    elif tokens < min_tokens:
        out["measured"] = False
        out["verdict"] = (f"not decided: identical on all {tokens} tokens, too few to tell a recomputation from an "
                          f"exact engine (needs ≥ {min_tokens})")
    elif differs == ["backend"] and isinstance(determinism, list) and determinism:
        out["verdict"] = (f"no: identical on all {tokens} tokens across backends ({engine['backend']} vs "
                          f"{trainer['backend']}) with the engine's {', '.join(map(str, determinism))}: exact by design")
    elif differs:
        pairs = ", ".join(f"{k} {engine[k]} vs {trainer[k]}" for k in differs)
        out["flagged"] = True
        out["verdict"] = (f"FLAGGED: identical to the bit on all {tokens} tokens while the engine's {pairs} (engine vs "
                          "trainer): these look recomputed on the trainer's weights, not sampled — ρ = 1 everywhere "
                          "and every correction is off")
    elif not known:
        out["measured"] = False
        out["verdict"] = (f"not decided: identical on all {tokens} tokens, and neither side's backend, dtype or device "
                          "is on record to say whether two different programs agreed to the bit")
    else:
        out["verdict"] = (f"no: identical on all {tokens} tokens, as expected where the engine runs with the trainer's "
                          f"{', '.join(known)}")
    return out


def zero_logprobs(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                  kept_count: torch.Tensor | None = None, below: float = ZERO_BELOW) -> dict[str, Any]:
    """The share of counted tokens whose engine log-prob is exactly 0 while the trainer's, over the same kept set,
    is below ``below`` and that set holds more than one token. ``trainer``, ``rollout``, ``mask`` ``[B, T]``;
    ``kept_count`` ``[B, T]``: the size of each token's recorded kept set (the engine's, which the trainer
    replayed; 0 where none was recorded and the trainer scored on its own); None where the trainer scored on its
    own set everywhere — there log π < ``below`` < 0 already says its set holds more than one token (a one-token
    set renormalises to log π = 0)."""
    keep = mask.bool()
    zero = keep & (rollout == 0)
    suspect = zero & (trainer < below)
    if kept_count is not None:  # a one-token recorded set gives an honest 0 (an empty one: the trainer's own set)
        suspect &= kept_count != 1
    tokens, n = int(keep.sum()), int(suspect.sum())
    out = {"tokens": tokens, "engine_zero_tokens": int(zero.sum()), "suspect_tokens": n,
           "fraction": n / tokens if tokens else 0.0, "below": below,
           "kept_set": ("the engine's recorded kept set (replayed): its size read per token" if kept_count is not None
                        else "the trainer's own kept set: log π < " f"{below:g} means it holds more than one token"),
           "first": None}
    if n:
        row, position = (int(i) for i in suspect.nonzero()[0])
        out["first"] = {"row": row, "position": position, "trainer_logprob": float(trainer[row, position]),
                        "engine_logprob": 0.0}
    return out


def engine_entropy(kept: KeptIds | None, head: KeptIds | None, width: int
                   ) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """The engine's entropy −Σ q log q and the mass Σ q it covers at each position ``[B, width]``, from the log-probs
    it sent per token: its kept set's (``kept.logprobs``: the whole set, mass 1 — the hf engine, SGLang's
    ``--sampling-mask-logprobs``), else its top-k (``head.logprobs``: ``--head-logprobs``), else None (nothing to
    read it from). Memory O(ids sent): never a ``[B, T, K]`` tensor (a top-p set can hold most of the vocabulary)."""
    source, sets = (("the engine's kept-set log-probs", kept) if kept is not None and kept.logprobs is not None else
                    ("the engine's top-k log-probs (head)", head) if head is not None and head.logprobs is not None
                    else (None, None))
    if sets is None:
        return None
    sets = sets.pad(width)
    position, index, _ = sets._flat()  # every sent id with its position (row-major) and its place in ids/logprobs
    logq = sets.logprobs[index].double()
    q = logq.exp()
    plogq = torch.where(q > 0, q * logq, torch.zeros_like(q))
    size = sets.start.numel()
    entropy = torch.zeros(size, dtype=torch.float64).index_add_(0, position, -plogq)
    mass = torch.zeros(size, dtype=torch.float64).index_add_(0, position, q)
    return entropy.view(sets.start.shape).float(), mass.view(sets.start.shape).float(), source


def entropy_gap(trainer_entropy: torch.Tensor | None, engine: tuple[torch.Tensor, torch.Tensor, str] | None,
                mask: torch.Tensor, why_not: str | None = None, coverage: float = COVERAGE) -> dict[str, Any]:
    """The trainer's exact entropy over the kept set (``trainer_entropy`` ``[B, T]``, the head's ``token_entropy``
    of the renormalised distribution) against the engine's (``engine_entropy``'s triple), on the counted tokens
    whose engine log-probs cover ≥ ``coverage`` of its mass. Not reported (``reported`` False, with the reason)
    where the engine sent no such log-probs, no trainer logits are at hand, or no token is covered."""
    keep = mask.bool()
    tokens = int(keep.sum())
    if engine is None:
        return {"reported": False, "tokens": tokens, "why": why_not or "not reported: the engine sent no log-probs "
                "beyond the sampled token's (no top-k, no kept-set log-probs)"}
    if trainer_entropy is None:
        return {"reported": False, "tokens": tokens, "why": "not reported: no trainer logits are at hand"}
    h_engine, mass, source = engine
    covered = keep & (mass >= coverage)
    n = int(covered.sum())
    mass_mean = float(mass[keep].mean()) if tokens else 0.0
    if not n:
        return {"reported": False, "tokens": tokens, "source": source, "coverage": coverage, "mass_mean": mass_mean,
                "why": f"not reported: {source} cover less than {coverage:g} of the engine's mass on every token (mean "
                       f"{mass_mean:.3f}); ask for more (--head-logprobs K)"}
    h_pi, h_mu = trainer_entropy.float()[covered].double(), h_engine[covered].double()
    gap = h_mu - h_pi
    return {"reported": True, "tokens": tokens, "source": source, "coverage": coverage, "covered_tokens": n,
            "covered_share": n / tokens, "mass_mean": mass_mean, "trainer_entropy_mean": float(h_pi.mean()),
            "engine_entropy_mean": float(h_mu.mean()), "gap_mean": float(gap.mean()),
            "abs_gap_mean": float(gap.abs().mean()), "abs_gap_max": float(gap.abs().max())}


def retokenization(tokenizer, prompts: list[list[int]], responses: list[list[int]], texts: list[str | None],
                   source: str, prompt_texts: list[str | None] | None = None,
                   forms: list[list[str]] | None = None) -> dict[str, Any]:
    """Re-encode each row's prompt + response text with the trainer's ``tokenizer`` and compare with the sampled ids
    ``prompts[i] + responses[i]``. ``texts``: each response's text as the engine returned it (None: that row came
    without); ``prompt_texts``: the prompt's text where the host kept it, else the prompt ids decoded here (special
    tokens kept: they re-encode to their ids); ``forms``: the server's text forms (``engines.server.completions.text_form``) —
    a response whose stop token the server left out of its text is compared without that token (a chat template
    puts it back), one cut inside a multi-byte character is not (its text cannot hold the held-back bytes).

    Returns the share of rows whose re-encoded ids differ from the sampled ones (``share``), each row's first
    differing position (``first_positions``, in the response: negative inside the prompt; None: equal) and the
    first row's ids around it (``first``)."""
    rows = [i for i, t in enumerate(texts) if isinstance(t, str)]
    if not rows:
        return {"reported": False, "source": source, "why": f"not reported: {source} carried no text"}
    positions: list[int | None] = [None] * len(texts)
    first, stop_left_out = None, 0
    for i in rows:
        prompt = list(prompts[i])
        response = list(responses[i])
        if forms is not None and "stop_token_left_out" in (forms[i] or []) and response:
            response, stop_left_out = response[:-1], stop_left_out + 1
        sampled = prompt + response
        given = prompt_texts[i] if prompt_texts is not None else None
        prompt_text = given if isinstance(given, str) else tokenizer.decode(prompt, skip_special_tokens=False)
        again = list(tokenizer.encode(prompt_text + texts[i], add_special_tokens=False))
        if again == sampled:
            continue
        at = next((k for k, (a, b) in enumerate(zip(sampled, again)) if a != b), min(len(sampled), len(again)))
        positions[i] = at - len(prompt)
        if first is None:
            first = {"row": i, "position": at, "response_position": at - len(prompt),
                     "in": "prompt" if at < len(prompt) else "response",
                     "sampled": sampled[at:at + 6], "reencoded": again[at:at + 6],
                     "sampled_tokens": tokenizer.convert_ids_to_tokens(sampled[at:at + 6]),
                     "reencoded_tokens": tokenizer.convert_ids_to_tokens(again[at:at + 6]),
                     "sampled_length": len(sampled), "reencoded_length": len(again)}
    differing = sum(p is not None for p in positions)
    return {"reported": True, "source": source, "rows": len(rows), "rows_differing": differing,
            "share": differing / len(rows), "first": first, "first_positions": positions,
            "stop_token_left_out_rows": stop_left_out}


def server_record(config, info: dict[str, Any], engine_dtype: str | None = None) -> dict[str, Any]:
    """The engine on record for a server (``offpolicy.measure.provenance``'s keys), from what it says about itself:
    ``/version`` (vLLM), ``/get_server_info`` (SGLang: its version, dtype, attention backend and
    ``enable_deterministic_inference``), ``/server_info?config_format=json`` (vLLM with ``VLLM_SERVER_DEV_MODE=1``, as
    ``trl vllm-serve`` starts it: the model config's dtype, the attention backend and ``VLLM_BATCH_INVARIANT``).
    Each one the server does not answer leaves its fields "not reported by the server"; ``engine_dtype`` (the
    ``--engine-dtype`` flag) fills the dtype only where the server says none, marked as the flag's."""
    from offpolicy.engines.server import ServerError, request_json

    quiet = config.model_copy(update={"retries": 0})

    def ask(path: str) -> dict[str, Any]:
        try:
            return request_json(quiet, path)
        except ServerError:
            return {}

    unknown = "not reported by the server"
    record: dict[str, Any] = {"name": "server", "version": unknown, "dtype": unknown, "attention_backend": unknown,
                              "determinism": unknown, "url": info.get("url"), "served_model": info.get("served_model"),
                              "sampling_mask": config.sampling_mask}
    sglang = ask("/get_server_info")
    if "enable_deterministic_inference" in sglang or "attention_backend" in sglang:
        record.update(name="sglang server", version=str(sglang.get("version", unknown)),
                      dtype=str(sglang.get("dtype", unknown)),
                      attention_backend=str(sglang.get("attention_backend") or "SGLang's default"),
                      determinism=["SGLang deterministic inference (--enable-deterministic-inference)"]
                      if sglang.get("enable_deterministic_inference") else "none")
    else:
        version = ask("/version").get("version")
        if isinstance(version, str):
            record.update(name="vllm server", version=version)
        dev = ask("/server_info?config_format=json")
        vllm_config, env = dev.get("vllm_config"), dev.get("vllm_env")
        if isinstance(vllm_config, dict) and isinstance(env, dict):
            model = vllm_config.get("model_config") or {}
            attention = (vllm_config.get("attention_config") or {}).get("backend") or env.get("VLLM_ATTENTION_BACKEND")
            record.update(name="vllm server", dtype=str(model.get("dtype", unknown)),
                          attention_backend=str(attention or "vLLM's default"),
                          determinism=["VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant mode)"]
                          if env.get("VLLM_BATCH_INVARIANT") in (True, 1, "1", "True", "true") else "none")
    if record["dtype"] == unknown and engine_dtype:
        record["dtype"] = f"{engine_dtype} (--engine-dtype; the server does not say)"
    return record


def describe(record: dict[str, Any] | None) -> str:
    """One line for an engine record: name, version, dtype, attention backend, determinism switches."""
    if not record:
        return "not on record"
    missing = "not recorded"
    switches = record.get("determinism") or missing
    switches = ", ".join(switches) if isinstance(switches, list) else switches
    return (f"{record.get('name') or record.get('backend') or 'unnamed'} ({record.get('version') or 'version ' + missing}), "
            f"dtype {record.get('dtype') or missing}, attention {record.get('attention_backend') or missing}, "
            f"determinism: {switches}")
