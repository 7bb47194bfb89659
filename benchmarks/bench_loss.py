"""Time correct + policy_loss, forward + backward: fused fast path vs the readable oracle.

Configuration: token TIS (w = min(ρ, 2)) + PPO clip (ε = 0.2), token-mean, fp32, right-padded
rows of random length, full offpolicy metric set. Implementations, timed in the same process on
the same inputs:

* ``offpolicy readable`` — ``policy_loss(..., implementation="reference")``, the oracle;
* ``offpolicy fused``    — the default fast path (``offpolicy.fused``);
* ``framework-style``    — written in this file the way framework code usually is: autograd
  through every op, one masked mean per metric, each pulled to a Python float (fewer metrics);
* ``OpenRLHF PolicyLoss`` — optional, when ``openrlhf`` is importable (``pip install openrlhf
  --no-deps``; its loss module imports once ``deepspeed`` is stubbed); it computes no IS metrics.

Reported: median wall time of ≥ 5 runs after a warm-up, and peak extra resident memory of one
forward + backward, measured in a fresh process (Linux VmHWM), in MB and in units of B·T fp32.
Ratios are against ``offpolicy readable`` measured in the same run.

    python benchmarks/bench_loss.py                # 64×1024, 256×4096, 1024×8192
    python benchmarks/bench_loss.py --sizes 256x4096 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import offpolicy as op

CFG = op.LossConfig(kind="ppo", correction=op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 2.0}))


# ------------------------------------------------------------------------- reference
def reference(logprobs, old, rollout, adv, mask) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain, unfused: token TIS + PPO clip, metrics one by one (what framework code does)."""
    mask = mask.float()
    n = mask.sum()

    def mmean(x):
        return (x * mask).sum() / n

    log_ratio = torch.clamp(old - rollout, -20, 20)
    rho = torch.exp(log_ratio)
    w = torch.clamp(rho, max=2.0).detach()
    ratio = torch.exp(torch.clamp(logprobs - old, -20, 20))
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 0.8, 1.2)
    per_token = torch.maximum(loss1, loss2) * w
    loss = (per_token * mask).sum() / n
    metrics = {
        "kl_k1": mmean(-log_ratio).item(),
        "kl_k3": mmean(rho - 1 - log_ratio).item(),
        "chi2_token": (mmean(rho * rho) - 1).item(),
        "ppl_train": torch.exp(-(old * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean().item(),
        "ppl_rollout": torch.exp(-(rollout * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean().item(),
        "abs_logp_diff_mean": mmean(log_ratio.abs()).item(),
        "abs_logp_diff_max": (log_ratio.abs() * mask).max().item(),
        "is_mean": mmean(w).item(),
        "is_std": torch.sqrt(mmean(w * w) - mmean(w) ** 2).item(),
        "is_max": torch.where(mask.bool(), w, -torch.inf).max().item(),
        "is_min": torch.where(mask.bool(), w, torch.inf).min().item(),
        "ess": (mmean(rho) ** 2 / mmean(rho * rho)).item(),
        "clip_fraction": mmean((loss2 > loss1).float()).item(),
        "approx_kl": mmean(ratio - 1 - torch.log(ratio)).item(),
    }
    return loss, metrics


def readable_impl(logprobs, old, rollout, adv, mask) -> tuple[torch.Tensor, dict[str, float]]:
    loss, metrics = op.policy_loss(logprobs, old, adv, mask, rollout_logprobs=rollout, config=CFG,
                                   implementation="reference")
    return loss, metrics.to_dict()


def fused_impl(logprobs, old, rollout, adv, mask) -> tuple[torch.Tensor, dict[str, float]]:
    loss, metrics = op.policy_loss(logprobs, old, adv, mask, rollout_logprobs=rollout, config=CFG,
                                   implementation="auto")
    return loss, metrics.to_dict()


def openrlhf_impl():
    """OpenRLHF's PolicyLoss with token TIS (w = clamp(ρ, 0, 2)), or None when it is not importable.

    Its package __init__ pulls in peft/deepspeed/flash-attn; the loss module needs none of them,
    so the two packages are registered bare (their real directories as __path__) and only
    ``openrlhf.models.loss`` runs.
    """
    import importlib.util
    import os
    import sys
    import types

    try:
        spec = importlib.util.find_spec("openrlhf")
        if spec is None or spec.origin is None:
            return None
        root = os.path.dirname(spec.origin)
        for name, path in (("openrlhf", root), ("openrlhf.models", os.path.join(root, "models"))):
            if name not in sys.modules:
                module = types.ModuleType(name)
                module.__path__ = [path]
                sys.modules[name] = module
        sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
        from openrlhf.models.loss import PolicyLoss

        loss_fn = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, is_correction_level="token",
                             is_correction_mode="clip", is_correction_threshold=(0.0, 2.0))
    except Exception:  # noqa: BLE001 — optional baseline, any version mismatch just drops the row
        return None

    def run(logprobs, old, rollout, adv, mask):
        out = loss_fn(logprobs, old, adv, action_mask=mask, rollout_log_probs=rollout)
        return (out[0] if isinstance(out, tuple) else out), {}

    return run


IMPLEMENTATIONS: dict[str, Callable] = {
    "offpolicy readable": readable_impl,
    "offpolicy fused": fused_impl,
    "framework-style": reference,
}
_openrlhf = openrlhf_impl()
if _openrlhf is not None:
    IMPLEMENTATIONS["OpenRLHF PolicyLoss (optional)"] = _openrlhf


# ------------------------------------------------------------------------- measuring
def make_inputs(b: int, t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=g) * 4 - 0.01
    rollout = (old + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0)
    logprobs = (old + 0.02 * torch.randn(b, t, generator=g)).clamp(max=0)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    return {"logprobs": logprobs, "old": old, "rollout": rollout, "adv": adv, "mask": mask}


def _status_kb(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def run_once(fn: Callable, inputs: dict[str, torch.Tensor], lp: torch.Tensor | None = None) -> None:
    lp = inputs["logprobs"].clone().requires_grad_(True) if lp is None else lp
    loss, _ = fn(lp, inputs["old"], inputs["rollout"], inputs["adv"], inputs["mask"])
    loss.backward()


def peak_extra_mb(fn: Callable, inputs: dict[str, torch.Tensor]) -> float:
    """Peak resident memory above the inputs (the π_θ leaf included) during forward + backward;
    the gradient of π_θ, which every implementation must produce, is part of it."""
    lp = inputs["logprobs"].clone().requires_grad_(True)
    gc.collect()
    if not _reset_peak_rss():
        return math.nan
    before = _status_kb("VmRSS")
    run_once(fn, inputs, lp)
    peak = _status_kb("VmHWM")
    return math.nan if before is None or peak is None else (peak - before) / 1024


def median_ms(fn: Callable, inputs: dict[str, torch.Tensor], repeats: int) -> float:
    run_once(fn, inputs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_once(fn, inputs)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check_agreement(inputs: dict[str, torch.Tensor]) -> None:
    """The implementations must compute the same loss, or the timing means nothing."""
    args = {k: inputs[k] for k in ("logprobs", "old", "rollout", "adv", "mask")}
    ref_loss, ref_m = readable_impl(**args)
    fused_loss, fused_m = fused_impl(**args)
    style_loss, style_m = reference(**args)
    for loss in (fused_loss, style_loss):
        assert math.isclose(ref_loss.item(), loss.item(), rel_tol=1e-4, abs_tol=1e-6), (ref_loss, loss)
    if _openrlhf is not None:
        theirs, _ = _openrlhf(**args)
        assert math.isclose(ref_loss.item(), theirs.item(), rel_tol=1e-4, abs_tol=1e-6), ("OpenRLHF", theirs)
    for key, value in ref_m.items():
        assert math.isclose(value, fused_m[key], rel_tol=1e-5, abs_tol=1e-7) or math.isnan(value), key
    for key in ("kl_k1", "is_mean", "clip_fraction", "ess"):
        assert math.isclose(style_m[key], ref_m[f"offpolicy/{key}"], rel_tol=1e-3, abs_tol=1e-6), key


def peak_extra_mb_in_subprocess(name: str, b: int, t: int) -> float:
    """Peak memory in a fresh process with glibc's mmap threshold pinned, so every large tensor is
    mmapped and returned to the OS when freed: resident memory then tracks live tensors and
    VmHWM is a true peak. (Timing runs without this: pinned thresholds make every allocation a
    page-faulting mmap, which would distort the times.)"""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    cmd = [sys.executable, __file__, "--memory-of", name, "--sizes", f"{b}x{t}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x1024,256x4096,1024x8192", help="comma-separated BxT")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # internal: one memory probe
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        b, t = (int(x) for x in args.sizes.lower().split("x"))
        inputs = make_inputs(b, t)
        run_once(IMPLEMENTATIONS[args.memory_of], inputs)  # warm-up: lazy inits are not the loss's memory
        print(peak_extra_mb(IMPLEMENTATIONS[args.memory_of], inputs))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    table = Table(title=f"correct + policy_loss, fwd+bwd, fp32, {torch.get_num_threads()} threads, median of {args.repeats}")
    for col in ("B×T", "implementation", "median ms", "× readable", "peak extra MB", "peak / (B·T fp32)"):
        table.add_column(col, justify="right" if col != "implementation" else "left")
    for size in args.sizes.split(","):
        b, t = (int(x) for x in size.lower().split("x"))
        inputs = make_inputs(b, t)
        check_agreement(inputs)
        baseline = None
        unit_mb = b * t * 4 / 2**20
        for name, fn in IMPLEMENTATIONS.items():
            ms = median_ms(fn, inputs, args.repeats)
            mb = peak_extra_mb_in_subprocess(name, b, t)
            baseline = baseline or ms
            table.add_row(f"{b}×{t}", name, f"{ms:.2f}", f"{ms / baseline:.2f}", f"{mb:.1f}", f"{mb / unit_mb:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
