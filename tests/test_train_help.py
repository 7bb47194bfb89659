"""``offpolicy train --help [SECTION]`` (issue #68 item 2): every key train takes, with its type, default and
description, generated from TrainConfig and the configs it nests; and every field of train's and diagnose's
configs has a description to show. In-process (tests/cli_inprocess.py): no model, no engine."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from typing import Any, Union

import pytest
import yaml
from pydantic import BaseModel

from cli_inprocess import offpolicy
from offpolicy.measure.diagnose_config import DiagnoseConfig
from offpolicy.train.config import HELP_SECTIONS, TrainConfig


def _models(kind: Any) -> Iterator[type[BaseModel]]:
    """Every config a type holds: itself, a union's members, a list's items, an Annotated's base."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        yield kind
    for arg in typing.get_args(kind):
        yield from _models(arg)


def _fields(model: type[BaseModel], prefix: str = "", seen: set | None = None) -> Iterator[tuple[str, Any]]:
    """(``dotted.path``, field) for every field of ``model`` and of every config under it, recursively."""
    seen = set() if seen is None else seen
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        yield f"{prefix}{model.__name__}.{name}", field
        for sub in _models(field.annotation):
            yield from _fields(sub, f"{prefix}{model.__name__}.{name}→", seen)


@pytest.mark.parametrize("config", [TrainConfig, DiagnoseConfig], ids=lambda c: c.__name__)
def test_every_config_field_has_help_text(config):
    """The help is generated from the descriptions: a field without one would be a key (or flag) with no
    meaning on screen. Walks nested configs, unions and lists of rules (the loss's correction, its weight, each
    reject rule, the data-chosen bounds)."""
    found = dict(_fields(config))
    assert len(found) > 40
    missing = sorted(path for path, field in found.items() if not (field.description or "").strip())
    assert not missing, f"fields with no description=: {missing}"


def test_every_train_field_is_in_exactly_one_help_section():
    listed = [name for _, names in HELP_SECTIONS.values() for name in names]
    assert sorted(listed) == sorted(TrainConfig.model_fields), \
        f"missing: {set(TrainConfig.model_fields) - set(listed)}, twice or unknown: " \
        f"{[n for n in listed if listed.count(n) > 1 or n not in TrainConfig.model_fields]}"


def _nested(field) -> type[BaseModel] | None:
    args = typing.get_args(field.annotation) if typing.get_origin(field.annotation) in (Union, types.UnionType) \
        else (field.annotation,)
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def _keys(model: type[BaseModel], prefix: str, values: Any) -> Iterator[tuple[str, Any]]:
    """(dotted key, its default) as a user types it: a nested config's fields dotted, its own key too; the
    default taken from ``values`` (the defaults as a default run resolves them) where it has the key."""
    for name, field in model.model_fields.items():
        key = prefix + name
        value = values.get(name, "unset") if isinstance(values, dict) else "unset"
        if value == "unset":
            value = "required" if field.is_required() else field.get_default(call_default_factory=True)
        yield key, value
        nested = _nested(field)
        if nested is not None:
            yield from _keys(nested, key + ".", value if isinstance(value, dict) else {})


def expected_keys(section: str | None = None) -> dict[str, Any]:
    """Every key of train (or of one section) with the default a run takes when it is not set: a flat key's
    field default; a section's (engine.*, sampling.*, trainer.*, data.*, warm_start.*) its config's, unset where
    the run resolves it (sampling.max_tokens: the task's); loss.* the loss a default run resolves (TrainConfig()'s,
    the default preset's)."""
    resolved = TrainConfig().model_dump()
    out = {}
    for name in (HELP_SECTIONS[section][1] if section else TrainConfig.model_fields):
        field = TrainConfig.model_fields[name]
        if _nested(field) is None:
            out[name] = field.get_default(call_default_factory=True)
        else:
            values = resolved[name] if name == "loss" else field.get_default(call_default_factory=True).model_dump()
            out.update(_keys(_nested(field), name + ".", values))
    return out


NOT_LISTED = object()


def shown_default(text: str, key: str) -> Any:
    """The default the help shows on ``key``'s line (``key=default  type``), as YAML reads it; "required"
    (``key  (required)``), "section" (a nested config's own line, its keys below), NOT_LISTED where no line is
    ``key``'s (a key line is the key at the start, then ``=default`` and two spaces, or two spaces: never
    prose)."""
    m = re.search(rf"^ *{re.escape(key)}(?:=(\S+)(?:  |$)|  (\(required\))|  mapping)", text, re.M)
    if m is None:
        return NOT_LISTED
    return yaml.safe_load(m.group(1)) if m.group(1) is not None else "required" if m.group(2) else "section"


