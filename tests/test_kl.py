"""KL estimators: values by hand, and which KL each one's gradient follows — exactly, by
enumerating a tabular policy (E_π[∇k(y)] = Σ_y sg(π(y))·∇k(y))."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op

F64 = torch.float64
THETA = torch.tensor([0.5, -1.0, 0.2, 1.3, -0.4], dtype=F64)
REF = torch.log_softmax(torch.tensor([0.0, 0.3, -0.6, 0.9, 0.1], dtype=F64), -1)


def expected_grad_of_estimator(kind: str) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    k = op.kl_penalty(logp.unsqueeze(0).float(), REF.unsqueeze(0).float(), kind)[0]
    (torch.softmax(theta, -1).detach().float() * k).sum().backward()
    return theta.grad


def grad_of(kl_fn) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    kl_fn(torch.log_softmax(theta, -1)).backward()
    return theta.grad


REVERSE = grad_of(lambda logp: (logp.exp() * (logp - REF)).sum())  # ∇ KL(π ‖ ref)
FORWARD = grad_of(lambda logp: (REF.exp() * (REF - logp)).sum())  # ∇ KL(ref ‖ π)
TOL = dict(rtol=1e-5, atol=1e-6)


def test_k2_gradient_is_the_reverse_kl_gradient():
    torch.testing.assert_close(expected_grad_of_estimator("k2"), REVERSE, **TOL)


def test_k3_as_a_loss_follows_the_forward_kl():
    # E_π[∇k3] = E_π[(1 − ref/π)∇log π] = −Σ ref ∇log π = ∇ KL(ref ‖ π): the *other* direction
    torch.testing.assert_close(expected_grad_of_estimator("k3"), FORWARD, **TOL)
    assert not torch.allclose(FORWARD, REVERSE, rtol=1e-2)


def test_k1_gradient_vanishes_in_expectation():
    torch.testing.assert_close(expected_grad_of_estimator("k1"), torch.zeros(5, dtype=F64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["k1+", "k2+", "k3+"])
def test_straight_through_variants_have_k2_gradient(kind):
    torch.testing.assert_close(expected_grad_of_estimator(kind), REVERSE, **TOL)


def test_values_by_hand():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    x = [0.5, -1.0]  # lp − ref
    torch.testing.assert_close(op.kl_penalty(lp, ref, "k1"), torch.tensor([x]))
    torch.testing.assert_close(op.kl_penalty(lp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    k3 = [math.exp(-v) + v - 1 for v in x]  # exp(ref − lp) − (ref − lp) − 1
    torch.testing.assert_close(op.kl_penalty(lp, ref, "k3"), torch.tensor([k3]))
    # the + variants carry the named value
    torch.testing.assert_close(op.kl_penalty(lp, ref, "k3+"), torch.tensor([k3]))
    torch.testing.assert_close(op.kl_penalty(lp, ref, "k1+"), torch.tensor([x]))


def test_k3_value_is_clamped():
    big = op.kl_penalty(torch.tensor([[-50.0]]), torch.tensor([[-1.0]]), "k3")
    assert big.item() == 10.0


def test_unknown_kind_and_shape_errors():
    with pytest.raises(ValueError, match="unknown kind 'k4'"):
        op.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(ValueError, match="differ in shape"):
        op.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3))
