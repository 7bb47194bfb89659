"""offpolicy's correction as a verl policy loss (tested with verl 0.9.1).

Importing this module registers the policy loss ``"offpolicy"`` through verl's public registry
(``verl.trainer.ppo.core_algos.register_policy_loss``). offpolicy ships it as a ``verl.plugins``
entry point, which ``import verl`` loads in every process, Ray workers included (verl 0.9.1
``verl/__init__.py``; ``VERL_USE_EXTERNAL_PLUGINS=none`` turns that off). verl only DEBUG-logs a
plugin that fails to import: if ``loss_mode=offpolicy`` then reports "Unsupported loss mode",
run ``python -c "import offpolicy.integrations.verl"`` to see why.

Which offpolicy loss: ``OFFPOLICY_VERL_LOSS`` in the workers' environment — a preset name
(``op.LossConfig.from_preset``) or the path of a YAML file holding a ``LossConfig`` — or
``configure(config)`` in the process that computes the loss.

verl 0.9.1 calls a policy loss as ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights)`` (``verl/workers/utils/losses.py::ppo_loss``): it
never passes the rollout log-probs μ. Hence:

* corrections with ``anchor: rollout`` or ``anchor: current`` (two policies: π_θ and μ) run in
  verl's **bypass mode**, where verl sets ``old_log_probs := rollout_log_probs``; the loss then
  uses μ = ``old_log_prob``. Set ``algorithm.rollout_correction.bypass_mode=True`` with the v1
  trainer (``trainer.use_v1=True``; ``verl/trainer/ppo/v1/trainer_base.py`` only substitutes the log-probs). The legacy
  ``RayPPOTrainer`` (``ray_trainer.py::apply_bypass_mode``) also overwrites ``loss_mode`` with
  verl's own ``"bypass_mode"`` loss; this module wraps that entry so it refuses to run while
  ``OFFPOLICY_VERL_LOSS`` is set, instead of silently training without offpolicy.
* corrections with ``anchor: old`` (three policies) are refused: the loss would need μ next to a
  recomputed π_old, which verl 0.9.1 does not hand a registered loss. Use verl's own
  ``algorithm.rollout_correction`` for decoupled corrections (offpolicy's ``verl:*`` presets
  reproduce them; measure with ``offpolicy diagnose``), or a two-policy correction here.
* verl's own IS weights (``rollout_is_weights`` not None) together with an offpolicy correction
  are refused: the mismatch would be corrected twice. Set ``algorithm.rollout_correction.rollout_is``
  and ``rollout_rs`` to null.

The per-token loss is ``op.policy_loss(log π_θ, π_old, A, mask, μ, config, reduce=False)``;
verl aggregates it with its own ``agg_loss`` over offpolicy's mask, with verl's global batch
info (``dp_size``, ``batch_num_tokens``, ``global_batch_size``), so verl's ``loss_agg_mode`` and
its micro-batch/data-parallel normalisation decide the reduction (when verl sets a global token
count, the denominator is verl's valid-token count: ``denominator: fixed`` in effect).
offpolicy's ``agg`` is not used. The KL term to a reference model stays verl's
(``actor.use_kl_loss``); a KL to μ (``kl_to: rollout``) is offpolicy's, on the μ of bypass mode.
Host defaults (``offpolicy.integrations.host``): an unset ``nonfinite`` is ``neutral``; a
micro-batch without a valid token gives a zero loss and ``all_masked_micro_batch`` = 1. Metrics come
back as floats under ``offpolicy/``; verl averages them over micro-batches and ranks
(``AggregationType.MEAN``), so ``*_min``/``*_max`` are means of per-micro-batch extremes.

Dumps for ``offpolicy diagnose --batch``: ``OFFPOLICY_VERL_DUMP_DIR`` (and ``OFFPOLICY_VERL_DUMP_EVERY``,
default 1) in the workers' environment write every N-th call of the loss in each process (the loss
does not see verl's step; the file's "step" is that call index). In bypass mode verl never
recomputes π_old, so the dump's ``old_logprobs`` is sg(π_θ) of that micro-batch (π_old itself on
the first PPO epoch), ``rollout_logprobs`` is μ, and ``meta.anchor`` is "rollout".

Would break on upgrade if verl changes the policy-loss signature, ``agg_loss``'s keywords,
``config.global_batch_info``, the ``verl.plugins`` group, or where bypass mode substitutes μ.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import verl
from verl.trainer.ppo import core_algos

import offpolicy as op
from offpolicy.core.config import ConfigError
from offpolicy.integrations import host
from offpolicy.integrations.dump import BatchDumper

TESTED_VERSION = "0.9.1"
ENV = "OFFPOLICY_VERL_LOSS"
LOSS_NAME = "offpolicy"

_configured: op.LossConfig | None = None
_calls = 0
_dumper: BatchDumper | None = None


def configure(config: op.LossConfig | str | None) -> None:
    """Set the offpolicy loss for this process (a ``LossConfig`` or preset name; None = use ``OFFPOLICY_VERL_LOSS``)."""
    global _configured
    _configured = None if config is None else host.loss_config_of(config, "configure")


def loss_config() -> op.LossConfig:
    """The configured ``LossConfig``: ``configure(...)`` first, else ``$OFFPOLICY_VERL_LOSS``.

    Raises:
        ConfigError: neither is set, or the value is neither a preset nor a readable YAML file.
    """
    if _configured is not None:
        return _configured
    value = os.environ.get(ENV)
    if not value:
        raise ConfigError(f"actor.policy_loss.loss_mode={LOSS_NAME!r} but {ENV} is not set in this worker: set it to "
                          "a preset name (e.g. verl:bypass_ppo_clip) or a LossConfig YAML path, for every Ray worker "
                          "(ray runtime_env env_vars), or call offpolicy.integrations.verl.configure(...)")
    return host.loss_config_of(value, ENV)


def _check(cfg: op.LossConfig, rollout_is_weights: torch.Tensor | None) -> None:
    corr = cfg.correction
    if corr is None:
        if cfg.kl_coef > 0:  # kl_to 'rollout': μ reaches the loss only in bypass mode, with a correction
            raise ConfigError(f"{ENV}: kl_to 'rollout' takes the KL to μ, which verl passes to a policy loss only in "
                              "bypass mode (old_log_prob := μ) with an offpolicy correction; add a two-policy "
                              "correction (anchor 'rollout'), or set kl_coef 0 and use verl's actor.use_kl_loss")
        return
    if rollout_is_weights is not None:
        raise ConfigError("verl passed rollout_is_weights (algorithm.rollout_correction.rollout_is is set) and the "
                          f"offpolicy loss ({ENV}) also corrects the mismatch: it would count twice. Set "
                          "algorithm.rollout_correction.rollout_is=null and rollout_rs=null, or drop the offpolicy correction")
    if corr.anchor == "old":
        raise ConfigError(f"{ENV}: correction.anchor 'old' (three policies) needs the rollout log-probs next to "
                          f"π_old, and verl {TESTED_VERSION} does not pass them to a policy loss. Use anchor 'rollout' "
                          "or 'current' with algorithm.rollout_correction.bypass_mode=True (e.g. verl:bypass_ppo_clip, "
                          "verl:bypass_pg_is), or verl's own algorithm.rollout_correction for decoupled corrections")
    host.check_kl(cfg, "verl", "actor.use_kl_loss, actor.kl_loss_coef")


@core_algos.register_policy_loss(LOSS_NAME)
def offpolicy_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss: ``agg_loss(ℓ, m, loss_agg_mode)`` with ``(ℓ, m) = op.policy_loss(log π_θ, π_old, A,
    mask, μ, cfg, reduce=False)``; in bypass mode π_old = μ = ``old_log_prob`` (module docstring)."""
    cfg = host.host_nonfinite_default(loss_config(), "verl")
    _check(cfg, rollout_is_weights)
    mask = response_mask.to(log_prob.dtype)
    if not host.has_valid_token(mask):
        # verl's agg_loss gives 0 here with its global counts and 0/0 = NaN without; offpolicy refuses the
        # batch. The zero (host.empty_loss) is what a micro-batch without a token contributes to the sum.
        loss, metrics = host.empty_loss(log_prob, mask)
        return loss, host.host_floats(metrics)
    # Bypass mode: verl put μ in old_log_prob. Without a correction μ is not used at all.
    rollout = old_log_prob if cfg.correction is not None else None
    per_token, loss_mask, metrics = op.policy_loss(log_prob, old_log_prob, advantages, mask, rollout, cfg, reduce=False)
    batch_info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    loss = core_algos.agg_loss(loss_mat=per_token, loss_mask=loss_mask, loss_agg_mode=loss_agg_mode, **batch_info)
    _maybe_dump(log_prob, old_log_prob, response_mask, advantages, cfg)
    return loss, host.host_floats(host.micro_batch_metrics(metrics))


