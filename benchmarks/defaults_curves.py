"""Do the trainer defaults of issue #13 change what is learned? Reward curves before and after.

``before``: the defaults before issue #13 — two optimizer steps per batch (``minibatches=2``) and
π_old recomputed by a forward every step (``recompute_old=true``). ``after``: today's defaults
(one step per batch, π_old = sg(π_θ) without a forward). The engine dtype is the same for both
(``--engine-dtype``, default bf16: the mismatch the default correction works against). Same
seeds, same task, the full default run (150 steps).

    python benchmarks/defaults_curves.py                       # seeds 0 1, docs/defaults_curves.png
    python benchmarks/defaults_curves.py --seeds 0 --steps 60 --out /tmp/curves

Prints, per setting: final reward (mean of the last 10 steps) and greedy eval accuracy as
mean ± std over seeds, steps/s, and the mean time per stage — the per-stage breakdown before
and after.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

SETTINGS = {
    "before (minibatches=2, π_old forward)": ["minibatches=2", "recompute_old=true"],
    "after (defaults)": [],
}
STAGES = ["generate", "wait", "score", "pi_old", "train", "sync", "log"]


def run(extra: list[str], seed: int, steps: int, dtype: str, out: Path) -> list[dict]:
    """One ``offpolicy train`` in its own process (each run gets a fresh engine), as a user types it."""
    from offpolicy.train.logger import read_jsonl

    cmd = [sys.executable, "-m", "offpolicy", "train", f"seed={seed}", f"steps={steps}", f"engine.dtype={dtype}",
           f"out_dir={out}", *extra, "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    records = read_jsonl(out / "metrics.jsonl")
    if done.returncode != 0 or not records:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return records


def _pm(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--engine-dtype", default="bf16", choices=["bf16", "fp16", "fp32", "auto"])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    console = Console(width=160)  # the table is wide; a pipe would squeeze it to 80 columns
    rows: dict[str, list[list[dict]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, extra in SETTINGS.items():
                records = run(extra, seed, args.steps, args.engine_dtype, Path(tmp) / f"{seed}-{list(SETTINGS).index(name)}")
                rows[name].append(records)
                console.print(f"seed {seed} {name}: final reward {statistics.fmean(r['reward'] for r in records[-10:]):.3f}")

    table = Table(title=f"{args.steps} steps, engine {args.engine_dtype}, seeds {args.seeds}")
    for col in ["setting", "final reward", "eval accuracy", "steps/s", *[f"{s} ms" for s in STAGES]]:
        table.add_column(col, justify="left" if col == "setting" else "right")
    for name, runs in rows.items():
        final = [statistics.fmean(r["reward"] for r in records[-10:]) for records in runs]
        acc = [records[-1]["eval/accuracy"] for records in runs if records[-1].get("eval/accuracy") is not None]
        steady = [r for records in runs for r in records[1:]]  # the first step warms up
        per_step = statistics.fmean(r["step_seconds"] for r in steady)
        stages = [f"{1e3 * statistics.fmean(r.get(f'time/{s}', 0.0) for r in steady):.0f}" for s in STAGES]
        table.add_row(name, _pm(final), _pm(acc), f"{1 / per_step:.2f}", *stages)
    console.print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, runs), color in zip(rows.items(), ["tab:gray", "tab:blue"]):
        for i, records in enumerate(runs):
            rewards = [r["reward"] for r in records]
            smooth = [statistics.fmean(rewards[max(0, j - 9): j + 1]) for j in range(len(rewards))]
            ax.plot(smooth, color=color, alpha=0.8, linestyle="-" if i == 0 else "--",
                    label=f"{name}, seed {args.seeds[i]}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (mean of the last 10 steps)")
    ax.set_title("trainer defaults before and after issue #13")
    ax.legend(fontsize=7)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "defaults_curves.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    console.print(f"plot: {path}")


if __name__ == "__main__":
    main()
