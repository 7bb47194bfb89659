"""TRL 1.16's ``GRPOTrainer`` training step at two data-parallel ranks and at one, on the CPU (gloo):
run by tests/test_two_ranks_trl.py.

    python tests/trl_two_ranks.py IN.pt OUT.pt
    torchrun --nproc_per_node 2 tests/trl_two_ranks.py IN.pt OUT.pt    (each rank writes OUT.pt.rank<r>)

Each rank is a process forked after the imports (tests/two_ranks.py) with RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT in its environment and a gloo group, as ``torchrun
--nproc_per_node 2`` gives it; ``GRPOConfig(use_cpu=True)`` then makes accelerate's state
``MULTI_CPU`` over that group at two ranks (``accelerate launch --cpu --num_processes 2`` starts one
process on this machine: see docs/hosts-end-to-end.md). What runs is TRL's: its ``RepeatSampler``
and accelerate's per-process split of each generation batch, ``_generate_and_score_completions``
(rewards gathered over the ranks, group advantages, this rank's slice), ``_compute_loss`` (here
``OffpolicyGRPOTrainer``'s, or TRL's own with its IS correction), DDP's gradient all-reduce (mean),
the grad-norm clip, the optimizer step and the logs (``_metrics`` averaged per logging step).

The rollouts are a TRL ``rollout_func`` that depends on nothing but the prompt, its occurrence in
the group and the weights: completions of seeded random characters whose length is fixed per
prompt (rank 0's prompts 1–2 tokens, rank 1's 4–6: unequal token counts per rank), μ = the
policy's own log-prob + seeded N(0, 0.3²) noise (optionally 3 nats lower on every token of chosen
prompts: a rank whose tokens a ratio veto all rejects). So one rank and two ranks see the same
global batch. SGD (``optim="sgd"``), fp32 (``bf16=False``: TRL's default bf16=True autocasts the
forward even on the CPU).

IN.pt: ``state`` (the tiny model's weights), ``shape`` (its ``build_tiny_qwen2`` options), ``runs``:
[{name, trainer: "offpolicy" | "trl_is", config (a LossConfig or preset), loss_type, spike: [prompts],
accum (gradient accumulation steps, default 1)}].
OUT.pt: {world: [per rank {name: {"state", "logs"}}]}.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zlib
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in trl 1.16
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["abc", "bcd", "cde", "def", "efg", "fgh", "ghi", "hij"]  # 4 per optimizer step, in order
LENGTHS = {"abc": 1, "bcd": 2, "cde": 5, "def": 4, "efg": 2, "fgh": 1, "ghi": 6, "hij": 4}
GROUP, COMPLETION = 2, 6


def rollout_func_for(tokenizer, spike: set[str]):
    first_char = len(tokenizer.all_special_tokens)

    def rollout_func(prompts, trainer):
        prompt_ids = [[tokenizer.bos_token_id, *tokenizer(p, add_special_tokens=False).input_ids] for p in prompts]
        seen: dict[str, int] = {}
        completion_ids, logprobs = [], []
        for text, ids_p in zip(prompts, prompt_ids):
            occ = seen[text] = seen.get(text, -1) + 1
            g = torch.Generator().manual_seed(zlib.crc32(f"{text}|{occ}|{trainer.state.global_step}".encode()))
            n = LENGTHS[text] if occ == 0 else max(1, LENGTHS[text] - 1)
            ids = torch.randint(first_char, first_char + 26, (n,), generator=g).tolist()
            with torch.no_grad():
                logits = trainer.model(torch.tensor([ids_p + ids])).logits[0, len(ids_p) - 1:-1].float()
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            mu = (lp + 0.3 * torch.randn(n, generator=g)).clamp(max=-1e-4)
            if text in spike:
                mu = mu - 3.0
            completion_ids.append(ids)
            logprobs.append(mu.tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout_func


def reward(completions, **kwargs):
    return [float(zlib.crc32(c.encode()) % 7) for c in completions]


def _rank_runs(rank: int, world: int, inp: dict) -> dict:
    import importlib.util

    from datasets import Dataset
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffpolicyGRPOTrainer
    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    spec = importlib.util.spec_from_file_location("trl_grpo_example", ROOT / "examples" / "trl_grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = {}
    for run in inp["runs"]:
        tokenizer = build_char_tokenizer()
        model = build_tiny_qwen2(tokenizer, **inp["shape"])
        model.load_state_dict(inp["state"])
        args = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="trl2r-"), use_cpu=True, report_to=[], save_strategy="no", seed=0,
            data_seed=0, max_steps=inp.get("steps", 2), logging_steps=1, learning_rate=inp["lr"], lr_scheduler_type="constant",
            # bf16=False: GRPOConfig defaults to bf16=True, and accelerate then runs the forward under bf16
            # autocast even on the CPU, whose rounding depends on the batch's shape (measured: 3e-3 of a step)
            bf16=False, optim="sgd", warmup_steps=0, max_grad_norm=1.0, per_device_train_batch_size=len(PROMPTS) // world // run.get("accum", 1),
            gradient_accumulation_steps=run.get("accum", 1),
            num_generations=GROUP, max_completion_length=COMPLETION, temperature=1.0, beta=0.0,
            loss_type=run["loss_type"], shuffle_dataset=False, disable_tqdm=True, dataloader_num_workers=0)
        common = {"model": model, "reward_funcs": reward, "args": args, "processing_class": tokenizer,
                  "train_dataset": Dataset.from_dict({"prompt": PROMPTS}),
                  "rollout_func": rollout_func_for(tokenizer, set(run.get("spike", ())))}
        if run["trainer"] == "trl_is":  # TRL's own loss with its own IS correction (the example's "TRL IS" arm)
            trainer = example.TRLImportanceSampling(**common)
        else:
            trainer = OffpolicyGRPOTrainer(**common, offpolicy_config=run["config"])
        assert trainer.accelerator.num_processes == world
        trainer.train()
        logs = [{k: v for k, v in row.items() if isinstance(v, (int, float))} for row in trainer.state.log_history
                if "loss" in row]
        out[run["name"]] = {"state": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                            "logs": logs, "trainer": type(trainer).__name__}
    return out


def main(path_in: str, path_out: str) -> None:
    torch.set_num_threads(1)
    inp = torch.load(path_in, weights_only=False)
    import datasets  # noqa: F401 - imported once, before the fork
    import trl  # noqa: F401

    import offpolicy.integrations.trl  # noqa: F401
    from two_ranks import run_worlds

    torch.save(run_worlds(_rank_runs, (inp,)), path_out)


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun: this process is one rank of its world
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo")
        r, w = torch.distributed.get_rank(), torch.distributed.get_world_size()
        torch.save(_rank_runs(r, w, torch.load(sys.argv[1], weights_only=False)), f"{sys.argv[2]}.rank{r}")
        torch.distributed.destroy_process_group()
    else:
        main(sys.argv[1], sys.argv[2])
