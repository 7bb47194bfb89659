"""The trained model scored on its device: loading, precision, micro-batches and the one ``score``
that ``train`` (π_old, the samples' log ρ, the update's KL) and ``diagnose`` (the trainer's side of
the mismatch) both call.

A ``Scorer`` holds what travels together — the model, the engine's sampling support, the device, the
compute dtype and the token budget of a micro-batch — frozen, so every caller scores the same way:

    score(batch) = log π̃(y_t) ``[B, T]`` fp32 (``Scores``; the entropy and the support's log-probs as asked),
                   the rows split into micro-batches of ≤ ``budget`` padded tokens (``micro_batches``; whole
                   packs of the step's one pack plan where the forward packs each group), each trimmed of the
                   padding no row uses (``trim``) and moved to the device with its counted positions and its
                   packs' tensors (``to_device``).

A micro-batch's columns past its longest response are 0 (masked everywhere); a row's log-probs do not
depend on the split beyond the last bit of the matmuls.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from offpolicy.core.config import ConfigError
from offpolicy.core.metrics import Metrics
from offpolicy.policy.batch import TENSORS, Batch, Counted, PackLayout, pack_layout
from offpolicy.policy.head import Scores, trainer_scores
from offpolicy.policy.scorer_config import TRAINER_DTYPES
from offpolicy.core.sampling import SamplingConfig
from offpolicy.speed import shared_prompt

DTYPES = tuple(d for d in TRAINER_DTYPES if d != "auto")  # what auto resolves to (ScorerConfig.dtype)


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` named ``name`` (``auto`` = CUDA when available): train's ``trainer.device=`` and
    diagnose's ``--trainer-device`` alike.

    Raises:
        ConfigError: CUDA asked for but absent, or a CUDA index past the visible devices.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__} " + ("has CUDA " + torch.version.cuda + " but sees no GPU"
                                                      if torch.version.cuda else "is a CPU-only build")
            raise ConfigError(f"trainer.device={name}: CUDA is not available ({build}). Fix: trainer.device=cpu (or "
                              "auto; diagnose: --trainer-device), or install a CUDA build of torch on a machine with "
                              "a GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"trainer.device={name}: only {torch.cuda.device_count()} CUDA device(s) visible "
                              f"(cuda:0 … cuda:{torch.cuda.device_count() - 1}). Fix: a visible index, or "
                              "trainer.device=cuda")
    return device


def resolve_dtype(name: str, device: torch.device) -> tuple[str, str]:
    """The trainer's compute dtype (``fp32`` or ``bf16``) and why: ``name`` unless it is ``auto``."""
    if name != "auto":
        return name, "set in the config"
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16", "auto: CUDA with bf16: bf16 autocast compute, fp32 master weights"
    return "fp32", f"auto: {'CUDA without bf16' if device.type == 'cuda' else 'CPU'}: fp32"


def load_policy(path, device: torch.device):
    """The trainer's model: fp32 master weights on ``device`` — what ``train`` updates and what
    ``diagnose`` scores with (its bf16 is ``precision``'s autocast too, never bf16 weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def checkpoint_activations(model) -> None:
    """Gradient (activation) checkpointing on ``model``'s layers, non-reentrant, under the name the installed
    transformers has: ``activation_checkpointing_enable`` (transformers ≥ 5.24, where the old name warns and goes
    at 6.0), else ``gradient_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def precision(device: torch.device, trainer_dtype: str) -> contextlib.AbstractContextManager:
    """The forward's compute dtype: bf16 autocast over fp32 master weights, or nothing (fp32).

    fp32 master weights + bf16 compute is what FSDP's MixedPrecision (param_dtype bf16, fp32
    sharded master copy) and verl's actor use; the optimizer state and the update stay fp32, so
    small updates are not lost to bf16's 8-bit mantissa. Log-probs are taken in fp32 from the
    bf16 logits (``trainer_logprobs`` casts before the log-sum-exp).
    """
    if trainer_dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Part(NamedTuple):
    """One micro-batch of a step (``micro_batches``): its ``rows`` ``[b]`` of the CPU batch, and ``packs``, those
    rows' packs as the step's one pack plan has them (``PackLayout.take``: row i of the layout is ``rows[i]``), or
    None: their whole rows run."""

    rows: torch.Tensor
    packs: PackLayout | None = None


