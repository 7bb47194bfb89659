"""The trainer's head: the one path from a causal LM to per-token numbers (docs/development.md, "The trainer's head").

π_θ in the update, π_old, and ``diagnose``'s trainer side all come from ``trainer_logprobs``:

    h   = decoder(prompt + response)                       [B, L, H]   no lm_head over L
    h_n = h[row_n, position_n]                             [N, H]      N = response tokens with mask = 1
    for each chunk c of C tokens (C · V · 4 bytes ≤ CHUNK_BYTES: 128 MiB on CUDA, 32 MiB on the CPU):
        z_c = W h_c + b   (Gemma: cap · tanh(z / cap)), cast to ≥ fp32        [C, V]
        log π̃(y_n) = renormalize_logprobs(z_c; τ, top-k, top-p, min-p)[y_n]    (docs/specification.md §6)
        H_n = −Σ_v π̃_v log π̃_v,   outside mass_n = 1 − Σ_{kept} softmax(z_c / τ)
    backward: each chunk is recomputed, so memory is O(C · V) whatever B·T.

How the field avoids the ``[B, T, V]`` logits, and why this module takes what it takes:

* TRL (``trl/trainer/utils.py`` ``selective_log_softmax``, ``logits_to_keep``) drops the prompt
  positions and takes the log-softmax row by row, but the model still returns ``[B, T, V]``
  logits that autograd keeps for the backward: memory grows with B·T·V.
* Liger's fused linear losses (``fused_linear_cross_entropy``) chunk the tokens and compute the
  gradient *during the forward*, because their loss is the last op. Here the log-probs feed a
  loss that is computed later (PPO ratio, IS weights, rejection masks, a global normaliser), so
  d loss / d log π is known only in the backward: gradients in the forward do not apply.
* Cut Cross-Entropy never holds even a chunk of logits (blockwise log-sum-exp in Triton, recompute
  in the backward, gradient filtering). Top-k / top-p renormalisation needs a sort over V per
  token, which its blockwise scheme does not express, and it is one kernel per CUDA target.
* verl's ``FusedLinearForPPO`` (``verl/utils/experimental/torch_functional.py``) is an autograd
  Function over chunks of tokens: log-prob and entropy per chunk in the forward, each chunk
  recomputed in the backward with hand-written gradients (temperature only, no top-k/top-p).

Taken: verl's shape — ``_ChunkedHead``, an autograd Function over chunks of tokens whose backward
recomputes each chunk — with the per-chunk numbers computed by ``renormalize_logprobs`` itself, in
the forward and in the backward: the gradient of log π̃(y) = z_y − logsumexp_K z is 1[v = y] − π̃_v
on the kept set K (0 off it), so temperature, top-k, top-p and a soft cap have one definition for
the values and the gradients (``_chunk_grad``), and the backward holds no more [C, V] buffers than
the forward. The linear layer's backward is written out so the weight gradient accumulates in
place (no [V, H] temporary per chunk, in any precision) and W is cast to the compute dtype once per
backward, not once per chunk. Hidden states of padding and prompt positions never reach the head:
the response tokens that count are gathered first, at positions the trainer works out on the host
when it moves a micro-batch to the device (``Batch.counted``), so the forward reads nothing back
from the device (a batch without them pays one ``nonzero`` of its mask). With the engine's kept sets
replayed (``Batch.kept``, ``offpolicy.core.kept_set``) each chunk makes its sets dense, ``[C, V]`` bool, in the
forward and again in the backward, from slices of the sets expanded id by id (``FlatKept``) whose
bounds the trainer also worked out on the host when it moved the micro-batch (``Batch.counted``): no
host read there either.

Precision: the head runs in the caller's autocast context, like the decoder (bf16 compute over
fp32 master weights), and the logits are cast to fp32 before any log-sum-exp; log-probs are fp32
(float64 for a float64 model, for exactness tests).

Architectures: a plain linear head (Llama, SmolLM2, Qwen2, Qwen3, Mistral, ...), with or without a
bias, tied or not; Gemma's ``final_logit_softcapping`` is applied exactly. A head that scales its
logits (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``)
is refused with one error, and any other difference from the model's own logits is caught by
``check_head`` on the first call: never silently wrong.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from offpolicy.core.config import ConfigError
from offpolicy.core.kept_set import FlatKept, KeptIds
from offpolicy.core.metrics import Metrics
from offpolicy.policy.batch import Batch
from offpolicy.core.sampling import SamplingConfig, outside_mass_metrics, renormalize_logprobs
from offpolicy.speed import cpu_linear, shared_prompt
from offpolicy.speed.cpu_linear import ONEDNN_WIDE_OUT, OneDNNLinear
from offpolicy.speed.shared_prompt import SharedPrompts

# one fp32 [C, V] buffer (a chunk's peak holds a handful): on CUDA large enough that a chunk's kernels
# are not launch-bound (128 MiB: 220 tokens at V = 151,936); on the CPU, where nothing is launched,
# small, and within glibc's mmap threshold ceiling (see ``_release_freed``)
CHUNK_BYTES = {"cuda": 128 * 2**20, "cpu": 32 * 2**20}
MIN_CHUNK = 16  # tokens: a huge vocabulary still gets matmuls worth launching
PROBE_TOKENS = 8  # check_head compares this many positions of the first row with the model's logits
# config fields of heads that do more than W·h + b, which this head does not reproduce
REFUSED_HEADS = {
    "logit_scale": "multiplies its logits by config.logit_scale (Cohere)",
    "logits_scaling": "rescales its logits by config.logits_scaling (Granite, HyperCLOVA X)",
    "lm_head_multiplier": "multiplies its logits by config.lm_head_multiplier (Falcon-H1)",
}


@dataclass(frozen=True)
class LinearHead:
    """The output layer z = W h + b, then (Gemma) z = cap · tanh(z / cap)."""

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None  # [V]
    softcap: float | None
    onednn: bool = False  # a vocabulary-wide ``OneDNNLinear`` head: its GEMMs go through oneDNN too (``cpu_linear``)


def chunk_tokens(vocab: int, device: torch.device | str = "cpu") -> int:
    """Tokens per chunk on ``device``: C · V · 4 bytes ≤ ``CHUNK_BYTES`` (at least ``MIN_CHUNK``)."""
    budget = CHUNK_BYTES["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return max(MIN_CHUNK, budget // (4 * vocab))


def linear_head(model) -> LinearHead:
    """``model``'s output layer as a ``LinearHead``.

    Raises:
        ConfigError: the model has no linear output embedding, or its head scales the logits
            (``REFUSED_HEADS``).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = type(model).__name__
    for key, what in REFUSED_HEADS.items():
        value = getattr(config, key, None)
        if value is not None and value != 1:
            raise ConfigError(
                f"model: {name} {what} ({key}={value}); offpolicy's trainer head (offpolicy/policy/head.py) "
                "reproduces a linear head and Gemma's soft cap only. Use a model with a plain head")
    out = model.get_output_embeddings()
    weight = getattr(out, "weight", None)
    if not isinstance(out, torch.nn.Linear) or weight is None or weight.dim() != 2:
        raise ConfigError(f"model: {name}'s output embedding is {type(out).__name__}, not a linear layer; "
                          "offpolicy's trainer head (offpolicy/policy/head.py) needs logits = W h + b")
    softcap = getattr(config, "final_logit_softcapping", None)
    # oneDNN for a vocabulary-wide head only: at the embedded model's [·, 128]·[128, 64] torch's GEMM is ahead
    onednn = isinstance(out, OneDNNLinear) and out.out_features >= ONEDNN_WIDE_OUT
    return LinearHead(weight, out.bias, float(softcap) if softcap else None, onednn)


