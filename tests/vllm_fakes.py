"""Fakes of ``vllm.LLM`` and of the worker it reaches through ``collective_rpc``, for tests that must not
start vLLM. They cannot drift from the real API: every call offpolicy makes is bound to the installed
vLLM's own signature (``inspect.signature`` of ``LLM.__init__``, ``generate``, ``sleep``, ``wake_up``,
``reset_prefix_cache``, ``collective_rpc``, ``apply_model``, the weight-transfer methods
``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``, and the model runner's
``reload_weights``, to which the worker forwards), so a wrong name or argument raises ``TypeError`` as it
would against vLLM, and the ``LLM(...)`` keywords must each be a field of the installed ``EngineArgs``.
Outputs are vLLM's own ``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` objects. The weight-transfer
backend the worker builds is the real one, from vLLM's factory (``WeightTransferEngineFactory``), loading
into the fake's model (``FakeModel``); only vLLM's layerwise reload around it is left out.

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
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.engine.arg_utils import EngineArgs
from vllm.logprobs import Logprob
from vllm.model_executor.model_loader.reload import inplace
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

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


class FakeModel(torch.nn.Module):
    """The engine's model as a weight loader sees it: its parameters are the worker's ``parameters`` (names;
    none unless a test sets them), each holding what was last loaded into it; ``load_weights`` consumes the
    iterator one tensor at a time, as vLLM's models do, and returns the names it loaded."""

    def __init__(self, worker: FakeWorker):
        super().__init__()
        self.worker = worker
        self.values: dict[str, torch.Tensor] = {}

    def named_parameters(self, *args, **kwargs):
        for name in sorted(self.worker.parameters or ()):
            yield name, torch.nn.Parameter(self.values.get(name, torch.zeros(0)), requires_grad=False)

    def load_weights(self, weights) -> set[str]:
        names = set()
        for name, tensor in weights:
            self.worker.calls.append(("loaded", name))
            self.worker.loaded.append((name, tensor))
            self.values[name] = tensor.detach().clone()
            names.add(name)
        return names


class FakeWorker:
    """vLLM's worker as ``LLM.collective_rpc`` reaches it. ``Worker.reload_weights(*args, **kwargs)`` forwards
    to the model runner's ``reload_weights``, whose signature the call is bound to; the weights iterator is
    consumed as vLLM consumes it, one tensor at a time while loading. With ``parameters`` (the engine model's
    parameter names) set, the names the iterator did not cover are reported as vLLM's in-place reload reports
    them: one warning of its own logger, in its own words (``reload/inplace.py``).

    The weight-transfer methods are ``Worker``'s (signatures bound to it): with ``weight_transfer_config``
    given to ``LLM(...)``, the engine vLLM's factory builds for its backend (the real class, as vLLM's worker
    builds it when it loads the model), then parsing and receiving each update as vLLM's worker has it do."""

    parameters: set[str] | None = None

    def __init__(self, calls: list, transfer_config=None):
        self.calls = calls
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.model = FakeModel(self)
        # what a callable sent through collective_rpc reads: a model with no layer vLLM's CPU dispatch packed
        # (so the engine's direct sync is off), an unquantized config
        self.model_runner = types.SimpleNamespace(get_model=lambda: self.model)
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=None),
                                                 lora_config=None, parallel_config=types.SimpleNamespace())
        self.transfer = None if transfer_config is None else WeightTransferEngineFactory.create_engine(
            transfer_config, self.vllm_config, torch.device("cpu"), self.model)
        self.updating = False

    def reload_weights(self, *args, **kwargs) -> None:
        bound = bind(GPUModelRunner, "reload_weights", *args, **kwargs)
        self.calls.append(("reload_weights",))
        names = self.model_runner.get_model().load_weights(bound.arguments["weights_iterator"])
        missing = (self.parameters or set()) - names
        if missing:
            inplace.logger.warning(NOT_LOADED_FORMAT, missing)

    def _transfer(self):
        if self.transfer is None:  # vLLM's own words (Worker._check_weight_transfer_engine)
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable weight "
                               "transfer.")
        return self.transfer

    def init_weight_transfer_engine(self, *args, **kwargs) -> None:
        init_info = bind(Worker, "init_weight_transfer_engine", *args, **kwargs).arguments["init_info"]
        self.calls.append(("init_weight_transfer_engine",))
        engine = self._transfer()
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    def start_weight_update(self, *args, **kwargs) -> None:
        bind(Worker, "start_weight_update", *args, **kwargs)
        self.calls.append(("start_weight_update",))
        assert not self.updating, "start_weight_update called while a weight update is already active"
        # vLLM's engine holds the model it was built with; here a test may have swapped the model since. vLLM's
        # layerwise reload (the engine's own start/finish) is left out: the fake's model has no vLLM layers
        self._transfer().set_weight_update_target(self.model_runner.get_model(), self.vllm_config.model_config)
        self.updating = True

    def update_weights(self, *args, **kwargs) -> None:
        update_info = bind(Worker, "update_weights", *args, **kwargs).arguments["update_info"]
        self.calls.append(("update_weights",))
        assert self.updating, "start_weight_update must be called before update_weights"
        engine = self._transfer()
        engine.receive_weights(engine.parse_update_info(update_info))

    def finish_weight_update(self, *args, **kwargs) -> None:
        bind(Worker, "finish_weight_update", *args, **kwargs)
        self.calls.append(("finish_weight_update",))
        assert self.updating, "finish_weight_update called without a matching start_weight_update"
        self._transfer().reset_weight_update_target()
        self.updating = False


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
        self.worker = FakeWorker(self.calls, self.kwargs.get("weight_transfer_config"))
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

    # LLM's weight-transfer methods (vLLM's RLOfflineMixin): each a collective_rpc of the worker method of its name
    def init_weight_transfer_engine(self, *args, **kwargs) -> None:
        request = bind(LLM, "init_weight_transfer_engine", *args, **kwargs).arguments["request"]
        self.worker.init_weight_transfer_engine(init_info=request["init_info"])

    def start_weight_update(self, *args, **kwargs) -> None:
        bind(LLM, "start_weight_update", *args, **kwargs)
        self.worker.start_weight_update()

    def update_weights(self, *args, **kwargs) -> None:
        request = bind(LLM, "update_weights", *args, **kwargs).arguments["request"]
        self.worker.update_weights(update_info=request["update_info"])

    def finish_weight_update(self, *args, **kwargs) -> None:
        bind(LLM, "finish_weight_update", *args, **kwargs)
        self.worker.finish_weight_update()

    def apply_model(self, *args, **kwargs) -> list:
        """vLLM's ``LLM.apply_model``: the function on the worker's model (``Worker.apply_model`` → ``get_model``)."""
        func = bind(LLM, "apply_model", *args, **kwargs).arguments["func"]
        self.calls.append(("apply_model", getattr(func, "__name__", None) or func.func.__name__))
        return [func(self.worker.model_runner.get_model())]

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
