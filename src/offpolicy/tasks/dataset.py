"""``task: dataset``: prompts and reference answers from a real data file, scored by a verifiable reward.

Prompts and references are the file's text, as written (issue #32): a ``.jsonl``/``.json``/``.csv``
file (or a dataset directory of them) is read here with the standard library, numbers kept as the
text they are written with — JSON ``72`` is ``"72"``, a CSV cell ``72.50`` is ``"72.50"`` — where the
``datasets`` library would infer a float column and give ``"72.0"`` (so ``reward=exact`` scored the
file's own answer 0). A ``.parquet`` file, a directory saved with ``Dataset.save_to_disk`` (read
with ``datasets.load_from_disk``) or a hub name go through ``datasets``: their columns are typed,
and a number becomes its text (a whole float such as ``72.0`` as ``"72"``).

Every prompt is rendered and tokenised once, before training starts (and before any model weight
loads), so every bad input is one clear error up front: a missing file, an empty one, a column
that is not there, an empty prompt, a prompt longer than ``max_prompt_tokens``, a chat template
that refuses the system prompt, a tokenizer that turns prompts into nothing, a reward function
that does not return a number.

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

import csv
import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from offpolicy.core.config import _Strict
from offpolicy.core.errors import ConfigError
from offpolicy.tasks.rewards import RewardFn, checked_value, resolve_reward
from offpolicy.tasks.tasks import Problem

log = logging.getLogger(__name__)
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataConfig(_Strict):
    """``task: dataset``: where the prompts and reference answers come from, and how prompts are rendered."""

    path: str | None = Field(None, description="a local .jsonl/.json/.parquet/.csv file (or a dataset directory, or "
                             "a hub name where the hub is reachable), read through the `datasets` library")
    prompt_field: str = Field("question", description="column holding the prompt text (GSM8K: question)")
    answer_field: str = Field("answer", description="column holding the reference the reward compares against "
                              "(GSM8K: answer, ending in '#### N')")
    split: str = Field("train", description="split to read from a dataset directory or hub name")
    subset: str | None = Field(None, description="a hub dataset's configuration name (openai/gsm8k: main)")
    eval_split: str = Field("test", description="split of data.eval_path when it is a dataset directory or hub name")
    eval_path: str | None = Field(None, description="held-out file for eval/accuracy; unset = hold out eval_fraction")
    eval_fraction: float | None = Field(None, ge=0, lt=1, description="share of data.path's rows held out for eval "
                                        "(shuffled with data.seed); unset = 0.1 without eval_path; 0 = no eval")
    seed: int = Field(0, description="the held-out split's shuffle: fixed across RL seeds")
    system_prompt: str | None = Field(None, description="a system message (chat template) or a first paragraph")
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="auto: render prompts with the tokenizer's chat template when it has one; none: raw text")
    drop_long_prompts: bool = Field(False, description="rows whose prompt exceeds max_prompt_tokens: false = refuse "
                                    "the file before training (the default), true = drop those rows and say how many")

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataConfig:
        if self.eval_path is not None and self.eval_fraction:
            raise ValueError(f"data.eval_path={self.eval_path!r} and data.eval_fraction={self.eval_fraction}: "
                             "pick one held-out source (unset eval_fraction, or drop eval_path)")
        return self



def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConfigError("task=dataset reads data files through the `datasets` library, which is not installed. "
                          "Fix: pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def as_text(value: Any) -> Any:
    """A cell as the text a prompt or reference is compared as: strings as they are, a number as
    written (JSON/CSV numbers arrive here already as their text), an int as ``str``, a whole float
    of a typed column without ``.0``, a bool as JSON writes it; None (a missing cell) and
    containers pass through (``_problems`` refuses them with the row)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):  # NaN: a typed column's missing cell (pandas writes gaps as NaN)
        return None if math.isnan(value) else str(int(value)) if value.is_integer() else repr(value)
    return value


def _json_rows(text: str, where: str) -> list[dict[str, Any]]:
    """Records of a JSON file — an array of objects, an object of equal-length columns, or JSON
    Lines — with every number kept as its text (``parse_int`` / ``parse_float``)."""
    parse = {"parse_int": str, "parse_float": str}
    try:
        data = json.loads(text, **parse)
    except json.JSONDecodeError:
        data = None  # JSON Lines, one object per line
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise ConfigError(f"{where}: a JSON object of columns needs columns of one length; got {sorted(lengths)}")
        return [dict(zip(data, values)) for values in zip(*data.values())]
    if isinstance(data, list):
        records = data
    elif isinstance(data, dict):
        records = [data]
    else:
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line, **parse))
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{where} line {number}: not valid JSON ({err.msg})") from None
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise ConfigError(f"{where} record {number}: expected an object of fields, got {type(record).__name__}")
    return records


