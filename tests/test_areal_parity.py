"""Parity with AReaL 1.0.4's own loss: ``areal.utils.functional.functional.ppo_actor_loss_fn``.

Each ``areal:*`` preset is run through ``offpolicy.policy_loss`` (every implementation that
accepts it, the reference included) and through AReaL's function on the same tensors:
π_θ = ``logprobs``, our π_old = AReaL's ``proximal_logprobs``, μ = AReaL's ``old_logprobs``
(behaviour). Loss, gradient w.r.t. π_θ and the surviving mask must agree.

Skips when AReaL is absent. AReaL's package ``__init__`` imports its runtime, so besides
``pip install --no-deps areal==1.0.4`` the import needs four small pure-Python packages:
``pip install --no-deps colorlog tenacity torchdata aiofiles`` (uvloop, hydra-core, omegaconf,
einops, numpy, pyyaml are already dependencies of the stack here), and the package __init__ needs
``flask`` and ``orjson`` (install.sh pins them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math

import pytest
import torch

import offpolicy as op
from offpolicy.core import kernels

from conftest import LazyModule, require_host  # noqa: E402

if importlib.util.find_spec("areal") is None:  # the package's presence only: its __init__ is the expensive part
    pytest.skip("AReaL 1.0.4 is not installed (install.sh installs it with colorlog tenacity torchdata aiofiles "
                "flask)", allow_module_level=True)

# one worker imports AReaL for all of this file's tests: the import (its runtime, from the package __init__)
# costs ~12 s, which every xdist worker paid at collection when it ran at module level
pytestmark = pytest.mark.xdist_group("areal")


@contextlib.contextmanager
def _logging_kept():
    """Logging as it was before, whatever AReaL did to it meanwhile.

    AReaL's ``getLogger`` (areal/utils/logging.py), run by its modules as they import and by its code
    later, replaces ``logging.Logger.root`` and ``logging.Logger.manager`` with new ones and runs
    dictConfig with disable_existing_loggers=True. Left so, ``logging.getLogger(name)`` returns a new
    logger, not the one a module (offpolicy's among them) already holds, and the old ones may be
    disabled: a later test on this xdist worker that reads a logger's records reads nothing."""
    root, manager = logging.Logger.root, logging.Logger.manager
    enabled = [lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger) and not lg.disabled]
    try:
        yield
    finally:
        logging.Logger.root, logging.Logger.manager = root, manager
        for logger in enabled:
            logger.disabled = False


@pytest.fixture(autouse=True)
def _areal_leaves_logging_alone():
    with _logging_kept():
        yield


@functools.cache
def _areal():
    """AReaL's two modules, imported on first use; a failed import skips the test with the reason
    (logging is put back afterwards: :func:`_logging_kept`)."""
    with _logging_kept():
        return require_host("areal.utils.functional.functional", "areal.api.cli_args",
                            why="AReaL 1.0.4 is not importable (install.sh installs it with colorlog tenacity "
                                "torchdata aiofiles flask)")


# AReaL's two modules, imported when a test first reads them (``_areal``)
functional, cli_args = LazyModule(lambda: _areal()[0]), LazyModule(lambda: _areal()[1])

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


# =============================================================================== issue #26
# AReaL's whole loss surface through ``offpolicy.integrations.areal.loss_config``: each setting
# below is what an AReaL user writes (PPOActorConfig fields); the translator gives our config, and
# AReaL's real functions (ppo_actor_loss_fn, sapo_loss_fn, grpo_loss_fn's M2PO masking) give the
# truth. Settings without a meaningful equivalent must be refused (REFUSED, further down).
from offpolicy.integrations import areal as areal_map  # noqa: E402



@functools.cache
def apply_m2po_masking():
    """AReaL's own ``_apply_m2po_masking`` (areal/trainer/ppo/actor.py): importing that module pulls
    AReaL's whole trainer (swanlab, wandb, ...), so its two M2PO functions are read from the
    installed file and run as they are."""
    import ast
    from pathlib import Path

    package = Path(importlib.util.find_spec("areal").submodule_search_locations[0])  # no `import areal`: 8 s
    source = (package / "trainer" / "ppo" / "actor.py").read_text()
    wanted = {"_apply_m2po_masking", "_get_m2po_loss_mask"}
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {node.name for node in tree.body} == wanted, "AReaL's M2PO functions moved"
    namespace = {"torch": torch}
    exec(compile(tree, "areal/trainer/ppo/actor.py", "exec"), namespace)
    return namespace["_apply_m2po_masking"]


