"""verl 0.9.1's own actor update on CPU, in a fresh process (as in a Ray worker): run by tests/test_e2e_verl.py.

    python tests/verl_actor_step.py JOB.pt OUT.pt
    python tests/verl_actor_step.py --ranks JOB.pt OUT.pt     (tests/test_two_ranks_verl.py)

JOB.pt holds ``model`` (a local HF model directory), ``batch`` (a padded DataProto's tensors: prompts,
responses, input_ids, attention_mask, position_ids, response_mask, old_log_probs = μ, advantages),
``mini_batch_size``, ``micro_batch_size``, ``lr``, ``overrides`` (extra Hydra overrides) and ``losses``
({name: value of OFFPOLICY_VERL_LOSS}): the loss is chosen as a user chooses it, through the environment.

What runs is verl's: ``ActorRolloutRefWorker(config.actor_rollout_ref, role="actor").init_model()``
builds the FSDP2 engine, the optimizer and ``partial(ppo_loss, config=ActorConfig)`` exactly as in
a Ray worker; the batch goes through ``DataProto.to_tensordict`` → ``left_right_2_no_padding`` →
``update_actor`` as ``RayPPOTrainer._update_actor`` sends it (bypass mode: old_log_probs is μ).
OUT.pt gets, per loss, the parameters after the update and verl's metrics.

verl 0.9.1 has no CPU path, so four things are set up here, and only here (each is what stops a
CPU run; docs/hosts-end-to-end.md lists them with file:line):
* offpolicy's CPU platform (``offpolicy.integrations.verl.cpu_platform``, registered through verl's own plugin
  registry, as verl's Ray workers get it by ``VERL_PLATFORM``) set with ``set_platform``: verl knows
  cuda/npu/rocm only and falls back to "nvidia";
* ``VERL_ENGINE_DEVICE=cuda``: the FSDP engine is registered for devices cuda/npu only; the
  variable is verl's own override of the lookup key, the engine itself runs on the CPU platform;
* a gloo process group, created before verl's (verl asks for ``cpu:gloo,<device>:nccl``);
* ``is_trl_available`` answered False in verl's monkey-patch module: with trl 1.16 installed
  next to verl 0.9.1, verl imports ``AutoModelForCausalLMWithValueHead``, which trl 1.16 removed.

``--ranks``: the same worker at two data-parallel ranks and at one (processes forked after verl's
import, tests/two_ranks.py; each world its own gloo group, RANK/WORLD_SIZE in the environment as a
Ray worker group sets them). verl's FSDP2 engine then shards over a CPU mesh of the world's size and
reduces the gradient across the ranks; each rank gets its contiguous chunk of the batch, as verl's
``DP_COMPUTE`` dispatch chunks a ``DataProto``, and ``train_mini_batch`` all-reduces the mini-batch's
token count (``batch_num_tokens``) and all-gathers the metrics itself. JOB.pt's ``runs`` map a name
to ``loss`` (OFFPOLICY_VERL_LOSS), ``overrides``, ``batches`` (one ``update_actor`` each) and
``per_rank_count`` (broken on purpose: the loss divides by this rank's token count).
"""

from __future__ import annotations

import os
import sys
import types

import torch

os.environ["VERL_ENGINE_DEVICE"] = "cuda"
# read by verl's Worker.__init__ (a Ray worker gets them from the worker group)
for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}.items():
    os.environ.setdefault(key, value)

from verl.plugin.platform.platform_manager import set_platform  # noqa: E402

from offpolicy.integrations import verl as op_verl  # noqa: E402 - registers offpolicy's CPU platform with verl


def compose(model_dir: str, job: dict):
    from hydra import compose as hydra_compose, initialize_config_dir
    import verl

    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",  # no flash-attn on CPU
        "actor_rollout_ref.actor.strategy=fsdp2",  # FSDP1 needs an accelerator's device_id
        "actor_rollout_ref.actor.policy_loss.loss_mode=offpolicy",
        f"actor_rollout_ref.actor.optim.lr={job['lr']}",
        # SGD and fp32 compute: a parameter then differs from the hand loop's by lr × the gradient's
        # difference (Adam's first step is lr·sign(g): any g near 0 would flip a whole lr), and the
        # default bf16 FSDP compute would put bf16 rounding into the loss the test compares
        "actor_rollout_ref.actor.optim.optimizer=SGD",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={job['mini_batch_size']}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={job['micro_batch_size']}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={job['micro_batch_size']}",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.shuffle=False",
        *job.get("overrides", []),
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose("ppo_trainer", overrides=overrides)


