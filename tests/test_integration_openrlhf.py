"""OpenRLHF 0.11.2: OffpolicyPolicyLoss called the way ppo_actor.training_step calls PolicyLoss
gives offpolicy's own loss and gradient, refuses double correction, and reports metrics.

``openrlhf.models/__init__`` imports the actor (DeepSpeed, flash-attn: GPU-only packages); the
loss lives in ``openrlhf/models/loss.py`` + ``utils.py``, which need only torch and, at import,
``deepspeed`` (utils.py, unused by the loss). Without DeepSpeed/flash-attn we load those two real
files under a bare ``openrlhf.models`` package with an inert ``deepspeed`` placeholder — the loss
code that runs is OpenRLHF's own.
"""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

openrlhf = pytest.importorskip("openrlhf", reason="OpenRLHF not installed (pip install offpolicy[openrlhf])")

from conftest import fixed_denominator, host_batch, previous_recommended  # noqa: E402
from host_packages import import_openrlhf_loss  # noqa: E402

import offpolicy as op  # noqa: E402
from offpolicy.core.config import ConfigError  # noqa: E402


try:
    host_loss = import_openrlhf_loss()
except ImportError as err:  # a dependency of openrlhf/models/{loss,utils}.py missing
    pytest.skip(f"OpenRLHF's openrlhf.models.loss does not import here: {err}", allow_module_level=True)
from offpolicy.integrations import openrlhf as adapter  # noqa: E402

CONFIGS = {
    "token_tis": op.presets.loss("openrlhf:tis"),
    "seq_mis": op.presets.loss("openrlhf:seq-mask-tis"),
    "veto": op.LossConfig(correction=op.CorrectionConfig(
        reject=[{"stat": "ratio", "level": "any_token", "low": 0.5, "high": 2.0}], denominator="fixed")),
    # recommended = bypass (anchor rollout: PPO on π_θ/μ); the host fixes the denominator (renormalize is refused)
    "recommended": fixed_denominator(op.presets.loss("recommended")),
    "seq_tis_veto": previous_recommended(),  # the default before the long-response sweep
}


def _batch(seed: int = 0, b: int = 6, t: int = 7) -> dict[str, torch.Tensor]:
    return host_batch(seed, b, t, noise=0.6)  # wide: the veto and bands reject rows


def _host_call(fn: torch.nn.Module, x: dict[str, torch.Tensor], **batch_info):
    # ppo_actor.ActorPPOTrainer.training_step (0.11.2): positional π_θ, π_old, A; keywords after.
    logp = x["logp"].clone().requires_grad_(True)
    out = fn(logp, x["old"], x["adv"], action_mask=x["mask"], rollout_log_probs=x["mu"], **batch_info)
    out[0].backward()
    return out, logp.grad


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_grad_equal_offpolicy(name: str) -> None:
    cfg = CONFIGS[name]
    x = _batch()
    fn = adapter.OffpolicyPolicyLoss(clip_eps_low=cfg.clip_low, clip_eps_high=cfg.clip_high,
                                     token_level_loss=cfg.agg == "token-mean", loss_config=cfg)
    assert isinstance(fn, host_loss.PolicyLoss)
    out, grad = _host_call(fn, x)
    assert len(out) == 5  # the arity ppo_actor unpacks
    logp = x["logp"].clone().requires_grad_(True)
    ref, metrics = op.policy_loss(logp, x["old"], x["adv"], x["mask"], x["mu"], cfg, implementation="reference")
    ref.backward()
    torch.testing.assert_close(out[0], ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-6, atol=1e-8)
    assert grad.abs().sum() > 0
    if name in ("seq_mis", "veto"):  # the test batch must exercise the rejection
        assert metrics["masked_fraction"] > 0
        assert out[4].item() >= metrics["masked_fraction"] - 1e-6
    assert fn.pop_metrics()["offpolicy/valid_tokens"] == x["mask"].sum().item()


def test_global_batch_normalisation_is_openrlhf_s() -> None:
    # With batch_num_tokens (the global count over ranks and micro-batches), OpenRLHF's
    # aggregate_loss is Σ ℓ_t m_t / N · dp_size; offpolicy's global_tokens gives Σ ℓ_t m_t / N.
    cfg = CONFIGS["token_tis"]
    x = _batch(1)
    fn = adapter.OffpolicyPolicyLoss(loss_config=cfg)
    out, grad = _host_call(fn, x, dp_size=2, batch_num_tokens=100.0)
    logp = x["logp"].clone().requires_grad_(True)
    global_cfg = cfg.model_copy(update={"global_tokens": 100.0})
    ref, _ = op.policy_loss(logp, x["old"], x["adv"], x["mask"], x["mu"], global_cfg, implementation="reference")
    (2 * ref).backward()
    torch.testing.assert_close(out[0], 2 * ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-6, atol=1e-8)


