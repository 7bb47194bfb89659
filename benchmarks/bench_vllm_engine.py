"""The vLLM engine's platform defaults, measured against the alternatives: start-up, generation and
weight-sync time of ``VLLMEngine`` per setting, in the same run.

Settings, each in its own process (vLLM patches process-wide state), in alternating order from run to
run (paired runs on a shared machine):

- ``default``: what ``offpolicy train`` uses (``engines/vllm.py``: on the CPU eager, chunked prefill off;
  on CUDA CUDA graphs on, chunked prefill on, sleep mode on — sleep(1) after generating, wake + reload
  at the sync);
- ``eager flipped``: ``enforce_eager`` the other way (CPU: compiled; CUDA: no graphs);
- on CUDA, ``no sleep``: the engine keeps its weights and KV cache on the GPU (no host round trip at
  the sync, no memory given back to the trainer) — what sleep level 1 costs per step.

Each worker times: the engine's start; one generation of ``--prompts`` prompts of ``--prompt-len``
tokens with ``--max-tokens`` new tokens (after one warm-up generation); the weight sync of the model's
own weights (in a sleeping engine: wake, reload, wake); the generation again (weights reloaded).

    python3 benchmarks/bench_vllm_engine.py --runs 2
    python3 benchmarks/bench_vllm_engine.py --model /path/to/hf-model --prompts 256 --prompt-len 120 --max-tokens 64

Without ``--model`` it builds the tiny Qwen2 of ``offpolicy.tasks.model`` (random weights). Numbers on
a shared machine are noisy: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from transformers import AutoModelForCausalLM

    from offpolicy.engines import SamplingConfig
    from offpolicy.engines.vllm import VLLMEngine

    path = args.model
    if path is None:
        from offpolicy.tasks.model import build_tiny_qwen2
        from offpolicy.tasks.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        path = tempfile.mkdtemp()
        build_tiny_qwen2(tok, seed=5).save_pretrained(path)
        tok.save_pretrained(path)
    options = json.loads(args.options)
    start = time.perf_counter()
    engine = VLLMEngine(path, dtype=args.dtype, seed=0, max_model_len=args.prompt_len + args.max_tokens + 8,
                        log_path=None, **options)
    out = {"start_s": time.perf_counter() - start}
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(vocab, 30_000), (args.prompts, args.prompt_len), generator=g).tolist()
    sampling = SamplingConfig(max_tokens=args.max_tokens)
    engine.generate(prompts[:8], sampling, seed=1, version=0)  # warm-up
    start = time.perf_counter()
    rollouts = engine.generate(prompts, sampling, seed=2, version=0)
    out["generate_s"] = time.perf_counter() - start
    out["tokens"] = sum(map(len, rollouts.response_ids))
    weights = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(engine.device).state_dict()
    start = time.perf_counter()
    engine.sync_weights(weights.items())
    out["sync_s"] = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(prompts, sampling, seed=2, version=1)
    out["generate_after_sync_s"] = time.perf_counter() - start
    out["kwargs"] = {k: v for k, v in engine.llm_kwargs.items() if k != "model"}
    engine.close()
    print("RESULT " + json.dumps(out), flush=True)


def settings(on_cpu: bool) -> dict[str, dict]:
    if on_cpu:
        return {"default": {}, "eager flipped": {"enforce_eager": False}}
    return {"default": {"sleep": True}, "eager flipped": {"sleep": True, "enforce_eager": True},
            "no sleep": {"sleep": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model directory (default: the tiny Qwen2)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--prompts", type=int, default=64)
    # 90 + 32 new tokens fit the tiny model's 128 positions (vLLM would cut longer responses short); 64 × 90 =
    # 5,760 prompt tokens, over the CPU's 4,096-token step budget (prefilled whole: chunked prefill is off there)
    parser.add_argument("--prompt-len", type=int, default=90)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import torch

    on_cpu = not torch.cuda.is_available()
    table = settings(on_cpu)
    results: dict[str, list[dict]] = {name: [] for name in table}
    for run in range(args.runs):
        names = list(table) if run % 2 == 0 else list(reversed(table))
        for name in names:
            cmd = [sys.executable, __file__, "--worker", "--options", json.dumps(table[name]), "--dtype", args.dtype,
                   "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
                   "--max-tokens", str(args.max_tokens)] + (["--model", args.model] if args.model else [])
            done = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{name}: the worker failed:\n{done.stderr[-3000:]}")
            results[name].append(json.loads(line.removeprefix("RESULT ")))
            print(f"run {run} {name}: {results[name][-1]}", flush=True)
    keys = ("start_s", "generate_s", "sync_s", "generate_after_sync_s")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in results.items()}
    base = med["default"]
    where = "CPU" if on_cpu else torch.cuda.get_device_name()
    print(f"\n{where}, {args.prompts} prompts × {args.prompt_len} tokens, {args.max_tokens} new, {args.dtype}, "
          f"median of {args.runs} (ratio: setting / default, same run)")
    print("| setting | start s | generate s | weight sync s | generate after sync s |")
    print("|---|---|---|---|---|")
    for name, m in med.items():
        cells = [f"{m[k]:.2f}" + ("" if name == "default" else f" ({m[k] / max(base[k], 1e-9):.2f}×)") for k in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
