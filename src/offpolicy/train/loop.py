"""The GRPO/PPO loop, top to bottom: sample → score → advantages → forward → correct + loss →
step → sync → log. ``train`` is ``setup`` (a ``Run``: the resolved choices, model, engine, pipeline,
logger), one ``train_step`` a step (``score``, ``choose_old``, ``update``, ``step_values``, ``evaluate``,
``checkpoint``) and ``close`` / ``finish``. Helpers live in batch.py, pipeline.py, checkpoint.py and logger.py.

π_old is the *proximal* policy: the trainer's own weights at the start of the step. With
synchronous sampling it differs from the engine's μ only by the engine's numerics (dtype, noise);
with ``max_staleness`` > 0 it is also newer than the weights that sampled the batch — real
staleness for the correction (anchor old / rollout / current) to fix. With one update per batch
(ppo_epochs = minibatches = 1) and no dropout, π_old = sg(π_θ) exactly: the update's own forward
is taken before any weight changes, so π_old's extra forward is skipped (``recompute_old`` forces it).

Each step logs its time per stage (``time/generate`` … ``time/log``, and ``time/eval`` on the steps that
evaluate); overlapped, ``time/generate`` is the engine's time in its own thread and ``time/wait`` what the
trainer waited for it.

A step whose advantages are all 0 (every group's rewards equal) with no other loss term (``loss.kl_coef``
= 0) has a zero gradient: its backward and optimizer step are skipped (``skipped_update`` = 1). Nothing
changes: weights, optimizer state (Adam's moments and step count) and the policy version stay where they
were — the batch counts as filtered out, as DAPO's dynamic sampling drops zero-variance groups — and the
engine, whose weights are already these, gets no sync. The mismatch is still measured: one no-grad
forward over the batch gives the step's ``offpolicy/*`` statistics (kl_k3, ess, rejected shares, …) as
an update would, without ``loss`` and ``grad_norm`` — a run of flat rewards is where a user most needs
to see whether μ and π_θ still agree.

SIGTERM (a scheduler's, a container's or ``timeout``'s stop) ends the run like Ctrl-C, with a checkpoint;
mid-update it first lets the step finish (``GracefulStop``); a second SIGTERM or Ctrl-C while that
checkpoint is written waits for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

import offpolicy as op
from offpolicy.core import ops
from offpolicy.measure import provenance
from offpolicy.core.config import ConfigError
from offpolicy.engines import EngineError, make_engine, min_p_order, perturb
from offpolicy.engines.choice import parameter_count
from offpolicy.core.metrics import Metrics
from offpolicy.policy.batch import to_batch
from offpolicy.speed import run_paths
from offpolicy.speed.cpu_linear import use_onednn_linear
from offpolicy.policy.score import Scorer, checkpoint_activations, device_index, load_policy
from offpolicy.policy.warmstart import model_dir, warm_start_progress
from offpolicy.core.sampling import SamplingConfig
from offpolicy.core.sequence_weight import warn_once
from offpolicy.train.sequence_weight import StepSequenceWeights
from offpolicy.measure.sync_check import InitialPolicy, verified_sync
from offpolicy.tasks import ChatRendered, make_task, problems
from offpolicy.tasks.dataset import load_dataset_task
from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer
from offpolicy.train.advantages import grpo_advantages, tied_groups
from offpolicy.train.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from offpolicy.train.config import (TrainConfig, resolve_device, resolve_engine, resolve_engine_dtype,
                                    resolve_trainer_dtype, score_centering_problem)
from offpolicy.train.evaluate import evaluate as held_out_eval
from offpolicy.train.logger import RunLogger, StageTimer, sample_records
from offpolicy.train.memory import memory_metrics, reset_memory_peaks
from offpolicy.train.pipeline import Pending, RolloutPipeline
from offpolicy.train.update import optimizer_step

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, float]
    interrupted: bool = False
    stop_signal: int = signal.SIGINT  # what interrupted it (the CLI exits 128 + it: 130 Ctrl-C, 143 SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (a KeyboardInterrupt): checkpoint, then a clean end."""


