"""The in-process vLLM engine's options, as a config both ``train`` (``vllm.*``) and ``diagnose``
(``--vllm-*``) validate before vLLM imports."""

from __future__ import annotations

from pydantic import Field, model_validator

from offpolicy.core.config import _Strict


class VLLMConfig(_Strict):
    """``engine: vllm``: vLLM's batching and compilation options, passed to ``vllm.LLM`` under the same
    names (checked against the installed vLLM's ``EngineArgs``). Unset = the platform's default."""

    max_num_batched_tokens: int | None = Field(
        None, gt=0, description="tokens vLLM processes per engine step (prefill + decode); unset = vLLM's default "
        "(CPU: 4,096, raised to the context with chunked prefill off; GPUs of ≥ 70 GiB but A100s — H100, H200, B200: "
        "16,384; other GPUs: 8,192)")
    max_num_seqs: int | None = Field(None, gt=0, description="sequences in flight per engine step; unset = vLLM's "
                                     "default (CPU 256; GPUs of ≥ 70 GiB but A100s 1,024; other GPUs 256)")
    enable_chunked_prefill: bool | None = Field(
        None, description="split long prompts over engine steps; unset = off on the CPU (vLLM cannot rewind a split "
        "prompt's seeded CPU generator: 'CPU Generator does not use offset'; true is refused there), vLLM's default "
        "(on) on CUDA")
    enforce_eager: bool | None = Field(
        None, description="no CUDA graphs, no compilation; unset = true on the CPU, false on CUDA (graphs on, as "
        "TRL's colocate mode: the in-place weight reload keeps the captured tensors valid)")

    @model_validator(mode="after")
    def _budget_holds_a_token_per_sequence(self) -> VLLMConfig:
        if self.max_num_batched_tokens is not None and self.max_num_seqs is not None \
                and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"vllm.max_num_batched_tokens={self.max_num_batched_tokens} < vllm.max_num_seqs="
                             f"{self.max_num_seqs}: each running sequence needs at least one token of the step's "
                             "budget. Fix: raise the budget or lower max_num_seqs")
        return self
