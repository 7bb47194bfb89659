"""Configuration: loading from dict/YAML/preset, and errors that read well (docs/specification.md §8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import offpolicy as op
from offpolicy.core.config import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def error_of(cls, **data) -> str:
    with pytest.raises(ConfigError) as info:
        cls(**data)
    return str(info.value)


def test_defaults_match_the_spec():
    c = op.CorrectionConfig()
    assert (c.anchor, c.weight, c.reject, c.reject_mode, c.denominator, c.log_clamp, c.nonfinite, c.kl_is_weight) == (
        "old", None, [], "independent", "renormalize", 20.0, "error", False)
    loss = op.LossConfig()
    assert (loss.kind, loss.clip_low, loss.clip_high, loss.dual_clip, loss.agg) == ("ppo", 0.2, 0.2, None, "token-mean")
    assert (loss.sapo_tau_pos, loss.sapo_tau_neg) == (1.0, 1.05)


def test_clip_defaults_follow_the_kind():
    assert (op.LossConfig(kind="gspo").clip_low, op.LossConfig(kind="gspo").clip_high) == (3e-4, 4e-4)
    assert op.LossConfig(kind="cispo").clip_low is None
    assert op.LossConfig(kind="ppo", clip_high=0.28).clip_high == 0.28


def test_unknown_key_suggests_the_right_one():
    msg = error_of(op.CorrectionConfig, weight={"level": "token", "mode": "truncate", "hihg": 2.0})
    assert "unknown key 'hihg' (did you mean 'high'?)" in msg
    assert "allowed keys: level, mode, low, high, normalize" in msg
    assert "unknown key 'anchr' (did you mean 'anchor'?)" in error_of(op.CorrectionConfig, anchr="old")


def test_low_above_high():
    msg = error_of(op.CorrectionConfig, weight={"level": "token", "mode": "truncate", "low": 3.0, "high": 2.0})
    assert msg == "CorrectionConfig.weight: weight: low=3.0 is above high=2.0; swap them"


def test_k2_with_a_band():
    msg = error_of(op.CorrectionConfig, reject=[{"stat": "k2", "level": "token", "low": 0.1, "high": 0.5}])
    assert "reject.0.k2" in msg
    # issue #26: AReaL accepts a lower bound on kl_k2; ours says why it is not a correction
    assert "reject rule 'k2' takes only an upper bound; got low=0.1." in msg
    assert "drops the on-policy tokens" in msg and "Remove low" in msg


def test_kl_rule_direction():
    """direction pi_mu (AReaL) flips verl's k1 and turns k3 = ρ − 1 − log ρ into 1/ρ − 1 + log ρ.
    ρ = e^0.8 (log ρ = 0.8): verl k3 = 2.2255 − 1.8 = 0.4255, AReaL k3 = 0.4493 − 0.2 = 0.2493;
    with high 0.3 verl drops the token and AReaL keeps it; at log ρ = −0.8 it is the other way."""
    old = torch.log(torch.tensor([[0.2, 0.2]]))
    rollout = old - torch.tensor([[0.8, -0.8]])  # log ρ = (0.8, −0.8)
    mask = torch.ones(1, 2)
    for direction, want in (("mu_pi", [0.0, 1.0]), ("pi_mu", [1.0, 0.0])):
        rule = {"stat": "k3", "level": "token", "high": 0.3, "direction": direction}
        assert op.correct(old, rollout, mask, {"reject": [rule]}).mask.tolist() == [want]
    # k1: verl's −log ρ ≤ −0.5 keeps log ρ = 0.8; AReaL's log ρ ≤ −0.5 keeps log ρ = −0.8
    for direction, want in (("mu_pi", [1.0, 0.0]), ("pi_mu", [0.0, 1.0])):
        rule = {"stat": "k1", "level": "token", "high": -0.5, "direction": direction}
        assert op.correct(old, rollout, mask, {"reject": [rule]}).mask.tolist() == [want]
    assert "direction" in error_of(op.CorrectionConfig, reject=[{"stat": "k3", "level": "token", "high": 1, "direction": "up"}])


def test_gspo_and_sapo_forms_belong_to_their_kind():
    assert op.LossConfig(kind="gspo", dual_clip=3.0, gspo_form="sequence").dual_clip == 3.0
    assert "gspo_form 'sequence' applies to kind 'gspo' only" in error_of(op.LossConfig, gspo_form="sequence")
    assert "sapo_level 'sequence' applies to kind 'sapo' only" in error_of(op.LossConfig, kind="gspo", sapo_level="sequence")


def test_k1_seq_max_is_undefined():
    msg = error_of(op.CorrectionConfig, reject=[{"stat": "k1", "level": "seq_max", "high": 0.5}])
    assert "level 'seq_max' is not defined for k1" in msg


def test_bypass_with_a_weight():
    msg = error_of(op.CorrectionConfig, anchor="rollout", weight={"level": "token", "mode": "truncate", "high": 2})
    assert "anchor 'rollout' (bypass)" in msg and "count the mismatch twice" in msg and "Remove `weight`" in msg


def test_unknown_stat_and_bad_literal():
    msg = error_of(op.CorrectionConfig, reject=[{"stat": "k4", "level": "token", "high": 1.0}])
    assert "reject.0" in msg and "k4" in msg
    msg = error_of(op.CorrectionConfig, weight={"level": "token", "mode": "clip", "high": 2.0})
    assert "CorrectionConfig.weight.mode" in msg and "'truncate' or 'mask'" in msg and "(got 'clip')" in msg


def test_ratio_rule_needs_a_bound_and_mask_needs_a_band():
    assert "needs low and/or high" in error_of(op.CorrectionConfig, reject=[{"stat": "ratio", "level": "token"}])
    assert "mode 'mask' needs a band" in error_of(op.CorrectionConfig, weight={"level": "token", "mode": "mask"})


def test_loss_combinations():
    assert "dual_clip applies to kinds 'ppo' and 'gspo' only" in error_of(op.LossConfig, kind="cispo", dual_clip=3.0)
    assert "kind 'reinforce' has no clip; remove clip_low" in error_of(op.LossConfig, kind="reinforce", clip_low=0.2)
    assert "max_len is used only by agg 'seq-mean-token-sum-norm'" in error_of(op.LossConfig, max_len=10)
    msg = error_of(op.LossConfig, kind="ppo", correction={"anchor": "current",
                                                          "weight": {"level": "token", "mode": "truncate", "high": 2}})
    assert "anchor 'current'" in msg and "Use kind reinforce" in msg
    assert "no KL term to weight" in error_of(
        op.LossConfig, correction={"weight": {"level": "token", "mode": "truncate", "high": 2}, "kl_is_weight": True})
    assert "greater than 1" in error_of(op.LossConfig, dual_clip=0.5)


def test_configs_are_pydantic_and_valueerrors():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        op.CorrectionConfig(log_clamp=-1)


def test_yaml_round_trip(tmp_path):
    cfg = op.LossConfig.from_preset("verl:decoupled_seq_is_rs")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"loss": cfg.model_dump(mode="json")}))
    assert op.LossConfig.from_yaml(path) == cfg
    path.write_text(yaml.safe_dump({"correction": cfg.correction.model_dump(mode="json")}))
    assert op.CorrectionConfig.from_yaml(path) == cfg.correction


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        op.CorrectionConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("weight: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        op.CorrectionConfig.from_yaml(bad)
    bad.write_text("- a list")
    with pytest.raises(ConfigError, match="expected a mapping"):
        op.CorrectionConfig.from_yaml(bad)


def test_every_example_config_loads():
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files, "examples/ must hold configs a user can copy"
    from offpolicy.train.config import load_train_config

    for path in files:
        if "train" in yaml.safe_load(path.read_text()):
            load_train_config(path)
        else:
            op.LossConfig.from_yaml(path)


NAN, INF = float("nan"), float("inf")
# (model, data, the key the message names) — issue #27 items 6–7: each was accepted before, and did
# harm: k2 high NaN rejected every token silently (masked_fraction 1, loss 0), OPSM with NaN was off,
# a truncate low of inf gave a NaN loss and gradient on finite inputs
NONFINITE = [
    (op.CorrectionConfig, {"reject": [{"stat": "k2", "level": "token", "high": NAN}]}, "reject.0.k2: high"),
    (op.CorrectionConfig, {"reject": [{"stat": "k3", "level": "seq_mean", "high": INF}]}, "reject.0.k3: high"),
    (op.CorrectionConfig, {"reject": [{"stat": "k1", "level": "token", "low": NAN, "high": 1.0}]}, "reject.0.k1: low"),
    (op.CorrectionConfig, {"reject": [{"stat": "k1", "level": "token", "low": -INF, "high": 1.0}]}, "k1: low"),
    (op.CorrectionConfig, {"reject": [{"stat": "opsm", "delta": NAN}]}, "reject.0.opsm: delta"),
    (op.CorrectionConfig, {"weight": {"level": "token", "mode": "truncate", "low": INF}}, "weight: low"),
    (op.CorrectionConfig, {"weight": {"level": "token", "mode": "truncate", "high": INF}}, "weight: high"),
    (op.CorrectionConfig, {"weight": {"level": "sequence", "mode": "mask", "low": 0.5, "high": "nan"}}, "weight: high"),
    (op.CorrectionConfig, {"reject": [{"stat": "ratio", "level": "token", "low": INF}]}, "ratio: low"),
    (op.CorrectionConfig, {"reject": [{"stat": "m2", "high": INF}]}, "m2: high"),
    (op.CorrectionConfig, {"reject": [{"stat": "prob_diff", "high": INF}]}, "prob_diff: high"),
    (op.CorrectionConfig, {"log_clamp": INF}, "log_clamp"),
    (op.LossConfig, {"kl_coef": INF}, "kl_coef"),
    (op.LossConfig, {"clip_high": INF}, "clip_high"),
    (op.LossConfig, {"global_tokens": INF}, "global_tokens"),
]


@pytest.mark.parametrize("cls,data,where", NONFINITE, ids=[w for _, _, w in NONFINITE])
def test_nonfinite_numbers_are_refused_at_config_time(cls, data, where):
    message = error_of(cls, **data)
    assert where in message and "not a finite number" in message and "null" in message


def test_nonfinite_bound_in_yaml_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("correction:\n  reject:\n    - {stat: k2, level: token, high: .nan}\n")
    with pytest.raises(ConfigError, match=r"reject\.0\.k2: high: got nan"):
        op.CorrectionConfig.from_yaml(path)
    # null stays the open bound, and large finite bounds stay legal
    assert op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "low": None, "high": 1e30}).weight.high == 1e30


def test_one_reader_of_a_loss_config_for_the_library_and_the_hosts(tmp_path):
    """``policy_loss``'s ``config=`` and a host's option (``integrations.host.loss_config_of``) read the same
    forms through one function: a preset, a dict, a CorrectionConfig, its JSON (a Ray worker's
    runtime_env), a YAML file by path whatever its name; only the host refuses an unset option."""
    from offpolicy.integrations.host import loss_config_of
    from offpolicy.core.losses import as_loss_config

    want = op.LossConfig.from_preset("recommended")
    path = tmp_path / "loss.conf"  # no .yaml suffix: read because it is a file
    path.write_text(yaml.safe_dump({"loss": want.model_dump(mode="json")}))
    for read in (as_loss_config, loss_config_of):
        assert read("recommended") == want
        assert read(want.model_dump_json()) == want
        assert read(str(path)) == want and read(path) == want
        assert read(want.model_dump()) == want
        assert read(want.correction) == op.LossConfig(correction=want.correction)
        with pytest.raises(ConfigError, match="got int"):
            read(3)
    assert as_loss_config(None) == op.LossConfig()
    with pytest.raises(ConfigError, match="host option: .*got NoneType"):
        loss_config_of(None, "host option:")
