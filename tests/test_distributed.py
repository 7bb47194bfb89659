"""Two gloo ranks, each holding half a batch, must report the metrics and the batch-normalised
weights of the whole batch (docs/specification.md §3 normalize, §7 all_reduce)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import offpolicy as op

sys.path.insert(0, str(Path(__file__).parent))
from conftest import on_gloo_ranks, random_batch  # noqa: E402

CFG = op.LossConfig(correction=op.CorrectionConfig(
    weight={"level": "token", "mode": "truncate", "low": 0.5, "high": 2.0, "normalize": True},
    reject=[{"stat": "ratio", "level": "any_token", "low": 0.05}, {"stat": "k3", "level": "seq_max", "high": 0.5}],
), dual_clip=3.0)
SEQ_CFG = op.CorrectionConfig(weight={"level": "sequence", "mode": "truncate", "high": 2.0, "normalize": True})
SPLIT = [slice(0, 3), slice(3, 8)]  # uneven on purpose


def _rank_main(rank: int) -> dict:
    b = random_batch(seed=7, b=8, t=10, noise=0.5)
    s = SPLIT[rank]
    # rank 1 also records a key rank 0 never sees: the key sets must be agreed before reducing
    loss, metrics = op.policy_loss(b["logprobs"][s], b["old"][s], b["adv"][s], b["mask"][s],
                                   rollout_logprobs=b["rollout"][s], config=CFG)
    if rank == 1:
        metrics.mean("only_on_rank_1", torch.tensor([3.0]))
    metrics.all_reduce()
    seq = op.correct(b["old"][s], b["rollout"][s], b["mask"][s], SEQ_CFG)
    tok = op.correct(b["old"][s], b["rollout"][s], b["mask"][s], CFG.correction)
    return {"metrics": metrics.to_dict(), "seq_weights": seq.weights, "tok_weights": tok.weights}


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_batch(tmp_path):
    ranks = on_gloo_ranks(_rank_main, tmp_path)

    b = random_batch(seed=7, b=8, t=10, noise=0.5)
    _, whole = op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"], rollout_logprobs=b["rollout"], config=CFG)
    expected = whole.to_dict()
    for r in ranks:
        got = r["metrics"]
        assert got["offpolicy/only_on_rank_1"] == 3.0
        for key, value in expected.items():
            if math.isnan(value):
                assert math.isnan(got[key]), key
            else:
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    # weights normalised by the mean over *both* ranks equal the whole batch's
    for weights_key, cfg in (("tok_weights", CFG.correction), ("seq_weights", SEQ_CFG)):
        whole_w = op.correct(b["old"], b["rollout"], b["mask"], cfg).weights
        got_w = torch.cat([ranks[0][weights_key], ranks[1][weights_key]])
        torch.testing.assert_close(got_w, whole_w, rtol=1e-5, atol=1e-6)
        # and the test can fail: per-rank normalisation differs
        local = op.correct(b["old"][SPLIT[0]], b["rollout"][SPLIT[0]], b["mask"][SPLIT[0]], cfg).weights
        assert not torch.allclose(local, whole_w[SPLIT[0]], rtol=1e-4)
