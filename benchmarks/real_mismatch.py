"""The real rollout–trainer mismatch of a pretrained model, engine dtype × trainer dtype (issue #30).

Runs ``offpolicy diagnose`` (the command a user types, one process per engine, trainer dtype and top-p)
on SmolLM2-135M-Instruct (``python scripts/smollm2.py`` builds it) with prompts from the shipped word
problems rendered with the chat template, and prints two Markdown tables:

1. per setting (engine, engine dtype, trainer dtype): kl_k3, mean |log ρ|, the share of tokens with ρ
   outside [0.9, 1.1], the ESS of the raw ratios; and, sampled again at top_p 0.9 with the trainer on
   the engine's truncated support: the trainer's mass outside its top-p set (1 − S, the factor a ratio
   against full-vocabulary log-probs would carry — TRL #6789), the share of sampled tokens outside the
   trainer's own top-p set, and the share outside [0.9, 1.1] there;
2. per preset that rejects anything on some setting's batch (top_p 1), the share of tokens it rejects.

    python benchmarks/real_mismatch.py                               # vllm and hf, n 64, 128 tokens
    python benchmarks/real_mismatch.py --engines hf --n 16 --max-tokens 32   # a quick run
    python benchmarks/real_mismatch.py --model DIR --out diag-real/

Every report.json stays under ``--out`` (default: a temporary directory). bf16 on a CPU without native
bf16 is emulated: slower, the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "arith_word_problems.jsonl"
ENGINE_DTYPES = ["bf16", "fp32"]
TRAINER_DTYPES = ["fp32", "bf16"]


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as scripts/smollm2.py built it: bench_trainer's lookup (beside this script)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_trainer import smollm2_path

    return smollm2_path()


def diagnose(model: Path, engine: str, trainer_dtype: str, top_p: float, n: int, max_tokens: int, out: Path) -> dict:
    """One ``offpolicy diagnose --compare engine_dtype=bf16,fp32`` run: its report.json, by engine dtype."""
    cmd = [sys.executable, "-m", "offpolicy", "diagnose", "--model", str(model), "--data", str(DATA),
           "--engine", engine, "--trainer-dtype", trainer_dtype, "--compare", "engine_dtype=" + ",".join(ENGINE_DTYPES),
           "--n", str(n), "--max-tokens", str(max_tokens), "--top-p", str(top_p), "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    runs = json.loads((out / "report.json").read_text())["runs"]
    print(f"  {engine} trainer {trainer_dtype} top_p {top_p}: {time.perf_counter() - start:.0f} s", flush=True)
    return {r["setting"]["engine_dtype"]: r for r in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory (default: the built SmolLM2)")
    parser.add_argument("--engines", nargs="+", choices=["vllm", "hf"], default=["vllm", "hf"])
    parser.add_argument("--n", type=int, default=64, help="samples per setting")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--top-p", type=float, default=0.9, help="the truncated run's top_p")
    parser.add_argument("--out", type=Path, help="where the report.json files go (default: a temporary directory)")
    args = parser.parse_args()
    model = args.model or smollm2_dir()
    out = args.out or Path(tempfile.mkdtemp(prefix="real-mismatch-"))
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {os.cpu_count()} CPU cores · load average "
          f"{load[0]:.2f} · {model.name} · n {args.n} · max_tokens {args.max_tokens} · reports under {out}")
    full, truncated = {}, {}
    for engine in args.engines:
        for trainer_dtype in TRAINER_DTYPES:
            for top_p, into in ((1.0, full), (args.top_p, truncated)):
                runs = diagnose(model, engine, trainer_dtype, top_p, args.n, args.max_tokens,
                                out / f"{engine}-{trainer_dtype}-top_p{top_p:g}")
                for engine_dtype, report in runs.items():
                    into[(engine, engine_dtype, trainer_dtype)] = report
    print(f"\n| engine | engine dtype | trainer dtype | tokens | kl_k3 | mean \\|log ρ\\| | ρ ∉ [0.9, 1.1] | ESS | "
          f"top_p {args.top_p:g}: mass outside | sampled outside trainer's set | ρ ∉ [0.9, 1.1] |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in full.items():
        s, t = r["summary"], truncated[key]["summary"]
        print(f"| {' | '.join(key)} | {r['tokens']:.0f} | {s['kl_k3']:.2e} | {s['mean_abs_log_ratio']:.4f} | "
              f"{s['fraction_outside_0.9_1.1']:.1%} | {s['ess']:.4f} | {t.get('outside_mass', float('nan')):.3f} | "
              f"{t['fraction_outside_trainer_support']:.2%} | {t['fraction_outside_0.9_1.1']:.1%} |")
    print("\nshare of tokens each preset rejects (top_p 1; presets that reject nothing anywhere left out):\n")
    print("| preset | " + " | ".join(" ".join(k) for k in full) + " |")
    print("|---|" + "---|" * len(full))
    names = [row["preset"] for row in next(iter(full.values()))["what_if"]]
    for preset in names:
        cells = [r["summary"][f"masked_fraction@{preset}"] for r in full.values()]
        if any(c > 0 for c in cells):
            print(f"| {preset} | " + " | ".join(f"{c:.1%}" for c in cells) + " |")


if __name__ == "__main__":
    main()
