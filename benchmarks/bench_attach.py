"""What ``core/kernels/common.py``'s private ``attach`` saves: the fast rungs hand their analytic derivative to
autograd through ``CoefLoss``/``CoefTokens``; ``attach`` calls torch's C ``apply`` (``torch._C._FunctionBase``)
directly instead of ``torch.autograd.Function.apply``, the public path (issue #44; issue #68 item 7 asks whether
it earns its place behind a gate).

Timed in one process, on the same inputs, interleaved (A, B, A, B, ...) so drift hits both alike:

* ``Function.apply`` — the public path, one call of ``CoefLoss.apply(logprobs, loss, coef, scale)``;
* ``attach`` — the private path, the same call through ``attach``;
* ``policy_loss`` — one whole loss call (forward only, the fused default ``implementation="auto"``: token TIS +
  PPO clip, token-mean, fp32), for the share the difference is of what a caller pays.

Reported: the median over ``--rounds`` rounds of the mean µs a call over ``--calls`` calls, and the ratio against
``Function.apply`` measured in the same run.

    python benchmarks/bench_attach.py                   # B×T = 8×256
    python benchmarks/bench_attach.py --shape 64x1024 --rounds 21
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import offpolicy as op
from offpolicy.core.kernels.common import CoefLoss, attach

CFG = op.LossConfig(kind="ppo", correction=op.CorrectionConfig(weight={"level": "token", "mode": "truncate",
                                                                       "high": 2.0}))


def mean_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x256", help="B×T of the inputs")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, t = (int(x) for x in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(b, t, generator=gen)).requires_grad_()
    old, rollout = -torch.rand(b, t, generator=gen), -torch.rand(b, t, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, t)
    mask = torch.ones(b, t)
    loss, coef, scale = torch.tensor(0.5), torch.rand(b, t, generator=gen), torch.tensor(1.0 / (b * t))

    runs = {
        "Function.apply (public)": lambda: CoefLoss.apply(logprobs, loss, coef, scale),
        "attach (torch._C apply)": lambda: attach(CoefLoss, logprobs, loss, coef, scale),
        "policy_loss (forward, auto)": lambda: op.policy_loss(logprobs, old, adv, mask, rollout_logprobs=rollout,
                                                              config=CFG),
    }
    for fn in runs.values():  # warm-up: first-call work (the rung's choice, caches) out of the timings
        for _ in range(20):
            fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(mean_us(fn, args.calls))
    median = {name: statistics.median(v) for name, v in times.items()}
    base = median["Function.apply (public)"]
    table = Table(title=f"one call, B×T {b}×{t}, {args.threads} thread(s), torch {torch.__version__}: median of "
                        f"{args.rounds} rounds × {args.calls} calls")
    for column in ("path", "µs / call", "× Function.apply", "spread (min–max µs)"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for name, value in median.items():
        table.add_row(name, f"{value:.2f}", f"{value / base:.2f}", f"{min(times[name]):.2f}–{max(times[name]):.2f}")
    console = Console()
    console.print(table)
    saved = base - median["attach (torch._C apply)"]
    console.print(f"attach saves {saved:.2f} µs a call: {saved / median['policy_loss (forward, auto)']:.1%} of one "
                  "policy_loss forward")


if __name__ == "__main__":
    main()
