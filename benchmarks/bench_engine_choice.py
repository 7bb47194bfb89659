"""Which rollout engine is faster on the CPU, by model size: the measurement behind ``engine=auto``.

For each model size, the hf engine and the vLLM engine each run in their own process (vLLM patches
process-wide state), in alternating order from run to run, and time what the trainer waits for in a
synchronous step: one ``generate`` of ``--rows`` prompts (``--prompt-len`` tokens, ``--max-tokens`` new
tokens, temperature 1) plus one weight sync of the model's own weights. Both engines run in ``--dtype``
(fp32 unless set), at torch's default threads (one per core), after one warm-up generation and sync.

Sizes: the embedded default itself (the warm-started tiny Qwen2 of ``offpolicy.tasks.model``, 0.8M
parameters, character vocabulary, the reverse task's prompts), Qwen2-architecture models initialised in
code (``SHAPES``: width × layers over SmolLM2's 49,152-token vocabulary, or over 128 to 4,096 tokens), and
SmolLM2-135M-Instruct itself where ``scripts/smollm2.py`` has built it. Random weights rarely draw the stop
token, so those rows run to ``--max-tokens``: the numbers compare the engines per generated token at a size.

    python benchmarks/bench_engine_choice.py --runs 3
    python benchmarks/bench_engine_choice.py --sizes embedded "64x2 V49k" --rows 64 --max-tokens 10

Prints one table: ms per (generate + sync) for each engine, and vLLM / hf (above 1: the hf engine is
faster). ``offpolicy.engines.choice`` states the rule drawn from it (docs/performance.md).
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
from pathlib import Path

# name → (hidden, layers, heads, kv heads, MLP width, vocabulary); "embedded" and "smollm2" are real models.
# 49,152 is SmolLM2's vocabulary; 128 a character-level one (the embedded model's is 64)
SHAPES = {"64x2 V49k": (64, 2, 2, 1, 192, 49_152), "128x4 V4k": (128, 4, 4, 2, 384, 4_096),
          "128x4 V1k": (128, 4, 4, 2, 384, 1_024), "192x8 V128": (192, 8, 6, 2, 576, 128),
          "256x8 V128": (256, 8, 4, 2, 768, 128), "512x8 V128": (512, 8, 8, 2, 1536, 128)}
# (head_dim ≥ 32 throughout: vLLM's CPU attention has no kernel for 16)


def build(name: str, out: Path) -> Path:
    """The model directory for ``name`` (built into ``out`` where it is made in code)."""
    if name == "embedded":
        from rich.console import Console

        from offpolicy.train.config import load_train_config
        from offpolicy.train.loop import resolve_model

        return resolve_model(load_train_config(None, []), Console(quiet=True))
    if name == "smollm2":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
        import smollm2

        path = smollm2.model_dir(Path(os.environ.get("OFFPOLICY_CACHE", Path.home() / ".cache" / "offpolicy")))
        if not smollm2.is_built(path):
            raise FileNotFoundError(f"SmolLM2 is not built at {path}: run `python scripts/smollm2.py`")
        return path
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from tokenizers import Tokenizer, models, pre_tokenizers

    hidden, layers, heads, kv, mlp, vocab_size = SHAPES[name]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=mlp,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=kv, max_position_embeddings=512,
                                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    path = out / name.replace(" ", "-")
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="t1", eos_token="t2", pad_token="t0",
                            unk_token="t3").save_pretrained(path)
    return path


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoTokenizer

    from offpolicy.engines import make_engine
    from offpolicy.engines.base import SamplingConfig

    path = args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    log = Path(tempfile.mkdtemp()) / "engine.log"
    engine = make_engine(args.worker, path, tokenizer, args.dtype, seed=0, max_model_len=512, log_path=log)
    from transformers import AutoModelForCausalLM

    weights = list(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items())
    generator = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    if args.embedded:  # the reverse task's own prompts, as the trainer sends them (8 prompts × 8)
        from offpolicy.tasks import make_task
        from offpolicy.tasks.tasks import problems
        from offpolicy.tasks.tokenizer import prompt_ids

        def prompts(i: int) -> list[list[int]]:
            return [prompt_ids(tokenizer, p) for p in problems(make_task("reverse"), args.rows // 8, seed=i)
                    for _ in range(8)]
    else:
        def prompts(i: int) -> list[list[int]]:
            return [torch.randint(4, vocab, (args.prompt_len,), generator=generator).tolist()
                    for _ in range(args.rows)]
    sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0)
    times, tokens = [], []
    for i in range(args.repeats + 1):
        batch = prompts(i)
        start = time.perf_counter()
        rollouts = engine.generate(batch, sampling, seed=i, version=i)
        engine.sync_weights(iter(weights))
        if i:  # the first warms up
            times.append(time.perf_counter() - start)
            tokens.append(sum(map(len, rollouts.response_ids)) / len(batch))
    print("RESULT " + json.dumps({"ms": 1e3 * statistics.median(times), "tokens": statistics.mean(tokens),
                                  "threads": torch.get_num_threads()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["embedded", *SHAPES, "smollm2"])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed generate + sync per worker")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="both engines' dtype")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--embedded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    from offpolicy.engines.choice import parameter_count

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {os.cpu_count()} CPU cores · torch "
          f"{torch.__version__} · {args.dtype} · {args.rows} rows × {args.max_tokens} new tokens (prompt "
          f"{args.prompt_len}; embedded: the reverse task's) · median of {args.repeats} per worker, {args.runs} runs")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            try:
                path = build(size, Path(tmp))
            except FileNotFoundError as err:
                print(f"  {size}: skipped ({err})")
                continue
            params = parameter_count(path)
            results: dict[str, list[float]] = {"hf": [], "vllm": []}
            for run in range(args.runs):
                for name in ("hf", "vllm") if run % 2 == 0 else ("vllm", "hf"):
                    cmd = [sys.executable, __file__, "--worker", name, "--model", str(path), "--rows", str(args.rows),
                           "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
                           "--repeats", str(args.repeats), "--dtype", args.dtype,
                           *(["--embedded"] if size == "embedded" else [])]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                    if proc.returncode or line is None:
                        raise RuntimeError(f"{size} {name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
                    r = json.loads(line.removeprefix("RESULT "))
                    results[name].append(r["ms"])
                    print(f"  {size} ({params / 1e6:.1f}M) run {run}: {name} {r['ms']:.1f} ms "
                          f"({r['tokens']:.1f} tokens a row, {r['threads']} threads)", flush=True)
            hf, vllm = (statistics.median(results[k]) for k in ("hf", "vllm"))
            rows.append((size, params, hf, vllm))
    print("\n| model | parameters | hf ms (generate + sync) | vLLM ms | vLLM / hf |")
    print("|---|---:|---:|---:|---:|")
    for size, params, hf, vllm in rows:
        print(f"| {size} | {params / 1e6:.1f}M | {hf:.1f} | {vllm:.1f} | {vllm / hf:.2f} |")


if __name__ == "__main__":
    main()
