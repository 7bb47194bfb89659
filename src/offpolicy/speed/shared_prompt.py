"""The shared prompt, once: the one planner that decides when a group's prompt is computed once, and the two
forwards that do it — the hf engine's prefill (``prefill``) and the trainer's decoder pass (``decoder_hidden``).

GRPO repeats each prompt group-size times, and under causal attention a prompt's keys and values do not depend
on what follows it: every row of a group computes the same prompt. The shared forward runs each distinct prompt
once, copies its KV cache to the prompt's rows (the cache's ``reorder_cache``: an index copy) and runs the rest
through that cache.

Eligibility (``refusal``, one rule for the engine and the trainer, decided once per model):

- the gate (``gates.SHARED_PROMPT``): transformers at a checked version, a checked model family;
- a decoder-only model whose cache layers can copy rows (``reorder_cache``);
- positions whose rotary frequencies do not depend on how long the forward is (``rope_refusal``). transformers'
  ``dynamic`` and ``longrope`` rotary types pick their frequencies from the largest position of each call, so a
  prompt computed alone (positions below the original context) gets other frequencies than the same prompt inside
  a whole row that passes it (issue #55: fp64 log-probs off by 1e-4–1e-3, gradients by up to 10 %). The rule
  tests the behaviour, not a list of names: the rotary embedding's cos/sin of the first positions, once called
  with those positions alone and once with a far position beside them, must be equal;
- where the rest goes through the cache many tokens at a time (the trainer's responses, ``continuation="tokens"``):
  plain per-layer KV (``DynamicLayer``: no sliding window, no linear attention) and torch's SDPA attention. SDPA
  only: the left-padded prefixes have query rows that attend to nothing, which SDPA returns as zeros, while the
  eager attention of an fp64 model turns them into NaN that reach the next layer's keys and values. The engine
  goes on one token at a time (``continuation="token"``), as ``generate`` does through any cache.

Per batch (``groups``): a plan only where some prompt repeats.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Literal, NamedTuple

import torch

from offpolicy.speed.gates import SHARED_PROMPT, decide, model_family

Continuation = Literal["token", "tokens"]
# the far position of the rotary probe: past any context a model here is trained or sampled at
FAR_POSITION = 2**20

_refusals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {continuation: refusal}


def cache_argument(module) -> str:
    """The name ``module``'s forward takes its KV cache under: transformers ≥ 5.24 renamed ``past_key_values`` to
    ``cache`` (the old name warns, and goes at 5.40); the name its signature has, so no deprecation warning."""
    accepted = inspect.signature(module.forward).parameters
    return "cache" if "cache" in accepted else "past_key_values"


def _rotary_modules(model) -> list[torch.nn.Module]:
    """The modules that compute rotary cos/sin: transformers' ``*RotaryEmbedding`` (an ``inv_freq`` buffer and a
    ``forward(x, position_ids)``)."""
    found = []
    for module in model.modules():
        if hasattr(module, "inv_freq") and "position_ids" in inspect.signature(module.forward).parameters:
            found.append(module)
    return found


def _probe_calls(rotary: torch.nn.Module) -> list[dict]:
    """One keyword set per rotary variant the module computes (a dict ``rope_type``: one per layer type)."""
    types = getattr(rotary, "rope_type", None)
    return [{"layer_type": t} for t in types] if isinstance(types, dict) else [{}]


def rope_refusal(model) -> str | None:
    """Why ``model``'s positions may not be split over two forwards: None where each rotary embedding gives
    positions 0..3 the same cos/sin whether called with them alone or beside position ``FAR_POSITION`` (module
    doc); else the reason in words. Probed on a copy (a dynamic rope updates its buffers as it is called)."""
    for rotary in _rotary_modules(model):
        probe = copy.deepcopy(rotary)
        buffer = next(probe.buffers(), None)
        device = buffer.device if buffer is not None else torch.device("cpu")
        x = torch.zeros(1, 1, dtype=torch.float32, device=device)
        near = torch.arange(4, device=device)[None]
        far = torch.cat([near, torch.tensor([[FAR_POSITION]], device=device)], dim=1)
        for kwargs in _probe_calls(probe):
            try:
                with torch.no_grad():
                    short = probe(x, near, **kwargs)
                    long = probe(x, far, **kwargs)
            except Exception as err:  # noqa: BLE001 — a rotary we cannot probe is not shared
                return f"its rotary embedding ({type(rotary).__name__}) could not be probed ({type(err).__name__})"
            if not all(torch.equal(a, b[:, :4]) for a, b in zip(short, long)):
                rope_type = getattr(probe, "rope_type", "?")
                return (f"its rotary embedding ({type(rotary).__name__}, rope type {rope_type!r}) changes its "
                        "frequencies with the forward's length, so a prompt computed alone differs from the same "
                        "prompt in a whole row")
    return None


def refusal(model, continuation: Continuation) -> str | None:
    """Why a group's prompt may not be computed once for ``model`` (module doc), or None where it may; worked out
    once per model and continuation."""
    known = _refusals.setdefault(model, {})
    if continuation not in known:
        known[continuation] = _refusal(model, continuation)
    return known[continuation]


def decision(model, continuation: Continuation):
    """The gate's ``Decision`` for ``model`` (for the run's header)."""
    return decide(SHARED_PROMPT, model_family(model), _structural_refusal(model, continuation))


def _refusal(model, continuation: Continuation) -> str | None:
    found = decision(model, continuation)
    return None if found.fast else found.reason


def cache_refusal(model) -> str | None:
    """Why ``model``'s KV cache cannot have its rows copied or dropped (``reorder_cache`` on every layer of
    transformers' ``DynamicCache``), or None where it can."""
    from transformers import DynamicCache

    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 — a config DynamicCache cannot read
        return "its cache is not one transformers' DynamicCache builds"
    if not layers or not all(hasattr(layer, "reorder_cache") for layer in layers):
        return "its cache layers cannot copy rows"
    return None


