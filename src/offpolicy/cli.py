"""`offpolicy` command line: ``offpolicy train [CONFIG.yaml] [key=value ...]``, ``offpolicy diagnose``,
``offpolicy view RUN_DIR``, ``offpolicy presets [NAME]``.

Each sub-command is a small function taking parsed arguments and returning an exit code;
errors a user can fix are printed as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from rich.console import Console
from rich.table import Table
from rich.text import Text

from offpolicy.core import presets
from offpolicy.core.config import ConfigError
from offpolicy.measure.diagnose_config import GROUPS, MOVED_FLAGS, SECTION_FLAGS, DiagnoseConfig
from offpolicy.train.config import HELP_SECTIONS


def _cmd_presets(args: argparse.Namespace, console: Console) -> int:
    if args.name is None:
        table = Table(title="offpolicy presets", show_lines=False)
        table.add_column("preset", style="bold")
        table.add_column("what it does")
        for name in presets.names():
            table.add_row(name, Text(presets.get(name).summary))  # Text: no rich markup in "[a, b]"
        console.print(table)
        console.print("Details: offpolicy presets NAME")
        return 0
    preset = presets.get(args.name)
    loss = preset.loss_config()
    body = {
        "correction": preset.correction_config().to_dict(),
        "loss": {"kind": loss.kind, **{k: v for k, v in loss.to_dict().items() if k not in ("kind", "correction")}},
    }
    console.print(Text(f"{preset.name} — {preset.summary}", style="bold"))
    console.print(Text(preset.note))
    console.print()
    print(yaml.safe_dump(body, sort_keys=False).rstrip())
    return 0


def _quiet_libraries() -> None:
    """transformers draws a progress bar for every checkpoint write and weight load: ours is enough."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from offpolicy.train.config import load_train_config

    if args.help is not None:  # --help [SECTION]: every key, generated from TrainConfig (train/help.py)
        from offpolicy.train.help import print_help

        print_help(console, args.help or None, usage=None if args.help else args.train_parser.format_help())
        return 0
    items = list(args.items)
    config_path = None
    if items and "=" not in items[0]:
        config_path = items.pop(0)
        if not Path(config_path).is_file() and not config_path.endswith((".yaml", ".yml")):
            raise ConfigError(f"{config_path!r} is neither a config file nor a key=value override (e.g. steps=100)")
    resume = None
    if args.resume is not None:
        resume = Path(args.resume)
        if config_path is not None:
            raise ConfigError("--resume reads the run's own config.yaml; pass only key=value overrides (e.g. steps=200)")
        if not (resume / "config.yaml").is_file():
            raise ConfigError(f"--resume {resume}: no config.yaml there; is it an offpolicy run directory?")
        config_path = resume / "config.yaml"
    cfg = load_train_config(config_path, items)
    from offpolicy.train.loop import train  # after the config: a typo is refused before transformers imports (~5 s)

    _quiet_libraries()
    result = train(cfg, resume=resume, console=console, progress=not args.no_progress)
    return 128 + int(result.stop_signal) if result.interrupted else 0  # 130: Ctrl-C, 143: SIGTERM


def _cmd_view(args: argparse.Namespace, console: Console) -> int:
    """``offpolicy view RUN_DIR``: the per-token viewer of a training run's saved samples (``offpolicy.measure.viewer``)."""
    from pathlib import Path

    from offpolicy.measure import viewer
    run_dir = Path(args.run_dir)
    view, notes = viewer.run_view(run_dir)
    for note in notes:
        console.print(Text(f"note: {note}", style="yellow"))
    out = Path(args.out) if args.out else run_dir / "report.html"
    viewer.write_html(out, [view], f"offpolicy run — {run_dir.resolve().name}")
    steps = len({s["step"] for s in view["seqs"]})
    console.print(f"viewer: {out} ({len(view['seqs'])} samples over {steps} steps; open it in a browser)")
    return 0


