"""``offpolicy diagnose`` configuration: every option of ``diagnose.run``, with its default and rule.

The fields are the command line's flags: ``cli.build_parser`` generates each one from its field (``--engine-dtype``
is ``engine_dtype``; its type, choices and default, its help from the description, a metavar and a section of the
help from ``json_schema_extra``), so a new field is a new flag and this file holds the only copy of each default.
A refused value is one ``ConfigError`` that names the flag, as the CLI prints it. Everything here is checked
before transformers, an engine or a server is touched.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from offpolicy.core.config import ConfigError, _Strict
from offpolicy.engines.config import VLLMConfig
from offpolicy.core.sampling import RULES, MaxTokens, MinP, SamplingConfig, Temperature, TopK, TopP
from offpolicy.tasks.dataset import DataConfig

COMPARED = ("engine", "engine_dtype", "trainer_dtype", "logit_noise")  # what --compare may vary
SERVER_FLAGS = (("api_key_env", "--api-key-env"), ("served_model_name", "--served-model-name"),
                ("no_cache_salt", "--no-cache-salt"), ("sampling_mask", "--sampling-mask"),
                ("sampling_mask_logprobs", "--sampling-mask-logprobs"), ("head_logprobs", "--head-logprobs"))
HEAD_LOGPROBS_MAX = 20  # vLLM's default --max-logprobs (ModelConfig.max_logprobs, 0.32): a request above it is refused
# padded tokens of one trainer micro-batch: train's micro_batch_tokens for a pretrained model (2,048 bound
# SmolLM2-135M's activations on a 24 GB host: train/config.py, PRETRAINED_DEFAULTS)
MICRO_BATCH_TOKENS = 2048
VLLM_FLAGS = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "enforce_eager")
TRAINER_DTYPES = ("auto", "fp32", "bf16")
# the flags' groups on the command line (a field's json_schema_extra "group"; cli.build_parser): the prompts'
# sources exclude one another; the vLLM and server flags are a section of the help each (title, description)
SOURCE, VLLM, SERVER = "source", "vllm", "server"
GROUPS: dict[str, tuple[str, str | None] | None] = {
    SOURCE: None,  # mutually exclusive, no section of its own
    VLLM: ("vLLM (--engine vllm; train's vllm.* options; unset = the platform's default)", None),
    SERVER: ("a running inference server (--engine-url)",
             "Sample through the server's OpenAI-compatible /v1/completions (vllm serve, trl vllm-serve, SGLang) "
             "instead of starting an engine — or, with --sampling-mask, vLLM's /inference/v1/generate or SGLang's "
             "/generate, which return each token's kept set; --model is the trainer's local copy of the served "
             "weights, prompts are rendered here and sent as token ids."),
}


# ServerConfig's fields under the names of the flags that set them
SERVER_FIELD_FLAGS = {"url": "--engine-url", "api_key": "--api-key-env", "served_model": "--served-model-name",
                "timeout": "--request-timeout", "cache_salt": "--no-cache-salt",
                "sampling_mask": "--sampling-mask", "mask_logprobs": "--sampling-mask-logprobs"}


def flag_error(err: ValidationError, flags: dict[str, str] | None = None) -> ConfigError:
    """A config's first validation error in the CLI's words: our validators' messages name the flag themselves;
    a sampling value's rule (``sampling.RULES``) is the flag, the value and the rule (``--top-k 0: expected -1
    …``; no other value is echoed: a server's URL or key may hold a secret); any other names the field as its
    flag (``flags``, else ``--field-name``)."""
    first = err.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "value_error" and field not in RULES:
        return ConfigError(first["msg"].removeprefix("Value error, "))
    flag = (flags or {}).get(field, "--" + field.replace("_", "-"))
    if first["type"] == "value_error":
        value = first["input"]
        shown = f"{value:g}" if isinstance(value, float) else value
        return ConfigError(f"{flag} {shown}: {first['msg'].removeprefix('Value error, ')}")
    return ConfigError(f"{flag}: {first['msg']}")

class DiagnoseConfig(_Strict):
    """Where the prompts come from (``task``, ``prompts``, ``data``; or ``batch``, a host's dump), what
    samples them (an engine in one or several settings, or the server at ``engine_url``), how the trainer
    scores them, and where the report goes (``out``) and what it gates (``fail_above``, ``fail_below``)."""

    model: str = Field("default", description="local HF model path, or 'default' (embedded tiny model)")
    engine: Literal["vllm", "hf"] = Field("vllm", description="the engine that samples: vllm (in-process vLLM) or "
                                          "hf (the transformers model)")
    engine_dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="the precision the engine "
                                                          "samples in")
    trainer_dtype: str = Field("auto", description="as train's trainer_dtype: fp32 master weights, bf16 = autocast; "
                               "auto = bf16 on CUDA with bf16", json_schema_extra={"choices": list(TRAINER_DTYPES)})
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N: where the trainer (and the hf engine) run; "
                        "auto = cuda when available")
    # where the prompts come from: one of these (SOURCE)
    prompts: str | None = Field(None, description="one JSON object per line with a 'prompt' field",
                                json_schema_extra={"metavar": "FILE.jsonl", "group": SOURCE})
    task: Literal["reverse", "addition", "walk"] = Field(
        "reverse", description="synthetic prompts (walk answers run to 150 tokens: add --max-tokens 160)",
        json_schema_extra={"group": SOURCE})
    data: str | None = Field(None, description="prompts from a dataset file (.jsonl/.parquet/.csv, as train's "
                             "data.path), rendered with the tokenizer's chat template as task=dataset renders them",
                             json_schema_extra={"metavar": "FILE", "group": SOURCE})
    batch: str | None = Field(None, description="report on a batch dumped by a host integration "
                              "(offpolicy.integrations.dump) instead of sampling",
                              json_schema_extra={"metavar": "FILE_OR_DIR", "group": SOURCE})
    prompt_field: str = Field("question", description="--data: the prompt column (train's data.prompt_field)")
    system_prompt: str | None = Field(None, description="--data: a system message (train's data.system_prompt)")
    chat_template: Literal["auto", "none"] = Field("auto", description="--data: train's data.chat_template")
    max_prompt_tokens: int = Field(512, description="--data: longer prompts are refused")
    # the sampling (rules: offpolicy.core.sampling.RULES, as train's keys and the engines' SamplingConfig)
    n: int = Field(512, description="number of samples")
    max_tokens: MaxTokens = Field(64, description="response limit, in tokens")
    temperature: Temperature = Field(1.0, description="τ, > 0")
    top_p: TopP = Field(1.0, description="nucleus mass in (0, 1]; 1 keeps everything")
    top_k: TopK = Field(-1, description="tokens kept by top-k; -1 = no top-k")
    min_p: MinP = Field(0.0, description="min-p in [0, 1); 0 = off. Its place among the truncations follows the "
                        "engine: vLLM (in-process or a server) first, the hf engine and an SGLang server (named by "
                        "its sampling-mask flag) after top-k and top-p")
    logit_noise: float = Field(0.0, description="additive engine logit noise σ (hf engine)")
    micro_batch_tokens: int | None = Field(
        MICRO_BATCH_TOKENS, gt=0, description="the trainer's micro-batches, in padded tokens, as train's "
        "micro_batch_tokens (train's for a pretrained model); null = one batch", json_schema_extra={"metavar": "N"})
    # train's vllm.* options (VLLM_FLAGS)
    vllm_max_num_batched_tokens: int | None = Field(
        None, description="tokens per engine step (vllm.max_num_batched_tokens)",
        json_schema_extra={"metavar": "N", "group": VLLM})
    vllm_max_num_seqs: int | None = Field(None, description="sequences per engine step (vllm.max_num_seqs)",
                                          json_schema_extra={"metavar": "N", "group": VLLM})
    vllm_enable_chunked_prefill: bool | None = Field(
        None, description="split long prompts over steps (vllm.enable_chunked_prefill; refused on the CPU)",
        json_schema_extra={"group": VLLM})
    vllm_enforce_eager: bool | None = Field(
        None, description="no CUDA graphs or compilation (vllm.enforce_eager; default: on the CPU only)",
        json_schema_extra={"group": VLLM})
    compare: str | None = Field(None, description="several settings side by side, e.g. engine_dtype=bf16,fp16,fp32",
                                json_schema_extra={"metavar": "KEY=V1,V2"})
    seed: int = Field(0, description="the seed of the prompts drawn and of the engine's sampling")
    out: str = Field("diagnose", description="output directory (report.json, PNG plots)")
    fail_above: list[str] | None = Field(
        None, description="CI gate: exit 3 if report.json's summary STAT exceeds VALUE (repeatable), e.g. "
        "kl_k3=5e-4, mean_abs_log_ratio=0.1, mult_prob_error=1.05, kl_over_entropy=0.01, "
        "masked_fraction@verl:decoupled_seq_is_rs=0.05", json_schema_extra={"metavar": "STAT=VALUE"})
    fail_below: list[str] | None = Field(
        None, description="CI gate: exit 3 if the summary STAT is below VALUE (repeatable), e.g. ess=0.9",
        json_schema_extra={"metavar": "STAT=VALUE"})
    # a running inference server (SERVER)
    engine_url: str | None = Field(None, description="the server's base URL, e.g. http://127.0.0.1:8000",
                                   json_schema_extra={"metavar": "URL", "group": SERVER})
    api_key_env: str | None = Field(None, description="environment variable holding the server's API key",
                                    json_schema_extra={"metavar": "VAR", "group": SERVER})
    served_model_name: str | None = Field(
        None, description="the model to request when /v1/models lists several (default: the only one)",
        json_schema_extra={"metavar": "NAME", "group": SERVER})
    concurrency: int = Field(8, description="requests in flight at once", json_schema_extra={"group": SERVER})
    request_timeout: float = Field(300.0, description="per request",
                                   json_schema_extra={"metavar": "SECONDS", "group": SERVER})
    retries: int = Field(3, description="retries with backoff after a connection error, timeout, HTTP 429 or 5xx "
                         "(never other 4xx)", json_schema_extra={"group": SERVER})
    no_cache_salt: bool = Field(
        False, description="do not send vLLM's cache_salt (sent by default: one fresh salt per run, so no request "
        "reuses prefix-cache KV computed before the run by older weights); for a server that refuses the field",
        json_schema_extra={"group": SERVER})
    log_to: str | None = Field(None, description="also send the summary, what-if table and plots to these "
                               "trackers, comma-separated: tensorboard, wandb, mlflow, trackio (offline, into --out)",
                               json_schema_extra={"metavar": "TRACKERS"})
    sampling_mask: Literal["vllm", "sglang"] | None = Field(
        None, description="ask the server for each token's kept set (its sampling mask) and replay it in the trainer: "
        "vllm = /inference/v1/generate of a vLLM server started with its return_sampling_mask option, sglang = "
        "/generate with "
        "return_sampling_mask; needs --top-k K >= 1 (both engines bound a mask by it)",
        json_schema_extra={"group": SERVER})
    sampling_mask_logprobs: bool = Field(
        False, description="with --sampling-mask sglang: also ask the log-prob of every kept id (SGLang PR #40932) "
        "and check them", json_schema_extra={"group": SERVER})
    head_logprobs: int = Field(
        0, description="also ask a vLLM server for each sampled token's K most likely ids with their log-probs (the "
        "sampler's head, score centering's 'head' support: vLLM 0.32 sends none for its mask's ids), check them and "
        f"report the mass they cover; 0 = off, at most {HEAD_LOGPROBS_MAX} (a vLLM server's default max_logprobs; "
        f"{HEAD_LOGPROBS_MAX - 1} with --sampling-mask vllm)", json_schema_extra={"metavar": "K", "group": SERVER})
    self_check: bool = Field(False, description="also score the engine's tokens with the trainer at micro-batch 1 "
                             "and with an fp32 head, against the configured micro-batches and precision (the share "
                             "of tokens with a ratio outside [0.9, 1.1], max |Δ log π|), and attribute the engine "
                             "precision's gap to fp32 layer by layer (report.json self_check; offpolicy.measure.self_check)")
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
        """``--n`` a sampler can use, and each setting's trainer dtype and noise (``--compare`` varies them).
        ``--max-tokens``, ``--temperature``, ``--top-p`` and ``--top-k`` are checked by their types' rules
        (``sampling.RULES``), as train's keys are."""
        if self.n <= 0:
            raise ValueError("--n must be positive")
        for setting in self.settings():
            if setting["trainer_dtype"] not in TRAINER_DTYPES:
                raise ValueError(f"--trainer-dtype {setting['trainer_dtype']!r}: expected auto, fp32 or bf16")
            noise = setting["logit_noise"]
            if not (math.isfinite(noise) and noise >= 0):  # the hf engine adds noise only where σ > 0
                raise ValueError(f"--logit-noise {noise:g}: expected a finite σ ≥ 0 (0: no noise)")

    @property
    def sampling(self) -> SamplingConfig:
        """What the engine samples with and the trainer renormalises over (``--max-tokens``, ``--temperature``,
        ``--top-p``, ``--top-k``), and the head the server is asked for (``--head-logprobs``)."""
        from offpolicy.engines import min_p_order

        return SamplingConfig(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, head_logprobs=self.head_logprobs,
                              min_p_order=min_p_order("sglang" if self.sampling_mask == "sglang" else self.engine)
                              if self.min_p > 0 else "min_p_last")  # without min-p the order is moot

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
        from offpolicy.engines.server import SGLANG_HEAD, ServerConfig, api_key_from_env, head_asked

        if not 0 <= self.head_logprobs <= HEAD_LOGPROBS_MAX:
            raise ConfigError(f"--head-logprobs {self.head_logprobs}: expected 0 (off) to {HEAD_LOGPROBS_MAX}, the "
                              "most top log-probs a vLLM server sends by default (its --max-logprobs)")
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
        if self.sampling_mask_logprobs and self.sampling_mask != "sglang":
            raise ConfigError("--sampling-mask-logprobs needs --sampling-mask sglang: vLLM 0.32 returns the kept ids "
                              "only, and /v1/completions no mask at all")
        if self.head_logprobs and self.sampling_mask == "sglang":
            raise ConfigError(SGLANG_HEAD)
        if self.sampling_mask == "vllm" and head_asked("vllm", self.head_logprobs) > HEAD_LOGPROBS_MAX:
            raise ConfigError(f"--head-logprobs {self.head_logprobs} with --sampling-mask vllm asks "
                              f"/inference/v1/generate for {head_asked('vllm', self.head_logprobs)} log-probs (it "
                              "sends the sampled id plus K − 1 others when the sampled one ranks below K), above "
                              f"vLLM's default --max-logprobs of {HEAD_LOGPROBS_MAX}. Fix: --head-logprobs "
                              f"{HEAD_LOGPROBS_MAX - 1} or less")
        if self.sampling_mask and self.top_k < 1:
            raise ConfigError(f"--sampling-mask {self.sampling_mask} needs --top-k K ≥ 1 (top-k is {self.top_k}): "
                              "vLLM refuses a mask request without top_k > 0 ('sampling distribution replay "
                              "requires top_k > 0') and SGLang without a finite top_k (SGLang PR #35205)")
        try:
            return ServerConfig(url=self.engine_url, api_key=api_key_from_env(self.api_key_env, os.environ),
                                served_model=self.served_model_name, concurrency=self.concurrency,
                                timeout=self.request_timeout, retries=self.retries, cache_salt=not self.no_cache_salt,
                                sampling_mask=self.sampling_mask, mask_logprobs=self.sampling_mask_logprobs)
        except ValidationError as err:
            raise flag_error(err, SERVER_FIELD_FLAGS) from None