def _structural_refusal(model, continuation: Continuation) -> str | None:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = model.config
    cache = cache_refusal(model)
    if cache is not None:
        return cache
    layers = DynamicCache(config=config).layers
    if continuation == "tokens":
        if not all(type(layer) is DynamicLayer for layer in layers):
            return "its cache is not plain per-layer KV (sliding window or linear attention)"
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return f"its attention is {getattr(config, '_attn_implementation', None)!r}, not SDPA"
    return rope_refusal(model)


def groups(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Rows ``[B, W]`` of prompt keys (each row's prompt ids, −1 where it has none) grouped by equal prompt:
    (``distinct`` ``[D, W]``, ``index`` ``[B]``: each row's group, ``first`` ``[D]``: a row of each group), or None
    where no prompt repeats (nothing to save)."""
    distinct, index = torch.unique(keys, dim=0, return_inverse=True)
    if len(distinct) == keys.shape[0]:
        return None
    rows = torch.arange(keys.shape[0], device=keys.device)
    first = torch.full((len(distinct),), keys.shape[0], dtype=torch.long, device=keys.device)
    first = first.scatter_reduce(0, index, rows, reduce="amin")
    return distinct, index, first


# ----------------------------------------------------------------------------------------------- the hf engine

def prefill(model, input_ids: torch.Tensor, attention: torch.Tensor, whole: bool):
    """The hf engine's prefill of a left-padded batch ``[B, L]`` with each repeated prompt computed once: the
    cache of each distinct prompt, copied to its rows. ``whole`` (the engine's own loop): the whole prompts, and
    the logits of their last token ``[B, V]`` fp32, from which the first token is drawn. Otherwise
    (``model.generate``, which must run at least one column itself): all but the last column, and None.
    None where no prompt repeats or ``refusal`` refuses the model."""
    cut = input_ids.shape[1] - (0 if whole else 1)
    if cut < 1 or refusal(model, "token") is not None:
        return None
    grouped = groups(torch.where(attention.bool(), input_ids, -1))
    if grouped is None:
        return None
    _, index, first = grouped
    from transformers import DynamicCache

    ids, mask = input_ids[first, :cut], attention[first, :cut]
    # the positions generate gives a left-padded prompt (GenerationMixin._prepare_position_ids_for_generation)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                **{cache_argument(model): cache})
    cache.reorder_cache(index)  # row i ← its prompt's KV (an index copy)
    return cache, out.logits[:, -1].float().index_select(0, index) if whole else None


# ------------------------------------------------------------------------------------------------- the trainer

class SharedPrompts(NamedTuple):
    """A micro-batch's forward with each repeated prompt computed once (``plan``; ``decoder_hidden``). Split each
    row after its prompt:

    - the *prefix*, the whole prompt, once per distinct prompt: ``prefix_ids`` ``[D, P]``, left-padded
      (``prefix_mask``, ``prefix_positions``), whose KV cache goes to each row by ``index`` ``[B]``, and whose
      last hidden state is each of its rows' logits for response token 0;
    - the *suffix*, the response but its last token, per row: ``suffix_ids`` ``[B, S]``, right-padded, at
      positions ``suffix_positions`` after the row's prompt, attending through ``attention_mask``
      ``[B, P + S]`` (the row's prefix mask, then its own); suffix column t − 1 gives the logits of response
      token t. S is 0 where no response is longer than a token.

    ``input_ids`` is the batch tensor this was made from (the plan serves only it)."""

    input_ids: torch.Tensor
    prefix_ids: torch.Tensor
    prefix_mask: torch.Tensor
    prefix_positions: torch.Tensor
    index: torch.Tensor
    suffix_ids: torch.Tensor
    suffix_positions: torch.Tensor
    attention_mask: torch.Tensor

    def to(self, device: torch.device, input_ids: torch.Tensor) -> SharedPrompts:
        """On ``device``, serving ``input_ids`` (that batch's tensor, already there)."""
        return SharedPrompts(input_ids, *(t.to(device, non_blocking=True) for t in self[1:]))


def plan(input_ids: torch.Tensor, attention: torch.Tensor, prompt: torch.Tensor) -> SharedPrompts | None:
    """The trainer's plan for right-padded rows ``[B, L]`` whose prompts are ``prompt`` ``[B]`` tokens long, made
    on the host (CPU tensors); None where it would save nothing (no prompt repeats). Rows whose prompts are equal
    token for token share a prefix."""
    rows, width = input_ids.shape
    if rows < 2 or int(prompt.min()) < 1:
        return None
    grouped = groups(torch.where(torch.arange(width) < prompt[:, None], input_ids, -1))
    if grouped is None:
        return None
    distinct, index, _ = grouped
    # prefixes: each distinct prompt, left-padded to the longest
    prefix_len = (distinct >= 0).sum(dim=1)  # [D]
    width_p = int(prefix_len.max())
    source = torch.arange(width_p)[None, :] - (width_p - prefix_len)[:, None]
    prefix_mask = source >= 0
    prefix_ids = torch.where(prefix_mask, distinct.gather(1, source.clamp(min=0)), 0)
    prefix_positions = (prefix_mask.long().cumsum(-1) - 1).clamp(min=0)
    # suffixes: the response but its last token, right-padded
    suffix_len = (attention.sum(dim=1) - prompt - 1).clamp(min=0)  # [B]
    width_s = int(suffix_len.max())
    columns = prompt[:, None] + torch.arange(width_s)  # [B, S] in the row's input_ids
    suffix_mask = torch.arange(width_s)[None, :] < suffix_len[:, None]
    suffix_ids = torch.where(suffix_mask, input_ids.gather(1, columns.clamp(max=width - 1)), 0)
    return SharedPrompts(input_ids, prefix_ids, prefix_mask.long(), prefix_positions, index, suffix_ids, columns,
                         torch.cat([prefix_mask[index], suffix_mask], dim=1).long())


def serves(model, shared: SharedPrompts | None, input_ids: torch.Tensor) -> bool:
    """Whether the trainer's forward of ``input_ids`` may take ``shared``: it was made for that very tensor, the
    model is eligible (``refusal``), and gradient checkpointing is off while training (it turns the cache off)."""
    if shared is None or shared.input_ids is not input_ids:
        return False
    if model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        return False
    return refusal(model, "tokens") is None


def decoder_hidden(model, shared: SharedPrompts) -> torch.Tensor:
    """The decoder's last hidden states that predict each row's response tokens, ``[B, S + 1, H]`` (column t
    predicts response token t): the distinct prompts once, their KV cache and last hidden state copied to each
    row (``index_select``, whose backward sums the rows' gradients into their prompt's), then every row's
    response attending through that cache. The same function of the weights as the whole rows' forward at those
    positions."""
    from transformers import DynamicCache

    decoder = model.get_decoder()
    name = cache_argument(decoder)
    cache = DynamicCache(config=model.config)
    out = decoder(input_ids=shared.prefix_ids, attention_mask=shared.prefix_mask,
                  position_ids=shared.prefix_positions, use_cache=shared.suffix_ids.shape[1] > 0, **{name: cache})
    last = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[:, -1:]  # [D, 1, H]
    first = last.index_select(0, shared.index)  # [B, 1, H]: response token 0's
    if shared.suffix_ids.shape[1] == 0:
        return first
    cache.reorder_cache(shared.index)
    out = decoder(input_ids=shared.suffix_ids, attention_mask=shared.attention_mask,
                  position_ids=shared.suffix_positions, use_cache=True, **{name: cache})
    return torch.cat([first, out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]], dim=1)