def _maybe_dump(log_prob, old_log_prob, response_mask, advantages, cfg: op.LossConfig) -> None:
    global _calls, _dumper
    directory = os.environ.get("OFFPOLICY_VERL_DUMP_DIR")
    if not directory or cfg.correction is None:
        return
    if _dumper is None or str(_dumper.directory) != directory:
        every = int(os.environ.get("OFFPOLICY_VERL_DUMP_EVERY", "1"))
        _dumper = BatchDumper(directory, every=every, host="verl", host_version=HOST_VERSION)
    _dumper.maybe_dump(_calls, old_logprobs=log_prob.detach(), rollout_logprobs=old_log_prob,
                       mask=response_mask.float(), advantages=advantages, logprobs=log_prob,
                       meta={"anchor": "rollout", "note": "old_logprobs is sg(pi_theta): bypass mode has no pi_old"})
    _calls += 1


def _guard_bypass_loss() -> None:
    """Legacy RayPPOTrainer bypass mode replaces loss_mode with verl's "bypass_mode" loss (verl 0.9.1
    rollout_corr_helper.apply_bypass_mode): refuse it while the user asked for offpolicy's loss."""
    original = core_algos.POLICY_LOSS_REGISTRY.get("bypass_mode")
    if original is None or getattr(original, "_offpolicy_guard", False):
        return

    def guarded(*args: Any, **kwargs: Any):
        if os.environ.get(ENV) or _configured is not None:
            raise ConfigError(f"{ENV} is set but verl runs its own 'bypass_mode' loss: the legacy RayPPOTrainer's "
                              "bypass mode overwrites actor.policy_loss.loss_mode. Use the v1 trainer with "
                              "bypass_mode=True, or unset the offpolicy loss")
        return original(*args, **kwargs)

    guarded._offpolicy_guard = True  # type: ignore[attr-defined]
    core_algos.POLICY_LOSS_REGISTRY["bypass_mode"] = guarded


