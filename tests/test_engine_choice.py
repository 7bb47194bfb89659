"""``engine=auto`` (issue #49): the rule of ``offpolicy.engines.choice``, the parameter count it reads, the
config around it, and what a run records of the choice."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from offpolicy.engines import choice
from offpolicy.engines.choice import CPU_HF_BELOW, CPU_HF_MAX_VOCAB, choose, parameter_count
from offpolicy.train.config import TrainConfig, load_train_config, resolve_engine

from hf_fixtures import char_model, char_model_dir

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def vllm_importable(monkeypatch):
    import offpolicy.engines.vllm as engine_vllm

    monkeypatch.setattr(engine_vllm, "vllm_import_error", lambda: None)


def test_small_models_on_the_cpu_get_the_hf_engine_and_the_rest_vllm(vllm_importable):
    small, chars = CPU_HF_BELOW - 1, CPU_HF_MAX_VOCAB
    assert choose(CPU, small, chars)[0] == "hf"
    assert choose(CPU, CPU_HF_BELOW, chars)[0] == "vllm"  # a larger model
    assert choose(CPU, small, chars + 1)[0] == "vllm"  # a larger vocabulary: HF's sampling costs V a row
    assert choose(CPU, 135_000_000, 49_152)[0] == "vllm"
    assert choose(CUDA, 800_000, 64) == ("vllm", "auto: a GPU")  # a GPU: vLLM whatever the size
    name, why = choose(CPU, 800_000, 64)
    assert why.startswith("auto: 0.8M parameters, a 64-token vocabulary on the CPU, where HF generate is faster")


def test_what_the_config_asks_for_comes_before_the_size(vllm_importable):
    assert choose(CPU, 135_000_000, 49_152, logit_noise=0.5) == ("hf", "auto: engine.logit_noise is the hf engine's")
    assert choose(CPU, 800_000, 64, vllm_options_set=True) == ("vllm", "auto: engine.vllm.* options set")


def test_without_vllm_auto_falls_back_to_hf_and_says_why(monkeypatch):
    import offpolicy.engines.vllm as engine_vllm

    monkeypatch.setattr(engine_vllm, "vllm_import_error", lambda: "ModuleNotFoundError: No module named 'vllm'")
    assert choose(CUDA, 135_000_000, 49_152) == ("hf", "auto: vLLM cannot be imported here (ModuleNotFoundError: "
                                                       "No module named 'vllm')")


def test_parameter_count_of_a_module_and_of_its_directory_agree(tmp_path):
    """Tied embeddings count once, loaded or read from the safetensors headers; a sharded checkpoint is read
    through its index."""
    model = char_model(hidden_size=32, num_layers=2, seed=0)
    by_hand = sum(p.numel() for name, p in model.named_parameters())  # named_parameters lists a tied one once
    assert model.config.tie_word_embeddings and parameter_count(model) == by_hand
    char_model_dir(tmp_path / "one", hidden_size=32, num_layers=2, seed=0)
    assert parameter_count(tmp_path / "one") == by_hand
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert parameter_count(tmp_path / "sharded") == by_hand


def test_the_default_engine_is_auto_and_an_explicit_one_is_kept():
    assert TrainConfig().engine.kind == "auto"
    cfg = load_train_config(None, ["engine=vllm"])
    assert resolve_engine(cfg, CPU, 800_000, 64) == ("vllm", "set in the config")
    assert resolve_engine(load_train_config(None, ["engine=hf"]), CUDA, 10**9, 49_152) == ("hf", "set in the config")


def test_auto_takes_each_engines_own_options_but_not_both():
    assert load_train_config(None, ["engine.logit_noise=0.5"]).engine.kind == "auto"
    assert load_train_config(None, ["engine.vllm.max_num_seqs=8"]).engine.kind == "auto"
    with pytest.raises(Exception, match="engine=auto cannot be both"):
        load_train_config(None, ["engine.logit_noise=0.5", "engine.vllm.max_num_seqs=8"])
    with pytest.raises(Exception, match="read with the vllm engine only"):
        load_train_config(None, ["engine=hf", "engine.vllm.max_num_seqs=8"])
    with pytest.raises(Exception, match="is added by the hf engine"):
        load_train_config(None, ["engine=vllm", "engine.logit_noise=0.5"])


def test_a_run_records_the_engine_auto_chose(offpolicy_cache, tmp_path, monkeypatch):
    """The embedded default at engine=auto on the CPU: the hf engine, named with its reason in the header and
    in config.yaml's resolved choices; the config itself keeps auto (what --resume reads)."""
    from rich.console import Console

    from offpolicy.train.loop import train

    monkeypatch.setenv("OFFPOLICY_CACHE", str(offpolicy_cache))
    console = Console(record=True, width=200)
    cfg = load_train_config(None, ["steps=1", "prompts_per_step=2", "group_size=2", "eval_problems=2",
                                   f"out_dir={tmp_path / 'run'}", "trainer.device=cpu"])
    train(cfg, console=console, progress=False)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["engine"]["kind"] == "auto"
    assert saved["resolved"]["engine"] == "hf"
    assert saved["resolved"]["engine_reason"].startswith("auto: 0.8M parameters, a 64-token vocabulary on the CPU")
    text = console.export_text()
    assert "engine hf (" in text and "engine hf: 0.8M parameters, a 64-token vocabulary on the CPU" in text


