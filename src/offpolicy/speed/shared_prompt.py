"""The shared prompt, once: the one planner that decides when a group's prompt is computed once, and the two
forwards that do it — the hf engine's prefill (``prefill``) and the trainer's decoder pass (``decoder_hidden``).

GRPO repeats each prompt group-size times, and under causal attention a prompt's keys and values do not depend
on what follows it: every row of a group computes the same prompt. The engine runs each distinct prompt once and
copies its KV cache to the prompt's rows (the cache's ``reorder_cache``: an index copy), then decodes one token
at a time. The trainer *packs*: one forward over sequences that each hold a distinct prompt followed by the
responses of its rows, back to back, under a custom 4D attention mask (a response sees its prompt and its own
earlier tokens) and each token's own position — so neither a prompt nor the padding after a short response is
computed once per row (transformers' public custom-mask path; the prompt's gradient is the sum over its rows).

Eligibility (``refusal``, decided once per model and form):

- the gate (``gates.SHARED_PROMPT``): transformers at a checked version, a checked model family;
- positions whose rotary frequencies do not depend on how long the forward is (``rope_refusal``). transformers'
  ``dynamic`` and ``longrope`` rotary types pick their frequencies from the largest position of each call, so a
  prompt computed alone (positions below the original context) gets other frequencies than the same prompt inside
  a whole row that passes it (issue #55: fp64 log-probs off by 1e-4–1e-3, gradients by up to 10 %). The rule
  tests the behaviour, not a list of names: the rotary embedding's cos/sin of the first positions, once called
  with those positions alone and once with a far position beside them, must be equal;
- the engine (``"token"``): a decoder-only model whose cache layers can copy rows (``reorder_cache``);
- the trainer (``"packed"``): a decoder-only model whose every layer is plain full attention (transformers'
  ``DynamicCache`` builds a ``DynamicLayer`` for each: a custom mask would override a sliding window, and linear
  attention has no mask) and torch's SDPA attention (which takes a boolean 4D mask as it is; the eager form adds
  it as a float).

Per batch (``groups``): a plan only where some prompt repeats.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Literal, NamedTuple

import torch

from offpolicy.speed.gates import SHARED_PROMPT, decide, model_family

Form = Literal["token", "packed"]
# the far position of the rotary probe: past any context a model here is trained or sampled at
FAR_POSITION = 2**20

_refusals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {form: refusal}


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


def refusal(model, form: Form) -> str | None:
    """Why a group's prompt may not be computed once for ``model`` (module doc), or None where it may; worked out
    once per model and form."""
    known = _refusals.setdefault(model, {})
    if form not in known:
        known[form] = _refusal(model, form)
    return known[form]


def decision(model, form: Form):
    """The gate's ``Decision`` for ``model`` (for the run's header)."""
    return decide(SHARED_PROMPT, model_family(model), _structural_refusal(model, form))


def _refusal(model, form: Form) -> str | None:
    found = decision(model, form)
    return None if found.fast else found.reason


def _cache_layers(model) -> tuple[list, str | None]:
    """The layers transformers' ``DynamicCache`` builds for ``model``'s config, or ``([], why)`` where it builds
    none that apply (an encoder-decoder model, a config it cannot read)."""
    from transformers import DynamicCache

    if getattr(model.config, "is_encoder_decoder", False):
        return [], "an encoder-decoder model"
    try:
        return DynamicCache(config=model.config).layers, None
    except Exception:  # noqa: BLE001 — a config DynamicCache cannot read
        return [], "its cache is not one transformers' DynamicCache builds"


def cache_refusal(model) -> str | None:
    """Why ``model``'s KV cache cannot have its rows copied or dropped (``reorder_cache`` on every layer of
    transformers' ``DynamicCache``), or None where it can."""
    layers, why = _cache_layers(model)
    if why is not None:
        return why
    if not layers or not all(hasattr(layer, "reorder_cache") for layer in layers):
        return "its cache layers cannot copy rows"
    return None


def packed_refusal(model) -> str | None:
    """Why the trainer may not pack ``model``'s rows (module doc): a layer that is not plain full attention (a
    custom mask would override a sliding window; linear attention has none) or attention other than SDPA."""
    from transformers.cache_utils import DynamicLayer

    layers, why = _cache_layers(model)
    if why is not None:
        return why
    if not layers or not all(type(layer) is DynamicLayer for layer in layers):
        return "its layers are not all plain full attention (sliding window or linear attention)"
    attention = getattr(model.config, "_attn_implementation", None)
    if attention != "sdpa":
        return f"its attention is {attention!r}, not SDPA"
    return None