DIAGNOSE_HEADLINE = ["kl_k1", "kl_k3", "ppl_ratio", "chi2_token", "chi2_seq", "abs_logp_diff_mean",
                     "abs_logp_diff_max", "mult_prob_error", "prob_diff_max", "ess"]


def _cmd_diagnose(args: argparse.Namespace, console: Console) -> int:
    """``offpolicy diagnose``: the flags as a ``DiagnoseConfig`` (every check before transformers and the
    engines import, ~5 s), ``diagnose.run``, then the tables, where the files went, and the gate's verdict."""
    config = DiagnoseConfig(**{k: v for k, v in vars(args).items() if k not in ("func", "command")})
    from offpolicy.measure import diagnose  # after the config: a wrong flag is refused before torch's models load

    _quiet_libraries()
    done = diagnose.run(config, console)
    _print_diagnosis(console, done.reports)
    diagnose.print_checks(console, done.reports)
    console.print(f"viewer: {done.page} (open it in a browser; one file, works offline)")
    for name, place in done.places.items():
        console.print(f"log_to: {name} → {place}")
    console.print(f"report: {done.report_path}  plots: {', '.join(done.plots)}")
    if not config.fail_above and not config.fail_below and not config.require_exact:
        return 0
    failed = diagnose.gate_failures(config, done.reports)
    for line in failed:
        print(f"offpolicy diagnose: {line}", file=sys.stderr)
    if not failed:
        exact = "" if not config.require_exact else "; --require-exact: every log-ratio is 0 on " + ", ".join(
            diagnose.engine_checks.describe((r.get("provenance") or {}).get("engine")) for r in done.reports)
        print(f"offpolicy diagnose: gate passed ({len(config.fail_above or []) + len(config.fail_below or [])} "
              f"bound(s)){exact}", file=sys.stderr)
    return 3 if failed else 0


def _print_diagnosis(console: Console, reports: list[dict]) -> None:
    from offpolicy.measure.diagnose import RATIO_BANDS

    table = Table(title="mismatch: trainer π vs engine μ on the engine's samples")
    table.add_column("metric")
    for r in reports:
        table.add_column(r["setting"]["name"], justify="right")
    for key in DIAGNOSE_HEADLINE:
        table.add_row(key, *(f"{r['mismatch'][key]:.4g}" for r in reports))
    for key in ("log1.1", "log2"):
        table.add_row(f"|log ρ| > {key}", *(f"{r['breakdowns']['fraction_abs_log_ratio_above'][key]:.4f}"
                                             for r in reports))
    for key, (low, high) in RATIO_BANDS.items():
        table.add_row(f"ρ outside [{low:g}, {high:g}]", *(f"{r['breakdowns']['fraction_ratio_outside'][key]:.4f}"
                                                         for r in reports))
    table.add_row("outside trainer's top-k/p", *(f"{r.get('fraction_outside_trainer_support', 0.0):.4f}" for r in reports))
    if any((r.get("kept_set") or {}).get("applied") == "replayed" for r in reports):
        _add_replay_rows(table, reports)
    table.add_row("mass outside top-k/p", *("–" if r.get("outside_mass") is None else f"{r['outside_mass']:.4f}"
                                             for r in reports))
    table.add_row("kl_over_entropy", *(f"{r['summary']['kl_over_entropy']:.4g}" if "kl_over_entropy" in r["summary"]
                                       else "–" for r in reports))
    table.add_row("tokens", *(f"{r['tokens']:.0f}" for r in reports))
    if any(r.get("outside_support_tokens") for r in reports):
        table.add_row("outside top-k/top-p (excluded)", *(f"{r.get('outside_support_tokens', 0):.0f}" for r in reports))
    table.add_row("engine tokens/s", *("–" if r["engine_tokens_per_s"] is None else f"{r['engine_tokens_per_s']:.0f}"
                                       for r in reports))
    console.print(table)
    for r in reports:
        by_prob = Table(title=f"{r['setting']['name']}: where the mismatch lives (token probability under π)")
        for col in ("π(y_t)", "tokens", "share", "mean |log ρ|", "k3", "share of Σ|log ρ|"):
            by_prob.add_column(col, justify="right")
        for row in r["breakdowns"]["by_probability"]:
            by_prob.add_row(row["bucket"], str(row["tokens"]), f"{row['token_share']:.3f}",
                            f"{row['abs_log_ratio_mean']:.4f}", f"{row['kl_k3']:.2e}", f"{row['abs_log_ratio_share']:.3f}")
        console.print(by_prob)
    for r in reports:  # every setting's: a bf16 engine's rejections differ from an fp32 one's (issue #30)
        what_if = Table(title=f"what-if: each preset on this batch — {r['setting']['name']}")
        what_if.add_column("preset", no_wrap=True)
        for col in ("tok rej", "seq rej", "w mean", "w min", "w max", "ESS"):
            what_if.add_column(col, justify="right", no_wrap=True)
        for row in r["what_if"]:
            what_if.add_row(row["preset"], f"{row['token_rejected']:.1%}", f"{row['seq_rejected']:.1%}",
                            f"{row['weight_mean']:.3f}", f"{row['weight_min']:.3f}", f"{row['weight_max']:.3f}",
                            f"{row['ess']:.4f}")
        console.print(what_if)


