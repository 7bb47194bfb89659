"""Rollouts with transformers' ``generate``: a fallback engine and a second, different source
of mismatch (its own copy of the weights, in its own dtype, with optional logit noise).

The reported log-prob of each sampled token is taken from the *processed* scores (after
temperature, top-k, top-p and the noise), i.e. from the distribution the token was drawn from.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerBase

from offpolicy.engines.base import Rollouts, SamplingConfig, left_pad, stop_token_ids

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _LogitNoise(LogitsProcessor):
    """Adds N(0, σ²) to every finite logit: a dialled-in sampler/trainer mismatch."""

    def __init__(self, sigma: float, generator: torch.Generator):
        self.sigma, self.generator = sigma, generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # the CPU generator draws the same noise on every device
        noise = torch.randn(scores.shape, generator=self.generator, dtype=torch.float32).to(scores.device, scores.dtype)
        return torch.where(torch.isfinite(scores), scores + self.sigma * noise, scores)


class HFEngine:
    name = "hf"

    def __init__(self, model_path: str, tokenizer: PreTrainedTokenizerBase, dtype: str = "fp32",
                 logit_noise: float = 0.0, device: torch.device | str | None = None):
        self.tokenizer = tokenizer
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device or "cpu")  # the trainer's device: weight syncs stay on it
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device).eval()
        self.logit_noise = logit_noise
        self.stop = stop_token_ids(tokenizer, self.model)  # EOS and the model's other end-of-turn ids

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int, version: int) -> Rollouts:
        pad = self.tokenizer.pad_token_id
        input_ids, attention = (t.to(self.device) for t in left_pad(prompt_ids, pad))
        width = input_ids.shape[1]
        torch.manual_seed(seed)  # generate() samples from the global generator (seeds CUDA's too)
        processors = LogitsProcessorList()
        if self.logit_noise > 0:
            processors.append(_LogitNoise(self.logit_noise, torch.Generator().manual_seed(seed + 1)))
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_new_tokens=sampling.max_tokens,
            logits_processor=processors,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            eos_token_id=self.stop,
        )
        new_tokens = out.sequences[:, width:]  # [B, steps]
        scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [B, steps, V] processed
        token_logprobs = scores.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        responses, logprobs, finished = [], [], []
        for row_ids, row_lps in zip(new_tokens.tolist(), token_logprobs.tolist()):
            ends = [t for t, token in enumerate(row_ids) if token in self.stop]
            stop = ends[0] + 1 if ends else len(row_ids)  # the first stop token ends it (padding may repeat it)
            responses.append(row_ids[:stop])
            logprobs.append(row_lps[:stop])
            finished.append(bool(ends))
        return Rollouts(prompt_ids=[list(p) for p in prompt_ids], response_ids=responses, logprobs=logprobs,
                        finished=finished, version=version)

    @torch.no_grad()
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict()  # tied weights appear under both names
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"hf engine: no parameter {name!r} to sync")
            params[name].copy_(tensor.to(self.dtype))

    def close(self) -> None:
        self.model = None
