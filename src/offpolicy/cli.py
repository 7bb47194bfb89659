"""`offpolicy` command line: ``offpolicy presets [NAME]``.

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offpolicy",
        description="Measure and correct the rollout–training mismatch in RL for language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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


if __name__ == "__main__":
    sys.exit(main())
