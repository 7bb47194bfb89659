"""``offpolicy train --help [SECTION]``: every key ``offpolicy train key=value`` (or a config.yaml) takes, with its
type, default and description, generated from ``TrainConfig`` and the configs it nests — as diagnose's flags are
generated from ``DiagnoseConfig`` — grouped by ``HELP_SECTIONS``. A nested config's fields are dotted keys
(``engine.vllm.max_num_seqs``, ``loss.correction.weight.high``); a list of rules (``loss.correction.reject``) shows each
rule's fields under it, as a mapping of the list is written.

The ``loss`` section's defaults are the default preset's loss (``preset_loss``: what runs when no ``loss.*`` key
is set), with LossConfig's own value beside where ``preset=none`` differs.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from rich.console import Console
from rich.text import Text

from offpolicy.core.config import ConfigError, LossConfig
from offpolicy.train.config import HELP_SECTIONS, TrainConfig, preset_loss

_MISSING = object()  # a default that is not there (a path through a null section, a required field)


@dataclass(frozen=True)
class Key:
    """One key of the help: ``label`` as it is typed (a dotted key, or a rule's field under its list), the
    type in words, the default as YAML writes it (None: required; "": a section, its keys below carry them),
    the description, how deep it nests."""

    label: str
    kind: str
    default: str | None
    doc: str
    depth: int = 0
    typed: bool = True  # key=value on the command line (False: a field of a mapping inside a list)
    note: str = ""  # the default of preset=none, where it differs


def yaml_value(value: Any) -> str:
    """A default as it would be typed: ``null``, ``true``, ``0.0003``, ``[tensorboard]``, ``{}``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value) if str(value) else "''"


def _bounds(metadata: list[Any]) -> str:
    """``gt``/``ge``/``lt``/``le`` constraints in words: `` > 0``, `` in (0, 1]``."""
    low = high = None
    for item in (m for item in metadata for m in (item.metadata if isinstance(item, FieldInfo) else [item])):
        if isinstance(item, annotated_types.Gt):
            low = (">", item.gt)
        elif isinstance(item, annotated_types.Ge):
            low = ("≥", item.ge)
        elif isinstance(item, annotated_types.Lt):
            high = ("<", item.lt)
        elif isinstance(item, annotated_types.Le):
            high = ("≤", item.le)
    if low and high:
        return f" in {'(' if low[0] == '>' else '['}{low[1]:g}, {high[1]:g}{')' if high[0] == '<' else ']'}"
    if low or high:
        sign, value = low or high
        return f" {sign} {value:g}"
    return ""