def _rs(**kw):
    return {"use_decoupled_loss": True, "rejection_sampling": kw}


DECOUPLED = {"use_decoupled_loss": True}  # AReaL's default is False: rejection sampling and M2PO need it


SETTINGS = {
    # item 1: KL statistics in AReaL's direction (k1 = log ρ, k3 = 1/ρ − 1 + log ρ)
    "k1_token_band": _rs(metric="kl_k1", lower=-0.4, upper=0.5),
    "k1_token_upper": _rs(metric="kl_k1", upper=0.3),
    "k2_token": _rs(metric="kl_k2", upper=0.08),
    "k3_token": _rs(metric="kl_k3", upper=0.05),
    "k3_seq_sum": _rs(metric="kl_k3", level="sequence", agg="sum", upper=1.5),
    "k3_seq_mean": _rs(metric="kl_k3", level="sequence", agg="mean", upper=0.33),
    "k3_seq_max": _rs(metric="kl_k3", level="sequence", agg="max", upper=0.2),
    "k2_seq_max": _rs(metric="kl_k2", level="sequence", agg="max", upper=0.2),
    "k1_seq_mean_band": _rs(metric="kl_k1", level="sequence", agg="mean", lower=-1.0, upper=0.5),
    "k1_seq_sum_band": _rs(metric="kl_k1", level="sequence", agg="sum", lower=-1.0, upper=0.5),
    "k1_seq_max_upper": _rs(metric="kl_k1", level="sequence", agg="max", upper=0.4),
    # item 3: sequence level, agg max (upper only: every token ρ_t ≤ U)
    "ratio_seq_max_mask": _rs(level="sequence", agg="max", upper=2.0),
    "ratio_seq_max_clamp": _rs(level="sequence", agg="max", action="clamp", upper=1.5),
    "ratio_seq_sum_clamp_band": _rs(level="sequence", agg="sum", action="clamp", lower=0.8, upper=1.3),
    "ratio_seq_sum_mask_band": _rs(level="sequence", agg="sum", lower=0.5, upper=2.0),
    "ratio_seq_mean_clamp_band": _rs(level="sequence", agg="mean", action="clamp", lower=0.9, upper=1.1),
    "ratio_token_mask_band": _rs(lower=0.7, upper=1.5),
    "ratio_token_clamp_band": _rs(action="clamp", lower=0.7, upper=1.5),
    # item 4 + 5: GSPO at sequence level (AReaL's sequence form), with clip-higher and the dual clip
    "gspo_seq": dict(importance_sampling_level="sequence", eps_clip=0.05),
    "gspo_seq_dual_clip": dict(importance_sampling_level="sequence", eps_clip=0.05, eps_clip_higher=0.08, c_clip=1.5),
    "gspo_seq_token_rs": dict(importance_sampling_level="sequence", eps_clip=0.1, **DECOUPLED,
                              rejection_sampling=dict(level="token", upper=2.0)),
    "gspo_seq_geo_clamp": dict(importance_sampling_level="sequence", eps_clip=0.1, c_clip=2.0, **DECOUPLED,
                               rejection_sampling=dict(level="sequence", action="clamp", upper=1.2)),
    "ppo_dual_clip_k3": dict(c_clip=1.5, eps_clip_higher=0.28, rejection_sampling=dict(metric="kl_k3", upper=0.1),
                             **DECOUPLED),
    # item 6: SAPO at sequence level (and token level, for contrast); AReaL's SAPO is not decoupled — its
    # default (issue #32: only the fields an AReaL config sets are passed)
    "sapo_seq": dict(use_sapo_loss=True, importance_sampling_level="sequence"),
    "sapo_seq_taus": dict(use_sapo_loss=True, use_decoupled_loss=False, importance_sampling_level="sequence",
                          sapo_tau_pos=2.0, sapo_tau_neg=0.5),
    "sapo_token": dict(use_sapo_loss=True),
    # M2PO with a clamp (one denominator)
    "m2po_clamp": dict(m2_threshold=0.05, rejection_sampling=dict(action="clamp", upper=1.5), **DECOUPLED),
    # issue #32: M2PO with a mask, AReaL's one count (the tokens M2PO keeps): denominator 1 (after the m2 rule)
    "m2po_token_mask": dict(m2_threshold=0.1, rejection_sampling=dict(upper=1.2), **DECOUPLED),
    "m2po_token_mask_band": dict(m2_threshold=0.05, rejection_sampling=dict(lower=0.7, upper=1.3), **DECOUPLED),
    "m2po_seq_mean_mask": dict(m2_threshold=0.1, rejection_sampling=dict(level="sequence", upper=1.1), **DECOUPLED),
    "m2po_gspo_seq_mask": dict(m2_threshold=0.03, importance_sampling_level="sequence", eps_clip=0.1, **DECOUPLED,
                               rejection_sampling=dict(level="sequence", lower=0.8, upper=1.2)),
    # issue #43 item 10: the masks a {mode: mask} weight could not write, now rules counted after M2PO
    "m2po_kl_mask": dict(m2_threshold=0.04, rejection_sampling=dict(metric="kl_k3", upper=0.05), **DECOUPLED),
    "m2po_seq_max_mask": dict(m2_threshold=0.04, rejection_sampling=dict(level="sequence", agg="max", upper=1.5),
                              **DECOUPLED),
    "m2po_gspo_token_mask": dict(m2_threshold=0.04, importance_sampling_level="sequence", eps_clip=0.1, **DECOUPLED,
                                 rejection_sampling=dict(upper=1.3)),
    # decoupled PPO without a behaviour correction, and AReaL's plain default (PPO against μ itself)
    "decoupled_plain": dict(**DECOUPLED),
    "areal_defaults": dict(),
}


