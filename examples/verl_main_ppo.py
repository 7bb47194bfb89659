"""verl's PPO/GRPO launch with offpolicy's policy loss (the README's verl section, as a script; verl 0.9.1).

    python examples/verl_main_ppo.py <your usual main_ppo overrides>             # runs verl.trainer.main_ppo
    python examples/verl_main_ppo.py --dry-run <your usual main_ppo overrides>   # checks, trains nothing
    python examples/verl_main_ppo.py --cpu <overrides>       # on a CPU machine: offpolicy's CPU platform plugin

The overrides below are added to yours: the v1 trainer, verl's bypass mode (μ takes π_old's place,
the only way a registered verl loss sees μ), ``loss_mode=offpolicy``, and the offpolicy loss for every
Ray worker through its environment (``OFFPOLICY_VERL_LOSS``: a preset name or a LossConfig YAML path).

``--dry-run`` composes verl's own Hydra config with these overrides, builds verl's typed configs from it
(``omega_conf_to_dataclass``: ``ActorConfig``, ``AlgoConfig``, ``RolloutCorrectionConfig`` — verl's schema
and its validation), then,
in this process, checks that a bare ``import verl`` registered loss_mode ``offpolicy`` (the ``verl.plugins``
entry point, as in a Ray worker) and that the worker's ``OFFPOLICY_VERL_LOSS`` is a loss the adapter
accepts in bypass mode. It prints the result as JSON.

``--cpu`` adds the CPU set-ups (``cpu_overrides``; offpolicy's CPU platform plugin, registered through verl's
platform registry by ``offpolicy.integrations.verl``). On a CPU machine main_ppo then builds verl's FSDP2 actor
in a Ray worker and stops at its vLLM rollout: docs/hosts-end-to-end.md, "## verl", names where and why.
``compute_score`` below is a verl custom reward function for offpolicy's exact-match tasks.
"""

from __future__ import annotations

import json
import os
import sys

OFFPOLICY_LOSS = "verl:bypass_ppo_clip"
OVERRIDES = [
    "trainer.use_v1=True",
    "actor_rollout_ref.actor.policy_loss.loss_mode=offpolicy",
    "algorithm.rollout_correction.bypass_mode=True",
    f"+ray_kwargs.ray_init.runtime_env.env_vars.OFFPOLICY_VERL_LOSS={OFFPOLICY_LOSS}",
]


# --cpu: verl's main_ppo on a CPU machine through verl's public plugin points (docs/hosts-end-to-end.md, "## verl"):
# offpolicy's CPU platform (VERL_PLATFORM), Ray's worker_process_setup_hook for the gloo group, logical Ray GPUs
# for verl's placement bundles and resource check, FSDP2 (FSDP1 asks for an accelerator device id), eager
# attention (no flash-attn on a CPU), vLLM without sleep mode. Ray's CPUs are logical too: verl and TransferQueue
# hold one per actor, so give ray_kwargs.ray_init.num_cpus more than the cores (e.g. 8 on 2 cores).
def cpu_overrides() -> list[str]:
    from offpolicy.integrations import verl as adapter

    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    return [
        "trainer.device=cpu", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
        "+ray_kwargs.ray_init.num_gpus=1",  # logical: it schedules verl's one worker, no device behind it
        f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={adapter.SETUP_HOOK}",
        *[f"{env}.{key}={value}" for key, value in adapter.cpu_env_vars().items()],
        "actor_rollout_ref.actor.strategy=fsdp2",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        # vLLM's CPU platform has no sleep mode ("Sleep mode is not supported on current platform")
        "+actor_rollout_ref.rollout.enable_sleep_mode=False", "actor_rollout_ref.rollout.free_cache_engine=False",
        # TransferQueue holds one Ray CPU per storage unit (8 by default)
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def dry_run(user_overrides: list[str]) -> dict:
    """Compose and validate the launch with verl's own schema; check the loss registration (module docstring).

    Raises:
        offpolicy.core.config.ConfigError: the worker's OFFPOLICY_VERL_LOSS is not a loss verl can run.
        AssertionError: loss_mode 'offpolicy' is not offpolicy's loss after ``import verl``.
    """
    import verl  # loads the verl.plugins entry points: offpolicy.integrations.verl registers its loss
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=[*OVERRIDES, *user_overrides])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # verl's ActorConfig, validated
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    omega_conf_to_dataclass(cfg.algorithm)  # verl's AlgoConfig (it keeps rollout_correction a dict, as verl reads it)
    correction = omega_conf_to_dataclass(cfg.algorithm.rollout_correction, dataclass_type=RolloutCorrectionConfig)
    env = dict(cfg.ray_kwargs.ray_init.runtime_env.env_vars)
    loss_fn = get_policy_loss_fn(actor.policy_loss.loss_mode)
    assert loss_fn.__module__ == "offpolicy.integrations.verl", f"loss_mode offpolicy is {loss_fn.__module__}"
    from offpolicy.integrations import verl as adapter

    os.environ[adapter.ENV] = env[adapter.ENV]  # as the Ray worker's runtime_env sets it
    loss = adapter.loss_config()
    adapter._check(loss, rollout_is_weights=None)  # what the loss refuses at its first call (anchor old, KL)
    return {"actor_config": type(actor).__name__, "loss_mode": actor.policy_loss.loss_mode,
            "registered": f"{loss_fn.__module__}.{loss_fn.__name__}", "use_v1": bool(cfg.trainer.use_v1),
            "bypass_mode": bool(correction.bypass_mode), "rollout_is": correction.rollout_is,
            adapter.ENV: env[adapter.ENV],
            "anchor": loss.correction.anchor if loss.correction is not None else None}


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's custom reward function for offpolicy's tasks (``reward.custom_reward_function.path=`` this file):
    exact match of the stripped completion, as ``offpolicy.tasks`` scores ``reverse`` and ``addition``."""
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def main(argv: list[str]) -> int:
    cpu = "--cpu" in argv
    argv = [a for a in argv if a != "--cpu"]
    extra = []
    if cpu:
        from offpolicy.integrations import verl as adapter

        os.environ.update(adapter.cpu_env_vars())  # this process too: main_ppo asks the platform before Ray starts
        extra = cpu_overrides()
    if argv[:1] == ["--dry-run"]:
        print(json.dumps(dry_run([*extra, *argv[1:]])))
        return 0
    from verl.trainer.main_ppo import main as main_ppo

    sys.argv = [sys.argv[0], *OVERRIDES, *extra, *argv]  # Hydra reads the command line
    main_ppo()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
