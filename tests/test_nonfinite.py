"""Non-finite inputs (docs/specification.md §6) and input validation (docs/specification.md §1): every policy does what it says,
`error` names the tensor and the count, and NaN/inf never reaches the loss."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op

NAN, INF = float("nan"), float("inf")


def batch():
    """Two rows of three valid tokens; μ = π_old except where a test plants a bad value."""
    old = torch.tensor([[-1.0, -2.0, -2.5], [-1.5, -0.7, -2.2]])
    return {"old": old, "rollout": old.clone(), "logprobs": old.clone(), "adv": torch.ones(2, 3), "mask": torch.ones(2, 3)}


TRUNCATE = {"weight": {"level": "token", "mode": "truncate", "high": 2.0}}


def run(b, nonfinite, **extra):
    cfg = op.LossConfig(correction=op.CorrectionConfig(nonfinite=nonfinite, **TRUNCATE), **extra)
    lp = b["logprobs"].clone().requires_grad_(True)
    loss, m = op.policy_loss(lp, b["old"], b["adv"], b["mask"], rollout_logprobs=b["rollout"], config=cfg)
    loss.backward()
    return loss, m, lp.grad


@pytest.mark.parametrize("tensor", ["rollout", "old", "logprobs", "adv"])
def test_error_names_tensor_count_and_position(tensor):
    b = batch()
    b[tensor][0, 1] = NAN
    b[tensor][1, 2] = INF if tensor != "rollout" else -INF
    name = {"rollout": "rollout_logprobs", "old": "old_logprobs", "logprobs": "logprobs", "adv": "advantages"}[tensor]
    with pytest.raises(ValueError, match=rf"{name} has 2 non-finite value\(s\) on valid tokens, first at \(0, 1\)"):
        run(b, "error")


def test_mask_token_drops_only_the_bad_token():
    b = batch()
    b["rollout"][0, 1] = NAN
    loss, m, grad = run(b, "mask_token")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[0, 1] == 0 and (grad[0, [0, 2]] != 0).all()
    assert m["nonfinite_tokens"] == 1
    assert m["masked_fraction"] == pytest.approx(1 / 6)


def test_mask_sequence_drops_the_row():
    b = batch()
    b["old"][1, 0] = -INF
    loss, m, grad = run(b, "mask_sequence")
    assert torch.isfinite(loss)
    assert (grad[1] == 0).all() and (grad[0] != 0).all()
    assert m["masked_fraction"] == pytest.approx(3 / 6)
    assert m["masked_fraction_seq"] == pytest.approx(1 / 2)


def test_neutral_keeps_the_token_with_unit_ratio():
    b = batch()
    b["rollout"][0, 1] = NAN
    b["old"][0, 2] = b["old"][0, 2] + math.log(4.0)  # a real ratio of 4 elsewhere → weight 2
    b["logprobs"][0, 2] = b["old"][0, 2]
    out = op.correct(b["old"], b["rollout"], b["mask"], op.CorrectionConfig(nonfinite="neutral", **TRUNCATE))
    assert out.mask.sum() == 6  # nothing dropped
    assert out.weights[0, 1] == 1.0  # ρ := 1
    assert out.weights[0, 2] == pytest.approx(2.0)
    assert out.metrics["nonfinite_tokens"] == 1


def test_neutral_still_masks_a_bad_loss_input():
    # π_θ or A has no neutral value: the token must leave the loss
    b = batch()
    b["logprobs"][1, 1] = NAN
    b["adv"][0, 0] = INF
    loss, m, grad = run(b, "neutral")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[1, 1] == 0 and grad[0, 0] == 0
    assert m["masked_fraction"] == pytest.approx(2 / 6)


def test_padding_may_hold_anything():
    b = batch()
    b["mask"][0, 2] = 0
    for key in ("old", "rollout", "logprobs", "adv"):
        b[key][0, 2] = NAN
    loss, m, grad = run(b, "error")  # padding is never validated as data
    assert torch.isfinite(loss) and grad[0, 2] == 0


def test_no_correction_still_refuses_nan():
    b = batch()
    b["adv"][1, 1] = NAN
    with pytest.raises(ValueError, match="advantages has 1 non-finite"):
        op.policy_loss(b["logprobs"], b["old"], b["adv"], b["mask"])


# ------------------------------------------------------------------ validation (§1)
def test_shape_mismatch_is_named():
    b = batch()
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(2, 2\) but mask has \(2, 3\)"):
        op.correct(b["old"], b["rollout"][:, :2], b["mask"])


def test_positive_logprob_is_a_bug_upstream():
    b = batch()
    b["old"][1, 2] = 0.5
    with pytest.raises(ValueError, match=r"old_logprobs has 1 positive log-prob\(s\).*first at \(1, 2\)"):
        op.correct(b["old"], b["rollout"], b["mask"])


def test_mask_must_be_binary():
    b = batch()
    b["mask"][0, 0] = 0.5
    with pytest.raises(ValueError, match="mask must be 0/1"):
        op.correct(b["old"], b["rollout"], b["mask"])


def test_empty_batch_is_refused():
    b = batch()
    with pytest.raises(ValueError, match="no valid token"):
        op.correct(b["old"], b["rollout"], torch.zeros(2, 3))


def test_integer_logprobs_are_refused():
    b = batch()
    with pytest.raises(ValueError, match="rollout_logprobs must be a float tensor"):
        op.correct(b["old"], b["rollout"].long(), b["mask"])


def test_half_precision_inputs_are_computed_in_fp32():
    b = batch()
    b["old"][0, 0] = -1.0 + 0.001  # a ratio bf16 cannot resolve on its own grid
    out16 = op.correct(b["old"].bfloat16(), b["rollout"].bfloat16(), b["mask"], TRUNCATE)
    assert out16.weights.dtype == torch.float32 and out16.log_ratio.dtype == torch.float32
    lp = b["logprobs"].bfloat16().requires_grad_(True)
    loss, _ = op.policy_loss(lp, b["old"].bfloat16(), b["adv"].bfloat16(), b["mask"])
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad.float()).all()


RUNGS = ["reference", "eager", "compiled", "triton", "auto"]


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)])
@pytest.mark.parametrize("implementation", RUNGS)
def test_empty_batch_gives_the_documented_error_on_every_rung(shape, implementation):
    """Issue #27 item 8: an empty batch raised aminmax's RuntimeError on the eager rung (and so
    under auto); every rung now raises the reference's ValueError."""
    if implementation == "triton":
        pytest.importorskip("triton", reason="the triton rung needs triton (CPU: its interpreter)")
    z = torch.zeros(shape)
    with pytest.raises(ValueError, match=rf"mask \({shape[0]}, {shape[1]}\) has no valid token"):
        op.policy_loss(z.clone().requires_grad_(True), z, z, z, z, "recommended", implementation=implementation)


def test_loglinear_proximal_refuses_a_trailing_dimension():
    """Issue #27 item 9: versions [B, T, 1] broadcast into expand's RuntimeError; the docstring's ValueError now."""
    lp = torch.full((2, 3), -1.0)
    with pytest.raises(ValueError, match=r"versions \(2, 3, 1\) must be a scalar, \[B\] or \(2, 3\)"):
        op.loglinear_proximal(lp, lp, torch.zeros(2, 3, 1, dtype=torch.long), 2)