def decoder_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The last hidden states ``[B, L, H]`` of ``model``'s decoder (after its final norm), no logits."""
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def shared_plan(model, batch: Batch) -> SharedPrompts | None:
    """The plan that computes each repeated prompt once (``Batch.counted.shared``, made on the host by
    ``score.to_device``) where it serves this batch and this model, else None: the whole rows are run. The one
    planner decides (``offpolicy.speed.shared_prompt.serves``: the batch's own ``input_ids``, an eligible model —
    its gate, plain full attention in every layer, SDPA, rotary frequencies that do not depend on the forward's
    length)."""
    counted = batch.counted
    plan = None if counted is None else counted.shared
    return plan if shared_prompt.serves(model, plan, batch.input_ids) else None


def shared_decoder_hidden(model, plan: SharedPrompts) -> torch.Tensor:
    """The decoder's last hidden states that predict each row's response tokens, ``[B, S + 1, H]`` (column t
    predicts response token t; ``offpolicy.speed.shared_prompt.decoder_hidden``): one forward of packs, each a
    prompt and its rows' responses back to back, so neither a prompt nor a short response's padding is computed
    once per row (docs/performance.md)."""
    return shared_prompt.decoder_hidden(model, plan)


def capped(lin: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The head's output ``W h + b`` (in the autocast dtype) as ≥ fp32 logits, soft-capped if the
    model caps them: z = cap · tanh(z / cap)."""
    logits = lin.to(torch.promote_types(lin.dtype, torch.float32))
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def head_logits(hidden: torch.Tensor, head: LinearHead) -> torch.Tensor:
    """z = W h + b, then the soft cap, as ≥ fp32 ``[..., V]``."""
    return capped(F.linear(hidden, head.weight, head.bias), head.softcap)


def check_head(model, head: LinearHead, input_ids: torch.Tensor) -> None:
    """Once per model: ``head_logits`` of the decoder's hidden states equal the model's own logits on
    ``input_ids`` ``[1, n]`` (eval mode, no autocast), so an architecture that does anything else
    after its decoder is refused instead of scored wrongly.

    Raises:
        ConfigError: the logits differ beyond the model dtype's rounding.
    """
    if getattr(model, "_offpolicy_head_checked", False):
        return
    modes = [(m, m.training) for m in model.modules()]  # restored module by module (a frozen part stays eval)
    model.eval()  # no dropout: both sides must be deterministic
    try:
        with torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
            ones = torch.ones_like(input_ids)
            want = model(input_ids=input_ids, attention_mask=ones).logits.to(torch.float64)  # [1, n, V]
            got = head_logits(decoder_hidden(model, input_ids, ones), head).to(torch.float64)
    finally:
        for module, training in modes:
            module.training = training
    scale = 1.0 + float(want.abs().max())
    tolerance = 64 * torch.finfo(head.weight.dtype).eps * scale
    error = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if not error <= tolerance:
        raise ConfigError(
            f"model: {type(model).__name__}'s logits are not W·h + b of its decoder's hidden states (max "
            f"difference {error:.3g} on a probe, tolerance {tolerance:.3g}); offpolicy's trainer head "
            "(offpolicy/policy/head.py) would score it wrongly. Use a model with a plain linear head")
    model._offpolicy_head_checked = True


def _chunk_numbers(lin: torch.Tensor, tokens: torch.Tensor, sampling: SamplingConfig, softcap: float | None,
                   stats: bool = False, keep: torch.Tensor | None = None, support: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One chunk: head output ``lin`` ``[C, V]`` → log π̃(y) ``[C]`` and, with ``stats``, the token
    entropy ``[C]`` and (truncated sampling) the outside mass ``[C]``. ``keep`` ``[C, V]``: the engine's
    kept set, replayed instead of the trainer's own top-k/top-p set (``offpolicy.core.kept_set``). ``support``
    ``[C, K]`` ids: also log π̃ of each (score centering's support, ``centring_support``)."""
    logits = capped(lin, softcap)
    want_outside = stats and sampling.truncates
    result = renormalize_logprobs(logits, **sampling.support(), return_outside_mass=want_outside, keep=keep)
    logprobs, outside = result if want_outside else (result, None)
    token_lp = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    support_lp = None if support is None else logprobs.gather(-1, support)
    return token_lp, token_entropy(logprobs) if stats else None, outside, support_lp


def _chunk_grad(lin: torch.Tensor, tokens: torch.Tensor, grad: torch.Tensor, sampling: SamplingConfig,
                softcap: float | None, keep: torch.Tensor | None = None, support: torch.Tensor | None = None,
                support_grad: torch.Tensor | None = None) -> torch.Tensor:
    """∂(Σ_n g_n log π̃(y_n) + Σ_{n,k} g_nk log π̃(s_nk)) / ∂lin ``[c, V]`` in ``lin``'s dtype, for head outputs
    ``lin`` (``support`` ``[c, K]`` ids s_nk and ``support_grad`` their g_nk, 0 where padded; or none):

        z = c·tanh(l / c) / τ   (no cap: z = l / τ);  log π̃(y) = z_y − logsumexp_{v ∈ K} z_v
        ∂ log π̃(y) / ∂z_v = 1[v = y] − π̃_v        (π̃_v = 0 for v ∉ K: the kept set K is constant
                                                     in z almost everywhere, as for autograd)
        so ∂/∂z_v of the sum = g 1[v = y] + Σ_k g_k 1[v = s_k] − (g + Σ_k g_k) π̃_v
        ∂z_v / ∂l_v = (1 − tanh²(l_v / c)) / τ

    with π̃ = exp(``renormalize_logprobs``) — the forward's own definition, on the forward's K (the
    engine's replayed set ``keep`` when given). A row with g = 0 (a
    token outside the support, a masked one) gets 0, even where its logits are not finite."""
    logits = lin.to(torch.promote_types(lin.dtype, torch.float32))
    squash = None
    if softcap is not None:
        squash = torch.tanh(logits / softcap)
        logits = softcap * squash
    d = renormalize_logprobs(logits, **sampling.support(), keep=keep)
    del logits
    g = grad.to(d.dtype).unsqueeze(-1)  # [c, 1]
    gs = None if support is None else support_grad.to(d.dtype)  # [c, K]
    d.exp_().mul_(-(g if gs is None else g + gs.sum(dim=-1, keepdim=True)))  # −(g + Σ_k g_k) π̃
    d.scatter_add_(-1, tokens.unsqueeze(-1), g)  # + g 1[v = y]
    quiet = g == 0  # a row with no gradient at all: 0 · NaN stays out of the weight gradient
    if gs is not None:
        d.scatter_add_(-1, support, gs)  # + Σ_k g_k 1[v = s_k]
        quiet &= (gs == 0).all(dim=-1, keepdim=True)
    d.masked_fill_(quiet, 0.0)
    if sampling.temperature != 1.0:
        d.div_(sampling.temperature)
    if squash is not None:
        d.mul_(1 - squash * squash)
    return d.to(lin.dtype)


def _mark_nonfinite(token_lp: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
    """−inf stays only where it means "outside the kept support": with finite logits nothing else can
    be −inf, so any other non-finite value (a model that overflowed) becomes NaN and meets ``nonfinite``."""
    finite = torch.isfinite(lin).all(dim=-1)
    return torch.where(finite | torch.isfinite(token_lp), token_lp, torch.full_like(token_lp, float("nan")))


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def _release_freed(device: torch.device, several_chunks: bool) -> None:
    """On the CPU, give a chunk's freed buffers back to the OS before the next chunk.

    A chunk's [C, V] buffers are at most 32 MiB, the ceiling of glibc's dynamic mmap threshold, so after
    the first one is freed glibc serves them from its heap; small tensors allocated between chunks
    (the [C] results) then split the freed blocks, and without a trim the heap — and the process's
    RSS — grows by about a chunk's buffers per chunk: linear in B·T after all. ``malloc_trim`` returns
    the free pages (measured: peak RSS flat from T to 4T). CUDA's caching allocator reuses its blocks."""
    if several_chunks and device.type == "cpu" and _TRIM is not None:
        _TRIM(0)


class _ChunkedHead(torch.autograd.Function):
    """log π̃(y_n) ``[N]`` from hidden states ``[N, H]``, one chunk of tokens at a time; the backward
    recomputes each chunk's logits under the forward's autocast state and takes its gradient from the
    same ``renormalize_logprobs`` (``_chunk_grad``): memory O(chunk · V). ``kept`` (``FlatKept`` of ``[N]``
    positions, or None): the engine's kept sets, made dense one chunk at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, sampling, softcap, chunk, stats, kept=None, support=None,
                onednn=False):
        n = hidden.shape[0]
        dtype = torch.promote_types(weight.dtype, torch.float32)
        token_lp = torch.empty(n, dtype=dtype, device=hidden.device)
        extra = torch.zeros((n, 2 if stats else 0), dtype=dtype, device=hidden.device)  # entropy, outside mass
        # score centering's support ids [N, K] (``centring_support``): log π̃ of each, 0 where ``support`` is -1
        present = None if support is None else support >= 0
        ids = None if support is None else support.clamp(min=0)
        support_lp = torch.zeros((n, 0 if support is None else support.shape[-1]), dtype=dtype, device=hidden.device)
        if kept is not None:
            kept.check(weight.shape[0])
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            lin = _linear(hidden[start:end], weight, bias, onednn)  # [c, V] in the autocast dtype
            keep = None if kept is None else kept.mask(start, end, lin.shape[-1])
            lp, entropy, outside, s_lp = _chunk_numbers(lin, tokens[start:end], sampling, softcap, stats, keep,
                                                        None if ids is None else ids[start:end])
            token_lp[start:end] = _mark_nonfinite(lp, lin)
            if s_lp is not None:
                support_lp[start:end] = torch.where(present[start:end], s_lp, torch.zeros((), dtype=s_lp.dtype,
                                                                                        device=s_lp.device))
            if stats:
                extra[start:end, 0] = entropy
                if outside is not None:
                    extra[start:end, 1] = outside
            del lin, lp, entropy, outside, keep, s_lp  # before the next chunk's: one chunk's buffers at a time
            _release_freed(hidden.device, n > chunk)
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.sampling, ctx.softcap, ctx.chunk, ctx.kept, ctx.onednn = sampling, softcap, chunk, kept, onednn
        ctx.save_for_backward(hidden, weight, bias, tokens, token_lp, ids, present, support_lp)
        ctx.mark_non_differentiable(extra)
        return token_lp, extra, support_lp

    @staticmethod
    def backward(ctx, grad_lp, _grad_extra, grad_support):
        hidden, weight, bias, tokens, token_lp, ids, present, support_lp = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        device, autocast, autocast_dtype = ctx.autocast
        # log π̃ = −inf (outside the support) is constant in the logits; NaN was flagged upstream
        grad_lp = torch.where(torch.isfinite(token_lp), grad_lp, torch.zeros((), dtype=grad_lp.dtype,
                                                                              device=grad_lp.device))
        if ids is not None:  # padding and a non-finite log π̃ of a support id take no gradient
            grad_support = torch.zeros_like(support_lp) if grad_support is None else torch.where(
                present & torch.isfinite(support_lp), grad_support, torch.zeros((), dtype=grad_support.dtype,
                                                                                 device=grad_support.device))
        d_hidden = torch.zeros_like(hidden) if need_hidden else None
        d_weight = torch.zeros_like(weight) if need_weight else None
        d_bias = torch.zeros_like(bias) if need_bias else None
        # the forward's autocast casts, done once for the whole backward: a fresh autocast region per
        # chunk would cast W [V, H] again in every chunk (its cast cache lives as long as the region)
        weight_c = _compute_dtype(weight, autocast, autocast_dtype)
        bias_c = _compute_dtype(bias, autocast, autocast_dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(hidden.shape[0], start + ctx.chunk)
            h = _compute_dtype(hidden[start:end], autocast, autocast_dtype)
            lin = _linear(h, weight_c, bias_c, ctx.onednn)  # the forward's [c, V], recomputed with the same casts
            keep = None if ctx.kept is None else ctx.kept.mask(start, end, lin.shape[-1])
            d_lin = _chunk_grad(lin, tokens[start:end], grad_lp[start:end], ctx.sampling, ctx.softcap, keep,
                                *((None, None) if ids is None else (ids[start:end], grad_support[start:end])))
            del lin, keep
            # the linear layer's backward in the compute dtype, as autograd does under autocast
            if need_hidden:
                d_hidden[start:end] = _linear(d_lin, weight_c.t(), None, ctx.onednn).to(hidden.dtype)  # d_lin W
            if need_weight:
                _add_weight_grad(d_weight, d_lin, h.to(d_lin.dtype))
            if need_bias:
                d_bias.add_(d_lin.sum(dim=0))
            del d_lin  # before the next chunk's: one chunk's buffers at a time
            _release_freed(hidden.device, hidden.shape[0] > ctx.chunk)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None, None, None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """``x Wᵀ + b`` of a chunk: through oneDNN where the model's own layers are (``LinearHead.onednn``; there
    1.3× torch's GEMM at SmolLM2's [170, 576]·[576, 49,152] on one thread), else ``F.linear``."""
    return cpu_linear.linear(x, weight, bias) if onednn else F.linear(x, weight, bias)


def _compute_dtype(x: torch.Tensor | None, autocast: bool, dtype: torch.dtype) -> torch.Tensor | None:
    """``x`` as the forward's autocast region handed it to ``F.linear``: floating tensors but float64
    cast to the autocast dtype (autocast's own eligibility rule); unchanged without autocast."""
    if x is None or not autocast or not x.is_floating_point() or x.dtype == torch.float64:
        return x
    return x.to(dtype)


def _add_weight_grad(d_weight: torch.Tensor, d_lin: torch.Tensor, h: torch.Tensor) -> None:
    """d_weight += d_linᵀ h in place, with no [V, H] temporary: in d_weight's dtype when the chunk's
    product is in it; a bf16/fp16 product (autocast over fp32 master weights) is accumulated in fp32
    into d_weight itself — on CUDA by the GEMM (``out_dtype``: low-precision inputs, fp32 accumulator
    and output), elsewhere from the chunk's fp32 copy of d_lin ([c, V], a chunk's budget, not [V, H]).
    Before, each chunk made a bf16 [V, H] product and added it into the fp32 gradient: ≈ 2.4 GB of
    traffic per chunk at V = 151,936, H = 896."""
    if d_lin.dtype == d_weight.dtype:
        d_weight.addmm_(d_lin.t(), h)
    elif d_weight.is_cuda:
        torch.addmm(d_weight, d_lin.t(), h, out_dtype=d_weight.dtype, out=d_weight)
    else:
        d_weight.addmm_(d_lin.t().to(d_weight.dtype), h.to(d_weight.dtype))


class TokenScores(NamedTuple):
    """What ``token_logprobs`` computes for ``[N]`` tokens, flat in N."""

    logprobs: torch.Tensor  # [N] log π̃(y_n): −inf exactly outside the kept support, NaN any other non-finite value
    entropy: torch.Tensor | None = None  # [N] token entropy, detached; None without ``stats``
    outside: torch.Tensor | None = None  # [N] mass outside the kept set, detached; None without ``stats`` or truncation
    support_logprobs: torch.Tensor | None = None  # [N, K] log π̃ of each support id, with grad, 0 at padding


def token_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, head: LinearHead, sampling: SamplingConfig, *,
                   stats: bool = False, chunk: int | None = None, kept: KeptIds | FlatKept | None = None,
                   support: torch.Tensor | None = None) -> TokenScores:
    """log π̃(y_n) ``[N]`` of tokens ``[N]`` from their hidden states ``[N, H]``, flat in N (``TokenScores``).

    ``stats``: also the token entropy ``[N]`` and, under top-k/top-p, the outside mass ``[N]``
    (detached; else None). A token outside the kept support gets exactly −inf; NaN marks any other
    non-finite value. ``chunk`` tokens per chunk (default ``chunk_tokens(V, device)``). ``kept``
    (``KeptIds`` ``[N]``, or its ``FlatKept``): the engine's kept set of each token, the support instead of
    the trainer's own top-k/top-p set (``offpolicy.core.kept_set``); None recomputes it from the trainer's
    logits. ``KeptIds`` are expanded here (two host reads: a wait on CUDA); the trainer passes the
    ``FlatKept`` it made on the host (``Batch.counted``). ``support`` ``[N, K]`` ids (−1: padding): also log π̃ of
    each support id ``[N, K]`` (``support_logprobs``, with grad, 0 at padding), taken from the same chunk's
    log-probs as log π̃(y) and differentiated in the same backward (score centering's support: the replayed kept
    set for ``exact``, any ids of the untruncated distribution for ``head``).

    Raises:
        ValueError: a kept id outside the head's vocabulary.
    """
    chunk = chunk or chunk_tokens(head.weight.shape[0], hidden.device)
    if isinstance(kept, KeptIds):
        kept = kept.flat()
    token_lp, extra, support_lp = _ChunkedHead.apply(hidden, head.weight, head.bias, tokens, sampling, head.softcap,
                                                     chunk, stats, kept, support, head.onednn)
    support_lp = None if support is None else support_lp
    if not stats:
        return TokenScores(token_lp, support_logprobs=support_lp)
    return TokenScores(token_lp, extra[:, 0], extra[:, 1] if sampling.truncates else None, support_lp)


def counted_positions(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) ``[N]`` each of the tokens with mask 1: the copy the trainer worked out on the host
    (``Batch.counted``, set by ``score.to_device``) while it belongs to the batch's current mask, else
    a ``nonzero`` of the mask (on CUDA, a host wait for the work queued before it)."""
    if batch.counted is not None and batch.counted.mask is batch.mask:
        return batch.counted.rows, batch.counted.cols
    return batch.mask.bool().nonzero(as_tuple=True)


class Scores(NamedTuple):
    """What the trainer's head computes for a batch (``trainer_scores``), ``[B, T]`` response-aligned."""

    logprobs: torch.Tensor  # [B, T] log π(y_t) fp32 (float64 for a float64 model), 0 where the mask is 0
    entropy: torch.Tensor | None = None  # [B, T] each token's entropy, 0 where the mask is 0; None unless asked
    # [B, T, K] log p_v of the batch's score-centering support ids (``Batch.support``), with grad, 0 where padded or
    # the mask is 0; None unless asked for and the batch carries a support
    support_logprobs: torch.Tensor | None = None


def trainer_logprobs(model, batch: Batch, sampling: SamplingConfig, metrics: Metrics | None = None, *,
                     chunk: int | None = None) -> torch.Tensor:
    """log π(y_t) ``[B, T]``: ``trainer_scores``' log-probs alone."""
    return trainer_scores(model, batch, sampling, metrics, chunk=chunk).logprobs


def trainer_scores(model, batch: Batch, sampling: SamplingConfig, metrics: Metrics | None = None, *,
                   chunk: int | None = None, entropy: bool = False, support: bool = False) -> Scores:
    """log π(y_t) ``[B, T]`` (fp32; float64 for a float64 model) under ``model`` on the engine's
    sampling support (docs/specification.md §6), 0 where ``batch.mask`` is 0; −inf exactly where the sampled token
    lies outside the trainer's top-k/top-p support (the caller masks those, see
    ``train.update.within_support``). Where the batch carries the engine's kept sets (``Batch.kept``: the hf
    engine records them) and sampling truncates, the support is the engine's set, replayed
    (``offpolicy.core.kept_set``); otherwise the trainer recomputes top-k/top-p on its own logits. With
    ``metrics``, ``kept_set_replayed`` says which (1: replayed, 0: recomputed).

    With ``metrics`` given, the mean token entropy of the sampling distribution is recorded as
    ``entropy`` (``token_entropy``; the denominator of prime-rl's mismatch KL / entropy, issue #25)
    and, with top-k/top-p, the mass the sampler truncated away (``outside_mass``,
    ``outside_mass_max``; see ``outside_mass_metrics``). ``entropy``: also each token's entropy ``[B, T]``
    (``Scores.entropy``, 0 where ``batch.mask`` is 0): the per-token viewer shows it. ``support`` and the batch
    carrying score centering's support (``Batch.support``): also log p_v of each support id ``[B, T, K]``
    (``Scores.support_logprobs``, with grad; 0 where padded or ``batch.mask`` is 0), from the same chunks and
    backward as log π(y_t) (``centring_support``, ``token_logprobs``).

    Raises:
        ConfigError: a head this module does not reproduce (``linear_head``, ``check_head``).
        ValueError: a support its form cannot normalise (``centring_support``).
    """
    rows, cols = counted_positions(batch)  # [N] each, the response tokens that count
    kept = replayed_sets(batch, sampling, rows, cols)
    head = linear_head(model)
    check_head(model, head, batch.input_ids[:1, :PROBE_TOKENS])
    plan = shared_plan(model, batch)
    if plan is None:
        hidden = decoder_hidden(model, batch.input_ids, batch.attention_mask)[rows, batch.positions[rows, cols]]
    else:  # each repeated prompt once: column t predicts response token t
        hidden = shared_decoder_hidden(model, plan)[rows, cols]
    ids = centring_support(batch, sampling, kept, rows, cols) if support and batch.support is not None else None
    out = token_logprobs(hidden, batch.response_ids[rows, cols], head, sampling,  # hidden: [N, H]
                         stats=metrics is not None or entropy, chunk=chunk, kept=kept, support=ids)
    if metrics is not None:
        metrics.mean("entropy", out.entropy)
        if out.outside is not None:
            outside_mass_metrics(out.outside, torch.ones_like(out.outside, dtype=torch.bool), metrics)
            metrics.mean("kept_set_replayed", torch.full_like(out.outside, float(kept is not None)))
    return Scores(per_token(out.logprobs, batch.mask, rows, cols),  # [B, T]
                  per_token(out.entropy, batch.mask, rows, cols) if entropy else None,
                  None if ids is None else per_token(out.support_logprobs, batch.mask, rows, cols))  # [B, T, K]


def per_token(values: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``values`` ``[N, ...]`` of the counted tokens (``rows``, ``cols``) placed in ``mask``'s ``[B, T, ...]``, 0
    elsewhere."""
    out = torch.zeros((*mask.shape, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_put((rows, cols), values)


def centring_support(batch: Batch, sampling: SamplingConfig, kept: FlatKept | None, rows: torch.Tensor,
                     cols: torch.Tensor) -> torch.Tensor:
    """The support ids ``[N, K]`` of the counted tokens (−1 where padded) for ``token_logprobs``: p over the same
    set as log π̃(y) — for ``exact`` the replayed kept set (so the batch must carry it), for ``head`` the
    untruncated distribution (so sampling must not truncate).

    Raises:
        ValueError: a support the head cannot normalise as its form says."""
    sup = batch.support
    if sup.form == "exact" and kept is None:
        raise ValueError("score centering 'exact' renormalises p over the engine's replayed kept set, and this batch "
                         "replays none (no Batch.kept, or untruncated sampling)")
    if sup.form == "head" and sampling.truncates:
        raise ValueError("score centering 'head' takes p over the full vocabulary, which truncated sampling does not "
                         "give the trainer: use 'exact' over the replayed kept sets")
    ids = sup.ids[rows, cols]
    return torch.where(sup.mask[rows, cols], ids, torch.full_like(ids, -1))


def replayed_sets(batch: Batch, sampling: SamplingConfig, rows: torch.Tensor, cols: torch.Tensor
                  ) -> FlatKept | None:
    """The engine's kept sets of the ``[N]`` counted tokens (``rows``, ``cols``) when the batch carries them
    and sampling truncates (without truncation the set is the whole vocabulary: nothing to replay), else
    None: the ``FlatKept`` the trainer made on the host (``Batch.counted``), or made here (two host reads)."""
    if batch.kept is None or not sampling.truncates:
        return None
    counted = batch.counted
    if counted is not None and counted.mask is batch.mask and counted.kept is batch.kept and counted.flat is not None:
        return counted.flat
    return batch.kept[rows, cols].flat()


@torch.no_grad()
def token_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """H_t = −Σ_v p_v log p_v of each position's distribution, ``[..., V]`` log-probs → ``[...]`` fp32.

    prime-rl's ``compute_entropy`` (src/prime_rl/trainer/rl/loss.py) takes the same quantity from the
    logits as logsumexp(z) − Σ softmax(z)·z; tokens outside a top-k/top-p support have log p = −inf and
    p = 0, and contribute 0 (not 0 · −inf = NaN).
    """
    lp = logprobs.float()
    plogp = lp.exp()  # p, then p · log p in place: one [.., V] buffer besides a mask
    zero = plogp == 0
    return -plogp.mul_(lp).masked_fill_(zero, 0.0).sum(-1)
