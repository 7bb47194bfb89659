"""``offpolicy train`` configuration: every option with its default and rule, in one place.

Load from YAML and override from the command line with dotted ``key=value`` pairs
(``loss.kind=cispo``, ``max_staleness=2``); values are parsed as YAML scalars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator

from offpolicy.core.config import ConfigError, LossConfig, _read_yaml, _Strict
from offpolicy.core.sampling import HEAD_LOGPROBS_MAX, SamplingConfig, SamplingSettings
from offpolicy.engines.config import EngineConfig
from offpolicy.policy.scorer_config import MICRO_BATCH_TOKENS, ScorerConfig
from offpolicy.policy.warmstart_config import WarmStartConfig, task_warm_start
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
    # gradient are unchanged, see trainer.micro_batch_tokens)
    "trainer.micro_batch_tokens": MICRO_BATCH_TOKENS,
}
# the keys that moved into the shared sections (issue #68): a config (or a run's config.yaml written before) that
# still uses one is refused with its new name — no silent alias
MOVED = {
    "engine_dtype": "engine.dtype", "engine_weight_noise": "engine.weight_noise",
    "engine_logit_noise": "engine.logit_noise", "engine_gpu_memory_utilization": "engine.gpu_memory_utilization",
    "engine_sleep": "engine.sleep", "vllm": "engine.vllm",
    "max_new_tokens": "sampling.max_tokens", "temperature": "sampling.temperature", "top_p": "sampling.top_p",
    "top_k": "sampling.top_k", "min_p": "sampling.min_p",
    "device": "trainer.device", "trainer_dtype": "trainer.dtype", "threads": "trainer.threads",
    "cpu_linear": "trainer.cpu_linear", "gradient_checkpointing": "trainer.gradient_checkpointing",
    "micro_batch_tokens": "trainer.micro_batch_tokens",
}
SHORTHANDS = {"engine": "kind"}  # a section a bare value may stand for: engine=vllm is engine.kind=vllm


def moved_keys_error(keys: list[str]) -> str:
    """The one message for keys of ``MOVED``: each old key with its new dotted name."""
    pairs = ", ".join(f"{k} → {MOVED[k]}" for k in keys)
    return (f"{'this key has' if len(keys) == 1 else 'these keys have'} moved into the engine / sampling / trainer "
            f"sections (issue #68): {pairs}. Fix: write the new key (e.g. {MOVED[keys[0]]}=…); a run's config.yaml "
            "written before the move: rewrite those keys in it, or start a new run")


def dotted(cfg: BaseModel, key: str) -> Any:
    """``cfg``'s value at a dotted key (``trainer.micro_batch_tokens``)."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def is_set(cfg: BaseModel, key: str) -> bool:
    """Whether the user set the dotted ``key`` (its section given and the field in it)."""
    *path, last = key.split(".")
    for part in path:
        if part not in cfg.model_fields_set:
            return False
        cfg = getattr(cfg, part)
    return last in cfg.model_fields_set


