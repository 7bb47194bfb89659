"""What replaying the engine's kept set buys (issue #46): ρ band shares with and without replay.

On SmolLM2-135M-Instruct (``python scripts/smollm2.py`` builds it), the hf engine samples the shipped word
problems (chat template, temperature 1) at each truncation (top_p 0.8, top_p 0.9, top_k 20) and once
untruncated (top_p 1, the reference), in each engine dtype; the fp32 trainer then scores the very same
tokens three ways, from one decoder pass (the trainer's head, ``offpolicy.policy.head``, three times):

* full vocabulary: log π over the whole vocabulary against the engine's truncated μ (TRL #7269's
  baseline; the ratio carries the factor S, the trainer's mass inside the set);
* recomputed: the trainer's own top-k/top-p set on its logits (offpolicy before issue #46; vLLM today);
* replayed: the engine's recorded kept set (``offpolicy.core.kept_set``; the hf engine).

It prints one Markdown table: per setting, the share of engine tokens outside the trainer's set and the
share of tokens with ρ outside [0.9, 1.1] each way, and the size of the recorded sets (mean and max ids
per token, bytes per token of ``KeptIds``).

    python benchmarks/replay_kept_set.py                    # n 64, 64 tokens
    python benchmarks/replay_kept_set.py --n 16 --max-tokens 16   # a quick run
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_mismatch import DATA, smollm2_dir  # noqa: E402

SETTINGS = [("top_p 1", {"top_p": 1.0}), ("top_p 0.8", {"top_p": 0.8}), ("top_p 0.9", {"top_p": 0.9}),
            ("top_k 20", {"top_k": 20})]


def shares(logprobs: torch.Tensor, rollout: torch.Tensor) -> tuple[float, float]:
    """(share of engine tokens the trainer gives −inf: outside the set it scored on; share of the others with
    ρ ∉ [0.9, 1.1], read on log ρ in fp64) — diagnose's ``kept_set_report`` definitions."""
    inside = torch.isfinite(logprobs)
    log_ratio = (logprobs[inside] - rollout[inside]).double()
    band = ((log_ratio < math.log(0.9)) | (log_ratio > math.log(1.1))).sum()
    return 1.0 - float(inside.float().mean()), float(band) / max(1, int(inside.sum()))


@torch.no_grad()
def three_ways(policy, batch, sampling) -> dict[str, torch.Tensor]:
    """log π ``[N]`` of every response token, full vocabulary / recomputed set / replayed set, and log μ: one
    decoder pass per 16 rows, the head (``offpolicy.policy.head.token_logprobs``) three times on its states."""
    from offpolicy.engines import SamplingConfig
    from offpolicy.policy.head import decoder_hidden, linear_head, token_logprobs

    head = linear_head(policy)
    full_vocab = SamplingConfig(max_tokens=sampling.max_tokens, temperature=sampling.temperature)
    out: dict[str, list[torch.Tensor]] = {"full": [], "recomputed": [], "replayed": [], "rollout": []}
    for rows in torch.arange(len(batch.mask)).split(16):
        mb = batch.select(rows)
        r, c = mb.mask.bool().nonzero(as_tuple=True)
        hidden = decoder_hidden(policy, mb.input_ids, mb.attention_mask)[r, mb.positions[r, c]]  # [N, H]
        tokens = mb.response_ids[r, c]
        out["full"].append(token_logprobs(hidden, tokens, head, full_vocab).logprobs)
        out["recomputed"].append(token_logprobs(hidden, tokens, head, sampling).logprobs)
        kept = None if mb.kept is None else mb.kept[r, c]
        out["replayed"].append(token_logprobs(hidden, tokens, head, sampling, kept=kept).logprobs)
        out["rollout"].append(mb.rollout_logprobs[r, c])
    return {k: torch.cat(v) for k, v in out.items()}


def run(model: Path, policy, engine_dtype: str, name: str, knobs: dict, n: int, max_tokens: int) -> dict:
    from offpolicy.engines import SamplingConfig
    from offpolicy.engines.hf import HFEngine
    from offpolicy.tasks.dataset import dataset_prompts
    from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer
    from offpolicy.policy.batch import to_batch
    from offpolicy.tasks.dataset import DataConfig

    tokenizer = load_tokenizer(model)
    ensure_pad_token(tokenizer)
    prompts = dataset_prompts(DataConfig(path=str(DATA)), tokenizer, 512)
    prompts = [prompts[i % len(prompts)] for i in range(n)]
    sampling = SamplingConfig(max_tokens=max_tokens, **knobs)
    engine = HFEngine(str(model), tokenizer, engine_dtype)
    start = time.perf_counter()
    rollouts = engine.generate(prompts, sampling, seed=0, version=0)
    seconds = time.perf_counter() - start
    engine.close()
    lp = three_ways(policy, to_batch(rollouts, tokenizer.pad_token_id), sampling)
    row = {"setting": name, "engine": engine_dtype, "tokens": int(lp["rollout"].numel())}
    for way in ("full", "recomputed", "replayed"):
        row[f"{way}_outside"], row[f"{way}_band"] = shares(lp[way], lp["rollout"])
    if rollouts.kept is not None:
        valid = rollouts.kept.count[rollouts.kept.count > 0].float()
        row.update(ids_mean=float(valid.mean()), ids_max=int(valid.max()),
                   bytes_per_token=rollouts.kept.nbytes() / max(1, valid.numel()))
    print(f"  {name} {engine_dtype} engine: {seconds:.0f} s engine, {time.perf_counter() - start:.0f} s total",
          flush=True)
    print(table_row(row), flush=True)
    return row


HEADER = ("| sampling | engine dtype | tokens | outside the trainer's set: recomputed | replayed "
          "| ρ ∉ [0.9, 1.1]: full vocabulary | recomputed set | replayed set | kept ids per token: mean | max "
          "| bytes per token |\n|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(r: dict) -> str:
    size = f"{r['ids_mean']:.1f} | {r['ids_max']} | {r['bytes_per_token']:.0f}" if "ids_mean" in r else "– | – | –"
    return (f"| {r['setting']} | {r['engine']} | {r['tokens']} | {r['recomputed_outside']:.2%} | "
            f"{r['replayed_outside']:.2%} | {r['full_band']:.1%} | {r['recomputed_band']:.1%} | "
            f"{r['replayed_band']:.1%} | {size} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory (default: the built SmolLM2)")
    parser.add_argument("--n", type=int, default=64, help="samples per setting")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engine-dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--settings", nargs="+", default=[name for name, _ in SETTINGS],
                        choices=[name for name, _ in SETTINGS], help="which samplings to run (default: all)")
    args = parser.parse_args()
    model = args.model or smollm2_dir()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {os.cpu_count()} CPU cores · load average "
          f"{os.getloadavg()[0]:.2f} · {model.name} · hf engine · fp32 trainer · n {args.n} · "
          f"max_tokens {args.max_tokens} · temperature 1")
    from offpolicy.policy.score import load_policy

    policy = load_policy(model, torch.device("cpu")).eval()  # the fp32 trainer, one for every setting
    rows = [run(model, policy, dtype, name, knobs, args.n, args.max_tokens)
            for dtype in args.engine_dtypes for name, knobs in SETTINGS if name in args.settings]
    print("\n" + HEADER)
    for r in rows:
        print(table_row(r))

if __name__ == "__main__":
    main()