def main(job_path: str, out_path: str) -> None:
    job = torch.load(job_path, weights_only=False)
    set_platform(op_verl.cpu_platform())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{out_path}.rendezvous")
    import verl.models.transformers.monkey_patch as verl_patch

    verl_patch.is_trl_available = lambda: False
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding

    results = {}
    for name, loss in job["losses"].items():  # one worker per loss, one process for all: verl's import is slow
        os.environ["OFFPOLICY_VERL_LOSS"] = loss  # how a Ray worker gets it: its environment
        config = compose(job["model"], job)
        worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
        worker.init_model()
        actor = config.actor_rollout_ref.actor
        # RayPPOTrainer._update_actor (verl 0.9.1 trainer/ppo/ray_trainer.py), minus the Ray dispatch
        batch = DataProto.from_single_dict(dict(job["batch"]), meta_info={"temperature": 1.0})
        data = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(data, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=actor.ppo_mini_batch_size, mini_batch_size=actor.ppo_mini_batch_size,
                             epochs=actor.ppo_epochs, seed=actor.data_loader_seed,
                             dataloader_kwargs={"shuffle": actor.shuffle}, compute_loss=True)
        output = worker.update_actor(data)
        module = worker.actor.engine.module
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in module.named_parameters()}
        metrics = {k: [float(x) for x in v] if isinstance(v, list) else float(v)
                   for k, v in tu.get(output, "metrics").items()}
        results[name] = {"params": params, "metrics": metrics, "engine": type(worker.actor.engine).__name__}
    torch.save(results, out_path)
    torch.distributed.destroy_process_group()


def _rank_runs(rank: int, world: int, job: dict) -> dict:
    """Every run of ``job["runs"]`` on this rank (module docstring)."""
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding

    from two_ranks import shard

    results = {}
    for name, run in job["runs"].items():
        os.environ["OFFPOLICY_VERL_LOSS"] = run["loss"]
        config = compose(job["model"], {**job, "overrides": run.get("overrides", [])})
        worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
        worker.init_model()
        actor = config.actor_rollout_ref.actor
        metrics = []
        for batch in run["batches"]:
            part = shard(batch, rank, world)
            if run.get("per_rank_count"):  # broken on purpose: this rank's own token count as the denominator
                local = float(part["response_mask"].sum())
                op_verl.core_algos = types.SimpleNamespace(agg_loss=lambda local=local, **kw: core_algos.agg_loss(
                    **{**kw, "batch_num_tokens": local}))
            data = left_right_2_no_padding(DataProto.from_single_dict(dict(part), meta_info={"temperature": 1.0})
                                           .to_tensordict())
            tu.assign_non_tensor(data, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                                 global_batch_size=actor.ppo_mini_batch_size, mini_batch_size=actor.ppo_mini_batch_size,
                                 epochs=actor.ppo_epochs, seed=actor.data_loader_seed,
                                 dataloader_kwargs={"shuffle": actor.shuffle}, compute_loss=True)
            output = worker.update_actor(data)
            op_verl.core_algos = core_algos
            metrics.append({k: [float(x) for x in v] if isinstance(v, list) else float(v)
                            for k, v in tu.get(output, "metrics").items()})
        module = worker.actor.engine.module
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in module.named_parameters()}
        results[name] = {"params": params, "metrics": metrics, "dp": worker.actor.engine.get_data_parallel_size()}
    return results


def main_ranks(job_path: str, out_path: str) -> None:
    """``_rank_runs`` at two ranks and at one; OUT.pt = {world: [per rank]}."""
    torch.set_num_threads(1)
    job = torch.load(job_path, weights_only=False)
    set_platform(op_verl.cpu_platform())
    import verl.models.transformers.monkey_patch as verl_patch

    verl_patch.is_trl_available = lambda: False
    import verl.workers.engine_workers  # noqa: F401 - imported once, before the fork
    from two_ranks import run_worlds

    import offpolicy.integrations.verl  # noqa: F401

    torch.save(run_worlds(_rank_runs, (job,)), out_path)


if __name__ == "__main__":
    if sys.argv[1] == "--ranks":
        main_ranks(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
