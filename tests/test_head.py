"""The trainer's head (issue #31, train/head.py): the chunked path from hidden states to log π̃ equals
the full-logits path it replaced — values and gradients, at a small and at real vocabularies, with and
without temperature / top-k / top-p, in fp32, bf16 autocast and float64, on rows of different lengths
with chunks that split rows — never holds a [B, T, V] tensor, handles or refuses every head, and marks
tokens outside the kept support with −inf exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offpolicy.core.config import ConfigError
from offpolicy.engines import SamplingConfig
from offpolicy.core.metrics import Metrics
from offpolicy.core.sampling import renormalize_logprobs
from offpolicy.policy.batch import Batch
from offpolicy.policy.head import chunk_tokens, token_entropy, trainer_logprobs

SAMPLINGS = {
    "plain": SamplingConfig(),
    "temperature": SamplingConfig(temperature=0.7),
    "top_k": SamplingConfig(top_k=5),
    "top_p": SamplingConfig(temperature=1.3, top_p=0.8),
    "all": SamplingConfig(temperature=0.7, top_k=10, top_p=0.9),
}


def full_logits_logprobs(model, batch: Batch, sampling: SamplingConfig) -> torch.Tensor:
    """The head before issue #31 (train/batch.py at 4efb1a7), kept here as the reference: the model's
    logits at every position [B, L, V], gathered at the response positions [B, T, V], renormalised."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, L, V]
    index = batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    response_logits = logits.gather(1, index).to(torch.promote_types(logits.dtype, torch.float32))  # [B, T, V]
    logprobs = renormalize_logprobs(response_logits, top_p=sampling.top_p, top_k=sampling.top_k,
                                    temperature=sampling.temperature)
    token_lp = logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.mask.bool(), token_lp, torch.zeros((), dtype=token_lp.dtype))


def tiny_causal_lm(family: str, vocab: int, hidden: int = 16, seed: int = 0, **extra):
    """A two-layer causal LM of ``family`` built in code (no file, no download)."""
    import transformers

    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "cohere": ("CohereConfig", "CohereForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    }[family]
    config = getattr(transformers, config_cls)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=64, **extra)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).eval()


