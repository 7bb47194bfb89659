"""``engine=auto``: the rollout engine a run gets when it names none, chosen by measurement.

The rule (``choose``), from ``benchmarks/bench_engine_choice.py`` (figures in docs/performance.md, "Which
engine, by model size"):

- ``engine.logit_noise`` set → ``hf``: the only engine that adds it;
- a ``vllm.*`` option set → ``vllm``: the config asks for vLLM by name;
- on a GPU → ``vllm`` (paged attention, CUDA graphs, continuous batching);
- on the CPU, a model under ``CPU_HF_BELOW`` parameters with a vocabulary of at most ``CPU_HF_MAX_VOCAB``
  tokens (character- and byte-level models, the embedded default among them) → ``hf``. There a generation is
  a few milliseconds of arithmetic, and vLLM's per-step Python (its scheduler, the per-request samplers and
  outputs, re-packing its oneDNN weights at every sync) costs more than HF ``generate``'s one loop over the
  batch: on the 2-core box the embedded default (0.8M parameters, 64 tokens) generates and syncs in 0.70× vLLM's
  time through transformers' ``generate``, 0.43× through the hf engine's own loop with shared prompts.
  The two are even at 3.5M parameters (vocabulary 128) and at a 1,024-token vocabulary (0.9M); past either
  vLLM wins — by 1.25× at a 4,096-token vocabulary, 2.8× at SmolLM2's 49,152 (torch's CPU ``multinomial``,
  which HF ``generate`` samples with, draws an exponential variate for every vocabulary entry of every row:
  ~15 ns each, 46 ms a step for 64 rows at 49,152), 2.5× at SmolLM2-135M itself;
- otherwise ``vllm``; where vLLM cannot be imported, ``hf``, with the import's own error as the reason.

Both engines sample the same distribution (the processed one: temperature, top-k, top-p) and report its
log-probs; what differs is the code that computes it, so the mismatch a run measures is that engine's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# on the CPU, models under both generate faster through the hf engine (module doc)
CPU_HF_BELOW = 2_000_000  # parameters
CPU_HF_MAX_VOCAB = 1_024  # tokens


def parameter_count(model: torch.nn.Module | str | Path) -> int:
    """The parameters of ``model``: a loaded module's (tied weights once), or a model directory's, read from
    its safetensors headers without loading a weight (a sharded checkpoint through its index)."""
    if isinstance(model, torch.nn.Module):
        return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    from safetensors import safe_open

    path = Path(model)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    total = 0
    for name in files:
        with safe_open(str(path / name), framework="pt") as handle:
            total += sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())
    return total


def choose(device: torch.device, parameters: int, vocabulary: int, logit_noise: float = 0.0,
           vllm_options_set: bool = False) -> tuple[str, str]:
    """The engine for ``engine=auto`` and why, in words for the run's header (the rule: module doc)."""
    if logit_noise > 0:
        return "hf", "auto: engine.logit_noise is the hf engine's"
    if vllm_options_set:
        return "vllm", "auto: engine.vllm.* options set"
    size = f"{parameters / 1e6:.1f}M parameters, a {vocabulary:,}-token vocabulary"
    if device.type == "cpu" and parameters < CPU_HF_BELOW and vocabulary <= CPU_HF_MAX_VOCAB:
        return "hf", (f"auto: {size} on the CPU, where HF generate is faster than vLLM (under "
                      f"{CPU_HF_BELOW / 1e6:.0f}M and {CPU_HF_MAX_VOCAB:,}: docs/performance.md)")
    from offpolicy.engines.vllm import vllm_import_error

    error = vllm_import_error()
    if error is not None:
        return "hf", f"auto: vLLM cannot be imported here ({error})"
    return "vllm", "auto: a GPU" if device.type != "cpu" else f"auto: {size} on the CPU"