def areal_truth(theta, prox, mu, adv, mask, setting):
    """AReaL's loss, gradient and surviving mask, called as grpo_loss_fn calls them."""
    s = {"eps_clip": 0.2, **setting}
    theta = theta.clone().requires_grad_(True)
    loss_mask = mask.clone()
    if s.get("m2_threshold") is not None:
        loss_mask = apply_m2po_masking()(mu, prox, loss_mask, s["m2_threshold"])
    level = s.get("importance_sampling_level", "token")
    if s.get("use_sapo_loss"):
        # not decoupled: AReaL's "old" log-probs are the policy the PPO ratio compares with
        loss, stat = functional.sapo_loss_fn(logprobs=theta, old_logprobs=prox, advantages=adv,
                                             tau_pos=s.get("sapo_tau_pos", 1.0), tau_neg=s.get("sapo_tau_neg", 1.05),
                                             loss_mask=loss_mask, importance_sampling_level=level)
        kept = loss_mask
    else:
        rs = s.get("rejection_sampling")
        cfg = None if rs is None else cli_args.RejectionSamplingConfig(**rs)
        loss, stat = functional.ppo_actor_loss_fn(
            logprobs=theta, proximal_logprobs=prox, old_logprobs=mu, advantages=adv, eps_clip=s["eps_clip"],
            loss_mask=loss_mask, eps_clip_higher=s.get("eps_clip_higher"), c_clip=s.get("c_clip"),
            rejection_sampling=cfg, importance_sampling_level=level)
        kept = stat["behave_mask"] if rs is not None else loss_mask
    loss.backward()
    return loss.detach(), theta.grad, kept.bool()


def ours_areal(theta, prox, mu, adv, mask, setting, implementation="reference"):
    cfg = areal_map.loss_config(**setting)
    if setting.get("rejection_sampling") is not None:  # AReaL's own dataclass (clamp: lower := 0.0) maps the same
        as_object = cli_args.RejectionSamplingConfig(**setting["rejection_sampling"])
        assert areal_map.loss_config(**{**setting, "rejection_sampling": as_object}) == cfg
    theta = theta.clone().requires_grad_(True)
    old = prox
    rollout = None if cfg.correction is None else mu
    loss, _ = op.policy_loss(theta, old, adv, mask.float(), rollout, cfg, implementation=implementation)
    loss.backward()
    if cfg.correction is None:
        return loss.detach(), theta.grad, mask
    # AReaL's behave_mask is its loss_mask after rejection sampling: correct's own surviving mask
    corr = op.correct(prox, mu, mask.float(), cfg.correction)
    return loss.detach(), theta.grad, corr.mask.bool()


