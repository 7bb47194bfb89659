"""Exact-gradient checks on tabular softmax policies.

Expectations under the sampler μ are computed *exactly* by enumeration: μ is rational, c(y)/N,
and the batch holds each outcome y exactly c(y) times, so a token- or sequence-mean over the
batch *is* E_μ[·]. No Monte Carlo, no tolerance for sampling noise.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import offpolicy as op

TOL = dict(rtol=2e-5, atol=2e-6)  # θ and the exact answer are float64; the library computes in fp32
F64 = torch.float64


# --------------------------------------------------------------- one-step (bandit) policies
def bandit(theta: torch.Tensor, counts: list[int], reward: torch.Tensor):
    """Rows = outcomes replicated by μ's counts; returns the tensors a loss needs ([N, 1])."""
    actions = torch.tensor([a for a, c in enumerate(counts) for _ in range(c)])
    mu = torch.tensor(counts, dtype=torch.float64) / sum(counts)
    logp = torch.log_softmax(theta, -1)[actions].unsqueeze(-1).float()
    rollout = mu.log()[actions].unsqueeze(-1).float()
    adv = reward[actions].unsqueeze(-1).float()
    return logp, rollout, adv, torch.ones_like(logp)


def exact_policy_gradient(theta: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
    """∇_θ of −E_π[R] = −Σ_a π_θ(a) R(a), by autograd on the closed form."""
    theta = theta.detach().clone().requires_grad_(True)
    (-(torch.softmax(theta, -1) * reward).sum()).backward()
    return theta.grad


THETA = torch.tensor([0.3, -0.5, 1.1, 0.0], dtype=F64)
REWARD = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=F64)
COUNTS = [1, 2, 3, 4]  # μ = [0.1, 0.2, 0.3, 0.4]


def grad_of(loss_fn, theta=THETA) -> torch.Tensor:
    theta = theta.detach().clone().requires_grad_(True)
    loss_fn(theta).backward()
    return theta.grad


@pytest.mark.parametrize("kind", ["ppo", "reinforce", "cispo"])
def test_token_is_is_unbiased_at_theta_old(kind):
    # At θ = θ_old, E_μ[(π_old/μ)·∇ℓ] = −Σ_a π(a) R(a) ∇log π(a) = ∇(−E_π[R]); with no truncation
    # and no rejection every loss kind gives exactly the policy gradient.
    corr = op.CorrectionConfig(weight={"level": "token", "mode": "truncate"})  # raw ratio

    def loss(theta):
        lp, rollout, adv, mask = bandit(theta, COUNTS, REWARD)
        return op.policy_loss(lp, lp.detach(), adv, mask, rollout_logprobs=rollout,
                              config=op.LossConfig(kind=kind, correction=corr))[0]

    torch.testing.assert_close(grad_of(loss), exact_policy_gradient(THETA, REWARD), **TOL)


def test_decoupled_ppo_without_clip_is_unbiased_off_theta_old():
    # θ ≠ θ_old: w = π_old/μ and r = π_θ/π_old compose to π_θ/μ (clip disabled) → exact gradient at θ.
    theta_old = THETA + torch.tensor([0.4, 0.1, -0.3, 0.2], dtype=F64)
    corr = op.CorrectionConfig(weight={"level": "token", "mode": "truncate"})
    cfg = op.LossConfig(kind="ppo", clip_low=None, clip_high=None, correction=corr)

    def loss(theta):
        lp, rollout, adv, mask = bandit(theta, COUNTS, REWARD)
        old, _, _, _ = bandit(theta_old, COUNTS, REWARD)
        return op.policy_loss(lp, old.detach(), adv, mask, rollout_logprobs=rollout, config=cfg)[0]

    torch.testing.assert_close(grad_of(loss), exact_policy_gradient(THETA, REWARD), **TOL)


def test_anchor_current_reinforce_is_unbiased_at_any_theta():
    # slime #2084 / verl bypass_pg_is: w = sg(π_θ)/μ, ℓ = −w·A·log π_θ → E_μ = −Σ π_θ R ∇log π_θ
    corr = op.CorrectionConfig(anchor="current", weight={"level": "token", "mode": "truncate"})

    def loss(theta):
        lp, rollout, adv, mask = bandit(theta, COUNTS, REWARD)
        return op.policy_loss(lp, None, adv, mask, rollout_logprobs=rollout,
                              config=op.LossConfig(kind="reinforce", correction=corr))[0]

    torch.testing.assert_close(grad_of(loss), exact_policy_gradient(THETA, REWARD), **TOL)


