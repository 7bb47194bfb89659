"""verl integration: verl's own ppo_loss (the actor's loss entry, verl/workers/utils/losses.py) with its
actor config and a TensorDict, loss_mode=offpolicy; loss and gradient must equal offpolicy's policy_loss."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import require_host

require_host("verl.utils.tensordict_utils", "verl.workers.config", "verl.workers.utils.losses",
             why="verl 0.9.1 is not importable (install.sh installs it; pip install offpolicy[verl])")

import torch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import offpolicy as op  # noqa: E402
from offpolicy.core.config import ConfigError  # noqa: E402
from offpolicy.integrations import verl as adapter  # noqa: E402

B, P, T = 6, 3, 7

# two-policy corrections: verl's bypass mode puts log μ in old_log_probs
CONFIGS = {
    # token TIS: w_t = min(sg(π_θ)/μ, 2) on REINFORCE (anchor current)
    "token_tis": op.LossConfig(kind="reinforce", correction=op.CorrectionConfig(
        anchor="current", weight={"level": "token", "mode": "truncate", "high": 2.0})),
    # sequence mask (Seq-MIS on sg(π_θ)/μ): drop a row unless 0.5 ≤ Π_t ρ_t ≤ 2; PPO ratio π_θ/μ
    "seq_mask": op.LossConfig(correction=op.CorrectionConfig(
        anchor="rollout", reject=[{"stat": "ratio", "level": "sequence", "low": 0.5, "high": 2.0}])),
    # veto: drop a row if any token has ρ outside [0.5, 2]; fixed denominator = verl's global token count
    "veto": op.LossConfig(correction=op.CorrectionConfig(
        anchor="rollout", reject=[{"stat": "ratio", "level": "any_token", "low": 0.5, "high": 2.0}],
        denominator="fixed")),
}


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    resp_len = torch.tensor([7, 5, 7, 3, 6, 7])
    mask = (torch.arange(T)[None] < resp_len[:, None]).float()
    mu = -torch.rand(B, T, generator=g) * 2 - 0.05
    lp = (mu + 0.15 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    lp[0, 2], mu[0, 2] = -0.1, -1.3  # ρ = e^1.2 ≈ 3.3: truncated by TIS, vetoes row 0, and pushes Π ρ of row 0 out of band
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    return lp * mask, mu * mask, adv, mask, resp_len


def _verl_call(lp_bt, mu, adv, mask, resp_len, *, global_tokens: bool, rollout_is_weights=None):
    """Call verl's ppo_loss as its actor does: packed (no-padding) log-probs, a TensorDict, ActorConfig."""
    prompt_len = torch.full((B,), P)
    # packed model output: per row prompt+response tokens; response log-probs sit one position left
    # (verl/workers/utils/padding.py::no_padding_2_padding)
    pieces = []
    for i in range(B):
        n = int(resp_len[i])
        pieces += [torch.zeros(P - 1), lp_bt[i, :n], torch.zeros(1)]
    packed = torch.cat(pieces)
    attention = torch.cat([torch.ones(B, P), mask], dim=1).long()
    tensors = {"prompts": torch.ones(B, P, dtype=torch.long), "responses": torch.ones(B, T, dtype=torch.long),
               "attention_mask": attention, "response_mask": mask, "old_log_probs": mu, "advantages": adv}
    if rollout_is_weights is not None:
        tensors["rollout_is_weights"] = rollout_is_weights
    data = tu.get_tensordict(tensors, non_tensor_dict={
        "dp_size": 1, "batch_num_tokens": float(mask.sum()) if global_tokens else None, "global_batch_size": None})
    assert int(prompt_len.sum() + resp_len.sum()) == packed.numel()
    config = FSDPActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=B, rollout_n=1, ppo_mini_batch_size=B,
                             policy_loss=PolicyLossConfig(loss_mode="offpolicy"))
    return ppo_loss(config, {"log_probs": packed}, data)