def _csv_rows(text: str) -> list[dict[str, Any]]:
    """Records of a CSV file with a header row, every cell as written; an empty cell is missing."""
    return [{k: (v if v != "" else None) for k, v in row.items() if k is not None}
            for row in csv.DictReader(text.splitlines(keepends=True))]


TEXT_READERS = {".jsonl": _json_rows, ".json": _json_rows, ".csv": lambda text, where: _csv_rows(text)}


def _read_text_files(paths: list[Path], where: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{where}: cannot be read: {type(err).__name__}: {err}") from None
        rows += TEXT_READERS[path.suffix.lower()](text, where if len(paths) == 1 else f"{where} ({path.name})")
    return rows


def _is_saved_dataset(directory: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return (directory / "dataset_dict.json").is_file() or (directory / "state.json").is_file()


def load_rows(path: str, fields: list[str], split: str = "train", what: str = "data.path",
              subset: str | None = None) -> list[dict[str, Any]]:
    """The rows of ``path`` (only ``fields``), as dicts of text (``as_text``; see the module docstring).

    Raises:
        ConfigError: no such file and no reachable dataset of that name, an unsupported extension, an
        unreadable or empty file, or a named field missing (the message lists the fields present).
    """
    local = Path(path).expanduser()
    where = f"{what}={path!r}"
    records: list[dict[str, Any]] | None = None
    try:
        if local.is_file():
            suffix = local.suffix.lower()
            if suffix not in BUILDERS:
                raise ConfigError(f"{where}: unsupported file type {local.suffix!r}; use one of {', '.join(BUILDERS)}")
            if local.stat().st_size == 0:
                raise ConfigError(f"{where} is empty: it holds no rows")
            if suffix in TEXT_READERS:
                records = _read_text_files([local], where)
            else:
                ds = _datasets().load_dataset(BUILDERS[suffix], data_files=str(local), split="train")
        elif local.is_dir() and _is_saved_dataset(local):
            ds = _datasets().load_from_disk(str(local))
            if hasattr(ds, "keys"):  # a DatasetDict: pick the split
                if split not in ds:
                    raise ConfigError(f"{where} (saved with save_to_disk) has no split {split!r}; its splits: "
                                      f"{', '.join(ds)}. Fix: data.split / data.eval_split")
                ds = ds[split]
        elif local.is_dir() or not local.suffix:
            datasets = _datasets()
            files = None
            if local.is_dir():  # the files `datasets` would read for this split, read as text when it can
                builder = datasets.load_dataset_builder(str(local), subset)
                found = (builder.config.data_files or {}).get(split)
                files = [Path(f) for f in found] if found else None
            if files and all(f.suffix.lower() in TEXT_READERS for f in files):
                records = _read_text_files(files, where)
            else:
                ds = datasets.load_dataset(str(local) if local.is_dir() else path, subset, split=split)
        else:
            raise ConfigError(f"{where}: file not found")
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 — datasets raises many types; all mean "cannot read it"
        hint = "" if local.exists() else " (not a local file or directory, and not loadable as a hub dataset)"
        raise ConfigError(f"{where}: cannot be read{hint}: {type(err).__name__}: {str(err)[:300]}") from None
    if records is None:
        columns = list(ds.column_names)
        records = ds.select_columns([f for f in fields if f in columns]).to_list() if len(ds) else []
    else:
        columns = list(dict.fromkeys(key for record in records for key in record))
    if not records:
        raise ConfigError(f"{where} holds no rows")
    missing = [f for f in fields if f not in columns]
    if missing:
        which = " and ".join(f"data.{'prompt' if f == fields[0] else 'answer'}_field={f!r}" for f in missing)
        raise ConfigError(f"{where} has no field {', '.join(map(repr, missing))} ({which}); its fields are: "
                          f"{', '.join(columns)}. Fix: name the right columns with data.prompt_field / "
                          "data.answer_field")
    return [{f: as_text(record.get(f)) for f in fields} for record in records]


def _apply_template(tokenizer, messages: list[dict[str, str]], system_prompt: str | None) -> str:
    """One conversation through the tokenizer's chat template; a template that raises (a jinja
    ``raise_exception``: Gemma's and Mistral's refuse a system turn) is one ConfigError naming the
    setting to change."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 — jinja2's TemplateError and whatever the template raises
        why = f"{type(err).__name__}: {str(err)[:200]}"
        if system_prompt:
            raise ConfigError(f"data.system_prompt: the model's chat template refuses a system turn ({why}). Fix: "
                              "drop data.system_prompt, or data.chat_template=none (the system prompt then leads "
                              "the raw text as its first paragraph)") from None
        raise ConfigError(f"data.chat_template=auto: the model's chat template cannot render a user turn ({why}). "
                          "Fix: data.chat_template=none (raw text)") from None


def render_prompts(tokenizer, texts: list[str], system_prompt: str | None, chat_template: str) -> list[list[int]]:
    """Token ids of each prompt, rendered as the module docstring says.

    Raises:
        ConfigError: the chat template refuses the conversation (a system turn, typically).
    """
    if chat_template == "auto" and getattr(tokenizer, "chat_template", None):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        rendered = [_apply_template(tokenizer, [*system, {"role": "user", "content": t}], system_prompt)
                    for t in texts]
        return tokenizer(rendered, add_special_tokens=False).input_ids  # the template holds any BOS itself
    rendered = [f"{system_prompt}\n\n{t}" if system_prompt else t for t in texts]
    return tokenizer(rendered).input_ids  # plain text: the tokenizer's own BOS rule (tasks/tokenizer.py)


def check_tokenizer(tokenizer, texts: list[str], vocab_size: int | None, where: str) -> None:
    """Refuse a tokenizer that cannot encode the data — e.g. a model directory holding only
    ``tokenizer_config.json``, which loads a tokenizer of a couple of special tokens that turns every
    prompt into nothing (the engine then failed deep inside generate): a vocabulary far smaller than
    the model's ``vocab_size`` (under a quarter of it; padded embeddings are a few percent larger at
    most) that is also smaller than a byte-level alphabet (256), or a non-empty prompt that encodes to
    no token. A working tokenizer smaller than its model's head (a test model's 384-token BPE under a
    49,152-row head, a head padded for later tokens) is the user's choice, not a broken file.

    Raises:
        ConfigError: naming the model's tokenizer files and the fix.
    """
    size = len(tokenizer)
    if vocab_size and size * 4 < vocab_size and size < 256:
        raise ConfigError(f"model: the tokenizer has {size} tokens but the model's vocab_size is {vocab_size} "
                          "(config.json): the tokenizer files next to the weights are incomplete (tokenizer.json, "
                          "or vocab.json + merges.txt, missing?). Fix: save the model's own tokenizer there "
                          "(tokenizer.save_pretrained(DIR))")
    empty = next((i for i, ids in enumerate(tokenizer(texts, add_special_tokens=False).input_ids) if not ids), None)
    if empty is not None:
        raise ConfigError(f"{where} row {empty + 1}: the prompt {texts[empty][:60]!r} encodes to no token with the "
                          f"model's tokenizer ({size} tokens): its tokenizer files are incomplete. Fix: save the "
                          "model's own tokenizer next to the weights (tokenizer.save_pretrained(DIR))")


def _problems(rows: list[dict[str, Any]], data, tokenizer, max_prompt_tokens: int, what: str,
              path: str, vocab_size: int | None = None) -> tuple[list[Problem], int]:
    """Rows → Problems with their rendered prompt ids; the count of rows dropped for length."""
    for number, row in enumerate(rows, 1):
        prompt, answer = row[data.prompt_field], row[data.answer_field]
        if not isinstance(prompt, str) or not isinstance(answer, str):
            raise ConfigError(f"{what}={path!r} row {number}: {data.prompt_field!r} and {data.answer_field!r} must "
                              f"be text (or a number); got {prompt!r:.80} / {answer!r:.80}")
        if not prompt.strip():
            raise ConfigError(f"{what}={path!r} row {number}: the prompt ({data.prompt_field!r}) is empty; a model "
                              "asked nothing cannot earn the reward. Fix: remove the row or fill it in")
    texts = [row[data.prompt_field] for row in rows]
    check_tokenizer(tokenizer, texts, vocab_size, f"{what}={path!r}")
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
    problems = [Problem(prompt=texts[i], answer=rows[i][data.answer_field], prompt_ids=tuple(ids[i]))
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


def load_dataset_task(data, tokenizer, reward: str, max_prompt_tokens: int, max_new_tokens: int,
                      vocab_size: int | None = None) -> DatasetTask:
    """Read, render and split the data of ``data`` (a ``DataConfig``); check the tokenizer (against
    the model's ``vocab_size`` when given, ``check_tokenizer``) and the reward on a real row.

    Raises:
        ConfigError: every input problem ``load_rows`` and ``_problems`` name; a held-out fraction that
        leaves no training row; a reward function that fails or returns a non-number on the first row.
    """
    fields = [data.prompt_field, data.answer_field]
    rows, dropped = _problems(load_rows(data.path, fields, data.split, subset=data.subset), data, tokenizer,
                              max_prompt_tokens, "data.path", data.path, vocab_size)
    if data.eval_path is not None:
        rows_eval = load_rows(data.eval_path, fields, data.eval_split, "data.eval_path", data.subset)
        held_out, more = _problems(rows_eval, data, tokenizer, max_prompt_tokens, "data.eval_path", data.eval_path,
                                   vocab_size)
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
