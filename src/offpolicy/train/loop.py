"""The GRPO/PPO loop, top to bottom: sample → score → advantages → forward → correct + loss →
step → sync → log. Helpers live in batch.py, pipeline.py, checkpoint.py and logger.py.

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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

import offpolicy as op
from offpolicy import ops
from offpolicy.config import ConfigError
from offpolicy.engines import EngineError, SamplingConfig, make_engine, perturb
from offpolicy.engines.choice import parameter_count
from offpolicy.metrics import Metrics
from offpolicy.policy.batch import to_batch
from offpolicy.policy.cpu_linear import use_onednn_linear
from offpolicy.policy.score import Scorer, device_index, load_policy
from offpolicy.policy.warmstart import model_dir, warm_start_progress
from offpolicy.tasks import ChatRendered, make_task, problems
from offpolicy.tasks.dataset import load_dataset_task
from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer
from offpolicy.train.advantages import grpo_advantages, tied_groups
from offpolicy.train.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from offpolicy.train.config import (TrainConfig, resolve_device, resolve_engine, resolve_engine_dtype,
                                    resolve_trainer_dtype)
from offpolicy.train.evaluate import evaluate
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
    path = model_dir(cfg.model, cfg, warm_start_progress(console))
    if cfg.task == "dataset":  # prompt + response must fit the model's context (RoPE past it is untrained)
        context = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        if context is not None and cfg.max_prompt_tokens + cfg.max_new_tokens > context:
            raise ConfigError(f"max_prompt_tokens={cfg.max_prompt_tokens} + max_new_tokens={cfg.max_new_tokens} "
                              f"exceeds the model's context ({context} positions, {path / 'config.json'}). "
                              "Fix: lower max_prompt_tokens or max_new_tokens")
    return path


def make_train_task(cfg: TrainConfig, tokenizer):
    """The task to train on: a synthetic one, or (task=dataset) the data file, rendered with ``tokenizer``."""
    if cfg.task != "dataset":
        task = make_task(cfg.task, **cfg.task_params)
        # a real chat model's task (larger): prompts through the model's chat template, held-out split for the eval
        return ChatRendered.of(task, tokenizer) if getattr(task, "needs_model_dir", False) else task
    # the model's vocabulary, against which the tokenizer files are checked (an incomplete set loads a tiny one)
    vocab_size = json.loads((Path(cfg.model).expanduser() / "config.json").read_text()).get("vocab_size")
    return load_dataset_task(cfg.data, tokenizer, cfg.reward, cfg.max_prompt_tokens, cfg.max_new_tokens, vocab_size)


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
    return perturb(weights, cfg.engine_weight_noise, seed=cfg.seed * 104_729 + version)


def cpu_threads(cfg: TrainConfig) -> tuple[int | None, str]:
    """torch's intra-op thread count for this run and why; None = leave torch's as it is (``threads=auto``:
    OMP_NUM_THREADS, else one a core). On the 2-core box one thread made the embedded model's step 1.5×
    faster under load 10–14 and 9 % slower on the quiet box (docs/performance.md): a choice for the
    machine, not the model, so it is the user's (``threads=1`` on a busy machine)."""
    if cfg.threads != "auto":
        return cfg.threads, "set in the config"
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
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in policy.modules()) or \
        getattr(policy.config, "attention_dropout", 0.0) > 0
    return cfg.ppo_epochs == 1 and cfg.minibatches == 1 and not dropout and not cfg.recompute_old


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
        trainer = scorer.whole().score(batch.select(rows)).float().cpu()
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


