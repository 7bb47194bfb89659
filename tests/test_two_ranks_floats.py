"""The floats a host adapter logs (``offpolicy.integrations.host.host_floats``): a statistic over no
units reads 0, so a host that averages each micro-batch's floats over the step and the ranks (verl,
SkyRL: means; OpenRLHF: token-weighted sums, all-reduced) keeps a number when one micro-batch — e.g.
every micro-batch of a rank whose tokens the correction rejected — has no kept token. The two-rank
runs (tests/test_two_ranks_{skyrl,openrlhf,verl}.py) found the NaN it was before."""

from __future__ import annotations

import math

import torch

import offpolicy as op
from offpolicy.integrations import host

VETO = op.LossConfig(clip_low=0.2, clip_high=0.2, correction=op.CorrectionConfig(
    anchor="old", reject=[{"stat": "ratio", "level": "any_token", "low": 0.1, "high": 10.0}], denominator="fixed"))


def _micro_batch(rejected: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(2, 4, generator=g) - 0.5
    mu = old - (3.0 if rejected else 0.1)  # π_old/μ = e³ > 10: every token rejected
    logprobs = old.clone().requires_grad_()
    _, _, metrics = op.policy_loss(logprobs, old, torch.tensor([[1.0], [-1.0]]).expand(2, 4), torch.ones(2, 4), mu,
                                   VETO, reduce=False)
    return metrics


def test_a_statistic_over_no_kept_token_is_0_and_the_rest_is_kept() -> None:
    metrics = _micro_batch(rejected=True)
    raw = metrics.to_dict()
    assert math.isnan(raw["offpolicy/clip_fraction"])  # the library's value: no kept token anywhere
    floats = host.host_floats(metrics)
    assert floats.keys() == raw.keys()
    assert floats["offpolicy/clip_fraction"] == 0.0 and floats["offpolicy/masked_fraction"] == 1.0
    assert all(floats[k] == v for k, v in raw.items() if not math.isnan(v))
    assert host.host_floats(metrics, prefix="")["clip_fraction"] == 0.0


def test_a_hosts_mean_over_micro_batches_stays_a_number() -> None:
    # verl / SkyRL average each micro-batch's float: with the NaN, one rejected micro-batch made the step NaN
    kept, rejected = host.host_floats(_micro_batch(False)), host.host_floats(_micro_batch(True))
    for key in kept:
        assert math.isfinite((kept[key] + rejected[key]) / 2), key