def micro_batches(batch: Batch, rows: torch.Tensor, budget: int | None, packed: bool = False) -> list[Part]:
    """``rows`` split into groups of at most ``budget`` padded tokens each (rows × the group's
    longest prompt + response); a row longer than the budget goes alone. Rows are taken
    shortest first, so rows of similar length share a group and little is padding. ``batch``
    must be on the CPU (its lengths are read on the host). ``budget=None``: one group.

    ``packed`` (the model's forward takes the packs: ``offpolicy.speed.shared_prompt``) and some prompt repeats: the
    step's rows are laid out in packs once (``pack_layout``, under ``budget``: a long prompt's packs grow only as far
    as the budget allows, ``shared_prompt.spans``), and the micro-batches take whole packs of that one plan, shortest
    first, each at most ``budget`` tokens of packs padded to its longest and at most one pack of a group — each
    micro-batch's packs are the step's slice (``PackLayout.take``), never planned again. Split by whole rows, the
    groups mix and each micro-batch computes again the prompt of every group it touches; and the budget then counts
    the tokens the packed forward holds."""
    if packed:
        found = pack_layout(batch, rows, budget)
        if found is not None:
            parts = [torch.arange(len(found.prompt))] if budget is None else [
                torch.tensor(part) for part in fill(found.pack_tokens(), budget, apart=found.group_of)]
            return [Part(rows[local], packs) for local, packs in (found.take(part) for part in parts)]
    if budget is None:
        return [Part(rows)]
    lengths = batch.attention_mask[rows].sum(dim=1)  # [b] prompt + response tokens
    return [Part(rows[torch.tensor(part, dtype=torch.long)]) for part in fill(lengths, budget)]


def fill(lengths: torch.Tensor, budget: int, apart: torch.Tensor | None = None) -> list[list[int]]:
    """Indices of ``lengths`` (host) shortest first, in groups of at most ``budget`` once padded to the group's
    longest (count × longest); one longer than the budget goes alone. ``apart`` (a key per index): two indices of
    one key never share a group."""
    groups: list[list[int]] = []
    widest = 0
    keys: set[int] = set()
    for i in torch.argsort(lengths, stable=True).tolist():
        width = int(lengths[i])
        key = None if apart is None else int(apart[i])
        if groups and (len(groups[-1]) + 1) * max(widest, width) <= budget and key not in keys:
            groups[-1].append(i)
            widest = max(widest, width)
        else:
            groups.append([i])
            widest = width
            keys = set()
        if key is not None:
            keys.add(key)
    return groups


def trim(batch: Batch) -> Batch:
    """``batch`` without the padding columns no row uses (CPU batch: lengths read on the host).
    Response tensors keep their first T' columns and inputs their first L' (rows are right-padded),
    so a trimmed micro-batch's ``[b, T']`` tensors are a prefix of the full batch's."""
    width = max(1, int(batch.attention_mask.sum(dim=1).max()))
    t_max = max(1, int(batch.mask.sum(dim=1).max()))
    return Batch(batch.input_ids[:, :width], batch.attention_mask[:, :width],
                 batch.positions[:, :t_max].clamp(max=width - 1), batch.response_ids[:, :t_max],
                 batch.mask[:, :t_max], batch.rollout_logprobs[:, :t_max], batch.versions,
                 kept=None if batch.kept is None else batch.kept[:, :t_max],
                 support=None if batch.support is None else batch.support.cut(t_max))


def to_device(batch: Batch, device: torch.device, packs: PackLayout | None = None) -> Batch:
    """The batch's tensors on ``device``, with the positions of its counted tokens and their kept sets
    (``Batch.counted``) worked out here while the mask is on the host: the forward then gathers them
    without reading the device (a ``nonzero`` of a CUDA mask waits for every kernel queued before it).
    ``packs``: the batch's rows' packs, as the step laid them out (``Part.packs``; ``pack_layout`` of the whole
    batch for a batch scored at once), whose tensors are made here; None: every row computes its whole prompt."""
    moved = Batch(*(getattr(batch, f).to(device, non_blocking=True) for f in TENSORS),
                  kept=None if batch.kept is None else batch.kept.to(device, non_blocking=True),
                  support=None if batch.support is None else batch.support.to(device, non_blocking=True))
    if batch.mask.device.type == "cpu":
        rows, cols = batch.mask.bool().nonzero(as_tuple=True)
        flat = None
        if batch.kept is not None:  # the counted tokens' sets, expanded here (``FlatKept``): host reads are free
            where = batch.kept.start.device
            flat = batch.kept[rows.to(where), cols.to(where)].flat().to(device, non_blocking=True)
        shared = None if packs is None else packs.build(batch.input_ids)
        moved.counted = Counted(moved.mask, device_index(rows, device), device_index(cols, device), moved.kept, flat,
                                None if shared is None else shared.to(device, moved.input_ids))
    return moved