def new_batch(seed: int, B: int, T: int, extreme: bool | str = False):
    """Inputs unlike ``batch``: per-token advantages, a fully masked row (B > 2), ragged rows;
    ``extreme``: behaviour log-ratios of ±25 (ρ = e^±25, no clamp in AReaL or the preset);
    "skew": row 0 drifts to log ρ ≈ +0.8 and row 2 to ≈ −0.8, where the two KL directions part
    (k3 = e^0.8 − 1.8 = 0.426 in verl's vs e^−0.8 − 0.2 = 0.249 in AReaL's, and the reverse)."""
    g = torch.Generator().manual_seed(1000 + seed)
    prox = -torch.rand(B, T, generator=g) * 3 - 1.0
    mu = prox + torch.randn(B, T, generator=g) * 0.35
    if extreme == "skew":
        mu[0] = prox[0] - 0.8 + torch.randn(T, generator=g) * 0.05
        mu[2] = prox[2] + 0.8 + torch.randn(T, generator=g) * 0.05
        extreme = False
    theta = prox + torch.randn(B, T, generator=g) * 0.1
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    if B > 2:
        mask[1] = False  # a row with no valid token
    if extreme:
        mu[0, 0] = prox[0, 0] - 25.0
        if T > 1:
            mu[-1, -1] = prox[-1, -1] + 25.0
            mask[-1, -1] = True
    return theta, prox, mu.clamp(max=-1e-3), adv, mask


SHAPES = [(0, 6, 8, False), (1, 1, 5, False), (2, 5, 1, False), (3, 4, 7, True), (4, 1, 1, False), (5, 7, 6, False),
          (6, 5, 6, "skew")]


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("seed,B,T,extreme", SHAPES)
def test_every_areal_mode_matches_its_real_function(name, seed, B, T, extreme):
    setting = SETTINGS[name]
    args = new_batch(seed, B, T, extreme)
    want_loss, want_grad, want_kept = areal_truth(*args, setting)
    # auto only where a fast rung takes the config (gspo / sapo run on the reference either way)
    fast = any(kernels.get(r).supports(areal_map.loss_config(**setting), None) for r in ("eager", "compiled"))
    for impl in ("reference", "auto") if fast else ("reference",):
        loss, grad, kept = ours_areal(*args, setting, impl)
        torch.testing.assert_close(loss, want_loss, rtol=2e-5, atol=1e-6, msg=f"{name} {impl} loss")
        torch.testing.assert_close(grad, want_grad, rtol=2e-5, atol=1e-7, msg=f"{name} {impl} grad")
    if "use_sapo_loss" not in setting:
        torch.testing.assert_close(kept, want_kept, msg=f"{name} mask")


def _variant(cfg: op.LossConfig, **loss_fields) -> op.LossConfig:
    """``cfg`` with loss fields changed, or with every KL rule's direction flipped to verl's."""
    data = cfg.model_dump(exclude_none=True)
    if loss_fields.pop("verl_direction", False):
        for rule in data["correction"]["reject"]:
            if rule.get("direction") == "pi_mu":
                rule["direction"] = "mu_pi"
    return op.LossConfig(**{**data, **loss_fields})


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_setting_exercises_what_it_claims(name):
    """Guard against a vacuous parity: on these batches each setting's rule bites (a mask setting
    drops a token), and the old semantics — verl's KL direction, GSPO-token, token-level SAPO —
    would NOT have matched AReaL (so the new options are what makes the parity hold)."""
    setting = SETTINGS[name]
    cfg = areal_map.loss_config(**setting)
    old = None
    if cfg.kind == "gspo":
        old = _variant(cfg, gspo_form="token")
    elif cfg.kind == "sapo" and cfg.sapo_level == "sequence":
        old = _variant(cfg, sapo_level="token")
    elif cfg.correction is not None and any(getattr(r, "direction", None) == "pi_mu" and r.stat != "k2"
                                            for r in cfg.correction.reject):
        old = _variant(cfg, verl_direction=True)
    bites = old_differs = False
    for shape in SHAPES:
        theta, prox, mu, adv, mask = new_batch(*shape)
        want_loss, want_grad, want_kept = areal_truth(theta, prox, mu, adv, mask, setting)
        bites |= bool(want_kept.sum() < mask.sum())
        if cfg.correction is not None and cfg.correction.weight is not None and cfg.correction.weight.high is not None:
            w = op.correct(prox, mu, mask.float(), cfg.correction).metrics.to_dict()
            bites |= w["offpolicy/fraction_above_high"] > 0 or w.get("offpolicy/fraction_below_low", 0) > 0
        if old is not None:
            theta_g = theta.clone().requires_grad_(True)
            loss, _ = op.policy_loss(theta_g, prox, adv, mask.float(), None if old.correction is None else mu, old,
                                     implementation="reference")
            loss.backward()
            old_differs |= not torch.allclose(theta_g.grad, want_grad, rtol=1e-3, atol=1e-5)
    rejects = cfg.correction is not None and (cfg.correction.reject or cfg.correction.weight is not None)
    assert bites or not rejects, f"{name}: no token rejected or clamped on any batch"
    assert old_differs or old is None, f"{name}: the old semantics match AReaL too; the setting tests nothing new"


