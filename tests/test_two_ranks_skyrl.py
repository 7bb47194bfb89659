"""SkyRL 0.4.0's policy worker at two data-parallel ranks (gloo, FSDP2) equals one rank, with offpolicy's loss.

tests/skyrl_cpu_worker.py ``--ranks`` runs SkyRL's ``PolicyWorkerBase.forward_backward`` /
``optim_step`` with the model wrapped by SkyRL's own ``apply_fsdp2`` (fp32) on a CPU mesh of two
ranks and of one, on the same global batch: 8 rows of unequal lengths (rank 0 holds 10 valid
tokens, rank 1 holds 21), two optimizer steps, two micro-batches per rank (four at one rank).
Every run must end with the same weights (to float rounding) and the same logged status
(``loss_metrics/offpolicy/*``, ``policy_loss``, ``grad_norm``, ...) at both world sizes:

* under each of SkyRL's ``loss_reduction`` modes that need no prompt grouping (token_mean,
  token_mean_legacy, sequence_mean, seq_mean_token_sum_norm);
* with rank 1's tokens all rejected by a ratio veto (μ 3 nats below π_old on its rows);
* with a data-chosen weight cap (``{rule: quantile, q: 0.75}``), which inside SkyRL is resolved
  per loss call (SkyRL hands its loss one micro-batch): both worlds split the step into the same
  micro-batches, so the same caps are chosen — equal, but not the one-big-batch cap (below).

The comparison can fail: advantages pre-scaled per rank (each rank dividing by its own token
count, the per-rank normaliser SkyRL's driver avoids) end elsewhere at two ranks.
Different micro-batch counts per rank are not allowed by SkyRL: FSDP2 gathers the parameters at
every forward and reduces the gradient at every backward, so every rank must run the same number
of micro-batches (SkyRL's dispatch splits a mini-batch evenly; its token-based batching pads the
micro-batch count to be equal across ranks).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("skyrl", reason="SkyRL not installed (pip install offpolicy[skyrl]; Python >= 3.12)")
for _dep in ("ray", "omegaconf", "jaxtyping", "loguru"):
    pytest.importorskip(_dep, reason=f"{_dep} (a SkyRL dependency) not installed: run install.sh")

from host_packages import worker_env  # noqa: E402
from conftest import fixed_denominator  # noqa: E402
from e2e_reference import LR, MAX_NORM, MODEL, distance, response_logprobs  # noqa: E402
from hf_fixtures import char_model  # noqa: E402
from two_ranks import RESPONSE, global_batches  # noqa: E402

import offpolicy as op  # noqa: E402

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
BASE = ["trainer.logger=console", "trainer.micro_train_batch_size_per_gpu=2",
        f"trainer.policy.optimizer_config.max_grad_norm={MAX_NORM}", "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.use_entropy_loss=false", f"trainer.algorithm.max_seq_len={RESPONSE}"]
CFG = fixed_denominator(op.presets.loss("recommended"))
VETO = op.LossConfig(clip_low=0.2, clip_high=0.2, correction=op.CorrectionConfig(
    anchor="old", reject=[{"stat": "ratio", "level": "any_token", "low": 0.1, "high": 10.0}], denominator="fixed"))
QUANTILE = op.LossConfig(clip_low=0.2, clip_high=0.2, correction=op.CorrectionConfig(
    anchor="old", weight={"level": "token", "mode": "truncate", "high": {"rule": "quantile", "q": 0.75}},
    denominator="fixed"))
REDUCTIONS = ("token_mean", "token_mean_legacy", "sequence_mean", "seq_mean_token_sum_norm")


def _env() -> dict[str, str]:
    return worker_env(("flash_attn",))


def _runs():
    model = char_model(**MODEL)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain = global_batches(model, response_logprobs)
    spiked = global_batches(model, response_logprobs, seed=1, spike_rows=(4, 5, 6, 7))
    runs = [{"name": r, "loss_config": CFG, "batches": plain, "overrides": [*BASE, f"trainer.algorithm.loss_reduction={r}"]}
            for r in REDUCTIONS]
    token_mean = [*BASE, "trainer.algorithm.loss_reduction=token_mean"]
    runs += [{"name": "rank1_all_rejected", "loss_config": VETO, "batches": spiked, "overrides": token_mean},
             {"name": "quantile_cap", "loss_config": QUANTILE, "batches": plain, "overrides": token_mean},
             {"name": "per_rank_scale", "loss_config": CFG, "batches": plain, "overrides": token_mean,
              "per_rank_scale": True}]
    return state, runs


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    d = tmp_path_factory.mktemp("skyrl_two_ranks")
    state, runs = _runs()
    torch.save({"model": MODEL, "state": state, "runs": runs, "lr": LR}, d / "in.pt")
    proc = subprocess.run([sys.executable, str(TESTS / "skyrl_cpu_worker.py"), "--ranks", str(d / "in.pt"),
                           str(d / "out.pt")], env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return state, runs, torch.load(d / "out.pt", weights_only=False)


def _assert_same_status(two: list[dict], one: list[dict], name: str) -> None:
    assert len(two) == len(one) == 2
    for step, (a, b) in enumerate(zip(two, one)):
        keys = {k for k, v in b.items() if isinstance(v, (int, float))}
        assert keys == {k for k, v in a.items() if isinstance(v, (int, float))}
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=2e-5, abs=1e-6), (name, step, k)


def test_skyrl_worker_two_ranks_equal_one(worlds) -> None:
    state, runs, out = worlds
    two, one = out[2], out[1]
    for run in runs:
        name = run["name"]
        a0, a1, b = two[0][name], two[1][name], one[0][name]
        moved = distance(b["state"], state)
        assert moved > 1e-2, name  # the steps move the weights
        # both ranks hold the same weights, and the same logged status (SkyRL all-reduces it)
        assert distance(a0["state"], a1["state"]) == 0.0, name
        _assert_same_status(a0["status"], a1["status"], name)
        gap = distance(a0["state"], b["state"])
        print(f"SkyRL {name}: moved {moved:.4f}, two ranks vs one {gap:.2e}")
        if run.get("per_rank_scale"):
            # each rank dividing by its own tokens (10 vs 21) is not one batch: the check can fail
            assert gap > 1e-2 * moved, (name, gap, moved)
            continue
        assert gap < 1e-5 * moved, (name, gap, moved)
        _assert_same_status(a0["status"], b["status"], name)
        assert "loss_metrics/offpolicy/kl_k3" in b["status"][0]


def test_a_rank_whose_tokens_are_all_rejected(worlds) -> None:
    _, _, out = worlds
    # rank 1 rejects every token in both micro-batches; SkyRL averages the per-micro-batch fraction:
    # rank 0's two micro-batches reject nothing, so the mean over 4 micro-batches is 0.5
    for status in out[2][0]["rank1_all_rejected"]["status"]:
        assert status["loss_metrics/offpolicy/masked_fraction"] == pytest.approx(0.5)
        # a statistic over no kept token reads 0 on rank 1's micro-batches (host.host_floats), so SkyRL's
        # mean over micro-batches and ranks stays a number (it was NaN on every rank before)
        assert all(math.isfinite(v) for v in status.values() if isinstance(v, float)), status
    for status in out[2][0]["token_mean"]["status"]:
        assert "loss_metrics/offpolicy/masked_fraction" not in status or status["loss_metrics/offpolicy/masked_fraction"] == 0


def test_the_quantile_cap_is_per_micro_batch_inside_skyrl(worlds) -> None:
    # SkyRL calls the loss per micro-batch: the cap is chosen per call, the same in both worlds (above)
    # and not the one a single call over the whole step would choose
    _, runs, out = worlds
    batch = next(r for r in runs if r["name"] == "quantile_cap")["batches"][0]
    m = batch["action_mask"]
    whole = op.correct(batch["old"], batch["mu"], m, QUANTILE.correction)
    per_call = [op.correct(batch["old"][s], batch["mu"][s], m[s], QUANTILE.correction).metrics["weight_high"]
                for s in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8))]
    logged = out[1][0]["quantile_cap"]["status"][0]["loss_metrics/offpolicy/weight_high"]
    assert logged == pytest.approx(sum(per_call) / 4, rel=1e-5)
    assert abs(logged - whole.metrics["weight_high"]) > 1e-3