def ragged_batch(model, vocab: int, seed: int = 0, b: int = 4, t: int = 7) -> Batch:
    """Right-padded rows of different prompt and response lengths. Most response tokens are among the
    model's three likeliest at their position (inside a top-k/top-p support), some are drawn uniformly
    (mostly outside it): both kinds are checked."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([3, 5, 2, 4])[:b]
    response_len = torch.tensor([7, 2, 5, 1])[:b]
    width = int((prompt_len + response_len).max())
    input_ids = torch.randint(0, vocab, (b, width), generator=g)
    attention = (torch.arange(width)[None] < (prompt_len + response_len)[:, None]).long()
    positions = (prompt_len[:, None] - 1 + torch.arange(t)[None]).clamp(max=width - 1)
    mask = (torch.arange(t)[None] < response_len[:, None]).float()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention).logits.float()  # [B, L, V]
    ranked = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, vocab)).argsort(-1, descending=True)
    likely = ranked.gather(-1, torch.randint(0, 3, (b, t, 1), generator=g)).squeeze(-1)
    uniform = torch.randint(0, vocab, (b, t), generator=g)
    response = torch.where(torch.rand(b, t, generator=g) < 0.8, likely, uniform)
    return Batch(input_ids, attention, positions, response, mask, torch.zeros(b, t), torch.zeros(b, dtype=torch.long))


def value_and_grads(fn, model, batch: Batch, weights: torch.Tensor):
    """log π̃ [B, T] and ∇ of Σ w·log π̃ over the finite tokens, for every parameter."""
    model.zero_grad(set_to_none=True)
    lp = fn()
    finite = torch.isfinite(lp)
    (torch.where(finite, lp, 0.0) * weights.to(lp.dtype)).sum().backward()
    return lp.detach(), [p.grad.clone() for p in model.parameters()]


# every setting at V = 97; the real vocabularies, 49,152 (SmolLM2) and 151,936 (Qwen2.5) with a hidden
# size of 16, untruncated and truncated, in fp32 and bf16 autocast
CASES = [(97, precision, name) for precision in ("fp32", "bf16", "fp64") for name in SAMPLINGS] + [
    (49_152, "fp32", "plain"), (49_152, "bf16", "all"), (151_936, "bf16", "temperature"), (151_936, "fp32", "all")]


@pytest.mark.parametrize(("vocab", "precision", "name"), CASES)
def test_chunked_head_equals_the_full_logits_path(vocab, precision, name):
    sampling = SAMPLINGS[name]
    model = tiny_causal_lm("llama", vocab)
    if precision == "fp64":
        model = model.double()
    batch = ragged_batch(model, vocab)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        want, want_grads = value_and_grads(lambda: full_logits_logprobs(model, batch, sampling), model, batch, weights)
    assert int(batch.mask.sum()) == 15
    for chunk in (None, 4):  # one chunk for everything; chunks of 4 split rows 0 and 2 across chunks
        with autocast:
            got, grads = value_and_grads(lambda: trainer_logprobs(model, batch, sampling, chunk=chunk), model,
                                         batch, weights)
        assert got.dtype == (torch.float64 if precision == "fp64" else torch.float32)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))  # the same tokens outside the support
        assert torch.isfinite(got[batch.mask.bool() & ~torch.isneginf(got)]).all()
        if name in ("top_k", "all"):
            assert torch.isneginf(got).any() and torch.isfinite(got[batch.mask.bool()]).any()  # both kinds
        # bf16: the same bf16 products, summed per chunk rather than over all rows at once
        rtol, atol = {"fp32": (1e-5, 1e-5), "bf16": (1e-2, 1e-2), "fp64": (1e-12, 1e-12)}[precision]
        torch.testing.assert_close(torch.where(torch.isfinite(got), got, 0), torch.where(torch.isfinite(want), want, 0),
                                   rtol=rtol, atol=atol)
        for a, b in zip(grads, want_grads):
            scale = float(b.abs().max()) + 1e-30
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma2"])
def test_architectures_score_as_their_own_logits(family):
    """Qwen2, Qwen3 and Mistral heads are W·h; Gemma 2 soft-caps its logits (cap · tanh(z / cap)),
    which the head applies exactly. Logits scaled up so a missing soft cap would show."""
    extra = {"final_logit_softcapping": 3.0} if family == "gemma2" else {}
    model = tiny_causal_lm(family, 97, seed=2, **extra)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)  # logits of order 10: tanh(z / 3) is far from z / 3
    batch = ragged_batch(model, 97, seed=2)
    for sampling in (SAMPLINGS["plain"], SAMPLINGS["all"]):
        with torch.no_grad():
            want = full_logits_logprobs(model, batch, sampling)
            got = trainer_logprobs(model, batch, sampling, chunk=3)
        torch.testing.assert_close(torch.where(torch.isfinite(got), got, 0), torch.where(torch.isfinite(want), want, 0),
                                   rtol=1e-5, atol=1e-5)


def test_a_head_that_scales_its_logits_is_refused():
    model = tiny_causal_lm("cohere", 97, logit_scale=0.0625)
    batch = ragged_batch(model, 97)
    with pytest.raises(ConfigError, match=r"model: CohereForCausalLM multiplies its logits by config.logit_scale"):
        trainer_logprobs(model, batch, SAMPLINGS["plain"])


def test_any_other_difference_from_the_model_logits_is_refused():
    """An architecture the head does not know (here: logits doubled after lm_head) is caught by the probe."""
    from transformers import LlamaForCausalLM

    class Doubled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    base = tiny_causal_lm("llama", 97)
    model = Doubled(base.config)
    model.load_state_dict(base.state_dict())
    with pytest.raises(ConfigError, match=r"model: Doubled's logits are not W·h \+ b of its decoder's hidden states"):
        trainer_logprobs(model, ragged_batch(base, 97), SAMPLINGS["plain"])


def long_rows_batch(vocab: int, b: int, t: int, kept=None) -> tuple[torch.nn.Module, Batch]:
    """A two-layer llama at ``vocab`` and ``b`` rows of 6 prompt + ``t`` response tokens, drawn uniformly
    (seed 0); ``kept(input_ids, generator)``: the engine's kept sets of the response tokens (``Batch.kept``)."""
    model = tiny_causal_lm("llama", vocab, hidden=8)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (b, t + 6), generator=g)
    positions = (5 + torch.arange(t))[None].expand(b, t)
    return model, Batch(input_ids, torch.ones_like(input_ids), positions, input_ids[:, 6:], torch.ones(b, t),
                        torch.zeros(b, t), torch.zeros(b, dtype=torch.long),
                        kept=None if kept is None else kept(input_ids, g))


class _LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_grows_with_tokens_times_vocabulary():
    """Forward and backward at 4 rows × 32 response tokens, chunks of 8: no op returns more than one
    chunk's [8, V] (the [V, H] gradient of the embedding is smaller here), where the old path held
    [4, 38, V] logits — 19 times more."""
    vocab, chunk, b, t = 2048, 8, 4, 32
    model, batch = long_rows_batch(vocab, b, t)
    trainer_logprobs(model, batch, SAMPLINGS["all"], chunk=chunk)  # the one-time head check runs outside the count
    with _LargestTensor() as seen:
        lp = trainer_logprobs(model, batch, SAMPLINGS["all"], Metrics(), chunk=chunk)
        torch.where(torch.isfinite(lp), lp, 0).sum().backward()
    assert seen.largest <= chunk * vocab < b * (t + 6) * vocab // 16


def test_chunk_size_is_bounded_in_bytes():
    assert chunk_tokens(151_936) == 55 and chunk_tokens(49_152) == 170  # CPU: 32 MiB / (4 · V)
    assert chunk_tokens(151_936, "cuda") == 220 and chunk_tokens(49_152, "cuda:1") == 682  # CUDA: 128 MiB
    assert chunk_tokens(10_000_000) == 16  # never fewer than 16 tokens per matmul


def test_outside_the_support_is_exactly_minus_inf_and_overflow_is_nan():
    model = tiny_causal_lm("llama", 97)
    batch = ragged_batch(model, 97)
    with torch.no_grad():
        lp = trainer_logprobs(model, batch, SAMPLINGS["top_k"])
        assert torch.isneginf(lp).any() and not torch.isnan(lp).any()
        model.get_output_embeddings().weight[5].fill_(float("inf"))  # a model that overflows
        model._offpolicy_head_checked = True  # past the one-time probe, as in the middle of a run
        broken = trainer_logprobs(model, batch, SAMPLINGS["plain"])
    counted = batch.mask.bool()
    assert torch.isnan(broken[counted]).all()  # never −inf: NaN meets the loss's `nonfinite` policy