_guard_bypass_loss()
HOST_VERSION = getattr(verl, "__version__", "unknown")


# --- An offpolicy CPU platform for verl (opt-in: docs/hosts-end-to-end.md, "## verl") ---------------------------
# verl 0.9.1 knows the platforms cuda, npu and rocm and falls back to "nvidia" without an accelerator. Its public
# platform registry (verl.plugin.platform: PlatformRegistry.register, chosen by VERL_PLATFORM) takes more; this
# one is registered at import under CPU_PLATFORM and used only where VERL_PLATFORM names it. It never
# auto-detects (is_platform_available is False), so a GPU machine is untouched.

CPU_PLATFORM = "offpolicy_cpu"
SETUP_HOOK = "offpolicy.integrations.verl.cpu_worker_setup"


def _cpu_device_module():
    """What verl calls on ``get_torch_device()`` (its ``torch.cuda`` stand-in), answered for the CPU:
    ``torch.cpu``'s functions, and no-ops or zeros for the memory and RNG calls ``torch.cpu`` lacks."""
    import types

    def nothing(*args, **kwargs):
        return None

    def zero(*args, **kwargs):
        return 0

    return types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1,
        get_device_name=lambda *a: "CPU", set_device=nothing, synchronize=nothing, empty_cache=nothing,
        ipc_collect=nothing, set_per_process_memory_fraction=nothing, reset_peak_memory_stats=nothing,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state, max_memory_allocated=zero, max_memory_reserved=zero,
        memory_allocated=zero, memory_reserved=zero, mem_get_info=lambda *a: (0, 0),
        current_stream=torch.cpu.current_stream, stream=torch.cpu.stream, Stream=torch.cpu.Stream,
        Event=torch.cpu.Event)


