"""offpolicy inside OpenRLHF 0.11.2 (Ray + DeepSpeed + vLLM).

OpenRLHF's actor builds one ``PolicyLoss`` (``openrlhf/trainer/ray/ppo_actor.py``,
``ActorPPOTrainer.__init__``, 0.11.2) and calls it once per micro-batch as

    loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = actor_loss_fn(
        log_probs, old_log_probs, advantages, action_mask=..., rollout_log_probs=...,
        dp_size=..., batch_num_tokens=..., global_batch_size=...)

``OffpolicyPolicyLoss`` is a ``PolicyLoss`` subclass with that constructor and that 5-tuple. Its
forward runs offpolicy's math unreduced,

    ℓ_t, m_t = op.policy_loss(log π_θ, log π_old, A, mask, log μ, cfg, reduce=False)

(ℓ_t = −w_t·clip-surrogate_t, rejected/padding tokens 0; m_t the aggregation mask) and hands
(ℓ, m) to OpenRLHF's own ``aggregate_loss`` with the host's ``dp_size`` / ``batch_num_tokens`` /
``global_batch_size``, so the cross-rank token/sample normalisation stays OpenRLHF's.

Installing it (every Ray worker, plus the driver):

    import ray, runpy
    from offpolicy.integrations import openrlhf as op_openrlhf
    ray.init(runtime_env=op_openrlhf.runtime_env("recommended"))   # LossConfig, preset or YAML path
    op_openrlhf.setup_worker()                                      # the driver: vLLM logprobs_mode
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")   # argv as usual

A driver without OpenRLHF's GPU dependencies (``openrlhf.models`` imports flash-attn and
DeepSpeed at module level in 0.11.2) can still import this module and call ``runtime_env`` /
``resolve_config``; the loss and :func:`install` then raise an ImportError naming what is missing.

``runtime_env`` names :func:`setup_worker` as Ray's ``worker_process_setup_hook`` and carries the
loss config in ``OFFPOLICY_OPENRLHF_LOSS``; in each worker process :func:`setup_worker` replaces
``PolicyLoss`` where ``ppo_actor`` imports it from (``openrlhf.models``), forces rollout
log-probs on (``SamplingParams(logprobs=1)`` in ``samples_generator``, ``logprobs_mode=
"processed_logprobs"`` in ``create_vllm_engines`` — OpenRLHF 0.11.2 requests both only when its
own ``--algo.advantage.is_correction_level`` is on), and adds offpolicy's metrics to
``training_step``'s status dict. Everything is guarded by the OpenRLHF version.

Host defaults (``offpolicy.integrations.host``): an unset ``nonfinite`` is ``neutral``; a
micro-batch without a valid token gives OpenRLHF's zero loss and ``all_masked_micro_batch`` = 1;
``ppo_kl``/``vllm_kl`` average over valid tokens with finite inputs (never NaN from one bad μ).

Refused: OpenRLHF's own correction (``is_correction_level`` ≠ off) together with offpolicy's —
the ratio π_old/μ would be applied twice; ``kl_coef`` > 0 with ``kl_to: ref`` (OpenRLHF adds its
own KL term from ``--algo.kl.*``; ``PolicyLoss`` never sees the reference log-probs; a KL to μ,
``kl_to: rollout``, is computed by offpolicy); ``correction.denominator:
renormalize`` (OpenRLHF's global token/sample counts are fixed before the loss); clip/dual-clip/
loss-type arguments that disagree with the LossConfig (the LossConfig governs; the host's values
must match so its logs do not lie). The aggregation is OpenRLHF's (``--actor.loss_agg_mode``);
the LossConfig's ``agg`` is not used.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, ClassVar

import torch

import offpolicy as op
from offpolicy.core.config import ConfigError, CorrectionConfig, LossConfig
from offpolicy.integrations import host
from offpolicy.integrations.dump import BatchDumper

_HOST_IMPORT_ERROR: ImportError | None = None
try:
    from openrlhf.models.loss import PolicyLoss, aggregate_loss
except ImportError as _err:
    if importlib.util.find_spec("openrlhf") is None:  # pragma: no cover - exercised only without OpenRLHF
        raise ImportError(
            f"offpolicy.integrations.openrlhf needs OpenRLHF ({_err}); "
            "install it with `pip install offpolicy[openrlhf]`"
        ) from _err
    # OpenRLHF is installed but ``openrlhf.models`` imports its GPU stack at module level (flash-attn,
    # DeepSpeed; 0.11.2). A Ray driver on such a machine still needs runtime_env()/resolve_config();
    # the loss itself and install() raise _HOST_IMPORT_ERROR's reason when used.
    _HOST_IMPORT_ERROR = _err
    PolicyLoss = torch.nn.Module  # type: ignore[misc,assignment]
    aggregate_loss = None  # type: ignore[assignment]

TESTED_VERSIONS = ("0.11.2",)
ENV_LOSS = "OFFPOLICY_OPENRLHF_LOSS"
ENV_DUMP_DIR = "OFFPOLICY_OPENRLHF_DUMP_DIR"
ENV_DUMP_EVERY = "OFFPOLICY_OPENRLHF_DUMP_EVERY"
METRIC_PREFIX = "offpolicy/"


def host_version() -> str:
    return host.host_version("openrlhf")


def _require_host() -> None:
    if _HOST_IMPORT_ERROR is not None:
        raise ImportError(
            f"OpenRLHF's openrlhf.models does not import in this process ({_HOST_IMPORT_ERROR}): it needs OpenRLHF's "
            "GPU dependencies (flash-attn, DeepSpeed). Run the loss where they are installed (the Ray workers); "
            "runtime_env() and resolve_config() work without them"
        ) from _HOST_IMPORT_ERROR


def _check_version() -> None:
    _require_host()
    v = host_version()
    if v not in TESTED_VERSIONS and os.environ.get("OFFPOLICY_OPENRLHF_ANY_VERSION") != "1":
        raise RuntimeError(
            f"offpolicy.integrations.openrlhf was written against OpenRLHF {', '.join(TESTED_VERSIONS)} "
            f"(PolicyLoss's 5-tuple, ppo_actor's import of PolicyLoss, samples_generator's SamplingParams); "
            f"found {v}. Install openrlhf=={TESTED_VERSIONS[-1]}, or set OFFPOLICY_OPENRLHF_ANY_VERSION=1 "
            "after checking those three contracts in the new release."
        )


def resolve_config(spec: LossConfig | CorrectionConfig | str | None) -> LossConfig:
    """A LossConfig from a LossConfig, a CorrectionConfig (PPO ε = 0.2 around it), a preset name
    (``"recommended"``, ``"openrlhf:icepop"``) or a YAML path; None reads ``$OFFPOLICY_OPENRLHF_LOSS``."""
    if spec is None:
        spec = os.environ.get(ENV_LOSS)
        if not spec:
            raise ConfigError(
                f"OffpolicyPolicyLoss: no offpolicy loss configured; call install(config) in this process or set "
                f"{ENV_LOSS} (a preset name or a YAML path) — runtime_env(config) does both for Ray workers"
            )
    return host.loss_config_of(spec, "OffpolicyPolicyLoss")  # runtime_env() passes config objects as JSON


class OffpolicyPolicyLoss(PolicyLoss):
    """OpenRLHF's ``PolicyLoss`` running offpolicy's corrected loss (see the module docstring).

    Same constructor as ``openrlhf.models.loss.PolicyLoss`` (0.11.2), plus keyword-only
    ``loss_config`` / ``dumper`` (default: the class-level ones :func:`install` sets, else
    ``$OFFPOLICY_OPENRLHF_LOSS``). ``forward`` returns ``(loss, clip_ratio, ppo_kl, vllm_kl,
    is_filter_ratio)`` like the host: vllm_kl = mean_t(log μ − log π_old) over the action mask,
    is_filter_ratio = offpolicy's ``masked_fraction`` + the fractions outside the weight's band;
    all offpolicy metrics are kept in
    ``self.last_metrics`` (an ``op.Metrics``, merged over the micro-batches since the last
    :meth:`pop_metrics`).
    """

    loss_config: ClassVar[LossConfig | None] = None
    dumper: ClassVar[BatchDumper | None] = None

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: float | None = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold: Any = (0.5, 5.0), *,
                 loss_config: LossConfig | CorrectionConfig | str | None = None,
                 dumper: BatchDumper | None = None) -> None:
        _require_host()
        super().__init__(clip_eps_low, clip_eps_high, dual_clip, token_level_loss, policy_loss_type,
                         is_correction_level, is_correction_mode, is_correction_gating, is_correction_threshold)
        if is_correction_level != "off":
            raise ConfigError(
                f"--algo.advantage.is_correction_level={is_correction_level}: OpenRLHF's own vLLM IS correction and "
                "offpolicy's would both weight the loss by π_old/μ. Set --algo.advantage.is_correction_level off "
                "(offpolicy's setup_worker still requests the rollout log-probs), or do not install offpolicy's loss."
            )
        cfg = resolve_config(loss_config if loss_config is not None else type(self).loss_config)
        cfg = host.host_nonfinite_default(cfg, "OpenRLHF")
        self._check_agrees(cfg)
        self.config = cfg
        self.dump = dumper if dumper is not None else (type(self).dumper or _dumper_from_env())
        self.calls = 0
        self.last_metrics: op.Metrics | None = None

    def _check_agrees(self, cfg: LossConfig) -> None:
        # Aggregation is OpenRLHF's (token_level_loss from --actor.loss_agg_mode; gspo forces
        # per-sample, as PolicyLoss.__init__ 0.11.2 does); the LossConfig's agg is not used.
        # ppo_actor always passes batch_num_tokens / global_batch_size (loss_utils.get_loss_batch_info,
        # 0.11.2): counts of *valid* tokens/samples over ranks, fixed before the loss runs.
        host.check_fixed_denominator(cfg, "OpenRLHF divides by its global count of valid tokens (batch_num_tokens) "
                                     "or samples, fixed before the loss runs")
        host.check_kl(cfg, "OpenRLHF", "--algo.kl.use_loss, --algo.kl.init_coef")
        want_type = "gspo" if cfg.kind == "gspo" else "ppo"
        if self.policy_loss_type != want_type:
            raise ConfigError(
                f"--actor.policy_loss_type={self.policy_loss_type} but loss.kind={cfg.kind!r}: set "
                f"--actor.policy_loss_type {want_type} (offpolicy computes the loss; OpenRLHF's type only "
                "picks its aggregation)"
            )
        if cfg.kind in ("ppo", "gspo"):
            host_clip = (self.clip_eps_low, self.clip_eps_high, self.dual_clip)
            ours = (cfg.clip_low, cfg.clip_high, cfg.dual_clip)
            if host_clip != ours:
                raise ConfigError(
                    f"OpenRLHF --actor.eps_clip_low_high/--actor.dual_clip = {host_clip} but the LossConfig has "
                    f"(clip_low, clip_high, dual_clip) = {ours}; offpolicy's values are the ones applied — "
                    "set both alike"
                )

    def forward(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                action_mask: torch.Tensor | None = None, rollout_log_probs: torch.Tensor | None = None,
                dp_size: int = 1, batch_num_tokens: float | None = None, global_batch_size: float | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        cfg = self.config
        if cfg.correction is not None and rollout_log_probs is None:
            raise RuntimeError(
                "OffpolicyPolicyLoss: experience.rollout_log_probs is None, so vLLM returned no log-probs. Run "
                "offpolicy.integrations.openrlhf.setup_worker() in every Ray worker (ray.init(runtime_env="
                "runtime_env(config))) — OpenRLHF 0.11.2 requests them only when its own correction is on"
            )
        mask = action_mask if action_mask is not None else torch.ones_like(log_probs)
        has_tokens = host.has_valid_token(mask)
        if has_tokens:
            per_token, agg_mask, metrics = op.policy_loss(
                log_probs, old_log_probs, advantages, mask, rollout_log_probs, cfg, reduce=False)
            loss = aggregate_loss(per_token, agg_mask.to(per_token.dtype), token_level_loss=self.token_level_loss,
                                  dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                                  global_batch_size=global_batch_size)
            host.micro_batch_metrics(metrics)
        else:  # OpenRLHF's own masked sum is 0 here; offpolicy refuses a batch without a token
            loss, metrics = host.empty_loss(log_probs, mask)
        dev = log_probs.device
        # this micro-batch's floats; a statistic over no kept token is 0 (host.host_floats): OpenRLHF sums
        # ppo_clip_ratio × tokens over micro-batches and ranks, where one NaN would make every rank's NaN
        floats = host.host_floats(metrics, prefix="")
        clip_ratio = torch.tensor(floats.get("clip_fraction", 0.0), device=dev, dtype=torch.float32)
        # the host's logged means, over valid tokens whose inputs are finite: a NaN μ that the nonfinite policy
        # neutralised in the loss must not turn vllm_kl into NaN (nor NaN padding, NaN · 0 = NaN)
        ok = (mask != 0) & torch.isfinite(old_log_probs.detach()) & torch.isfinite(log_probs.detach())
        ppo_kl = _masked_mean(old_log_probs.detach().float() - log_probs.detach().float(), ok)
        vllm_kl = is_filter_ratio = None
        if rollout_log_probs is not None:
            ok_mu = ok & torch.isfinite(rollout_log_probs)
            vllm_kl = _masked_mean(rollout_log_probs.float() - old_log_probs.detach().float(), ok_mu)
            # OpenRLHF's is_filter_ratio counts tokens its gate dropped (mask) or clamped (clip): here the
            # rejected fraction plus the fractions outside the weight's band (a token both rejected and
            # outside the band counts twice; capped at 1).
            filtered = sum(floats.get(k, 0.0) for k in ("masked_fraction", "fraction_below_low", "fraction_above_high"))
            is_filter_ratio = torch.tensor(min(filtered, 1.0), device=dev, dtype=torch.float32)
        self.last_metrics = metrics if self.last_metrics is None else self.last_metrics.merge(metrics)
        if self.dump is not None and rollout_log_probs is not None and has_tokens:
            self.dump.maybe_dump(self.calls, old_logprobs=old_log_probs, rollout_logprobs=rollout_log_probs,
                                 mask=mask, advantages=advantages.expand_as(mask), logprobs=log_probs,
                                 meta={"step_unit": "PolicyLoss.forward call (micro-batch)"})
        self.calls += 1
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio

    def pop_metrics(self, prefix: str = METRIC_PREFIX) -> dict[str, float]:
        """offpolicy's metrics merged since the last call, as ``{prefix + name: value}``; then cleared."""
        out = {} if self.last_metrics is None else host.host_floats(self.last_metrics, prefix)
        self.last_metrics = None
        return out