def test_metrics_are_the_full_distributions_entropy_and_outside_mass():
    model = tiny_causal_lm("llama", 97)
    batch = ragged_batch(model, 97)
    sampling = SAMPLINGS["all"]
    metrics = Metrics()
    with torch.no_grad():
        trainer_logprobs(model, batch, sampling, metrics, chunk=4)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        response = logits.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, 97))
        full, outside = renormalize_logprobs(response, top_p=0.9, top_k=10, temperature=0.7, return_outside_mass=True)
    counted = batch.mask.bool()
    values = metrics.to_dict()
    assert values["offpolicy/entropy"] == pytest.approx(token_entropy(full)[counted].double().mean().item(), rel=1e-6)
    assert values["offpolicy/outside_mass"] == pytest.approx(outside[counted].double().mean().item(), rel=1e-6)
    assert values["offpolicy/outside_mass_max"] == pytest.approx(outside[counted].max().item(), rel=1e-6)
    plain = Metrics()
    with torch.no_grad():
        trainer_logprobs(model, batch, SAMPLINGS["plain"], plain)
    assert "offpolicy/outside_mass" not in plain.to_dict() and plain.to_dict()["offpolicy/entropy"] > 0


class _WeightTraffic(TorchDispatchMode):
    """While on: how many ops cast ``weight`` (read it and return a tensor of another dtype), and how many
    return a new tensor of its [V, H] shape (one that is none of the op's inputs: not an in-place update)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.ptr, self.shape = weight.data_ptr(), tuple(weight.shape)
        self.casts, self.new_vh = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        if any(a.data_ptr() == self.ptr for a in inputs) and any(t.dtype != torch.float32 for t in outputs):
            self.casts += 1
        ptrs = {a.data_ptr() for a in inputs}
        self.new_vh += [str(func) for t in outputs if tuple(t.shape) == self.shape and t.data_ptr() not in ptrs]
        return out


def test_the_bf16_backward_casts_w_once_and_adds_no_vh_temporary_per_chunk():
    """Issue #44 item 2. bf16 autocast over fp32 master weights, 15 tokens in chunks of 4: the backward casts
    W to bf16 once (a fresh autocast region per chunk cast it in each: 4 casts), and the weight gradient is
    accumulated in fp32 in place — the only new [V, H] tensors are that cast and the gradient buffer (before:
    one bf16 [V, H] product per chunk too). The gradient is that of float64 within bf16's rounding."""
    from offpolicy.policy.head import LinearHead, token_logprobs

    vocab, width, n, chunk = 512, 8, 15, 4
    g = torch.Generator().manual_seed(0)
    master = torch.randn(vocab, width, generator=g) / 3
    hidden0 = torch.randn(n, width, generator=g)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.randn(n, generator=g)
    grads = {}
    for precision in ("bf16", "fp64"):
        dtype = torch.float64 if precision == "fp64" else torch.float32
        weight = master.to(dtype, copy=True).requires_grad_(True)
        hidden = hidden0.to(dtype, copy=True).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            lp = token_logprobs(hidden, tokens, LinearHead(weight, None, None), SAMPLINGS["temperature"],
                                      chunk=chunk).logprobs
        with _WeightTraffic(weight) as seen:
            (lp * weights.to(lp.dtype)).sum().backward()
        if precision == "bf16":
            assert seen.casts == 1, seen.casts
            assert sorted(seen.new_vh) == ["aten._to_copy.default", "aten.zeros_like.default"], seen.new_vh
        grads[precision] = (weight.grad.double(), hidden.grad.double())
    for got, want in zip(grads["bf16"], grads["fp64"]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def grouped_batch(vocab: int, groups: int = 3, group_size: int = 4, seed: int = 0, one_token_prompt: bool = False,
                  longest: int = 7):
    """GRPO's layout: ``groups`` prompts of different lengths, each ``group_size`` times, with responses of
    1 to ``longest`` tokens (one row without any); through ``to_batch`` as the trainer builds it."""
    from offpolicy.engines import Rollouts
    from offpolicy.policy.batch import to_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (1 if one_token_prompt and k == 0 else 2 + 2 * k,), generator=g).tolist()
               for k in range(groups)]
    rows = [p for p in prompts for _ in range(group_size)]
    responses = [torch.randint(1, vocab, (int(n),), generator=g).tolist()
                 for n in torch.randint(1, longest + 1, (len(rows),), generator=g)]
    responses[1] = []
    return to_batch(Rollouts(rows, responses, [[-1.0] * len(r) for r in responses], [True] * len(rows), version=0), 0)


def with_packs(batch: Batch) -> Batch:
    """``batch`` on the CPU scored as one micro-batch: with the packs of its ``pack_layout`` (the step's one plan)."""
    from offpolicy.policy.batch import pack_layout
    from offpolicy.policy.score import to_device

    return to_device(batch, torch.device("cpu"), pack_layout(batch))


