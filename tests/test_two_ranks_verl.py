"""verl 0.9.1's actor update at two data-parallel ranks (gloo, FSDP2) equals one rank, with offpolicy's loss.

tests/verl_actor_step.py ``--ranks`` builds ``ActorRolloutRefWorker(role="actor")`` + ``init_model()``
(verl's FSDP2 engine, sharded over a CPU mesh of the world's size) at two gloo ranks and at one, and
sends each rank its contiguous chunk of the same global batch through ``update_actor`` (verl's own
``train_mini_batch``: the mini-batch's token count all-reduced over the ranks into
``batch_num_tokens``, ``ppo_loss`` → the registered ``offpolicy`` loss → ``agg_loss`` with
``dp_size``, FSDP2's gradient reduce-scatter, clip, SGD step; metrics all-gathered). The batch:
8 rollouts of unequal lengths (rank 0 holds 17 response tokens, rank 1 holds 13), mini-batch = the
8 rows (one optimizer step per update), micro-batches of 2 (2 per rank, 4 at one rank), two updates.

Equal weights (to rounding) and equal metrics (verl logs the mean over micro-batches and ranks)
under each ``loss_agg_mode`` (token-mean, seq-mean-token-sum, seq-mean-token-mean,
seq-mean-token-sum-norm), with rank 1's tokens all rejected by a ratio veto, with a data-chosen
bound (a ratio band's ``high: {rule: quantile}``: per loss call, i.e. per micro-batch, in both worlds), and with
verl's dynamic batch size (``use_dynamic_bsz``: micro-batches by token budget, so the two worlds
split the step differently — weights equal; verl's per-micro-batch metric means then differ, as
they do for verl's own loss, and are not compared). The comparison can fail: the loss divided by
each rank's own token count (broken on purpose) ends elsewhere.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl not installed (install.sh installs verl==0.9.1; pip install offpolicy[verl])")
pytest.importorskip("hydra", reason="verl's config needs hydra-core (a verl dependency)")

import torch  # noqa: E402

import offpolicy as op  # noqa: E402
from test_e2e_verl import LR, _batch, _load, _loss_env, _model_dir  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MINI, MICRO = 8, 2
VETO = op.LossConfig(correction=op.CorrectionConfig(
    anchor="rollout", reject=[{"stat": "ratio", "level": "any_token", "low": 0.1, "high": 10.0}], denominator="fixed"))
# bypass mode has no separate weight (PPO's ratio is π_θ/μ): the data-chosen bound is a token band's top
QUANTILE = op.LossConfig(correction=op.CorrectionConfig(
    anchor="rollout", reject=[{"stat": "ratio", "level": "token", "high": {"rule": "quantile", "q": 0.75}}],
    denominator="fixed"))
AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _batches(model_dir: Path, spike_rows: tuple[int, ...] = ()) -> list[dict[str, torch.Tensor]]:
    first = _batch(model_dir)
    second = {k: v.clone() for k, v in first.items()}
    second["advantages"] = -0.5 * first["advantages"]  # a second update on the same rollouts, other advantages
    for b in (first, second):
        for r in spike_rows:  # μ 3 nats lower on every token of these rows: π_θ/μ ≈ e³ > 10
            b["old_log_probs"][r] -= 3.0 * b["response_mask"][r]
    return [first, second]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl_two_ranks")
    model_dir = _model_dir(tmp)
    plain = _batches(model_dir)
    runs = {f"agg={a}": {"loss": "recommended", "batches": plain,
                         "overrides": [f"actor_rollout_ref.actor.loss_agg_mode={a}"]} for a in AGG}
    runs["rank1_all_rejected"] = {"loss": _loss_env(VETO, "veto", tmp), "batches": _batches(model_dir, (4, 5, 6, 7))}
    runs["quantile_cap"] = {"loss": _loss_env(QUANTILE, "quantile", tmp), "batches": plain}
    runs["dynamic_bsz"] = {"loss": "recommended", "batches": plain, "overrides": [
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24"]}
    runs["per_rank_count"] = {"loss": "recommended", "batches": plain, "per_rank_count": True}
    job = {"model": str(model_dir), "mini_batch_size": MINI, "micro_batch_size": MICRO, "lr": LR, "runs": runs}
    torch.save(job, tmp / "job.pt")
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "verl_actor_step.py"), "--ranks", str(tmp / "job.pt"),
                        str(tmp / "out.pt")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    return model_dir, runs, torch.load(tmp / "out.pt", weights_only=False)


def _distance(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5


def _mean(v) -> float:
    return sum(v) / len(v) if isinstance(v, list) else float(v)


def test_verl_update_actor_two_ranks_equal_one(worlds) -> None:
    model_dir, runs, out = worlds
    two, one = out[2], out[1]
    assert two[0]["agg=token-mean"]["dp"] == 2 and one[0]["agg=token-mean"]["dp"] == 1
    start = {k: v.detach() for k, v in _load(model_dir).named_parameters()}
    for name, run in runs.items():
        a0, a1, b = two[0][name], two[1][name], one[0][name]
        moved = _distance(b["params"], start)
        assert moved > 1e-2, name
        assert _distance(a0["params"], a1["params"]) == 0.0, name  # FSDP2's full weights, the same on both ranks
        gap = _distance(a0["params"], b["params"])
        print(f"verl {name}: moved {moved:.4f}, two ranks vs one {gap:.2e}")
        if run.get("per_rank_count"):
            assert gap > 1e-2 * moved, (name, gap, moved)
            continue
        assert gap < 1e-5 * moved, (name, gap, moved)
        if name == "dynamic_bsz":
            continue
        for step, (ma, mb) in enumerate(zip(a0["metrics"], b["metrics"])):
            assert "offpolicy/kl_k3" in mb
            for k in mb:
                if not (k.startswith("offpolicy/") or k in ("actor/pg_loss", "grad_norm", "loss")):
                    continue
                assert math.isfinite(_mean(mb[k])), (name, step, k)
                assert _mean(ma[k]) == pytest.approx(_mean(mb[k]), rel=2e-5, abs=1e-6), (name, step, k)


def test_a_rank_whose_tokens_are_all_rejected(worlds) -> None:
    _, runs, out = worlds
    for m in out[2][0]["rank1_all_rejected"]["metrics"]:
        # verl's mean over the 4 micro-batches: rank 0's two reject nothing, rank 1's two reject everything
        assert _mean(m["offpolicy/masked_fraction"]) == pytest.approx(0.5)
        # a statistic over no kept token is 0 on rank 1 (host.host_floats), so verl's mean is a number
        assert math.isfinite(_mean(m["offpolicy/clip_fraction"]))
