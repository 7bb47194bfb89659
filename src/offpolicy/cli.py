"""`offpolicy` command line: ``offpolicy train [CONFIG.yaml] [key=value ...]``, ``offpolicy presets [NAME]``.

Each sub-command is a small function taking parsed arguments and returning an exit code;
errors a user can fix are printed as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from offpolicy import presets
from offpolicy.config import ConfigError


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


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from offpolicy.train.config import load_train_config
    from offpolicy.train.loop import train

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
    result = train(cfg, resume=resume, console=console, progress=not args.no_progress)
    return 130 if result.interrupted else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offpolicy",
        description="Measure and correct the rollout–training mismatch in RL for language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    t = sub.add_parser("train", help="GRPO/PPO with a real rollout engine (default: the embedded tiny model)",
                       description="Train with RL from verifiable rewards. With no config: the embedded default "
                       "(tiny Qwen2 on digit reversal, vLLM rollouts, the `recommended` correction).")
    t.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="a YAML config and/or dotted overrides, e.g. steps=100 loss.kind=cispo preset=trl:token_mask")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (logs and summary only)")
    t.set_defaults(func=_cmd_train)
    p = sub.add_parser("presets", help="list the correction presets, or show one")
    p.add_argument("name", nargs="?", help="a preset name, e.g. verl:decoupled_token_is")
    p.set_defaults(func=_cmd_presets)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
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
