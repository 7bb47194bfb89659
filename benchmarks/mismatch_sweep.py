"""Which correction trains best as the rollout–training mismatch grows?

Same seeds, same task, same loss (PPO, ε = 0.2, token-mean); only the correction changes.
Mismatch is dialled in on the engine side: a bf16 engine copy, additive logit noise N(0, σ²)
on the engine's logits, and staleness (rollouts sampled s policy versions ago).

    python benchmarks/mismatch_sweep.py                       # the table in docs/science.md
    python benchmarks/mismatch_sweep.py --steps 40 --seeds 0 --methods none,token_tis

At real lengths (issue #12) the sweep is staged and resumable, in ``sweep_long.py``; ``--task``
runs it for one task, screen → final → report, with one command:

    python benchmarks/mismatch_sweep.py --task walk            # the long-response table in docs/science.md
    python benchmarks/mismatch_sweep.py --task walk --quick    # CI: < 3 min, asserts runs finish finite

Prints a table (final reward = mean of the last 10 steps, reward AUC = mean reward over all
steps, mismatch KL k3, masked fraction and ESS averaged over steps) and saves
``sweep.json`` and ``sweep.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from offpolicy.train.config import TrainConfig

# method → (correction preset or None for measure-only, extra overrides)
METHODS: dict[str, tuple[str | None, dict]] = {
    "none": (None, {}),
    "token_tis": ("verl:decoupled_token_is", {}),
    "token_mask": ("verl:decoupled_token_icepop", {}),
    "seq_tis": ("verl:decoupled_seq_is", {}),
    "seq_mis": ("verl:decoupled_seq_is_rs", {}),
    "geo_rs": ("verl:decoupled_geo_rs", {}),
    "current": ("slime:current", {"kind": "reinforce", "clip_low": None, "clip_high": None}),
    "bypass": ("verl:bypass_ppo_clip", {}),
    "recommended": ("recommended", {}),
}
CONDITIONS: dict[str, dict] = {  # the engine section's keys (engine.kind hf for all) and the staleness
    "bf16": {"engine": {"dtype": "bf16"}},
    "stale4": {"engine": {"dtype": "bf16"}, "max_staleness": 4},
    "noise0.5": {"engine": {"dtype": "bf16", "logit_noise": 0.5}},
    "noise1.0+stale4": {"engine": {"dtype": "bf16", "logit_noise": 1.0}, "max_staleness": 4},
}


def run_one(method: str, condition: str, seed: int, steps: int, out: Path) -> dict:
    from offpolicy.core import presets
    from offpolicy.core.config import CorrectionConfig
    from offpolicy.train.loop import train  # here, not at the top: --help and argument errors answer at once

    preset, loss_extra = METHODS[method]
    correction = CorrectionConfig() if preset is None else presets.correction(preset)  # none = measure only
    loss = {"kind": "ppo", "clip_low": 0.2, "clip_high": 0.2, "agg": "token-mean",
            "correction": correction.model_dump(), **loss_extra}
    condition_keys = CONDITIONS[condition]
    cfg = TrainConfig(steps=steps, seed=seed, eval_every=steps, preset=None, loss=loss,
                      checkpoint_every=steps, out_dir=str(out / f"{condition}-{method}-s{seed}"),
                      **{**condition_keys, "engine": {"kind": "hf", **condition_keys["engine"]}})
    start = time.perf_counter()
    result = train(cfg, progress=False, console=Console(quiet=True))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]

    def mean(key: str, part=slice(None)) -> float:
        values = [r[key] for r in rows[part] if r.get(key) is not None]
        return statistics.fmean(values) if values else math.nan

    return {
        "method": method, "condition": condition, "seed": seed,
        "final_reward": mean("reward", slice(-10, None)), "reward_auc": mean("reward"),
        "kl_k3": mean("offpolicy/kl_k3"), "masked_fraction": mean("offpolicy/masked_fraction"),
        "ess": mean("offpolicy/ess"), "eval_accuracy": rows[-1].get("eval/accuracy"),
        "rewards": [r["reward"] for r in rows], "seconds": time.perf_counter() - start,
    }


def long_sweep(argv: list[str]) -> bool:
    """``--task T [--quick] [sweep_long options]``: the staged sweep of ``sweep_long.py`` for task T
    (screen, final with its finalists, report); returns False when ``--task`` is absent."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--task")
    parser.add_argument("--quick", action="store_true")
    known, rest = parser.parse_known_args(argv)
    if known.task is None:
        if known.quick:
            raise SystemExit("--quick needs --task (e.g. --task walk --quick)")
        return False
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sweep_long

    stage = ["--quick"] if known.quick else ["--stage", "all", "--markdown"]
    sweep_long.main([*stage, "--tasks", known.task, *rest])
    return True


def main() -> None:
    if long_sweep(sys.argv[1:]):
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--out", default="runs/sweep")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    results = []
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(c, m, s) for c in args.conditions.split(",") for m in args.methods.split(",") for s in seeds]
    for i, (condition, method, seed) in enumerate(jobs, 1):
        r = run_one(method, condition, seed, args.steps, out)
        results.append(r)
        console.print(f"[{i}/{len(jobs)}] {condition:16s} {method:12s} seed {seed}: final {r['final_reward']:.3f} "
                      f"auc {r['reward_auc']:.3f} kl {r['kl_k3']:.2e} masked {r['masked_fraction']:.3f} "
                      f"({r['seconds']:.0f}s)")
        (out / "sweep.json").write_text(json.dumps(results, indent=1))
    table = Table(title=f"mismatch sweep — {args.steps} steps, seeds {args.seeds}, HF engine, PPO ε=0.2")
    for col in ("condition", "method", "final reward", "reward AUC", "mismatch KL k3", "masked frac", "ESS"):
        table.add_column(col, justify="left" if col in ("condition", "method") else "right")
    for condition in args.conditions.split(","):
        for method in args.methods.split(","):
            rs = [r for r in results if r["method"] == method and r["condition"] == condition]
            avg = {k: statistics.fmean(r[k] for r in rs) for k in ("final_reward", "reward_auc", "kl_k3",
                                                                      "masked_fraction", "ess")}
            table.add_row(condition, method, f"{avg['final_reward']:.3f}", f"{avg['reward_auc']:.3f}",
                          f"{avg['kl_k3']:.2e}", f"{avg['masked_fraction']:.3f}", f"{avg['ess']:.3f}")
    console.print(table)
    plot(results, args.conditions.split(","), args.methods.split(","), out / "sweep.png")
    console.print(f"saved {out / 'sweep.json'} and {out / 'sweep.png'}")


def plot(results: list[dict], conditions: list[str], methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(conditions), figsize=(5 * len(conditions), 4), sharey=True, constrained_layout=True)
    axes = [axes] if len(conditions) == 1 else axes
    for ax, condition in zip(axes, conditions):
        for method in methods:
            curves = [r["rewards"] for r in results if r["method"] == method and r["condition"] == condition]
            if not curves:
                continue
            mean = [statistics.fmean(v) for v in zip(*curves)]
            smooth = [statistics.fmean(mean[max(0, i - 4): i + 1]) for i in range(len(mean))]
            ax.plot(smooth, label=method, lw=1.5)
        ax.set_title(condition)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward (5-step moving average)")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
