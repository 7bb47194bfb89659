"""Where a real-model step's time goes, against its compute floor on this machine (issue #42 item 2).

For a finished ``offpolicy train`` run directory (e.g. one of ``benchmarks/science_real.py``'s) it
reads the run's config and ``metrics.jsonl`` and prints, per stage, the measured seconds (median over
the steps after the first) against the floor: the stage's matmul FLOPs at the matmul throughput
measured here, now, with the run's thread count and dtype::

    train      6 · (N_body · T + N_head · T_resp)      forward + backward over prompt + response tokens
    generate   2 · (N_body · T + N_head · T_resp)      one forward per token (KV cache), the head on responses
    policy_kl  2 · 2 · (N_body · T_kl + N_head · T_kl_resp)   the two no-grad forwards of policy_kl_rows rows
    eval       2 · (N_body + N_head) · E · (P + R_max) greedy answers to E held-out prompts (an upper bound:
               every answer taken to max_new_tokens)

N_body = the decoder's matmul parameters (attention and MLP projections), N_head = vocabulary × width
(the tied head), T = the step's prompt + response tokens with each prompt counted once a group (the trainer
and both engines compute a group's prompt once: issue #49's round 3; a run made before that computed it
once a row, and reads that much above this floor), T_resp its response tokens (from ``response_length`` ×
rows; prompt lengths from the task's prompts rendered by the model's tokenizer).
Attention's own FLOPs (≈ 4 · layers · width · T²/rows) are under 1 % at these lengths and left out.

    python benchmarks/real_step_floor.py --run runs/science_real/reference/seed0 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import yaml


def matmul_gflops(rows: int, width: int, inner: int, dtype: str, threads: int, reps: int = 20,
                  median: bool = False) -> float:
    """Best-of-``reps`` throughput of ``[rows, width] @ [width, inner]`` (the MLP's shape) in GFLOP/s; with
    ``median``, the median of the reps instead (what a long stage gets on a shared, loaded machine)."""
    import torch

    torch.set_num_threads(threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(rows, width, dtype=dt), torch.randn(width, inner, dtype=dt)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * rows * width * inner / (statistics.median(times) if median else min(times)) / 1e9


def model_params(config: dict) -> tuple[int, int]:
    """(N_body, N_head): the decoder's projection parameters and the head's, from a Llama/Qwen2 config."""
    width, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or width // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    per_layer = width * q + 2 * width * kv + q * width + 3 * width * inner
    return layers * per_layer, config["vocab_size"] * width


def prompt_tokens(train: dict, model: str, n: int = 256) -> float:
    """Mean prompt length of the run's task as the trainer builds it (``make_train_task``: a chat model's
    template, or the data file), over its first ``n`` training prompts."""
    from offpolicy.tasks import problems
    from offpolicy.tasks.tokenizer import load_tokenizer, prompt_ids
    from offpolicy.train.config import TrainConfig
    from offpolicy.train.loop import make_train_task

    tokenizer = load_tokenizer(model)
    task = make_train_task(TrainConfig.model_validate(train), tokenizer)
    return statistics.fmean(len(prompt_ids(tokenizer, p)) for p in problems(task, n, seed=0))


def floors(train: dict, rows: list[dict], n_body: int, n_head: int, prompt: float, gflops: float,
           gflops_engine: float) -> dict[str, tuple[float, float]]:
    """Per stage: (measured seconds, floor seconds), medians over the steps after the first."""
    batch = train["prompts_per_step"] * train["group_size"]
    later = [r for r in rows if r["step"] >= 1 and not r.get("skipped_update")] or rows

    def median(key: str) -> float:
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else 0.0

    resp = statistics.median(r["response_length"] for r in later)
    t_all, t_resp = train["prompts_per_step"] * prompt + batch * resp, batch * resp  # a group's prompt once
    fwd = 2 * (n_body * t_all + n_head * t_resp)
    kl_rows = min(train.get("policy_kl_rows", 0), batch)
    fwd_kl = 2 * (n_body * kl_rows * (prompt + resp) + n_head * kl_rows * resp)
    out = {"generate": (median("time/generate"), fwd / gflops_engine / 1e9),
           "train": (median("time/train"), 3 * fwd / gflops / 1e9),
           "policy_kl": (median("time/policy_kl"), 2 * fwd_kl / gflops / 1e9)}
    evals = [r for r in rows if "eval/accuracy" in r and r["step"] >= 1]
    if evals:
        eval_flops = 2 * (n_body + n_head) * train["eval_problems"] * (prompt + train["max_new_tokens"])
        # time/eval: its own stage since issue #49 (a run from before kept it inside time/log)
        out["eval (per eval)"] = (statistics.median(r.get("time/eval", r["time/log"]) for r in evals),
                                  eval_flops / gflops / 1e9)
    step = sum(v[1] for k, v in out.items() if k != "eval (per eval)")
    # every step's time without its eval (a run from before time/eval: the steps that did not evaluate)
    no_eval = [r["step_seconds"] - r.get("time/eval", 0.0) for r in later
               if "time/eval" in r or "eval/accuracy" not in r] or [r["step_seconds"] for r in later]
    out["step (no eval)"] = (statistics.median(no_eval), step)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="an offpolicy train run directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the matmul measurement (the run's)")
    args = p.parse_args(argv)
    saved = yaml.safe_load((args.run / "config.yaml").read_text())
    train, resolved = saved["train"], saved["resolved"]
    from offpolicy.train.logger import read_jsonl

    rows = read_jsonl(args.run / "metrics.jsonl")  # a run cut mid-write leaves a torn last line
    config = json.loads((Path(train["model"]) / "config.json").read_text())
    n_body, n_head = model_params(config)
    prompt = prompt_tokens(train, train["model"])
    batch = train["prompts_per_step"] * train["group_size"]
    shape_rows = int(batch * (prompt + 16))
    gflops = matmul_gflops(shape_rows, config["hidden_size"], config["intermediate_size"], "fp32", args.threads)
    engine_dtype = resolved["engine_dtype"]
    gflops_engine = gflops if engine_dtype == "fp32" else matmul_gflops(
        shape_rows, config["hidden_size"], config["intermediate_size"], engine_dtype, args.threads)
    print(f"model: N_body {n_body / 1e6:.1f}M, N_head {n_head / 1e6:.1f}M; prompt {prompt:.1f} tokens; "
          f"{batch} rows a step; matmul [{shape_rows}×{config['hidden_size']}]·[{config['hidden_size']}×"
          f"{config['intermediate_size']}] at {args.threads} thread(s): fp32 {gflops:.1f} GFLOP/s"
          + (f", {engine_dtype} {gflops_engine:.1f} GFLOP/s" if engine_dtype != "fp32" else ""))
    # the same floor at the median matmul throughput: on a shared machine the best-of-20 catches the quiet
    # moments, a stage of tens of seconds does not; the ratio against it says how much is load, not overhead
    typical = matmul_gflops(shape_rows, config["hidden_size"], config["intermediate_size"], "fp32", args.threads,
                            median=True)
    typical_engine = typical if engine_dtype == "fp32" else matmul_gflops(
        shape_rows, config["hidden_size"], config["intermediate_size"], engine_dtype, args.threads, median=True)
    print(f"load average {os.getloadavg()[0]:.2f}; median matmul fp32 {typical:.1f} GFLOP/s"
          + (f", {engine_dtype} {typical_engine:.1f}" if engine_dtype != "fp32" else ""))
    loaded = floors(train, rows, n_body, n_head, prompt, typical, typical_engine)
    print("| stage | measured s | floor s | measured / floor | floor s at the median matmul | measured / that |\n"
          "|---|---:|---:|---:|---:|---:|")
    for stage, (measured, floor) in floors(train, rows, n_body, n_head, prompt, gflops, gflops_engine).items():
        if floor == 0:  # a stage the run did not have (policy_kl_rows=0)
            continue
        print(f"| {stage} | {measured:.2f} | {floor:.2f} | {measured / floor:.2f}× | {loaded[stage][1]:.2f} | "
              f"{measured / loaded[stage][1]:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
