"""Peak memory as the response length grows, at a real vocabulary (issue #31): one training step,
the hf engine's generate and the eval's answer log-prob, the old path against the current one, in the same run.

    step      the default step (π_old = sg(π_θ), no π_old forward): forward, the `recommended` loss,
              backward, AdamW — ``update.optimizer_step`` itself. "old" swaps in the head of 4efb1a7
              (logits at every position [B, L, V], gathered [B, T, V], fp32 renormalisation and
              entropy over [B, T, V]); "new" is ``policy/head.py``.
    generate  ``HFEngine.generate``. "old" is the engine of 4efb1a7 (``output_scores=True``: every
              step's [B, V] scores kept, stacked and log-softmaxed); "new" keeps O(B·V).
    eval      ``evaluate.answer_logprobs`` over 16 rows (one chunk of the trainer's eval) of prompt + a
              T-token answer. "old" is its code before issue #67 (the model's logits [16, L, V] of the
              chunk, log-softmaxed row by row); "new" goes through ``policy/head.py`` (chunks of tokens).

A small model built in code (Llama, 2 layers, width 64, vocabulary 151,936 — Qwen2.5's; its stop
token's output row is 0 and the others are scaled up, so no response stops early) and B rows of
prompt + T response tokens, T in ``--lengths``. Every configuration runs in its own process
(``--worker``): CPU — the op's peak RSS above the process's RSS just before it (``ru_maxrss`` is
the kernel's peak); CUDA — ``max_memory_allocated`` above the memory allocated before it. A
configuration whose predicted peak exceeds ``--max-gib`` is skipped and says so (the old path at
T = 4096 needs tens of GiB). Then an estimate at Qwen2.5-0.5B's shapes (64 rows, prompt 194 +
response 256, V = 151,936; bf16 autocast over fp32 weights, AdamW): weights, gradients and
optimizer state by arithmetic, the decoder's saved activations measured per token and layer with
``saved_tensors_hooks`` on a two-layer model of that width, the head by its buffers.

    python benchmarks/bench_memory.py                      # CPU, T = 256, 1024, 4096, 4 rows
    python benchmarks/bench_memory.py --device cuda --rows 16
    python benchmarks/bench_memory.py --quick              # T = 64, 256, 2 rows: a check that it runs

Timings are not the point here; on a shared machine RSS is still exact (it is this process's own).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB = 151_936
PROMPT = 32
MIB = 2**20
GIB = 2**30


# ------------------------------------------------------------------------------------------ the old paths
def old_trainer_logprobs(model, batch, sampling, metrics=None, **_):
    """train/batch.py's ``trainer_logprobs`` at 4efb1a7: logits at every position, then [B, T, V]."""
    import torch

    from offpolicy.core.sampling import outside_mass_metrics, renormalize_logprobs
    from offpolicy.policy.head import token_entropy

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, L, V]
    index = batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    response_logits = logits.gather(1, index).to(torch.promote_types(logits.dtype, torch.float32))  # [B, T, V]
    if sampling.top_k == -1 and sampling.top_p == 1.0:
        z = response_logits / sampling.temperature if sampling.temperature != 1.0 else response_logits
        token_lp = z.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
        if metrics is not None:
            metrics.mean("entropy", token_entropy(z.detach().log_softmax(-1)), batch.mask.bool())
    else:
        logprobs, outside = renormalize_logprobs(response_logits, top_p=sampling.top_p, top_k=sampling.top_k,
                                                 temperature=sampling.temperature, return_outside_mass=True)
        token_lp = logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        if metrics is not None:
            outside_mass_metrics(outside.detach(), batch.mask, metrics)
            metrics.mean("entropy", token_entropy(logprobs.detach()), batch.mask.bool())
    return torch.where(batch.mask.bool(), token_lp, torch.zeros((), device=token_lp.device))


def old_generate(engine, prompt_ids, sampling, seed):
    """engines/hf.py's ``generate`` at 4efb1a7: ``output_scores=True``, every step stacked [B, steps, V]."""
    import torch

    from offpolicy.engines.base import left_pad

    pad = engine.tokenizer.pad_token_id
    input_ids, attention = (t.to(engine.device) for t in left_pad(prompt_ids, pad))
    torch.manual_seed(seed)
    out = engine.model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                                temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                                max_new_tokens=sampling.max_tokens, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=pad, eos_token_id=engine.stop)
    new_tokens = out.sequences[:, input_ids.shape[1]:]
    scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [B, steps, V]
    return scores.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)


