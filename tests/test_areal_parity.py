"""Parity with AReaL 1.0.4's own loss: ``areal.utils.functional.functional.ppo_actor_loss_fn``.

Each ``areal:*`` preset is run through ``offpolicy.policy_loss`` (every implementation that
accepts it, the reference included) and through AReaL's function on the same tensors:
π_θ = ``logprobs``, our π_old = AReaL's ``proximal_logprobs``, μ = AReaL's ``old_logprobs``
(behaviour). Loss, gradient w.r.t. π_θ and the surviving mask must agree.

Skips when AReaL is absent. AReaL's package ``__init__`` imports its runtime, so besides
``pip install --no-deps areal==1.0.4`` the import needs four small pure-Python packages:
``pip install --no-deps colorlog tenacity torchdata aiofiles`` (uvloop, hydra-core, omegaconf,
einops, numpy, pyyaml are already dependencies of the stack here).
"""

from __future__ import annotations

import pytest
import torch

import offpolicy as op

from conftest import require_host  # noqa: E402

functional, cli_args = require_host(
    "areal.utils.functional.functional", "areal.api.cli_args",
    why="AReaL 1.0.4 is not importable (install.sh installs it with colorlog tenacity torchdata aiofiles flask)")

# preset -> AReaL rejection_sampling (None = use_decoupled_loss without it)
CASES = {
    "areal:decoupled": None,
    "areal:token_mask": dict(level="token", action="mask", metric="ratio", upper=5.0),
    "areal:token_clamp": dict(level="token", action="clamp", metric="ratio", upper=5.0),
    "areal:seq_mask": dict(level="sequence", action="mask", metric="ratio", agg="mean", upper=5.0),
    "areal:seq_clamp": dict(level="sequence", action="clamp", metric="ratio", agg="mean", upper=5.0),
}


def batch(seed: int, B: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(B, T, generator=g) * 3 - 1.0
    # behaviour log-probs: mostly close, a few far apart so every rule bites on some rows/tokens
    mu = prox + torch.randn(B, T, generator=g) * 0.3
    mu[0, 1] = prox[0, 1] - 2.5  # ρ = e^2.5 ≈ 12 > 5: token rejected / clamped
    mu[1] = prox[1] - 1.9  # geometric mean e^1.9 ≈ 6.7 > 5: row rejected / clamped
    theta = prox + torch.randn(B, T, generator=g) * 0.15
    mu, theta = mu.clamp(max=-1e-3), theta.clamp(max=-1e-3)  # log-probs are ≤ 0
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 6:] = False
    mask[4, 3:] = False
    return theta, prox, mu, adv, mask


def areal_loss(theta, prox, mu, adv, mask, rs):
    theta = theta.clone().requires_grad_(True)
    cfg = None if rs is None else cli_args.RejectionSamplingConfig(**rs)
    loss, stat = functional.ppo_actor_loss_fn(
        logprobs=theta, proximal_logprobs=prox, old_logprobs=mu, advantages=adv, eps_clip=0.2,
        loss_mask=mask.clone(), eps_clip_higher=None, c_clip=None, rejection_sampling=cfg,
    )
    loss.backward()
    kept = stat["behave_mask"] if rs is not None else mask
    return loss.detach(), theta.grad, kept


def ours(theta, prox, mu, adv, mask, preset, implementation):
    theta = theta.clone().requires_grad_(True)
    loss, metrics = op.policy_loss(theta, prox, adv, mask.float(), mu, preset, implementation=implementation)
    loss.backward()
    return loss.detach(), theta.grad, metrics


@pytest.mark.parametrize("preset", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_gradient_and_mask_match_areal(preset, seed):
    theta, prox, mu, adv, mask = batch(seed)
    want_loss, want_grad, want_kept = areal_loss(theta, prox, mu, adv, mask, CASES[preset])
    for impl in ("reference", "auto"):
        loss, grad, _ = ours(theta, prox, mu, adv, mask, preset, impl)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=f"{preset} {impl} loss")
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7, msg=f"{preset} {impl} grad")
    # the mask: a token survives in ours iff its gradient can be nonzero, i.e. AReaL kept it
    corr = op.correct(prox, mu, mask.float(), op.presets.correction(preset))
    torch.testing.assert_close(corr.mask.bool(), want_kept.bool(), msg=f"{preset} mask")


def test_the_cases_exercise_rejection():
    """Guard against a vacuous parity: the batches must make the mask presets drop something."""
    theta, prox, mu, adv, mask = batch(0)
    for preset in ("areal:token_mask", "areal:seq_mask"):
        _, _, kept = areal_loss(theta, prox, mu, adv, mask, CASES[preset])
        assert kept.sum() < mask.sum(), preset


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402


@given(seed=st.integers(0, 2**31 - 1), preset=st.sampled_from(sorted(CASES)),
       spread=st.floats(0.01, 2.0), drift=st.floats(0.0, 0.5))
def test_parity_on_random_batches(seed, preset, spread, drift):
    """Property: for any batch (behaviour drift `spread`, policy drift `drift`) the reference
    implementation gives AReaL's loss and gradient."""
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    prox = -torch.rand(B, T, generator=g) * 4 - 0.5
    mu = (prox + torch.randn(B, T, generator=g) * spread).clamp(max=-1e-3)
    theta = (prox + torch.randn(B, T, generator=g) * drift).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    want_loss, want_grad, _ = areal_loss(theta, prox, mu, adv, mask, CASES[preset])
    loss, grad, _ = ours(theta, prox, mu, adv, mask, preset, "reference")
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
