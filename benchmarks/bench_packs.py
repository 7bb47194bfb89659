"""A long prompt's group, packed or not (issue #67): one prompt of ``--prompt`` tokens and ``--group`` responses of
``--response``/2 to ``--response`` tokens, the trainer's forward + backward of log π (``trainer_logprobs``, the
update's micro-batches: ``Scorer.micro_batches`` and ``Scorer.to_device``) under each ``--budgets`` token budget.

    rows      every row whole (micro-batches of whole rows, the forward of a model that does not pack)
    cap only  packs with the span before issue #67: a pack's responses start within cap − len(prompt) tokens of its
              first (clamped to 1), so past the 1,024-token cap each response is its own pack
    packs     this code's packs (``shared_prompt.spans``): a long prompt's responses span up to its own length, as
              far as the budget allows

The table: the micro-batches, the prompt tokens computed (the prompt once per pack or row), all tokens computed, and
the median forward + backward of ``--repeats`` (the variants alternate, so a loaded machine slows each alike).
A Qwen2 model built in code (2 layers, ``--hidden`` wide, 4 heads, vocabulary 4,096), fp32, on the CPU.

    python benchmarks/bench_packs.py                               # 1,500-token prompt × 8, budgets 2048, 4096, none
    python benchmarks/bench_packs.py --prompt 300 --repeats 1      # a short prompt: the three alike but rows
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args):
    import transformers

    from offpolicy.engines import Rollouts
    from offpolicy.policy.batch import to_batch

    config = transformers.Qwen2Config(vocab_size=4096, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=args.hidden // 4,
                                      max_position_embeddings=2 * (args.prompt + args.response))
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).train()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 4096, (args.prompt,), generator=g).tolist()
    lengths = torch.randint(max(1, args.response // 2), args.response + 1, (args.group,), generator=g).tolist()
    responses = [torch.randint(1, 4096, (n,), generator=g).tolist() for n in lengths]
    batch = to_batch(Rollouts([prompt] * args.group, responses, [[-1.0] * n for n in lengths], [True] * args.group,
                              version=0), 0)
    return model, batch


def micro_batches(model, batch, budget: int | None, variant: str) -> list:
    """The device micro-batches the update would run for ``variant`` (module doc)."""
    from offpolicy.policy.score import Scorer
    from offpolicy.core.sampling import SamplingConfig
    from offpolicy.speed import shared_prompt

    scorer = Scorer(model, SamplingConfig(), torch.device("cpu"), budget=budget, by_packs=variant != "rows")
    spans = shared_prompt.spans
    if variant == "cap only":
        shared_prompt.spans = lambda prompt, longest, cap, budget: (cap - prompt).clamp(min=1)
    try:
        rows = torch.arange(len(batch.mask))
        mbs = [scorer.to_device(batch, part) for part in scorer.micro_batches(batch, rows)]
    finally:
        shared_prompt.spans = spans
    return mbs  # "rows": micro-batches of whole rows run whole (they cut through the step's packs)


def counts(mbs) -> tuple[int, int]:
    """(prompt tokens, all tokens) the micro-batches' forwards compute."""
    prompt = tokens = 0
    for mb in mbs:
        shared = mb.counted.shared
        if shared is None:
            prompt += int((mb.positions[:, 0] + 1).sum())
            tokens += int(mb.attention_mask.sum())
        else:
            prompt += int((shared.segments == 0).sum())
            tokens += int((shared.segments >= 0).sum())
    return prompt, tokens


def step(model, mbs) -> float:
    from offpolicy.policy.head import trainer_logprobs
    from offpolicy.core.sampling import SamplingConfig

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for mb in mbs:
        (trainer_logprobs(model, mb, SamplingConfig()) * mb.mask).sum().backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1500, help="prompt tokens")
    parser.add_argument("--group", type=int, default=8, help="responses of the prompt")
    parser.add_argument("--response", type=int, default=200, help="the longest response; the shortest is half")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--budgets", default="2048,4096,none", help="micro_batch_tokens values, 'none': one batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, batch = build(args)
    budgets = [None if b.strip() == "none" else int(b) for b in args.budgets.split(",")]
    variants = ("rows", "cap only", "packs")
    print(f"prompt {args.prompt} tokens × {args.group} responses of {max(1, args.response // 2)}–{args.response}, "
          f"Qwen2 2 layers × {args.hidden}, fp32, {args.threads} thread(s), median of {args.repeats}")
    print("| budget | variant | micro-batches | prompt tokens | tokens | fwd+bwd s |")
    print("|---:|---|---:|---:|---:|---:|")
    for budget in budgets:
        runs = {v: micro_batches(model, batch, budget, v) for v in variants}
        for v in variants:
            step(model, runs[v])  # warm
        seconds = {v: [] for v in variants}
        for r in range(args.repeats):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                seconds[v].append(step(model, runs[v]))
        for v in variants:
            prompt, tokens = counts(runs[v])
            print(f"| {budget or 'none'} | {v} | {len(runs[v])} | {prompt:,} | {tokens:,} | "
                  f"{statistics.median(seconds[v]):.2f} |")


if __name__ == "__main__":
    main()