def _is_model(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _union_args(kind: Any) -> tuple[Any, ...]:
    return typing.get_args(kind) if typing.get_origin(kind) in (Union, types.UnionType) else (kind,)


def _strip_annotated(kind: Any) -> tuple[Any, list[Any]]:
    if typing.get_origin(kind) is typing.Annotated:
        base, *metadata = typing.get_args(kind)
        return base, metadata
    return kind, []


def _tagged(kind: Any) -> tuple[str, list[type[BaseModel]]] | None:
    """A discriminated union of configs (``Annotated[Union[...], Field(discriminator="stat")]``): the tag's
    name and the configs; None for any other type."""
    base, metadata = _strip_annotated(kind)
    tag = next((m.discriminator for m in metadata if isinstance(m, FieldInfo) and m.discriminator), None)
    return None if tag is None else (tag, [m for m in _union_args(base) if _is_model(m)])


def _tag_value(model: type[BaseModel], tag: str) -> str:
    """The values of a tagged config's tag: ``ratio``, ``k1 | k2 | k3``."""
    return " | ".join(str(v) for v in typing.get_args(model.model_fields[tag].annotation))


def type_words(kind: Any, metadata: list[Any] = ()) -> str:
    """A field's type as a user writes its value: ``int > 0 | null``, ``ppo | gspo | …``,
    ``float ≥ 0 | {rule: ess, target} | {rule: quantile, q} | null``, ``list of rules (below)``; ``metadata``
    (the field's bounds) applies to its numbers."""
    kind, inner = _strip_annotated(kind)
    metadata = [*metadata, *inner]
    parts = []
    for arg in _union_args(kind):
        arg, own = _strip_annotated(arg)
        if arg is type(None):
            continue
        tagged = _tagged(typing.Annotated[(arg, *own)] if own else arg)
        if tagged is not None:  # {rule: ess, target} | {rule: quantile, q}
            tag, models = tagged
            parts.extend("{" + ", ".join([f"{tag}: {_tag_value(m, tag)}", *(n for n in m.model_fields if n != tag)])
                         + "}" for m in models)
        elif typing.get_origin(arg) in (Union, types.UnionType):
            parts.append(type_words(arg, own))
        elif typing.get_origin(arg) is Literal:
            parts.append(" | ".join(str(v) for v in typing.get_args(arg)))
        elif _is_model(arg):
            parts.append("mapping")
        elif typing.get_origin(arg) is list:
            (item,) = typing.get_args(arg)
            parts.append("list of rules (below)" if _tagged(item) else f"list of {type_words(item)}")
        elif typing.get_origin(arg) is dict:
            parts.append("mapping")
        elif arg in (int, float):
            parts.append(arg.__name__ + _bounds([*metadata, *own]))
        else:
            parts.append(getattr(arg, "__name__", str(arg)))
    if type(None) in _union_args(kind):
        parts.append("null")
    return " | ".join(parts)


def _field_kind(field: FieldInfo) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return str(extra["metavar"]) if "metavar" in extra else type_words(field.annotation, field.metadata)


def _nested_model(field: FieldInfo) -> type[BaseModel] | None:
    """The config a field holds (``vllm: VLLMConfig``, ``weight: WeightConfig | None``), else None."""
    models = [a for a in _union_args(field.annotation) if _is_model(a)]
    return models[0] if len(models) == 1 else None


def _rules(field: FieldInfo) -> tuple[str, list[type[BaseModel]]] | None:
    """The tag and rule configs of a list-of-rules field (``reject: list[RejectRule]``), else None."""
    kind = _strip_annotated(field.annotation)[0]
    return _tagged(typing.get_args(kind)[0]) if typing.get_origin(kind) is list else None


def _lookup(values: Any, path: list[str]) -> Any:
    for name in path:
        if not isinstance(values, dict) or name not in values:
            return _MISSING
        values = values[name]
    return values


def _default(field: FieldInfo, path: list[str], values: Any) -> Any:
    """The default shown: the value at ``path`` in ``values`` (a section's defaults as they resolve), else the
    field's own; _MISSING where the field is required."""
    value = _lookup(values, path)
    if value is not _MISSING:
        return value
    return _MISSING if field.is_required() else field.get_default(call_default_factory=True)


def model_keys(model: type[BaseModel], prefix: str, values: Any, bare: Any = _MISSING,
               depth: int = 0) -> Iterator[Key]:
    """The keys of ``model`` under ``prefix`` (``loss.``), its nested configs recursively (a key line for the
    config itself, then its fields one level deeper); ``values``: the defaults as they resolve (a dict),
    ``bare``: the preset=none defaults, shown beside where they differ."""
    for name, field in model.model_fields.items():
        key = prefix + name
        path = key.split(".")
        default = _default(field, path, values)
        note = ""
        if bare is not _MISSING:
            other = _lookup(bare, path)
            if other is not _MISSING and other != default and not isinstance(other, dict):
                note = f"preset=none: {yaml_value(other)}"
        nested = _nested_model(field)
        shown = None if default is _MISSING else yaml_value(default)
        if nested is not None and isinstance(default, (dict, BaseModel)):
            shown = ""  # a section: its keys below carry the defaults
        yield Key(key, _field_kind(field), shown, field.description or "", depth, note=note)
        if nested is not None:
            yield from model_keys(nested, key + ".", values, bare, depth + 1)
        rules = _rules(field)
        for rule in rules[1] if rules else ():
            yield from _rule_keys(rule, rules[0], depth + 1)


def _rule_keys(rule: type[BaseModel], tag: str, depth: int) -> Iterator[Key]:
    """One rule of a list: ``- stat: ratio`` (its tag's description), then its other fields."""
    yield Key(f"- {tag}: {_tag_value(rule, tag)}", "", "", rule.model_fields[tag].description or "", depth,
              typed=False)
    for name, field in rule.model_fields.items():
        if name != tag:
            default = None if field.is_required() else yaml_value(field.get_default(call_default_factory=True))
            yield Key(name, _field_kind(field), default, field.description or "", depth + 1, typed=False)


def section_keys(name: str) -> list[Key]:
    """The keys of help section ``name`` (``HELP_SECTIONS``), in order."""
    preset = TrainConfig.model_fields["preset"].default
    loss = {"loss": LossConfig(**preset_loss(preset, {})).model_dump()}  # what runs with no loss.* key set
    bare = {"loss": LossConfig().model_dump()}  # preset=none
    keys: list[Key] = []
    for field_name in HELP_SECTIONS[name][1]:
        field = TrainConfig.model_fields[field_name]
        nested = _nested_model(field)
        if nested is None:
            keys.append(Key(field_name, _field_kind(field), yaml_value(field.get_default(call_default_factory=True)),
                            field.description or ""))
        else:  # a config of its own: its dotted keys
            values = loss if field_name == "loss" else {field_name: field.get_default(call_default_factory=True)
                                                        .model_dump()}
            keys.extend(model_keys(nested, field_name + ".", values, bare if field_name == "loss" else _MISSING))
    return keys


def section_doc(name: str) -> str:
    """What a section is about beyond its title: the nested config's own description (``vllm``: its field's)."""
    fields = [TrainConfig.model_fields[f] for f in HELP_SECTIONS[name][1]]
    nested = [f for f in fields if _nested_model(f) is not None]
    doc = (nested[0].description or "") if len(nested) == 1 else ""
    if name == "loss":
        preset = TrainConfig.model_fields["preset"].default
        doc = (f"Defaults below are preset={preset}'s loss (the default preset); another preset brings its own "
               "(offpolicy presets NAME), and preset=none starts from LossConfig's, shown beside where they differ. "
               "loss.* keys merge into the preset's loss key by key (a list such as reject replaces it).")
    return doc


def _key_line(key: Key) -> Text:
    line = Text()
    line.append(key.label, style="bold cyan" if key.typed else "bold")
    if key.default is None:
        line.append("  (required)", style="yellow")
    elif key.default:
        line.append("=" if key.typed else ": ", style="dim")
        line.append(key.default, style="green")
    if key.kind:
        line.append(f"  {key.kind}", style="dim")
    if key.note:
        line.append(f"  ({key.note})", style="dim")
    return line


def _print_wrapped(console: Console, text: Text, indent: int, hanging: int = 0) -> None:
    """``text`` wrapped to the console's width at ``indent`` columns (its continuation lines ``hanging`` more),
    no trailing spaces."""
    width = max(console.width - indent - hanging, 20)
    for i, line in enumerate(text.wrap(console, width)):
        line.rstrip()
        console.print(Text(" " * (indent + (hanging if i else 0))) + line, no_wrap=True, crop=False,
                      soft_wrap=True)


def print_section(console: Console, name: str) -> None:
    title, _ = HELP_SECTIONS[name]
    console.print(Text.assemble((name, "bold underline"), f" — {title}"))
    if section_doc(name):
        _print_wrapped(console, Text(section_doc(name), style="italic"), 2)
    for key in section_keys(name):
        indent = 2 * key.depth + 2
        _print_wrapped(console, _key_line(key), indent, hanging=4)
        doc = key.doc
        if not key.typed and key.label.startswith("- "):  # a rule: its tag's description, without the tag again
            doc = doc.removeprefix(key.label.split(": ", 1)[1] + ": ")
        if doc:
            _print_wrapped(console, Text(doc), indent + 4)


def print_help(console: Console, section: str | None = None, usage: str | None = None) -> None:
    """Every section (after argparse's ``usage``), or only ``section``.

    Raises:
        ConfigError: an unknown section, naming the sections.
    """
    if section:
        if section not in HELP_SECTIONS:
            close = difflib.get_close_matches(section, list(HELP_SECTIONS), n=1)
            raise ConfigError(f"--help {section}: no such section{f' (did you mean {close[0]!r}?)' if close else ''}; "
                              f"the sections are {', '.join(HELP_SECTIONS)}")
        print_section(console, section)
        return
    if usage:
        print(usage.rstrip())
        print()
    _print_wrapped(console, Text.assemble(("keys", "bold underline"), " — set with key=value on the command line or "
                                          "in CONFIG.yaml (values are YAML: steps=100, log_to=[wandb], "
                                          "loss.clip_high=0.28); one section: offpolicy train --help SECTION "
                                          f"({', '.join(HELP_SECTIONS)})"), 0)
    for name in HELP_SECTIONS:
        console.print()
        print_section(console, name)