_CPU_PLATFORM_CLASS: list[type] = []  # the class _register_cpu_platform registered (cpu_platform builds one)


def cpu_platform():
    """An instance of the CPU platform registered under ``CPU_PLATFORM``, for ``verl``'s ``set_platform`` in a
    process that runs verl's worker code itself (the tests' actor step) rather than through ``VERL_PLATFORM``."""
    return _CPU_PLATFORM_CLASS[0]()


def _register_cpu_platform() -> None:
    import contextlib

    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform=CPU_PLATFORM)
    class CPUPlatform(PlatformBase):
        """The CPU as a verl platform. ``current_device`` is "cpu" (verl moves modules with
        ``.to(get_device_id())``, where an integer names an accelerator). Ray resource "GPU": verl's
        placement bundles and its resource check count that name, so a CPU Ray cluster declares logical
        GPUs (``ray.init(num_gpus=N)``) that only schedule verl's workers."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _cpu_device_module()

        def is_available(self): return True
        def is_platform_available(self, use_smi_check=False): return False  # only ever chosen by VERL_PLATFORM
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, device_index): return None
        def synchronize(self, device_index=None): return None
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): return None
        def empty_cache(self): return None
        def get_device_capability(self, device_index=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        @contextlib.contextmanager
        def nvtx_range(self, msg): yield
        def profiler_start(self): return None
        def profiler_stop(self): return None
        def ray_resource_name(self): return "GPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

    _CPU_PLATFORM_CLASS.append(CPUPlatform)


def cpu_env_vars() -> dict[str, str]:
    """The environment verl's Ray workers need on a CPU machine (with ``cpu_worker_setup`` as Ray's
    ``worker_process_setup_hook``): the platform, and ``VERL_ENGINE_DEVICE=cuda`` — verl's own override
    of its engine lookup, whose FSDP engine is registered for cuda/npu only; the engine then runs on this
    platform's device, the CPU; ``VLLM_TARGET_DEVICE=cpu``, vLLM's own choice of its CPU platform for the
    rollout servers."""
    return {"VERL_PLATFORM": CPU_PLATFORM, "VERL_ENGINE_DEVICE": "cuda", "VLLM_TARGET_DEVICE": "cpu"}


def cpu_worker_setup() -> None:
    """Ray ``worker_process_setup_hook`` for verl on the CPU platform, run in every Ray worker before its task.

    * A verl worker (``WG_BACKEND=ray``, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from its worker
      group) gets its gloo process group here: verl asks ``init_process_group`` for
      ``cpu:gloo,<device>:<backend>``, which for this platform is ``cpu:gloo,cpu:gloo`` and torch refuses
      ("Duplicate device type cpu"); verl skips its own when one exists.
    * With trl >= 1.16 installed next to verl 0.9.1, verl's model patching imports trl's
      ``AutoModelForCausalLMWithValueHead``, which trl removed: verl is told trl is absent (verl's
      ``monkey_patch.is_trl_available``), as when trl is not installed.
    """
    if os.environ.get("VERL_PLATFORM") != CPU_PLATFORM:
        return
    _trl_without_value_head()
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if os.environ.get("WG_BACKEND") == "ray" and all(k in os.environ for k in needed):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _trl_without_value_head() -> None:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return
    try:
        from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
        return
    except ImportError:
        pass
    import verl.models.transformers.monkey_patch as verl_patch

    verl_patch.is_trl_available = lambda: False


_register_cpu_platform()