class GracefulStop:
    """SIGTERM for the run's duration. Where the weights, optimizer and queued rollouts are consistent
    (sampling, scoring, π_old, logging) it raises ``Terminated`` at once; mid-update (``updating``) it
    waits for the step to end, where the loop calls ``check()``. Signal handlers can be set only in the
    main thread: elsewhere (a run started from a worker thread) SIGTERM keeps its handler. ``close()``
    restores the previous handler."""

    def __init__(self) -> None:
        self.updating = self.pending = False
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.updating:
            self.pending = True
        else:
            raise Terminated()

    def check(self) -> None:
        if self.pending:
            self.pending = False
            raise Terminated()

    @contextlib.contextmanager
    def deferred(self):
        """The interrupt checkpoint's window: a second SIGTERM or Ctrl-C waits for it (the run is
        stopping anyway) instead of cutting it short with a traceback and no checkpoint."""
        updating, self.updating = self.updating, True
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
        try:
            yield
        finally:
            self.updating, self.pending = updating, False
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def close(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def resolve_model(cfg: TrainConfig, console: Console) -> Path:
    """The model to start from: the warm-started default, or a local HF model directory."""
    path = model_dir(cfg.model, cfg.warm_start_spec(), warm_start_progress(console))
    if cfg.task == "dataset":  # prompt + response must fit the model's context (RoPE past it is untrained)
        context = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        if context is not None and cfg.max_prompt_tokens + cfg.sampling.max_tokens > context:
            raise ConfigError(f"max_prompt_tokens={cfg.max_prompt_tokens} + sampling.max_tokens={cfg.sampling.max_tokens} "
                              f"exceeds the model's context ({context} positions, {path / 'config.json'}). "
                              "Fix: lower max_prompt_tokens or sampling.max_tokens")
    return path


def make_train_task(cfg: TrainConfig, tokenizer):
    """The task to train on: a synthetic one, or (task=dataset) the data file, rendered with ``tokenizer``."""
    if cfg.task != "dataset":
        task = make_task(cfg.task, **cfg.task_params)
        # a real chat model's task (larger): prompts through the model's chat template, held-out split for the eval
        return ChatRendered.of(task, tokenizer) if getattr(task, "needs_model_dir", False) else task
    # the model's vocabulary, against which the tokenizer files are checked (an incomplete set loads a tiny one)
    vocab_size = json.loads((Path(cfg.model).expanduser() / "config.json").read_text()).get("vocab_size")
    return load_dataset_task(cfg.data, tokenizer, cfg.reward, cfg.max_prompt_tokens, cfg.sampling.max_tokens, vocab_size)


def new_run_dir(cfg: TrainConfig, resolved: dict[str, Any]) -> Path:
    """A fresh run directory with ``config.yaml``: the config under ``train`` (what ``--resume``
    reads) and the choices made at run time (engine dtype and why, the loss the preset resolved
    to) under ``resolved``."""
    run_dir = Path(cfg.out_dir or f"runs/{cfg.task}-{datetime.now():%Y%m%d-%H%M%S}")
    if (run_dir / "checkpoints").exists():
        raise ConfigError(f"run directory {run_dir} already holds a run; use --resume {run_dir} or another out_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({"train": cfg.model_dump(mode="json"), "resolved": resolved}, sort_keys=False,
                          allow_unicode=True)
    (run_dir / "config.yaml").write_text(text)
    return run_dir


def add_resolved(run_dir: Path, values: dict[str, Any]) -> None:
    """``values`` into the ``resolved`` choices of ``run_dir``'s config.yaml (those made once the model loaded)."""
    path = run_dir / "config.yaml"
    data = yaml.safe_load(path.read_text())
    data["resolved"] = {**data.get("resolved", {}), **values}
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def engine_weights(policy, cfg: TrainConfig, version: int, snapshot: bool):
    """The trainer's weights as the engine gets them (with the configured noise); ``snapshot``
    copies them, for an engine that loads them later in its own thread."""
    weights = [(name, t.detach().clone() if snapshot else t.detach()) for name, t in policy.state_dict().items()]
    return perturb(weights, cfg.engine.weight_noise, seed=cfg.seed * 104_729 + version)


def cpu_threads(cfg: TrainConfig) -> tuple[int | None, str]:
    """torch's intra-op thread count for this run and why; None = leave torch's as it is (``trainer.threads=auto``:
    OMP_NUM_THREADS, else one a core). On the 2-core box one thread made the embedded model's step 1.5×
    faster under load 10–14 and 9 % slower on the quiet box (docs/performance.md): a choice for the
    machine, not the model, so it is the user's (``trainer.threads=1`` on a busy machine)."""
    if cfg.trainer.threads != "auto":
        return cfg.trainer.threads, "set in the config"
    return None, "auto: torch's default (OMP_NUM_THREADS, else one a core)"


def set_threads(n: int) -> int:
    """Set torch's intra-op threads to ``n``; returns the count before. vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a no-op once an engine has started (vllm/v1/worker/cpu_worker.py), so this
    calls torch's own function (``torch._C.set_num_threads``, what ``torch.set_num_threads`` is)."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(n)
    return before


def single_update(cfg: TrainConfig, policy) -> bool:
    """π_old = sg(π_θ) exactly: one optimizer step per batch and no dropout to make forwards differ."""
    return cfg.ppo_epochs == 1 and cfg.minibatches == 1 and not dropout_in(policy) and not cfg.recompute_old


def dropout_in(policy) -> list[str]:
    """What makes ``policy``'s training-mode forwards random: its ``nn.Dropout`` modules with p > 0, and every
    number > 0 of its config (sub-configs too) whose name holds "drop" — the dropout a model applies
    functionally, with no module to show it (OPT's ``dropout``, ``attention_dropout``, ``hidden_dropout``,
    BERT's ``attention_probs_dropout_prob``, GPT-2's ``resid_pdrop``/``embd_pdrop``, ``layerdrop``,
    ``drop_path_rate``). Decided by the name, not a list of models: a field the model does not use (GPT-2's
    ``summary_first_dropout``) only costs the π_old forward that reusing π_θ saves."""
    found = sorted({type(m).__name__ for m in policy.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})

    def fields(values: dict, prefix: str = "") -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                fields(value, f"{prefix}{key}.")
            elif "drop" in str(key).lower() and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and value > 0:
                found.append(f"config.{prefix}{key}={value}")

    config = getattr(policy, "config", None)
    if config is not None:
        fields(config.to_dict() if hasattr(config, "to_dict") else vars(config))
    return found


def uses_old(loss_cfg: op.LossConfig) -> bool:
    """Whether the loss reads π_old at all: not under anchor 'rollout' (bypass: policy_loss puts μ in
    its place), nor for REINFORCE without a correction or with anchor 'current' (no ratio to π_old)."""
    corr = loss_cfg.correction
    if corr is not None and corr.anchor == "rollout":
        return False
    return not (loss_cfg.kind == "reinforce" and (corr is None or corr.anchor == "current"))


def with_kl_over_entropy(values: dict[str, float]) -> dict[str, float]:
    """Adds prime-rl's mismatch KL over the trainer's mean token entropy, kl_k3 / entropy (left out
    where either is missing or the entropy is 0 — prime-rl sets kl_ent_ratio only if entropy > 0)."""
    kl, entropy = values.get("offpolicy/kl_k3"), values.get("offpolicy/entropy")
    if kl is not None and entropy is not None and entropy > 0:
        values["offpolicy/kl_over_entropy"] = kl / entropy
    return values


def staleness_metrics(version: int, row_versions: torch.Tensor, pipeline: RolloutPipeline,
                      item: Pending | None = None) -> dict[str, float]:
    """How stale the trained batch was, per rollout: version − the version that sampled it (``[B]``),
    its mean and max (``staleness_max`` is each trajectory's worst staleness, verl #6736: version −
    the oldest version behind any of its tokens), and the rollouts dropped as too old for this step
    and over the run (TRL's async GRPO logs sample/staleness_mean/max and dropped_stale_total the
    same way). With ``item``, the split of issue #46 (``pipeline`` module doc):
    ``staleness/in_flight`` + ``staleness/in_queue`` = ``staleness``, and ``staleness/version_span``
    (the trajectory's newest − oldest weight version, 0 here: one job, one set of weights)."""
    staleness = (version - row_versions).float()
    out = {"staleness_mean": staleness.mean().item(), "staleness_max": staleness.max().item(),
           "dropped_rollouts": float(pipeline.last_dropped), "dropped_rollouts_total": float(pipeline.dropped)}
    if item is not None:
        in_flight, in_queue = pipeline.split_staleness(item, version)
        out.update({"staleness/in_flight": float(in_flight), "staleness/in_queue": float(in_queue),
                    "staleness/version_span": float(item.version_span)})
    return out


def throughput(values: dict[str, float], n_tokens: float, device: torch.device, overlapped: bool,
               engine_bytes: int = 0) -> dict[str, float]:
    """What a user watches (issue #21): response tokens per second of the whole step
    (``time/tokens_per_s``; the engine's own rate, per second of generation, is
    ``generate/tokens_per_s``), the share of the step spent generating (waiting, when overlapped)
    and training, and the step's memory (``memory_metrics``)."""
    step = max(values["step_seconds"], 1e-9)
    engine = values["time/wait"] if overlapped else values["time/generate"]  # what held the trainer up
    out = {"time/tokens_per_s": n_tokens / step, "time/generate_share": min(1.0, engine / step),
           "time/train_share": values.get("time/train", 0.0) / step}
    return {**out, **memory_metrics(device, engine_bytes)}


def step_samples(cfg: TrainConfig, scorer: Scorer, tokenizer, item, batch, texts: list[str], rewards: torch.Tensor,
                 advantages: torch.Tensor, old: torch.Tensor | None, update_logprobs: dict[int, torch.Tensor] | None = None
                 ) -> list[dict]:
    """``cfg.samples_per_step`` rows of this step as text (``logger.sample_records``): one row from each of
    the first groups (the first response of group 0, 1, …; then the second of each), with log ρ = log π_old
    − log μ per token — from the π_old forward where one ran; else, with one update per batch, from the
    update's own forward (``update_logprobs``: row → its log-probs, what ``old_of`` returned for it; π_old = sg(π_θ)
    there); else from a no-grad forward on those rows only, before the update (π_old = the weights that
    start the step)."""
    if cfg.samples_per_step == 0:
        return []
    rows = spread_rows(len(rewards), cfg.group_size, cfg.samples_per_step)
    if old is not None:
        trainer = old[rows.to(old.device)].float().cpu()
    elif update_logprobs is not None:  # a row the update never saw has no response token: all of it is masked below
        trainer = torch.zeros(len(rows), batch.mask.shape[1], dtype=torch.float32)
        for i, r in enumerate(rows.tolist()):
            if r in update_logprobs:
                trainer[i, : update_logprobs[r].shape[0]] = update_logprobs[r].float().cpu()
    else:
        trainer = scorer.whole().score(batch.select(rows)).logprobs.float().cpu()
    # −inf where a token lies outside the trainer's top-k/top-p support (sample_records leaves it out)
    log_ratio = torch.where(batch.mask[rows].bool(), trainer - batch.rollout_logprobs[rows], 0.0)  # [k, T]
    # each response token as text, for the per-token viewer (offpolicy view)
    token_texts = [[tokenizer.decode([t]) for t in item.rollouts.response_ids[i]] for i in rows.tolist()]
    return sample_records([item.problems[i] for i in rows.tolist()], [texts[i] for i in rows.tolist()],
                          rewards[rows], advantages[rows], log_ratio, batch.mask[rows],
                          [item.rollouts.finished[i] for i in rows.tolist()], token_texts=token_texts,
                          trainer=torch.where(batch.mask[rows].bool(), trainer, 0.0),
                          rollout=batch.rollout_logprobs[rows])


def spread_rows(n_rows: int, group_size: int, k: int) -> torch.Tensor:
    """``k`` rows of a batch of groups, one from each group first (row 0 of group 0, 1, …; then row 1 of each)."""
    n_groups = n_rows // group_size
    return torch.tensor([(i % n_groups) * group_size + i // n_groups for i in range(min(k, n_rows))], dtype=torch.long)


def groups_with_spread(rewards: torch.Tensor, group_size: int) -> float:
    """The share of GRPO groups whose rewards are not all equal, by ``grpo_advantages``' tie rule
    (``advantages.tied_groups``): the groups that give a gradient."""
    return (~tied_groups(rewards, group_size)).float().mean().item()


def update_kl_k3(before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(π_v ‖ π_{v+1}) of one update, by the k3 estimator on the response tokens of some rows:
    mean over tokens of (r − 1) − log r, r = π_{v+1}(y_t)/π_v(y_t), in fp32, log r clamped to [−20, 20]
    before the exp; tokens where either log-prob is not finite (outside a top-k/top-p support) are left
    out. The tokens were drawn by the engine (μ), so this is KL(π_v ‖ π_{v+1}) exactly in expectation only
    where μ = π_v (synchronous, no mismatch); with staleness it is the same divergence weighted by μ."""
    before, after = before.float(), after.float()
    valid = mask.bool() & torch.isfinite(before) & torch.isfinite(after)
    if not valid.any():
        return 0.0
    log_r = torch.where(valid, after - before, 0.0).clamp(-20.0, 20.0)
    return ops.masked_mean(ops.k3(log_r, 20.0), valid).item()


@dataclass
class Run:
    """What a run holds from ``setup`` to ``close``: the choices resolved before the model loads, the parts built
    once it has (tokenizer, task, policy, optimizer, scorer, engine, pipeline, logger), and where the steps stand."""

    cfg: TrainConfig
    console: Console
    run_dir: Path
    created: bool  # this call made run_dir: a failure before the first checkpoint removes it again
    device: torch.device
    trainer_dtype: str
    engine_dtype: str
    loss_cfg: op.LossConfig
    sampling: SamplingConfig
    recorded: dict | None = None  # a resumed run's config.yaml ``resolved`` choices (engine, dtype: kept on resume)
    threads_before: int | None = None  # torch's thread count before the run set its own (restored at close)
    tokenizer: Any = None
    task: Any = None
    policy: Any = None
    optimizer: Any = None
    scorer: Scorer | None = None
    engine: Any = None
    engine_bytes: int = 0  # the engine's share of the trainer device's allocations (memory_metrics)
    pipeline: RolloutPipeline | None = None
    eval_set: list = field(default_factory=list)
    logger: RunLogger | None = None
    single: bool = False  # π_old = sg(π_θ) exactly (single_update)
    skip_old: bool = False  # no π_old forward: it equals sg(π_θ), or the loss never reads it
    version: int = 0  # the policy version: weight updates so far
    completed: int = 0  # steps done
    saved: int = 0  # steps in the latest checkpoint
    initial: Any = None  # the initial policy, for sync/engine_kl_to_initial (initial_kl_rows; sync_check)
    seq_warned: set[str] = field(default_factory=set)  # the sequence-weight pre-check's warnings, each once a run


@dataclass
class Scored:
    """One step's rollouts, decoded, rewarded and batched."""

    item: Pending
    texts: list[str]
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B]
    batch: Any  # policy.batch.Batch
    adv_tokens: torch.Tensor  # [B, T]: each row's advantage on every token


def train(cfg: TrainConfig, resume: Path | None = None, console: Console | None = None,
          progress: bool = True) -> RunResult:
    """Run (or resume) ``cfg``; returns the run directory and the summary numbers: ``setup``, one ``train_step``
    a step, ``close``. Ctrl-C or SIGTERM between updates checkpoints the steps done (``interrupted``).

    Raises:
        ConfigError: bad model path or run directory; RuntimeError: engine contract broken.
    """
    run = setup(cfg, resume, console or Console(), progress)
    interrupted, stop_signal, raised, failed = False, signal.SIGINT, False, False
    stop = GracefulStop()
    try:
        for step in range(run.completed, cfg.steps):
            train_step(run, step, stop)
            stop.check()  # a SIGTERM that came mid-update ends the run here, the step done
    except KeyboardInterrupt as err:
        interrupted = True
        stop_signal = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
        interrupt(run, stop, stop_signal)
    except BaseException as err:
        failed = not isinstance(err, EngineError)  # an engine failure keeps the run directory and its engine.log
        raised = True
        record_failure(run, err)
        raise
    finally:
        stop.close()
        close(run, raised, failed)
    return finish(run, interrupted, stop_signal)


# ---------------------------------------------------------------------------------------------------- setup
def setup(cfg: TrainConfig, resume: Path | None, console: Console, progress: bool) -> Run:
    """The run before its first step: the choices that need no model (device, dtypes, the run directory),
    then ``load`` (model, task, engine, pipeline). A failure here restores torch's threads and removes a run
    directory this call created (an engine failure keeps it, for its engine.log)."""
    torch.manual_seed(cfg.seed)
    loss_cfg = cfg.loss_config()
    recorded = yaml.safe_load((resume / "config.yaml").read_text()).get("resolved") \
        if resume is not None and (resume / "config.yaml").is_file() else None
    engine_dtype, dtype_reason = resolve_engine_dtype(cfg, recorded)  # a resume keeps auto's first choice
    device = resolve_device(cfg)  # before the run directory: device=cuda without CUDA leaves nothing
    trainer_dtype, trainer_dtype_reason = resolve_trainer_dtype(cfg, device)
    run_dir = resume if resume is not None else new_run_dir(cfg, {
        "engine_dtype": engine_dtype, "engine_dtype_reason": dtype_reason, "device": str(device),
        "trainer_dtype": trainer_dtype, "trainer_dtype_reason": trainer_dtype_reason,
        "loss": loss_cfg.model_dump(mode="json")})  # the preset with the loss.* keys on top: what runs
    run = Run(cfg, console, run_dir, resume is None, device, trainer_dtype, engine_dtype, loss_cfg, cfg.sampling_config(),
              recorded)
    try:
        load(run, latest_checkpoint(run_dir) if resume is not None else None, progress)
    except BaseException as err:
        if run.threads_before is not None:
            set_threads(run.threads_before)
        if run.created and not isinstance(err, EngineError):
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-written (an engine failure keeps engine.log)
        raise
    return run


def load(run: Run, checkpoint: Path | None, progress: bool) -> None:
    """Threads, model, tokenizer, task, policy and optimizer (from ``checkpoint`` where resumed), then the
    header, the engine and the rollout pipeline."""
    cfg, console = run.cfg, run.console
    # before the warm start (it trains too) and the engine (vLLM's CPU worker pins torch's setter: set_threads)
    threads, threads_reason = cpu_threads(cfg)
    run.threads_before = set_threads(threads) if threads is not None else None
    model_path = resolve_model(cfg, console)
    load_from = checkpoint or model_path
    run.tokenizer = load_tokenizer(load_from)
    padded = ensure_pad_token(run.tokenizer)
    run.task = task = make_train_task(cfg, run.tokenizer)  # every data error surfaces here, before any weight loads
    dropped = getattr(task, "dropped", 0) and f"{task.dropped} prompts over max_prompt_tokens dropped"
    for note in filter(None, (padded, dropped)):
        console.print(f"  data: {note}")
    # fp32 master weights on the device; bf16 is autocast compute (policy.score.precision)
    run.policy = policy = load_policy(load_from, run.device).train()
    linear = use_onednn_linear(policy, cfg.trainer.cpu_linear, run.device, run.trainer_dtype)
    engine_name, engine_reason = resolve_engine(  # a resumed run keeps the engine auto chose at its start
        cfg, run.device, parameter_count(policy), policy.get_output_embeddings().weight.shape[0],
        recorded=run.recorded)
    problem = score_centering_problem(run.loss_cfg.score_centering, engine_name, cfg.sampling, cfg.prox_logp,
                                      why=engine_reason)  # the config's rule again, on the engine auto chose
    if problem:
        raise ConfigError(problem)
    # min-p's place among the truncations is the engine's (offpolicy.core.sampling): the trainer's kept set follows it
    if run.sampling.min_p > 0:
        run.sampling = run.sampling.model_copy(update={"min_p_order": min_p_order(engine_name)})
    if run.created:  # beside the engine dtype's choice, in the run's config.yaml
        add_resolved(run.run_dir, {"engine": engine_name, "engine_reason": engine_reason})
    if cfg.trainer.gradient_checkpointing:
        checkpoint_activations(policy)  # under the name the installed transformers has
        policy.config.use_cache = False
    # on the CPU torch's fused AdamW: one kernel a parameter instead of ~10 ops (the embedded default: 1.5 →
    # 0.4 ms a step, issue #49), the same update to fp32 rounding (tests/test_train.py); GPUs keep the default
    run.optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0,
                                      fused=True if run.device.type == "cpu" else None)
    # one way to score, all run
    run.scorer = Scorer(policy, run.sampling, run.device, run.trainer_dtype, cfg.trainer.micro_batch_tokens)
    state = load_trainer_state(checkpoint) if checkpoint else {"step": 0, "version": 0, "pending": []}
    state.setdefault("pipeline", {})  # staleness policy's queue cursor (issue #25); older checkpoints lack it
    if checkpoint:
        run.optimizer.load_state_dict(state["optimizer"])
    run.completed = run.saved = state["step"]
    run.version = state["version"]
    print_header(run, engine_name, engine_reason, f"{torch.get_num_threads()} ({threads_reason})")
    start_engine(run, engine_name, load_from, linear)
    run.initial = InitialPolicy(model_path, run.scorer) if cfg.initial_kl_rows else None
    # no π_old forward where it equals sg(π_θ) exactly, or where the loss never reads it
    run.single = single_update(cfg, policy)
    run.skip_old = run.single or (not uses_old(run.loss_cfg) and not cfg.recompute_old)
    run.pipeline = RolloutPipeline(run.engine, task, run.tokenizer, run.sampling, cfg.prompts_per_step,
                                   cfg.group_size, cfg.max_staleness, cfg.seed, pending=state["pending"],
                                   staleness_policy=cfg.staleness_policy, **state["pipeline"])
    run.eval_set = problems(task, cfg.eval_problems, seed=cfg.seed + 20_000)
    if hasattr(task, "held_out"):  # dataset, larger: the held-out rows; eval/accuracy = mean reward, greedy
        run.eval_set = list(task.held_out[: cfg.eval_problems])
    run.logger = RunLogger(run.run_dir, cfg.steps, run.completed, console, progress=progress, log_to=cfg.log_to,
                           config=yaml.safe_load((run.run_dir / "config.yaml").read_text()))


def print_header(run: Run, engine_name: str, engine_reason: str, threads: str) -> None:
    """The run's first lines: what trains on what, with which engine and loss; the defaults the model chose;
    the CPU's threads; the engine=auto choice and why (the linear layers are a speed path: ``start_engine``)."""
    cfg, console = run.cfg, run.console
    console.print(f"offpolicy train: {cfg.task} · {run.device} ({run.trainer_dtype}) · "
                  f"engine {engine_name} ({run.engine_dtype}) · "
                  f"loss {cfg.loss_summary()} · staleness ≤ "
                  f"{cfg.max_staleness} · run {run.run_dir}")
    defaults = cfg.model_defaults()
    if defaults:  # chosen by the model, not the task: say which applied
        console.print(f"  {defaults}")
    console.print(f"  threads: {threads}")
    if cfg.engine.kind == "auto":
        console.print(f"  engine {engine_name}: {engine_reason.removeprefix('auto: ')} (engine=auto)")


def start_engine(run: Run, engine_name: str, load_from: Path, linear: str) -> None:
    """The rollout engine on the model at ``load_from``, with the trainer's weights (at ``run.version``) synced."""
    cfg, device = run.cfg, run.device
    context = cfg.max_prompt_tokens + cfg.sampling.max_tokens if cfg.task == "dataset" else 1024
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    run.engine = make_engine(engine_name, str(load_from), run.tokenizer, run.engine_dtype, seed=cfg.seed,
                             logit_noise=cfg.engine.logit_noise, max_model_len=context,
                             log_path=run.run_dir / "engine.log", device=device,
                             gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
                             sleep=cfg.engine.sleep and cfg.max_staleness == 0, vllm_options=cfg.engine.vllm.model_dump(),
                             cpu_linear=cfg.trainer.cpu_linear, sampling=run.sampling)
    blocker = getattr(run.engine, "sampling_mask_blocker", None)
    if run.sampling.truncates and blocker is not None:  # vLLM without its sampling masks
        run.console.print(f"  sampling masks: not returned ({blocker}); the trainer recomputes top-k/top-p on its "
                          "own logits")
    paths = run_paths(run.policy, linear, run.engine)  # the gated speed paths (offpolicy.speed): which ran and why
    if run.created:
        add_resolved(run.run_dir, {"speed_paths": paths})
    for gate, reason in paths.items():
        run.console.print(f"  {gate}: {reason}")
    run.engine_bytes = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else 0
    record_provenance(run)
    verified_sync(run.engine, engine_weights(run.policy, cfg, run.version, snapshot=False))  # a no-op sync raises


def record_provenance(run: Run) -> None:
    """``provenance.json`` in the run directory: one provenance block (``offpolicy.measure.provenance``) per session of the
    run — its start and each resume — with every setting that differs from its default and the engine on record,
    so a resumed run shows whether it went on with the same code, stack and machine."""
    path = run.run_dir / "provenance.json"
    sessions = json.loads(path.read_text())["sessions"] if path.is_file() and not run.created else []
    settings = run.cfg.model_dump(mode="json", exclude_defaults=True)
    sessions.append({"from_step": run.completed, **provenance.block(
        settings, provenance.engine_record(run.engine, run.engine_dtype))})
    path.write_text(json.dumps({"sessions": sessions}, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------------- step
def train_step(run: Run, step: int, stop: GracefulStop) -> None:
    """One step: sample (bounded staleness) and score, π_old, the corrected update, the new weights to the
    engine, the step's metrics and samples logged, then a checkpoint where one is due."""
    cfg = run.cfg
    t0, timer = time.perf_counter(), StageTimer()
    reset_memory_peaks(run.device)
    item, waited = run.pipeline.next(step, run.version)
    with timer("score"):
        s = score(run, item)
    with timer("pi_old"):  # π_old: the trainer before this step (no forward where it is skipped, or loglinear)
        # with score centering, log π_old of the support ids too (else the update's own, detached: ``optimizer_step``)
        scored = None if run.skip_old or cfg.prox_logp == "loglinear" else run.scorer.score(s.batch, support=True)
        old, old_support = (None, None) if scored is None else (scored.logprobs, scored.support_logprobs)
    # which rows' log ρ are shown as text (samples.jsonl), and π_old as the update reads it
    shown = set(spread_rows(len(s.rewards), cfg.group_size, cfg.samples_per_step).tolist())
    old_of, update_lp = choose_old(run, s, old, shown)
    # Π ρ of each row before truncation, for a loss with a sequence-level stage only (sequence_weight)
    seq_weights = StepSequenceWeights.for_loss(run.loss_cfg.correction, len(s.rewards), run.device)
    old_of = seq_weights.wrap(old_of) if seq_weights else old_of
    samples = []
    if update_lp is None:
        with timer("samples"):  # a few rows as text, with their log ρ under the weights that start the step
            samples = step_samples(cfg, run.scorer, run.tokenizer, item, s.batch, s.texts, s.rewards, s.advantages,
                                   old)
    metrics = Metrics()
    # no advantage signal and no other loss term: a zero gradient, so no forward/backward (module doc)
    skipped = bool((s.advantages == 0).all()) and run.loss_cfg.kl_coef == 0
    trained_on = run.version  # the weights this step starts from (the version does not advance on a skip)
    stop.updating = True  # from here until the step is logged, the weights are mid-update
    kl_update = update(run, step, s, old_of, metrics, skipped, timer, old_support)
    if update_lp is not None:
        with timer("samples"):  # log π_old from the update's own forward (choose_old)
            samples = step_samples(cfg, run.scorer, run.tokenizer, item, s.batch, s.texts, s.rewards, s.advantages,
                                   old, update_logprobs=update_lp)
    with timer("sync"):  # the new weights to the engine
        if not skipped:
            run.version += 1
            run.pipeline.sync(engine_weights(run.policy, cfg, run.version, snapshot=run.pipeline.overlapped),
                              run.version)
    with timer("log"):
        values = step_values(run, s, metrics, skipped, trained_on, kl_update)
        if seq_weights is not None:  # the sequence weight before truncation, and its pre-check
            values.update(seq_weights.values())
            warn_once(seq_weights.warnings(cfg.preset or "loss"), run.seq_warned, run.console)
        if run.initial is not None:  # the engine's (and trainer's) KL to the initial policy
            probe = spread_rows(len(s.rewards), cfg.group_size, cfg.initial_kl_rows)
            values.update(run.initial.values(s.batch, probe, None if old is None else old[probe.to(old.device)]))
    values.update(evaluate(run, step, timer))
    values.update({"time/generate": item.seconds, "time/wait": waited,
                   **{f"time/{k}": v for k, v in timer.seconds.items()},
                   "step_seconds": time.perf_counter() - t0})
    values.update(throughput(values, float(s.batch.mask.sum()), run.device, run.pipeline.overlapped,
                             run.engine_bytes))
    run.logger.log(step, values)
    run.logger.log_samples(step, samples)
    run.pipeline.commit(step)
    run.completed = step + 1
    stop.updating = False
    if run.completed % cfg.checkpoint_every == 0 or run.completed == cfg.steps:
        checkpoint(run)


def score(run: Run, item: Pending) -> Scored:
    """``item``'s responses decoded and rewarded, GRPO's advantages, the padded batch."""
    texts = run.tokenizer.batch_decode(item.rollouts.response_ids, skip_special_tokens=True)
    rewards = torch.tensor([run.task.reward(p, t) for p, t in zip(item.problems, texts)])
    advantages = grpo_advantages(rewards, run.cfg.group_size)
    batch = to_batch(item.rollouts, run.tokenizer.pad_token_id, support=run.loss_cfg.score_centering)
    adv_tokens = advantages.unsqueeze(-1).expand_as(batch.mask).contiguous()
    return Scored(item, texts, rewards, advantages, batch, adv_tokens)


def choose_old(run: Run, s: Scored, old: torch.Tensor | None, shown: set[int]
               ) -> tuple[Callable, dict[int, torch.Tensor] | None]:
    """π_old as the update reads it: ``old_of(rows, mb, logprobs)`` → log π_old of micro-batch ``mb``'s rows,
    given the update's own forward ``logprobs`` — one of three (module doc):

    - ``prox_logp=loglinear``: AReaL's interpolation from the versions, this step's starting weights (v + 1 − 1);
    - skipped (``run.skip_old``): the update's own forward, detached — π_old = sg(π_θ) with one update per batch,
      and any value where the loss never reads π_old;
    - else the rows of ``old``, the π_old forward taken before the update.

    With one update per batch the shown rows' (``shown``) log π_old are kept from the update's forward into the
    returned dict (no forward of their own, issue #49); None where they take one before the update."""
    cfg, version, device = run.cfg, run.version, run.device
    if cfg.prox_logp == "loglinear":
        def loglinear(rows, mb, logprobs):
            return op.loglinear_proximal(logprobs, mb.rollout_logprobs, s.item.rollouts.version,
                                         current_version=version + 1)
        return loglinear, None
    if not run.skip_old:
        return (lambda rows, mb, logprobs: old[device_index(rows, device), : mb.mask.shape[1]]), None
    kept: dict[int, torch.Tensor] | None = {} if run.single and shown else None

    def own_forward(rows, mb, logprobs):
        if kept is not None:
            kept.update({r: logprobs[i].detach() for i, r in enumerate(rows.tolist()) if r in shown})
        return logprobs.detach()
    return own_forward, kept


def update(run: Run, step: int, s: Scored, old_of: Callable, metrics: Metrics, skipped: bool,
           timer: StageTimer, old_support: torch.Tensor | None = None) -> float | None:
    """The corrected loss over PPO's epochs and mini-batches (micro-batches inside ``optimizer_step``), into
    ``metrics``; a skipped step takes one no-grad pass for its mismatch statistics (module doc). Returns the
    update's KL on ``policy_kl_rows`` rows (None when off; exactly 0 for a skip)."""
    cfg, scorer, batch = run.cfg, run.scorer, s.batch
    n_rows = len(s.rewards)
    order = torch.Generator().manual_seed(cfg.seed * 31 + step)
    kl_rows = spread_rows(n_rows, cfg.group_size, cfg.policy_kl_rows) if cfg.policy_kl_rows else None
    with timer("policy_kl"):  # the policy before the update, on a few rows (policy/kl_k3_update)
        kl_before = None if kl_rows is None or skipped else scorer.whole().score(batch.select(kl_rows)).logprobs
    with timer("train"):
        step_args = dict(old_of=old_of, loss_cfg=run.loss_cfg, max_grad_norm=cfg.max_grad_norm, metrics=metrics,
                         split_metrics=cfg.split_metrics, old_support=old_support)
        if skipped:  # the mismatch is still measured: one no-grad pass over the batch (module doc)
            optimizer_step(scorer, run.optimizer, batch, torch.arange(n_rows), s.adv_tokens, **step_args,
                           update=False, step_start=True)
        start = True  # the first optimizer step still sees the step's starting π_θ: offpolicy/kl_k3_start
        for _ in range(0 if skipped else cfg.ppo_epochs):
            for rows in torch.randperm(n_rows, generator=order).chunk(cfg.minibatches):
                if batch.mask[rows].sum() == 0:  # the CPU batch: no device read
                    continue
                optimizer_step(scorer, run.optimizer, batch, rows, s.adv_tokens, **step_args, step_start=start)
                start = False
    with timer("policy_kl"):
        return None if kl_rows is None else 0.0 if skipped else update_kl_k3(
            kl_before, scorer.whole().score(batch.select(kl_rows)).logprobs, batch.mask[kl_rows].to(run.device))


def step_values(run: Run, s: Scored, metrics: Metrics, skipped: bool, trained_on: int,
                kl_update: float | None) -> dict[str, float]:
    """The step's scalars for metrics.jsonl and the trackers (times and throughput are added by ``train_step``)."""
    rollouts, n_rows = s.item.rollouts, len(s.rewards)
    n_tokens = float(s.batch.mask.sum())
    values = {
        **with_kl_over_entropy(metrics.to_dict()),
        "reward": s.rewards.mean().item(),
        "response_length": n_tokens / n_rows,
        "finished_fraction": sum(rollouts.finished) / n_rows,
        # responses cut by max_new_tokens (or the context) before their stop token
        "truncated_share": 1.0 - sum(rollouts.finished) / n_rows,
        "staleness": float(trained_on - rollouts.version),
        **staleness_metrics(trained_on, s.batch.versions, run.pipeline, s.item),
        "generate/tokens_per_s": n_tokens / max(s.item.seconds, 1e-9),  # the engine's rate
        "policy_version": float(run.version),
        "skipped_update": float(skipped),
        "reward/groups_with_spread": groups_with_spread(s.rewards, run.cfg.group_size),
    }
    if kl_update is not None:  # a skipped update moves nothing: exactly 0
        values["policy/kl_k3_update"] = kl_update
    return values


def evaluate(run: Run, step: int, timer: StageTimer) -> dict[str, float]:
    """The held-out evaluation on its steps (every ``eval_every`` and the last), in its own stage: greedy answers
    to the held-out prompts cost seconds on a real model (issue #49), which inside "log" hid what writing the
    step's records costs (milliseconds)."""
    cfg, task = run.cfg, run.task
    if not run.eval_set or not (step % cfg.eval_every == 0 or step == cfg.steps - 1):
        return {}
    with timer("eval"):  # held-out tasks: greedy reward, truncation, length, answer log-prob (train/evaluate.py)
        return held_out_eval(run.policy, run.tokenizer, task, run.eval_set, cfg.sampling.max_tokens, run.trainer_dtype)


def checkpoint(run: Run) -> None:
    """The run at ``run.completed`` steps: weights, optimizer, queued rollouts and the pipeline's counters."""
    save_checkpoint(run.run_dir, run.completed, run.policy, run.tokenizer, run.optimizer,
                    {"step": run.completed, "version": run.version, "pending": run.pipeline.state(),
                     "pipeline": run.pipeline.counters()}, keep=run.cfg.checkpoint_keep)
    run.saved = run.completed


# ---------------------------------------------------------------------------------------------------- close
def interrupt(run: Run, stop: GracefulStop, stop_signal: int) -> None:
    """Ctrl-C or SIGTERM: between updates the weights, optimizer and queued rollouts are consistent, so the
    steps done since the last checkpoint are saved (a second signal waits for it); then where to resume from."""
    if not stop.updating and run.completed > run.saved:
        with stop.deferred():
            checkpoint(run)
    run_dir = run.run_dir
    where = latest_checkpoint(run_dir).name if (run_dir / "checkpoints" / "latest").exists() else "none yet"
    how = "terminated (SIGTERM)" if stop_signal == signal.SIGTERM else "interrupted"
    run.console.print(f"[yellow]{how} after {run.completed} steps; checkpoint: {where}. Continue with "
                      f"offpolicy train --resume {run_dir}[/yellow]")


def close(run: Run, raised: bool, failed: bool) -> None:
    """The pipeline, logger (the trackers' runs end as failed where the run ``raised``) and engine closed, torch's
    threads as they were (a run started in-process, a test), and a ``failed`` run that never checkpointed removed."""
    run.pipeline.close()
    run.logger.close()
    if raised:
        run.logger.finish(failed=True)
    run.engine.close()
    if run.threads_before is not None:
        set_threads(run.threads_before)
    if failed and run.created and not (run.run_dir / "checkpoints").exists() and not run.logger.records:
        shutil.rmtree(run.run_dir, ignore_errors=True)  # a run that failed before its first step leaves nothing


FAILURE_FILE = "failure.json"


def record_failure(run: Run, err: BaseException) -> None:
    """The trainer's failure record, ``failure.json`` in the run directory, where a run that logged a step raised:
    the step it was on, the exception's type and message. What tells a run that failed by itself (this record, a
    non-zero exit) from one stopped from outside (a signal: no record), e.g. for the science campaign's runner."""
    if not run.logger.records:
        return  # nothing of the run is kept (``close``)
    with contextlib.suppress(OSError):
        (run.run_dir / FAILURE_FILE).write_text(json.dumps(
            {"step": run.completed, "type": type(err).__name__, "message": str(err)[:2000]}, indent=1) + "\n")


def finish(run: Run, interrupted: bool, stop_signal: int) -> RunResult:
    """The plots, the trackers' runs ended, and the last line: where the metrics, plots and viewer are."""
    logger = run.logger
    plot = logger.plot()
    logger.finish(plot)
    summary = logger.summary()
    trackers = "".join(f"  {name}: {place}" for name, place in logger.trackers.places().items())
    run.console.print(f"metrics: {logger.path}  plots: {plot}  view: offpolicy view {run.run_dir}{trackers}")
    return RunResult(run.run_dir, summary, interrupted, stop_signal if interrupted else signal.SIGINT)
