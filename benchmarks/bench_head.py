"""Time the trainer's head (``policy/head.py``): forward + backward of ``token_logprobs`` over N tokens at
vocabulary V and hidden size H, fp32 and bf16 autocast over fp32 weights, before and after issue #44.

"before" is the backward as it was at 3be706e (kept here as the baseline): a fresh autocast region per
chunk, which casts W [V, H] again in every chunk, and a bf16 [V, H] product per chunk added into the fp32
weight gradient. "after" is the library's: W cast once per backward, the product accumulated in fp32 in
place. Both compute the same gradient up to bf16 rounding (checked here: max relative difference).

    python benchmarks/bench_head.py --device cuda                       # V = 151,936, H = 896, 16k tokens
    python benchmarks/bench_head.py --vocab 4096 --hidden 64 --tokens 512  # a quick CPU run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from offpolicy.engines.base import SamplingConfig
from offpolicy.policy import head as H
from offpolicy.policy.head import LinearHead, token_logprobs


def _before_backward(ctx, grad_lp, _grad_extra):
    """``_ChunkedHead.backward`` at 3be706e: autocast entered per chunk, bf16 [V, H] product per chunk."""
    hidden, weight, bias, tokens, token_lp = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    device, autocast, autocast_dtype = ctx.autocast
    zero = torch.zeros((), dtype=grad_lp.dtype, device=grad_lp.device)
    grad_lp = torch.where(torch.isfinite(token_lp), grad_lp, zero)
    d_hidden = torch.zeros_like(hidden) if need_hidden else None
    d_weight = torch.zeros_like(weight) if need_weight else None
    d_bias = torch.zeros_like(bias) if need_bias else None
    weight_c = None
    for start in range(0, hidden.shape[0], ctx.chunk):
        end = min(hidden.shape[0], start + ctx.chunk)
        h = hidden[start:end]
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
            lin = F.linear(h, weight, bias)
        d_lin = H._chunk_grad(lin, tokens[start:end], grad_lp[start:end], ctx.sampling, ctx.softcap)
        del lin
        if weight_c is None:
            weight_c = weight if weight.dtype == d_lin.dtype else weight.to(d_lin.dtype)
        if need_hidden:
            d_hidden[start:end] = d_lin.mm(weight_c).to(hidden.dtype)
        if need_weight:
            h_c = h.to(d_lin.dtype)
            if d_weight.dtype == d_lin.dtype:
                d_weight.addmm_(d_lin.t(), h_c)
            else:
                d_weight.add_(d_lin.t().mm(h_c))
        if need_bias:
            d_bias.add_(d_lin.sum(dim=0))
        del d_lin
    return d_hidden, d_weight, d_bias, None, None, None, None, None


def step(weight, hidden, tokens, bf16: bool, device: str):
    weight.grad = hidden.grad = None
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        lp = token_logprobs(hidden, tokens, LinearHead(weight, None, None), SamplingConfig()).logprobs
    lp.sum().backward()
    return weight.grad, hidden.grad


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = args.device
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).to(device).requires_grad_(True)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device).requires_grad_(True)
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    print(f"head fwd+bwd, V={args.vocab} H={args.hidden} N={args.tokens} on {device} "
          f"(chunk {H.chunk_tokens(args.vocab, device)} tokens), median of {args.repeats}")
    after = H._ChunkedHead.backward
    for precision in ("fp32", "bf16"):
        grads = {}
        for variant, backward in (("before", _before_backward), ("after", after)):
            H._ChunkedHead.backward = staticmethod(backward)
            try:
                run = lambda: step(weight, hidden, tokens, precision == "bf16", device)  # noqa: E731
                first = timed(run, device)
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                seconds = [timed(run, device) for _ in range(args.repeats)]
                peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
                # kept on the host: a float64 copy on the device would sit in the next variant's peak
                # (the 2026-11-26 H100 run read "after" 1.1 GiB higher for exactly that reason)
                grads[variant] = tuple(g.detach().to("cpu", torch.float64) for g in (weight.grad, hidden.grad))
            finally:
                H._ChunkedHead.backward = staticmethod(after)
            print(f"  {precision:5s} {variant:6s}: {statistics.median(seconds) * 1e3:9.1f} ms "
                  f"(first {first * 1e3:.0f} ms), peak {peak:.2f} GiB")
        diff = max(float((a - b).abs().max() / (b.abs().max() + 1e-30))
                   for a, b in zip(grads["after"], grads["before"]))
        print(f"  {precision:5s} after vs before: max relative difference of the gradients {diff:.2e}")


if __name__ == "__main__":
    main()
