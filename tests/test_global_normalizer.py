"""Micro-batches × ranks = one big batch, for every aggregation (issue #9 item 10).

``with_global_normalizer`` fills in the loss denominator of one optimizer step — the surviving
token count (``renormalize``) or the valid one (``fixed``), summed over micro-batches and
all-reduced over ranks — so the micro-batches' losses and gradients add up to the big batch's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import offpolicy as op
from offpolicy.core.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from conftest import on_gloo_ranks, random_batch  # noqa: E402

B, T = 12, 10
REJECT = [{"stat": "ratio", "level": "token", "low": 0.6, "high": 1.6},
          {"stat": "ratio", "level": "geometric", "low": 0.8, "high": 1.25}]
CONFIGS = {
    "token-mean renormalize": op.LossConfig(correction={"weight": {"level": "token", "mode": "truncate", "high": 2.0},
                                                        "reject": REJECT}),
    "token-mean fixed": op.LossConfig(correction={"reject": REJECT, "denominator": "fixed"}),
    "seq-mean-token-mean": op.LossConfig(agg="seq-mean-token-mean", correction={"reject": REJECT}),
    "seq-mean-token-sum": op.LossConfig(agg="seq-mean-token-sum", correction={"reject": REJECT}),
    "seq-mean-token-sum-norm": op.LossConfig(agg="seq-mean-token-sum-norm", max_len=16, correction={"reject": REJECT}),
    "no correction": op.LossConfig(agg="seq-mean-token-mean"),
}
# rank 0 holds rows 0-4, rank 1 rows 5-11; each splits its rows into two uneven micro-batches
RANKS = [[slice(0, 2), slice(2, 5)], [slice(5, 6), slice(6, 12)]]


def _batch() -> dict[str, torch.Tensor]:
    b = random_batch(seed=11, b=B, t=T, noise=0.4)
    b["mask"][3] = 0  # an empty row
    return b


def _micro(b: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """The rows of one micro-batch, trimmed to their own longest row (micro-batches differ in T)."""
    mask = b["mask"][rows]
    t = max(1, int(mask.sum(dim=-1).max()))
    return {k: v[rows, :t] for k, v in b.items()}


def _step(b, slices, cfg, group_cfg):
    """Loss and gradient of one rank's micro-batches under ``group_cfg``'s denominator."""
    total, grads = torch.zeros(()), []
    for rows in slices:
        mb = _micro(b, rows)
        lp = mb["logprobs"].clone().requires_grad_(True)
        loss, _ = op.policy_loss(lp, mb["old"], mb["adv"], mb["mask"], rollout_logprobs=mb["rollout"], config=group_cfg)
        loss.backward()
        total = total + loss.detach()
        grads.append(torch.nn.functional.pad(lp.grad, (0, T - lp.shape[1])))
    return total, torch.cat(grads)


def _inputs(b, slices):
    return [{"old_logprobs": m["old"], "rollout_logprobs": m["rollout"], "mask": m["mask"]}
            for m in (_micro(b, rows) for rows in slices)]


def _whole(cfg):
    b = _batch()
    lp = b["logprobs"].clone().requires_grad_(True)
    loss, _ = op.policy_loss(lp, b["old"], b["adv"], b["mask"], rollout_logprobs=b["rollout"], config=cfg)
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("name", list(CONFIGS))
def test_micro_batches_add_up_to_the_big_batch(name):
    cfg = CONFIGS[name]
    b = _batch()
    slices = [s for rank in RANKS for s in rank]
    loss, grad = _step(b, slices, cfg, op.with_global_normalizer(cfg, _inputs(b, slices)))
    whole_loss, whole_grad = _whole(cfg)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-8)
    # and the check can fail: each micro-batch's own denominator gives another loss
    local_loss, _ = _step(b, slices, cfg, cfg)
    assert not torch.allclose(local_loss, whole_loss, rtol=1e-3)


def test_the_denominator_counts_what_the_loss_divides_by():
    b = _batch()
    inputs = _inputs(b, [slice(0, B)])
    renorm = op.with_global_normalizer(CONFIGS["token-mean renormalize"], inputs)
    fixed = op.with_global_normalizer(CONFIGS["token-mean fixed"], inputs)
    corr = op.correct(b["old"], b["rollout"], b["mask"], CONFIGS["token-mean renormalize"].correction)
    assert renorm.global_tokens == corr.mask.sum().item() < fixed.global_tokens == b["mask"].sum().item()
    seqs = op.with_global_normalizer(CONFIGS["seq-mean-token-mean"], inputs)
    assert seqs.global_seqs == corr.mask.any(dim=-1).sum().item() and seqs.global_tokens is None


def test_sum_norm_without_max_len_is_refused():
    with pytest.raises(ConfigError, match="max_len"):
        op.with_global_normalizer(op.LossConfig(agg="seq-mean-token-sum-norm"), [{"mask": torch.ones(2, 3)}])


def test_bad_micro_batches_are_named():
    with pytest.raises(ValueError, match="micro-batch 0: .*'mask'"):
        op.with_global_normalizer(op.LossConfig(), [{"old": torch.zeros(2, 3)}])
    with pytest.raises(ValueError, match="no micro-batches"):
        op.with_global_normalizer(op.LossConfig(), [])


def _rank_main(rank: int) -> dict:
    b, out = _batch(), {}
    for name, cfg in CONFIGS.items():
        loss, grad = _step(b, RANKS[rank], cfg, op.with_global_normalizer(cfg, _inputs(b, RANKS[rank])))
        dist.all_reduce(loss)
        out[name] = (loss, grad)
    return out


@pytest.mark.slow
def test_two_gloo_ranks_of_micro_batches_equal_one_batch(tmp_path):
    ranks = on_gloo_ranks(_rank_main, tmp_path)
    for name, cfg in CONFIGS.items():
        whole_loss, whole_grad = _whole(cfg)
        for r in ranks:
            torch.testing.assert_close(r[name][0], whole_loss, rtol=1e-5, atol=1e-7, msg=name)
        grad = torch.cat([ranks[0][name][1], ranks[1][name][1]])
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-8, msg=name)