def _same(shown: Any, default: Any) -> bool:
    if isinstance(default, dict) and shown == "section":
        return True
    if isinstance(default, float):
        return float(shown) == default  # YAML 1.1 reads 1e-06 as text; train's float keys take it as a number
    return shown == default


def test_train_help_lists_every_key_with_its_default():
    """``offpolicy train --help`` lists every key — dotted for the nested configs — each with the default a run
    takes where it is not set, written as it would be typed (key=default), plus argparse's own options."""
    result = offpolicy("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "--resume RUN_DIR" in result.stdout and "--no-progress" in result.stdout
    expected = expected_keys()
    assert len(expected) > 100
    shown = {key: shown_default(result.stdout, key) for key in expected}
    assert not [key for key, value in shown.items() if value is NOT_LISTED], "keys not listed"
    wrong = {key: (shown[key], default) for key, default in expected.items() if not _same(shown[key], default)}
    assert not wrong, wrong
    # the loss's defaults are the default preset's (recommended: bypass, clip 0.4), with preset=none's beside
    assert re.search(r"^  loss\.clip_high=0\.4 .*\(preset=none: 0\.2\)$", result.stdout, re.M)
    assert "loss.correction.anchor=rollout" in result.stdout
    for key in ("engine.vllm.max_num_batched_tokens", "loss.clip_low", "loss.correction.weight.high",
                "loss.correction.reject", "data.path", "warm_start.lr"):
        assert key in expected, key
    for rule in ("ratio", "k1 | k2 | k3", "opsm", "binary_kl", "m2", "mult_error", "prob_diff"):
        assert f"- stat: {rule}\n" in result.stdout  # each reject rule, with its fields under it


@pytest.mark.parametrize("section", list(HELP_SECTIONS))
def test_train_help_section_shows_only_that_section(section):
    result = offpolicy("train", "--help", section)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{section} — {HELP_SECTIONS[section][0]}")
    assert "usage:" not in result.stdout
    mine = expected_keys(section)
    listed = {key for key in expected_keys() if shown_default(result.stdout, key) is not NOT_LISTED}
    assert listed == set(mine), (sorted(set(mine) - listed), sorted(listed - set(mine)))


def test_train_help_engine_holds_the_vllm_keys():
    result = offpolicy("train", "--help", "engine")
    assert result.returncode == 0, result.stderr
    assert "engine.vllm.max_num_batched_tokens=null  int > 0 | null" in result.stdout
    assert "engine.gpu_memory_utilization=0.3  float in (0, 1]" in result.stdout
    assert "lr=" not in result.stdout and "loss." not in result.stdout and "sampling." not in result.stdout


@pytest.mark.parametrize("section, hint", [("nope", ""), ("lss", " (did you mean 'loss'?)")])
def test_unknown_help_section_is_one_line_naming_the_sections(section, hint):
    result = offpolicy("train", "--help", section)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"offpolicy train: error: --help {section}: no such section{hint}; the "
                                          f"sections are {', '.join(HELP_SECTIONS)}"]


def test_help_text_is_wrapped_to_the_width_without_trailing_spaces():
    result = offpolicy("train", "--help", "loss")  # not a terminal: the CLI's 120 columns
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 120 and not [line for line in lines if line != line.rstrip()]


def test_train_arguments_parse_as_before():
    """--help is the only new option: a config file, key=value overrides, --resume and --no-progress parse as
    they did; --help alone (no SECTION) is the empty string, absent None."""
    from offpolicy.cli import build_parser

    args = build_parser().parse_args(["train", "cfg.yaml", "steps=3", "loss.kind=cispo", "--no-progress"])
    assert (args.items, args.resume, args.no_progress, args.help) == (["cfg.yaml", "steps=3", "loss.kind=cispo"],
                                                                      None, True, None)
    args = build_parser().parse_args(["train", "--resume", "runs/x", "steps=9"])
    assert (args.items, args.resume, args.help) == (["steps=9"], "runs/x", None)
    assert build_parser().parse_args(["train", "steps=3", "--help"]).help == ""
    assert build_parser().parse_args(["train", "-h", "loss"]).help == "loss"
