"""TRL end to end: examples/trl_grpo.py (the README's TRL section, runnable as is) trains the embedded
warm-started model with TRL's GRPOTrainer and a lagged bf16 sampler behind TRL's rollout_func. A few
steps here; the 32-step runs and the comparison table are in docs/hosts-end-to-end.md."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytest.importorskip("trl", reason="TRL not installed (install.sh installs trl==1.16.0; pip install offpolicy[trl])")

import torch  # noqa: E402

import offpolicy as op  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"
TINY = ["--steps-per-generation", "2", "--sync-every", "2", "--prompts-per-step", "2", "--group-size", "4",
        "--prompts", "32", "--quiet"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.slow
def test_trl_example_trains_with_offpolicy_loss(example, offpolicy_cache, tmp_path, monkeypatch):
    calls = []
    real = op.policy_loss

    def recording(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config, **kwargs):
        calls.append({"rollout": rollout_logprobs.detach().clone(), "config": config, "reduce": kwargs.get("reduce")})
        return real(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config, **kwargs)

    monkeypatch.setattr(op, "policy_loss", recording)  # the adapter calls op.policy_loss through the module
    args = ["--output-dir", str(tmp_path / "out"), "--steps", "3", *TINY]
    trainer, rows = example.build(example.parse_args(args))
    start = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert type(trainer).__name__ == "OffpolicyGRPOTrainer" and trainer.state.global_step == 3
    # the trainer is fp32 as the example says (TRL's GRPOConfig defaults to bf16=True: accelerate's autocast)
    assert trainer.accelerator.mixed_precision == "no"
    # the loss was offpolicy's: one call per optimizer step (one micro-batch each), with the sampler's μ,
    # the recommended config, unreduced (TRL aggregates)
    assert len(calls) == 3
    # recommended, with the host default for the unset nonfinite policy (neutral: one NaN μ from vLLM
    # must not end a TRL run; docs/host-defaults.md)
    expected = op.LossConfig.from_preset("recommended").model_dump(exclude={"correction": {"nonfinite"}})
    assert all(c["config"].model_dump(exclude={"correction": {"nonfinite"}}) == expected
               and c["config"].correction.nonfinite == "neutral" and c["reduce"] is False for c in calls)
    assert all(c["rollout"].le(0).all() and c["rollout"].ne(0).any() for c in calls)
    # the sampler differs from the trainer (bf16, lagged weights): a positive mismatch logged at every step
    logged = [r for r in rows if "offpolicy/kl_k3" in r]
    assert len(logged) == 3 and all(r["offpolicy/kl_k3"] > 0 for r in logged)
    assert any("reward" in r for r in rows)
    moved = max((p.detach() - start[k]).abs().max().item() for k, p in trainer.model.named_parameters())
    assert moved > 1e-4  # it trained: lr 1e-3 for 3 steps


@pytest.mark.slow
def test_trl_example_baseline_runs_trls_own_correction(example, offpolicy_cache, tmp_path):
    """The table's "TRL IS" arm really runs TRL's vLLM IS correction on the rollout_func's μ."""
    result = example.main(["--correction", "trl", "--output-dir", str(tmp_path / "out"), "--steps", "2", *TINY])
    assert result["summary"]["trainer"] == "TRLImportanceSampling" and result["summary"]["steps"] == 2
    ratios = [r["sampling/importance_sampling_ratio/mean"] for r in result["log"]
              if "sampling/importance_sampling_ratio/mean" in r]
    assert ratios and all(torch.isfinite(torch.tensor(v)) and v > 0 for v in ratios)

