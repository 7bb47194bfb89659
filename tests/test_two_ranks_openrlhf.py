"""OpenRLHF 0.11.2's actor epoch loop at two data-parallel ranks (gloo) equals one rank, with offpolicy's loss.

tests/openrlhf_cpu_worker.py ``--ranks`` runs ``ActorPPOTrainer.ppo_train`` — OpenRLHF's replay
buffer and data loader, ``iter_grad_accum_global_norm`` (the optimizer step's token and sample
counts summed over its micro-batches and all-reduced over the ranks), ``training_step`` → the
actor's loss call (``OffpolicyPolicyLoss`` → ``aggregate_loss`` with ``dp_size``) and its metric
reduction (token/sample-weighted sums all-reduced by ``DeepspeedStrategy.all_reduce``) — at two
gloo ranks and at one, on the same global batch: 8 rows of unequal lengths (rank 0 holds 10
valid tokens, rank 1 holds 21), micro-batches of one row (4 per rank at two ranks, 8 at one), one
optimizer step per batch, two batches. The gradient reduction is NOT OpenRLHF's: DeepSpeed is
absent (and builds a CUDA mesh), so ``DPStrategy`` stands in for its engine (loss / gas, gradients
averaged over the ranks at the accumulation boundary, clip, step).

Equal weights (to rounding) and equal ``ppo_train`` status under both ``--actor.loss_agg_mode``
values, with rank 1's tokens all rejected by a ratio veto, and with a data-chosen weight cap
(``{rule: quantile}``, chosen per loss call, i.e. per micro-batch of one row here, in both worlds).
The comparison can fail: each rank dividing by its own token count (``batch_num_tokens`` per
rank, broken on purpose) ends elsewhere. Micro-batch counts that differ by rank are not possible
in OpenRLHF: ``ppo_train`` all-reduces the status after every micro-batch (and DeepSpeed reduces
gradients at the same boundaries on every rank); its dynamic batching equalises the counts.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("openrlhf", reason="OpenRLHF not installed (pip install offpolicy[openrlhf])")
pytest.importorskip("pylatexenc", reason="pylatexenc (an OpenRLHF dependency) not installed: run install.sh")

from host_packages import worker_env  # noqa: E402
from conftest import fixed_denominator  # noqa: E402
from e2e_reference import LR, MAX_NORM, MODEL, distance, response_logprobs  # noqa: E402
from hf_fixtures import char_model  # noqa: E402
from two_ranks import global_batches  # noqa: E402

import offpolicy as op  # noqa: E402

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent


def _argv(clip: float, agg: str) -> list[str]:
    return ["--actor.model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct",
            "--reward.remote_url", "http://127.0.0.1:5000/get_reward", "--algo.advantage.estimator", "group_norm",
            "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "8", "--actor.num_gpus_per_node", "1",
            "--vllm.num_engines", "1", "--actor.eps_clip_low_high", str(clip), str(clip),
            "--actor.loss_agg_mode", agg, "--actor.max_norm", str(MAX_NORM)]


CFG = fixed_denominator(op.presets.loss("recommended"))
VETO = op.LossConfig(clip_low=0.2, clip_high=0.2, correction=op.CorrectionConfig(
    anchor="old", reject=[{"stat": "ratio", "level": "any_token", "low": 0.1, "high": 10.0}], denominator="fixed"))
QUANTILE = op.LossConfig(clip_low=0.2, clip_high=0.2, correction=op.CorrectionConfig(
    anchor="old", weight={"level": "token", "mode": "truncate", "high": {"rule": "quantile", "q": 0.75}},
    denominator="fixed"))


def _env() -> dict[str, str]:
    return worker_env(("deepspeed", "flash_attn"))


def _runs():
    model = char_model(**MODEL)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain = global_batches(model, response_logprobs)
    spiked = global_batches(model, response_logprobs, seed=1, spike_rows=(4, 5, 6, 7))
    clip = CFG.clip_low
    runs = [{"name": "token-mean", "loss_config": CFG, "batches": plain, "argv": _argv(clip, "token-mean")},
            {"name": "seq-mean-token-mean", "loss_config": CFG, "batches": plain,
             "argv": _argv(clip, "seq-mean-token-mean")},
            {"name": "rank1_all_rejected", "loss_config": VETO, "batches": spiked, "argv": _argv(0.2, "token-mean")},
            {"name": "quantile_cap", "loss_config": QUANTILE, "batches": plain, "argv": _argv(0.2, "token-mean")},
            {"name": "per_rank_count", "loss_config": CFG, "batches": plain, "argv": _argv(clip, "token-mean"),
             "per_rank_count": True}]
    return state, runs


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    d = tmp_path_factory.mktemp("openrlhf_two_ranks")
    state, runs = _runs()
    torch.save({"model": MODEL, "state": state, "runs": runs, "lr": LR, "micro": 1}, d / "in.pt")
    proc = subprocess.run([sys.executable, str(TESTS / "openrlhf_cpu_worker.py"), "--ranks", str(d / "in.pt"),
                           str(d / "out.pt")], env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return state, runs, torch.load(d / "out.pt", weights_only=False)


def _numbers(status: dict) -> dict[str, float]:
    return {k: float(v) for k, v in status.items() if isinstance(v, (int, float))}


def test_openrlhf_ppo_train_two_ranks_equal_one(worlds) -> None:
    state, runs, out = worlds
    two, one = out[2], out[1]
    for run in runs:
        name = run["name"]
        a0, a1, b = two[0][name], two[1][name], one[0][name]
        assert a0["loss_fn"] == b["loss_fn"] == "OffpolicyPolicyLoss"
        moved = distance(b["state"], state)
        assert moved > 1e-2, name
        assert distance(a0["state"], a1["state"]) == 0.0, name  # the stand-in's averaged gradient: one model
        gap = distance(a0["state"], b["state"])
        print(f"OpenRLHF {name}: moved {moved:.4f}, two ranks vs one {gap:.2e}")
        if run.get("per_rank_count"):
            assert gap > 1e-2 * moved, (name, gap, moved)
            continue
        assert gap < 1e-5 * moved, (name, gap, moved)
        for step, (sa, sa1, sb) in enumerate(zip(a0["status"], a1["status"], b["status"])):
            x, x1, y = _numbers(sa), _numbers(sa1), _numbers(sb)
            assert x.keys() == y.keys() == x1.keys() and "offpolicy/kl_k3" in y
            for k in y:
                assert math.isfinite(y[k]), (name, step, k)
                assert x[k] == pytest.approx(y[k], rel=2e-5, abs=1e-6), (name, step, k)
                assert x1[k] == pytest.approx(x[k], rel=1e-6, abs=1e-7), (name, step, k)


def test_a_rank_whose_tokens_are_all_rejected(worlds) -> None:
    _, runs, out = worlds
    batches = next(r for r in runs if r["name"] == "rank1_all_rejected")["batches"]
    for b, status in zip(batches, out[2][0]["rank1_all_rejected"]["status"]):
        # OpenRLHF weights each micro-batch's masked fraction by its action tokens: rank 1's 21 of 31
        m = b["action_mask"]
        assert status["offpolicy/masked_fraction"] == pytest.approx(float(m[4:].sum() / m.sum()), rel=1e-6)
