"""The embedded default policy: a tiny Qwen2 warm-started by supervised learning on the task.

RL from a random policy on these tasks never sees a reward, and a converged SFT model leaves
nothing to learn; so SFT stops as soon as the *sampled* accuracy (temperature 1, as RL samples)
reaches ``target_accuracy`` (default 20 %). The result is cached on disk, keyed by everything
that determines it, and reused by later runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from filelock import FileLock  # a dependency of torch
from transformers import PreTrainedTokenizerBase

from offpolicy.core.config import ConfigError
from offpolicy.engines.base import left_pad, stop_token_ids
from offpolicy.engines.generation import explicit_config, generate
from offpolicy.tasks import Problem, Task, make_task, problems
from offpolicy.tasks.tasks import exact_match
from offpolicy.tasks.model import build_tiny_qwen2
from offpolicy.policy.score import precision
from offpolicy.policy.warmstart_config import WarmStartConfig
from offpolicy.tasks.tokenizer import build_char_tokenizer, prompt_ids

log = logging.getLogger(__name__)


class WarmStartSpec(Protocol):
    """What names a warm start: ``TrainConfig.warm_start_spec()`` and ``DiagnoseConfig.warm_start_spec()`` give
    these fields (the same task, the same cached model); a config that has ``warm_start_spec`` may be passed
    itself (``spec_of``)."""

    task: str
    task_params: dict[str, Any]
    max_new_tokens: int
    warm_start: WarmStartConfig
WARMSTART_VERSION = 1  # bump when the procedure changes: old cache entries are then ignored


def cache_root() -> Path:
    """``$OFFPOLICY_CACHE``, or ``~/.cache/offpolicy`` where it is unset or empty (``OFFPOLICY_CACHE=`` must
    not put the cache in the working directory)."""
    return Path(os.environ.get("OFFPOLICY_CACHE") or Path.home() / ".cache" / "offpolicy")


def answer_ids(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
    return [*tokenizer(problem.answer, add_special_tokens=False).input_ids, tokenizer.eos_token_id]


def sft_batch(tokenizer, batch: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels); labels only on the answer and EOS."""
    rows = [(prompt_ids(tokenizer, p), answer_ids(tokenizer, p)) for p in batch]
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        seq = prompt + answer
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(prompt) : len(seq)] = torch.tensor(answer)
        attention[i, : len(seq)] = 1
    return ids, attention, labels


@torch.no_grad()
def exact_match_accuracy(model, tokenizer, task: Task, batch: list[Problem], max_new_tokens: int,
                         sample_seed: int | None, score=None, trainer_dtype: str = "fp32") -> float:
    """Exact-match accuracy of one completion per problem: a temperature-1 sample seeded with
    ``sample_seed`` (what RL sees), or greedy decoding when it is None (the eval metric).
    ``score(problem, completion)`` replaces exact match (task=dataset: its reward; mean over the batch).
    Decoding uses this explicit config alone (never the model's ``generation_config.json``), under
    the trainer's precision (``trainer_dtype``: bf16 is autocast over the fp32 weights, as in the update)."""
    input_ids, attention = left_pad([prompt_ids(tokenizer, p) for p in batch], tokenizer.pad_token_id)
    if sample_seed is not None:
        torch.manual_seed(sample_seed)
    config = explicit_config(do_sample=sample_seed is not None, max_new_tokens=max_new_tokens,
                             stop=stop_token_ids(tokenizer, model), pad=tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    input_ids, attention = input_ids.to(model.device), attention.to(model.device)  # the trainer's device
    try:
        with precision(model.device, trainer_dtype):
            out = generate(model, input_ids, attention, config)
    finally:
        model.train(was_training)
    texts = tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)
    score = score or exact_match  # not task.reward for synthetic tasks: no partial credit
    return sum(score(p, t) for p, t in zip(batch, texts)) / len(batch)