def _masked_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Σ x over ``keep`` / max(Σ keep, 1), selecting before summing (0 where nothing is kept)."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(keep, x, zero).sum() / keep.sum().clamp(min=1)


def _dumper_from_env() -> BatchDumper | None:
    d = os.environ.get(ENV_DUMP_DIR)
    if not d:
        return None
    return BatchDumper(d, every=int(os.environ.get(ENV_DUMP_EVERY, "1")), host="openrlhf", host_version=host_version())


def add_metrics_to_status(status: dict[str, Any], loss_fn: Any) -> dict[str, Any]:
    """Put ``loss_fn``'s offpolicy metrics into a ``training_step`` status dict (0.11.2 layout:
    ``{"metrics": {name: tensor}, "weights": {name: "token" | "sample" | None}}``); 0-D tensors
    weighted "token", the way ppo_actor weights its own loss statistics."""
    if isinstance(loss_fn, OffpolicyPolicyLoss):
        for k, v in loss_fn.pop_metrics().items():
            status["metrics"][k] = torch.tensor(v, dtype=torch.float32)
            status["weights"][k] = "token"
    return status


def _wrap_training_step(cls: type) -> None:
    if getattr(cls.training_step, "_offpolicy", False):
        return
    original = cls.training_step

    @functools.wraps(original)
    def training_step(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return add_metrics_to_status(original(self, *args, **kwargs), self.actor_loss_fn)

    training_step._offpolicy = True  # type: ignore[attr-defined]
    cls.training_step = training_step


def _forced_sampling_params(real: Any) -> Any:
    @functools.wraps(real)
    def sampling_params(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("logprobs") is None:
            kwargs["logprobs"] = 1  # the sampled token's log μ; OpenRLHF reads response["rollout_log_probs"]
        return real(*args, **kwargs)

    sampling_params._offpolicy = True  # type: ignore[attr-defined]
    return sampling_params


def _forced_create_vllm_engines(real: Any) -> Any:
    sig = inspect.signature(real)

    @functools.wraps(real)
    def create_vllm_engines(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        if bound.arguments.get("logprobs_mode") is None:
            # log μ after temperature/top-p, the distribution actually sampled (docs/specification.md §1: μ).
            bound.arguments["logprobs_mode"] = "processed_logprobs"
        return real(*bound.args, **bound.kwargs)

    create_vllm_engines._offpolicy = True  # type: ignore[attr-defined]
    return create_vllm_engines


def install(config: LossConfig | CorrectionConfig | str | None = None, *,
            dumper: BatchDumper | None = None) -> list[str]:
    """Install offpolicy in this process; returns what was patched (for logs and tests).

    - ``PolicyLoss`` → :class:`OffpolicyPolicyLoss` in ``openrlhf.models`` (where ppo_actor imports
      it from) and in ``ppo_actor`` if already imported; ``ActorPPOTrainer.training_step`` then
      adds offpolicy's metrics to its status dict.
    - ``samples_generator.SamplingParams`` asks vLLM for the sampled token's log-prob;
      ``create_vllm_engines`` gets ``logprobs_mode="processed_logprobs"``.
    Modules that cannot be imported in this process (a driver without DeepSpeed) are skipped.
    """
    _check_version()
    OffpolicyPolicyLoss.loss_config = resolve_config(config)
    if dumper is not None:
        OffpolicyPolicyLoss.dumper = dumper
    done: list[str] = []
    for name in ("openrlhf.models", "openrlhf.models.loss"):
        mod = _try_import(name)
        if mod is not None and getattr(mod, "PolicyLoss", None) is not OffpolicyPolicyLoss:
            mod.PolicyLoss = OffpolicyPolicyLoss
            done.append(f"{name}.PolicyLoss")
    actor = sys.modules.get("openrlhf.trainer.ray.ppo_actor") or _try_import("openrlhf.trainer.ray.ppo_actor")
    if actor is not None:
        actor.PolicyLoss = OffpolicyPolicyLoss
        _wrap_training_step(actor.ActorPPOTrainer)
        done.append("openrlhf.trainer.ray.ppo_actor.{PolicyLoss,ActorPPOTrainer.training_step}")
    gen = _try_import("openrlhf.trainer.ppo_utils.samples_generator")
    if gen is not None and not getattr(gen.SamplingParams, "_offpolicy", False):
        gen.SamplingParams = _forced_sampling_params(gen.SamplingParams)
        done.append("openrlhf.trainer.ppo_utils.samples_generator.SamplingParams")
    for name in ("openrlhf.trainer.ray.vllm_engine", "openrlhf.trainer.ray"):
        mod = _try_import(name)
        if mod is not None and not getattr(mod.create_vllm_engines, "_offpolicy", False):
            mod.create_vllm_engines = _forced_create_vllm_engines(mod.create_vllm_engines)
            done.append(f"{name}.create_vllm_engines")
    return done


def _try_import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook``: :func:`install` from ``$OFFPOLICY_OPENRLHF_LOSS``."""
    install(None)


def runtime_env(config: LossConfig | CorrectionConfig | str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Ray ``runtime_env`` that installs offpolicy in every worker: the setup hook, and the config
    in ``$OFFPOLICY_OPENRLHF_LOSS`` (a preset name or YAML path as given, a config object as JSON)."""
    # exclude_unset: a field left unset must stay unset in the workers (an unset correction.nonfinite
    # becomes the host default 'neutral' there; dumping the default would pin 'error')
    cfg_spec = config if isinstance(config, str) else resolve_config(config).model_dump_json(exclude_unset=True)
    env = dict(base or {})
    env_vars = {**env.get("env_vars", {}), ENV_LOSS: cfg_spec}
    for key in (ENV_DUMP_DIR, ENV_DUMP_EVERY):
        if os.environ.get(key):
            env_vars[key] = os.environ[key]
    # OpenRLHF's own ray.init defaults (train_ppo_ray.train, 0.11.2), kept since our ray.init replaces it.
    env_vars.setdefault("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "true"))
    env_vars.setdefault("NCCL_DEBUG", os.environ.get("NCCL_DEBUG", "WARN"))
    env_vars.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"))
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = "offpolicy.integrations.openrlhf.setup_worker"
    return env
