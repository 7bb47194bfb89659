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

Reported: median wall time of ≥ 5 runs after a warm-up, the first call's seconds at each shape and dtype
(compilation included: the first row of a process pays Triton's JIT or torch.compile, unless their on-disk
caches hold the kernels), and peak extra resident memory of one
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


def _offpolicy(implementation: str) -> Callable:
    def run(logprobs, old, rollout, adv, mask) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = op.policy_loss(logprobs, old, adv, mask, rollout_logprobs=rollout, config=CFG,
                                       implementation=implementation)
        return loss, metrics

    return run


readable_impl = _offpolicy("reference")
fused_impl = _offpolicy("auto")


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
    "offpolicy auto": fused_impl,
    "framework-style": reference,
}
_openrlhf = openrlhf_impl()
if _openrlhf is not None:
    IMPLEMENTATIONS["OpenRLHF PolicyLoss (optional)"] = _openrlhf


def _read(metrics) -> dict[str, float]:
    """What a trainer does with the metrics every step: read them on the host."""
    return metrics.to_dict() if isinstance(metrics, op.Metrics) else metrics


# ------------------------------------------------------------------------- measuring
def make_inputs(b: int, t: int, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=g) * 4 - 0.01
    rollout = (old + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0)
    logprobs = (old + 0.02 * torch.randn(b, t, generator=g)).clamp(max=0)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    out = {"logprobs": logprobs, "old": old, "rollout": rollout, "adv": adv, "mask": mask}
    return {k: (v.to(device=device, dtype=dtype) if k != "mask" else v.to(device)) for k, v in out.items()}


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


def run_once(fn: Callable, inputs: dict[str, torch.Tensor], lp: torch.Tensor | None = None, read: bool = True):
    lp = inputs["logprobs"].clone().requires_grad_(True) if lp is None else lp
    loss, metrics = fn(lp, inputs["old"], inputs["rollout"], inputs["adv"], inputs["mask"])
    loss.backward()
    if read:
        _read(metrics)
    return lp


def peak_extra_mb(fn: Callable, inputs: dict[str, torch.Tensor]) -> float:
    """Peak memory above the inputs (the π_θ leaf included) during forward + backward; the
    gradient of π_θ, which every implementation must produce, is part of it."""
    lp = inputs["logprobs"].clone().requires_grad_(True)
    gc.collect()
    if lp.is_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_once(fn, inputs, lp)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    if not _reset_peak_rss():
        return math.nan
    before = _status_kb("VmRSS")
    run_once(fn, inputs, lp)
    peak = _status_kb("VmHWM")
    return math.nan if before is None or peak is None else (peak - before) / 1024


def timed_s(fn: Callable, inputs: dict[str, torch.Tensor]) -> float:
    """Seconds of one forward + backward + metric read, the device synchronised on both sides."""
    if inputs["mask"].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    run_once(fn, inputs)
    if inputs["mask"].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def first_call_s(fn: Callable, inputs: dict[str, torch.Tensor]) -> float:
    """Seconds of the first forward + backward + metric read at this shape and dtype in this process: what
    a new configuration costs before its first step (Triton's JIT and torch.compile included, unless their
    on-disk caches already hold it)."""
    return timed_s(fn, inputs)