def context_length(max_new_tokens: int) -> int:
    """The embedded model's ``max_position_embeddings`` (vLLM's context limit): 128 for the short
    tasks (unchanged), else room for a prompt of ≤ 64 tokens plus the response, rounded to 64.
    RoPE has no learned positions, so this changes no weight."""
    return max(128, 64 * -(-(max_new_tokens + 64) // 64))


def spec_of(cfg: Any) -> WarmStartSpec:
    """``cfg``'s warm-start spec: ``cfg.warm_start_spec()`` where the config has one (train's, diagnose's: the
    response limit sits in their sampling section), else ``cfg`` itself."""
    make = getattr(cfg, "warm_start_spec", None)
    return make() if callable(make) else cfg


def warm_start_key(cfg: WarmStartSpec) -> str:
    cfg = spec_of(cfg)
    ws = cfg.warm_start.model_dump()
    seed = ws.pop("seed")
    spec = {"v": WARMSTART_VERSION, "task": cfg.task, "task_params": cfg.task_params, "seed": seed,
            "max_new_tokens": cfg.max_new_tokens, "warm_start": ws}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def warm_start_progress(console):
    """A ``progress`` for ``default_model`` that prints each evaluation of the warm start on ``console``."""
    def progress(step, total, loss, accuracy):
        console.print(f"  warm start: step {step}/{total}  loss {loss:.3f}  sampled accuracy {accuracy:.0%}")
    return progress


def model_dir(model: str, spec: WarmStartSpec, progress=None) -> Path:
    """The model to start from: ``default``, the warm-started embedded model of ``spec`` (trained now if
    not cached; ``progress(step, total, loss, accuracy)`` hears of it), or a local HF model directory.

    Raises:
        ConfigError: ``model`` is neither ``default`` nor a directory with a config and tokenizer files.
    """
    if model == "default":
        return default_model(spec, progress)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model: {model!r} is not a local Hugging Face model directory (no config.json); "
                          "use model=default for the embedded tiny model")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise ConfigError(f"model: {model!r} has no tokenizer files; save the tokenizer next to the model")
    return path


def default_model(cfg: WarmStartSpec, progress=None) -> Path:
    """Path of the warm-started default model for ``cfg`` (trained now if not cached)."""
    cfg = spec_of(cfg)
    target = cache_root() / "warmstart" / f"{cfg.task}-{warm_start_key(cfg)}"
    if (target / "warmstart.json").exists():
        log.info("warm start: reusing %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # one warm start of a key at a time: a run started beside it (a parallel sweep's, a test worker's)
    # waits for it and reuses its result instead of training the same model again
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if (target / "warmstart.json").exists():
            log.info("warm start: reusing %s", target)
            return target
        return _warm_start(cfg, target, progress)


def _warm_start(cfg: WarmStartSpec, target: Path, progress) -> Path:
    ws = cfg.warm_start
    task = make_task(cfg.task, **cfg.task_params)
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, seed=ws.seed, max_positions=context_length(cfg.max_new_tokens))
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    rng = random.Random(ws.seed)
    eval_set = problems(task, ws.eval_problems, seed=ws.seed + 10_000)
    start, accuracy, step = time.time(), 0.0, 0
    for step in range(1, ws.max_steps + 1):
        ids, attention, labels = sft_batch(tokenizer, [task.sample(rng) for _ in range(ws.batch_size)])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % ws.eval_every == 0:
            accuracy = exact_match_accuracy(model, tokenizer, task, eval_set, cfg.max_new_tokens,
                                            sample_seed=ws.seed + step)
            if progress is not None:
                progress(step, ws.max_steps, loss.item(), accuracy)
            if accuracy >= ws.target_accuracy:
                break
    if accuracy == 0 and getattr(task, "partial_credit", False):
        # a partial-credit reward (walk) still ranks the group's completions: RL has a signal
        log.warning("warm start reached 0%% sampled exact-match accuracy in %d steps; task %r rewards partial "
                    "answers, so RL proceeds on partial credit alone", step, cfg.task)
    elif accuracy == 0:
        # exact-match RL from a policy that never succeeds sees no reward at all: refuse, with the fix
        raise RuntimeError(
            f"the warm start of task {cfg.task!r} reached 0% sampled accuracy in {step} steps (warm_start.seed="
            f"{ws.seed}, lr={ws.lr}); RL from it would never see a reward. Raise warm_start.max_steps, lower "
            "warm_start.lr, try another warm_start.seed or an easier task_params")
    if accuracy < ws.target_accuracy:
        log.warning("warm start reached only %.0f%% sampled accuracy in %d steps", 100 * accuracy, step)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warmstart.json").write_text(json.dumps(
        {"steps": step, "sampled_accuracy": accuracy, "seconds": round(time.time() - start, 1), "task": cfg.task}))
    try:
        tmp.rename(target)  # atomic: a half-written cache entry is never visible
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target