def _set_default(cfg: BaseModel, key: str, value: Any) -> None:
    """Write a resolved default into an unset key (``lr``, ``trainer.micro_batch_tokens``: one section deep at
    most) of a config being validated, leaving it unset so ``model_defaults`` still tells it from the user's; a
    section is replaced by a copy (the instance may be the caller's)."""
    section, _, field = key.rpartition(".")
    if not section:
        object.__setattr__(cfg, field, value)
        return
    old = getattr(cfg, section)
    new = old.model_copy(update={field: value})
    object.__setattr__(new, "__pydantic_fields_set__", set(old.model_fields_set))
    object.__setattr__(cfg, section, new)


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
    "engine": ("the rollout engine and the mismatch it brings", ("engine",)),
    "sampling": ("what the engine samples with (the trainer renormalises over the same support)", ("sampling",)),
    "algorithm": ("the RL algorithm: steps, batches, optimizer, staleness",
                  ("steps", "prompts_per_step", "group_size", "ppo_epochs", "minibatches", "lr", "max_grad_norm",
                   "max_staleness", "staleness_policy", "recompute_old", "prox_logp", "seed")),
    "loss": ("the loss: a preset, with the loss.* keys you set on top", ("preset", "loss", "score_centering_head")),
    "trainer": ("where and how the trainer runs: device, precision, memory", ("trainer",)),
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
    # the shared sections (issue #68): the same keys, names and defaults as offpolicy diagnose's
    engine: EngineConfig = Field(default_factory=EngineConfig, description="engine=vllm names the engine alone "
                                 "(engine.kind). The section diagnose shares: --engine, --engine-*, --vllm-*")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings, description="each key's rule is "
                                       "offpolicy.core.sampling.RULES. The section diagnose shares: --max-tokens, "
                                       "--temperature, --top-p, --top-k, --min-p")
    trainer: ScorerConfig = Field(default_factory=ScorerConfig, description="the section diagnose shares: "
                                  "--trainer-* (diagnose scores the engine's tokens as this trainer does)")
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
        HEAD_LOGPROBS_MAX, ge=1, le=HEAD_LOGPROBS_MAX, description="loss.score_centering=head: the sampler's k most "
        "likely ids of each token the engine returns with their log μ, the head the score is centred over "
        f"(≤ {HEAD_LOGPROBS_MAX}: vLLM's max_logprobs)")
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
    def _reject_unknown_keys(cls, data: Any) -> Any:
        """A key that moved into a section (``MOVED``) is named with its new key; any other unknown key as
        ``_Strict`` names it."""
        if isinstance(data, dict):
            moved = [k for k in data if k in MOVED]
            if moved:
                raise ValueError(moved_keys_error(moved))
        return _Strict._reject_unknown_keys.__func__(cls, data)

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
        """Unset ``sampling.max_tokens`` and warm-start fields take the task's values; a pretrained model's
        (``model=DIR``) unset ``lr`` / ``prompts_per_step`` / ``group_size`` / ``trainer.micro_batch_tokens``
        take ``PRETRAINED_DEFAULTS``, whatever the task (``model_defaults`` says which applied)."""
        if self.model != "default":
            for key, default in PRETRAINED_DEFAULTS.items():
                if not is_set(self, key):  # set by the user (or a saved config.yaml): kept
                    _set_default(self, key, default)
        if self.task == "dataset":  # no warm start (model=DIR); GSM8K-style reasoning needs room
            for key, default in (("sampling.max_tokens", DATASET_MAX_NEW_TOKENS),
                                 ("max_prompt_tokens", DATASET_MAX_PROMPT)):
                if dotted(self, key) is None:
                    _set_default(self, key, default)
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
        if self.sampling.max_tokens is None:  # the task's own limit (a frozen model: set once, here)
            _set_default(self, "sampling.max_tokens", task.max_new_tokens)
        object.__setattr__(self, "warm_start", task_warm_start(self.task, self.warm_start))
        return self

    def model_defaults(self) -> str | None:
        """One line for the run's console: which model-dependent defaults this run took (the options in
        ``PRETRAINED_DEFAULTS`` the user left unset), or None when every one was set (a resumed run's
        config.yaml sets them all)."""
        unset = [key for key in PRETRAINED_DEFAULTS if not is_set(self, key)]
        if not unset:
            return None
        which = "the embedded model's" if self.model == "default" else "a pretrained model's (model=DIR)"
        values = ", ".join(f"{key} {dotted(self, key)}" for key in unset)
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
    def _score_centering_has_its_support(self) -> TrainConfig:
        form = self.loss_config().score_centering
        if form is None and self.score_centering_head != type(self).model_fields["score_centering_head"].default:
            raise ValueError("score_centering_head applies only with loss.score_centering=head")
        problem = score_centering_problem(form, self.engine.kind, self.sampling, self.prox_logp)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _micro_batches_exact(self) -> TrainConfig:
        loss = self.loss_config()
        budget = self.trainer.micro_batch_tokens
        if budget is not None and loss.agg == "seq-mean-token-sum-norm" and loss.max_len is None:
            raise ValueError(
                f"trainer.micro_batch_tokens={budget}"
                f"{'' if is_set(self, 'trainer.micro_batch_tokens') else ' (a pretrained model default)'} with "
                "loss.agg 'seq-mean-token-sum-norm' and no loss.max_len: each micro-batch would divide by its own "
                "padded length, so they would not add up to the whole batch's loss. Fix: "
                f"loss.max_len={self.sampling.max_tokens} (the response limit), or trainer.micro_batch_tokens=null")
        return self

    def sampling_config(self, min_p_order: str = "min_p_last") -> SamplingConfig:
        """The engines' contract for this run (``SamplingSettings.config``): the ``sampling`` section with its
        response limit resolved, min-p's place (the engine's: the trainer passes it once the engine is chosen,
        ``train/loop.py``) and, under score centering's head form, the head the engine returns."""
        return self.sampling.config(head_logprobs=self.score_centering_head
                                    if self.loss_config().score_centering == "head" else 0, min_p_order=min_p_order)

    def warm_start_spec(self) -> Any:
        """What names the embedded model's warm start (``policy.warmstart.WarmStartSpec``): the task, its options,
        the response limit and the warm start's own settings (the cached model's key)."""
        from types import SimpleNamespace

        return SimpleNamespace(task=self.task, task_params=self.task_params, max_new_tokens=self.sampling.max_tokens,
                               warm_start=self.warm_start)

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


