"""Does the correction keep real-model RL on track? GRPO on SmolLM2-135M-Instruct (issue #42).

The grid, on ``task=larger`` (a task the untrained model half-solves, src/offpolicy/tasks/larger.py):

    reference          fp32 engine, synchronous, no correction: the no-mismatch reference
    bf16_s{0,4}_METHOD bf16 engine at max_staleness 0 and 4, METHOD one of
                       none (no correction: what a framework without the fix does), recommended,
                       token_tis (verl:decoupled_token_is), seq_mask (trl:sequence_mask, TRL's default),
                       icepop (verl:decoupled_token_icepop)

each over ``--seeds``. Every run is ``python -m offpolicy train`` in its own process (one torch thread)
and its own directory ``OUT/CELL/seedN``; ``--jobs N`` runs N at once. A finished run (its
``metrics.jsonl`` holds the last step) is skipped, a cut one (checkpoints, not finished) is resumed with
``--resume``, one without a checkpoint starts again. Then one table and plots from the run directories:

    python benchmarks/science_real.py --pilot --jobs 2                   # reference, bf16_s4_none, bf16_s4_recommended × 3 seeds
    python benchmarks/science_real.py --cells all --jobs 8               # the whole grid (a many-core machine)
    python benchmarks/science_real.py --report --json docs/science_real.json --plot docs/science_real.png

Table columns (mean ± std over the seeds that finished):

* ``final held-out``: ``eval/accuracy`` at the last step — the mean reward of greedy answers to the
  task's held-out pairs (the same pairs for every seed); ``start``: the untrained model's, measured once
  (``untrained_held_out``; a run's own step-0 eval comes after its first update).
* ``share of ref``: the cell's mean final held-out reward / the reference's.
* ``mismatch k3``: the run's mean over steps of ``offpolicy/kl_k3``, the k3 KL between the trainer's
  π at the start of the step and the engine's μ on the step's tokens (bf16 numerics + staleness).
* ``update k3``: the median over steps of ``policy/kl_k3_update`` (mean over seeds), KL(π_v ‖ π_{v+1}) of
  one optimizer step on 8 rows of the batch (``policy_kl_rows``; a skipped update is 0), and its largest
  value over the cell's runs: how far the policy moves per version, so 4 versions of staleness are
  roughly 4 of these steps apart.
* ``collapse``: how many seeds collapsed, by the rule ``COLLAPSE_RULE`` (a failed run counts as collapsed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = {  # method → preset (the whole preset: loss kind, clip, aggregation, correction)
    "none": "none",  # with loss.correction={}: measured, not corrected (CorrectionConfig() weights every token 1)
    "recommended": "recommended",
    "token_tis": "verl:decoupled_token_is",
    "seq_mask": "trl:sequence_mask",
    "icepop": "verl:decoupled_token_icepop",
}
PILOT = ("reference", "bf16_s4_none", "bf16_s4_recommended")
COLLAPSE_DROP = 0.05
COLLAPSE_RULE = (f"final held-out reward more than {COLLAPSE_DROP} below the untrained model's held-out reward, "
                 "or the run did not finish / logged a non-finite metric")
# the run settings, chosen so that the reference learns within the run on a 2-core CPU (docs/science.md)
RUN = {"task": "larger", "prompts_per_step": 4, "group_size": 8, "lr": 3e-5, "steps": 20, "temperature": 0.7,
       "eval_every": 5, "eval_problems": 32, "micro_batch_tokens": 4096, "policy_kl_rows": 8,
       "checkpoint_every": 5, "samples_per_step": 0}


@dataclass(frozen=True)
class Cell:
    name: str
    engine_dtype: str
    staleness: int
    preset: str


def all_cells() -> dict[str, Cell]:
    cells = {"reference": Cell("reference", "fp32", 0, "none")}
    for staleness in (0, 4):
        for method, preset in METHODS.items():
            name = f"bf16_s{staleness}_{method}"
            cells[name] = Cell(name, "bf16", staleness, preset)
    return cells


def run_overrides(cell: Cell, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The ``key=value`` overrides of one run: ``RUN`` with the command line's values, the cell, the seed."""
    settings = {**RUN, "steps": args.steps, "lr": args.lr, "prompts_per_step": args.prompts_per_step,
                "group_size": args.group_size, "eval_problems": args.eval_problems, "eval_every": args.eval_every,
                "max_new_tokens": args.max_new_tokens, "model": args.model, "engine": args.engine,
                "engine_dtype": cell.engine_dtype, "max_staleness": cell.staleness, "preset": cell.preset,
                "seed": seed, "out_dir": str(run_dir), "device": args.device,
                "trainer_dtype": "fp32"}  # the trainer in fp32 everywhere: the mismatch is the engine's alone
    extra = list(args.set)
    if cell.preset == "none":  # an empty correction measures the mismatch (offpolicy/kl_k3 …) and changes no weight
        extra.append("loss.correction={}")
    return [f"{k}={v}" for k, v in settings.items() if v is not None] + extra


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    from offpolicy.train.logger import read_jsonl

    rows = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):  # a run cut mid-write leaves a torn last line
        rows[row["step"]] = row  # a resumed run rewrites the steps past its checkpoint: the last wins
    return [rows[k] for k in sorted(rows)]


