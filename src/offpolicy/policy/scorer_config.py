"""The trainer's section, shared by ``offpolicy train`` (``trainer.*``) and ``offpolicy diagnose``
(``--trainer-*``): where the trained model runs and how it scores (and, in train, updates) — one name and one
default for each setting, kept apart from the torch code so the configs load before anything heavy imports
(issue #68).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from offpolicy.core.config import _Strict
from offpolicy.engines.config import TRAIN_ONLY

TrainerDtype = Literal["auto", "fp32", "bf16"]
TRAINER_DTYPES: tuple[str, ...] = get_args(TrainerDtype)
# padded tokens of one micro-batch where trainer.micro_batch_tokens is unset: a pretrained model in train
# (train/config.py, PRETRAINED_DEFAULTS: 2,048 bound SmolLM2-135M's activations on a 24 GB host) and diagnose
MICRO_BATCH_TOKENS = 2048


class ScorerConfig(_Strict):
    """The trainer: device, precision, threads, linear layers and memory — ``trainer.*`` in ``offpolicy train``,
    ``--trainer-*`` in ``offpolicy diagnose`` (which scores the engine's tokens as train's trainer does)."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto = cuda when CUDA is "
                        "available, else cpu; the policy, optimizer state, batches and the loss live there (so does "
                        "the hf engine; vLLM picks its GPU itself)",
                        json_schema_extra={"metavar": "auto | cpu | cuda | cuda:N"})
    dtype: TrainerDtype = Field(
        "auto", description="auto = bf16 on a CUDA device with bf16, else fp32. bf16 = fp32 master weights and "
        "optimizer state with bf16 autocast compute (FSDP MixedPrecision's and verl's practice); log-probs and "
        "every ratio stay fp32")
    threads: int | Literal["auto"] = Field(
        "auto", description="torch's intra-op threads: auto = torch's default (OMP_NUM_THREADS, else one a core); "
        "1 on a busy CPU machine, where a second OpenMP thread stalls every small op "
        "(docs/performance.md#the-embedded-defaults-step-issue-49)")
    cpu_linear: Literal["auto", "onednn", "torch"] = Field(
        "auto", description="the linear layers on an fp32 CPU trainer: auto/onednn = through oneDNN (torch's mkldnn "
        "linear; torch's own BLAS ran them at half the speed on the benchmark's AMD CPU), torch = torch's F.linear. "
        "auto falls back to torch where oneDNN is missing; GPUs and bf16 always use torch's "
        "(docs/performance.md#the-embedded-defaults-step-issue-49)")
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="split the rows into micro-batches of at most this many prompt + response tokens (a "
        "longer row goes alone; where the forward packs each prompt group, whole packs and their tokens); exact: "
        "the loss is divided by the step's global count. Unset: train = one batch for the embedded model, "
        f"{MICRO_BATCH_TOKENS:,} for a pretrained model (model=DIR); diagnose = {MICRO_BATCH_TOKENS:,}. null (train) "
        "= one batch", json_schema_extra={"metavar": "N"})
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward: less memory, "
                                         "about one more forward per update", json_schema_extra=TRAIN_ONLY)

    @field_validator("threads")
    @classmethod
    def _threads_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"trainer.threads={value}: at least 1, or auto")
        return value

    def budget(self, default: int | None) -> int | None:
        """``micro_batch_tokens`` as the command runs it: the value set (null included), else ``default``."""
        return self.micro_batch_tokens if "micro_batch_tokens" in self.model_fields_set else default
