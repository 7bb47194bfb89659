"""One setting, one place (issue #68): the engine, the sampling and the trainer are sections train and diagnose
share, each setting with one name, one default and one rule; the keys and flags they replaced are refused with
their new names; both configs document every field."""

from __future__ import annotations

import pytest
import yaml
from pydantic import BaseModel

from offpolicy.core.config import ConfigError
from offpolicy.core.sampling import SamplingSettings
from offpolicy.engines.config import EngineConfig
from offpolicy.measure.diagnose_config import MOVED_FLAGS, SECTION_FLAGS, DiagnoseConfig
from offpolicy.policy.scorer_config import ScorerConfig
from offpolicy.train.config import MOVED, TrainConfig, load_train_config

SECTIONS = {"engine": EngineConfig, "sampling": SamplingSettings, "trainer": ScorerConfig}
# settings both commands take outside the sections, each for a reason: what is trained or measured (model, task),
# the prompts' source and limit (task=dataset's data.* and max_prompt_tokens, diagnose's --data), the seed, the
# trackers (a list in train's YAML, a comma-separated flag in diagnose)
COMMAND_LEVEL = {"model", "task", "data", "max_prompt_tokens", "seed", "log_to"}


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    out = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out.update(_leaves(kind, f"{prefix}{name}."))
        else:
            out[prefix + name] = field
    return out


def test_the_sections_are_the_same_classes_in_both_commands():
    for name, section in SECTIONS.items():
        assert TrainConfig.model_fields[name].annotation is section
        assert DiagnoseConfig.model_fields[name].annotation is section


def test_no_setting_both_commands_take_lives_outside_the_shared_sections():
    """A field of both configs' top levels is a section or a command-level setting with its reason above; no
    section's setting (by its name, its flag's name or a name it replaced) is declared again outside it."""
    both = set(TrainConfig.model_fields) & set(DiagnoseConfig.model_fields)
    assert both - set(SECTIONS) <= COMMAND_LEVEL, sorted(both - set(SECTIONS) - COMMAND_LEVEL)
    section_names = {key.rsplit(".", 1)[1] for name, s in SECTIONS.items() for key in _leaves(s, name + ".")}
    for config in (TrainConfig, DiagnoseConfig):
        loose = set(config.model_fields) - set(SECTIONS)
        clash = loose & (section_names | set(SECTION_FLAGS) | set(MOVED) | set(MOVED_FLAGS))
        assert not clash, f"{config.__name__} declares {sorted(clash)} outside the sections"


@pytest.mark.parametrize("config", [TrainConfig, DiagnoseConfig])
def test_every_field_of_both_configs_says_what_it_does(config):
    undocumented = [key for key, field in _leaves(config).items() if not (field.description or "").strip()]
    assert not undocumented, undocumented


def test_each_section_flag_of_diagnose_is_a_key_of_train():
    """diagnose's flags of a section are train's dotted keys under one rule (``--engine-dtype`` is
    ``engine.dtype``); a field only train reads (json_schema_extra commands) has no flag."""
    train_keys = set(_leaves(TrainConfig))
    for flag, (key, _, _) in SECTION_FLAGS.items():
        assert key in train_keys, (flag, key)
    assert "engine_sleep" not in SECTION_FLAGS and "trainer_gradient_checkpointing" not in SECTION_FLAGS
    assert SECTION_FLAGS["engine"][0] == "engine.kind" and SECTION_FLAGS["top_p"][0] == "sampling.top_p"
    assert SECTION_FLAGS["trainer_dtype"][0] == "trainer.dtype" and SECTION_FLAGS["vllm_max_num_seqs"][0] == \
        "engine.vllm.max_num_seqs"


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_moved_train_key_is_refused_with_its_new_name(old, new):
    with pytest.raises(ConfigError, match=rf"{old} → {new}"):
        load_train_config(None, [f"{old}=1"])


def test_engine_alone_names_the_engine_and_combines_with_its_keys_in_either_order():
    for items in (["engine=hf", "engine.dtype=bf16"], ["engine.dtype=bf16", "engine=hf"]):
        cfg = load_train_config(None, items)
        assert (cfg.engine.kind, cfg.engine.dtype) == ("hf", "bf16")
    assert TrainConfig().engine.kind == DiagnoseConfig().engine.kind == "auto"  # one default for both


def test_a_run_config_written_before_the_sections_fails_to_resume_with_the_mapping(tmp_path):
    """``--resume`` of a run whose config.yaml spells the old flat keys: one error naming every moved key."""
    old = {"train": {"task": "reverse", "engine": "hf", "engine_dtype": "fp32", "max_new_tokens": 10,
                     "top_p": 1.0, "micro_batch_tokens": None, "device": "cpu"}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError) as err:
        load_train_config(path, ["steps=2"])
    for key in ("engine_dtype → engine.dtype", "max_new_tokens → sampling.max_tokens", "top_p → sampling.top_p",
                "micro_batch_tokens → trainer.micro_batch_tokens", "device → trainer.device"):
        assert key in str(err.value)


def test_a_saved_config_loads_back_to_the_same_config(tmp_path):
    """What a run writes (config.yaml: the resolved sections) is what it reads on resume."""
    cfg = load_train_config(None, ["engine=hf", "engine.dtype=bf16", "sampling.top_p=0.9", "trainer.threads=1"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"train": cfg.model_dump(mode="json")}))
    assert load_train_config(path) == cfg


def test_the_commands_resolve_their_own_defaults_where_the_section_says_so():
    """engine.dtype auto: bf16 in diagnose; sampling.max_tokens unset: the task's in train, 64 in diagnose;
    trainer.micro_batch_tokens unset: one batch for the embedded model, 2,048 in diagnose."""
    diagnose = DiagnoseConfig()
    assert diagnose.settings()[0]["engine_dtype"] == "bf16" and diagnose.sampling_config().max_tokens == 64
    assert diagnose.trainer.budget(2048) == 2048 and DiagnoseConfig(trainer_micro_batch_tokens=64).trainer.budget(
        2048) == 64
    train = TrainConfig()
    assert train.sampling.max_tokens == 10 and train.trainer.micro_batch_tokens is None
    assert TrainConfig(task="walk").sampling.max_tokens == 160