def plan(input_ids, attention, prompt, **kw):
    """The packs' tensors of rows laid out as one step (``layout``, then ``PackLayout.build``), or None."""
    from offpolicy.speed.shared_prompt import layout

    found = layout(input_ids, attention, prompt, **kw)
    return None if found is None else found.build(input_ids)


@pytest.mark.parametrize(("family", "name", "precision", "shape"), [
    ("llama", "plain", "fp32", {}), ("qwen2", "all", "fp32", {}), ("qwen3", "top_p", "fp32", {}),
    ("llama", "plain", "fp64", {}), ("qwen2", "temperature", "bf16", {}),
    ("llama", "all", "fp32", {"one_token_prompt": True}), ("qwen2", "plain", "fp32", {"longest": 1})])
def test_a_repeated_prompt_computed_once_scores_as_the_whole_rows(family, name, precision, shape):
    """Issues #49 and #57: where prompts repeat (GRPO's groups), the forward packs each distinct prompt with its
    rows' responses (``SharedPrompts``, made on the host by ``to_device`` from the batch's ``pack_layout``) and runs
    the packs once. Against the
    same batch scored row by row: the same log π̃ and the same gradients, to the dtype's rounding; also with a
    one-token prompt, and with no response longer than a token (packs of prompts alone)."""
    from offpolicy.policy.head import shared_plan

    sampling = SAMPLINGS[name]
    model = tiny_causal_lm(family, 97).train()
    if precision == "fp64":
        model = model.double()
    batch = with_packs(grouped_batch(97, **shape))
    plan = shared_plan(model, batch)
    assert plan.ids.shape[0] == 3  # the 3 distinct prompts, each with its 4 rows' responses in one pack
    assert (plan.gather.shape[1] == 1) == (shape.get("longest") == 1)
    plain = Batch(*(getattr(batch, f) for f in ("input_ids", "attention_mask", "positions", "response_ids", "mask",
                                                   "rollout_logprobs", "versions")))
    assert plain.counted is None and shared_plan(model, plain) is None
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        want, want_grads = value_and_grads(lambda: trainer_logprobs(model, plain, sampling), model, plain, weights)
        got, grads = value_and_grads(lambda: trainer_logprobs(model, batch, sampling), model, batch, weights)
    # fp64: the values agree to the bit; the gradients of the two-pass form differ by ~2e-8 of the largest
    # (measured; more than fp64 rounding of the same sums, so some kernel of SDPA's CPU backward is coarser)
    rtol, atol = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 2e-2), "fp64": (1e-12, 1e-7)}[precision]
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    torch.testing.assert_close(torch.where(torch.isfinite(got), got, 0), torch.where(torch.isfinite(want), want, 0),
                               rtol=rtol, atol=atol)
    if precision != "bf16":
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol * (float(b.abs().max()) + 1e-30))
        return
    # bf16: the packs round other GEMMs than the whole rows, and a bias's gradient (a sum over tokens that
    # cancels) can differ by ~2 % of its largest entry. Against the float64 truth, the packed gradients must be
    # as close as the whole rows' are
    truth = copy.deepcopy(model).double()
    _, exact = value_and_grads(lambda: trainer_logprobs(truth, plain, sampling), truth, plain, weights)
    for a, b, x in zip(grads, want_grads, exact):
        assert float((a.double() - x).norm()) <= 1.5 * float((b.double() - x).norm()) + 1e-6 * float(x.norm())


def test_the_shared_prompt_plan_only_where_it_saves_work_and_serves():
    """No plan for distinct prompts; none used by a model whose layers are not all full attention (gemma2's
    sliding layers) or whose attention is not SDPA, or for a batch whose input_ids are not the plan's. Each of
    those scores the whole rows. Gradient checkpointing keeps the packs (they need no cache)."""
    from dataclasses import replace

    from offpolicy.policy.batch import pack_layout
    from offpolicy.policy.head import shared_plan
    from offpolicy.policy.score import checkpoint_activations

    assert pack_layout(grouped_batch(97, group_size=1)) is None
    batch = with_packs(grouped_batch(97))
    assert shared_plan(tiny_causal_lm("gemma2", 97), batch) is None
    assert shared_plan(tiny_causal_lm("llama", 97, attn_implementation="eager"), batch) is None
    model = tiny_causal_lm("llama", 97).train()
    assert shared_plan(model, batch) is not None
    assert shared_plan(model, replace(batch, input_ids=batch.input_ids.clone())) is None
    checkpoint_activations(model)
    assert shared_plan(model, batch) is not None


