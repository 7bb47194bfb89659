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
