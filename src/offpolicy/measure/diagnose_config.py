"""``offpolicy diagnose`` configuration: every option of ``diagnose.run``, with its default and rule.

The fields are the command line's flags: ``cli.build_parser`` generates each one from its field (its type, choices
and default, its help from the description, a metavar and a section of the help from ``json_schema_extra``), so a new
field is a new flag. The engine, the sampling and the trainer are the sections train shares (``EngineConfig``,
``SamplingSettings``, ``ScorerConfig``: one name and one default each, issue #68); their flags follow one rule,
``FLAG_PREFIX`` (``engine.dtype`` is ``--engine-dtype``, ``engine.kind`` is ``--engine``, ``sampling.top_p`` is
``--top-p``, ``trainer.dtype`` is ``--trainer-dtype``, ``engine.vllm.max_num_seqs`` is ``--vllm-max-num-seqs``).
A refused value is one ``ConfigError`` that names the flag, as the CLI prints it. Everything here is checked
before transformers, an engine or a server is touched.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from offpolicy.core.config import _NESTING, ConfigError, _Strict
from offpolicy.core.sampling import DIAGNOSE_MAX_TOKENS, HEAD_LOGPROBS_MAX, RULES, SamplingConfig, SamplingSettings
from offpolicy.engines.config import EngineConfig
from offpolicy.policy.scorer_config import MICRO_BATCH_TOKENS, TRAINER_DTYPES, ScorerConfig
from offpolicy.tasks.dataset import DataConfig

SERVER_FLAGS = (("api_key_env", "--api-key-env"), ("served_model_name", "--served-model-name"),
                ("no_cache_salt", "--no-cache-salt"), ("sampling_mask", "--sampling-mask"),
                ("sampling_mask_logprobs", "--sampling-mask-logprobs"), ("head_logprobs", "--head-logprobs"))
# the flags' groups on the command line (a field's json_schema_extra "group"; cli.build_parser): the prompts'
# sources exclude one another; the sections and the server flags are a section of the help each (title, description)
SOURCE, ENGINE, VLLM, SAMPLING, TRAINER, SERVER = "source", "engine", "vllm", "sampling", "trainer", "server"
# a shared section's flags: its path → (the flags' prefix, the help's group). engine.kind is --engine itself
SECTIONS: dict[str, tuple[str, str]] = {"engine": ("engine", ENGINE), "engine.vllm": ("vllm", VLLM),
                                        "sampling": ("", SAMPLING), "trainer": ("trainer", TRAINER)}
SECTION_NAME_FIELD = {"engine": "kind"}  # a section whose flag without a suffix is one field (--engine)
# the diagnose flags that left for a section's (issue #68): refused with the new flag's name
MOVED_FLAGS = {"logit_noise": "engine_logit_noise", "device": "trainer_device",
               "micro_batch_tokens": "trainer_micro_batch_tokens"}
GROUPS: dict[str, tuple[str, str | None] | None] = {
    SOURCE: None,  # mutually exclusive, no section of its own
    ENGINE: ("the engine (train's engine.*)", "auto = train's rule (offpolicy.engines.choice) on the loaded model; "
             "its dtype auto = bf16, the precision RL engines sample in"),
    SAMPLING: ("the sampling (train's sampling.*)", None),
    TRAINER: ("the trainer that scores the tokens (train's trainer.*)", None),
    VLLM: ("vLLM (--engine vllm; train's engine.vllm.* options; unset = the platform's default)", None),
    SERVER: ("a running inference server (--engine-url)",
             "Sample through the server's OpenAI-compatible /v1/completions (vllm serve, trl vllm-serve, SGLang) "
             "instead of starting an engine — or, with --sampling-mask, vLLM's /inference/v1/generate or SGLang's "
             "/generate, which return each token's kept set; --model is the trainer's local copy of the served "
             "weights, prompts are rendered here and sent as token ids."),
}


def section_flags() -> dict[str, tuple[str, str, Any]]:
    """Every flag of a shared section diagnose reads: its name (``engine_dtype``, as argparse's dest) → (the dotted
    key, the help's group, the field). A field marked for train only (``json_schema_extra`` commands) has none."""
    sections = {"engine": EngineConfig, "engine.vllm": EngineConfig.model_fields["vllm"].annotation,
                "sampling": SamplingSettings, "trainer": ScorerConfig}
    flags: dict[str, tuple[str, str, Any]] = {}
    for path, model in sections.items():
        prefix, group = SECTIONS[path]
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if f"{path}.{name}" in sections:
                continue  # a section of its own (engine.vllm)
            if "diagnose" not in extra.get("commands", ("diagnose",)):
                continue
            flag = prefix if SECTION_NAME_FIELD.get(path) == name else "_".join(p for p in (prefix, name) if p)
            flags[flag] = (f"{path}.{name}", group, field)
    return flags


SECTION_FLAGS = section_flags()
COMPARED = ("engine", "engine_dtype", "trainer_dtype", "engine_logit_noise")  # what --compare may vary (flag names)


def flag_name(loc: tuple) -> str:
    """The flag of a validation error's location (``("engine", "logit_noise")`` → ``--engine-logit-noise``)."""
    key = ".".join(str(p) for p in loc)
    for flag, (dotted, _, _) in SECTION_FLAGS.items():
        if dotted == key:
            return "--" + flag.replace("_", "-")
    return "--" + str(loc[-1] if loc else "").replace("_", "-")


def into_sections(flags: dict[str, Any]) -> dict[str, Any]:
    """The command line's flags as ``DiagnoseConfig``'s fields: each shared section's flag into its section (a flag
    left at None, argparse's "not given", is left out; ``--engine vllm`` is ``engine.kind``), the rest as they are.

    Raises:
        ConfigError: a flag that moved into a section (``MOVED_FLAGS``), with its new name.
    """
    moved = [k for k in flags if k in MOVED_FLAGS]
    if moved:
        pairs = ", ".join(f"--{k.replace('_', '-')} → --{MOVED_FLAGS[k].replace('_', '-')}" for k in moved)
        raise ConfigError(f"{'this flag has' if len(moved) == 1 else 'these flags have'} moved into the engine / "
                          f"trainer sections train shares (issue #68): {pairs}")
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if key not in SECTION_FLAGS or key == "engine" and isinstance(value, (dict, BaseModel)):
            out[key] = value  # a field of its own, or a whole section
            continue
        node = out
        *path, last = SECTION_FLAGS[key][0].split(".")
        for part in path:
            node = node.setdefault(part, {})
            if isinstance(node, BaseModel):
                raise ConfigError(f"--{key.replace('_', '-')} with a whole {part} section given: pass one of them")
        node[last] = value
    return out


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
    field = str(first["loc"][-1]) if first["loc"] else None
    in_section = len(first["loc"]) > 1  # a section's field (engine.logit_noise): its own check, said with its flag
    if first["type"] == "value_error" and field not in RULES and not in_section:
        message = first["msg"].removeprefix("Value error, ")
        nonfinite = re.match(r"(\w+): got (\S+), which is not a finite number", message)  # _Strict's, in a section
        if nonfinite and first["loc"]:
            return ConfigError(f"{flag_name(tuple(first['loc']) + (nonfinite[1],))} {nonfinite[2]}: expected a finite "
                               "number")
        return ConfigError(message)
    flag = (flags or {}).get(field) or flag_name(tuple(first["loc"]))
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
    # the sections train shares (flags: SECTION_FLAGS)
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the engine that samples")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings, description="the sampling")
    trainer: ScorerConfig = Field(default_factory=ScorerConfig, description="the trainer that scores the tokens")
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
    n: int = Field(512, description="number of samples")
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
        """``flags``: the command line's, by their argparse names (``engine_dtype=bf16``, ``top_p=0.9``: each
        shared section's flag goes into its section, ``SECTION_FLAGS``), or the sections themselves
        (``engine={...}``).

        Raises ConfigError: one line in the CLI's words — the flag, the value's problem (``--n and
        --max-tokens must be positive``, ``--concurrency: Input should be greater than or equal to 1``), or a
        flag that moved into a section, with its new name."""
        token = _NESTING.set(_NESTING.get() + 1)  # the sections' errors come up here, with their paths
        try:
            BaseModel.__init__(self, **into_sections(flags))  # not _Strict's: its message names the class
        except ValidationError as err:
            raise flag_error(err) from None
        finally:
            _NESTING.reset(token)

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
        if vllm and self.engine_url is None and not self.batch and \
                all(s["engine"] == "hf" for s in self.settings()):
            raise ValueError(f"{vllm[0]} is read with --engine vllm only (engine is hf). Fix: --engine vllm, or drop it")
        if self.batch and self.compare:
            raise ValueError("--batch reports on the dumped tensors as they are; --compare needs an engine to sample with")
        if self.batch and self.self_check:
            raise ValueError("--self-check scores the engine's tokens again with the trainer; a --batch dump holds "
                             "log-probs only, no token ids (diagnose --model MODEL --self-check samples them)")
        if not self.batch:
            self._check_sampling()
        return self

    def _check_sampling(self) -> None:
        """``--n`` a sampler can use, and each setting's engine, trainer dtype and noise (``--compare`` varies them,
        each through its section's rules). ``--max-tokens``, ``--temperature``, ``--top-p``, ``--top-k`` and
        ``--min-p`` are checked by their types' rules (``sampling.RULES``), as train's keys are."""
        if self.n <= 0:
            raise ValueError("--n must be positive")
        for setting in self.settings():
            if setting["trainer_dtype"] not in TRAINER_DTYPES:
                raise ValueError(f"--trainer-dtype {setting['trainer_dtype']!r}: expected {', '.join(TRAINER_DTYPES)}")
            noise = setting["logit_noise"]
            if not (math.isfinite(noise) and noise >= 0):  # the hf engine adds noise only where σ > 0
                raise ValueError(f"--engine-logit-noise {noise:g}: expected a finite σ ≥ 0 (0: no noise)")
            if noise > 0 and setting["engine"] == "vllm":
                raise ValueError("--engine-logit-noise is added by the hf engine; with --engine vllm drop it")

    def sampling_config(self, engine: str | None = None) -> SamplingConfig:
        """The engines' contract (``SamplingSettings.config``): ``--max-tokens`` (unset: ``DIAGNOSE_MAX_TOKENS``),
        ``--temperature``, ``--top-p``, ``--top-k``, ``--min-p`` with min-p's place as ``engine`` (default: this
        config's; auto counts as vLLM's, its first choice) applies it, and the head the server is asked for
        (``--head-logprobs``)."""
        from offpolicy.engines import min_p_order

        kind = "sglang" if self.sampling_mask == "sglang" else engine or self.engine.kind
        order = min_p_order("vllm" if kind == "auto" else kind) if self.sampling.min_p > 0 else "min_p_last"
        return self.sampling.config(max_tokens=DIAGNOSE_MAX_TOKENS, head_logprobs=self.head_logprobs,
                                    min_p_order=order)  # without min-p the order is moot

    @property
    def max_tokens(self) -> int:
        """The response limit this run samples to (``--max-tokens``, else ``DIAGNOSE_MAX_TOKENS``)."""
        return self.sampling_config().max_tokens

    def settings(self) -> list[dict[str, Any]]:
        """The engine settings to sample in: this config's, or one per value of ``--compare KEY=V1,V2`` (KEY a
        flag's name: engine, engine-dtype, trainer-dtype, engine-logit-noise). The engine dtype auto is bf16 here
        (``EngineConfig.dtype``); the engine auto is resolved on the loaded model (``diagnose``)."""
        base = {"engine": self.engine.kind, "engine_dtype": "bf16" if self.engine.dtype == "auto" else self.engine.dtype,
                "trainer_dtype": self.trainer.dtype, "logit_noise": self.engine.logit_noise}
        if not self.compare:
            return [base]
        key, _, values = self.compare.partition("=")
        key = key.strip().replace("-", "_")
        if key in MOVED_FLAGS:
            raise ConfigError(f"--compare {key}=…: the flag is now --{MOVED_FLAGS[key].replace('_', '-')} (issue #68)")
        if key not in COMPARED or not values:
            raise ConfigError(f"--compare {self.compare!r}: expected KEY=V1,V2,... with KEY one of "
                              f"{', '.join(k.replace('_', '-') for k in COMPARED)}")
        field = {"engine_logit_noise": "logit_noise"}.get(key, key)
        return [{**base, field: float(raw) if field == "logit_noise" else raw.strip()} for raw in values.split(",")]

    def vllm_flags(self) -> list[str]:
        """The ``--vllm-*`` flags given (train's ``engine.vllm.*`` options), as typed."""
        return [("--no-vllm-" if v is False else "--vllm-") + n.replace("_", "-")
                for n, v in self.engine.vllm.set_options().items()]

    def vllm_options(self) -> dict[str, Any]:
        """``--vllm-*`` as vLLM's options (``VLLMConfig``, validated with the section)."""
        return self.engine.vllm.model_dump()

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
                               warm_start=task_warm_start(self.task))  # the task's limit, not --max-tokens: one cache

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
        if self.engine.logit_noise:
            raise ConfigError("--engine-logit-noise is added by the hf engine; a server samples as it is configured")
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
        if self.sampling_mask and self.sampling.top_k < 1:
            raise ConfigError(f"--sampling-mask {self.sampling_mask} needs --top-k K ≥ 1 (top-k is "
                              f"{self.sampling.top_k}): "
                              "vLLM refuses a mask request without top_k > 0 ('sampling distribution replay "
                              "requires top_k > 0') and SGLang without a finite top_k (SGLang PR #35205)")
        try:
            return ServerConfig(url=self.engine_url, api_key=api_key_from_env(self.api_key_env, os.environ),
                                served_model=self.served_model_name, concurrency=self.concurrency,
                                timeout=self.request_timeout, retries=self.retries, cache_salt=not self.no_cache_salt,
                                sampling_mask=self.sampling_mask, mask_logprobs=self.sampling_mask_logprobs)
        except ValidationError as err:
            raise flag_error(err, SERVER_FIELD_FLAGS) from None