def test_the_packs_by_hand():
    """The planner's packs for two prompts, [5, 6, 7] twice (responses of 3 and 1 tokens) and [8, 9] twice (2 and
    4 tokens), written out by hand: each pack is its prompt then its rows' responses but their last tokens, at
    their whole rows' positions; ``gather`` gives each response token the state that predicts it (the prompt's
    last, then the response's own). With ``cap`` 3 and a budget of 5 tokens, the second group's second response
    starts a new pack; a row with no response never does. With ``cap`` 3 and no budget each prompt, past half the
    cap, lets its responses span its own length (``spans``): 2 tokens for [8, 9], so its responses, starting 0 and 1
    tokens in, share one pack again."""
    from offpolicy.speed.shared_prompt import attention_mask

    rows = [[5, 6, 7, 11, 12, 13], [8, 9, 21, 22], [5, 6, 7, 14], [8, 9, 23, 24, 25, 26]]
    input_ids = torch.tensor([r + [0] * (6 - len(r)) for r in rows])
    attention = (torch.arange(6) < torch.tensor([len(r) for r in rows])[:, None]).long()
    prompt = torch.tensor([3, 2, 3, 2])
    got = plan(input_ids, attention, prompt)
    # packs in prompt order ([5, 6, 7] < [8, 9] by torch.unique's row order), rows in batch order
    assert got.ids.tolist() == [[5, 6, 7, 11, 12, 0], [8, 9, 21, 23, 24, 25]]
    assert got.positions.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 2, 3, 4]]
    assert got.segments.tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 2, 4, 4, 4]]
    assert got.gather.tolist() == [[2, 3, 4, 2], [7, 8, 7, 7], [2, 2, 2, 2], [7, 9, 10, 11]]
    mask = attention_mask(got.segments)[:, 0].long()
    assert mask[1].tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                [1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]]
    assert mask[0, 5].tolist() == [0, 0, 0, 0, 0, 1]  # padding attends to itself alone
    assert plan(input_ids, attention, prompt, cap=3).ids.tolist() == got.ids.tolist()
    split = plan(input_ids, attention, prompt, cap=3, budget=5)  # spans: max(3 − P, min(P, 5 − P − longest + 1)) = 1
    assert split.ids.tolist() == [[5, 6, 7, 11, 12], [8, 9, 21, 0, 0], [8, 9, 23, 24, 25]]
    assert split.gather[3].tolist() == [11, 12, 13, 14] and split.gather[1].tolist() == [6, 7, 6, 6]
    assert plan(input_ids[[0, 1]], attention[[0, 1]], prompt[[0, 1]]) is None  # no prompt repeats


@pytest.mark.parametrize("seed", range(10))
def test_packs_of_random_batches_score_as_the_whole_rows(seed, monkeypatch):
    """Differential, float64, five families: random groups (1–4 prompts of 1–6 tokens, 1–5 rows each, responses
    of 0–9 tokens), packed under a random cap (2–40 tokens, so groups split), gradient checkpointing on odd seeds. The
    packed forward's hidden states at every counted position, and the gradients of a weighted sum of log π̃,
    equal the whole rows': the states to float64 rounding, the gradients to ~1e-7 of the largest (transformers'
    RMSNorm computes in float32 whatever the model's dtype)."""
    from offpolicy.engines import Rollouts
    from offpolicy.policy.batch import to_batch
    from offpolicy.policy.score import checkpoint_activations
    from offpolicy.speed import shared_prompt

    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    prompts = [torch.randint(1, 97, (draw(1, 6),), generator=g).tolist() for _ in range(draw(1, 4))]
    rows = [p for p in prompts for _ in range(draw(1, 5))]
    rows.append(prompts[0])  # some prompt repeats
    responses = [torch.randint(1, 97, (draw(0, 9),), generator=g).tolist() for _ in rows]
    batch = to_batch(Rollouts(rows, responses, [[-1.0] * len(r) for r in responses], [True] * len(rows),
                              version=0), 0)
    cap = draw(2, 40)
    monkeypatch.setattr("offpolicy.policy.batch.layout", lambda *args, **kw: shared_prompt.layout(*args, **kw, cap=cap))
    batch = with_packs(batch)
    family = ("llama", "qwen2", "qwen3", "mistral", "phi3")[seed % 5]
    extra = {"mistral": {"sliding_window": None}, "phi3": {"pad_token_id": 0}}.get(family, {})
    model = tiny_causal_lm(family, 97, seed=seed, **extra).double().train()
    if seed % 2:
        checkpoint_activations(model)
    assert batch.counted.shared is not None and shared_prompt.serves(model, batch.counted.shared, batch.input_ids)
    rows_, cols = batch.counted.rows, batch.counted.cols
    with torch.no_grad():
        packed = shared_prompt.decoder_hidden(model, batch.counted.shared)[rows_, cols]
        torch.testing.assert_close(packed, decoder_hidden_at(model, batch), rtol=1e-12, atol=1e-12)
    plain = Batch(*(getattr(batch, f) for f in ("input_ids", "attention_mask", "positions", "response_ids", "mask",
                                                   "rollout_logprobs", "versions")))
    weights = torch.randn(batch.mask.shape, generator=g)
    plain_lp, packed_lp = (lambda b=b: trainer_logprobs(model, b, SAMPLINGS["plain"]) for b in (plain, batch))
    want, want_grads = value_and_grads(plain_lp, model, plain, weights)
    got, grads = value_and_grads(packed_lp, model, batch, weights)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-6 * (float(b.abs().max()) + 1e-30))


