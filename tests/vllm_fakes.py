"""Fakes of ``vllm.LLM`` and of the worker it reaches through ``collective_rpc``, for tests that must not
start vLLM. They cannot drift from the real API: every call offpolicy makes is bound to the installed
vLLM's own signature (``inspect.signature`` of ``LLM.__init__``, ``generate``, ``sleep``, ``wake_up``,
``reset_prefix_cache``, ``collective_rpc`` and the model runner's ``reload_weights``, to which the
worker forwards), so a wrong name or argument raises ``TypeError`` as it would against vLLM, and the
``LLM(...)`` keywords must each be a field of the installed ``EngineArgs``. Outputs are vLLM's own
``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` objects.

``install(monkeypatch, platform)`` puts ``FakeLLM`` in place of ``vllm.LLM``; with ``platform="cuda"``
vLLM's platform reports CUDA (``is_cpu()`` False), so the engine takes its GPU path on this machine.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import types

import torch
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.logprobs import Logprob
from vllm.model_executor.model_loader.reload import inplace
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

LLM = vllm.LLM  # the real class, bound against even while FakeLLM stands in for it
NOT_LOADED_FORMAT = "Following weights were not loaded from checkpoint: %s"
# the fake's warning is vLLM's own: its logger, and words its source still holds
assert NOT_LOADED_FORMAT in inspect.getsource(inplace), "vLLM's reload no longer reports unloaded weights this way"
DUMP = "Dumping input data for V1 LLM engine"  # how vLLM's dump of a failed step begins (dump_input.py)


def bind(cls, method: str, *args, **kwargs) -> inspect.BoundArguments:
    """``args``/``kwargs`` bound to the installed ``cls.method`` (self taken as None); TypeError if they do not fit."""
    bound = inspect.signature(getattr(cls, method)).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound


class FakeWorker:
    """vLLM's worker as ``LLM.collective_rpc`` reaches it. ``Worker.reload_weights(*args, **kwargs)`` forwards
    to the model runner's ``reload_weights``, whose signature the call is bound to; the weights iterator is
    consumed as vLLM consumes it, one tensor at a time while loading. With ``parameters`` (the engine model's
    parameter names) set, the names the iterator did not cover are reported as vLLM's in-place reload reports
    them: one warning of its own logger, in its own words (``reload/inplace.py``)."""

    parameters: set[str] | None = None

    def __init__(self, calls: list):
        self.calls = calls
        self.loaded: list[tuple[str, torch.Tensor]] = []
        # what a callable sent through collective_rpc reads: a model with no layer vLLM's CPU dispatch packed
        # (so the engine's direct sync is off and every sync goes through reload_weights), an unquantized config
        self.model_runner = types.SimpleNamespace(get_model=torch.nn.Module)
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=None),
                                                 lora_config=None)

    def reload_weights(self, *args, **kwargs) -> None:
        bound = bind(GPUModelRunner, "reload_weights", *args, **kwargs)
        self.calls.append(("reload_weights",))
        names = set()
        for name, tensor in bound.arguments["weights_iterator"]:
            self.calls.append(("loaded", name))
            self.loaded.append((name, tensor))
            names.add(name)
        missing = (self.parameters or set()) - names
        if missing:
            inplace.logger.warning(NOT_LOADED_FORMAT, missing)


class FakeLLM:
    """Records the ``LLM(...)`` keywords and every call, in order (``calls``). ``fail_generate`` (an
    exception) makes ``generate`` log a dump through vLLM's logger, as vLLM does when a step fails, and raise it."""

    instances: list[FakeLLM] = []
    fail_generate: Exception | None = None

    def __init__(self, *args, **kwargs):
        bind(LLM, "__init__", *args, **kwargs)
        self.kwargs = {**dict(zip(["model"], args)), **kwargs}
        unknown = set(self.kwargs) - {f.name for f in dataclasses.fields(EngineArgs)}  # LLM builds EngineArgs
        if unknown:
            raise TypeError(f"EngineArgs has no field(s) {sorted(unknown)}")
        self.calls: list[tuple] = []
        self.worker = FakeWorker(self.calls)
        FakeLLM.instances.append(self)

    def generate(self, *args, **kwargs) -> list[RequestOutput]:
        bound = bind(LLM, "generate", *args, **kwargs)
        self.calls.append(("generate",))
        self.sampling_params = bound.arguments["sampling_params"]
        if FakeLLM.fail_generate is not None:
            logging.getLogger("vllm.v1.engine.core").error("%s (v%s) with config: %s", DUMP, vllm.__version__,
                                                            "x" * 50_000)
            raise FakeLLM.fail_generate
        outputs = []
        for i, (prompt, params) in enumerate(zip(bound.arguments["prompts"], bound.arguments["sampling_params"])):
            ids = [(5 + i + t) % 40 for t in range(params.max_tokens)]
            logprobs = [{token: Logprob(logprob=-1.0 - 0.1 * t)} for t, token in enumerate(ids)]
            completion = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None, logprobs=logprobs,
                                          finish_reason="length")
            outputs.append(RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=prompt["prompt_token_ids"],
                                         prompt_logprobs=None, outputs=[completion], finished=True))
        return outputs

    def sleep(self, *args, **kwargs) -> None:
        self.calls.append(("sleep", bind(LLM, "sleep", *args, **kwargs).arguments["level"]))

    def wake_up(self, *args, **kwargs) -> bool:
        self.calls.append(("wake_up", bind(LLM, "wake_up", *args, **kwargs).arguments["tags"]))
        return True

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        bind(LLM, "reset_prefix_cache", *args, **kwargs)
        self.calls.append(("reset_prefix_cache",))
        return True

    def collective_rpc(self, *args, **kwargs) -> list:
        bound = bind(LLM, "collective_rpc", *args, **kwargs).arguments
        method = bound["method"]
        self.calls.append(("collective_rpc", method if isinstance(method, str) else method.__name__))
        # vLLM's run_method: a name is the worker's method, a callable gets the worker as its first argument
        call = getattr(self.worker, method) if isinstance(method, str) else functools.partial(method, self.worker)
        return [call(*bound["args"], **(bound["kwargs"] or {}))]


def install(monkeypatch, platform: str = "cpu") -> type[FakeLLM]:
    """``FakeLLM`` in place of ``vllm.LLM`` (fresh instance list, no failure), the engine's environment
    variables restored afterwards, and with ``platform="cuda"`` vLLM's platform reporting CUDA."""
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(FakeLLM, "instances", [])
    monkeypatch.setattr(FakeLLM, "fail_generate", None)
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                        ("VLLM_LOGGING_LEVEL", "ERROR")):
        monkeypatch.setenv(name, value)
    if platform == "cuda":
        from vllm.platforms import current_platform

        monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return FakeLLM
