"""SkyRL 0.4.0: the "offpolicy" loss fetched from SkyRL's PolicyLossRegistry and called the way
its worker calls it (advantages pre-scaled by SkyRL's own ``apply_loss_reduction_to_advantages_minibatch``)
gives offpolicy's own loss and gradient, refuses double correction, and returns metrics the
worker puts in its status as ``loss_metrics/offpolicy/...``.

SkyRL 0.4.0 declares Python >= 3.12; on 3.11 ``skyrl/backends/__init__`` (the Tinker backend,
unrelated to the loss) fails at import on a pydantic TypedDict, so we load the real
``skyrl.backends.skyrl_train.utils`` modules under a bare ``skyrl.backends`` package.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

skyrl = pytest.importorskip("skyrl", reason="SkyRL not installed (pip install offpolicy[skyrl]; Python >= 3.12)")

from host_packages import import_skyrl_module  # noqa: E402

try:
    pu = import_skyrl_module()
except ImportError as err:  # a SkyRL dependency missing (ray, jaxtyping, skyrl-gym, ...)
    pytest.skip(f"SkyRL's ppo_utils does not import here: {err}", allow_module_level=True)

from skyrl.train.config.config import AlgorithmConfig, OffPolicyCorrectionConfig, SamplingParams  # noqa: E402

from conftest import fixed_denominator, host_batch, previous_recommended  # noqa: E402

import offpolicy as op  # noqa: E402
from offpolicy.core.config import ConfigError  # noqa: E402
from offpolicy.integrations import skyrl as adapter  # noqa: E402

CONFIGS = {
    "token_tis": op.presets.loss("skyrl:token_tis"),
    "seq_mis": op.presets.loss("skyrl:geometric_mask").model_copy(update={"correction": op.CorrectionConfig(
        reject=[{"stat": "ratio", "level": "geometric", "low": 0.5, "high": 2.0}], denominator="fixed")}),
    "veto": op.presets.loss("skyrl:outlier_mask").model_copy(update={"correction": op.CorrectionConfig(
        reject=[{"stat": "ratio", "level": "any_token", "low": 0.5, "high": 2.0}], denominator="fixed")}),
    # recommended = bypass (anchor rollout: PPO on π_θ/μ); the host fixes the denominator (renormalize is refused)
    "recommended": fixed_denominator(op.presets.loss("recommended")),
    "seq_tis_veto": previous_recommended(),  # the default before the long-response sweep
}


@pytest.fixture(autouse=True)
def _clean_registry():
    if adapter.NAME in pu.PolicyLossRegistry.list_available():
        pu.PolicyLossRegistry.unregister(adapter.NAME)
    yield
    if adapter.NAME in pu.PolicyLossRegistry.list_available():
        pu.PolicyLossRegistry.unregister(adapter.NAME)


def _train_config() -> types.SimpleNamespace:
    # The two sections of SkyRLTrainConfig that configure() touches, with SkyRL's own dataclasses.
    # (A full SkyRLTrainConfig() imports vLLM and installs SkyRL's vLLM patches process-wide — not
    # something to leave behind in a shared pytest process.)
    return types.SimpleNamespace(trainer=types.SimpleNamespace(algorithm=AlgorithmConfig()),
                                 generator=types.SimpleNamespace(sampling_params=SamplingParams()))


def _worker_call(loss_fn, x: dict[str, torch.Tensor], algorithm: AlgorithmConfig):
    # worker.py (0.4.0): the mini-batch's advantages are pre-scaled for loss_reduction, then
    # loss_fn(action_log_probs, old_action_log_probs, advantages, config=..., loss_mask=..., rollout_logprobs=...)
    b, t = x["mask"].shape
    adv = pu.apply_loss_reduction_to_advantages_minibatch(x["adv"], x["mask"], algorithm.loss_reduction, b, t)
    logp = x["logp"].clone().requires_grad_(True)
    loss, metrics = loss_fn(logp, x["old"], adv, config=algorithm, loss_mask=x["mask"], rollout_logprobs=x["mu"])
    loss.backward()
    return loss, metrics, logp.grad


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_grad_equal_offpolicy(name: str) -> None:
    cfg = CONFIGS[name]
    adapter.register(cfg)
    fn = pu.PolicyLossRegistry.get("offpolicy")
    x = host_batch()
    reduction = {"token-mean": "token_mean", "seq-mean-token-mean": "sequence_mean"}[cfg.agg]
    loss, metrics, grad = _worker_call(fn, x, AlgorithmConfig(policy_loss_type="offpolicy", loss_reduction=reduction))
    logp = x["logp"].clone().requires_grad_(True)
    ref, ref_metrics = op.policy_loss(logp, x["old"], x["adv"], x["mask"], x["mu"], cfg, implementation="reference")
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-5, atol=1e-8)
    assert grad.abs().sum() > 0
    if name in ("seq_mis", "veto"):
        assert ref_metrics["masked_fraction"] > 0
    assert metrics["offpolicy/masked_fraction"] == pytest.approx(ref_metrics["masked_fraction"])
    assert metrics["offpolicy/valid_tokens"] == x["mask"].sum().item()


def test_skyrl_s_own_token_tis_equals_the_preset_through_the_adapter() -> None:
    # Differential: SkyRL's "regular" loss with its own token TIS (cap 2) vs offpolicy's
    # skyrl:token_tis preset through the adapter, same pre-scaled batch.
    x = host_batch(1)
    own = AlgorithmConfig(policy_loss_type="regular",
                          off_policy_correction=OffPolicyCorrectionConfig(tis_ratio_type="token"))
    h_loss, h_metrics, h_grad = _worker_call(pu.PolicyLossRegistry.get("regular"), x, own)
    adapter.register("skyrl:token_tis")
    o_loss, o_metrics, o_grad = _worker_call(pu.PolicyLossRegistry.get("offpolicy"), x,
                                             AlgorithmConfig(policy_loss_type="offpolicy"))
    torch.testing.assert_close(o_loss, h_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(o_grad, h_grad, rtol=1e-5, atol=1e-8)


def test_refuses_skyrl_s_own_correction() -> None:
    adapter.register(CONFIGS["token_tis"])
    x = host_batch()
    both = AlgorithmConfig(policy_loss_type="offpolicy",
                           off_policy_correction=OffPolicyCorrectionConfig(sequence_mask_metric="geometric"))
    with pytest.raises(ConfigError, match="corrected twice"):
        _worker_call(pu.PolicyLossRegistry.get("offpolicy"), x, both)
    cfg = _train_config()
    cfg.trainer.algorithm.off_policy_correction.tis_ratio_type = "token"
    with pytest.raises(ConfigError, match="off_policy_correction"):
        adapter.configure(cfg)


def test_refuses_unsupported_configs() -> None:
    with pytest.raises(ConfigError, match="kl_coef"):
        adapter.OffpolicyLoss(op.LossConfig(kl_coef=0.1))
    with pytest.raises(ConfigError, match="renormalize"):
        adapter.OffpolicyLoss(op.LossConfig(correction=op.CorrectionConfig(
            reject=[{"stat": "ratio", "level": "token", "low": 0.5, "high": 2.0}], denominator="renormalize")))


def test_configure_switches_rollout_logprobs_on() -> None:
    adapter.register(CONFIGS["recommended"])
    cfg = _train_config()
    cfg.generator.sampling_params.logprobs = None
    adapter.configure(cfg)
    assert cfg.trainer.algorithm.policy_loss_type == "offpolicy"
    assert cfg.generator.sampling_params.logprobs == 1


def test_registration_is_guarded() -> None:
    first = adapter.register(CONFIGS["recommended"])
    assert adapter.register(CONFIGS["recommended"]) is first  # same config: no-op, no "already registered"
    second = adapter.register("skyrl:token_tis")  # a different config replaces ours
    assert pu.PolicyLossRegistry.get("offpolicy") is second
    pu.PolicyLossRegistry.unregister("offpolicy")
    pu.PolicyLossRegistry.register("offpolicy", lambda *a, **k: None)
    with pytest.raises(ConfigError, match="different loss"):
        adapter.register(CONFIGS["recommended"])


def test_missing_rollout_logprobs_is_an_error() -> None:
    adapter.register(CONFIGS["token_tis"])
    x = host_batch()
    with pytest.raises(RuntimeError, match="sampling_params.logprobs"):
        pu.PolicyLossRegistry.get("offpolicy")(x["logp"], x["old"], x["adv"], config=AlgorithmConfig(),
                                                loss_mask=x["mask"], rollout_logprobs=None)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 5), t=st.integers(1, 9),
       reduction=st.sampled_from(["token_mean", "sequence_mean"]))
def test_property_worker_path_equals_offpolicy(seed: int, b: int, t: int, reduction: str) -> None:
    # For any batch, SkyRL's pre-scaled-advantage sum == offpolicy's own reduction (ℓ is linear in A).
    x = host_batch(seed, b=b + 3, t=t + 2)  # host_batch pads rows 0 and 3 and shifts row 2
    agg = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean"}[reduction]
    cfg = CONFIGS["recommended"].model_copy(update={"agg": agg})
    if adapter.NAME in pu.PolicyLossRegistry.list_available():
        pu.PolicyLossRegistry.unregister(adapter.NAME)
    adapter.register(cfg)
    loss, _, grad = _worker_call(pu.PolicyLossRegistry.get("offpolicy"), x,
                                 AlgorithmConfig(policy_loss_type="offpolicy", loss_reduction=reduction))
    logp = x["logp"].clone().requires_grad_(True)
    ref, _ = op.policy_loss(logp, x["old"], x["adv"], x["mask"], x["mu"], cfg, implementation="reference")
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-5, atol=1e-7)


def test_dump_is_readable_by_diagnose(tmp_path) -> None:
    from offpolicy.integrations.dump import BatchDumper, load_batch

    adapter.register(CONFIGS["token_tis"], dumper=BatchDumper(tmp_path, steps={0}, host="skyrl"))
    x = host_batch()
    _worker_call(pu.PolicyLossRegistry.get("offpolicy"), x, AlgorithmConfig(policy_loss_type="offpolicy"))
    got = load_batch(tmp_path)
    torch.testing.assert_close(got["rollout_logprobs"], x["mu"])
    torch.testing.assert_close(got["old_logprobs"], x["old"])