EVAL_ROWS = 16  # the eval's chunk of answer log-probs: evaluate's chunk of 64 prompts // 4


def old_answer_logprobs(policy, tokenizer, problems, trainer_dtype="fp32", chunk=16):
    """train/evaluate.py's ``answer_logprobs`` before issue #67: the model's logits [rows, L, V] of a chunk."""
    import torch

    from offpolicy.policy.score import precision
    from offpolicy.tasks.tokenizer import prompt_ids

    eos = tokenizer.eos_token_id
    rows = [(prompt_ids(tokenizer, p), [*tokenizer(p.answer, add_special_tokens=False).input_ids, eos])
            for p in problems]
    totals, counts = [], []
    with torch.no_grad():
        for start in range(0, len(rows), chunk):
            part = rows[start: start + chunk]
            width = max(len(a) + len(b) for a, b in part)
            ids = torch.full((len(part), width), tokenizer.pad_token_id, dtype=torch.long)
            attention = torch.zeros((len(part), width), dtype=torch.long)
            for i, (prompt, answer) in enumerate(part):
                ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                attention[i, : len(prompt) + len(answer)] = 1
            with precision(policy.device, trainer_dtype):
                logits = policy(input_ids=ids.to(policy.device), attention_mask=attention.to(policy.device)).logits
            for i, (prompt, answer) in enumerate(part):
                at = logits[i, len(prompt) - 1: len(prompt) + len(answer) - 1].float()
                logp = torch.log_softmax(at, dim=-1).gather(1, torch.tensor(answer, device=at.device)[:, None])
                totals.append(float(logp.sum()))
                counts.append(len(answer))
    return totals, counts