def finished(run_dir: Path, steps: int) -> bool:
    rows = read_metrics(run_dir)
    return bool(rows) and rows[-1]["step"] >= steps - 1 and "eval/accuracy" in rows[-1]


def command(cell: Cell, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """Resume a cut run (it has a checkpoint), else start it afresh (a directory without one is removed)."""
    base = [sys.executable, "-m", "offpolicy", "train", "--no-progress"]
    if (run_dir / "checkpoints" / "latest").exists():
        return [*base, "--resume", str(run_dir), f"steps={args.steps}"]  # --steps may have grown since
    shutil.rmtree(run_dir, ignore_errors=True)
    return [*base, *run_overrides(cell, seed, args, run_dir)]


def run_env() -> dict[str, str]:
    """One torch/OpenMP thread per run (``--jobs`` of them share the cores); vLLM's CPU backend must not
    pin its threads to cores another run uses; workers sleep instead of spinning (docs/gpu-and-real-data.md)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
                "MALLOC_ARENA_MAX": "2"})  # fewer malloc arenas: less resident memory per run
    return env


def run_grid(cells: list[Cell], seeds: list[int], args: argparse.Namespace) -> list[str]:
    """Run every (cell, seed) not yet finished, ``args.jobs`` at a time; returns the runs that failed."""
    # seed-major: a grid cut short still has every cell at its first seeds
    todo = [(c, s) for s in seeds for c in cells if not finished(args.out / c.name / f"seed{s}", args.steps)]
    print(f"{len(cells) * len(seeds) - len(todo)} runs finished already, {len(todo)} to run, {args.jobs} at once",
          flush=True)
    running: list[tuple[subprocess.Popen, str, float, Any]] = []
    failed = []
    while todo or running:
        while todo and len(running) < args.jobs:
            cell, seed = todo.pop(0)
            run_dir = args.out / cell.name / f"seed{seed}"
            cmd = command(cell, seed, args, run_dir)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            log = open(args.out / cell.name / f"seed{seed}.log", "a")
            print(f"start {cell.name} seed {seed}{' (resume)' if '--resume' in cmd else ''}", flush=True)
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env()),
                            f"{cell.name}/seed{seed}", time.time(), log))
        time.sleep(1.0)
        for item in list(running):
            proc, name, start, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            ok = proc.returncode == 0
            print(f"{'done' if ok else 'FAILED'} {name} in {time.time() - start:.0f} s (exit {proc.returncode})",
                  flush=True)
            if not ok:
                failed.append(name)
    return failed


def run_stats(rows: list[dict[str, Any]], steps: int, start: float | None) -> dict[str, Any]:
    """One run's numbers from its metrics rows: final held-out reward (``start``: the untrained model's,
    ``untrained_held_out``), mean mismatch and update KL, whether it finished and whether it collapsed
    (``COLLAPSE_RULE``)."""
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    done = bool(rows) and rows[-1]["step"] >= steps - 1 and bool(evals) and evals[-1][0] == rows[-1]["step"]
    finite = all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, (int, float)))

    def mean_of(key: str) -> float | None:
        values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        return statistics.fmean(values) if values else None

    def median_of(key: str) -> float | None:  # one blown-up update (k3 ≫ 1) would set a mean
        values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        return statistics.median(values) if values else None

    final = evals[-1][1] if done else None
    collapsed = (not done or not finite or (start is not None and final < start - COLLAPSE_DROP))
    return {"done": done, "steps": len(rows), "start": start, "final": final, "collapsed": collapsed,
            "mismatch_k3": mean_of("offpolicy/kl_k3"), "update_k3": median_of("policy/kl_k3_update"),
            "update_k3_max": max((r["policy/kl_k3_update"] for r in rows if "policy/kl_k3_update" in r), default=None),
            "reward_curve": [r["reward"] for r in rows], "eval_curve": evals,
            "mismatch_curve": [r.get("offpolicy/kl_k3") for r in rows]}


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cell: final and start held-out reward (mean, std over seeds), its share of the reference's
    mean final, mismatch and update k3, collapses; the runs that did not finish are counted, not averaged."""
    ref_mean, _ = _mean_std([r["final"] for r in runs.get("reference", {}).values() if r["done"]])
    table = []
    for cell, seeds in runs.items():
        done = [r for r in seeds.values() if r["done"]]
        final, final_sd = _mean_std([r["final"] for r in done])
        start, _ = _mean_std([r["start"] for r in done])
        table.append({
            "cell": cell, "seeds": sorted(seeds), "finished": len(done), "final": final, "final_std": final_sd,
            "start": start, "share_of_reference": (final / ref_mean) if final is not None and ref_mean else None,
            "mismatch_k3": _mean_std([r["mismatch_k3"] for r in done])[0],
            "update_k3": _mean_std([r["update_k3"] for r in done])[0],
            "update_k3_max": max((r["update_k3_max"] for r in done if r["update_k3_max"] is not None), default=None),
            "collapsed": sum(r["collapsed"] for r in seeds.values()), "runs": len(seeds)})
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| cell | seeds done | held-out reward: start → final (± std) | share of ref | mismatch k3 | "
             "update k3: median (max) | collapsed |", "|---|---:|---|---:|---:|---:|---:|"]
    for row in table:
        lines.append(f"| {row['cell']} | {row['finished']}/{row['runs']} | {_fmt(row['start'], '.3f')} → "
                     f"{_fmt(row['final'], '.3f')} ± {_fmt(row['final_std'], '.3f')} | "
                     f"{_fmt(row['share_of_reference'] and 100 * row['share_of_reference'], '.0f')} % | "
                     f"{_fmt(row['mismatch_k3'], '.1e')} | {_fmt(row['update_k3'], '.1e')} "
                     f"({_fmt(row['update_k3_max'], '.1e')}) | "
                     f"{row['collapsed']}/{row['runs']} |")
    return "\n".join(lines)


