"""What every rollout engine returns and accepts: a typed record and a narrow protocol.

Engines sample responses and report the log-probability μ(y_t) of each sampled token *as the
engine computed it* — after temperature / top-k / top-p (vLLM's ``processed_logprobs``), since
that is the distribution the token was drawn from. Nothing outside ``engines/`` imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from offpolicy.core.kept_set import KeptIds
from offpolicy.core.sampling import SamplingConfig  # noqa: F401 — the sampling contract, as the engines take it


class EngineError(RuntimeError):
    """The rollout engine failed (to start, generate, sleep or load weights). The message is one line:
    what the engine was doing, the cause, and where its full output and traceback were written."""


@dataclass
class Rollouts:
    """One generation call: row i answers ``prompt_ids[i]``.

    ``logprobs[i][t]`` is log μ(response_ids[i][t]); ``response_ids`` include the EOS token when
    the engine stopped on it (``finished[i]``). ``version`` is the policy version of the
    weights that sampled them. ``kept`` ``[rows, steps]``: under top-k/top-p, the set each token was
    drawn from (``offpolicy.core.kept_set``; the hf engine records it, a server asked for its sampling masks
    returns it, vLLM does where its build can: ``engines/vllm.py``), for the trainer to renormalise over;
    None where the engine records none, and the trainer recomputes the set. ``kept.logprobs`` ``[nnz]``
    fp32: log μ of each kept id, where the engine records them (the hf engine; SGLang's
    ``output_token_sampling_mask_logprobs``): exact score centering's support. ``head`` ``[rows, steps]``:
    the top-k ids of each token's sampling distribution with their log μ (``KeptIds`` with ``logprobs``),
    where an engine was asked for them (``head_logprobs``): score centering's ``head`` support.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    version: int
    meta: dict[str, float] = field(default_factory=dict)
    kept: KeptIds | None = None
    head: KeptIds | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def validate(self, engine: str) -> None:
        """Raise a clear error if the engine broke the contract (no log-probs, wrong lengths)."""
        if len(self.response_ids) != len(self.prompt_ids) or len(self.logprobs) != len(self.prompt_ids):
            raise RuntimeError(f"engine {engine!r} returned {len(self.response_ids)} responses for {len(self.prompt_ids)} prompts")
        for i, (ids, lps) in enumerate(zip(self.response_ids, self.logprobs)):
            if lps is None or len(lps) != len(ids):
                raise RuntimeError(
                    f"engine {engine!r} returned no per-token log-probs for response {i} "
                    f"({0 if lps is None else len(lps)} log-probs for {len(ids)} tokens); offpolicy needs the "
                    "sampled tokens' log-probs to measure and correct the mismatch"
                )


class RolloutEngine(Protocol):
    name: str

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int, version: int) -> Rollouts:
        """Sample one response per prompt (repeat a prompt for a group), seeded."""
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights in place, without restarting."""
        ...

    def close(self) -> None: ...


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Tokens that end a response: the tokenizer's EOS and the model's ``generation_config.eos_token_id``
    (an int or a list: Qwen2.5-Instruct stops on both ``<|im_end|>`` and ``<|endoftext|>``). Sorted."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([extra] if isinstance(extra, int) else (extra or []))
    return sorted(ids)


def left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, L]`` input ids and attention mask, the layout ``generate`` expects."""
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompt_ids])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    return input_ids, attention


def perturb(named_tensors: Iterable[tuple[str, torch.Tensor]], relative_noise: float, seed: int):
    """Yield (name, w + σ·std(w)·ε) — a dialled-in engine/trainer mismatch (like a coarse
    quantisation of the engine's copy). σ = 0 yields the tensors unchanged.

    ε is drawn on the weight's device by a generator of that device seeded with ``seed`` (one per
    device, in the order the tensors come): deterministic per seed, no host copy of the noise on a
    GPU, and on the CPU the same draws as a CPU generator always gave."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, tensor in named_tensors:
        if relative_noise > 0 and tensor.is_floating_point() and tensor.numel() > 1:
            g = generators.get(tensor.device)
            if g is None:
                g = generators[tensor.device] = torch.Generator(device=tensor.device).manual_seed(seed)
            noise = torch.randn(tensor.shape, generator=g, dtype=torch.float32, device=tensor.device)
            tensor = (tensor.float() + relative_noise * tensor.float().std() * noise).to(tensor.dtype)
        yield name, tensor