def test_without_correction_the_gradient_is_biased():
    # The control: ignoring μ ≠ π gives E_μ[−R ∇log π] ≠ ∇(−E_π[R]) — the test above can fail.
    def loss(theta):
        lp, _, adv, mask = bandit(theta, COUNTS, REWARD)
        return op.policy_loss(lp, None, adv, mask, config=op.LossConfig(kind="reinforce"))[0]

    assert not torch.allclose(grad_of(loss), exact_policy_gradient(THETA, REWARD), rtol=1e-2)


def test_truncation_biases_the_gradient():
    corr = op.CorrectionConfig(weight={"level": "token", "mode": "truncate", "high": 1.0})

    def loss(theta):
        lp, rollout, adv, mask = bandit(theta, COUNTS, REWARD)
        return op.policy_loss(lp, lp.detach(), adv, mask, rollout_logprobs=rollout,
                              config=op.LossConfig(kind="reinforce", correction=corr))[0]

    assert not torch.allclose(grad_of(loss), exact_policy_gradient(THETA, REWARD), rtol=1e-2)


# --------------------------------------------------------------- two-step sequences
K = 3
SEQ_COUNTS = torch.tensor([[1, 2, 1], [3, 1, 2], [1, 1, 4]])  # c(y1, y2); μ(seq) = c / 16
SEQ_REWARD = torch.tensor([[1.0, 0.0, -1.0], [2.0, 0.5, 0.0], [-0.5, 1.5, 3.0]], dtype=F64)
THETA1 = torch.tensor([0.2, -0.4, 0.7], dtype=F64)  # logits of y1
THETA2 = torch.tensor([[0.1, 0.5, -0.2], [-0.3, 0.0, 0.4], [0.6, -0.1, 0.2]], dtype=F64)  # logits of y2 | y1


def sequences(theta1, theta2):
    """Rows = every (y1, y2) replicated c(y1, y2) times; [N, 2] tensors."""
    pairs = [(a, b) for a, b in itertools.product(range(K), range(K)) for _ in range(int(SEQ_COUNTS[a, b]))]
    y1 = torch.tensor([a for a, _ in pairs])
    y2 = torch.tensor([b for _, b in pairs])
    mu1 = SEQ_COUNTS.sum(1).double() / SEQ_COUNTS.sum()
    mu2 = SEQ_COUNTS.double() / SEQ_COUNTS.sum(1, keepdim=True)
    lp = torch.stack([torch.log_softmax(theta1, -1)[y1], torch.log_softmax(theta2, -1)[y1, y2]], -1).float()
    rollout = torch.stack([mu1.log()[y1], mu2.log()[y1, y2]], -1).float()
    adv = SEQ_REWARD[y1, y2].unsqueeze(-1).expand(-1, 2).float()
    return lp, rollout, adv, torch.ones_like(lp)


def exact_sequence_gradient():
    t1, t2 = THETA1.clone().requires_grad_(True), THETA2.clone().requires_grad_(True)
    p_seq = torch.softmax(t1, -1)[:, None] * torch.softmax(t2, -1)  # π(y1)·π(y2|y1)
    (-(p_seq * SEQ_REWARD).sum()).backward()
    return torch.cat([t1.grad, t2.grad.flatten()])


def sequence_grad(weight: dict | None) -> torch.Tensor:
    t1, t2 = THETA1.clone().requires_grad_(True), THETA2.clone().requires_grad_(True)
    lp, rollout, adv, mask = sequences(t1, t2)
    corr = op.CorrectionConfig(weight=weight) if weight else None
    cfg = op.LossConfig(kind="reinforce", agg="seq-mean-token-sum", correction=corr)
    loss, _ = op.policy_loss(lp, lp.detach(), adv, mask, rollout_logprobs=rollout if corr else None, config=cfg)
    loss.backward()
    return torch.cat([t1.grad, t2.grad.flatten()])


def test_sequence_is_is_unbiased_for_sequences():
    # w = Π_t π(y_t)/μ(y_t) = π(seq)/μ(seq): E_μ[w·R·Σ_t ∇log π(y_t)] = ∇E_π[R] exactly
    got = sequence_grad({"level": "sequence", "mode": "truncate"})
    torch.testing.assert_close(got, exact_sequence_gradient(), **TOL)


def test_token_is_is_biased_for_sequences():
    # per-token ratios do not compose into π(seq)/μ(seq) for a sequence-level reward
    got = sequence_grad({"level": "token", "mode": "truncate"})
    assert not torch.allclose(got, exact_sequence_gradient(), rtol=1e-2)


def test_truncated_sequence_is_is_biased():
    got = sequence_grad({"level": "sequence", "mode": "truncate", "high": 1.0})
    assert not torch.allclose(got, exact_sequence_gradient(), rtol=1e-2)
