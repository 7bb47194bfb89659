"""Runs inside the Ray worker of tests/test_e2e_openrlhf.py: OpenRLHF 0.11.2's own
``ActorPPOTrainer`` (built by its ``__init__`` from arguments parsed by ``train_ppo_ray``'s own
parser) takes optimizer steps with its ``training_step``, on OpenRLHF's ``Actor`` around a tiny
Qwen2, with whatever ``PolicyLoss`` the worker setup hook left in ``openrlhf.models``.

CPU stand-ins, each for a GPU-only piece this path does not exercise:
- ``CPUStrategy`` for ``DeepspeedStrategy``: backward / optimizer_step / get_grad_norm as DeepSpeed's
  engine does them at ZeRO-0 with one rank (loss.backward(); clip the global grad norm to
  ``--actor.max_norm``; step; zero grads; scheduler step; report the pre-clip norm).
- ``torch_dist_barrier_and_cuda_sync`` → the barrier alone (CPU torch has no CUDA to sync).
- the process group is gloo with world size 1.
- OpenRLHF's ``Actor`` wraps the fp32 module directly (its from-path loading is bf16/fp16 only).
- ``torch.cuda.current_device()`` → 0: ``NaiveReplayBuffer.__init__`` builds ``torch.device("cuda:0")``
  from it for the replay buffer, which ``training_step`` does not use (CPU torch raises instead).

``python tests/openrlhf_cpu_worker.py --ranks IN.pt OUT.pt`` (tests/test_two_ranks_openrlhf.py):
OpenRLHF's own epoch loop ``ActorPPOTrainer.ppo_train`` at two gloo ranks and at one (processes
forked after the imports, tests/two_ranks.py), over its ``NaiveReplayBuffer``, ``DataLoader``,
``iter_grad_accum_global_norm`` (the step's global token/sample counts, all-reduced over the ranks),
``training_step`` → the actor's loss call → ``aggregate_loss`` (× dp_size), and its metric reduction
(token/sample-weighted sums all-reduced with ``DeepspeedStrategy.all_reduce`` itself). What is not
OpenRLHF's: the gradient reduction. DeepSpeed's engine is replaced by ``DPStrategy`` — backward of
loss / gas, and at every gas-th micro-batch the gradients averaged over the ranks (all-reduce
SUM / world, what DeepSpeed's ZeRO-0 data parallel does), the global norm clipped, step, zero.
Here ``torch.cuda.current_device()`` → "cpu" after the trainer is built (the loop's
``experience.to_device`` and the metric all-reduce call it).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("openrlhf_train_example", ROOT / "examples" / "openrlhf_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class CPUStrategy:
    """The part of ``DeepspeedStrategy`` (0.11.2) that ``ActorPPOTrainer.training_step`` calls."""

    ring_attn_group = None

    def __init__(self, args: Any) -> None:
        self.args = args
        self.grad_norm = 0.0

    def backward(self, loss: torch.Tensor, model: Any, optimizer: Any, **kwargs: Any) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: Any, model: Any, scheduler: Any, name: str = "model", **kwargs: Any) -> None:
        params = [p for p in model.parameters() if p.grad is not None]
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.args.actor.max_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    def get_grad_norm(self, model: Any) -> float:
        return self.grad_norm


class DPStrategy(CPUStrategy):
    """``CPUStrategy`` with DeepSpeed's gradient accumulation and data-parallel averaging (module docstring).
    ``all_reduce`` is ``DeepspeedStrategy.all_reduce`` itself (OpenRLHF's metric reduction)."""

    def __init__(self, args: Any, world: int, gas: int) -> None:
        from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy

        super().__init__(args)
        self.world_size = world
        self.accumulated_gradient = gas
        self.calls = 0
        self._all_reduce = DeepspeedStrategy.all_reduce

    def all_reduce(self, data: Any, op: str = "mean") -> Any:
        return self._all_reduce(self, data, op)

    def is_rank_0(self) -> bool:
        return dist.get_rank() == 0

    def backward(self, loss: torch.Tensor, model: Any, optimizer: Any, **kwargs: Any) -> None:
        (loss / self.accumulated_gradient).backward()  # DeepSpeed scales every backward by 1 / gas

    def optimizer_step(self, optimizer: Any, model: Any, scheduler: Any, name: str = "model", **kwargs: Any) -> None:
        self.calls += 1
        if self.calls % self.accumulated_gradient:
            return  # DeepSpeed steps at the accumulation boundary only
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= self.world_size
        super().optimizer_step(optimizer, model, scheduler, name)


def _init_process_group() -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def train_steps(argv: list[str], model_kwargs: dict[str, Any], state: dict[str, torch.Tensor],
                batches: list[dict[str, torch.Tensor]], lr: float) -> dict[str, Any]:
    """Build the trainer the way OpenRLHF does and run one ``training_step`` (= one optimizer step,
    micro batch = the whole batch) per batch; returns the trained weights and each step's status."""
    torch.set_num_threads(1)
    import openrlhf.models as models
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ray import ppo_actor

    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    hooked = {"openrlhf.models": models.PolicyLoss.__qualname__, "ppo_actor": ppo_actor.PolicyLoss.__qualname__,
              "env": os.environ.get("OFFPOLICY_OPENRLHF_LOSS", "")}
    _init_process_group()
    ppo_actor.torch_dist_barrier_and_cuda_sync = dist.barrier  # CPU: nothing to synchronise on a device
    torch.cuda.current_device = lambda: 0  # only names the replay buffer's device (see the module docstring)
    args = _example().host_args(argv)

    model = build_tiny_qwen2(build_char_tokenizer(), **model_kwargs)
    model.load_state_dict(state)
    actor = Actor(model)  # OpenRLHF's wrapper: position ids, fp32 logits, log_probs_from_logits
    # Actor(<module>) skips the attribute its from-path branch sets (0.11.2); set it the same way,
    # rather than load the model from a path, which OpenRLHF only allows in bf16/fp16.
    actor.packing_samples = args.ds.packing_samples
    optim = torch.optim.SGD(actor.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
    trainer = ppo_actor.ActorPPOTrainer(CPUStrategy(args), actor, None, optim, scheduler,
                                        micro_train_batch_size=batches[0]["sequences"].shape[0],
                                        dataloader_pin_memory=False, vllm_engines=None)
    statuses = []
    for step, b in enumerate(batches):
        exp = Experience(sequences=b["sequences"], attention_mask=b["attention_mask"],
                         action_mask=b["action_mask"].bool(), action_log_probs=b["old"],
                         rollout_log_probs=b["mu"], advantages=b["adv"], info={})
        status = trainer.training_step(exp, 0.0, step)
        statuses.append({k: (v.float().mean().item() if isinstance(v, torch.Tensor) else v)
                         for k, v in status["metrics"].items()})
    return {"hooked": hooked, "loss_fn": type(trainer.actor_loss_fn).__qualname__,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "status": statuses}


def _rank_runs(rank: int, world: int, inp: dict) -> dict:
    """Each run of ``inp["runs"]``: ``ppo_train`` once per global batch on this rank's shard (tests/two_ranks.py)."""
    torch.set_num_threads(1)
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ray import ppo_actor
    from two_ranks import ROWS, shard

    from offpolicy.integrations import openrlhf as op_openrlhf
    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    ppo_actor.torch_dist_barrier_and_cuda_sync = dist.barrier
    out = {}
    for run in inp["runs"]:
        op_openrlhf.install(run["loss_config"])
        args = _example().host_args(run["argv"])
        model = build_tiny_qwen2(build_char_tokenizer(), **inp["model"])
        model.load_state_dict(inp["state"])
        actor = Actor(model)
        actor.packing_samples = args.ds.packing_samples
        optim = torch.optim.SGD(actor.parameters(), lr=inp["lr"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
        micro = inp["micro"]
        strategy = DPStrategy(args, world, ROWS // micro // world)  # one optimizer step per global batch
        torch.cuda.current_device = lambda: 0  # NaiveReplayBuffer.__init__ names cuda:0 (module docstring)
        trainer = ppo_actor.ActorPPOTrainer(strategy, actor, None, optim, scheduler, micro_train_batch_size=micro,
                                            dataloader_pin_memory=False, vllm_engines=None)
        torch.cuda.current_device = lambda: "cpu"
        statuses = []
        global_norm = ppo_actor.iter_grad_accum_global_norm
        for b in run["batches"]:
            part = shard(b, rank, world)
            if run.get("per_rank_count"):  # broken on purpose: each rank divides by its own token count
                local = float(part["action_mask"].sum())

                def per_rank(data_iter, strategy, gas, mask_fn, local=local):
                    for item, info in global_norm(data_iter, strategy, gas, mask_fn):
                        yield item, {**info, "batch_num_tokens": torch.tensor(local / gas)}

                ppo_actor.iter_grad_accum_global_norm = per_rank
            trainer.replay_buffer.append(Experience(
                sequences=part["sequences"], attention_mask=part["attention_mask"],
                action_mask=part["action_mask"].bool(), action_log_probs=part["old"], rollout_log_probs=part["mu"],
                advantages=part["adv"], info={}))
            torch.manual_seed(rank)  # the DataLoader's shuffle: the rows' order differs by rank and world
            statuses.append(trainer.ppo_train(0.0))
            ppo_actor.iter_grad_accum_global_norm = global_norm
            trainer.replay_buffer.clear()
        out[run["name"]] = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                            "status": statuses, "loss_fn": type(trainer.actor_loss_fn).__qualname__}
    return out


def main_ranks(path_in: str, path_out: str) -> None:
    """``_rank_runs`` at two ranks and at one, each its own gloo group; OUT.pt = {world: [per rank]}."""
    torch.set_num_threads(1)
    inp = torch.load(path_in, weights_only=False)
    import openrlhf.trainer.ray.ppo_actor  # noqa: F401 - imported once, before the fork
    from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy  # noqa: F401
    from two_ranks import run_worlds

    import offpolicy.integrations.openrlhf  # noqa: F401

    torch.save(run_worlds(_rank_runs, (inp,)), path_out)


if __name__ == "__main__":
    import sys

    main_ranks(sys.argv[2], sys.argv[3])