REFUSED = {
    # item 2: a lower bound on a divergence keeps the mismatched tokens, drops the on-policy ones
    "k2_lower": (_rs(metric="kl_k2", lower=0.001, upper=0.5), "drops the on-policy tokens"),
    "k3_seq_lower": (_rs(metric="kl_k3", level="sequence", agg="mean", lower=0.01, upper=0.5), "on-policy"),
    # item 3: a lower bound on the row's maximum
    "ratio_seq_max_mask_lower": (_rs(level="sequence", agg="max", lower=0.5, upper=2.0), "ONE token"),
    "ratio_seq_max_clamp_lower": (_rs(level="sequence", agg="max", action="clamp", lower=0.5, upper=2.0), "ONE token"),
    "k1_seq_max_lower": (_rs(metric="kl_k1", level="sequence", agg="max", lower=-0.5, upper=0.5), "ONE token"),
    # AReaL quirks: a KL threshold used as a ratio clamp; a non-monotone sequence clamp; two denominators
    "k2_clamp": (_rs(metric="kl_k2", action="clamp", upper=0.5), "clamps the RATIO"),  # AReaL's config refuses it too
    "ratio_seq_sum_clamp_lower_above_1": (_rs(level="sequence", agg="sum", action="clamp", lower=1.1, upper=2.0),
                                          "not monotone"),
    "sapo_decoupled": (dict(use_sapo_loss=True, use_decoupled_loss=True), "use_decoupled_loss"),
    # AReaL ignores them without the decoupled loss (π_prox is μ): a silent no-op is refused
    "rs_not_decoupled": (dict(rejection_sampling=dict(upper=2.0)), "AReaL ignores it there"),
    "m2po_not_decoupled": (dict(m2_threshold=0.04), "AReaL ignores it there"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_settings_without_a_meaningful_equivalent_are_refused_with_the_reason(name):
    setting, why = REFUSED[name]
    with pytest.raises(op.ConfigError, match=why):
        areal_map.loss_config(**setting)
    # and AReaL really accepts the ones it accepts (the refusal is ours, not a typo in the setting)
    if name == "k2_clamp":
        with pytest.raises(ValueError, match="only supports metric='ratio'"):
            cli_args.RejectionSamplingConfig(**setting["rejection_sampling"])
    elif "use_sapo_loss" not in setting and "rejection_sampling" in setting:
        rs = cli_args.RejectionSamplingConfig(**setting["rejection_sampling"])
        with pytest.raises(op.ConfigError, match=why):  # AReaL's dataclass is refused the same way
            areal_map.loss_config(**{**setting, "rejection_sampling": rs})


# the issue #26 presets are the translator's output for their AReaL setting (checked above)
PRESET_SETTINGS = {
    "areal:token_mask_kl_k3": _rs(metric="kl_k3", upper=0.5),
    "areal:seq_mask_max": _rs(level="sequence", agg="max", upper=5.0),
    "areal:gspo": dict(importance_sampling_level="sequence", **DECOUPLED),
}


def test_the_translators_defaults_are_ppo_actor_configs():
    """Issue #32 item 9: every keyword of ``loss_config`` that is a PPOActorConfig field defaults to AReaL's
    default (use_decoupled_loss was True here, False there), so an AReaL user passes what their config sets."""
    import dataclasses
    import inspect

    fields = {f.name: f for f in dataclasses.fields(cli_args.PPOActorConfig)}
    shared = [p for p in inspect.signature(areal_map.loss_config).parameters.values() if p.name in fields]
    assert {p.name for p in shared} >= {"eps_clip", "eps_clip_higher", "c_clip", "rejection_sampling",
                                        "importance_sampling_level", "use_decoupled_loss", "m2_threshold",
                                        "use_sapo_loss", "sapo_tau_pos", "sapo_tau_neg"}
    for param in shared:
        field = fields[param.name]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        assert param.default == default, param.name
    assert areal_map.loss_config().correction is None  # AReaL's default: PPO against μ, nothing to correct
    assert areal_map.loss_config(use_sapo_loss=True).kind == "sapo"  # its ordinary SAPO setup


@pytest.mark.parametrize("preset", sorted(PRESET_SETTINGS))
def test_new_presets_match_areal(preset):
    cfg = op.LossConfig.from_preset(preset)
    for shape in SHAPES[:4] + SHAPES[-1:]:
        theta, prox, mu, adv, mask = new_batch(*shape)
        want_loss, want_grad, _ = areal_truth(theta, prox, mu, adv, mask, PRESET_SETTINGS[preset])
        theta = theta.clone().requires_grad_(True)
        loss, _ = op.policy_loss(theta, prox, adv, mask.float(), mu, cfg)
        loss.backward()
        torch.testing.assert_close(loss.detach(), want_loss, rtol=2e-5, atol=1e-6, msg=preset)
        torch.testing.assert_close(theta.grad, want_grad, rtol=2e-5, atol=1e-7, msg=preset)


@pytest.mark.parametrize("name", ["ratio_token_mask_band", "ratio_seq_sum_mask_band", "ratio_seq_mean_clamp_band",
                                  "gspo_seq_token_rs"])
def test_nonfinite_behaviour_logprobs_with_neutral(name):
    """AReaL sets a non-finite log ρ to 0 (weight 1, token kept) for the ratio metric; the
    translator's ``nonfinite='neutral'`` does the same (μ = −inf and NaN on valid tokens)."""
    theta, prox, mu, adv, mask = new_batch(0, 6, 8)
    mu[0, 0], mu[3, 2], mask[3, 2] = float("-inf"), float("nan"), True
    setting = SETTINGS[name]
    want_loss, want_grad, _ = areal_truth(theta, prox, mu, adv, mask, setting)
    theta = theta.clone().requires_grad_(True)
    loss, _ = op.policy_loss(theta, prox, adv, mask.float(), mu, areal_map.loss_config(**setting, nonfinite="neutral"))
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(theta.grad, want_grad, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["m2po_token_mask", "m2po_seq_mean_mask", "m2po_kl_mask"])
def test_m2po_with_a_mask_keeps_areals_one_count(name):
    """Guard for the M2PO + mask settings above: both rules counted after BOTH (renormalize) or before
    both (fixed) would not match; AReaL divides by the tokens M2PO keeps (``denominator: 1``), so the
    parity above tests the count, not a coincidence."""
    setting = SETTINGS[name]
    cfg = areal_map.loss_config(**setting)
    assert cfg.correction.denominator == 1 and len(cfg.correction.reject) == 2
    differs = {"fixed": False, "renormalize": False}
    for shape in SHAPES:
        theta, prox, mu, adv, mask = new_batch(*shape)
        want, _, _ = areal_truth(theta, prox, mu, adv, mask, setting)
        for denominator in differs:
            data = cfg.model_dump(exclude_none=True)
            data["correction"]["denominator"] = denominator
            loss, _ = op.policy_loss(theta, prox, adv, mask.float(), mu, op.LossConfig(**data))
            differs[denominator] |= not torch.allclose(loss, want, rtol=1e-4, atol=1e-6)
    assert all(differs.values()), differs


@pytest.mark.parametrize("implementation", ["auto", "reference", "eager", "compiled"])
def test_m2po_sequence_mask_drops_the_token_areal_drops(implementation):
    """Issue #43 item 10: M2PO + a sequence mask (agg mean, upper 1.5) on a one-token batch whose
    ratio is 1.8. AReaL's loss_mask drops the token while M2PO keeps it (the count stays 1): loss 0,
    gradient 0, and ``correct``'s surviving mask and masked_fraction say the token is gone (the
    mask-as-weight translation kept it, with weight 0)."""
    setting = dict(m2_threshold=0.04, rejection_sampling=dict(level="sequence", action="mask", metric="ratio",
                                                              agg="mean", upper=1.5), **DECOUPLED)
    cfg = areal_map.loss_config(**setting)
    prox = torch.tensor([[-1.0]])
    mu, theta, adv, mask = prox - math.log(1.8), prox + 0.05, torch.tensor([[1.0]]), torch.tensor([[True]])
    want_loss, want_grad, want_kept = areal_truth(theta, prox, mu, adv, mask, setting)
    assert not want_kept.any()  # AReaL drops it; M2PO alone keeps it (it never masks the last token)
    assert apply_m2po_masking()(mu, prox, mask.clone(), 0.04).all()
    if implementation not in ("auto", "reference"):  # the fast rungs cannot count after the first rule
        assert not kernels.get(implementation).supports(cfg, None)
        with pytest.raises(ValueError, match="does not cover"):
            ours_areal(theta, prox, mu, adv, mask, setting, implementation)
        return
    loss, grad, kept = ours_areal(theta, prox, mu, adv, mask, setting, implementation)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)
    assert torch.equal(kept, want_kept)
    corr = op.correct(prox, mu, mask.float(), cfg.correction)
    metrics = corr.metrics.to_dict()
    assert metrics["offpolicy/masked_fraction"] == 1.0 and corr.count_mask.tolist() == [[1.0]]
    per_token, count_mask, _ = op.policy_loss(theta, prox, adv, mask.float(), mu, cfg, reduce=False)
    assert count_mask.tolist() == [[1.0]] and per_token.tolist() == [[0.0]]


def test_an_integer_denominator_counts_after_the_first_rules():
    """``denominator: n`` counts the tokens left after the first n rules; 0 and len(reject) are written
    ``fixed`` / ``renormalize`` (one spelling for every rung), other numbers are refused with the range;
    ``with_global_normalizer`` counts the same tokens ``policy_loss`` divides by."""
    rules = [{"stat": "m2", "high": 0.04}, {"stat": "ratio", "level": "geometric", "high": 1.5}]
    assert op.CorrectionConfig(reject=rules, denominator=0).denominator == "fixed"
    assert op.CorrectionConfig(reject=rules, denominator=2).denominator == "renormalize"
    with pytest.raises(ValueError, match=r"must lie in 0\.\.2"):
        op.CorrectionConfig(reject=rules, denominator=3)
    cfg = areal_map.loss_config(m2_threshold=0.04, rejection_sampling=dict(level="sequence", upper=1.1), **DECOUPLED)
    theta, prox, mu, adv, mask = new_batch(0, 6, 8)
    counted = op.correct(prox, mu, mask.float(), cfg.correction).count_mask
    glob = op.with_global_normalizer(cfg, [{"mask": mask.float(), "old_logprobs": prox, "rollout_logprobs": mu}])
    assert glob.global_tokens == counted.sum().item() > op.correct(prox, mu, mask.float(), cfg.correction).mask.sum()


def test_m2po_with_a_mask_resolves_for_a_step():
    """``resolve_thresholds`` reads M2PO's cut with the rules before it only (no rule: fewer than the
    count after the m2 rule names) and keeps ``denominator: 1``; on one micro-batch the step's config
    gives AReaL's loss, as the per-call one does."""
    setting = SETTINGS["m2po_seq_mean_mask"]
    cfg = areal_map.loss_config(**setting)
    theta, prox, mu, adv, mask = new_batch(0, 6, 8)
    fixed = op.resolve_thresholds(cfg, [{"mask": mask.float(), "old_logprobs": prox, "rollout_logprobs": mu}])
    assert fixed.correction.denominator == 1 and fixed.correction.reject[0].stat == "k2"
    want, _, _ = areal_truth(theta, prox, mu, adv, mask, setting)
    loss, _ = op.policy_loss(theta, prox, adv, mask.float(), mu, fixed)
    torch.testing.assert_close(loss, want, rtol=2e-5, atol=1e-6)