def rope_lm(rope: str, seed: int = 0):
    """A two-layer float64 causal LM whose rotary embedding is of type ``rope``, with an original context of 8
    positions (built in code): Phi-3's ``longrope`` (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini), and Llama with
    ``dynamic``, ``linear``, ``yarn`` or the default rope."""
    import transformers

    common = dict(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    if rope == "longrope":
        config = transformers.Phi3Config(
            **common, max_position_embeddings=64, original_max_position_embeddings=8,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 8.0,
                             "original_max_position_embeddings": 8,
                             "short_factor": [1.0, 1.3, 1.7, 2.0], "long_factor": [1.5, 3.0, 6.0, 9.0]})
        cls = transformers.Phi3ForCausalLM
    else:
        parameters = {"rope_type": rope, "rope_theta": 10000.0}
        if rope in ("dynamic", "linear"):
            parameters["factor"] = 2.0
        if rope == "yarn":
            parameters.update(factor=4.0, original_max_position_embeddings=8)
        config = transformers.LlamaConfig(**common, max_position_embeddings=8 if rope == "dynamic" else 32,
                                          rope_parameters=parameters)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    return cls(config).double().train()


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
def test_rotary_frequencies_that_follow_the_length_are_not_shared(rope):
    """Issue #55 item 1: transformers' ``dynamic`` and ``longrope`` rotary types pick their frequencies from the
    largest position of each call, so a prompt (under the original context of 8) computed alone got other
    frequencies than inside its whole row (up to 18 tokens): on 65ba3dd the shared forward ran and its float64
    log-probs were off by ~1e-4 (Phi-3) and 1e-5 (Llama), the gradients by 0.5 % and 5 %. The planner probes the
    rope's behaviour and refuses: the whole rows run, log-probs and gradients equal to the bit. (The trainer's
    packs now put every position in one forward, but their largest position is the longest response's last but
    one where the whole rows' is the padded width's last, so the frequencies could still differ: refused too.)"""
    from offpolicy.policy.head import shared_plan
    from offpolicy.speed.shared_prompt import refusal

    model = rope_lm(rope)
    batch = with_packs(grouped_batch(97, longest=12))
    assert batch.input_ids.shape[1] > 8 and int(batch.positions[:, 0].max()) + 1 < 8  # rows pass it, prompts not
    assert shared_plan(model, batch) is None
    assert "changes its frequencies with the forward's length" in refusal(model, "packed")
    assert "changes its frequencies" in refusal(model, "token")  # the hf engine's rule is the same
    plain = Batch(*(getattr(batch, f) for f in ("input_ids", "attention_mask", "positions", "response_ids", "mask",
                                                   "rollout_logprobs", "versions")))
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2))
    want, want_grads = value_and_grads(lambda: trainer_logprobs(model, plain, SAMPLINGS["plain"]), model, plain, weights)
    got, grads = value_and_grads(lambda: trainer_logprobs(model, batch, SAMPLINGS["plain"]), model, batch, weights)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def decoder_hidden_at(model, batch: Batch) -> torch.Tensor:
    from offpolicy.policy.head import decoder_hidden

    rows, cols = batch.counted.rows, batch.counted.cols
    return decoder_hidden(model, batch.input_ids, batch.attention_mask)[rows, batch.positions[rows, cols]]


@pytest.mark.parametrize("rope", ["default", "linear", "yarn"])
def test_rotary_frequencies_fixed_by_the_config_still_share(rope):
    """Default, linear and YaRN ropes fix their frequencies from the config: the prompt is computed once, and the
    log-probs and gradients equal the whole rows' (float64; the gradients to transformers' float32 RMSNorm, ~1e-7 of
    the largest, against the 0.5–5 % of a length-dependent rope shared)."""
    from offpolicy.policy.head import shared_plan

    model = rope_lm(rope)
    batch = with_packs(grouped_batch(97, longest=12))
    assert shared_plan(model, batch) is not None
    plain = Batch(*(getattr(batch, f) for f in ("input_ids", "attention_mask", "positions", "response_ids", "mask",
                                                   "rollout_logprobs", "versions")))
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2))
    want, want_grads = value_and_grads(lambda: trainer_logprobs(model, plain, SAMPLINGS["plain"]), model, plain, weights)
    got, grads = value_and_grads(lambda: trainer_logprobs(model, batch, SAMPLINGS["plain"]), model, batch, weights)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-6 * (float(b.abs().max()) + 1e-30))


def test_the_rotary_probe_leaves_the_models_rope_as_it_was():
    """The probe calls a copy: a dynamic rope's cached frequencies and length are the model's own afterwards."""
    from offpolicy.speed.shared_prompt import rope_refusal

    model = rope_lm("dynamic")
    rotary = model.model.rotary_emb
    before = (rotary.inv_freq.clone(), rotary.max_seq_len_cached)
    assert rope_refusal(model) is not None
    assert torch.equal(rotary.inv_freq, before[0]) and rotary.max_seq_len_cached == before[1]


