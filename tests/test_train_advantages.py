"""GRPO advantages (issue #43 item 1): a group whose rewards are all equal has advantage exactly 0 —
whatever float value they share, float32 or float64 — so the zero-advantage skip of ``train/loop.py``
fires; groups with a real spread keep (r − mean) / (std + ε)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from offpolicy.train.advantages import grpo_advantages


def reference(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """The textbook formula in float64, for groups with a real spread."""
    g = rewards.double().view(-1, group_size)
    return ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps)).view(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [0.7, 0.1, 0.3, 0.9, 1 / 3, -2.6, 1e6 + 0.1, 0.0])
@pytest.mark.parametrize("group_size", [2, 3, 8, 16])
def test_a_group_of_equal_rewards_has_advantage_exactly_zero(dtype, value, group_size):
    # at 3be706e a float32 0.7 shared by 8 rows gave +0.056 on every row: the mean rounds off, the std is 0
    rewards = torch.full((2 * group_size,), value, dtype=dtype)
    advantages = grpo_advantages(rewards, group_size)
    assert advantages.dtype == dtype
    assert torch.equal(advantages, torch.zeros_like(rewards))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tied_group_beside_a_graded_one(dtype):
    rewards = torch.tensor([0.7] * 8 + [0.0, 0.5, 1.0, 0.5, 0.7, 0.7, 0.7, 0.7], dtype=dtype)
    advantages = grpo_advantages(rewards, 8)
    assert torch.equal(advantages[:8], torch.zeros(8, dtype=dtype))
    torch.testing.assert_close(advantages[8:].double(), reference(rewards[8:], 8), rtol=1e-6, atol=1e-6)


def test_rewards_equal_up_to_rounding_are_a_tie():
    # a partial-credit reward summed in another order: 0.1 + 0.2 is 0.30000000000000004, one ulp from 0.3
    rewards = torch.tensor([0.1 + 0.2, 0.3, 0.3, 0.2 + 0.1], dtype=torch.float64)
    assert torch.equal(grpo_advantages(rewards, 4), torch.zeros(4, dtype=torch.float64))
    one_ulp = torch.tensor([0.7, 0.7, 0.7, 0.7], dtype=torch.float32)
    one_ulp[0] = torch.nextafter(one_ulp[0], torch.tensor(1.0))
    assert torch.equal(grpo_advantages(one_ulp, 4), torch.zeros(4))
    # a spread well above rounding is a signal, however small against ε: the usual formula
    small = torch.tensor([0.7, 0.7, 0.7, 0.70001], dtype=torch.float64)
    torch.testing.assert_close(grpo_advantages(small, 4), reference(small, 4), rtol=1e-9, atol=1e-12)
    assert (grpo_advantages(small, 4)[:3] < 0).all() and grpo_advantages(small, 4)[3] > 0


def test_a_non_finite_reward_is_refused():
    with pytest.raises(ValueError, match=r"rewards: 1 non-finite value\(s\) at rows \[2\]"):
        grpo_advantages(torch.tensor([0.0, 1.0, float("nan"), 1.0]), 2)


rewards_of = st.floats(-10.0, 10.0, allow_nan=False, width=32)


@given(value=rewards_of, size=st.integers(2, 16), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_any_shared_value_gives_zero(value, size, dtype):
    assert torch.equal(grpo_advantages(torch.full((size,), value, dtype=dtype), size), torch.zeros(size, dtype=dtype))


@given(values=st.lists(rewards_of, min_size=2, max_size=12), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_a_graded_group_follows_the_formula_and_a_tied_one_is_zero(values, dtype):
    rewards = torch.tensor(values, dtype=dtype)
    advantages = grpo_advantages(rewards, len(values))
    spread = (rewards.max() - rewards.min()).item()
    if spread <= 4 * torch.finfo(dtype).eps * rewards.abs().max().item():
        assert torch.equal(advantages, torch.zeros_like(advantages))
    else:
        torch.testing.assert_close(advantages.double(), reference(rewards, len(values)),
                                   rtol=1e-5 if dtype == torch.float32 else 1e-9, atol=1e-5)
        assert advantages.min() < 0 < advantages.max()  # a real spread: both signs, never one
