"""TRL integration: a real GRPOTrainer run (two optimizer steps, tiny embedded model, CPU) with a
rollout_func that returns log-probs; TRL's loss and gradient must equal offpolicy's policy_loss."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in trl 1.16

import functools
import importlib.util
from types import SimpleNamespace

import pytest

from conftest import require_host  # noqa: E402

WHY = "TRL 1.16.0 is not importable (install.sh installs it; pip install offpolicy[trl])"
if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
    pytest.skip(WHY, allow_module_level=True)

import torch  # noqa: E402

import offpolicy as op  # noqa: E402
from offpolicy.core.config import ConfigError  # noqa: E402
from hf_fixtures import HOST_SHAPE, char_model  # noqa: E402
from offpolicy.tasks.tokenizer import build_char_tokenizer  # noqa: E402

COMPLETION_LEN = 6

CONFIGS = {
    # token TIS: w_t = min(ρ_t, 2), verl's loss settings (dual clip 3)
    "token_tis": op.LossConfig.from_preset("verl:decoupled_token_is"),
    # sequence mask (Seq-MIS): drop a row unless 0.5 ≤ Π_t ρ_t ≤ 2
    "seq_mask": op.LossConfig(correction=op.CorrectionConfig(
        reject=[{"stat": "ratio", "level": "sequence", "low": 0.5, "high": 2.0}])),
    # veto: drop a row if any token has ρ_t outside [0.5, 2]; fixed denominator (TRL-style)
    "veto": op.LossConfig(correction=op.CorrectionConfig(
        reject=[{"stat": "ratio", "level": "any_token", "low": 0.5, "high": 2.0}], denominator="fixed")),
}


def make_rollout_func(tokenizer):
    """Completions of random characters; log μ = the policy's own log-prob + seeded noise, and on
    the first row a spike (log μ − 1.5 on token 0: ρ = e^1.5 ≈ 4.5) that every config above acts on."""
    gen = torch.Generator().manual_seed(0)
    first_char = len(tokenizer.all_special_tokens)

    def rollout_func(prompts, trainer):
        prompt_ids = [[tokenizer.bos_token_id, *tokenizer(p, add_special_tokens=False).input_ids] for p in prompts]
        completion_ids, logprobs = [], []
        for i, p in enumerate(prompt_ids):
            ids = torch.randint(first_char, first_char + 26, (COMPLETION_LEN,), generator=gen).tolist()
            with torch.no_grad():
                logits = trainer.model(torch.tensor([p + ids])).logits[0, len(p) - 1:-1].float()
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            mu = (lp + 0.1 * torch.randn(COMPLETION_LEN, generator=gen)).clamp(max=-1e-4)
            if i == 0:
                mu[0] = lp[0] - 1.5
            completion_ids.append(ids)
            logprobs.append(mu.tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout_func


@functools.cache
def _trl() -> SimpleNamespace:
    """TRL's pieces, imported by the first test that needs them, not at collection (which every xdist worker
    pays: ~4 s); a TRL that fails to import skips the test with the reason (``require_host``)."""
    trl, datasets = require_host("trl", "datasets", why=WHY)
    from offpolicy.integrations.trl import OffpolicyGRPOTrainer

    class Probe(OffpolicyGRPOTrainer):
        """Captures what the adapter hands offpolicy, and the loss TRL backpropagates."""

        def __init__(self, *args, **kwargs):
            self.captured: list[dict] = []
            super().__init__(*args, **kwargs)

        def offpolicy_loss(self, logprobs, old_logprobs, advantages, mask, rollout_logprobs, ref_logprobs):
            logprobs.retain_grad()  # TRL's backward fills .grad: the gradient TRL computes w.r.t. log π_θ
            self.captured.append({"logprobs": logprobs, "old": old_logprobs.detach().clone(),
                                  "adv": advantages.detach().clone(), "mask": mask.clone(),
                                  "rollout": rollout_logprobs.detach().clone()})
            return super().offpolicy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, ref_logprobs)

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            self.captured[-1]["loss"] = loss.detach().clone()
            return loss

    return SimpleNamespace(Dataset=datasets.Dataset, GRPOConfig=trl.GRPOConfig, Trainer=OffpolicyGRPOTrainer,
                           Probe=Probe)


def _trainer(tmp_path, config, cls=None, trainer_kwargs=None, **overrides):
    host = _trl()
    cls = cls or host.Probe
    tokenizer = build_char_tokenizer()
    model = char_model(**HOST_SHAPE)
    # loss_type bnpo = Σ ℓ·m / Σ m per micro-batch (1 accumulation step), i.e. offpolicy's token-mean
    args = host.GRPOConfig(**{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "num_generations": 4,
                         "max_completion_length": COMPLETION_LEN, "max_steps": 2, "logging_steps": 1, "report_to": [],
                         "use_cpu": True, "learning_rate": 1e-2, "loss_type": "bnpo", "beta": 0.0,
                         "save_strategy": "no", "seed": 0, **overrides})
    data = host.Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "reverse me"] * 4})

    def reward(completions, **kwargs):  # varies across a group, so A ≠ 0
        return [float(sum(ord(ch) % 3 == 0 for ch in c)) for c in completions]

    return cls(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer,
               rollout_func=make_rollout_func(tokenizer), offpolicy_config=config, **(trainer_kwargs or {}))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_trl_loss_and_gradient_equal_offpolicy(tmp_path, name):
    cfg = CONFIGS[name]
    trainer = _trainer(tmp_path, cfg)
    assert trainer.vllm_importance_sampling_correction is False  # TRL's own correction is off
    trainer.train()
    assert len(trainer.captured) == 2  # two optimizer steps, one micro-batch each
    acted = 0.0
    for c in trainer.captured:
        lp = c["logprobs"].detach().clone().requires_grad_(True)
        want, metrics = op.policy_loss(lp, c["old"], c["adv"], c["mask"], c["rollout"], cfg)
        want.backward()
        torch.testing.assert_close(c["loss"], want.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(c["logprobs"].grad, lp.grad, rtol=1e-5, atol=1e-8)
        assert c["logprobs"].grad.abs().sum() > 0
        acted += metrics["masked_fraction"] if name != "token_tis" else metrics["is_max"] - 1.0
    assert acted > 0  # the spike was truncated / rejected: the comparison covers the correction itself
    logged = [h for h in trainer.state.log_history if "offpolicy/kl_k3" in h]
    assert len(logged) == 2 and all(h["offpolicy/kl_k3"] > 0 for h in logged)
    assert "offpolicy/masked_fraction" in logged[0] or "offpolicy/is_mean" in logged[0]


def test_trl_refuses_double_correction(tmp_path):
    with pytest.raises(ConfigError, match="off_policy_mask_threshold=0.5"):
        _trainer(tmp_path, CONFIGS["veto"], cls=_trl().Trainer, off_policy_mask_threshold=0.5)
    with pytest.raises(ConfigError, match="loss_type='vespo'"):
        _trainer(tmp_path, CONFIGS["veto"], cls=_trl().Trainer, loss_type="vespo")


@pytest.mark.slow
def test_trl_dump_is_diagnosable(tmp_path):
    from offpolicy.cli import main
    from offpolicy.integrations.dump import load_batch

    trainer = _trainer(tmp_path, "recommended", cls=_trl().Trainer,
                       trainer_kwargs={"dump_dir": str(tmp_path / "dump"), "dump_every": 1})
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == ["step000000-rank0.pt", "step000001-rank0.pt"]
    batch = load_batch(tmp_path / "dump")
    assert batch["mask"].shape[0] == 8 and batch["meta"][0]["host"] == "trl"
    assert main(["diagnose", "--batch", str(tmp_path / "dump"), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.json").is_file()
