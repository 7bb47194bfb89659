"""Trainer throughput: ``offpolicy train`` against TRL's GRPOTrainer in the same run.

Same model, same task, the same completions per step, one optimizer step per batch, the same
response-length limit and sampling (temperature 1, no top-k/top-p). For each trainer: steps/s on the steady state
(the seconds between the ends of consecutive steps — TRL's ``on_step_end``, offpolicy's logger call, so
the logger's own write is counted; setup, the first step and offpolicy's eval step excluded), response tokens/s (generated tokens per second of step), and peak memory (CUDA: peak
allocated GPU memory; CPU: the process's peak RSS). The table gives the median of ``--runs``.

Every measurement runs in its own process (``--worker``), so thread settings, vLLM's process-wide
patches and peak memory do not leak from one trainer into the next; the trainers of one run go
back to back, in alternating order from run to run (paired runs on a shared machine).

    python3 benchmarks/bench_trainer.py --device cpu --threads default 1 --runs 5 --steps 12 --lengths 10
    python3 benchmarks/bench_trainer.py --device cuda --models embedded qwen2-0.5b --lengths 128
    python3 benchmarks/bench_trainer.py --device cpu --models smollm2 --lengths 64 --runs 3 --steps 6
    python3 benchmarks/bench_trainer.py --device cpu --profile --steps 22    # where a step goes, by function
    python3 benchmarks/bench_trainer.py --device cpu --only TRL defaults --baseline-src ../main/src   # before/after

Trainers: offpolicy's defaults (``engine=auto``: the hf engine for the embedded model on the CPU, vLLM for
the others; ``offpolicy.engines.choice``); ``offpolicy torch linear``, the defaults with ``cpu_linear=torch``
(torch's ``F.linear`` instead of oneDNN's); each engine by name; an async run. ``--baseline-src DIR`` runs
the offpolicy ones again with ``PYTHONPATH=DIR`` (another checkout's ``src/``): before/after, paired.

``--models``: ``embedded`` (the warm-started tiny Qwen2 of src/offpolicy/tasks/model.py) and
``qwen2-0.5b`` (Qwen2-0.5B's shapes — 24 layers, width 896, 14 heads / 2 KV heads, MLP 4864,
vocabulary 151,936, tied embeddings — initialised in code, no download; random weights, so every
response runs to the length limit) on the reverse task, 8 prompts × 8; ``smollm2``: SmolLM2-135M-Instruct
(a real pretrained chat model, built once by ``python scripts/smollm2.py``) on the shipped word problems
(examples/data/arith_word_problems.jsonl, chat template, reward ``number``) at ``task=dataset``'s defaults:
4 prompts × 8, lr 1e-6. ``--threads default`` leaves OMP_NUM_THREADS unset: torch then
uses one thread per core, what a user gets. TRL (1.16's ``GRPOTrainer``, HF generate) runs in the
trainer dtype offpolicy resolves (fp32 on CPU, bf16 on CUDA): GRPOConfig's own default is bf16 even
on a CPU. TRL runs without gradient checkpointing (GRPOConfig turns it on by default; offpolicy's default
is off), so both do the same work per step.

Where the time goes: offpolicy logs ``time/<stage>`` per step (generate, score, π_old, samples, train,
sync, log); TRL's own ``profiling_context`` timings (``transformers.generate``, ``_calculate_rewards``,
``_get_per_token_logps_and_entropies``, ``compute_loss``, …), which it sends only to W&B/MLflow/Trackio,
are collected in the worker, and the rest of TRL's step (backward + optimizer step) is the step's time
minus its ``_prepare_inputs`` and ``compute_loss``. On a shared CPU the numbers are noisy: compare ratios
taken in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, GROUP = 8, 8
# per model: prompts a step, learning rate (smollm2: a pretrained model's defaults, PRETRAINED_DEFAULTS)
SETTINGS = {"embedded": (PROMPTS, 3e-4), "qwen2-0.5b": (PROMPTS, 3e-4), "smollm2": (4, 1e-6)}
DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "arith_word_problems.jsonl"
TRAINERS = {
    # the defaults: engine auto (the embedded model on the CPU: hf; offpolicy.engines.choice), engine dtype auto
    # (fp32 on a CPU without bf16), π_old forward skipped
    "offpolicy defaults": [],
    "offpolicy torch linear": ["trainer.cpu_linear=torch"],  # the defaults with torch's own F.linear in the trainer
    "offpolicy vllm engine": ["engine=vllm"],
    "offpolicy hf engine": ["engine=hf"],
    "offpolicy async s=1 (hf)": ["engine=hf", "max_staleness=1", "preset=verl:decoupled_token_is"],
}
TRL = "TRL GRPOTrainer (HF generate)"
PROFILE = bool(os.environ.get("BENCH_TRAINER_PROFILE"))  # set by --profile for the worker
STAGES = ["generate", "wait", "score", "pi_old", "samples", "train", "sync", "log"]


# ------------------------------------------------------------------------------------------ worker
def qwen2_05b_shaped(out: Path) -> Path:
    """A Qwen2-0.5B-shaped model with random weights and the char tokenizer, saved to ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from offpolicy.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, rope_theta=1_000_000.0, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as scripts/smollm2.py built it (never built here: that downloads)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("smollm2", Path(__file__).resolve().parents[1] / "scripts" / "smollm2.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    path = builder.model_dir()
    if not builder.is_built(path):
        raise SystemExit(f"SmolLM2-135M-Instruct is not built at {path}: run python scripts/smollm2.py first")
    return path


def model_path(name: str, tmp: Path, length: int) -> Path:
    if name == "qwen2-0.5b":
        return qwen2_05b_shaped(tmp / "qwen2-0.5b")
    if name == "smollm2":
        return smollm2_path()
    from offpolicy.train.config import load_train_config
    from offpolicy.policy.warmstart import default_model

    # the warm start (and the model's context) depends on the response limit
    return default_model(load_train_config(None, [f"sampling.max_tokens={length}"]))


def peak_memory_gib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def offpolicy_worker(extra: list[str], name: str, model: Path, device: str, steps: int, length: int, out: Path) -> dict:
    import torch
    from rich.console import Console

    from offpolicy.train.config import load_train_config
    from offpolicy.train.logger import RunLogger, read_jsonl
    from offpolicy.train.loop import train

    prompts, lr = SETTINGS[name]
    task = ["task=dataset", f"data.path={DATA}", "data.prompt_field=question", "data.answer_field=answer",
            "reward=number"] if name == "smollm2" else []
    cfg = load_train_config(None, [f"model={model}", f"trainer.device={device}", f"prompts_per_step={prompts}",
                                   f"group_size={GROUP}", f"steps={steps}", f"sampling.max_tokens={length}", f"lr={lr}",
                                   "eval_every=100000", "eval_problems=16", f"checkpoint_every={steps}",
                                   f"out_dir={out}", *task, *extra])
    # the clock TRL's gets (its on_step_end): the wall time between the ends of consecutive steps, the
    # logger's own write included (step_seconds stops before it)
    stamps: list[float] = []
    threads: list[int] = []  # torch's threads while the run trains (offpolicy's threads=auto may set them)
    log = RunLogger.log

    import cProfile

    profiler = cProfile.Profile()  # --profile: the timed steps (1 … n − 2) by function

    def clocked(self, step, values):
        log(self, step, values)
        stamps.append(time.perf_counter())
        threads.append(torch.get_num_threads())
        if PROFILE and step == 0:
            profiler.enable()
        if PROFILE and step == steps - 2:
            profiler.disable()

    RunLogger.log = clocked
    train(cfg, console=Console(quiet=True), progress=False)
    if PROFILE:
        profile_table(profiler, steps - 2)
    rows = read_jsonl(out / "metrics.jsonl")[1:-1]  # first step warms up; the last one evaluates
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][: len(rows)]  # steps 1 … n − 2, as rows
    per_step = statistics.median(gaps)
    tokens = statistics.median(r["response_length"] * prompts * GROUP for r in rows)
    return {"steps_per_s": 1.0 / per_step, "tokens_per_s": tokens / per_step,
            "stages": {s: statistics.median(r.get(f"time/{s}", 0.0) for r in rows) for s in STAGES},
            "threads": threads[-1]}


