"""Rollouts with transformers' models and sampling loop: the engine ``engine=auto`` picks for tiny models on
the CPU (``engines/choice.py``), and a second, different source of mismatch (its own copy of the weights, in
its own dtype, with optional logit noise).

The reported log-prob of each sampled token is taken from the *processed* scores (after
temperature, top-k, top-p and the noise), i.e. from the distribution the token was drawn from.

Memory O(B·V), not O(B·steps·V): no ``output_scores``. transformers 5.19's sampling loop
(``GenerationMixin._sample``) runs, per step,

    scores = logits_processor(input_ids, logits)      # the list built by _get_logits_processor:
                                                      # its own processors, then the caller's,
                                                      # then (do_sample) temperature, top-k, top-p
    token  = multinomial(softmax(scores))
    input_ids = cat(input_ids, token)                 # a finished row gets pad instead
    stopping_criteria(input_ids, scores)

A caller's processor comes *before* transformers' warpers, so it cannot see the processed
distribution. The engine therefore asks ``generate`` for plain sampling (τ = 1, top-k = 0,
top-p = 1: no warper; ``engines/generation.py``) and passes the same warpers itself, in the same
order with the same arguments — noise, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper`` — followed by ``_SampledLogprobs``, which keeps the step's processed
log-softmax ``[B, V]`` and, as a stopping criterion (called once the token is appended), gathers
it at the token just drawn and drops it. Through ``generate`` the draws are the same as with transformers'
own warpers, bit for bit (``tests/test_hf_engine.py``); top-p is transformers' nucleus computed by the
trainer's own function (``offpolicy.core.sampling.top_p_keep``), so that exactly tied probabilities at
the cut keep the same tokens on both sides.

The loop itself is ``offpolicy.speed.hf_loop.sample``: transformers' ``_sample`` above with the rows that have
finished left out of the forward (their KV cache dropped, their logits zeros). The processors and ``multinomial``
still run on the whole ``[B, V]``, so the random stream, and with it every unfinished row's draw, is
``generate``'s; the log-probs differ from ``generate``'s only by the fp32 rounding of a smaller batch's GEMMs (the
embedded default: ``generate`` 28 → 21 ms, its rows finish at ~5 of 10 tokens; issue #49). It reaches into
transformers' cache, so it is gated (``offpolicy.speed.gates.HF_OWN_LOOP``: the transformers versions and model
families it was checked against, a forward and cache it can drive, rotary frequencies that do not follow the
forward's length); any other model or version goes through ``generate``, and ``HFEngine.speed_paths`` says why.

A prompt that repeats in the batch (GRPO's group) is prefilled once where the one planner allows it
(``offpolicy.speed.shared_prompt``, which also plans the trainer's packs): the KV cache of each distinct prompt
(and its last logits) computed once and copied to the prompt's rows; the loop draws the first token from those
logits and goes on from that cache as it would from its own prefill (through ``generate``, all but the last
prompt token are shared: ``generate`` runs that one itself).

Under top-k/top-p, ``_SampledLogprobs`` also records each step's kept set — the tokens whose processed
score is not −inf, exactly the support ``multinomial`` draws from — as kept ids
(``offpolicy.core.kept_set.StepRecorder``: only the ids, the step's ``[B, V]`` mask is dropped at once), and
``Rollouts.kept`` carries them to the trainer, which renormalises over them (replay, issue #46). A row the own
loop has finished records an empty set (issue #55: its zero logits tied every token, and the whole vocabulary
was recorded for it at every step). Each kept id carries its log q_v (exact score centering's support). Asked
for a head (``SamplingConfig.head_logprobs`` = k), it records the k most likely ids of each step's processed
distribution and their log q_v the same way (``Rollouts.head``: score centering's head support).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

import torch
from transformers import (AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList, MinPLogitsWarper,
                          PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from offpolicy.engines.base import Rollouts, SamplingConfig, left_pad, stop_token_ids
from offpolicy.engines.generation import explicit_config, generate, ignored_line
from offpolicy.core.kept_set import StepRecorder
from offpolicy.speed import hf_loop, shared_prompt
from offpolicy.speed.cpu_linear import use_onednn_linear
from offpolicy.speed.shared_prompt import cache_argument
from offpolicy.core.sampling import top_p_keep

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _LogitNoise(LogitsProcessor):
    """Adds N(0, σ²) to every finite logit: a dialled-in sampler/trainer mismatch. The noise is drawn
    on the scores' device by a generator of that device seeded with ``seed`` (on the CPU, the same
    draws as ever; on a GPU, no host round trip per step)."""

    def __init__(self, sigma: float, seed: int):
        self.sigma, self.seed, self.generator = sigma, seed, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.generator is None:
            self.generator = torch.Generator(device=scores.device).manual_seed(self.seed)
        noise = torch.randn(scores.shape, generator=self.generator, dtype=torch.float32, device=scores.device)
        return torch.where(torch.isfinite(scores), scores + self.sigma * noise.to(scores.dtype), scores)


class _SampledLogprobs(LogitsProcessor):
    """The log-prob of each drawn token under the processed distribution, in O(B·V) memory. As the
    last logits processor it keeps log_softmax(scores) ``[B, V]`` (fp32); its ``criterion``, a
    stopping criterion that runs once the drawn token is appended to ``input_ids``, gathers that
    token's log-prob (``[B]`` per step, in ``steps``) and drops the ``[B, V]``. With ``record_kept``, each
    step's kept set (scores > −inf: the support the token is drawn from) goes to ``kept``, but for the rows
    ``live`` (set by the own loop) says have finished: theirs is empty."""

    def __init__(self, record_kept: bool = False, record_head: int = 0):
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []
        self.criterion = _GatherDrawn(self)
        self.kept = StepRecorder() if record_kept else None
        self.head_k = record_head
        self.head = StepRecorder() if record_head else None
        self.live: torch.Tensor | None = None  # [B] bool, set by the own loop: the rows still running

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.pending = scores.float().log_softmax(-1)
        if self.kept is not None:
            keep = scores > float("-inf")
            # a row the own loop has finished records nothing (its zero logits would keep every token); with
            # each kept id's q_v (score centering)
            self.kept.add(keep if self.live is None else keep & self.live[:, None], self.pending)
        if self.head is not None:  # the k most likely ids of the processed distribution, with their log q_v
            self.head.add_top(self.pending, self.head_k, self.live)
        return scores


class _GatherDrawn(StoppingCriteria):
    """``_SampledLogprobs``'s second half: log π̃ of ``input_ids[:, -1]``; never stops generation."""

    def __init__(self, recorder: _SampledLogprobs):
        self.recorder = recorder

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        r = self.recorder
        r.steps.append(r.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        r.pending = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Draw(LogitsProcessor):
    """The draw of transformers' ``_sample`` made from the engine's own generator: ``multinomial(softmax(scores))``
    with ``generator``, as ``_sample`` would draw from the global one, then scores that put all the mass on the
    drawn token (0 there, −inf elsewhere), so ``generate``'s own multinomial can only return it. The last
    processor: the recorder before it has kept the processed distribution the token was drawn from."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=self.generator)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)


class _TopP(TopPLogitsWarper):
    """Top-p on the trainer's definition (``offpolicy.core.sampling.top_p_keep``): the same nucleus as
    transformers' ``TopPLogitsWarper`` (min_tokens_to_keep = 1), with one tie rule for both sides —
    equal probabilities at the cut ordered by token id, the larger first. transformers' own warper
    sorts with an unstable sort, ascending, while the trainer sorted descending: with exactly tied
    probabilities the two kept different tokens."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        keep = top_p_keep(scores.float().softmax(dim=-1), self.top_p)
        return scores.masked_fill(~keep, self.filter_value)


def warpers(sampling: SamplingConfig) -> list[LogitsProcessor]:
    """transformers' warpers for ``sampling``, as ``_get_logits_processor`` builds them for
    ``do_sample`` with one beam (min_tokens_to_keep = 1): temperature if τ ≠ 1, top-k if on, top-p if
    < 1 (``_TopP``: transformers' warper with the trainer's tie rule), min-p if > 0, in that order."""
    out: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        out.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        out.append(_TopP(top_p=sampling.top_p, min_tokens_to_keep=1))
    if sampling.min_p > 0.0:  # transformers' order: after top-k and top-p (min_p_last)
        out.append(MinPLogitsWarper(min_p=sampling.min_p, min_tokens_to_keep=1))
    return out


def own_loop_fits(model) -> bool:
    """Whether the engine samples ``model`` through its own loop (``offpolicy.speed.hf_loop``: its gate, a
    forward and cache it can drive, rotary frequencies that do not follow the forward's length); any other model
    samples through transformers' ``generate``, which knows its own inputs."""
    return hf_loop.decision(model).fast


class HFEngine:
    name = "hf"
    min_p_order = "min_p_last"  # transformers' warpers: top-k → top-p → min-p

    def __init__(self, model_path: str, tokenizer: PreTrainedTokenizerBase, dtype: str = "fp32",
                 logit_noise: float = 0.0, device: torch.device | str | None = None,
                 cpu_linear: Literal["auto", "onednn", "torch"] = "auto"):
        """``cpu_linear``: as the trainer's option of that name — in fp32 on the CPU, auto/onednn run the
        linear layers through oneDNN (``offpolicy.speed.cpu_linear``: a prefill's many rows 2× faster than
        torch's GEMM; a decode step's few rows stay on ``F.linear``), torch keeps ``F.linear``."""
        self.tokenizer = tokenizer
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device or "cpu")  # the trainer's device: weight syncs stay on it
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device).eval()
        self.linear = use_onednn_linear(self.model, cpu_linear, self.device, dtype)
        self.logit_noise = logit_noise
        self.stop = stop_token_ids(tokenizer, self.model)  # EOS and the model's other end-of-turn ids
        # the gated speed paths (offpolicy.speed), decided once: which ran and why goes to the run's header
        loop, sharing = hf_loop.decision(self.model), shared_prompt.decision(self.model, "token")
        self._own_loop = loop.fast  # else transformers' generate
        self.speed_paths = {"hf_own_loop": loop.reason, "hf_shared_prefill": sharing.reason,
                            "hf_linear": self.linear}
        self._warned = False
        self._probes: dict[str, torch.Tensor] | None = None  # the tensors weight_fingerprint reads

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int, version: int) -> Rollouts:
        if not self._warned:  # once per engine, on the console (the constructor's output goes to engine.log)
            self._warned = True
            line = ignored_line(self.model, {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                             "top_k": max(sampling.top_k, 0), "min_p": sampling.min_p or None})
            if line:
                log.warning("hf engine: %s", line)
        pad = self.tokenizer.pad_token_id
        input_ids, attention = (t.to(self.device) for t in left_pad(prompt_ids, pad))
        width = input_ids.shape[1]
        # the engine's own generator, never torch's process-wide one: the engine samples in its own thread beside
        # the trainer's (max_staleness > 0), and the trainer's activation checkpointing forks and resets the global
        # generator, which made two runs of one seed draw differently (issue #66). On the CPU a generator seeded
        # with `seed` gives the stream torch.manual_seed(seed) gives, so the draws are those of before.
        generator = torch.Generator(device=self.device).manual_seed(seed)
        # without truncation the kept set is the whole vocabulary: nothing to record
        recorder = _SampledLogprobs(record_kept=sampling.truncates, record_head=sampling.head_logprobs)
        noise = [_LogitNoise(self.logit_noise, seed + 1)] if self.logit_noise > 0 else []
        shared = self._shared_prompts(prompt_ids, input_ids, attention, whole=self._own_loop)
        processors = LogitsProcessorList([*noise, *warpers(sampling), recorder])
        if self._own_loop:
            sequences = hf_loop.sample(self.model, input_ids, attention, sampling.max_tokens, processors, recorder,
                                       shared, self.tokenizer.pad_token_id, self.stop, generator=generator)
        else:
            # generate() draws from the global generator: the draw is made here, from ours, and generate()'s
            # multinomial is handed a distribution with all its mass on that token (_Draw)
            processors.append(_Draw(generator))
            sequences = generate(self.model, input_ids, attention,
                                 explicit_config(do_sample=True, max_new_tokens=sampling.max_tokens, stop=self.stop,
                                                 pad=pad),
                                 logits_processor=processors,
                                 stopping_criteria=StoppingCriteriaList([recorder.criterion]),
                                 **({} if shared is None else {cache_argument(self.model): shared[0]}))
        new_tokens = sequences[:, width:]  # [B, steps]
        token_logprobs = torch.stack(recorder.steps[: new_tokens.shape[1]], dim=1)  # [B, steps] processed
        responses, logprobs, finished = [], [], []
        for row_ids, row_lps in zip(new_tokens.tolist(), token_logprobs.tolist()):
            ends = [t for t, token in enumerate(row_ids) if token in self.stop]
            stop = ends[0] + 1 if ends else len(row_ids)  # the first stop token ends it (padding may repeat it)
            responses.append(row_ids[:stop])
            logprobs.append(row_lps[:stop])
            finished.append(bool(ends))
        lengths = list(map(len, responses))
        kept, head = (None if r is None else r.assemble(new_tokens.shape[1], lengths).to("cpu")
                      for r in (recorder.kept, recorder.head))
        return Rollouts(prompt_ids=[list(p) for p in prompt_ids], response_ids=responses, logprobs=logprobs,
                        finished=finished, version=version, kept=kept, head=head)

    def _shared_prompts(self, prompt_ids: list[list[int]], input_ids: torch.Tensor, attention: torch.Tensor,
                        whole: bool) -> tuple[DynamicCache, torch.Tensor | None] | None:
        """A GRPO batch repeats each prompt group-size times: the prefill computed once per distinct prompt and
        copied to its rows, by the one planner (``offpolicy.speed.shared_prompt.prefill``); None where no prompt
        repeats or the planner refuses the model. ``whole`` (the own loop): the whole prompts' cache and their last
        logits; else (``generate``) all but the last column's cache. The loop then samples as before, on logits
        that differ from a full prefill's only in the rounding of a smaller GEMM (issue #49)."""
        return shared_prompt.prefill(self.model, input_ids, attention, whole)

    @torch.no_grad()
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict()  # tied weights appear under both names
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"hf engine: no parameter {name!r} to sync")
            params[name].copy_(tensor.to(self.dtype))

    def weight_fingerprint(self) -> dict[str, tuple[float, float, float]]:
        """Float64 sums of a few of the largest weights (``engines.fingerprint``; ``offpolicy.measure.sync_check``: the
        trainer checks that a sync of changed weights changed them here). The probed tensors are found once: a
        sync writes them in place (``sync_weights``), so the same tensors hold the engine's weights after it."""
        from offpolicy.engines.fingerprint import probe_names, sample, summarize

        if self._probes is None:
            params = self.model.state_dict()
            self._probes = {name: params[name] for name in probe_names(params)}
        return summarize({name: sample(tensor) for name, tensor in self._probes.items()})

    def record(self) -> dict:
        """The engine on record (``offpolicy.measure.provenance``): transformers' version, the weights' dtype, the model's
        attention implementation, the determinism switches (torch's deterministic algorithms, or "none"; the draws
        come from the engine's own seeded generator either way) and the speed paths that ran."""
        from importlib.metadata import version

        attention = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        return {"name": self.name, "version": f"transformers {version('transformers')}",
                "dtype": str(self.dtype).removeprefix("torch."), "attention_backend": attention or "unknown",
                "determinism": ["torch.use_deterministic_algorithms"] if torch.are_deterministic_algorithms_enabled()
                else "none", "speed_paths": dict(self.speed_paths)}

    def close(self) -> None:
        self.model = None
        self._probes = None  # views of the model's largest weights