def _structural_refusal(model, form: Form) -> str | None:
    why = cache_refusal(model) if form == "token" else packed_refusal(model)
    return why if why is not None else rope_refusal(model)


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

# The most tokens a pack holds where its prompt is short (a pack's prompt and its first response always go in,
# whatever their length). Inside a pack every token attends under a dense [W, W] mask, so attention costs ~4·W·d a
# token against the linear layers' ~24·d² (d the width): packs of ≤ 1,024 tokens keep it a fraction of the GEMMs the
# packing saves at the widths packed here (SmolLM2's 576: 1,024 tokens ≈ 0.3 of the linears a token;
# docs/performance-journal.md, issue #57's third session). A long prompt's responses may span as many tokens as
# the prompt itself (``spans``).
PACK_TOKENS = 1024


def spans(prompt: torch.Tensor, longest: torch.Tensor, cap: int = PACK_TOKENS, budget: int | None = None
          ) -> torch.Tensor:
    """How far apart the responses of one pack may start, per group ``[D]``: of prompts ``prompt`` ``[D]`` tokens
    long whose rows' responses (but their last tokens) are at most ``longest`` ``[D]``; at least 1 (a prompt and one
    response always make a pack).

    ``cap`` − len(prompt), or len(prompt) where that is more: a prompt past half the cap would otherwise leave its
    responses a few tokens (past the cap, one: each row its own pack, the prompt computed once per row again, as in
    the whole rows). Under the dense mask a pack whose k ≥ 2 responses, of lengths r summing to s, span at most its
    prompt's length P costs no more attention than the rows it replaces — (P + s)² = P² + 2Ps + s² ≤ k·P² + 2Ps +
    Σ r² = Σ (P + r)², as s² ≤ P² ≤ (k − 1)·P² — and fewer linear FLOPs (P + s tokens, not k·P + s; the last
    response may run past the span, by less than a response). The growth past the cap stops where a pack would pass
    ``budget`` tokens (the micro-batch's, ``policy.score.micro_batches``): the last response starts at most span − 1
    after the first and holds at most ``longest``, so P + span − 1 + longest ≤ budget. The spans are the step's: its
    micro-batches take whole packs of the step's one layout (``PackLayout.take``), never a plan of their own."""
    grown = prompt if budget is None else torch.minimum(prompt, budget - prompt - longest + 1)
    return torch.maximum(cap - prompt, grown).clamp(min=1)


class SharedPrompts(NamedTuple):
    """A micro-batch's forward with each repeated prompt computed once, packed (``PackLayout.build``;
    ``decoder_hidden``).
    Each row is its prompt and its response; the response's last token predicts nothing. A *pack* is one
    distinct prompt followed by the responses (but their last tokens) of some of its rows, back to back, with no
    padding between them; ``ids`` ``[n, W]`` holds the packs (0-padded at the right), ``positions`` ``[n, W]`` each
    token's position in its whole row, and ``segments`` ``[n, W]`` whose it is: 0 the prompt, r + 1 row r's
    response, −1 padding. A response's token attends to its prompt and to its own earlier tokens, as in its whole
    row (the mask is built from ``segments`` on the device). ``gather`` ``[B, S + 1]`` indexes the packs'
    flattened hidden states: column t of row r is the one that predicts r's response token t (column 0 the
    prompt's last token; columns past the response repeat it). S is 0 where no response is longer than a token.

    ``input_ids`` is the batch tensor this was made from (the plan serves only it)."""

    input_ids: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    gather: torch.Tensor

    def to(self, device: torch.device, input_ids: torch.Tensor) -> SharedPrompts:
        """On ``device``, serving ``input_ids`` (that batch's tensor, already there)."""
        return SharedPrompts(input_ids, *(t.to(device, non_blocking=True) for t in self[1:]))