# ------------------------------------------------------------------------------------------ model
def save_model(out: Path, vocab: int, hidden: int, layers: int) -> Path:
    """A small Llama whose stop token is never drawn (its output row 0, the others scaled to logits of
    σ ≈ √hidden), with the char tokenizer; saved to ``out``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from offpolicy.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=8192 + PROMPT, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(50.0)
        head[tok.eos_token_id].zero_()
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------ worker
def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(what: str, path: str, length: int, rows: int, model_dir: str, device_name: str) -> dict:
    import torch

    import offpolicy as op  # noqa: F401
    from offpolicy.engines import Rollouts, SamplingConfig
    from offpolicy.core.metrics import Metrics
    from offpolicy.tasks.tokenizer import load_tokenizer
    from offpolicy.policy import score
    from offpolicy.policy.batch import to_batch
    from offpolicy.train import update
    from offpolicy.train.config import TrainConfig, resolve_trainer_dtype

    device = torch.device(device_name)
    tok = load_tokenizer(model_dir)
    sampling = SamplingConfig(max_tokens=length)
    g = torch.Generator().manual_seed(0)
    prompts = [[tok.bos_token_id, *torch.randint(5, 40, (PROMPT - 1,), generator=g).tolist()] for _ in range(rows)]
    if what == "eval":
        from offpolicy.tasks.tasks import Problem
        from offpolicy.train import evaluate

        policy = score.load_policy(model_dir, device).train()  # as the trainer holds it
        digits = torch.randint(0, 10, (EVAL_ROWS, length - 1), generator=g).tolist()  # + EOS: T answer tokens
        problems = [Problem("", "".join(map(str, d)), tuple(p))
                    for d, p in zip(digits, [prompts[i % rows] for i in range(EVAL_ROWS)])]
        answer = old_answer_logprobs if path == "old" else evaluate.answer_logprobs

        def run():
            _, counts = answer(policy, tok, problems, chunk=EVAL_ROWS)
            return max(counts)
    elif what == "generate":
        from offpolicy.engines.hf import HFEngine

        engine = HFEngine(model_dir, tok, dtype="fp32", device=device)

        def run():
            if path == "old":
                return old_generate(engine, prompts, sampling, seed=0).shape[1]
            return len(engine.generate(prompts, sampling, seed=0, version=0).response_ids[0])
    else:
        trainer_dtype = resolve_trainer_dtype(TrainConfig(), device)[0]
        policy = score.load_policy(model_dir, device).train()
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        responses = [torch.randint(5, VOCAB, (length,), generator=g).tolist() for _ in range(rows)]
        logprobs = [[-1.0] * length for _ in range(rows)]
        batch = to_batch(Rollouts(prompts, responses, logprobs, [False] * rows, version=0), tok.pad_token_id)
        adv = torch.randn(rows, 1, generator=g).expand_as(batch.mask).contiguous()
        loss_cfg = TrainConfig().loss_config()
        if path == "old":
            score.trainer_logprobs = old_trainer_logprobs  # Scorer.forward's head, as at 4efb1a7

        def run():
            update.optimizer_step(score.Scorer(policy, sampling, device, trainer_dtype), optimizer, batch,
                                  torch.arange(rows), adv, old_of=lambda r, mb, lp: lp.detach(), loss_cfg=loss_cfg,
                                  max_grad_norm=1.0, metrics=Metrics())
            return length
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        produced = run()
        torch.cuda.synchronize(device)
        return {"op_bytes": torch.cuda.max_memory_allocated(device) - before, "tokens": produced}
    before = _resident()
    produced = run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"op_bytes": max(0, peak - before), "peak_bytes": peak, "tokens": produced}


# ------------------------------------------------------------------------------------------ parent
def predicted_old_bytes(what: str, rows: int, length: int, vocab: int) -> int:
    """What the old path holds at its peak, roughly: generate 3 × [B, T, V] fp32 (scores, stack,
    log-softmax); step [B, L, V] logits + about 6 × [B, T, V] fp32 (gather, cast, log-softmax,
    entropy temporaries, gradients)."""
    btv = rows * length * vocab * 4
    if what == "eval":  # the chunk's logits [16, L, V] fp32
        return EVAL_ROWS * (PROMPT + length) * vocab * 4
    return 3 * btv if what == "generate" else rows * (PROMPT + length) * vocab * 4 + 6 * btv


def available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def run_config(what: str, path: str, length: int, args, model_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", what, path, str(length), "--rows", str(args.rows),
           "--model-dir", str(model_dir), "--device", args.device]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def decoder_activation_bytes_per_token_layer(hidden: int, intermediate: int, heads: int, kv_heads: int,
                                             length: int, device: str) -> float:
    """Bytes autograd saves per token and decoder layer under bf16 autocast over fp32 weights at
    sequences of ``length`` tokens, measured with ``saved_tensors_hooks`` (each storage once) on Qwen2
    models of this width: the difference between 2 and 1 rows, and between 2 and 1 layers, so the
    embedding, the final norm and the weights' bf16 copies cancel."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def saved(layers: int, rows: int) -> int:
        config = Qwen2Config(vocab_size=1024, hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=max(1024, length), tie_word_embeddings=True)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(device).train()
        seen: dict[tuple[int, int], int] = {}

        def pack(t):
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
            return t

        ids = torch.randint(0, 1024, (rows, length), device=device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            model.model(input_ids=ids, use_cache=False)
        return sum(seen.values())

    per_row = {layers: saved(layers, 2) - saved(layers, 1) for layers in (1, 2)}
    return (per_row[2] - per_row[1]) / length


def qwen_estimate(device: str) -> list[tuple[str, float, float]]:
    """(term, old GiB, new GiB) at Qwen2.5-0.5B's shapes."""
    rows, prompt, response, vocab, hidden, layers = 64, 194, 256, 151_936, 896, 24
    params = 494_032_768  # Qwen2.5-0.5B, tied embeddings
    tokens = rows * (prompt + response)
    per_token_layer = decoder_activation_bytes_per_token_layer(hidden, 4_864, 14, 2, prompt + response, device)
    decoder = per_token_layer * layers * tokens
    btv, blv = rows * response * vocab, rows * (prompt + response) * vocab
    # old head at its forward peak (4efb1a7, with the entropy metric): the bf16 logits [B, L, V], the
    # gathered [B, T, V] bf16 and its fp32 cast (kept by logsumexp for the backward), and over [B, T, V]
    # in fp32: the log-softmax for the entropy, exp, the product and the where of token_entropy
    old_head = blv * 2 + btv * (2 + 4) + btv * 4 * 4
    from offpolicy.policy.head import chunk_tokens

    chunk = chunk_tokens(vocab, "cuda")  # the estimate is for an 80 GB card
    new_head = 6 * chunk * vocab * 4 + vocab * hidden * 2  # a chunk's few [C, V] buffers + W in bf16
    state = [("weights fp32", params * 4), ("gradients fp32", params * 4), ("AdamW moments fp32", params * 8)]
    out = [(name, b / GIB, b / GIB) for name, b in state]
    out.append((f"decoder activations ({per_token_layer / 1024:.1f} KiB/token/layer measured)", decoder / GIB,
                decoder / GIB))
    out.append(("head (logits / chunks)", old_head / GIB, new_head / GIB))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=None, help="B (default 4; 2 with --quick)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="T values (default 256 1024 4096)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-gib", type=float, default=None,
                        help="skip a configuration predicted above this (default: 70%% of the free memory)")
    parser.add_argument("--quick", action="store_true", help="T = 64, 256 and 2 rows: a check that it runs")
    parser.add_argument("--ops", nargs="+", choices=("step", "generate", "eval"), default=["step", "generate", "eval"],
                        help="what to measure (eval: 16 rows whatever --rows)")
    parser.add_argument("--no-estimate", action="store_true", help="skip the Qwen2.5-0.5B estimate")
    parser.add_argument("--worker", nargs=3, metavar=("WHAT", "PATH", "T"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rows = args.rows or (2 if args.quick else 4)
    if args.worker:
        what, path, length = args.worker
        print(json.dumps(worker(what, path, int(length), args.rows, args.model_dir, args.device)))
        return
    lengths = args.lengths or ([64, 256] if args.quick else [256, 1024, 4096])
    limit = (args.max_gib * GIB) if args.max_gib else 0.7 * available_bytes(args.device)
    print(f"bench_memory: device {args.device}, V = {VOCAB:,}, B = {args.rows} (eval: {EVAL_ROWS}), prompt {PROMPT}, "
          f"Llama {args.layers} layers × width {args.hidden}; memory of the op above the process before it")
    print(f"{'op':<9} {'T':>6} {'old MiB':>10} {'new MiB':>10} {'old/new':>8}  {'[B,T,V] fp32 MiB':>16}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(Path(tmp) / "model", VOCAB, args.hidden, args.layers)
        for what in args.ops:
            for length in lengths:
                cells = {}
                for path in ("old", "new"):
                    predicted = predicted_old_bytes(what, args.rows, length, VOCAB) if path == "old" else 0
                    if predicted > limit:
                        cells[path] = f"skip>{predicted / GIB:.0f}G"
                        continue
                    result = run_config(what, path, length, args, model_dir)
                    if "error" in result:
                        cells[path] = "error"
                        print(f"  {what} {path} T={length}: {result['error']}", file=sys.stderr)
                    else:
                        if result["tokens"] != length:
                            print(f"  {what} {path} T={length}: only {result['tokens']} tokens", file=sys.stderr)
                        cells[path] = result["op_bytes"] / MIB
                old, new = cells["old"], cells["new"]
                ratio = f"{old / new:.1f}×" if isinstance(old, float) and isinstance(new, float) and new > 0 else "–"
                fmt = lambda v: f"{v:10.0f}" if isinstance(v, float) else f"{v:>10}"  # noqa: E731
                btv = (EVAL_ROWS if what == "eval" else args.rows) * length * VOCAB * 4 / MIB
                print(f"{what:<9} {length:>6} {fmt(old)} {fmt(new)} {ratio:>8}  {btv:16.0f}", flush=True)
    if args.no_estimate:
        return
    print("\nestimate at Qwen2.5-0.5B shapes: 64 rows × (194 + 256) tokens, V = 151,936, bf16 autocast over fp32 "
          "weights, AdamW, no gradient checkpointing, one micro-batch")
    rows = qwen_estimate(args.device)
    for name, old, new in rows:
        print(f"  {name:<58} old {old:7.1f} GiB   new {new:7.1f} GiB")
    old_total, new_total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"  {'total':<58} old {old_total:7.1f} GiB   new {new_total:7.1f} GiB   "
          f"(80 GB card = 74.5 GiB: {'fits' if new_total < 74.5 else 'does not fit'} new, "
          f"{'fits' if old_total < 74.5 else 'does not fit'} old)")


if __name__ == "__main__":
    main()