@dataclass(frozen=True)
class Scorer:
    """The trained model as ``train`` and ``diagnose`` score it: ``model`` (fp32 master weights,
    ``load_policy``) on ``device``, the engine's ``sampling`` support, the compute ``dtype`` (``fp32``,
    or ``bf16`` autocast: ``precision``) and ``budget``, the padded tokens of one micro-batch
    (``micro_batches``; None: the whole batch at once). ``by_packs``: micro-batches of whole packs of the step's one
    pack plan where the model's forward packs (False: of whole rows, which then run whole — e.g. each row alone for
    ``diagnose --self-check``); ``packs``: the forward runs those packs (False: whole rows in the same
    micro-batches, the self-check's packing row)."""

    model: torch.nn.Module
    sampling: SamplingConfig
    device: torch.device
    dtype: str = "fp32"
    budget: int | None = None
    by_packs: bool = True
    packs: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"trainer dtype {self.dtype!r}: expected one of {', '.join(DTYPES)} (resolve 'auto' "
                              "with resolve_dtype first)")

    def whole(self) -> Scorer:
        """This scorer without a token budget: a few rows in one forward."""
        return replace(self, budget=None)

    def forward(self, mb: Batch, metrics: Metrics | None = None, *, entropy: bool = False,
                support: bool = False) -> Scores:
        """``head.trainer_scores`` of a device micro-batch under the configured precision: log π(y_t) ``[b, T']``
        fp32 and, as asked (``entropy``, ``support``), each token's entropy and log p_v of its support ids."""
        with precision(self.device, self.dtype):
            scores = trainer_scores(self.model, mb, self.sampling, metrics, entropy=entropy, support=support)
        return scores._replace(logprobs=scores.logprobs.to(torch.promote_types(scores.logprobs.dtype, torch.float32)))

    def micro_batches(self, batch: Batch, rows: torch.Tensor) -> list[Part]:
        """``rows`` of the CPU ``batch`` in micro-batches of at most ``budget`` padded tokens (whole packs of the
        step's one pack plan, where the model takes them and ``by_packs``)."""
        packed = self.by_packs and shared_prompt.refusal(self.model, "packed") is None
        return micro_batches(batch, rows, self.budget, packed=packed)

    def to_device(self, batch: Batch, part: Part) -> Batch:
        """``part``'s rows of the CPU ``batch``, trimmed of unused padding, on the device with their packs (unless
        ``packs`` is False)."""
        return to_device(trim(batch.select(part.rows)), self.device, part.packs if self.packs else None)

    @torch.no_grad()
    def score(self, batch: Batch, metrics: Metrics | None = None, *, entropy: bool = False,
              support: bool = False) -> Scores:
        """``Scores`` ``[B, T]`` fp32 on the device for the whole CPU ``batch``, in micro-batches; the
        columns past a micro-batch's longest response stay 0 (masked everywhere). The rows' order
        goes to the device once, after the last forward, without a host wait (``device_index``).
        ``metrics``: the forward's own (mean token entropy, outside mass); ``entropy``: also each
        token's entropy ``[B, T]`` (0 off the mask); ``support`` and the batch carrying score centering's support
        (``Batch.support``): also log π of its ids ``[B, T, K]``."""
        parts = self.micro_batches(batch, torch.arange(len(batch.mask)))
        width = batch.mask.shape[1]
        support = support and batch.support is not None
        logprobs, entropies, supports = [], [], []
        for part in parts:
            out = self.forward(self.to_device(batch, part), metrics, entropy=entropy, support=support)  # [b, T'] fp32
            logprobs.append(widen(out.logprobs, width))
            if entropy:
                entropies.append(widen(out.entropy, width))
            if support:  # back to the batch's K (a micro-batch carries only the slots it uses)
                lp = widen(out.support_logprobs, width)
                supports.append(torch.nn.functional.pad(lp, (0, batch.support.ids.shape[-1] - lp.shape[-1])))
        order = torch.cat([part.rows for part in parts])  # row of each stacked part
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        index = device_index(inverse, self.device)
        return Scores(torch.cat(logprobs)[index],  # [B, T]
                      torch.cat(entropies)[index] if entropy else None,
                      torch.cat(supports)[index] if support else None)  # [B, T, K]


def widen(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """``[b, T', ...]`` → ``[b, width, ...]`` with ``value`` (0: masked everywhere) in the new columns."""
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1]), value=value)


def device_index(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU index on ``device`` without a host wait: on CUDA through pinned memory, non-blocking (a
    plain ``.to(device)`` waits for every kernel queued before it)."""
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