def test_micro_batches_of_whole_packs_by_hand(monkeypatch):
    """Where the forward packs, micro-batches hold whole packs (``score.micro_batches``, ``packed``): split by whole
    rows, shortest first, the groups mix and each micro-batch computes again the prompt of every group it touches.
    Two prompts, [5, 6, 7] (rows 0, 2, 4: responses of 3, 1 and 2 tokens) and [8, 9] (rows 1, 3: 2 and 4 tokens):
    pack tokens, prompt + responses but their last tokens, 3 + 2 + 0 + 1 = 6 and 2 + 1 + 3 = 6."""
    from offpolicy.policy.score import micro_batches
    from offpolicy.speed import shared_prompt

    rows = [[5, 6, 7, 11, 12, 13], [8, 9, 21, 22], [5, 6, 7, 14], [8, 9, 23, 24, 25, 26], [5, 6, 7, 15, 16]]
    input_ids = torch.tensor([r + [0] * (6 - len(r)) for r in rows])
    attention = (torch.arange(6) < torch.tensor([len(r) for r in rows])[:, None]).long()
    prompt = torch.tensor([3, 2, 3, 2, 3])
    found = shared_prompt.layout(input_ids, attention, prompt)
    assert found.pack_tokens().tolist() == [6, 6] and found.pack_of_rows().tolist() == [0, 1, 0, 1, 0]
    assert found.group_of.tolist() == [0, 1]
    assert shared_prompt.layout(input_ids[:2], attention[:2], prompt[:2]) is None  # no prompt repeats

    class B:  # the fields micro_batches reads, as to_batch lays them out (positions[:, 0] = len(prompt) − 1)
        pass
    batch = B()
    batch.input_ids, batch.attention_mask, batch.positions = input_ids, attention, (prompt - 1)[:, None]

    def split(budget, rows=torch.arange(5)):
        return [p.rows.tolist() for p in micro_batches(batch, rows, budget, packed=True)]
    assert split(12) == [[0, 1, 2, 3, 4]] and split(11) == [[0, 2, 4], [1, 3]] and split(3) == [[0, 2, 4], [1, 3]]
    subset = torch.tensor([4, 3, 2, 1])  # any rows of a batch: indices into the batch come back, in its order
    assert split(9, subset) == [[4, 2], [3, 1]]
    # the whole-row rule (a model that does not pack): shortest first, groups mixed, no packs
    whole = micro_batches(batch, subset, 9, packed=False)
    assert [p.rows.tolist() for p in whole] == [[2, 1], [4], [3]] and all(p.packs is None for p in whole)
    # with cap 4 each prompt is past half the cap, so its responses may span its own length, as far as the budget
    # allows (``spans``: max(4 − P, min(P, budget − P − longest + 1))): under 10 both groups stay one pack (spans 3
    # and 2), 6 tokens each; under 6 the first group's span is 2, so row 4 (its response starts 2 tokens in) leaves
    # rows 0 and 2 (5 tokens) for a pack of its own (4 tokens), and the second group stays one pack of 6
    real = shared_prompt.layout
    monkeypatch.setattr("offpolicy.policy.batch.layout", lambda *args, **kw: real(*args, **kw, cap=4))
    assert split(10) == [[0, 2, 4], [1, 3]] and split(6) == [[4], [0, 2], [1, 3]]
    # with the short prompts' span alone, cap − len(prompt), the first group splits under any budget (b = 4 − 3 = 1):
    # rows 0 and 2 (5 tokens), row 4 (4 tokens); the second stays one pack (b = 2: both responses start within 2
    # tokens), 6 tokens. Two packs of a group never share a micro-batch: [row 4], then [0, 2] though 2 · 5 ≤ 10, then
    # [1, 3]; under 12 the second group's pack joins [0, 2] (2 · 6 ≤ 12)
    monkeypatch.setattr(shared_prompt, "spans", lambda prompt, longest, cap, budget: (cap - prompt).clamp(min=1))
    assert split(10) == [[4], [0, 2], [1, 3]] and split(12) == [[4], [0, 1, 2, 3]]
    assert split(100) == [[4], [0, 1, 2, 3]]


def pack_members(shared, rows: torch.Tensor) -> list[tuple[tuple[int, int], ...]]:
    """Each pack of ``shared`` (``SharedPrompts`` of a micro-batch whose row i is ``rows[i]``) as its rows' (row,
    column where its response starts), sorted: what a pack is, whoever laid it out."""
    packs = []
    for segments in shared.segments:
        members = {}
        for column, segment in enumerate(segments.tolist()):
            if segment > 0:
                members.setdefault(int(rows[segment - 1]), column)
        packs.append(tuple(sorted(members.items())))
    return packs


@pytest.mark.parametrize("seed", range(32))
def test_the_micro_batches_packs_are_slices_of_the_steps_one_plan(seed, monkeypatch):
    """Issue #68 item 5 (ff06b67's bug was a micro-batch's own second plan packing two packs of one group otherwise):
    random groups, caps (so a group spans several packs), budgets and PPO mini-batches of shuffled rows. The step
    lays its rows out in packs once (``pack_layout``); every micro-batch of whole packs (``score.micro_batches``)
    holds the rows of its packs, and the packs its forward runs (``to_device``, from ``Part.packs``) are those very
    packs of the step's plan — the same rows at the same columns — or, where none of its packs holds two rows, its
    whole rows. Together they hold every row once and every pack of the step's plan once, and each micro-batch at
    most the budget's tokens unless it is one pack. (Checked to fail: with each micro-batch planning its own rows
    again and two packs of a group allowed in one micro-batch — ff06b67's bug — seeds 9, 12, 15, 23, 27 and 28
    do.)"""
    from offpolicy.policy.batch import pack_layout
    from offpolicy.policy.score import micro_batches, to_device, trim
    from offpolicy.speed import shared_prompt

    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    cap = draw(8, 60)
    real = shared_prompt.layout
    monkeypatch.setattr("offpolicy.policy.batch.layout", lambda *args, **kw: real(*args, **kw, cap=cap))
    batch = grouped_batch(97, groups=draw(2, 5), group_size=draw(2, 8), seed=seed, longest=draw(1, 40))
    rows = torch.arange(len(batch.mask))
    rows = rows[batch.mask.sum(dim=1) > 0]  # as the update takes them
    rows = rows[torch.randperm(len(rows), generator=g)] if seed % 2 else rows  # a PPO mini-batch's shuffled rows
    budget = draw(8, 200)

    step = pack_layout(batch, rows, budget)  # the step's one plan: its row i is rows[i]
    want = sorted(pack_members(step.build(batch.input_ids[rows]), rows))
    parts = micro_batches(batch, rows, budget, packed=True)
    assert sorted(torch.cat([p.rows for p in parts]).tolist()) == sorted(rows.tolist())
    got = []
    for part in parts:
        mb = to_device(trim(batch.select(part.rows)), torch.device("cpu"), part.packs)
        shared = mb.counted.shared
        if shared is None:  # no pack of its holds two rows: its whole rows run, each the one-row pack it is
            assert part.packs is None
            alone = [((int(r), int(batch.positions[r, 0]) + 1),) for r in part.rows]
            assert all(pack in want for pack in alone)
            got += alone
            sizes = (batch.attention_mask[part.rows].sum(dim=1) - 1).tolist()
        else:
            assert shared.input_ids is mb.input_ids
            got += pack_members(shared, part.rows)
            sizes = (shared.segments != -1).sum(dim=1).tolist()
        assert len(sizes) * max(sizes) <= budget or len(sizes) == 1
    assert sorted(got) == want