class PackLayout(NamedTuple):
    """Which pack each row of a step goes in (``layout``), before any tensor of the packs is made — the step's one
    pack plan, of which each micro-batch takes whole packs (``take``) and makes its tensors (``build``). Rows in
    group order (``order`` ``[B]``: each group's rows in batch order), each row's response length but its last token
    (``length``, by ``order``), ``pack`` (by ``order``) and start column in it (``column``, by ``order``); per pack
    its prompt's length (``prompt`` ``[n]``) and group (``group_of`` ``[n]``), and per distinct prompt its ids
    (``distinct`` ``[D, L]``, −1 past the prompt). Host tensors."""

    order: torch.Tensor
    length: torch.Tensor
    pack: torch.Tensor
    column: torch.Tensor
    prompt: torch.Tensor
    group_of: torch.Tensor
    distinct: torch.Tensor

    def pack_tokens(self) -> torch.Tensor:
        """Each pack's tokens ``[n]``: its prompt and its rows' responses but their last tokens."""
        return self.prompt + torch.zeros_like(self.prompt).scatter_add(0, self.pack, self.length)

    def pack_of_rows(self) -> torch.Tensor:
        """Each row's pack ``[B]``, in batch order."""
        return torch.empty_like(self.pack).scatter_(0, self.order, self.pack)

    def take(self, packs: torch.Tensor) -> tuple[torch.Tensor, PackLayout | None]:
        """The rows of ``packs`` (indices of this layout's packs) and those packs alone, as they are here: (the
        rows ``[b]``, indices of this layout's rows in their order; the layout of those rows, row i the i-th of
        them, its packs renumbered in their order here), or (rows, None) where no pack of them holds two rows —
        nothing shared, so their whole rows run. A micro-batch's packs are the step's by construction: the same
        rows in the same order at the same columns, whatever else the micro-batch holds."""
        chosen = torch.zeros(len(self.prompt), dtype=torch.bool)
        chosen[packs] = True
        inside = chosen[self.pack]  # by order
        members = self.order[inside]  # this layout's rows, in group order
        rows = members.sort().values
        if len(members) == int(chosen.sum()):  # one row a pack: no prompt computed once for two rows
            return rows, None
        local = torch.empty(len(self.order), dtype=torch.long)
        local[rows] = torch.arange(len(rows))
        renumber = chosen.long().cumsum(0) - 1  # each chosen pack's index among them
        return rows, PackLayout(local[members], self.length[inside], renumber[self.pack[inside]], self.column[inside],
                                self.prompt[chosen], self.group_of[chosen], self.distinct)

    def build(self, input_ids: torch.Tensor) -> SharedPrompts:
        """The packs' tensors (``SharedPrompts``, on the host) serving ``input_ids`` ``[B, L]``, the right-padded
        rows this layout is of (any width that holds every row's tokens: a trimmed micro-batch's)."""
        order, length, pack, column, pack_prompt = self.order, self.length, self.pack, self.column, self.prompt
        rows, width = input_ids.shape
        packs = len(pack_prompt)
        packed = int(self.pack_tokens().max())
        # the prompts
        cols = torch.arange(packed)
        in_prompt = cols[None, :] < pack_prompt[:, None]  # [n, W]
        prompt_ids = self.distinct[self.group_of].gather(1, cols.clamp(max=self.distinct.shape[1] - 1).expand(packs, -1))
        ids = torch.where(in_prompt, prompt_ids, 0)
        positions = torch.where(in_prompt, cols, 0)
        segments = torch.where(in_prompt, 0, -1)
        # the responses (but their last tokens), each after its pack's prompt and the responses before it
        width_s = int(length.max())
        t = torch.arange(width_s)
        valid = t[None, :] < length[:, None]  # [B, S], rows in group order
        target = pack[:, None] * packed + column[:, None] + t  # flat index into [n·W]
        source = (pack_prompt[pack][:, None] + t).clamp(max=width - 1)  # the tokens' columns in their whole rows
        ids.view(-1)[target[valid]] = input_ids[order].gather(1, source)[valid]
        positions.view(-1)[target[valid]] = source[valid]
        segments.view(-1)[target[valid]] = (order[:, None] + 1).expand(-1, width_s)[valid]
        last = pack * packed + pack_prompt[pack] - 1  # each row's prompt's last token
        gather = torch.empty((rows, width_s + 1), dtype=torch.long)
        gather[order] = torch.cat([last[:, None], torch.where(valid, target, last[:, None])], dim=1)
        return SharedPrompts(input_ids, ids, positions, segments, gather)