@pytest.fixture(autouse=True)
def _unconfigure():
    yield
    adapter.configure(None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verl_ppo_loss_equals_offpolicy(name, monkeypatch):
    cfg = CONFIGS[name]
    adapter.configure(cfg)
    lp, mu, adv, mask, resp_len = _batch()
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = _verl_call(leaf, mu, adv, mask, resp_len, global_tokens=(name == "veto"))
    loss.backward()
    mine = lp.clone().requires_grad_(True)
    want, want_metrics = op.policy_loss(mine, mu, adv, mask, mu, cfg)
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(leaf.grad, mine.grad, rtol=1e-6, atol=1e-8)
    assert mine.grad.abs().sum() > 0
    # the spike was acted on: truncated (TIS) or its row rejected (masks)
    acted = want_metrics["is_max"] == 2.0 if name == "token_tis" else want_metrics["masked_fraction"] > 0
    assert acted
    # metrics reach verl's metrics dict (ppo_loss wraps them as verl Metric objects)
    assert "offpolicy/kl_k3" in metrics and "actor/pg_loss" in metrics


def test_verl_refuses_double_and_three_policy_corrections():
    lp, mu, adv, mask, resp_len = _batch()
    adapter.configure(CONFIGS["veto"])
    with pytest.raises(ConfigError, match="rollout_is_weights"):
        _verl_call(lp, mu, adv, mask, resp_len, global_tokens=False, rollout_is_weights=torch.ones(B, T))
    adapter.configure("verl:decoupled_token_is")  # anchor old: three policies
    with pytest.raises(ConfigError, match="anchor 'old'"):
        _verl_call(lp, mu, adv, mask, resp_len, global_tokens=False)


def test_verl_needs_a_configured_loss(monkeypatch):
    monkeypatch.delenv(adapter.ENV, raising=False)
    lp, mu, adv, mask, resp_len = _batch()
    with pytest.raises(ConfigError, match="OFFPOLICY_VERL_LOSS is not set"):
        _verl_call(lp, mu, adv, mask, resp_len, global_tokens=False)
    monkeypatch.setenv(adapter.ENV, "verl:bypass_ppo_clip")  # how Ray workers get it: an environment variable
    loss, _ = _verl_call(lp, mu, adv, mask, resp_len, global_tokens=False)
    assert torch.isfinite(loss)
    # legacy RayPPOTrainer bypass mode swaps in verl's own "bypass_mode" loss: refused while offpolicy is asked for
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    with pytest.raises(ConfigError, match="overwrites actor.policy_loss.loss_mode"):
        get_policy_loss_fn("bypass_mode")(mu, lp, adv, mask)


def test_verl_dump_is_diagnosable(tmp_path, monkeypatch):
    from offpolicy.cli import main

    monkeypatch.setenv("OFFPOLICY_VERL_DUMP_DIR", str(tmp_path / "dump"))
    adapter.configure(CONFIGS["veto"])
    lp, mu, adv, mask, resp_len = _batch()
    _verl_call(lp, mu, adv, mask, resp_len, global_tokens=False)
    files = list((tmp_path / "dump").glob("*.pt"))
    assert len(files) == 1
    assert main(["diagnose", "--batch", str(files[0]), "--out", str(tmp_path / "report")]) == 0
    report = __import__("json").loads((tmp_path / "report" / "report.json").read_text())
    want = op.correct(lp, mu, mask).metrics  # the trainer view is π_θ, the engine's μ
    assert abs(report["mismatch"]["kl_k3"] - want["kl_k3"]) < 1e-6 * max(1.0, want["kl_k3"])


def test_import_verl_loads_the_entry_point():
    """A fresh interpreter: `import verl` alone (as in a Ray worker) registers loss_mode 'offpolicy'."""
    code = ("import sys, verl\n"
            "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "fn = get_policy_loss_fn('offpolicy')\n"
            "assert fn.__module__ == 'offpolicy.integrations.verl', fn.__module__\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "VERL_USE_EXTERNAL_PLUGINS": "auto"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
