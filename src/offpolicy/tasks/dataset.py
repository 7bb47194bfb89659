"""``task: dataset``: prompts and reference answers from a real data file, scored by a verifiable reward.

The file is read through the ``datasets`` library: a local ``.jsonl``/``.json``/``.parquet``/``.csv``
file, a dataset directory, or a hub name (where the hub is reachable). Every prompt is rendered and
tokenised once, before training starts, so every bad input is one clear error up front: a missing
file, an empty one, a column that is not there, a prompt longer than ``max_prompt_tokens``, a reward
function that does not return a number.

Rendering: with ``data.chat_template: auto`` and a tokenizer that has a chat template, the prompt is
``[system?, user]`` through ``apply_chat_template(add_generation_prompt=True)`` — the template writes
its own BOS where the model wants one; otherwise it is the raw text (after ``system_prompt`` and a
blank line) with what the tokenizer itself puts in front of text (``tokenizer(text)``: Llama's BOS; nothing
for Qwen or SmolLM2, whose ``bos_token`` ``<|im_start|>`` opens a chat turn).

Prompts longer than ``max_prompt_tokens`` are *refused* (or, with ``data.drop_long_prompts``, dropped
and counted), never left-truncated: cutting a prompt's start removes the chat template's header and
system turn, and cutting anywhere removes part of the question — the model would be rewarded against
an answer to a question it never saw.

``DatasetTask`` satisfies the ``Task`` protocol: ``sample(rng)`` draws a training row uniformly (with
replacement, so a step's batch depends on its seed alone and a resumed run draws what an uninterrupted
one would), ``reward(problem, completion)`` scores it; ``held_out`` is the eval set.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offpolicy.errors import ConfigError
from offpolicy.tasks.rewards import RewardFn, checked_value, resolve_reward
from offpolicy.tasks.tasks import Problem

log = logging.getLogger(__name__)
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConfigError("task=dataset reads data files through the `datasets` library, which is not installed. "
                          "Fix: pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load_rows(path: str, fields: list[str], split: str = "train", what: str = "data.path",
              subset: str | None = None) -> list[dict[str, Any]]:
    """The rows of ``path`` (only ``fields``), as dicts.

    Raises:
        ConfigError: no such file and no reachable dataset of that name, an unsupported extension, an
        unreadable or empty file, or a named field missing (the message lists the fields present).
    """
    datasets = _datasets()
    local = Path(path).expanduser()
    try:
        if local.is_file():
            builder = BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise ConfigError(f"{what}={path!r}: unsupported file type {local.suffix!r}; "
                                  f"use one of {', '.join(BUILDERS)}")
            if local.stat().st_size == 0:
                raise ConfigError(f"{what}={path!r} is empty: it holds no rows")
            ds = datasets.load_dataset(builder, data_files=str(local), split="train")
        elif local.is_dir() or not local.suffix:
            ds = datasets.load_dataset(str(local) if local.is_dir() else path, subset, split=split)
        else:
            raise ConfigError(f"{what}={path!r}: file not found")
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 — datasets raises many types; all mean "cannot read it"
        hint = "" if local.exists() else " (not a local file or directory, and not loadable as a hub dataset)"
        raise ConfigError(f"{what}={path!r}: cannot be read{hint}: {type(err).__name__}: {str(err)[:300]}") from None
    if len(ds) == 0:
        raise ConfigError(f"{what}={path!r} holds no rows")
    missing = [f for f in fields if f not in ds.column_names]
    if missing:
        which = " and ".join(f"data.{'prompt' if f == fields[0] else 'answer'}_field={f!r}" for f in missing)
        raise ConfigError(f"{what}={path!r} has no field {', '.join(map(repr, missing))} ({which}); its fields are: "
                          f"{', '.join(ds.column_names)}. Fix: name the right columns with data.prompt_field / "
                          "data.answer_field")
    return ds.select_columns(fields).to_list()


def render_prompts(tokenizer, texts: list[str], system_prompt: str | None, chat_template: str) -> list[list[int]]:
    """Token ids of each prompt, rendered as the module docstring says."""
    if chat_template == "auto" and getattr(tokenizer, "chat_template", None):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        rendered = [tokenizer.apply_chat_template([*system, {"role": "user", "content": t}], tokenize=False,
                                                  add_generation_prompt=True) for t in texts]
        return tokenizer(rendered, add_special_tokens=False).input_ids  # the template holds any BOS itself
    rendered = [f"{system_prompt}\n\n{t}" if system_prompt else t for t in texts]
    return tokenizer(rendered).input_ids  # plain text: the tokenizer's own BOS rule (tasks/tokenizer.py)


def _problems(rows: list[dict[str, Any]], data, tokenizer, max_prompt_tokens: int, what: str,
              path: str) -> tuple[list[Problem], int]:
    """Rows → Problems with their rendered prompt ids; the count of rows dropped for length."""
    for number, row in enumerate(rows, 1):
        if not isinstance(row[data.prompt_field], str) or row[data.answer_field] is None:
            raise ConfigError(f"{what}={path!r} row {number}: {data.prompt_field!r} must be a string and "
                              f"{data.answer_field!r} set; got {row[data.prompt_field]!r:.80} / "
                              f"{row[data.answer_field]!r:.80}")
    texts = [row[data.prompt_field] for row in rows]
    ids = render_prompts(tokenizer, texts, data.system_prompt, data.chat_template)
    long = [i for i, p in enumerate(ids) if len(p) > max_prompt_tokens]
    if long and not data.drop_long_prompts:
        worst = max(long, key=lambda i: len(ids[i]))
        raise ConfigError(f"{what}={path!r}: {len(long)} of {len(rows)} prompts exceed max_prompt_tokens="
                          f"{max_prompt_tokens} (row {long[0] + 1} has {len(ids[long[0]])} tokens, the longest "
                          f"{len(ids[worst])}, chat template included). Prompts are never truncated (that would "
                          "cut the question). Fix: raise max_prompt_tokens, or data.drop_long_prompts=true")
    keep = sorted(set(range(len(rows))) - set(long))
    if not keep:
        raise ConfigError(f"{what}={path!r}: every prompt exceeds max_prompt_tokens={max_prompt_tokens}")
    problems = [Problem(prompt=texts[i], answer=str(rows[i][data.answer_field]), prompt_ids=tuple(ids[i]))
                for i in keep]
    return problems, len(long)


@dataclass(frozen=True)
class DatasetTask:
    """Rows of a data file as a ``Task``: ``train`` to sample from, ``held_out`` to evaluate on."""

    train: tuple[Problem, ...]
    held_out: tuple[Problem, ...]
    reward_spec: str
    max_new_tokens: int
    dropped: int = 0  # rows refused for length (data.drop_long_prompts)
    name: str = "dataset"
    reward_fn: RewardFn = field(default=None, repr=False, compare=False)

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.train)

    def reward(self, problem: Problem, completion: str) -> float:
        return checked_value(self.reward_spec, self.reward_fn(completion, problem.answer))


def load_dataset_task(data, tokenizer, reward: str, max_prompt_tokens: int, max_new_tokens: int) -> DatasetTask:
    """Read, render and split the data of ``data`` (a ``DataConfig``); check the reward on a real row.

    Raises:
        ConfigError: every input problem ``load_rows`` and ``_problems`` name; a held-out fraction that
        leaves no training row; a reward function that fails or returns a non-number on the first row.
    """
    fields = [data.prompt_field, data.answer_field]
    rows, dropped = _problems(load_rows(data.path, fields, data.split, subset=data.subset), data, tokenizer,
                              max_prompt_tokens, "data.path", data.path)
    if data.eval_path is not None:
        rows_eval = load_rows(data.eval_path, fields, data.eval_split, "data.eval_path", data.subset)
        held_out, more = _problems(rows_eval, data, tokenizer, max_prompt_tokens, "data.eval_path", data.eval_path)
        train, dropped = rows, dropped + more
    else:
        order = list(range(len(rows)))
        random.Random(data.seed).shuffle(order)
        fraction = 0.1 if data.eval_fraction is None else data.eval_fraction
        n_eval = max(round(fraction * len(rows)), 1) if fraction > 0 else 0
        if n_eval >= len(rows):
            raise ConfigError(f"data.eval_fraction={fraction} of {len(rows)} rows leaves no training row; "
                              "use a larger file, data.eval_fraction=0 or data.eval_path")
        held_out = [rows[i] for i in sorted(order[:n_eval])]
        train = [rows[i] for i in sorted(order[n_eval:])]
    fn = resolve_reward(reward)
    probe = train[0]
    try:  # the reference scored against itself: any reward function must at least return a number
        checked_value(reward, fn(probe.answer, probe.answer))
    except Exception as err:  # noqa: BLE001 — the user's function may raise anything; say where
        raise ConfigError(f"reward={reward!r} on the first training row (completion = its reference "
                          f"{probe.answer[:60]!r}): {type(err).__name__}: {err}") from None
    if dropped:
        log.warning("dropped %d prompts longer than max_prompt_tokens=%d (data.drop_long_prompts)", dropped,
                    max_prompt_tokens)
    return DatasetTask(tuple(train), tuple(held_out), reward, max_new_tokens, dropped, reward_fn=fn)


def dataset_prompts(data, tokenizer, max_prompt_tokens: int) -> list[list[int]]:
    """Only the rendered prompt ids of ``data.path`` (``offpolicy diagnose --data``: no reward, no split)."""
    rows = load_rows(data.path, [data.prompt_field], data.split, subset=data.subset)
    data = data.model_copy(update={"answer_field": data.prompt_field})  # nothing to score: reuse the prompt column
    problems, _ = _problems(rows, data, tokenizer, max_prompt_tokens, "--data", data.path)
    return [list(p.prompt_ids) for p in problems]