def median_ms(fns: dict[str, Callable], inputs: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """Median wall time (ms) of forward + backward + reading the metrics on the host (a sync on a GPU)
    of each implementation, their repeats interleaved — one call of each in turn — so that a burst of
    load on a shared machine hits them alike and the ratios of one run compare like with like."""
    for fn in fns.values():
        for _ in range(3):
            run_once(fn, inputs)  # warm-up: compiles, autotuning, caches
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed_s(fn, inputs) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


PEERS = ("framework-style", "OpenRLHF PolicyLoss (optional)")  # "× fastest peer": ours ÷ the faster of these


def _per_call_us(calls_of: list[Callable[[], object]], calls: int, rounds: int = 7) -> list[float]:
    """µs per call of each callable: the median over ``rounds`` rounds of ``calls`` calls, the
    callables' rounds interleaved (a burst of load on a shared machine then hits all of them alike),
    after ``calls // 3`` warm-up calls of each."""
    for call in calls_of:
        for _ in range(calls // 3):
            call()
    times: list[list[float]] = [[] for _ in calls_of]
    for _ in range(rounds):
        for call, out in zip(calls_of, times):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            out.append((time.perf_counter() - start) / calls * 1e6)
    return [statistics.median(out) for out in times]


def host_overhead_us(device: str, calls: int = 300, b: int = 8, t: int = 64,
                     rounds: int = 7) -> tuple[float, float, float, float, float]:
    """Microseconds of host work per call of the Triton rung — ``policy_loss(implementation="triton")``
    forward, and forward + backward — with its kernel launches stubbed out: what a GPU step pays on the
    host around its 3 kernels (the launches' own cost is Triton's). The finishing kernel's stub writes
    "one valid token, no refusal" into the checks (on the CPU they are read at once). On the CPU the rung
    runs where ``TRITON_INTERPRET=1`` (set here for the measurement).

    Measured in the same interleaved rounds, for scale, what torch itself costs the host now:
    ``torch.empty(100)``, and ``x.sum().backward()`` of a fresh [b, t] leaf — one autograd node and
    the engine's round trip, the least any loss's forward + backward can cost. Returns (forward,
    forward + backward, forward with a new config, empty, floor)."""
    from offpolicy.core.kernels import triton as tk

    if not tk.available():
        return math.nan, math.nan, math.nan, math.nan, math.nan
    saved_env = os.environ.get("TRITON_INTERPRET")
    if not device.startswith("cuda"):
        os.environ["TRITON_INTERPRET"] = "1"
    kernels = (tk._row_stats, tk._tokens, tk._finish)
    saved = [k.__dict__.get("run") for k in kernels]
    template: dict[int, torch.Tensor] = {}

    def finish(*args, grid, warmup, **kwargs):
        flat = args[1]
        if flat.numel() not in template:
            template[flat.numel()] = torch.zeros_like(flat)
            template[flat.numel()][-len(tk._CHECKS)] = 1.0  # n_input = 1, no refusal
        flat.copy_(template[flat.numel()])

    inputs = make_inputs(b, t, device=device)
    try:
        tk._row_stats.run = tk._tokens.run = lambda *args, grid, warmup, **kwargs: None
        tk._finish.run = finish

        def call(backward: bool, config: op.LossConfig = CFG) -> None:
            lp = inputs["logprobs"].detach().requires_grad_(True)
            loss, _ = op.policy_loss(lp, inputs["old"], inputs["adv"], inputs["mask"],
                                     rollout_logprobs=inputs["rollout"], config=config, implementation="triton")
            if backward:
                loss.backward()

        # one config a call (made beforehand: their construction is the caller's), each cap its own number
        fresh = iter([CFG.model_copy(update={"correction": CFG.correction.model_copy(update={
            "weight": CFG.correction.weight.model_copy(update={"high": 2.0 + i * 1e-3})})})
            for i in range(calls // 3 + rounds * calls)])

        x = torch.zeros(b, t, device=device)

        def floor() -> None:
            x.detach().requires_grad_(True).sum().backward()

        forward, step, new_config, empty, least = _per_call_us(
            [lambda: call(False), lambda: call(True), lambda: call(False, next(fresh)),
             lambda: torch.empty(100, device=device), floor], calls, rounds)
        return forward, step, new_config, empty, least
    finally:
        for kernel, run in zip(kernels, saved):
            if run is None:
                kernel.__dict__.pop("run", None)
            else:
                kernel.run = run
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


def kernel_table(fn: Callable, inputs: dict[str, torch.Tensor], rows: int = 15) -> str:
    """torch.profiler's table of one warm call: where the device time goes, kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if inputs["mask"].is_cuda else [])
    run_once(fn, inputs)
    with profile(activities=activities) as prof:
        run_once(fn, inputs)
        if inputs["mask"].is_cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if inputs["mask"].is_cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def kernels_and_syncs(fn: Callable, inputs: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(CUDA kernels launched, host synchronisations) by one forward + backward, the metrics
    left on the device (``to_dict``'s one copy is not counted)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    run_once(fn, inputs, read=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_once(fn, inputs, read=False)
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_once(fn, inputs, read=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    return kernels, syncs


def check_agreement(inputs: dict[str, torch.Tensor]) -> None:
    """The implementations must compute the same loss, or the timing means nothing. offpolicy's
    rungs compute in fp32 whatever the input dtype and must agree closely; the framework-style code
    and OpenRLHF compute in the input dtype (bf16: within 2 %)."""
    args = {k: inputs[k] for k in ("logprobs", "old", "rollout", "adv", "mask")}
    low_precision = inputs["old"].dtype != torch.float32
    ref_loss, ref_m = readable_impl(**args)
    fast_loss, fast_m = fused_impl(**args)
    style_loss, style_m = reference(**args)
    ref_m, fast_m = _read(ref_m), _read(fast_m)
    # the loss is a mean of signed terms of size ~1: its rounding error is absolute, ~1e-6
    assert math.isclose(ref_loss.item(), fast_loss.item(), rel_tol=1e-4, abs_tol=1e-5), (ref_loss, fast_loss)
    theirs = [style_loss] + ([_openrlhf(**args)[0]] if _openrlhf is not None else [])
    for loss in theirs:
        tol = dict(rel_tol=2e-2, abs_tol=1e-3) if low_precision else dict(rel_tol=1e-4, abs_tol=1e-5)
        assert math.isclose(ref_loss.item(), float(loss), **tol), (ref_loss, loss)
    for key, value in ref_m.items():
        assert math.isclose(value, fast_m[key], rel_tol=1e-4, abs_tol=1e-6) or math.isnan(value), (key, value, fast_m[key])
    if not low_precision:
        for key in ("kl_k1", "is_mean", "clip_fraction", "ess"):
            assert math.isclose(style_m[key], ref_m[f"offpolicy/{key}"], rel_tol=1e-3, abs_tol=1e-6), key


def peak_extra_mb_in_subprocess(name: str, b: int, t: int) -> float:
    """CPU: peak memory in a fresh process with glibc's mmap threshold pinned, so every large tensor
    is mmapped and returned to the OS when freed: resident memory then tracks live tensors and
    VmHWM is a true peak. (Timing runs without this: pinned thresholds make every allocation a
    page-faulting mmap, which would distort the times.)"""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    cmd = [sys.executable, __file__, "--memory-of", name, "--sizes", f"{b}x{t}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="comma-separated BxT (default: 64x1024,256x4096,1024x8192 "
                        "on the CPU; 256x4096,1024x8192,64x32768 on CUDA)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtypes", default="fp32", help="input dtypes, comma-separated: fp32,bf16 (CUDA)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 7 CPU, 50 CUDA)")
    parser.add_argument("--bandwidth", type=float, default=3.0, help="TB/s for the traffic bound (CUDA)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's kernel table of "
                        "`offpolicy auto` (one warm forward + backward) at each size and dtype")
    parser.add_argument("--host-only", action="store_true", help="print the host-overhead row alone")
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # internal: one memory probe
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    sizes = args.sizes or ("256x4096,1024x8192,64x32768" if cuda else "64x1024,256x4096,1024x8192")
    repeats = args.repeats or (50 if cuda else 7)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        b, t = (int(x) for x in sizes.lower().split("x"))
        inputs = make_inputs(b, t)
        run_once(IMPLEMENTATIONS[args.memory_of], inputs)  # warm-up: lazy inits are not the loss's memory
        print(peak_extra_mb(IMPLEMENTATIONS[args.memory_of], inputs))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    forward_us, step_us, new_config_us, empty_us, floor_us = host_overhead_us(args.device)
    load = f"load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "load unknown"
    host = Table(title="host overhead of the Triton rung per call, kernel launches stubbed "
                       f"(8×64 inputs; goal ≤ 50 µs; {load})")
    for col in ("device", "forward µs", "forward + backward µs", "forward, a new config µs", "torch.empty(100) µs",
                "x.sum().backward() µs"):
        host.add_column(col, justify="right")
    host.add_row(args.device, f"{forward_us:.1f}", f"{step_us:.1f}", f"{new_config_us:.1f}", f"{empty_us:.1f}",
                 f"{floor_us:.1f}")
    console.print(host)
    if args.host_only:
        return
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    table = Table(title=f"correct + policy_loss, fwd+bwd + metrics read on the host, {where}, median of {repeats} "
                        "(implementations interleaved)")
    columns = ["B×T", "dtype", "implementation", "median ms", "× OpenRLHF" if cuda and _openrlhf else "× readable",
               "× fastest peer", "peak extra MB", "peak / (B·T fp32)", "first call s"]
    if cuda:
        columns += ["kernels", "syncs", "traffic bound ms"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("implementation", "dtype") else "right")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    profiles: list[tuple[str, str]] = []
    for size in sizes.split(","):
        b, t = (int(x) for x in size.lower().split("x"))
        for dtype_name in args.dtypes.split(","):
            dtype = dtypes[dtype_name]
            inputs = make_inputs(b, t, device=args.device, dtype=dtype)
            first = {name: first_call_s(fn, inputs) for name, fn in IMPLEMENTATIONS.items()}
            check_agreement(inputs)
            unit_mb = b * t * 4 / 2**20
            rows = {}
            medians = median_ms(IMPLEMENTATIONS, inputs, repeats)
            for name, fn in IMPLEMENTATIONS.items():
                ms = medians[name]
                mb = peak_extra_mb(fn, inputs) if cuda else peak_extra_mb_in_subprocess(name, b, t)
                extra = []
                if cuda:
                    kernels, syncs = kernels_and_syncs(fn, inputs)
                    # each input read once (4 [B, T] tensors + the mask) and the gradient written once
                    traffic = b * t * (4 * inputs["old"].element_size() + 4 + inputs["old"].element_size())
                    extra = [str(kernels), str(syncs), f"{traffic / (args.bandwidth * 1e12) * 1e3:.3f}"]
                rows[name] = (ms, mb, [f"{first[name]:.2f}", *extra])
            if args.profile:
                profiles.append((f"{b}×{t} {dtype_name}", kernel_table(fused_impl, inputs)))
            baseline = rows.get("OpenRLHF PolicyLoss (optional)", rows["offpolicy readable"])[0] if cuda else \
                rows["offpolicy readable"][0]
            fastest_peer = min(rows[name][0] for name in PEERS if name in rows)
            for name, (ms, mb, extra) in rows.items():
                table.add_row(f"{b}×{t}", dtype_name, name, f"{ms:.3f}", f"{ms / baseline:.2f}",
                              f"{ms / fastest_peer:.2f}", f"{mb:.1f}", f"{mb / unit_mb:.1f}", *extra)
    console.print(table)
    for title, text in profiles:
        print(f"\noffpolicy auto, {title}: one warm forward + backward + metric read, by self time")
        print(text)


if __name__ == "__main__":
    main()
