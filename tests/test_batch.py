"""``to_batch`` (issue #49: one masked write per tensor instead of a loop over the rows) against the
row-by-row construction it replaced, written out here as the readable reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.engines import Rollouts
from offpolicy.policy.batch import TENSORS, to_batch


def row_by_row(rollouts: Rollouts, pad_id: int) -> tuple[torch.Tensor, ...]:
    """The ``[B, L]`` / ``[B, T]`` tensors one row at a time (docs/specification.md's batch layout)."""
    rows = len(rollouts)
    width = max(len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids))
    t_max = max(1, max(len(r) for r in rollouts.response_ids))
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    positions = torch.zeros((rows, t_max), dtype=torch.long)
    response = torch.full((rows, t_max), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, t_max))
    logprobs = torch.zeros((rows, t_max))
    for i, (prompt, resp, lps) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.logprobs)):
        seq = prompt + resp
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        positions[i] = torch.arange(len(prompt) - 1, len(prompt) - 1 + t_max).clamp(max=width - 1)
        if resp:
            response[i, : len(resp)] = torch.tensor(resp)
            mask[i, : len(resp)] = 1
            logprobs[i, : len(resp)] = torch.tensor(lps, dtype=torch.float32)
    versions = torch.full((rows,), rollouts.version, dtype=torch.long)
    return input_ids, attention, positions, response, mask, logprobs, versions


rows = st.lists(st.tuples(st.lists(st.integers(0, 60), min_size=1, max_size=7),
                          st.lists(st.tuples(st.integers(0, 60), st.floats(-30.0, 0.0)), max_size=9)),
                min_size=1, max_size=10)


@settings(max_examples=200, deadline=None)
@given(rows=rows, pad=st.integers(0, 3), version=st.integers(0, 5))
def test_to_batch_is_the_row_by_row_construction(rows, pad, version):
    rollouts = Rollouts([p for p, _ in rows], [[t for t, _ in r] for _, r in rows],
                        [[lp for _, lp in r] for _, r in rows], [True] * len(rows), version=version)
    batch = to_batch(rollouts, pad)
    for name, expected in zip(TENSORS, row_by_row(rollouts, pad)):
        got = getattr(batch, name)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name


def test_a_row_whose_logprobs_do_not_match_its_tokens_is_refused():
    """Two rows off by one in opposite directions add up to the right total: still refused, by row."""
    rollouts = Rollouts([[1], [1]], [[5, 6], [5, 6]], [[-1.0], [-1.0, -2.0, -3.0]], [True, True], version=0)
    with pytest.raises(ValueError, match="rollout row 0: 2 response tokens but 1 log-probs"):
        to_batch(rollouts, 0)
