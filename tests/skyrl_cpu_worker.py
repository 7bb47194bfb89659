"""Run by tests/test_e2e_skyrl.py in a fresh process: SkyRL 0.4.0's policy worker takes optimizer
steps with offpolicy's loss, as SkyRL's trainer drives it (``RayPPOTrainer._execute_training_step``:
advantages pre-scaled by ``apply_loss_reduction_to_advantages_minibatch``, then the worker's
``forward_backward`` over its micro-batches and ``optim_step``).

SkyRL's own: the config (``SkyRLTrainConfig.from_cli_overrides``, ``validate_cfg``), the loss
registry and the loss looked up by ``policy_loss_type``, ``PolicyWorkerBase.forward_backward`` /
``_forward_backward_micro`` / ``optim_step``, ``HFModelWrapper`` around a tiny Qwen2,
``FSDPStrategy.backward`` / ``optimizer_step`` (grad clip, step, zero), the metric reductions.
CPU stand-ins, each for a GPU-only piece: the worker object is made without its Ray-actor
``__init__`` (which asks Ray for its GPU id) and given what ``FSDPPolicyWorker.init_model`` would
set, minus the FSDP wrapping and with SGD; a gloo process group and a CPU ``dp`` device mesh of
size 1 (``setup_distributed`` builds a CUDA mesh); ``torch.cuda.current_device()`` → "cpu" (the
micro-batch's ``to_device`` and the metric all-reduce); import placeholders for flash-attn
(tests/gpu_placeholders, which ``model_wrapper`` imports at module level and this path never
calls); ``skyrl.backends`` loaded without its ``__init__`` (the Tinker backend, Python ≥ 3.12).

Usage: python tests/skyrl_cpu_worker.py IN.pt OUT.pt
       python tests/skyrl_cpu_worker.py --ranks IN.pt OUT.pt   (tests/test_two_ranks_skyrl.py)

``--ranks``: the same worker at two data-parallel ranks and at one (processes forked after the
imports, tests/two_ranks.py), its model **wrapped in FSDP2** with SkyRL's own ``apply_fsdp2``
(fp32 ``MixedPrecisionPolicy``, a CPU ``dp`` mesh of the world's size), so that the gradient is
reduced across ranks as in a SkyRL FSDP2 worker; ``optim_step`` then clips with SkyRL's
``fsdp2_clip_grad_norm_`` on the sharded gradients. The advantages are pre-scaled over the
global mini-batch (the driver's ``_normalize_advantages``) before the batch is split over ranks
(``MeshDispatch``: contiguous chunks), as SkyRL's trainer does.
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist

from host_packages import import_skyrl_module


def _skyrl_backends_without_init() -> None:
    import_skyrl_module("skyrl.backends.skyrl_train.utils.ppo_utils")


def main(path_in: str, path_out: str) -> None:
    torch.set_num_threads(1)
    inp = torch.load(path_in, weights_only=False)
    _skyrl_backends_without_init()
    from torch.distributed.device_mesh import init_device_mesh

    from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank
    from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        PolicyLossRegistry,
        apply_loss_reduction_to_advantages_minibatch,
    )
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
    from skyrl.train.config import SkyRLTrainConfig

    from offpolicy.integrations import skyrl as op_skyrl
    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    op_skyrl.register(inp["loss_config"])  # the README's order: register, then configure the SkyRL config
    cfg = op_skyrl.configure(SkyRLTrainConfig.from_cli_overrides(inp["overrides"]))
    tc = cfg.trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.cuda.current_device = lambda: "cpu"

    model = build_tiny_qwen2(build_char_tokenizer(), **inp["model"])
    model.load_state_dict(inp["state"])
    worker = PolicyWorkerBase.__new__(PolicyWorkerBase)
    worker.cfg = tc
    worker.profiler = None
    worker.record_memory = False
    worker.policy_loss_fn = PolicyLossRegistry.get(tc.algorithm.policy_loss_type)  # as PolicyWorkerBase.__init__
    worker.strategy = FSDPStrategy(fsdp_config=tc.policy.fsdp_config, optimizer_config=tc.policy.optimizer_config,
                                   model_config=tc.policy.model, fsdp_strategy=tc.strategy, seed=tc.seed,
                                   micro_train_batch_size_per_gpu=tc.micro_train_batch_size_per_gpu)
    worker.strategy.world_size = 1
    worker.device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    worker.mesh_rank = MeshRank(dp=0, sp=0, tp=0, pp=0, world_size=1, dp_size=1, pp_size=1)
    worker.model = HFModelWrapper(model, bf16=False, temperature=tc.algorithm.temperature)
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=inp["lr"])
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda _: 1.0)

    statuses = []
    for b in inp["batches"]:
        # RayPPOTrainer._normalize_advantages, one mini-batch = the whole batch
        adv = apply_loss_reduction_to_advantages_minibatch(
            advantages=b["adv"], loss_mask=b["loss_mask"], loss_reduction=tc.algorithm.loss_reduction,
            micro_batch_size=tc.micro_train_batch_size_per_gpu, max_seq_len=tc.algorithm.max_seq_len)
        data = TrainingInputBatch({
            "sequences": b["sequences"], "attention_mask": b["attention_mask"], "loss_mask": b["loss_mask"],
            "response_mask": torch.ones_like(b["loss_mask"], dtype=torch.long), "action_log_probs": b["old"],
            "base_action_log_probs": b["old"], "advantages": adv, "rollout_logprobs": b["mu"]})
        data.metadata = {"response_length": b["loss_mask"].shape[1]}
        out = worker.forward_backward(data)
        grad_norm = worker.optim_step()
        statuses.append({**out.metrics, "grad_norm": grad_norm})
    torch.save({"loss_fn": type(worker.policy_loss_fn).__qualname__, "policy_loss_type": tc.algorithm.policy_loss_type,
                "logprobs": cfg.generator.sampling_params.logprobs,
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "status": statuses}, path_out)
    dist.destroy_process_group()


def _rank_runs(rank: int, world: int, inp: dict) -> dict:
    """Every run of ``inp["runs"]`` on this rank of a ``world``-rank gloo group (tests/two_ranks.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank
    from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
    from skyrl.backends.skyrl_train.distributed.fsdp_utils import apply_fsdp2
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        PolicyLossRegistry,
        apply_loss_reduction_to_advantages_minibatch,
    )
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
    from skyrl.train.config import SkyRLTrainConfig
    from two_ranks import shard

    from offpolicy.integrations import skyrl as op_skyrl
    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    torch.cuda.current_device = lambda: "cpu"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out = {}
    for run in inp["runs"]:
        op_skyrl.register(run["loss_config"])
        cfg = op_skyrl.configure(SkyRLTrainConfig.from_cli_overrides(run["overrides"]))
        tc = cfg.trainer
        model = build_tiny_qwen2(build_char_tokenizer(), **inp["model"])
        model.load_state_dict(inp["state"])
        worker = PolicyWorkerBase.__new__(PolicyWorkerBase)
        worker.cfg = tc
        worker.profiler = None
        worker.record_memory = False
        worker.policy_loss_fn = PolicyLossRegistry.get(tc.algorithm.policy_loss_type)
        worker.strategy = FSDPStrategy(fsdp_config=tc.policy.fsdp_config, optimizer_config=tc.policy.optimizer_config,
                                       model_config=tc.policy.model, fsdp_strategy=tc.strategy, seed=tc.seed,
                                       micro_train_batch_size_per_gpu=tc.micro_train_batch_size_per_gpu)
        worker.strategy.world_size = world
        worker.device_mesh = mesh
        worker.mesh_rank = MeshRank(dp=rank, sp=0, tp=0, pp=0, world_size=world, dp_size=world, pp_size=1)
        worker.model = HFModelWrapper(model, bf16=False, temperature=tc.algorithm.temperature)
        # FSDPStrategy._fsdp_init_model's wrapping (SkyRL's apply_fsdp2) on the CPU mesh, fp32 compute and reduce
        apply_fsdp2(worker.model.model, {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True),
            "offload_policy": None, "reshard_after_forward": True}, tc.policy.fsdp_config)
        worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=inp["lr"])
        worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda _: 1.0)
        statuses = []
        for b in run["batches"]:
            # RayPPOTrainer._normalize_advantages on the driver: over the global mini-batch, before dispatch;
            # run["per_rank_scale"] breaks that on purpose (each rank scales by its own shard)
            part = shard(b, rank, world)
            src = part if run.get("per_rank_scale") else b
            adv = apply_loss_reduction_to_advantages_minibatch(
                advantages=src["adv"], loss_mask=src["action_mask"], loss_reduction=tc.algorithm.loss_reduction,
                micro_batch_size=tc.micro_train_batch_size_per_gpu, max_seq_len=tc.algorithm.max_seq_len)
            if not run.get("per_rank_scale"):
                adv = shard({"adv": adv}, rank, world)["adv"]
            data = TrainingInputBatch({
                "sequences": part["sequences"], "attention_mask": part["attention_mask"],
                "loss_mask": part["action_mask"], "response_mask": torch.ones_like(part["action_mask"], dtype=torch.long),
                "action_log_probs": part["old"], "base_action_log_probs": part["old"], "advantages": adv,
                "rollout_logprobs": part["mu"]})
            data.metadata = {"response_length": part["action_mask"].shape[1]}
            status = worker.forward_backward(data).metrics
            statuses.append({**status, "grad_norm": worker.optim_step()})
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                 for k, v in worker.model.model.state_dict().items()}
        out[run["name"]] = {"state": state, "status": statuses}
    return out


def main_ranks(path_in: str, path_out: str) -> None:
    """``_rank_runs`` at two ranks and at one, each its own gloo group; OUT.pt = {world: [per rank]}."""
    torch.set_num_threads(1)
    inp = torch.load(path_in, weights_only=False)
    _skyrl_backends_without_init()
    import skyrl.backends.skyrl_train.workers.worker  # noqa: F401 - imported once, before the fork
    from skyrl.train.config import SkyRLTrainConfig  # noqa: F401
    from two_ranks import run_worlds

    import offpolicy.integrations.skyrl  # noqa: F401

    torch.save(run_worlds(_rank_runs, (inp,)), path_out)


if __name__ == "__main__":
    if sys.argv[1] == "--ranks":
        main_ranks(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