def layout(input_ids: torch.Tensor, attention: torch.Tensor, prompt: torch.Tensor,
           cap: int = PACK_TOKENS, budget: int | None = None) -> PackLayout | None:
    """The packs of right-padded rows ``[B, L]`` whose prompts are ``prompt`` ``[B]`` tokens long (host tensors);
    None where no prompt repeats. Rows whose prompts are equal token for token share a prompt. A group's rows fill
    packs in batch order, each pack's responses starting within its group's ``spans`` of its first: ``cap`` −
    len(prompt) (so such a pack ends at most one response past ``cap``), or for a long prompt up to len(prompt),
    within ``budget`` tokens a pack (the micro-batches' budget: the trainer lays out a step's rows once, and its
    micro-batches take whole packs, ``PackLayout.take``)."""
    rows, width = input_ids.shape
    if rows < 2 or int(prompt.min()) < 1:
        return None
    grouped = groups(torch.where(torch.arange(width) < prompt[:, None], input_ids, -1))
    if grouped is None:
        return None
    distinct, index, first = grouped
    prompt_len = prompt[first]  # [D]
    suffix = (attention.sum(dim=1) - prompt - 1).clamp(min=0)  # [B]: the response but its last token
    # the rows in group order, each group's in batch order; a row's offset among its group's responses
    order = torch.sort(index, stable=True).indices
    group, length = index[order], suffix[order]
    start = length.cumsum(0) - length
    offset = start - torch.zeros_like(prompt_len).scatter_reduce(0, group, start, "amin", include_self=False)[group]
    # pack k of a group: the rows whose responses start in [k·b, (k + 1)·b) of the group's responses back to back,
    # b its span (``spans``); a row with no response rides in the pack of the row before it (no pack of a prompt
    # alone, unless a group has nothing else)
    longest = torch.zeros_like(prompt_len).scatter_reduce(0, index, suffix, "amax", include_self=False)  # [D]
    chunk = torch.where(length > 0, offset // spans(prompt_len, longest, cap, budget)[group], 0)
    key = (group * (int(suffix.sum()) + 1) + chunk).cummax(0).values  # keys rise from group to group
    _, pack = torch.unique(key, return_inverse=True)  # packs in group order
    packs = int(pack.max()) + 1
    pack_group = torch.zeros(packs, dtype=torch.long).scatter(0, pack, group)
    pack_prompt = prompt_len[pack_group]  # [n]
    column = offset - torch.full((packs,), rows * width).scatter_reduce(0, pack, offset, "amin")[pack]
    column = column + pack_prompt[pack]  # where each row's response starts in its pack
    return PackLayout(order, length, pack, column, pack_prompt, pack_group, distinct)


def serves(model, shared: SharedPrompts | None, input_ids: torch.Tensor) -> bool:
    """Whether the trainer's forward of ``input_ids`` may take ``shared``: it was made for that very tensor and
    the model is eligible (``refusal``)."""
    if shared is None or shared.input_ids is not input_ids:
        return False
    return refusal(model, "packed") is None


def attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """The packs' attention ``[n, 1, W, W]`` (True: attends) from their ``segments`` (``SharedPrompts``): a token
    attends to the earlier tokens of its own segment and to its pack's prompt; padding only to itself (so no row of
    the softmax is empty)."""
    n, width = segments.shape
    i = torch.arange(width, device=segments.device)
    key, query = segments[:, None, :], segments[:, :, None]
    allowed = (i[None, :] <= i[:, None]) & (key >= 0) & (query >= 0) & ((key == 0) | (key == query))
    return (allowed | torch.eye(width, dtype=torch.bool, device=segments.device))[:, None]


def decoder_hidden(model, shared: SharedPrompts) -> torch.Tensor:
    """The decoder's last hidden states that predict each row's response tokens, ``[B, S + 1, H]`` (column t
    predicts response token t): one forward of the packs (``SharedPrompts``) through transformers' public custom
    4D attention mask and explicit positions, then each row's states gathered from its pack (the gather's
    backward sums the rows' gradients into their prompt's). The same function of the weights as the whole rows'
    forward at those positions."""
    decoder = model.get_decoder()
    out = decoder(input_ids=shared.ids, attention_mask=attention_mask(shared.segments),
                  position_ids=shared.positions, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [n, W, H]
    return hidden.reshape(-1, hidden.shape[-1])[shared.gather]