def collect(out: Path, cells: list[str], seeds: list[int] | None, steps: int,
            start: float | None = None) -> dict[str, dict[int, dict[str, Any]]]:
    """Every run directory under ``out`` of the named cells (and seeds, when given); ``start``: the
    untrained model's held-out reward."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for cell in cells:
        for run_dir in sorted((out / cell).glob("seed*")):
            if not run_dir.is_dir():
                continue
            seed = int(run_dir.name[4:])
            if seeds is None or seed in seeds:
                runs.setdefault(cell, {})[seed] = run_stats(read_metrics(run_dir), steps, start)
    return runs


def plot(runs: dict[str, dict[int, dict[str, Any]]], path: Path, start: float | None = None) -> None:
    """Three panels against the step, one line per cell (mean over its seeds): training reward,
    held-out reward (``start``, the untrained model's, dashed), mismatch k3 (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    methods = list(METHODS)
    for cell, seeds in runs.items():
        # colour by correction (the reference black), line by staleness: 11 cells stay apart
        method = cell.split("_", 2)[-1] if cell.startswith("bf16_s") else None
        color = f"C{methods.index(method)}" if method in methods else "black"
        style = {"linestyle": "--" if cell.startswith("bf16_s4") else "-"}
        curves = [r["reward_curve"] for r in seeds.values() if r["reward_curve"]]
        if curves:  # each step over the seeds that reached it
            n = max(map(len, curves))
            axes[0].plot(range(n), [statistics.fmean(c[t] for c in curves if len(c) > t) for t in range(n)],
                         color=color, label=cell, **style)
        evals: dict[int, list[float]] = {}
        for r in seeds.values():
            for step, value in r["eval_curve"]:
                evals.setdefault(step, []).append(value)
        steps = sorted(evals)
        axes[1].plot(steps, [statistics.fmean(evals[s]) for s in steps], "o", color=color, label=cell, **style)
        mism = [r["mismatch_curve"] for r in seeds.values() if r["mismatch_curve"]]
        if mism:
            n = max(map(len, mism))
            at = [[c[t] for c in mism if len(c) > t and c[t] is not None and c[t] > 0] for t in range(n)]
            axes[2].semilogy(range(n), [statistics.fmean(v) if v else float("nan") for v in at], color=color,
                             label=cell, **style)
    if start is not None:
        axes[1].axhline(start, color="grey", linestyle=":", label="untrained model")
    axes[0].set(title="training reward (mean over seeds)", xlabel="step")
    axes[1].set(title="held-out reward, greedy (mean over seeds)", xlabel="step")
    axes[2].set(title="mismatch KL k3 (π at step start vs μ)", xlabel="step")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def untrained_held_out(args: argparse.Namespace) -> float:
    """The untrained model's held-out reward as the runs' ``eval/accuracy`` measures it (greedy, the first
    ``--eval-problems`` held-out pairs, the fp32 trainer's weights): every run's start, before any update
    (a run's own step-0 eval comes after its first update). Cached in ``OUT/untrained.json``."""
    cache = args.out / "untrained.json"
    key = f"{Path(args.model).resolve()}|{args.eval_problems}|{args.max_new_tokens}"
    if cache.is_file() and json.loads(cache.read_text()).get("key") == key:
        return json.loads(cache.read_text())["held_out_greedy"]
    import torch

    from offpolicy.policy.score import load_policy
    from offpolicy.policy.warmstart import exact_match_accuracy
    from offpolicy.tasks import ChatRendered, make_task
    from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    ensure_pad_token(tokenizer)
    task = ChatRendered.of(make_task("larger"), tokenizer)
    policy = load_policy(args.model, torch.device("cpu"))
    value = exact_match_accuracy(policy, tokenizer, task, list(task.held_out[: args.eval_problems]),
                                 args.max_new_tokens or task.max_new_tokens, sample_seed=None, score=task.reward)
    args.out.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "held_out_greedy": value}))
    return value