def test_host_without_correction_matches_offpolicy_without_correction() -> None:
    # Differential check of the contract itself: OpenRLHF's plain PPO == offpolicy's plain PPO.
    x = _batch(2)
    host = host_loss.PolicyLoss()
    ours = adapter.OffpolicyPolicyLoss(loss_config=op.LossConfig())
    (h, *_), gh = _host_call(host, x)
    (o, *_), go = _host_call(ours, x)
    torch.testing.assert_close(o, h, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(go, gh, rtol=1e-6, atol=1e-8)


def test_refuses_openrlhf_s_own_correction() -> None:
    with pytest.raises(ConfigError, match="is_correction_level=token"):
        adapter.OffpolicyPolicyLoss(is_correction_level="token", loss_config=CONFIGS["token_tis"])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"clip_eps_high": 0.28}, "eps_clip_low_high"),
    ({"policy_loss_type": "gspo"}, "policy_loss_type"),
])
def test_refuses_host_arguments_that_disagree(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        adapter.OffpolicyPolicyLoss(loss_config=op.LossConfig(correction=CONFIGS["token_tis"].correction), **kwargs)


def test_refuses_missing_rollout_logprobs() -> None:
    x = _batch()
    fn = adapter.OffpolicyPolicyLoss(loss_config=CONFIGS["token_tis"])
    with pytest.raises(RuntimeError, match="setup_worker"):
        fn(x["logp"], x["old"], x["adv"], action_mask=x["mask"], rollout_log_probs=None)


def test_metrics_reach_the_status_dict() -> None:
    # training_step's status layout (0.11.2): {"metrics": {k: tensor}, "weights": {k: ...}}.
    x = _batch()
    fn = adapter.OffpolicyPolicyLoss(loss_config=CONFIGS["veto"])
    _host_call(fn, x)
    _host_call(fn, _batch(3))
    status = adapter.add_metrics_to_status({"metrics": {"policy_loss": torch.tensor(0.0)},
                                            "weights": {"policy_loss": "token"}}, fn)
    assert status["metrics"]["offpolicy/valid_tokens"].item() == x["mask"].sum().item() + _batch(3)["mask"].sum().item()
    assert status["weights"]["offpolicy/masked_fraction"] == "token"
    assert "offpolicy/is_mean" in status["metrics"]
    assert fn.pop_metrics() == {}  # consumed once


def test_install_replaces_policyloss_and_forces_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    import openrlhf.models as models

    monkeypatch.setattr(models, "PolicyLoss", host_loss.PolicyLoss, raising=False)
    monkeypatch.setattr(host_loss, "PolicyLoss", host_loss.PolicyLoss)
    monkeypatch.setattr(adapter.OffpolicyPolicyLoss, "loss_config", None)
    monkeypatch.setenv(adapter.ENV_LOSS, "openrlhf:icepop")
    done = adapter.install(None)
    assert "openrlhf.models.PolicyLoss" in done
    assert models.PolicyLoss is adapter.OffpolicyPolicyLoss
    assert adapter.OffpolicyPolicyLoss.loss_config == op.presets.loss("openrlhf:icepop")
    # the rollout-log-prob switches, on stand-ins with the 0.11.2 signatures
    seen = {}
    sp = adapter._forced_sampling_params(lambda **kw: seen.update(kw))
    sp(temperature=1.0, logprobs=None)
    assert seen["logprobs"] == 1

    def create_vllm_engines(num_engines, tensor_parallel_size, pretrain, seed, full_determinism,
                            enable_prefix_caching, enforce_eager, max_model_len, shared_pg=None,
                            gpu_memory_utilization=None, vllm_enable_sleep=False, logprobs_mode=None,
                            agent_func_path=None, remote_rm_url=None, max_images_per_prompt=0):
        return logprobs_mode

    assert adapter._forced_create_vllm_engines(create_vllm_engines)(*range(11), None) == "processed_logprobs"


def test_runtime_env_carries_the_config() -> None:
    env = adapter.runtime_env(CONFIGS["veto"])
    assert env["worker_process_setup_hook"] == "offpolicy.integrations.openrlhf.setup_worker"
    assert adapter.resolve_config(env["env_vars"][adapter.ENV_LOSS]) == CONFIGS["veto"]
    assert adapter.runtime_env("recommended")["env_vars"][adapter.ENV_LOSS] == "recommended"


def test_dump_is_readable_by_diagnose(tmp_path) -> None:
    from offpolicy.integrations.dump import BatchDumper, load_batch

    x = _batch()
    fn = adapter.OffpolicyPolicyLoss(loss_config=CONFIGS["token_tis"],
                                     dumper=BatchDumper(tmp_path, steps={0}, host="openrlhf"))
    _host_call(fn, x)
    got = load_batch(tmp_path)
    torch.testing.assert_close(got["rollout_logprobs"], x["mu"])
    torch.testing.assert_close(got["old_logprobs"], x["old"])


def test_refuses_renormalize_since_openrlhf_fixes_the_denominator() -> None:
    with pytest.raises(ConfigError, match="renormalize"):
        adapter.OffpolicyPolicyLoss(loss_config=op.presets.loss("recommended"))


@pytest.mark.parametrize(("mode", "preset"), [("clip", "openrlhf:tis"), ("mask", "openrlhf:icepop")])
def test_openrlhf_s_own_correction_equals_the_preset_through_the_adapter(mode: str, preset: str) -> None:
    # Differential against the host's own math: PolicyLoss(is_correction_level=token, mode) vs
    # offpolicy's preset for it inside OffpolicyPolicyLoss, same batch, same batch_num_tokens.
    x = _batch(4)
    host = host_loss.PolicyLoss(is_correction_level="token", is_correction_mode=mode)
    ours = adapter.OffpolicyPolicyLoss(loss_config=preset)
    info = {"dp_size": 1, "batch_num_tokens": x["mask"].sum()}
    (h, *_, h_filter), gh = _host_call(host, x, **info)
    (o, *_, o_filter), go = _host_call(ours, x, **info)
    torch.testing.assert_close(o, h, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(go, gh, rtol=1e-6, atol=1e-8)
    assert gh.abs().sum() > 0
    assert h_filter.item() > 0  # the batch exercises the band
    assert o_filter.item() == pytest.approx(h_filter.item())  # the same filter fraction in the host's log


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 5), t=st.integers(1, 9), token_level=st.booleans(),
       global_counts=st.booleans())