def _add_replay_rows(table: Table, reports: list[dict]) -> None:
    """The rows the engine's kept set changes, without replay (the trainer's own top-k/top-p set): the
    rows above are with replay wherever the engine recorded its set (issue #46)."""
    from offpolicy.measure.diagnose import RATIO_BANDS

    def without(r: dict) -> dict | None:
        kept = r.get("kept_set") or {}
        return kept.get("without_replay") if kept.get("applied") == "replayed" else None

    table.add_row("kept set", *((r.get("kept_set") or {}).get("applied", "–") for r in reports))
    table.add_row("  without replay: outside trainer's set",
                  *("–" if without(r) is None else f"{without(r)['fraction_outside_trainer_support']:.4f}"
                    for r in reports))
    for key, (low, high) in RATIO_BANDS.items():
        table.add_row(f"  without replay: ρ outside [{low:g}, {high:g}]",
                      *("–" if without(r) is None else f"{without(r)['fraction_ratio_outside'][key]:.4f}"
                        for r in reports))


def add_config_flags(parser: argparse.ArgumentParser, config: type[BaseModel],
                     groups: dict[str, tuple[str, str | None] | None],
                     sections: dict[str, tuple[str, str, FieldInfo]] | None = None,
                     moved: dict[str, str] | None = None) -> None:
    """One ``--flag-name`` per field of ``config``, in its order: the type (``int | None`` → int), a Literal's
    choices, a boolean as a switch (``--x``; ``--x/--no-x`` where unset is None), a list as a repeatable flag,
    the default and the help from the field (its description, then the default where there is one). A field's
    ``json_schema_extra`` may name its ``metavar``, its ``choices`` and its ``group`` in ``groups``: None = the
    group's flags exclude one another, (title, description) = a section of the help. A field that is a section
    (a config of its own) stands for its flags in ``sections`` (name → (dotted key, group, field)): those are
    passed on only when given (argparse's SUPPRESS), so a section's unset field stays unset. ``moved``: old flag
    names → new, each refused with the new name."""
    added: dict[str, Any] = {}

    def group_of(group: str | None):
        if group is None:
            return parser
        if group not in added:
            spec = groups[group]
            added[group] = parser.add_mutually_exclusive_group() if spec is None else parser.add_argument_group(*spec)
        return added[group]

    for name, field in config.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            for flag, (key, group, inner) in (sections or {}).items():
                if key.startswith(name + "."):
                    extra = inner.json_schema_extra if isinstance(inner.json_schema_extra, dict) else {}
                    _, kwargs = config_flag(flag, inner, extra)
                    group_of(group).add_argument("--" + flag.replace("_", "-"), dest=flag,
                                                 **{**kwargs, "default": argparse.SUPPRESS})
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag, kwargs = config_flag(name, field, extra)
        group_of(extra.get("group")).add_argument(flag, **kwargs)
    for old, new in (moved or {}).items():
        parser.add_argument("--" + old.replace("_", "-"), nargs="?", help=argparse.SUPPRESS, default=argparse.SUPPRESS,
                            action=_moved_flag(f"--{new.replace('_', '-')}"))


