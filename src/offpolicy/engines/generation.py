"""transformers ``generate`` with only the sampling config offpolicy logs (issue #31).

``generate`` fills every field its ``GenerationConfig`` leaves at None from the model's
``generation_config.json`` (transformers 5.19, ``GenerationMixin._prepare_generation_config``:
``generation_config.update(**self.generation_config.to_dict(), defaults_only=True)``) — a passed
config included. Qwen2.5-Instruct ships ``repetition_penalty: 1.05, top_k: 20, top_p: 0.8,
temperature: 0.7``; sampled from that, μ is a distribution the trainer never scores (measured:
kl_k3 5.9e-5 against a fp32 trainer instead of 2.9e-14). Setting every field is not enough either:
a field whose neutral value *is* None (``min_p``, ``bad_words_ids``, ``suppress_tokens``,
``sequence_bias``, ``forced_eos_token_id``, ...) cannot be set to "off". So ``generate`` here
runs with the model's ``generation_config`` swapped for an empty one, and an explicit config:

    do_sample, max_new_tokens, eos_token_id (every stop id), pad_token_id,
    temperature = 1, top_k = 0, top_p = 1   (the engine applies its τ / top-k / top-p itself, in
                                             the order transformers would, see engines/hf.py)
    repetition_penalty = 1, no_repeat_ngram_size = 0, min_length = 0, typical_p = 1, ... : off

``ignored_fields`` names what the model's own config asked for and did not get, for the one
warning line an engine prints (vLLM is not affected: explicit ``SamplingParams`` skip the model's
defaults).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import GenerationConfig

# every field that changes which token is drawn, with the value that turns it off
NEUTRAL: dict[str, object] = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None, "top_h": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "min_length": 0,
    "min_new_tokens": None, "guidance_scale": None, "watermarking_config": None, "renormalize_logits": False,
    "remove_invalid_values": False, "num_beams": 1, "penalty_alpha": None, "dola_layers": None,
    "token_healing": False, "stop_strings": None,
}
# GenerationConfig's other fields, none of which changes the distribution a token is drawn from at num_beams = 1:
# lengths and ids, what generate returns, caching and compilation, beam search's own knobs (off at one beam), and
# assisted or speculative decoding (which keeps the sampled distribution). tests/test_hf_engine.py checks that every
# field of the installed transformers' GenerationConfig() is here or in NEUTRAL: a new one is reviewed, not missed.
NOT_SAMPLING = frozenset({
    "_from_model_config", "transformers_version", "do_sample", "max_length", "max_new_tokens", "max_time",
    "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "num_return_sequences",
    "output_attentions", "output_hidden_states", "output_logits", "output_scores", "return_dict_in_generate",
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "low_memory", "compile_config",
    "disable_compile", "prefill_chunk_size", "continuous_batching_config",
    "num_beam_groups", "diversity_penalty", "length_penalty", "early_stopping", "constraints", "force_words_ids",
    "assistant_confidence_threshold", "assistant_early_exit", "assistant_ensemble_weight", "assistant_lookbehind",
    "is_assistant", "max_matching_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "prompt_lookup_num_tokens", "speculation_type", "target_lookbehind", "use_mtp",
})

WARPERS = {"temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff"}


def explicit_config(*, do_sample: bool, max_new_tokens: int, stop: list[int], pad: int | None) -> GenerationConfig:
    """The whole generation config: greedy or plain sampling from the model's logits (the caller
    adds its own temperature / top-k / top-p processors), every other sampling field off. Greedy
    leaves the warpers' fields unset: transformers applies them only when sampling (and warns
    about a set one)."""
    values = {k: v for k, v in NEUTRAL.items() if v is not None and (do_sample or k not in WARPERS)}
    return GenerationConfig(**values, do_sample=do_sample, max_new_tokens=max_new_tokens, eos_token_id=stop,
                            pad_token_id=pad, use_cache=True)


def ignored_fields(model, used: dict[str, object] | None = None) -> dict[str, object]:
    """The sampling fields of ``model.generation_config`` that differ from what is applied:
    ``used`` (e.g. the run's temperature, top_k, top_p) or else ``NEUTRAL``'s off value."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    applied = {**NEUTRAL, **(used or {})}
    out = {}
    for key, off in applied.items():
        value = getattr(config, key, None)
        if value is None or value == off:
            continue
        if key == "top_k" and value in (0, -1) and off in (0, -1):  # both mean "off"
            continue
        if key == "min_length" and value == 0:
            continue
        out[key] = value
    return out


def ignored_line(model, used: dict[str, object] | None = None) -> str | None:
    """One line naming what the model's ``generation_config.json`` asks for that offpolicy does not
    apply, or None when it asks for nothing else."""
    fields = ignored_fields(model, used)
    if not fields:
        return None
    asked = ", ".join(f"{k}={v}" for k, v in fields.items())
    return (f"the model's generation_config.json asks for {asked}: ignored, offpolicy samples only from its "
            "logged sampling config (temperature, top_k, top_p, min_p, max_new_tokens), the distribution it scores")


@contextlib.contextmanager
def without_model_defaults(model) -> Iterator[None]:
    """``model.generation_config`` is an empty ``GenerationConfig`` while the block runs (restored
    after), so ``generate`` takes nothing from the model's own file."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig,
             **kwargs) -> torch.Tensor:
    """``model.generate`` with ``config`` alone (``without_model_defaults``); returns the sequences
    ``[B, L + steps]``. ``kwargs``: ``logits_processor``, ``stopping_criteria``."""
    with without_model_defaults(model):
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **kwargs)
