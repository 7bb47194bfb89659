"""Trainer throughput: ``offpolicy train`` against TRL's GRPOTrainer in the same run.

Same warm-started tiny Qwen2 (src/offpolicy/tasks/model.py), same task (reverse), 64 completions
per step (8 prompts × 8), one optimizer step per batch, the same response-length limit. Steps/s
is measured on the steady state: the seconds between consecutive optimizer steps, setup and
the first step (and offpolicy's eval steps) excluded; the table gives the median of ``--runs``.

    nice -n 5 python3 benchmarks/bench_trainer.py --runs 3 --steps 12 --lengths 10 128

TRL (1.16, its ``GRPOTrainer`` with HF generate, fp32) runs when it is installed. On a shared
CPU the numbers are noisy: compare ratios taken in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console

TRAINERS = {
    # the defaults: engine dtype auto (fp32 here), minibatches=1 → π_old forward skipped
    "offpolicy defaults (vllm)": [],
    "offpolicy hf engine": ["engine=hf"],
    "offpolicy async s=1 (vllm)": ["max_staleness=1", "preset=verl:decoupled_token_is"],
    "offpolicy async s=1 (hf)": ["engine=hf", "max_staleness=1", "preset=verl:decoupled_token_is"],
    # the defaults before issue #13: bf16 engine, two optimizer steps per batch, π_old recomputed
    "offpolicy old defaults (vllm)": ["engine_dtype=bf16", "minibatches=2", "recompute_old=true"],
}
STAGES = ["generate", "wait", "score", "pi_old", "train", "sync", "log"]


def offpolicy_run(extra: list[str], steps: int, length: int, out: Path) -> tuple[float, dict[str, float]]:
    from offpolicy.train.config import load_train_config
    from offpolicy.train.logger import read_jsonl
    from offpolicy.train.loop import train

    cfg = load_train_config(None, ["prompts_per_step=8", "group_size=8", f"steps={steps}", f"max_new_tokens={length}",
                                   "eval_every=100000", "eval_problems=16", f"checkpoint_every={steps}",
                                   f"out_dir={out}", *extra])
    train(cfg, console=Console(quiet=True), progress=False)
    rows = read_jsonl(out / "metrics.jsonl")[1:-1]  # first step warms up; the last one evaluates
    per_step = statistics.median(r["step_seconds"] for r in rows)
    stages = {s: statistics.median(r.get(f"time/{s}", 0.0) for r in rows) for s in STAGES}
    return 1.0 / per_step, stages


def trl_run(steps: int, length: int, out: Path) -> tuple[float, dict[str, float]]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from offpolicy.tasks import make_task, problems
    from offpolicy.tasks.tokenizer import load_tokenizer
    from offpolicy.train.config import load_train_config
    from offpolicy.train.warmstart import default_model

    cfg = load_train_config(None, [])
    path = default_model(cfg)
    tokenizer = load_tokenizer(path)
    task = make_task("reverse")
    probs = problems(task, 8 * (steps + 2), seed=123)
    answers = {p.prompt: p for p in probs}
    data = Dataset.from_dict({"prompt": [p.prompt for p in probs]})

    def reward(prompts, completions, **kwargs):
        return [task.reward(answers[p], c) for p, c in zip(prompts, completions)]

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=64, num_generations=8,
                      max_completion_length=length, max_steps=steps, num_iterations=1, beta=0.0, temperature=1.0,
                      learning_rate=3e-4, use_cpu=True, report_to=[], save_strategy="no", logging_steps=steps,
                      seed=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=[Clock()])
    trainer.train()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return 1.0 / statistics.median(gaps), {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 128])
    parser.add_argument("--only", nargs="*", help="trainer names (substrings) to run")
    args = parser.parse_args()
    console = Console()
    try:
        import trl  # noqa: F401

        have_trl = True
    except ImportError:
        have_trl = False
        console.print("[yellow]TRL not installed: no TRL baseline in this run[/yellow]")
    load = os.getloadavg()
    console.print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    names = (["TRL GRPOTrainer (HF generate, fp32)"] if have_trl else []) + list(TRAINERS)
    if args.only:
        names = [n for n in names if any(o in n for o in args.only)]
    for length in args.lengths:
        results: dict[str, list[tuple[float, dict]]] = {n: [] for n in names}
        for run in range(args.runs):
            for name in names:
                with tempfile.TemporaryDirectory() as tmp:
                    if name.startswith("TRL"):
                        results[name].append(trl_run(args.steps, length, Path(tmp) / "trl"))
                    else:
                        results[name].append(offpolicy_run(TRAINERS[name], args.steps, length, Path(tmp) / "run"))
                console.print(f"  length {length} run {run}: {name}: {results[name][-1][0]:.2f} steps/s")
        medians = {n: statistics.median(r[0] for r in results[n]) for n in names}
        base = next((medians[n] for n in names if n.startswith("TRL")), None)
        print(f"\nmax_new_tokens={length}, 64 completions/step, median of {args.runs} runs × {args.steps} steps")
        print("| trainer | steps/s | vs TRL | " + " | ".join(f"{s} ms" for s in STAGES) + " |")
        print("|---|---|---|" + "---|" * len(STAGES))
        for n in names:
            stages = results[n][0][1]
            times = [statistics.median(r[1].get(s, 0.0) for r in results[n]) for s in STAGES] if stages else []
            cells = " | ".join(f"{1e3 * t:.0f}" for t in times) if times else " | ".join("–" for _ in STAGES)
            ratio = f"{medians[n] / base:.2f}×" if base else "–"
            print(f"| {n} | {medians[n]:.2f} | {ratio} | {cells} |")
        sync = {k: medians.get(f"offpolicy {k}") for k in ("defaults (vllm)", "hf engine")}
        asyn = {k: medians.get(f"offpolicy async s=1 ({e})") for k, e in (("defaults (vllm)", "vllm"), ("hf engine", "hf"))}
        for k in sync:
            if sync[k] and asyn[k]:
                print(f"async s=1 vs sync, {k}: {asyn[k] / sync[k]:.2f}×")
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (shared machine: other work ran too)")


if __name__ == "__main__":
    main()