def profile_table(profiler, steps: int, top: int = 25) -> None:
    """The functions that took the most time of the timed steps (self time per step), from ``cProfile``:
    what the stage timers do not split."""
    import pstats

    stats = pstats.Stats(profiler).stats
    rows = sorted(((tt, ct, nc, f"{Path(file).name}:{line}({fn})") for (file, line, fn), (_, nc, tt, ct, _) in
                   stats.items()), reverse=True)[:top]
    print(f"\n--profile: the {top} largest self times (ms per step, {steps} timed steps; cProfile's own overhead "
          "included)")
    print("| function | self ms/step | cumulative ms/step | calls/step |\n|---|---:|---:|---:|")
    for tt, ct, nc, name in rows:
        print(f"| {name} | {1e3 * tt / steps:.1f} | {1e3 * ct / steps:.1f} | {nc / steps:.0f} |")


def trl_data(name: str, n: int):
    """TRL's dataset and reward for ``name``: the reverse task, or the word problems as chat prompts (TRL
    renders a conversational prompt with the tokenizer's chat template, as task=dataset does) scored by
    offpolicy's ``number`` reward against each row's reference."""
    from datasets import Dataset

    if name == "smollm2":
        from offpolicy.tasks.rewards import resolve_reward

        rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()][:n]
        number = resolve_reward("number")

        def reward(prompts, completions, answer, **kwargs):
            return [float(number(c[0]["content"] if isinstance(c, list) else c, a)) for c, a in zip(completions, answer)]

        return Dataset.from_dict({"prompt": [[{"role": "user", "content": r["question"]}] for r in rows],
                                  "answer": [r["answer"] for r in rows]}), reward
    from offpolicy.tasks import make_task, problems

    task = make_task("reverse")
    probs = problems(task, n, seed=123)
    answers = {p.prompt: p for p in probs}

    def reward(prompts, completions, **kwargs):
        return [task.reward(answers[p], c) for p, c in zip(prompts, completions)]

    return Dataset.from_dict({"prompt": [p.prompt for p in probs]}), reward


