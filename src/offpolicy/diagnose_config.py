"""``offpolicy diagnose`` configuration: every option of ``diagnose.run``, with its default and rule.

The fields are the command line's flags (``--engine-dtype`` is ``engine_dtype``); a refused value is one
``ConfigError`` that names the flag, as the CLI prints it. Everything
here is checked before transformers, an engine or a server is touched.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from offpolicy.config import ConfigError, _Strict
from offpolicy.engines.config import VLLMConfig
from offpolicy.tasks.dataset import DataConfig

COMPARED = ("engine", "engine_dtype", "trainer_dtype", "logit_noise")  # what --compare may vary
SERVER_FLAGS = (("api_key_env", "--api-key-env"), ("served_model_name", "--served-model-name"),
                ("no_cache_salt", "--no-cache-salt"))
# padded tokens of one trainer micro-batch: train's micro_batch_tokens for a pretrained model (2,048 bound
# SmolLM2-135M's activations on a 24 GB host: train/config.py, PRETRAINED_DEFAULTS)
MICRO_BATCH_TOKENS = 2048
VLLM_FLAGS = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "enforce_eager")


# ServerConfig's fields under the names of the flags that set them
SERVER_FIELD_FLAGS = {"url": "--engine-url", "api_key": "--api-key-env", "served_model": "--served-model-name",
                "timeout": "--request-timeout", "cache_salt": "--no-cache-salt"}


def flag_error(err: ValidationError, flags: dict[str, str] | None = None) -> ConfigError:
    """A config's first validation error in the CLI's words: our validators' messages name the flag
    themselves; any other names the field as its flag (``flags``, else ``--field-name``)."""
    first = err.errors()[0]
    if first["type"] == "value_error":
        return ConfigError(first["msg"].removeprefix("Value error, "))
    field = str(first["loc"][0])
    return ConfigError(f"{(flags or {}).get(field, '--' + field.replace('_', '-'))}: {first['msg']}")

class DiagnoseConfig(_Strict):
    """Where the prompts come from (``task``, ``prompts``, ``data``; or ``batch``, a host's dump), what
    samples them (an engine in one or several settings, or the server at ``engine_url``), how the trainer
    scores them, and where the report goes (``out``) and what it gates (``fail_above``, ``fail_below``)."""

    model: str = Field("default", description="local HF model path, or 'default' (embedded tiny model)")
    engine: Literal["vllm", "hf"] = "vllm"
    engine_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    trainer_dtype: str = Field("auto", description="auto | fp32 | bf16, as train's trainer_dtype")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N: where the trainer and the hf engine run")
    prompts: str | None = Field(None, description="a JSONL file with a 'prompt' field per line")
    task: Literal["reverse", "addition", "walk"] = "reverse"
    data: str | None = Field(None, description="prompts from a dataset file, rendered as task=dataset renders them")
    batch: str | None = Field(None, description="a batch dumped by a host integration, instead of sampling")
    prompt_field: str = "question"
    system_prompt: str | None = None
    chat_template: Literal["auto", "none"] = "auto"
    max_prompt_tokens: int = 512
    n: int = Field(512, description="number of samples")
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logit_noise: float = Field(0.0, description="additive engine logit noise σ (hf engine)")
    micro_batch_tokens: int | None = Field(MICRO_BATCH_TOKENS, gt=0, description="the trainer's micro-batch, in padded tokens "
                                           "(train's micro_batch_tokens for a pretrained model); null = one batch")
    vllm_max_num_batched_tokens: int | None = None
    vllm_max_num_seqs: int | None = None
    vllm_enable_chunked_prefill: bool | None = None
    vllm_enforce_eager: bool | None = None
    compare: str | None = Field(None, description="KEY=V1,V2,...: several settings side by side")
    seed: int = 0
    out: str = "diagnose"
    fail_above: list[str] | None = None
    fail_below: list[str] | None = None
    engine_url: str | None = None
    api_key_env: str | None = None
    served_model_name: str | None = None
    concurrency: int = 8
    request_timeout: float = 300.0
    retries: int = 3
    no_cache_salt: bool = False
    log_to: str | None = None
    self_check: bool = Field(False, description="also score the engine's tokens with the trainer at micro-batch 1 "
                             "and with an fp32 head, against the configured micro-batches and precision (the share "
                             "of tokens with a ratio outside [0.9, 1.1], max |Δ log π|), and attribute the engine "
                             "precision's gap to fp32 layer by layer (report.json self_check; offpolicy.self_check)")
    require_exact: bool = Field(False, description="fail (exit 3) unless every log-ratio is exactly 0, naming the "
                                "first token whose log-probs differ: row, position, log π_train and log μ")

    def __init__(self, **flags: Any) -> None:
        """Raises ConfigError: one line in the CLI's words — the flag, the value's problem (``--n and
        --max-tokens must be positive``, ``--concurrency: Input should be greater than or equal to 1``)."""
        try:
            BaseModel.__init__(self, **flags)  # not _Strict's: its message names the class, not the flag
        except ValidationError as err:
            raise flag_error(err) from None

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_finite(cls, data: Any) -> Any:
        """Not _Strict's blanket refusal: each flag's own check names it (``--temperature nan: expected a
        finite number > 0``)."""
        return data

    @model_validator(mode="after")
    def _checked(self) -> DiagnoseConfig:
        """The CLI's rules, in its order: server flags, vLLM flags, the sampling, every setting (the gates'
        STAT=VALUE bounds: ``diagnose.bounds``)."""
        self.server()  # --engine-url: a wrong flag fails before transformers even imports
        vllm = self.vllm_flags()
        if vllm and self.engine_url is None and not self.batch and all(s["engine"] != "vllm" for s in self.settings()):
            raise ValueError(f"{vllm[0]} is read with --engine vllm only (engine is {self.engine!r}). "
                             "Fix: --engine vllm, or drop it")
        if self.batch and self.compare:
            raise ValueError("--batch reports on the dumped tensors as they are; --compare needs an engine to sample with")
        if self.batch and self.self_check:
            raise ValueError("--self-check scores the engine's tokens again with the trainer; a --batch dump holds "
                             "log-probs only, no token ids (diagnose --model MODEL --self-check samples them)")
        if not self.batch:
            self._check_sampling()
        return self

    def _check_sampling(self) -> None:
        """``--n``, ``--max-tokens``, ``--temperature``, ``--top-p``, ``--top-k`` a sampler can use, and each
        setting's trainer dtype and noise (the trainer's ``renormalize_logprobs`` would refuse them only after
        sampling)."""
        if self.n <= 0 or self.max_tokens <= 0:
            raise ValueError("--n and --max-tokens must be positive")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"--temperature {self.temperature:g}: expected a finite number > 0 (greedy decoding, "
                             "temperature 0, samples no distribution whose log-probs a ratio could compare; a small "
                             "value such as 0.1 samples almost greedily)")
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError(f"--top-p {self.top_p:g}: expected a value in (0, 1]; 1 keeps the whole distribution")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"--top-k {self.top_k}: expected -1 (no top-k; vLLM also reads 0 as off, offpolicy takes "
                             "-1 only) or a number of tokens ≥ 1")
        for setting in self.settings():
            if setting["trainer_dtype"] not in ("auto", "fp32", "bf16"):
                raise ValueError(f"--trainer-dtype {setting['trainer_dtype']!r}: expected auto, fp32 or bf16")
            noise = setting["logit_noise"]
            if not (math.isfinite(noise) and noise >= 0):  # the hf engine adds noise only where σ > 0
                raise ValueError(f"--logit-noise {noise:g}: expected a finite σ ≥ 0 (0: no noise)")

    def settings(self) -> list[dict[str, Any]]:
        """The engine settings to sample in: this config's, or one per value of ``--compare KEY=V1,V2``."""
        base = {key: getattr(self, key) for key in COMPARED}
        if not self.compare:
            return [base]
        key, _, values = self.compare.partition("=")
        key = key.strip().replace("-", "_")
        if key not in base or not values:
            raise ConfigError(f"--compare {self.compare!r}: expected KEY=V1,V2,... with KEY one of {', '.join(base)}")
        return [{**base, key: float(raw) if key == "logit_noise" else raw.strip()} for raw in values.split(",")]

    def vllm_flags(self) -> list[str]:
        """The ``--vllm-*`` flags given (train's ``vllm.*`` options), as typed."""
        given = {n: getattr(self, f"vllm_{n}") for n in VLLM_FLAGS}
        return [("--no-vllm-" if v is False else "--vllm-") + n.replace("_", "-") for n, v in given.items()
                if v is not None]

    def vllm_options(self) -> dict[str, Any]:
        """``--vllm-*`` under train's ``vllm.*`` rules (``VLLMConfig``)."""
        return VLLMConfig(**{n: getattr(self, f"vllm_{n}") for n in VLLM_FLAGS}).model_dump()

    def data_config(self) -> DataConfig:
        """``--data`` and its rendering flags as train's ``data.*``."""
        return DataConfig(path=self.data, prompt_field=self.prompt_field, system_prompt=self.system_prompt,
                          chat_template=self.chat_template)

    def warm_start_spec(self) -> Any:
        """What names the embedded model's warm start for ``--task`` (``policy.warmstart.WarmStartSpec``): the
        task's own response limit and warm start, as ``offpolicy train task=TASK`` resolves them — the same
        cached model."""
        from types import SimpleNamespace

        from offpolicy.policy.warmstart_config import task_warm_start
        from offpolicy.tasks import make_task

        return SimpleNamespace(task=self.task, task_params={}, max_new_tokens=make_task(self.task).max_new_tokens,
                               warm_start=task_warm_start(self.task))

    def server(self):
        """The ``ServerConfig`` of ``--engine-url`` (None without it).

        Raises:
            ConfigError: a flag that has no meaning against a server, a URL that is not http(s), an
                ``--api-key-env`` variable that is unset, or a server flag without ``--engine-url``.
        """
        from offpolicy.engines.server import ServerConfig, api_key_from_env

        if self.engine_url is None:
            given = [flag for name, flag in SERVER_FLAGS if getattr(self, name) not in (None, False)]
            if given:
                raise ConfigError(f"{given[0]} needs --engine-url URL (the server to sample from)")
            return None
        if self.batch:
            raise ConfigError("--engine-url samples from a server, --batch reads a dump: pass one of them")
        if self.compare:
            raise ConfigError("--compare starts engines in several settings; --engine-url measures the one server as "
                              "it runs (run diagnose once per server)")
        if self.logit_noise:
            raise ConfigError("--logit-noise is added by the hf engine; a server samples as it is configured")
        if self.vllm_flags():
            raise ConfigError(f"{self.vllm_flags()[0]} configures the in-process vLLM engine; a server batches as it "
                              "was started (pass the option to the server instead)")
        try:
            return ServerConfig(url=self.engine_url, api_key=api_key_from_env(self.api_key_env, os.environ),
                                served_model=self.served_model_name, concurrency=self.concurrency,
                                timeout=self.request_timeout, retries=self.retries, cache_salt=not self.no_cache_salt)
        except ValidationError as err:
            raise flag_error(err, SERVER_FIELD_FLAGS) from None