def train(cfg: TrainConfig, resume: Path | None = None, console: Console | None = None,
          progress: bool = True) -> RunResult:
    """Run (or resume) ``cfg``; returns the run directory and the summary numbers.

    Raises:
        ConfigError: bad model path or run directory; RuntimeError: engine contract broken.
    """
    console = console or Console()
    torch.manual_seed(cfg.seed)
    loss_cfg = cfg.loss_config()
    sampling = SamplingConfig(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              top_k=cfg.top_k)
    engine_dtype, dtype_reason = resolve_engine_dtype(cfg)
    device = resolve_device(cfg)  # before the run directory: device=cuda without CUDA leaves nothing
    trainer_dtype, trainer_dtype_reason = resolve_trainer_dtype(cfg, device)
    created = resume is None
    run_dir = resume if resume is not None else new_run_dir(cfg, {
        "engine_dtype": engine_dtype, "engine_dtype_reason": dtype_reason, "device": str(device),
        "trainer_dtype": trainer_dtype, "trainer_dtype_reason": trainer_dtype_reason,
        "loss": loss_cfg.model_dump(mode="json")})  # the preset with the loss.* keys on top: what runs
    threads_before = None  # torch's thread count before this run set its own (restored when it ends)
    try:
        # ---------------------------------------------------------------- setup
        checkpoint = latest_checkpoint(run_dir) if resume is not None else None
        # before the warm start (it trains too) and the engine (vLLM's CPU worker pins torch's setter: set_threads)
        threads, threads_reason = cpu_threads(cfg)
        threads_before = set_threads(threads) if threads is not None else None
        model_path = resolve_model(cfg, console)
        load_from = checkpoint or model_path
        tokenizer = load_tokenizer(load_from)
        padded = ensure_pad_token(tokenizer)
        task = make_train_task(cfg, tokenizer)  # every data error surfaces here, before any weight loads
        dropped = getattr(task, "dropped", 0) and f"{task.dropped} prompts over max_prompt_tokens dropped"
        for note in filter(None, (padded, dropped)):
            console.print(f"  data: {note}")
        # fp32 master weights on the device; bf16 is autocast compute (policy.score.precision)
        policy = load_policy(load_from, device).train()
        linear = use_onednn_linear(policy, cfg.cpu_linear, device, trainer_dtype)
        engine_name, engine_reason = resolve_engine(cfg, device, parameter_count(policy),
                                                    policy.get_output_embeddings().weight.shape[0])
        if created:  # beside the engine dtype's choice, in the run's config.yaml
            add_resolved(run_dir, {"engine": engine_name, "engine_reason": engine_reason})
        if cfg.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            policy.config.use_cache = False
        # on the CPU torch's fused AdamW: one kernel a parameter instead of ~10 ops (the embedded default: 1.5 →
        # 0.4 ms a step, issue #49), the same update to fp32 rounding (tests/test_train.py); GPUs keep the default
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0,
                                      fused=True if device.type == "cpu" else None)
        scorer = Scorer(policy, sampling, device, trainer_dtype, cfg.micro_batch_tokens)  # one way to score, all run
        state = load_trainer_state(checkpoint) if checkpoint else {"step": 0, "version": 0, "pending": []}
        state.setdefault("pipeline", {})  # staleness policy's queue cursor (issue #25); older checkpoints lack it
        if checkpoint:
            optimizer.load_state_dict(state["optimizer"])
        start_step, version = state["step"], state["version"]
        console.print(f"offpolicy train: {cfg.task} · {device} ({trainer_dtype}) · "
                      f"engine {engine_name} ({engine_dtype}) · "
                      f"loss {cfg.loss_summary()} · staleness ≤ "
                      f"{cfg.max_staleness} · run {run_dir}")
        defaults = cfg.model_defaults()
        if defaults:  # chosen by the model, not the task: say which applied
            console.print(f"  {defaults}")
        console.print(f"  threads: {torch.get_num_threads()} ({threads_reason}) · linear layers: {linear}")
        if cfg.engine == "auto":
            console.print(f"  engine {engine_name}: {engine_reason.removeprefix('auto: ')} (engine=auto)")
        context = cfg.max_prompt_tokens + cfg.max_new_tokens if cfg.task == "dataset" else 1024
        engine_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        engine = make_engine(engine_name, str(load_from), tokenizer, engine_dtype, seed=cfg.seed,
                             logit_noise=cfg.engine_logit_noise, max_model_len=context, log_path=run_dir / "engine.log",
                             device=device, gpu_memory_utilization=cfg.engine_gpu_memory_utilization,
                             sleep=cfg.engine_sleep and cfg.max_staleness == 0, vllm_options=cfg.vllm.model_dump(),
                             cpu_linear=cfg.cpu_linear)
        # the engine's share of the trainer device's allocations (memory_metrics)
        engine_bytes = torch.cuda.memory_allocated(device) - engine_bytes if device.type == "cuda" else 0
        engine.sync_weights(engine_weights(policy, cfg, version, snapshot=False))
        # no π_old forward where it equals sg(π_θ) exactly, or where the loss never reads it
        single = single_update(cfg, policy)
        skip_old = single or (not uses_old(loss_cfg) and not cfg.recompute_old)
        pipeline = RolloutPipeline(engine, task, tokenizer, sampling, cfg.prompts_per_step, cfg.group_size,
                                   cfg.max_staleness, cfg.seed, pending=state["pending"],
                                   staleness_policy=cfg.staleness_policy, **state["pipeline"])
        eval_set = problems(task, cfg.eval_problems, seed=cfg.seed + 20_000)
        if hasattr(task, "held_out"):  # dataset, larger: the held-out rows; eval/accuracy = mean reward, greedy
            eval_set = list(task.held_out[: cfg.eval_problems])
        logger = RunLogger(run_dir, cfg.steps, start_step, console, progress=progress, log_to=cfg.log_to,
                           config=yaml.safe_load((run_dir / "config.yaml").read_text()))
    except BaseException as err:
        if threads_before is not None:
            set_threads(threads_before)
        if created and not isinstance(err, EngineError):
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-written (an engine failure keeps engine.log)
        raise

    completed, updating, interrupted, failed, saved = start_step, False, False, False, start_step
    raised = False
    def checkpoint() -> None:
        """The run at ``completed`` steps: weights, optimizer, queued rollouts and the pipeline's counters."""
        save_checkpoint(run_dir, completed, policy, tokenizer, optimizer,
                        {"step": completed, "version": version, "pending": pipeline.state(),
                         "pipeline": pipeline.counters()})

    stop = GracefulStop()
    try:
        for step in range(start_step, cfg.steps):
            t0, timer = time.perf_counter(), StageTimer()
            reset_memory_peaks(device)
            # ------------------------------------------------ sample (bounded staleness) and score
            item, waited = pipeline.next(step, version)
            with timer("score"):
                texts = tokenizer.batch_decode(item.rollouts.response_ids, skip_special_tokens=True)
                rewards = torch.tensor([task.reward(p, t) for p, t in zip(item.problems, texts)])
                advantages = grpo_advantages(rewards, cfg.group_size)
                batch = to_batch(item.rollouts, tokenizer.pad_token_id)
                adv_tokens = advantages.unsqueeze(-1).expand_as(batch.mask).contiguous()
            # ------------------------------------------------ π_old: the trainer before this step
            loglinear = cfg.prox_logp == "loglinear"  # π_old from the versions: no forward (AReaL)
            with timer("pi_old"):
                old = None if skip_old or loglinear else scorer.score(batch)

            # one update per batch: the update's forward is π_old exactly (module doc), so the sample rows'
            # log π_old are kept from it (no forward of their own, issue #49); else they take one before the update
            shown = set(spread_rows(len(rewards), cfg.group_size, cfg.samples_per_step).tolist())
            update_lp: dict[int, torch.Tensor] | None = {} if single and not loglinear and shown else None

            def old_of(rows, mb, logprobs):
                if loglinear:  # proximal = this step's starting weights (v + 1 − 1)
                    return op.loglinear_proximal(logprobs, mb.rollout_logprobs, item.rollouts.version,
                                                 current_version=version + 1)
                if skip_old:
                    if update_lp is not None:
                        update_lp.update({r: logprobs[i].detach() for i, r in enumerate(rows.tolist()) if r in shown})
                    return logprobs.detach()
                return old[device_index(rows, device), : mb.mask.shape[1]]

            samples = []
            if update_lp is None:
                with timer("samples"):  # a few rows as text, with their log ρ under the weights that start the step
                    samples = step_samples(cfg, scorer, tokenizer, item, batch, texts, rewards, advantages, old)
            # ------------------------------------------------ corrected loss, PPO mini-batches, micro-batches
            metrics = Metrics()
            order = torch.Generator().manual_seed(cfg.seed * 31 + step)
            # no advantage signal and no other loss term: a zero gradient, so no forward/backward (module doc)
            skipped = bool((advantages == 0).all()) and loss_cfg.kl_coef == 0
            trained_on = version  # the weights this step starts from (the version does not advance on a skip)
            updating = stop.updating = True  # from here until the step is logged, the weights are mid-update
            kl_rows = spread_rows(len(rewards), cfg.group_size, cfg.policy_kl_rows) if cfg.policy_kl_rows else None
            with timer("policy_kl"):  # the policy before the update, on a few rows (policy/kl_k3_update)
                kl_before = None if kl_rows is None or skipped else scorer.whole().score(batch.select(kl_rows))
            with timer("train"):
                step_args = dict(old_of=old_of, loss_cfg=loss_cfg, max_grad_norm=cfg.max_grad_norm, metrics=metrics,
                                 split_metrics=cfg.split_metrics)
                if skipped:  # the mismatch is still measured: one no-grad pass over the batch (module doc)
                    optimizer_step(scorer, optimizer, batch, torch.arange(len(rewards)), adv_tokens, **step_args,
                                   update=False)
                for _ in range(0 if skipped else cfg.ppo_epochs):
                    for rows in torch.randperm(len(rewards), generator=order).chunk(cfg.minibatches):
                        if batch.mask[rows].sum() == 0:  # the CPU batch: no device read
                            continue
                        optimizer_step(scorer, optimizer, batch, rows, adv_tokens, **step_args)
            if update_lp is not None:
                with timer("samples"):  # log π_old from the update's own forward (update_lp above)
                    samples = step_samples(cfg, scorer, tokenizer, item, batch, texts, rewards, advantages, old,
                                           update_logprobs=update_lp)
            with timer("policy_kl"):
                kl_update = None if kl_rows is None else 0.0 if skipped else update_kl_k3(
                    kl_before, scorer.whole().score(batch.select(kl_rows)),
                    batch.mask[kl_rows].to(device))
            # ------------------------------------------------ new weights to the engine
            with timer("sync"):
                if not skipped:
                    version += 1
                    pipeline.sync(engine_weights(policy, cfg, version, snapshot=pipeline.overlapped), version)
            # ------------------------------------------------ log
            with timer("log"):
                n_tokens = float(batch.mask.sum())
                values = {
                    **with_kl_over_entropy(metrics.to_dict()),
                    "reward": rewards.mean().item(),
                    "response_length": n_tokens / len(rewards),
                    "finished_fraction": sum(item.rollouts.finished) / len(rewards),
                    # responses cut by max_new_tokens (or the context) before their stop token
                    "truncated_share": 1.0 - sum(item.rollouts.finished) / len(rewards),
                    "staleness": float(trained_on - item.rollouts.version),
                    **staleness_metrics(trained_on, batch.versions, pipeline, item),
                    "generate/tokens_per_s": n_tokens / max(item.seconds, 1e-9),  # the engine's rate
                    "policy_version": float(version),
                    "skipped_update": float(skipped),
                    "reward/groups_with_spread": groups_with_spread(rewards, cfg.group_size),
                }
                if kl_update is not None:  # a skipped update moves nothing: exactly 0
                    values["policy/kl_k3_update"] = kl_update
            # its own stage: greedy answers to the held-out prompts cost seconds on a real model (issue #49),
            # which inside "log" hid what writing the step's records costs (milliseconds)
            if eval_set and (step % cfg.eval_every == 0 or step == cfg.steps - 1):
                with timer("eval"):  # held-out tasks: greedy reward, truncation, length, answer log-prob (evaluate.py)
                    values.update(evaluate(policy, tokenizer, task, eval_set, cfg.max_new_tokens, trainer_dtype))
            values.update({"time/generate": item.seconds, "time/wait": waited,
                           **{f"time/{k}": v for k, v in timer.seconds.items()},
                           "step_seconds": time.perf_counter() - t0})
            values.update(throughput(values, n_tokens, device, pipeline.overlapped, engine_bytes))
            logger.log(step, values)
            logger.log_samples(step, samples)
            pipeline.commit(step)
            completed, updating = step + 1, False
            stop.updating = False
            if completed % cfg.checkpoint_every == 0 or completed == cfg.steps:
                checkpoint()
                saved = completed
            stop.check()  # a SIGTERM that came mid-update ends the run here, the step done
    except KeyboardInterrupt as err:
        interrupted = True
        stop_signal = signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT
        if not updating and completed > saved:
            # between updates the weights, optimizer and queued rollouts are consistent: save them
            with stop.deferred():
                checkpoint()
        where = latest_checkpoint(run_dir).name if (run_dir / "checkpoints" / "latest").exists() else "none yet"
        how = "terminated (SIGTERM)" if stop_signal == signal.SIGTERM else "interrupted"
        console.print(f"[yellow]{how} after {completed} steps; checkpoint: {where}. Continue with "
                      f"offpolicy train --resume {run_dir}[/yellow]")
    except BaseException as err:
        failed = not isinstance(err, EngineError)  # an engine failure keeps the run directory and its engine.log
        raised = True
        raise
    finally:
        stop.close()
        pipeline.close()
        logger.close()
        if raised:
            logger.finish(failed=True)  # the trackers' runs end as failed
        engine.close()
        if threads_before is not None:  # the caller's process as it was (a run started in-process, a test)
            set_threads(threads_before)
        if failed and created and not (run_dir / "checkpoints").exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a run that never checkpointed leaves nothing
    plot = logger.plot()
    logger.finish(plot)
    summary = logger.summary()
    trackers = "".join(f"  {name}: {place}" for name, place in logger.trackers.places().items())
    console.print(f"metrics: {logger.path}  plots: {plot}  view: offpolicy view {run_dir}{trackers}")
    return RunResult(run_dir, summary, interrupted, stop_signal if interrupted else signal.SIGINT)