def test_a_prompt_over_the_pack_cap_is_computed_once_per_pack():
    """Issue #67: a prompt longer than the pack cap (1,024 tokens) left its responses a span of 1 token
    (cap − len(prompt), clamped), so every response went in a pack of its own and the prompt was computed once per
    row, as in the whole rows (here 8 × 1,100 prompt tokens). A long prompt's responses now span up to its own length
    as far as the micro-batch's budget allows (``shared_prompt.spans``). One prompt of 1,100 tokens, 8 responses of
    30: no budget, one pack (the prompt once); a budget of 1,300, span min(1,100, 1,300 − 1,100 − 29 + 1) = 172, so
    packs of 6 and 2 responses, 1,274 and 1,158 tokens (the prompt twice, each micro-batch within the budget). The
    log-probs and gradients equal the whole rows' (float64)."""
    from offpolicy.engines import Rollouts
    from offpolicy.policy.batch import to_batch
    from offpolicy.policy.score import Scorer
    from offpolicy.speed.shared_prompt import PACK_TOKENS

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 97, (1100,), generator=g).tolist()
    assert len(prompt) > PACK_TOKENS
    responses = [torch.randint(1, 97, (30,), generator=g).tolist() for _ in range(8)]
    batch = to_batch(Rollouts([prompt] * 8, responses, [[-1.0] * 30] * 8, [True] * 8, version=0), 0)
    model = tiny_causal_lm("qwen2", 97).double().train()

    whole = with_packs(batch)
    assert (whole.counted.shared.segments == 0).sum(dim=1).tolist() == [1100]  # one pack: the prompt once
    scorer = Scorer(model, SAMPLINGS["plain"], torch.device("cpu"), budget=1300)
    parts = [scorer.to_device(batch, part) for part in scorer.micro_batches(batch, torch.arange(8))]
    assert [len(mb.mask) for mb in parts] == [2, 6]  # shortest first
    assert [(mb.counted.shared.segments == 0).sum().item() for mb in parts] == [1100, 1100]
    assert [(mb.counted.shared.segments >= 0).sum().item() for mb in parts] == [1158, 1274]  # each ≤ the budget

    plain = Batch(*(getattr(batch, f) for f in ("input_ids", "attention_mask", "positions", "response_ids", "mask",
                                                   "rollout_logprobs", "versions")))
    weights = torch.randn(batch.mask.shape, generator=g)
    want, want_grads = value_and_grads(lambda: trainer_logprobs(model, plain, SAMPLINGS["plain"]), model, plain,
                                       weights)
    got, grads = value_and_grads(lambda: trainer_logprobs(model, whole, SAMPLINGS["plain"]), model, whole, weights)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-6 * (float(b.abs().max()) + 1e-30))
    torch.testing.assert_close(scorer.score(batch).logprobs, want, rtol=1e-12, atol=1e-12)  # the two packs, split


def test_the_self_check_s_each_row_alone_is_rows_not_packs():
    """``diagnose --self-check`` compares the configured micro-batches with each row scored alone
    (``replace(scorer, budget=1, by_packs=False)``): by packs, a budget of 1 would leave each pack whole."""
    from dataclasses import replace

    from offpolicy.policy.score import Scorer

    model = tiny_causal_lm("llama", 97)
    batch = grouped_batch(97)
    rows = torch.arange(len(batch.mask))
    scorer = Scorer(model, SAMPLINGS["plain"], torch.device("cpu"), budget=1)
    assert len(scorer.micro_batches(batch, rows)) == 3  # the 3 packs, each alone
    alone = replace(scorer, by_packs=False).micro_batches(batch, rows)
    assert len(alone) == len(rows) and sorted(torch.cat([p.rows for p in alone]).tolist()) == rows.tolist()
    assert all(p.packs is None for p in alone)  # whole rows: they cut through the step's packs, so they run whole
