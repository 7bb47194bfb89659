"""Issue #25, part 1–2: the gate metrics (mean |log ρ|, NeMo-RL's token multiplicative probability
error, prime-rl's mismatch KL over entropy) and `offpolicy diagnose --fail-above/--fail-below` as a
user types it in CI: exit 0 when every bound holds, 3 with one line per failed bound, 2 for a usage
error."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

import offpolicy as op
from offpolicy.measure.diagnose import gate, parse_bounds
from offpolicy.core.config import ConfigError
from offpolicy.integrations.dump import BatchDumper
from offpolicy.core.kernels import IMPLEMENTATIONS
from offpolicy.policy.head import token_entropy
from offpolicy.train.loop import with_kl_over_entropy


def _golden():
    # log ρ = log π_old − log μ per token: log 2, −log 2, 0 (row 0) and log 4 (row 1), one padded token
    old = torch.tensor([[math.log(0.5), math.log(0.4), math.log(0.3)], [math.log(0.8), -1.0, -1.0]])
    roll = torch.tensor([[math.log(0.25), math.log(0.8), math.log(0.3)], [math.log(0.2), -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return old, roll, mask


def test_mult_prob_error_and_mean_abs_log_ratio_by_hand():
    old, roll, mask = _golden()
    m = op.correct(old, roll, mask).metrics
    # NeMo-RL: mean_t exp(|log ρ_t|) = (2 + 2 + 1 + 4) / 4 = 2.25 (the padded token never counts)
    assert m["mult_prob_error"] == pytest.approx(2.25, rel=1e-6)
    # mean |log π_old − log μ| = (log 2 + log 2 + 0 + log 4) / 4 = log 2
    assert m["abs_logp_diff_mean"] == pytest.approx(math.log(2), rel=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_rung_reports_the_same_mult_prob_error(implementation):
    if implementation == "triton":
        pytest.importorskip("triton", reason="Triton is not installed; the triton rung is untested")
    old, roll, mask = _golden()
    cfg = op.LossConfig(kind="ppo", correction=op.CorrectionConfig.from_preset("recommended"))
    adv = torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, 0.0]])
    try:
        _, m = op.policy_loss(old.clone().requires_grad_(), old, adv, mask, rollout_logprobs=roll, config=cfg,
                              implementation=implementation)
    except ValueError as err:  # a rung that does not cover the recommended preset says so
        pytest.skip(str(err))
    assert m["mult_prob_error"] == pytest.approx(2.25, rel=1e-6)


def test_token_entropy_and_kl_over_entropy_by_hand():
    # uniform over 4 tokens: H = log 4; a one-hot distribution (log 0 = −inf elsewhere): H = 0, not NaN
    uniform = torch.full((1, 1, 4), math.log(0.25))
    onehot = torch.tensor([[[0.0, -math.inf, -math.inf, -math.inf]]])
    assert token_entropy(uniform).item() == pytest.approx(math.log(4))
    assert token_entropy(onehot).item() == 0.0
    # prime-rl's kl_ent_ratio: mismatch KL / entropy, left out at entropy 0
    values = with_kl_over_entropy({"offpolicy/kl_k3": 2e-3, "offpolicy/entropy": 0.5})
    assert values["offpolicy/kl_over_entropy"] == pytest.approx(4e-3)
    assert "offpolicy/kl_over_entropy" not in with_kl_over_entropy({"offpolicy/kl_k3": 1.0, "offpolicy/entropy": 0.0})


def test_gate_bounds_and_usage_errors():
    assert parse_bounds(["kl_k3=5e-4", "masked_fraction@verl:decoupled_seq_is_rs=0.05"], "--fail-above") == [
        ("kl_k3", 5e-4), ("masked_fraction@verl:decoupled_seq_is_rs", 0.05)]
    for bad, why in (("kl=1", "unknown STAT 'kl'. Allowed: kl_k1, kl_k3"), ("kl_k3", "expected STAT=VALUE"),
                     ("kl_k3=abc", "expected STAT=VALUE"), ("masked_fraction@nope=1", "PRESET one of")):
        with pytest.raises(ConfigError, match=why):
            parse_bounds([bad], "--fail-above")
    values = {"kl_k3": 1e-3, "ess": 0.95, "chi2": math.nan}
    assert gate(values, [("kl_k3", 1e-3)], [("ess", 0.95)]) == []  # a bound is inclusive
    failed = gate(values, [("kl_k3", 5e-4), ("chi2", 1.0)], [("ess", 0.99)])
    assert len(failed) == 3 and failed[0].startswith("FAIL kl_k3 = 0.001 is above the bound 0.0005")
    assert "NaN" not in failed[1] and "chi2 = nan" in failed[1]  # NaN never passes
    with pytest.raises(ConfigError, match="kl_over_entropy: left out"):
        gate(values, [("kl_over_entropy", 1.0)], [], ["kl_over_entropy: left out, no logits"])


def _diagnose(*args: str, cwd, process: bool = False) -> subprocess.CompletedProcess:
    """``offpolicy diagnose ARGS`` in this process (tests/cli_inprocess.py), or with ``process`` as its own
    ``python -m offpolicy`` — the exit status a CI script reads."""
    from cli_inprocess import offpolicy

    return offpolicy("diagnose", *args, cwd=cwd, process=process, timeout=300)


def test_fail_above_as_a_user_types_it_exit_0_3_and_2(tmp_path):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 8, generator=g) * 3
    roll = old - 0.05 * torch.randn(6, 8, generator=g).abs()
    BatchDumper(tmp_path / "dump", every=1, host="test", host_version="0").maybe_dump(
        0, old_logprobs=old, rollout_logprobs=roll, mask=torch.ones(6, 8))
    want = op.correct(old, roll, torch.ones(6, 8)).metrics
    kl = want["kl_k3"]
    args = ("--batch", "dump", "--out", "report")
    ok = _diagnose(*args, "--fail-above", f"kl_k3={kl * 2}", "--fail-above", "mean_abs_log_ratio=0.1",
                   "--fail-below", "ess=0.9", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads((tmp_path / "report" / "report.json").read_text())["summary"]
    assert summary["kl_k3"] == pytest.approx(kl, rel=1e-6)
    assert summary["mult_prob_error"] == pytest.approx(want["mult_prob_error"], rel=1e-6)
    assert "kl_over_entropy" not in summary  # a dump holds no logits
    fail = _diagnose(*args, "--fail-above", f"kl_k3={kl / 2}", "--fail-above", "mult_prob_error=1.0",
                     "--fail-below", "ess=0.9", cwd=tmp_path, process=True)
    assert fail.returncode == 3, fail.stderr
    lines = [line for line in fail.stderr.splitlines() if "FAIL" in line]
    assert len(lines) == 2 and "kl_k3" in lines[0] and "mult_prob_error" in lines[1]
    usage = _diagnose(*args, "--fail-above", "kl=1", cwd=tmp_path)
    assert usage.returncode == 2 and "Allowed: kl_k1, kl_k3, mean_abs_log_ratio" in usage.stderr



def test_a_bound_the_dump_cannot_hold_is_a_usage_error(tmp_path, capsys, monkeypatch):
    from offpolicy.cli import main

    g = torch.Generator().manual_seed(1)
    old = -torch.rand(2, 4, generator=g)
    BatchDumper(tmp_path / "dump", every=1).maybe_dump(0, old_logprobs=old, rollout_logprobs=old - 0.01,
                                                       mask=torch.ones(2, 4))
    monkeypatch.chdir(tmp_path)  # log ρ = 0.01 on every token: the histogram must still draw
    assert main(["diagnose", "--batch", "dump", "--out", "report", "--fail-above", "kl_over_entropy=0.1"]) == 2
    assert "no trainer logits" in capsys.readouterr().err  # never a silent pass


@pytest.mark.parametrize("stat", ["masked_fraction@recommended", "seq_masked_fraction@verl:decoupled_token_is"])
def test_a_rejected_fraction_of_a_preset_that_rejects_nothing_is_refused(stat):
    """Issue #32: docs/ci-gate.md gated masked_fraction@recommended, 0 on every batch (recommended has no
    rejection rule): a bound that can never fail is a usage error, with a preset that can."""
    with pytest.raises(ConfigError, match=r"rejects no token .* cannot gate anything.*@verl:decoupled_seq_is_rs"):
        parse_bounds([f"{stat}=0.05"], "--fail-above")
    parse_bounds(["weight_ess@recommended=0.5", "masked_fraction@areal:m2po=0.1"], "--fail-below")


def test_the_docs_ci_example_can_fail_and_entropy_says_why_on_a_dump(tmp_path, capsys, monkeypatch):
    """The gate of docs/ci-gate.md's CI step, on a dump whose rows drift apart: it fails (exit 3) on the
    rejected fraction; and a bound on entropy, which a dump cannot hold, says why (it said only 'not in
    this report')."""
    import re
    from pathlib import Path

    from offpolicy.cli import main

    doc = (Path(__file__).resolve().parents[1] / "docs" / "ci-gate.md").read_text()
    step = re.search(r"offpolicy diagnose --batch dumps/ --out mismatch-host\s+(.*?)\n", doc).group(1).split()
    assert step[0] == "--fail-above" and step[1].startswith("kl_k3=") and "@" in step[3]
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(8, 6, generator=g) * 2 - 0.5
    roll = old + torch.cat([torch.zeros(4, 6), torch.full((4, 6), 0.3)])  # half the rows: Π ρ = e^-1.8 < 0.5
    BatchDumper(tmp_path / "dumps", every=1).maybe_dump(0, old_logprobs=old, rollout_logprobs=roll,
                                                        mask=torch.ones(8, 6))
    monkeypatch.chdir(tmp_path)
    assert main(["diagnose", "--batch", "dumps", "--out", "report", *step[2:]]) == 3
    assert f"FAIL {step[3].split('=')[0]}" in capsys.readouterr().err
    assert main(["diagnose", "--batch", "dumps", "--out", "report", "--fail-above", "entropy=1.0"]) == 2
    err = capsys.readouterr().err
    assert "entropy: left out, no trainer logits" in err and "not in this report" not in err