def test_property_host_aggregation_equals_offpolicy(seed: int, b: int, t: int, token_level: bool,
                                                    global_counts: bool) -> None:
    # For any batch: OpenRLHF's aggregate_loss over (ℓ, m) == offpolicy's own reduction, locally and
    # with the global counts ppo_actor passes (batch_num_tokens / global_batch_size, dp_size 1).
    x = _batch(seed, b=b + 3, t=t + 2)
    agg = "token-mean" if token_level else "seq-mean-token-mean"
    cfg = CONFIGS["recommended"].model_copy(update={"agg": agg})
    info = {}
    if global_counts:
        info = {"batch_num_tokens": x["mask"].sum(), "global_batch_size": float(x["mask"].shape[0])}
    fn = adapter.OffpolicyPolicyLoss(clip_eps_low=cfg.clip_low, clip_eps_high=cfg.clip_high,  # as a user must
                                     token_level_loss=token_level, loss_config=cfg)
    (loss, *_), grad = _host_call(fn, x, **info)
    logp = x["logp"].clone().requires_grad_(True)
    ref, _ = op.policy_loss(logp, x["old"], x["adv"], x["mask"], x["mu"], cfg, implementation="reference")
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-5, atol=1e-7)


def test_training_step_wrapper_adds_metrics_once() -> None:
    # ppo_actor.ActorPPOTrainer needs DeepSpeed to import; the wrapper is checked on a class with
    # the same training_step contract (0.11.2: returns {"metrics", "weights", ...}; self.actor_loss_fn).
    x = _batch()

    class Trainer:
        def __init__(self) -> None:
            self.actor_loss_fn = adapter.OffpolicyPolicyLoss(loss_config=CONFIGS["token_tis"])

        def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
            (loss, *_), _ = _host_call(self.actor_loss_fn, x)
            return {"metrics": {"policy_loss": loss.detach()}, "weights": {"policy_loss": "token"}}

    adapter._wrap_training_step(Trainer)
    adapter._wrap_training_step(Trainer)  # idempotent: a second install does not wrap twice
    status = Trainer().training_step(None, 0.0, 0)
    assert status["metrics"]["offpolicy/valid_tokens"].item() == x["mask"].sum().item()
    assert status["weights"]["offpolicy/is_mean"] == "token"
