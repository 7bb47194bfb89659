"""The hf engine's own sampling loop: transformers' ``GenerationMixin._sample`` (transformers 5.19) with the rows
that have finished left out of the forward. It drives the model's forward and KV cache directly (positions, the
cache's ``reorder_cache``, ``logits_to_keep``), which ``generate`` keeps to itself, so it is gated
(``offpolicy.speed.gates.HF_OWN_LOOP``): a transformers version or a model family it was not checked against,
a forward or cache it cannot drive, or rotary frequencies that depend on the forward's length (``refusal``)
samples through ``model.generate`` instead, and the run's header says why.

Per step, as ``_sample``:

    scores = processors(sequences, logits)          # [B, V]: finished rows' logits are zeros
    token  = multinomial(softmax(scores))           # a finished row's token is the pad
    sequences = cat(sequences, token); recorder.criterion(sequences, scores)
    forward(the rows still running, their token)    # finished rows' KV dropped (reorder_cache)

Everything that draws keeps the batch's shape — the processors (the noise's ``[B, V]`` draw) and ``multinomial``
(one exponential per entry of ``[B, V]``) — so the random stream and the unfinished rows' draws are those of
``generate``. The recorder is told which rows still run (``recorder.live``): a finished row records no kept set
(its all-zero logits would tie every token, and top-k/top-p would keep the whole vocabulary, issue #55).
"""

from __future__ import annotations

import inspect

import torch

from offpolicy.speed.gates import HF_OWN_LOOP, Decision, decide, model_family
from offpolicy.speed.shared_prompt import cache_argument, cache_refusal, rope_refusal


def refusal(model) -> str | None:
    """Why the loop cannot drive ``model`` (its forward does not take the positions, the cache and
    ``logits_to_keep``; its cache cannot drop rows; its rotary frequencies follow the forward's length — dropping
    the longest row would change them, where ``generate`` keeps every row), or None."""
    accepted = set(inspect.signature(model.forward).parameters)
    missing = {"position_ids", "logits_to_keep"} - accepted
    if not ({"cache", "past_key_values"} & accepted):
        missing.add("cache")
    if missing:
        return f"its forward takes no {', '.join(sorted(missing))}"
    return cache_refusal(model) or rope_refusal(model)


def decision(model) -> Decision:
    """The gate's ``Decision`` for ``model``."""
    return decide(HF_OWN_LOOP, model_family(model), refusal(model))


def sample(model, input_ids: torch.Tensor, attention: torch.Tensor, max_new_tokens: int, processors, recorder,
           shared, pad: int, stop: list[int], generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample up to ``max_new_tokens`` after the left-padded prompts ``[B, L]`` (module doc). ``processors``: the
    logits processors, the recorder last; ``recorder``: the engine's ``_SampledLogprobs``; ``shared``: the prefill
    already done (``shared_prompt.prefill``: the cache and the first logits ``[B, V]``) or None; ``generator``: what
    ``multinomial`` draws from (the engine's own; None: torch's global one). Returns the sequences
    ``[B, L + steps]``."""
    from transformers import DynamicCache

    rows, _ = input_ids.shape
    device = input_ids.device
    name = cache_argument(model)
    stops = torch.tensor(stop, device=device)
    positions = (attention.long().cumsum(-1) - 1).masked_fill(attention == 0, 0)
    if shared is None:
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                       logits_to_keep=1, **{name: cache}).logits[:, -1].float()
    else:  # the whole prompts are in the cache already, and their last logits copied to the rows
        cache, logits = shared
    vocab = logits.shape[-1]
    held = torch.arange(rows, device=device)  # the rows the cache holds, in its order
    unfinished = torch.ones(rows, dtype=torch.bool, device=device)
    sequences, mask = input_ids, attention
    try:
        for step in range(max_new_tokens):
            full = logits if len(held) == rows else \
                torch.zeros((rows, vocab), dtype=logits.dtype, device=device).index_copy_(0, held, logits)
            recorder.live = unfinished
            scores = processors(sequences, full)
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator).squeeze(1)
            tokens = torch.where(unfinished, tokens, pad)
            sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
            recorder.criterion(sequences, scores)
            unfinished = unfinished & ~torch.isin(tokens, stops)
            if step == max_new_tokens - 1 or not bool(unfinished.any()):
                break
            keep = unfinished[held]
            if not bool(keep.all()):
                kept_rows = keep.nonzero().squeeze(1)
                cache.reorder_cache(kept_rows)
                held = held[kept_rows]
            out = model(input_ids=tokens[held, None], attention_mask=mask[held],
                        position_ids=mask[held].long().sum(-1, keepdim=True) - 1, use_cache=True, logits_to_keep=1,
                        **{name: cache})
            logits = out.logits[:, -1].float()
    finally:
        recorder.live = None
    return sequences