def score_centering_problem(form: str | None, engine: str, sampling: SamplingSettings, prox_logp: str,
                            why: str = "") -> str | None:
    """The one statement of score centering's cross-section rule (loss × engine × sampling × π_old): what is wrong
    with centring ``form`` on this engine (``engine``: hf, vllm, or auto before it is resolved) and sampling, or
    None. The config checks it when it loads; the loop again once ``engine=auto`` is resolved (``why``: the
    choice's reason, for the message). The support centring reads (docs/estimators.md#score-centering): the
    engine's kept sets with q_v (exact: only truncated sampling has sets smaller than the vocabulary) or the
    engine's top-k head (head: p over the full vocabulary, so untruncated sampling only: under top-k/top-p the
    trainer's p is renormalised over its kept set, and exact is the form that matches it)."""
    if form is None:
        return None
    if prox_logp == "loglinear":
        return (f"loss.score_centering={form!r} with prox_logp=loglinear: the centring reads log π_old of every "
                "support id, which AReaL's interpolation does not give. Fix: prox_logp=forward")
    if form == "exact" and not sampling.truncates:
        return ("loss.score_centering=exact centres over the engine's kept sets, and untruncated sampling keeps the "
                "whole vocabulary (sampling.top_k=-1, top_p=1, min_p=0). Fix: loss.score_centering=head, or "
                "sampling.top_k / top_p < 1")
    if form == "exact" and engine == "vllm":
        chose = f"; engine=auto chose vllm ({why})" if why else ""
        return ("loss.score_centering=exact needs each kept id's log q_v, which vLLM does not return with its "
                f"sampling mask{chose}. Fix: engine=hf, or loss.score_centering=head with untruncated sampling")
    if form == "head" and sampling.truncates:
        return (f"loss.score_centering=head with sampling.top_k={sampling.top_k}, sampling.top_p={sampling.top_p}, "
                f"sampling.min_p={sampling.min_p}: under truncated sampling the trainer's p is renormalised over the "
                "kept set, not the full vocabulary the head's tail is modelled on. Fix: loss.score_centering=exact "
                "(engine=hf records each kept id's q_v), or sampling.top_k=-1 sampling.top_p=1 sampling.min_p=0")
    return None


def resolve_engine(cfg: TrainConfig, device, parameters: int, vocabulary: int,
                   recorded: dict[str, Any] | None = None) -> tuple[str, str]:
    """The engine to run with and why: ``engine`` unless it is ``auto`` (``offpolicy.engines.choice.choose``:
    by the device, the model's ``parameters`` and its ``vocabulary``). A resumed run passes its config.yaml's
    ``resolved`` choices as ``recorded``: ``auto`` then keeps the engine the run chose when it was created,
    wherever it resumes (the mismatch a run measures is its engine's); ``engine=…`` on the resume still wins."""
    if cfg.engine.kind != "auto":
        return cfg.engine.kind, "set in the config"
    if recorded and recorded.get("engine"):
        why = str(recorded.get("engine_reason") or "auto")
        return recorded["engine"], f"{why} (chosen when the run was created; a resume keeps it)"
    from offpolicy.engines.choice import choose

    return choose(device, parameters, vocabulary, logit_noise=cfg.engine.logit_noise,
                  vllm_options_set=bool(cfg.engine.vllm.set_options()))


def resolve_engine_dtype(cfg: TrainConfig, recorded: dict[str, Any] | None = None) -> tuple[str, str]:
    """The engine dtype to run with and why: ``engine.dtype`` unless it is ``auto``. A resumed run passes its
    config.yaml's ``resolved`` choices as ``recorded``: ``auto`` then keeps the dtype the run started with (a
    resume on a machine with or without native bf16 would otherwise switch the engine's numerics, and so the
    mismatch, mid-run); ``engine.dtype=…`` on the resume still wins."""
    if cfg.engine.dtype != "auto":
        return cfg.engine.dtype, "set in the config"
    if recorded and recorded.get("engine_dtype"):
        why = str(recorded.get("engine_dtype_reason") or "auto")
        return recorded["engine_dtype"], f"{why} (chosen when the run was created; a resume keeps it)"
    native, why = _native_bf16()
    return ("bf16" if native else "fp32"), f"auto: {why}"


def resolve_device(cfg: TrainConfig):
    """The ``torch.device`` the trainer runs on (``trainer.device``; auto = CUDA when available): ``policy.score.resolve_device``.

    Raises:
        ConfigError: CUDA asked for but absent, or a CUDA index past the visible devices.
    """
    from offpolicy.policy.score import resolve_device as from_name  # torch: imported when a run starts

    return from_name(cfg.trainer.device)


def resolve_trainer_dtype(cfg: TrainConfig, device) -> tuple[str, str]:
    """The trainer's compute dtype and why: ``trainer.dtype`` unless it is ``auto`` (``policy.score.resolve_dtype``)."""
    from offpolicy.policy.score import resolve_dtype

    return resolve_dtype(cfg.trainer.dtype, device)


def _set_dotted(data: dict[str, Any], key_path: str, value: Any) -> None:
    """``data[a][b] = value`` for ``a.b``; a section's bare value (``engine=vllm``, ``SHORTHANDS``) and its dotted keys
    combine in either order."""
    keys = key_path.split(".")
    node = data
    for key in keys[:-1]:
        if isinstance(node.get(key), str) and key in SHORTHANDS:
            node[key] = {SHORTHANDS[key]: node[key]}
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key_path}=…: {key!r} is not a section")
    last = keys[-1]
    if len(keys) == 1 and last in SHORTHANDS and isinstance(node.get(last), dict) and not isinstance(value, dict):
        node[last][SHORTHANDS[last]] = value
    else:
        node[last] = value


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