def trl_worker(name: str, model: Path, device: str, steps: int, length: int, out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from offpolicy.tasks.tokenizer import load_tokenizer

    prompts, lr = SETTINGS[name]
    tokenizer = load_tokenizer(model)
    data, reward = trl_data(name, prompts * (steps + 2))
    stamps: list[float] = []
    profile: dict[str, list[float]] = {}  # TRL's own timings per step (its profiling_context names)

    def record(self, duration: float) -> None:
        profile.setdefault(self.name, []).append(duration)

    profiling.ProfilingContext._log_metrics = record  # TRL sends these only to W&B / MLflow / Trackio

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    bf16 = device == "cuda" and torch.cuda.is_bf16_supported()  # offpolicy's trainer_dtype auto
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=prompts * GROUP, num_generations=GROUP,
                      max_completion_length=length, max_steps=steps, num_iterations=1, beta=0.0, temperature=1.0,
                      learning_rate=lr, use_cpu=device == "cpu", bf16=bf16, gradient_checkpointing=False,
                      report_to=[], save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=reward, args=args,
                          train_dataset=data, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    per_step = statistics.median(gaps)
    # per step, steps 1 … (as offpolicy's: the first warms up); a name called several times a step is summed
    stages = {k: sum(v[1:]) / max(len(gaps), 1) for k, v in profile.items()}
    inside = stages.get("GRPOTrainer._prepare_inputs", 0.0) + stages.get("GRPOTrainer.compute_loss", 0.0)
    stages["backward + optimizer (rest)"] = max(per_step - inside, 0.0)
    return {"steps_per_s": 1.0 / per_step, "tokens_per_s": statistics.median(lengths[1:]) * prompts * GROUP / per_step,
            "stages": {}, "trl_stages": stages}


def worker(args: argparse.Namespace) -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        model = model_path(args.model, Path(tmp), args.length)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if args.worker == TRL:
            result = trl_worker(args.model, model, args.device, args.steps, args.length, Path(tmp) / "trl")
        else:
            result = offpolicy_worker(TRAINERS[args.worker], args.model, model, args.device, args.steps, args.length,
                                      Path(tmp) / "run")
        result["peak_gib"] = peak_memory_gib(args.device)
        result.setdefault("threads", torch.get_num_threads())
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------ driver
BASELINE = "before: "  # --baseline-src: the offpolicy trainers again, with offpolicy imported from that source tree


def measure(name: str, model: str, device: str, threads: str, steps: int, length: int,
            baseline_src: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    if name.startswith(BASELINE):
        name = name.removeprefix(BASELINE)
        env["PYTHONPATH"] = os.pathsep.join([baseline_src, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, __file__, "--worker", name, "--model", model, "--device", device, "--steps", str(steps),
           "--length", str(length)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--models", nargs="+", choices=list(SETTINGS), default=["embedded"])
    parser.add_argument("--threads", nargs="+", default=["default"], help="'default' (OMP_NUM_THREADS unset) and/or N")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lengths", type=int, nargs="+", default=[10])
    parser.add_argument("--only", nargs="*", help="trainer names (substrings) to run")
    parser.add_argument("--baseline-src", help="a source tree (e.g. another checkout's src/): each offpolicy trainer "
                        "also runs with offpolicy imported from it, paired with the others run by run (before/after)")
    parser.add_argument("--profile", action="store_true", help="one offpolicy defaults run under cProfile: "
                        "its largest self times per step (no timing table)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="embedded", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=10, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.profile:
        env = dict(os.environ, BENCH_TRAINER_PROFILE="1")
        cmd = [sys.executable, __file__, "--worker", "offpolicy defaults", "--model", args.models[0],
               "--device", "cpu" if args.device == "auto" else args.device, "--steps", str(args.steps),
               "--length", str(args.lengths[0])]
        print(f"load average at start {os.getloadavg()[0]:.2f}")
        subprocess.run(cmd, env=env, check=True)
        return None
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        import trl  # noqa: F401

        names = [TRL]
    except Exception as exc:  # noqa: BLE001 - ImportError, or a carried TRL whose own imports fail
        names = []
        print(f"TRL unavailable ({type(exc).__name__}: {exc}): no TRL baseline in this run")
    from offpolicy.engines.vllm import vllm_available

    names += [n for n in TRAINERS if "vllm" not in n or vllm_available()]
    if args.only:
        names = [n for n in names if any(o in n for o in args.only)]
    if args.baseline_src:
        if not (Path(args.baseline_src) / "offpolicy").is_dir():
            parser.error(f"--baseline-src {args.baseline_src}: no offpolicy package there (give a checkout's src/)")
        names += [BASELINE + n for n in names if n != TRL]
    load = os.getloadavg()
    where = torch.cuda.get_device_name() if device == "cuda" else f"{os.cpu_count()} CPU cores"
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {where} · torch {torch.__version__} · "
          f"load average at start {load[0]:.2f}")
    for model in args.models:
        for threads in args.threads:
            for length in args.lengths:
                results: dict[str, list[dict]] = {n: [] for n in names}
                failed: set[str] = set()
                for run in range(args.runs):
                    for name in names if run % 2 == 0 else names[::-1]:  # paired, alternating order
                        if name in failed:
                            continue
                        try:
                            results[name].append(measure(name, model, device, threads, args.steps, length,
                                                         args.baseline_src))
                        except RuntimeError as exc:  # one trainer's failure leaves the others' numbers
                            print(f"  {model} length {length} run {run}: {exc}", flush=True)
                            failed.add(name)
                            continue
                        r = results[name][-1]
                        stages = ", ".join(f"{s} {1e3 * r['stages'][s]:.0f}" for s in ("generate", "train")
                                           if s in r["stages"])
                        print(f"  {model} threads={threads} length {length} run {run}: {name}: "
                              f"{r['steps_per_s']:.2f} steps/s{f' (ms: {stages})' if stages else ''} "
                              f"({r['threads']} threads; load average {os.getloadavg()[0]:.2f})", flush=True)
                kept = [n for n in names if n not in failed]
                if failed:
                    print(f"  left out of the table (failed): {', '.join(sorted(failed))}")
                if kept:
                    report({n: results[n] for n in kept}, kept, model, device, threads, length, args)
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def report(results: dict[str, list[dict]], names: list[str], model: str, device: str, threads: str, length: int,
           args: argparse.Namespace) -> None:
    med = {n: {k: statistics.median(r[k] for r in results[n]) for k in ("steps_per_s", "tokens_per_s", "peak_gib")}
           for n in names}
    # paired ratios: each run's offpolicy/TRL ratio, then the median (robust to load drifting between runs)
    ratio = {n: statistics.median(a["steps_per_s"] / b["steps_per_s"] for a, b in zip(results[n], results[TRL]))
             for n in names} if TRL in results else {}
    memory = "peak GPU GiB" if device == "cuda" else "peak RSS GiB"
    print(f"\n{model} on {device}, threads {threads}, max_new_tokens={length}, {SETTINGS[model][0] * GROUP} "
          f"completions/step, median of {args.runs} runs × {args.steps} steps")
    print(f"| trainer | steps/s | tokens/s | {memory} | vs TRL (paired) | "
          + " | ".join(f"{s} ms" for s in STAGES) + " |")
    print("|---|---|---|---|---|" + "---|" * len(STAGES))
    for n in names:
        stages = [statistics.median(r["stages"].get(s, 0.0) for r in results[n]) for s in STAGES]
        cells = " | ".join(f"{1e3 * t:.0f}" for t in stages) if results[n][0]["stages"] else " | ".join("–" for _ in STAGES)
        vs = f"{ratio[n]:.2f}×" if ratio else "–"
        print(f"| {n} | {med[n]['steps_per_s']:.2f} | {med[n]['tokens_per_s']:.0f} | {med[n]['peak_gib']:.2f} | {vs} | "
              f"{cells} |")
    if TRL in results and results[TRL][0].get("trl_stages"):
        names = list(results[TRL][0]["trl_stages"])
        print(f"\nwhere TRL's step goes (its profiling_context timings, ms per step, median of {args.runs} runs):")
        print("| " + " | ".join(names) + " |")
        print("|" + "---|" * len(names))
        print("| " + " | ".join(f"{1e3 * statistics.median(r['trl_stages'].get(k, 0.0) for r in results[TRL]):.0f}"
                                for k in names) + " |")


if __name__ == "__main__":
    main()