def _moved_flag(new: str) -> type[argparse.Action]:
    class Moved(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string} has moved: it is {new} now (the sections train shares, issue #68)")
    return Moved


def config_flag(name: str, field: FieldInfo, extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The flag of field ``name`` and ``add_argument``'s keywords for it (``add_config_flags``)."""
    kind = field.annotation
    if get_origin(kind) in (Union, UnionType) and type(None) in get_args(kind):  # X | None: unset = None
        kind = next(a for a in get_args(kind) if a is not type(None))
    if get_origin(kind) is Annotated:  # a rule's type (sampling.MaxTokens): the type it annotates
        kind = get_args(kind)[0]
    default = field.get_default(call_default_factory=True)
    described = (field.description or "").replace("%", "%%")  # argparse %-formats the help
    # the default where one is set (argparse's BooleanOptionalAction adds its own)
    shown = not (default is None or default == [] or kind is bool)
    kwargs: dict[str, Any] = {"default": default, "help": f"{described} (default: {default})".lstrip() if shown
                              else described or None}
    if kind is bool:
        kwargs["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
    elif get_origin(kind) is list:
        kwargs["action"] = "append"
        kind = get_args(kind)[0]
    if get_origin(kind) is Literal:
        kwargs["choices"] = list(get_args(kind))
    elif kind in (int, float):  # a string stays as typed
        kwargs["type"] = kind
    kwargs.update({k: v for k, v in extra.items() if k in ("metavar", "choices")})
    return "--" + name.replace("_", "-"), kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offpolicy",
        description="Measure and correct the rollout–training mismatch in RL for language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    t = sub.add_parser("train", help="GRPO/PPO with a real rollout engine (default: the embedded tiny model)",
                       description="Train with RL from verifiable rewards. With no config: the embedded default "
                       "(tiny Qwen2 on digit reversal, vLLM rollouts, the `recommended` correction).",
                       add_help=False)
    t.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="a YAML config and/or dotted overrides, e.g. steps=100 loss.kind=cispo preset=trl:token_mask")
    t.add_argument("-h", "--help", nargs="?", const="", metavar="SECTION",
                   help="show this help and every key with its type, default and meaning; with SECTION only that "
                   f"section's keys ({', '.join(HELP_SECTIONS)})")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (logs and summary only)")
    t.set_defaults(func=_cmd_train, train_parser=t)
    d = sub.add_parser("diagnose", help="measure an engine's mismatch against the trainer, with a what-if table",
                       description="Sample with an engine, recompute the same tokens with the trainer, and report "
                       "the mismatch, where it lives, and what every preset would do to this batch.")
    add_config_flags(d, DiagnoseConfig, GROUPS, SECTION_FLAGS, MOVED_FLAGS)
    d.set_defaults(func=_cmd_diagnose)
    w = sub.add_parser("view", help="write the per-token mismatch viewer (report.html) of a training run",
                       description="One self-contained HTML page of a run's saved samples (samples.jsonl): tokens "
                       "coloured by log ρ, π/μ/ρ and each preset's verdict on hover, each step's worst first.")
    w.add_argument("run_dir", metavar="RUN_DIR", help="an offpolicy train run directory")
    w.add_argument("--out", metavar="FILE.html", help="where to write it (default RUN_DIR/report.html)")
    w.set_defaults(func=_cmd_view)
    p = sub.add_parser("presets", help="list the correction presets, or show one")
    p.add_argument("name", nargs="?", help="a preset name, e.g. verl:decoupled_token_is")
    p.set_defaults(func=_cmd_presets)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:  # piped or logged: rich would assume 80 columns and squeeze the tables
        console = Console(width=120)
    try:
        return args.func(args, console)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"offpolicy {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a broken engine contract, a missing optional dependency
        print(f"offpolicy {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
