"""``offpolicy diagnose``: how off-policy is an engine, and which correction would this batch need?

Samples with the engine, recomputes the very same tokens with the trainer (Hugging Face, on the
engine's top-k/top-p support, SPEC §6), and reports:

* every mismatch metric of SPEC §7 (``correct`` with a measure-only config);
* breakdowns by token position and by the sampled token's probability under the trainer —
  where the mismatch lives;
* the fraction of tokens with |log ρ| above log 1.1 and log 2;
* a what-if table: every preset applied to this very batch (rejected tokens and sequences,
  weight mean/min/max, ESS of the weights);
* PNG plots (histogram of log ρ, log ρ against token probability, mismatch KL per position)
  and ``report.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import offpolicy as op
from offpolicy import presets
from offpolicy.config import ConfigError
from offpolicy.engines import SamplingConfig, make_engine
from offpolicy.train.update import to_device
from offpolicy.train.batch import Batch, to_batch, trainer_logprobs

POSITION_EDGES = [0, 4, 8, 16, 32, 64, 128, 256, 1 << 30]
PROBABILITY_EDGES = [0.0, 0.01, 0.1, 0.5, 0.9, 1.0000001]
THRESHOLDS = {"log1.1": math.log(1.1), "log2": math.log(2.0)}


@dataclass
class Sample:
    """One engine batch and the trainer's view of it, ``[B, T]``."""

    batch: Batch
    trainer: torch.Tensor  # log π_train(y_t)
    seconds: float | None  # engine time; None for a batch read from a dump (``--batch``)


def read_prompts(path: Path, tokenizer) -> list[list[int]]:
    """Token ids of each JSONL line's ``prompt`` field.

    Raises:
        ConfigError: missing/empty file, invalid JSON, or a line without a string ``prompt``.
    """
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: file not found")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--prompts {path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ConfigError(f"--prompts {path}:{number}: each line needs a string field \"prompt\"")
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        prompts.append([*bos, *tokenizer(record["prompt"], add_special_tokens=False).input_ids])
    if not prompts:
        raise ConfigError(f"--prompts {path}: the file holds no prompt")
    return prompts


def sample(model_path: Path, tokenizer, prompts: list[list[int]], engine: str, engine_dtype: str,
           trainer_dtype: str, sampling: SamplingConfig, seed: int = 0, logit_noise: float = 0.0,
           log_path: Path | None = None, device: torch.device | None = None) -> Sample:
    """Generate with the engine, then recompute the sampled tokens' log-probs with the trainer.
    The engine's start-up output goes to ``log_path`` when given (see ``engines.output_to``).
    ``device`` (default CPU) is where the trainer and the hf engine run; the sample comes back on the CPU."""
    import time

    from transformers import AutoModelForCausalLM

    eng = make_engine(engine, str(model_path), tokenizer, engine_dtype, seed=seed, logit_noise=logit_noise,
                      log_path=log_path, device=device)
    try:
        start = time.perf_counter()
        rollouts = eng.generate(prompts, sampling, seed=seed, version=0)
        seconds = time.perf_counter() - start
        rollouts.validate(eng.name)
    finally:
        eng.close()
    if not any(rollouts.response_ids):
        raise RuntimeError("the engine returned only empty responses: nothing to compare")
    batch = to_batch(rollouts, tokenizer.pad_token_id)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[trainer_dtype]
    device = torch.device(device or "cpu")
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        lp = torch.cat([trainer_logprobs(trainer, to_device(batch.select(rows), device), sampling).cpu()
                        for rows in torch.arange(len(rollouts)).split(64)])
    return Sample(batch, lp.float(), seconds)


def from_dump(path: Path) -> tuple[Sample, dict[str, Any]]:
    """A ``Sample`` from a host framework's batch dump (``offpolicy.integrations.dump``): the trainer
    view is the dump's ``old_logprobs`` (log π_old), the engine's its ``rollout_logprobs`` (log μ).
    Returns the sample and a description of its source (files, hosts, steps) for the report."""
    from offpolicy.integrations.dump import load_batch

    data = load_batch(path)
    mask = data["mask"]
    rows, t = mask.shape
    zeros = torch.zeros((rows, t), dtype=torch.long)
    # Only mask and rollout_logprobs of a Batch feed the report; token ids are not dumped.
    keep = mask.bool()  # padding may hold anything (a host's fill value); it never reaches the report
    batch = Batch(input_ids=zeros, attention_mask=zeros, positions=zeros, response_ids=zeros, mask=mask,
                  rollout_logprobs=torch.where(keep, data["rollout_logprobs"], 0.0),
                  versions=torch.zeros(rows, dtype=torch.long))
    meta = data["meta"]
    source = {"files": data["files"], "hosts": sorted({f"{m.get('host')} {m.get('host_version')}" for m in meta}),
              "steps": sorted({m.get("step") for m in meta if m.get("step") is not None}),
              "anchors": sorted({str(m.get("anchor")) for m in meta})}
    return Sample(batch, torch.where(keep, data["old_logprobs"], 0.0), None), source