def test_a_resumed_run_keeps_the_engine_auto_chose(offpolicy_cache, tmp_path, monkeypatch):
    """Suspicion of issue #55: ``engine=auto`` is chosen once, when the run is created; ``--resume`` reads
    config.yaml's resolved engine instead of choosing again, so a run resumed where the rule would pick
    another engine (another machine, a GPU, vLLM now importable) keeps its own. ``engine=…`` on the resume
    still names one."""
    from rich.console import Console

    from offpolicy.train import loop

    monkeypatch.setenv("OFFPOLICY_CACHE", str(offpolicy_cache))
    overrides = ["prompts_per_step=2", "group_size=2", "eval_problems=2", f"out_dir={tmp_path / 'run'}",
                 "trainer.device=cpu", "checkpoint_every=1"]
    started, make_engine = [], loop.make_engine

    def recording(name, *args, **kwargs):
        started.append(name)
        if name != "hf":  # what a resume that switches engines would start (not built here: vLLM is slow)
            raise RuntimeError(f"the resumed run started {name}")
        return make_engine(name, *args, **kwargs)

    monkeypatch.setattr(loop, "make_engine", recording)
    loop.train(load_train_config(None, ["steps=1", *overrides]), progress=False)
    # where it resumes, the rule would now pick vLLM
    monkeypatch.setattr(choice, "choose", lambda *args, **kwargs: ("vllm", "auto: a GPU"))
    console = Console(record=True, width=300)
    loop.train(load_train_config(None, ["steps=2", *overrides]), resume=tmp_path / "run", console=console,
               progress=False)
    assert started == ["hf", "hf"]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["engine"]["kind"] == "auto" and saved["resolved"]["engine"] == "hf"
    text = console.export_text()
    assert "engine hf (" in text and "(chosen when the run was created; a resume keeps it)" in text
    # a resumed run given engine=… explicitly gets that one
    assert resolve_engine(load_train_config(None, ["engine=vllm"]), CPU, 10**6, 64,
                          recorded=saved["resolved"]) == ("vllm", "set in the config")


def test_the_rule_names_the_measurement_it_rests_on():
    """The module states the rule and where its figures are; the threshold is the one the docs give."""
    assert "bench_engine_choice.py" in choice.__doc__
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    assert "Which engine, by model size" in doc
    assert f"{CPU_HF_BELOW / 1e6:.0f}M parameters" in doc and f"{CPU_HF_MAX_VOCAB:,}" in doc
