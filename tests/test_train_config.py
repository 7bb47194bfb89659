"""``offpolicy train``'s configuration (train/config.py), issue #32 item 1: ``preset=`` is the whole
preset — its kind, clip, aggregation and correction, what ``LossConfig.from_preset`` builds — with the
user's ``loss.*`` keys on top, resolved and validated once when the config loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import offpolicy as op
from offpolicy.core.config import ConfigError, WeightConfig
from offpolicy.train.config import TrainConfig, load_train_config

README = Path(__file__).resolve().parents[1] / "README.md"


def _trains(name: str) -> bool:
    """Every preset that loads with train's default sampling: score centering's exact form centres over a
    truncated sampler's kept sets, so it needs top_k or top_p < 1 (test_train_runs_a_centred_preset_where_its_
    support_exists)."""
    return op.LossConfig.from_preset(name).score_centering != "exact"


def resolved(*overrides: str) -> op.LossConfig:
    return load_train_config(None, list(overrides)).loss_config()


@pytest.mark.parametrize("name", [n for n in op.presets.names() if _trains(n)])
def test_the_trainer_runs_the_whole_preset(name):
    assert resolved(f"preset={name}") == op.LossConfig.from_preset(name)


def test_train_runs_a_centred_preset_where_its_support_exists():
    """prime-rl's IPO with score centering (exact, over the sampler's kept sets) trains under truncated sampling
    on the hf engine, the preset whole; the head form asks the engine for its head (``head_logprobs``)."""
    cfg = load_train_config(None, ["preset=prime-rl:ipo_score_centering", "sampling.top_k=20", "engine=hf"])
    assert cfg.loss_config() == op.LossConfig.from_preset("prime-rl:ipo_score_centering")
    assert cfg.sampling_config().head_logprobs == 0
    head = load_train_config(None, ["loss.score_centering=head", "score_centering_head=7"])
    assert head.loss_config().score_centering == "head" and head.sampling_config().head_logprobs == 7
    assert load_train_config(None, []).sampling_config().head_logprobs == 0


def expected(name: str, top: dict, correction: dict | None = None) -> op.LossConfig | type[ConfigError]:
    """``LossConfig.from_preset(name)`` with ``top`` loss fields and ``correction`` fields on top, or the
    error that combination raises."""
    try:
        cfg = op.LossConfig.from_preset(name, **top)
        if correction:
            data = cfg.model_dump()
            data["correction"] = {**data["correction"], **correction}
            cfg = op.LossConfig(**data)
        return cfg
    except ConfigError:
        return ConfigError


@pytest.mark.parametrize("name", [n for n in op.presets.names() if _trains(n)])
def test_loss_keys_override_the_preset_key_by_key(name):
    """Differential: the trainer's loss = the preset's + the user's keys, for top-level keys and for keys
    inside the correction (the rest of the preset's correction stays); a combination that cannot hold
    fails when the config loads, exactly where ``from_preset`` fails."""
    preset = op.LossConfig.from_preset(name)
    cases = [({"agg": "seq-mean-token-mean"}, None)]
    if preset.kind in ("ppo", "gspo", "cispo"):
        cases.append(({"clip_high": 0.31}, None))
    if preset.correction is not None:
        cases.append(({}, {"log_clamp": 7.5}))
        cases.append(({"clip_high": 0.27} if preset.kind != "reinforce" else {}, {"nonfinite": "mask_token"}))
    for top, corr in cases:
        overrides = [f"preset={name}", *(f"loss.{k}={v}" for k, v in top.items()),
                     *(f"loss.correction.{k}={v}" for k, v in (corr or {}).items())]
        want = expected(name, top, corr)
        if want is ConfigError:
            with pytest.raises(ConfigError):
                resolved(*overrides)
        else:
            assert resolved(*overrides) == want, overrides


def test_a_nested_weight_key_overrides_one_bound():
    cfg = resolved("preset=verl:decoupled_token_is", "loss.correction.weight.high=3")
    assert cfg.correction.weight == WeightConfig(level="token", mode="truncate", high=3.0)
    assert cfg.dual_clip == 3.0 and cfg.clip_low == 0.2  # the rest of the preset stays


def test_recommended_trains_with_its_own_clip_not_ppos_default():
    """The README's default, `offpolicy train`'s default and the banner agree: [0.6, 1.4] (it was ε = 0.2)."""
    cfg = load_train_config(None, [])
    assert (cfg.loss.clip_low, cfg.loss.clip_high) == (0.4, 0.4) and cfg.loss.correction.anchor == "rollout"
    assert cfg.loss_summary() == "recommended: ppo, clip [0.6, 1.4], anchor rollout"
    paragraph = README.read_text().split("## The default: `recommended`")[1].split("\n## ")[0]
    assert re.search(r"clip widened to \[0\.6, 1\.4\]", paragraph)


def test_preset_none_is_no_correction_and_ppos_defaults():
    assert resolved("preset=none") == op.LossConfig()
    assert resolved("preset=null", "loss.kind=cispo") == op.LossConfig(kind="cispo")


def test_another_kind_starts_from_its_own_defaults():
    """A kind other than the preset's does not inherit the preset's clip (a clip is the kind's option):
    reinforce under recommended has none to refuse, cispo takes its own ε_high."""
    assert resolved("loss.kind=reinforce") == op.LossConfig(kind="reinforce", correction={"anchor": "rollout"})
    assert resolved("loss.kind=cispo") == op.LossConfig(kind="cispo", correction={"anchor": "rollout"})
    assert resolved("loss.kind=cispo", "loss.clip_high=0.5").clip_high == 0.5


@pytest.mark.parametrize("overrides", [["preset=verl:bypass_pg_is"], ["preset=slime:current"],
                                       ["preset=areal:m2po", "loss.clip_high=0.28"], []])
def test_the_saved_config_loads_back_to_the_same_loss(overrides):
    """config.yaml holds the resolved loss under train.loss: --resume resolves it to the same loss."""
    cfg = load_train_config(None, [*overrides, "trainer.micro_batch_tokens=64"])
    again = TrainConfig(**cfg.model_dump(mode="json"))
    assert again.loss == cfg.loss and again == cfg


def test_the_preset_combinations_of_the_issue_load_and_bad_ones_fail_at_load():
    # issue #32: both failed at step 0 ("anchor 'current' … with kind 'ppo'"), after the model and engine loaded
    assert resolved("preset=verl:bypass_pg_is", "trainer.micro_batch_tokens=64").kind == "reinforce"
    assert resolved("preset=slime:current", "trainer.micro_batch_tokens=64").agg == "seq-mean-token-mean"
    with pytest.raises(ConfigError, match="anchor 'current'"):
        resolved("preset=verl:bypass_pg_is", "loss.kind=ppo")


def test_cli_refuses_a_bad_combination_in_one_line_before_anything_loads(tmp_path):
    out = tmp_path / "run"
    from cli_inprocess import run_cli  # the CLI in this process (tests/cli_inprocess.py)

    result = run_cli("train", "preset=slime:current", "loss.kind=cispo", f"out_dir={out}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "anchor 'current'" in result.stderr
    assert not out.exists()


def test_a_config_yaml_written_before_the_whole_preset_resumes_with_its_correction():
    """config.yaml used to hold the unresolved loss (PPO's ε = 0.2, correction null) beside the preset,
    whose correction was applied on top: resumed now, the run keeps its correction and its clip."""
    old = {"preset": "recommended", "loss": op.LossConfig().model_dump(mode="json")}
    cfg = TrainConfig(**old)
    assert cfg.loss.correction == op.CorrectionConfig(anchor="rollout") and cfg.loss.clip_low == 0.2
    assert resolved("loss.correction=null") == op.LossConfig.from_preset("recommended")  # no correction: preset=none


@pytest.mark.parametrize("name", [n for n in op.presets.names() if _trains(n)])
def test_one_path_from_a_preset_to_a_loss(name):
    """Issue #57 item 4: train's ``preset=`` + ``loss.*`` and ``LossConfig.from_preset(name, **keys)`` are one
    path (``LossConfig.preset_fields``). On 65ba3dd from_preset replaced whole fields: a correction dict
    dropped the rest of the preset's correction, and a new kind kept the preset's clip, while train merged."""
    preset = op.LossConfig.from_preset(name)
    cases = [{"kind": "cispo"}, {"kind": "reinforce"}]
    if preset.correction is not None:
        cases.append({"correction": {"log_clamp": 7.5}})
        if preset.correction.weight is not None:
            cases.append({"correction": {"weight": {"high": 3.5}}})
    for keys in cases:
        try:
            want = op.LossConfig.from_preset(name, **keys)
        except ConfigError:
            with pytest.raises(ConfigError):
                load_train_config(None, [f"preset={name}", *dotted("loss", keys)])
            continue
        assert resolved(f"preset={name}", *dotted("loss", keys)) == want, keys
        if "correction" in keys:  # the rest of the preset's correction stays
            rest = want.correction.model_dump(exclude={"log_clamp", "weight"})
            assert rest == preset.correction.model_dump(exclude={"log_clamp", "weight"})
        if keys.get("kind") == "cispo" and preset.kind != "cispo":  # cispo's own clip, not the preset's
            assert (want.clip_low, want.clip_high) == (None, 0.2)


def dotted(prefix: str, keys: dict) -> list[str]:
    """``{"correction": {"weight": {"high": 3}}}`` → ``["loss.correction.weight.high=3"]``."""
    out = []
    for key, value in keys.items():
        out += dotted(f"{prefix}.{key}", value) if isinstance(value, dict) else [f"{prefix}.{key}={value}"]
    return out