def _bucket_rows(log_ratio, mask, index, edges, labels) -> list[dict[str, float]]:
    total_abs = float((log_ratio.abs() * mask).sum())
    n_all = float(mask.sum())
    rows = []
    for lo, hi, label in zip(edges[:-1], edges[1:], labels):
        sel = mask.bool() & (index >= lo) & (index < hi)
        n = int(sel.sum())
        if n == 0:
            continue
        x = log_ratio[sel]
        rows.append({
            "bucket": label, "tokens": n, "token_share": n / n_all,
            "abs_log_ratio_mean": float(x.abs().mean()),
            "kl_k3": float((x.exp() - 1 - x).mean()),
            "abs_log_ratio_share": float(x.abs().sum()) / total_abs if total_abs > 0 else 0.0,
        })
    return rows


def breakdowns(s: Sample) -> dict[str, Any]:
    log_ratio = (s.trainer - s.batch.rollout_logprobs) * s.batch.mask  # log ρ = log π_train − log μ
    mask = s.batch.mask
    t = torch.arange(mask.shape[1]).expand_as(mask)
    pos_labels = [f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+" for lo, hi in zip(POSITION_EDGES[:-1], POSITION_EDGES[1:])]
    prob = s.trainer.exp()
    prob_labels = ["<0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", "≥0.9"]
    n = float(mask.sum())
    return {
        "by_position": _bucket_rows(log_ratio, mask, t, POSITION_EDGES, pos_labels),
        "by_probability": _bucket_rows(log_ratio, mask, prob, PROBABILITY_EDGES, prob_labels),
        "fraction_abs_log_ratio_above": {k: float(((log_ratio.abs() > v) & mask.bool()).sum()) / n
                                         for k, v in THRESHOLDS.items()},
    }


def what_if(s: Sample, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Every preset's ``correct`` on this batch (π_old = π_θ = the trainer's log-probs, A = 0)."""
    rows = []
    mask = s.batch.mask
    adv = torch.zeros_like(mask)
    non_empty = mask.any(dim=-1)
    for name in names or presets.names():
        cfg = presets.correction(name)
        out = op.correct(s.trainer, s.batch.rollout_logprobs, mask, cfg, logprobs=s.trainer, advantages=adv)
        m = out.metrics
        kept_rows = out.mask.bool().any(dim=-1)
        rows.append({
            "preset": name,
            "token_rejected": m["masked_fraction"],
            "seq_rejected": float((non_empty & ~kept_rows).sum()) / float(non_empty.sum()),
            "weight_mean": m["is_mean"], "weight_min": m["is_min"], "weight_max": m["is_max"],
            "ess": m["is_ess"],
        })
    return rows


def mismatch(s: Sample) -> dict[str, float]:
    out = op.correct(s.trainer, s.batch.rollout_logprobs, s.batch.mask)  # measure only
    keys = ["kl_k1", "kl_k3", "ppl_train", "ppl_rollout", "log_ppl_diff", "ppl_ratio", "chi2_token", "chi2_seq",
            "abs_logp_diff_mean", "abs_logp_diff_max", "prob_diff_mean", "prob_diff_max", "ess", "valid_tokens"]
    values = out.metrics.to_dict(prefix="")
    return {k: values[k] for k in keys}


def plot(s: Sample, out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mask = s.batch.mask.bool()
    log_ratio = (s.trainer - s.batch.rollout_logprobs)[mask]
    prob = s.trainer.exp()[mask]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.hist(log_ratio.numpy(), bins=80, color="#3a6ea5", log=True)
    ax.set_xlabel("log ρ = log π_train − log μ_engine")
    ax.set_ylabel("tokens (log scale)")
    ax.set_title(f"{title}: log-ratio histogram", fontsize=10)
    ax.axvline(0, color="k", lw=0.5)
    paths.append(out_dir / "log_ratio_hist.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.scatter(prob.numpy(), log_ratio.numpy(), s=3, alpha=0.3, color="#3a6ea5")
    ax.set_xscale("log")
    ax.set_xlabel("π_train(y_t) of the sampled token (log scale)")
    ax.set_ylabel("log ρ")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_title(f"{title}: mismatch against token probability", fontsize=10)
    paths.append(out_dir / "log_ratio_vs_prob.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    lr = (s.trainer - s.batch.rollout_logprobs)
    k3 = (lr.exp() - 1 - lr) * s.batch.mask
    counts = s.batch.mask.sum(0)
    per_pos = (k3.sum(0) / counts.clamp(min=1))[counts > 0]
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.plot(per_pos.numpy(), marker="o", ms=3, color="#3a6ea5")
    ax.set_xlabel("response token position")
    ax.set_ylabel("mean k3 = ρ − 1 − log ρ")
    ax.set_title(f"{title}: mismatch KL per position", fontsize=10)
    ax.grid(alpha=0.3)
    paths.append(out_dir / "kl_per_position.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def report(s: Sample, setting: dict[str, Any], out_dir: Path, plots: bool = True) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = float(s.batch.mask.sum())
    result = {
        "setting": setting,
        "samples": len(s.batch.mask),
        "tokens": tokens,
        "engine_tokens_per_s": None if s.seconds is None else tokens / max(s.seconds, 1e-9),
        "mismatch": mismatch(s),
        "breakdowns": breakdowns(s),
        "what_if": what_if(s),
    }
    if plots:
        label = setting.get("label") or f"{setting['engine']} {setting['engine_dtype']} vs trainer {setting['trainer_dtype']}"
        result["plots"] = [str(p) for p in plot(s, out_dir, label)]
    return result