def untrained(args: argparse.Namespace, prompts: int) -> dict[str, float]:
    """The untrained model on ``task=larger``: ``prompts`` training prompts × ``--group-size`` samples from the
    engine in fp32 at the run's temperature; mean reward and the share of groups whose rewards differ."""
    import torch

    from offpolicy.engines import SamplingConfig, make_engine
    from offpolicy.tasks import ChatRendered, make_task, problems
    from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer
    from offpolicy.train.loop import groups_with_spread

    tokenizer = load_tokenizer(args.model)
    ensure_pad_token(tokenizer)
    task = ChatRendered.of(make_task("larger"), tokenizer)
    rows = [p for p in problems(task, prompts, seed=12_345) for _ in range(args.group_size)]
    engine = make_engine(args.engine, args.model, tokenizer, "fp32", seed=0, max_model_len=1024,
                         log_path=args.out / "untrained-engine.log")
    try:
        sampling = SamplingConfig(max_tokens=args.max_new_tokens or task.max_new_tokens, temperature=RUN["temperature"])
        out = engine.generate([list(p.prompt_ids) for p in rows], sampling, seed=0, version=0)
    finally:
        engine.close()
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    rewards = torch.tensor([task.reward(p, t) for p, t in zip(rows, texts)])
    return {"held_out_greedy": untrained_held_out(args), "samples": len(rows), "mean_reward": rewards.mean().item(),
            "groups_with_spread": groups_with_spread(rewards, args.group_size),
            "reward_1": (rewards == 1).float().mean().item(), "reward_0.5": (rewards == 0.5).float().mean().item()}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/science_real"))
    p.add_argument("--cells", default=None, help=f"comma-separated cell names, or 'all' ({', '.join(all_cells())})")
    p.add_argument("--pilot", action="store_true", help=f"the pilot cells: {', '.join(PILOT)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    p.add_argument("--model", default=None, help="model directory; default: SmolLM2-135M-Instruct as "
                   "scripts/smollm2.py builds it")
    p.add_argument("--engine", default="hf", choices=("vllm", "hf"), help="hf (default): ~1.5 GB less resident "
                   "memory a run than in-process vLLM on the CPU, which let two runs fit beside other jobs")
    p.add_argument("--device", default="cpu", help="the trainer's and the hf engine's device (cpu, cuda, "
                   "cuda:N); the trainer stays fp32 on every device")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more train override for every run (repeatable), e.g. --set eval_problems=64")
    p.add_argument("--steps", type=int, default=RUN["steps"])
    p.add_argument("--lr", type=float, default=RUN["lr"])
    p.add_argument("--prompts-per-step", type=int, default=RUN["prompts_per_step"])
    p.add_argument("--group-size", type=int, default=RUN["group_size"])
    p.add_argument("--eval-problems", type=int, default=RUN["eval_problems"])
    p.add_argument("--eval-every", type=int, default=RUN["eval_every"])
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's (16)")
    p.add_argument("--untrained", type=int, default=0, metavar="PROMPTS", help="only measure the untrained "
                   "model: PROMPTS prompts × --group-size samples (fp32 engine), mean reward and groups with spread")
    p.add_argument("--report", action="store_true", help="only the table and plots from the run directories")
    p.add_argument("--json", type=Path, default=None, help="write the table and per-run numbers here")
    p.add_argument("--plot", type=Path, default=None, help="write the plots here (default OUT/science_real.png)")
    args = p.parse_args(argv)
    names = PILOT if args.pilot else tuple(all_cells()) if args.cells in (None, "all") else \
        tuple(c.strip() for c in args.cells.split(","))
    unknown = [n for n in names if n not in all_cells()]
    if unknown:
        p.error(f"--cells: unknown {', '.join(unknown)}; cells are {', '.join(all_cells())}")
    args.cell_names = names
    args.seed_list = [int(s) for s in args.seeds.split(",")]
    if args.model is None:
        script = Path(__file__).resolve().parents[1] / "scripts" / "smollm2.py"
        args.model = subprocess.run([sys.executable, str(script), "--print-path"], check=True, capture_output=True,
                                    text=True).stdout.strip()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.untrained:
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(untrained(args, args.untrained)))
        return 0
    failed = []
    if not args.report:
        cells = [all_cells()[n] for n in args.cell_names]
        failed = run_grid(cells, args.seed_list, args)
    start = untrained_held_out(args)
    print(f"untrained model, held-out reward (greedy, {args.eval_problems} pairs): {start:.3f}")
    runs = collect(args.out, list(args.cell_names), args.seed_list, args.steps, start)
    table = summarize(runs)
    print(markdown(table))
    print(f"collapse: {COLLAPSE_RULE}")
    plot(runs, args.plot or args.out / "science_real.png", start)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        per_run = {c: {str(s): {k: v for k, v in r.items()} for s, r in seeds.items()} for c, seeds in runs.items()}
        args.json.write_text(json.dumps({"settings": {**RUN, "steps": args.steps, "lr": args.lr,
                                                      "prompts_per_step": args.prompts_per_step,
                                                      "group_size": args.group_size, "engine": args.engine,
                                                      "eval_problems": args.eval_problems},
                                         "untrained_held_out": start, "collapse_rule": COLLAPSE_RULE,
                                         "table": table, "runs": per_run}, indent=1))
    if failed:
        print(f"failed runs: {', '.join(failed)} (their logs: OUT/CELL/seedN.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
