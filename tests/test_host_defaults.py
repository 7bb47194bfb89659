"""Issue #27: the adapters under their hosts' real defaults.

TRL (trl 1.16.0): the adapter's ``_compute_loss`` is run next to TRL's own
``GRPOTrainer._compute_loss`` on the same trainer and the same batch (TRL's real code, no copy):
the KL term under both ``use_bias_correction_kl`` settings, an all-masked micro-batch
(``mask_truncated_completions``), a NaN sampling log-prob (vLLM's ``None``), a ``kl_to: rollout``
preset. Each case builds a tiny saved model (TRL loads the reference model from its path).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in trl 1.16

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from host_packages import import_openrlhf_loss, import_skyrl_module
from offpolicy.core.config import ConfigError

C = 6  # completion length (= max_completion_length)
NAN = float("nan")


# =========================================================================== TRL
@pytest.fixture(scope="module")
def trl_env(tmp_path_factory):
    pytest.importorskip("trl", reason="TRL not installed (install.sh installs trl==1.16.0; pip install offpolicy[trl])")
    from hf_fixtures import HOST_SHAPE, char_model_dir
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    # beta > 0: TRL builds the reference model from the policy's path
    path = char_model_dir(tmp_path_factory.mktemp("tiny"), with_tokenizer=False, **HOST_SHAPE)
    return {"tokenizer": tokenizer, "model_path": str(path), "out": tmp_path_factory.mktemp("out")}


def _trl_trainer(env, offpolicy_config, rollout_func=None, **overrides):
    from datasets import Dataset
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffpolicyGRPOTrainer

    args = GRPOConfig(**{"output_dir": str(env["out"]), "per_device_train_batch_size": 4, "num_generations": 4,
                         "max_completion_length": C, "report_to": [], "use_cpu": True, "loss_type": "bnpo",
                         "beta": 0.0, "save_strategy": "no", "seed": 0, "max_steps": 1, "logging_steps": 1,
                         **overrides})
    data = Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "reverse me"]})

    def reward(completions, **kwargs):
        return [float(sum(ord(ch) % 3 == 0 for ch in c)) for c in completions]

    trainer = OffpolicyGRPOTrainer(model=env["model_path"], reward_funcs=reward, args=args, train_dataset=data,
                                   processing_class=env["tokenizer"], offpolicy_config=offpolicy_config,
                                   rollout_func=rollout_func)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.training_step; one micro-batch here
    return trainer


def _batch(trainer, seed=0, drift=4.0):
    """A GRPO micro-batch as TRL's ``_generate_and_score_completions`` hands it to ``_compute_loss``:
    4 rows × 6 tokens, row 2 padded after 3 tokens; π_old = π_θ + noise (so the ratio π_θ/π_old ≠ 1),
    π_ref = π_θ + noise with one drifted token (log π_ref − log π_θ = ``drift`` at [0, 1], where
    k3 = e^4 − 4 − 1 ≈ 49.6 is far above offpolicy's k3 value clamp of 10), μ = π_old + noise."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(trainer.processing_class)
    prompt_ids = torch.randint(5, vocab, (4, 3), generator=gen)
    completion_ids = torch.randint(5, vocab, (4, C), generator=gen)
    completion_mask = torch.ones(4, C, dtype=torch.long)
    completion_mask[2, 3:] = 0
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
              "num_items_in_batch": completion_mask.sum()}
    with torch.no_grad():
        lp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([inputs["prompt_mask"], completion_mask], 1), C)
    old = (lp + 0.15 * torch.randn(4, C, generator=gen)).clamp(max=-1e-3)
    ref = (lp + 0.3 * torch.randn(4, C, generator=gen)).clamp(max=-1e-3)
    ref[0, 1] = lp[0, 1] + drift
    inputs.update(old_per_token_logps=old, ref_per_token_logps=ref,
                  sampling_per_token_logps=(old + 0.1 * torch.randn(4, C, generator=gen)).clamp(max=-1e-3))
    return inputs


def _loss_and_grads(trainer, compute, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = compute(trainer, trainer.model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in trainer.model.parameters()]
    return loss.detach(), grads


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", ["bnpo", "grpo"])
def test_trl_kl_equals_trls_own_loss(trl_env, bias_correction, loss_type):
    """Items 2–3: with beta > 0 the adapter's loss and parameter gradient equal TRL's
    ``_compute_loss`` (its k3, unclamped, times the differentiable π_θ/π_old when
    use_bias_correction_kl), on a batch with a drifted token and π_old ≠ π_θ."""
    from trl import GRPOTrainer

    trainer = _trl_trainer(trl_env, op.LossConfig(), beta=0.04, loss_type=loss_type,
                           use_bias_correction_kl=bias_correction)
    assert trainer.offpolicy_trl_kl and trainer.offpolicy_config.kl_coef == 0.0
    inputs = _batch(trainer)
    ours = _loss_and_grads(trainer, type(trainer)._compute_loss, inputs)
    kl_ours = trainer._metrics["train"]["kl"][-1]
    trl = _loss_and_grads(trainer, GRPOTrainer._compute_loss, inputs)
    _assert_same(ours, trl)
    assert math.isclose(kl_ours, trainer._metrics["train"]["kl"][-1], rel_tol=1e-5)  # TRL's own "kl" log
    # the comparison covers the drifted token: its k3 ≈ 49.6 (times r = π_θ/π_old ∈ e^±0.5) over 21 tokens
    # lifts the mean above 1; at offpolicy's value clamp (10) it would stay below 10/21 + 20·0.05/21 ≈ 0.53
    assert kl_ours > 1.0


def test_trl_kl_with_a_correction_equals_trl_where_nothing_is_corrected(trl_env):
    """The recommended preset (bypass, ε 0.4) with μ = π_old: nothing to correct, so the loss is
    TRL's PPO at ε 0.4 plus TRL's KL (bias-corrected, TRL's default) — exactly."""
    from trl import GRPOTrainer

    trainer = _trl_trainer(trl_env, "recommended", beta=0.04, epsilon=0.4)
    inputs = _batch(trainer)
    inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"].clone()
    _assert_same(_loss_and_grads(trainer, type(trainer)._compute_loss, inputs),
                 _loss_and_grads(trainer, GRPOTrainer._compute_loss, inputs))


def test_trl_kl_golden():
    """trl_kl by hand at x = log π_ref − log π_θ = 4 (the drifted token), π_old = π_θ:
    k3 = e^4 − 4 − 1 = 54.59815 − 5 = 49.59815; d k3/d log π_θ = 1 − e^4 = −53.59815;
    bias-corrected, value k3·r = 49.59815 (r = 1), gradient (1 − e^4)·r + k3·r = −53.59815 + 49.59815 = −4.
    offpolicy's own k3 would clamp the value to 10 (issue #27 item 3)."""
    pytest.importorskip("trl", reason="TRL not installed (install.sh installs trl==1.16.0)")
    from offpolicy.integrations.trl import trl_kl

    for bias, value, grad in ((False, 49.59815, -53.59815), (True, 49.59815, -4.0)):
        lp = torch.tensor([[-5.0]], requires_grad=True)
        kl = trl_kl(lp, torch.tensor([[-1.0]]), torch.tensor([[-5.0]]), bias)
        kl.sum().backward()
        assert kl.item() == pytest.approx(value, rel=1e-6)
        assert lp.grad.item() == pytest.approx(grad, rel=1e-5)
    assert op.kl_penalty(torch.tensor([[-5.0]]), torch.tensor([[-1.0]]), "k3").item() == 10.0


def test_trl_all_masked_micro_batch_gives_trls_zero_loss(trl_env):
    """Item 1: every completion masked (mask_truncated_completions) — TRL's loss is 0 with a zero
    gradient; the adapter's too, on the graph, and the metrics say so. A batch with one row left
    keeps equalling TRL (no correction, beta > 0)."""
    from trl import GRPOTrainer

    trainer = _trl_trainer(trl_env, "recommended", beta=0.04, mask_truncated_completions=True)
    inputs = _batch(trainer)
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    loss, grads = _loss_and_grads(trainer, type(trainer)._compute_loss, inputs)
    assert loss.item() == 0.0 and all(bool((g == 0).all()) for g in grads)
    assert trainer._metrics["train"]["offpolicy/all_masked_micro_batch"][-1] == 1.0
    assert trainer._metrics["train"]["kl"][-1] == 0.0
    trl_loss, _ = _loss_and_grads(trainer, GRPOTrainer._compute_loss, inputs)
    assert trl_loss.item() == 0.0

    plain = _trl_trainer(trl_env, op.LossConfig(), beta=0.04)
    inputs = _batch(plain)
    inputs["completion_mask"][1:] = 0
    _assert_same(_loss_and_grads(plain, type(plain)._compute_loss, inputs),
                 _loss_and_grads(plain, GRPOTrainer._compute_loss, inputs))
    assert plain._metrics["train"]["offpolicy/all_masked_micro_batch"][-1] == 0.0


def test_trl_training_with_every_completion_truncated_runs(trl_env):
    """Item 1 end to end: completions that never emit EOS are all truncated, so with
    mask_truncated_completions=True every micro-batch is empty; trainer.train() finishes (it raised
    ``ValueError: mask … has no valid token`` before) and logs the empty micro-batches."""
    tokenizer = trl_env["tokenizer"]
    first_char = len(tokenizer.all_special_tokens)

    def rollout_func(prompts, trainer):
        ids = [[tokenizer.bos_token_id, *tokenizer(p, add_special_tokens=False).input_ids] for p in prompts]
        completions = [[first_char + (i + t) % 26 for t in range(C)] for i in range(len(prompts))]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[-1.0] * C for _ in prompts]}

    trainer = _trl_trainer(trl_env, "recommended", rollout_func=rollout_func, mask_truncated_completions=True)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "offpolicy/all_masked_micro_batch" in h]
    assert logged and logged[0]["offpolicy/all_masked_micro_batch"] == 1.0 and logged[0]["loss"] == 0.0


def test_trl_nan_sampling_logprob_is_neutral_by_default(trl_env):
    """Item 5: trl 1.16.0 turns vLLM's None log-prob into NaN and gives that token ratio 1. With
    the correction's nonfinite left unset the adapter does the same (neutral): the loss equals the
    loss with μ_t := π_old_t there (ρ_t = 1), and the token is counted. An explicit nonfinite wins."""
    trainer = _trl_trainer(trl_env, op.LossConfig.from_preset("verl:decoupled_token_is"))
    assert trainer.offpolicy_config.correction.nonfinite == "neutral"
    inputs = _batch(trainer)
    bad = dict(inputs, sampling_per_token_logps=inputs["sampling_per_token_logps"].clone())
    bad["sampling_per_token_logps"][1, 2] = NAN
    same = dict(inputs, sampling_per_token_logps=inputs["sampling_per_token_logps"].clone())
    same["sampling_per_token_logps"][1, 2] = inputs["old_per_token_logps"][1, 2]
    got = _loss_and_grads(trainer, type(trainer)._compute_loss, bad)
    assert trainer._metrics["train"]["offpolicy/nonfinite_tokens"][-1] == 1.0
    want = _loss_and_grads(trainer, type(trainer)._compute_loss, same)
    assert trainer._metrics["train"]["offpolicy/nonfinite_tokens"][-1] == 0.0
    _assert_same(got, want)
    assert torch.isfinite(got[0])

    strict = op.LossConfig.from_preset("verl:decoupled_token_is")
    strict = strict.model_copy(update={"correction": op.CorrectionConfig(
        **{**strict.correction.model_dump(exclude_defaults=True), "nonfinite": "error"})})
    trainer = _trl_trainer(trl_env, strict)
    assert trainer.offpolicy_config.correction.nonfinite == "error"
    with pytest.raises(ValueError, match="rollout_logprobs has 1 non-finite"):
        trainer._compute_loss(trainer.model, bad)


def test_trl_kl_to_rollout_preset(trl_env):
    """Item 4: prime-rl:dppo's KL is to μ (kl_to rollout). With beta = 0 the adapter runs it (no
    reference model) and equals op.policy_loss; with beta > 0 it refuses at construction, saying
    to set GRPOConfig.beta=0."""
    config = op.LossConfig.from_preset("prime-rl:dppo")
    trainer = _trl_trainer(trl_env, config)
    assert not trainer.offpolicy_trl_kl and trainer.ref_model is None
    inputs = _batch(trainer)
    loss = trainer._compute_loss(trainer.model, inputs)
    with torch.no_grad():
        lp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), C)
    per_token, mask, _ = op.policy_loss(lp, inputs["old_per_token_logps"], inputs["advantages"][:, None].expand(4, C),
                                        inputs["completion_mask"].float(), inputs["sampling_per_token_logps"],
                                        trainer.offpolicy_config, reduce=False)
    want = (per_token * mask).sum() / mask.sum()  # bnpo
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigError, match="GRPOConfig.beta=0"):
        _trl_trainer(trl_env, config, beta=0.002)
    with pytest.raises(ConfigError, match="set GRPOConfig.beta to the KL coefficient"):
        _trl_trainer(trl_env, op.LossConfig(kl_coef=0.1), beta=0.04)


# =========================================================================== verl, OpenRLHF, SkyRL
# Each host's loss entry, called the way the host calls it; ``call(cfg, lp, old, adv, mask, mu)``
# returns (loss, metrics dict with the offpolicy/ prefix).
def _verl():
    pytest.importorskip("verl", reason="verl not installed (install.sh installs verl==0.9.1)")
    from offpolicy.integrations import verl as adapter

    def call(cfg, lp, old, adv, mask, mu):
        # bypass mode: verl hands the policy loss μ as old_log_prob (adapter docstring)
        adapter.configure(cfg)
        try:
            return adapter.offpolicy_policy_loss(mu, lp, adv, mask, "token-mean", None, None)
        finally:
            adapter.configure(None)

    return call


def _openrlhf():
    pytest.importorskip("openrlhf", reason="OpenRLHF not installed (install.sh installs openrlhf==0.11.2)")
    try:  # without DeepSpeed/flash-attn: OpenRLHF's real loss.py under a bare package (test_integration_openrlhf)
        import_openrlhf_loss()
    except ImportError as err:
        pytest.skip(f"OpenRLHF's openrlhf.models.loss does not import here: {err}")
    from offpolicy.integrations import openrlhf as adapter

    def call(cfg, lp, old, adv, mask, mu):
        fn = adapter.OffpolicyPolicyLoss(clip_eps_low=cfg.clip_low, clip_eps_high=cfg.clip_high,
                                         dual_clip=cfg.dual_clip, loss_config=cfg)
        loss, _, ppo_kl, vllm_kl, _ = fn(lp, old, adv, action_mask=mask, rollout_log_probs=mu,
                                         batch_num_tokens=float(max(mask.sum(), 1)))
        assert torch.isfinite(ppo_kl) and torch.isfinite(vllm_kl)  # the host's own logged means
        return loss, fn.pop_metrics()

    return call


def _skyrl():
    pytest.importorskip("skyrl", reason="SkyRL not installed (Python >= 3.12; pip install offpolicy[skyrl])")
    try:  # on 3.11 under a bare skyrl.backends (test_integration_skyrl)
        import_skyrl_module()
    except ImportError as err:
        pytest.skip(f"SkyRL's ppo_utils does not import here: {err}")
    from skyrl.train.config.config import AlgorithmConfig

    from offpolicy.integrations import skyrl as adapter

    def call(cfg, lp, old, adv, mask, mu):
        return adapter.OffpolicyLoss(cfg)(lp, old, adv, config=AlgorithmConfig(), loss_mask=mask, rollout_logprobs=mu)

    return call


HOSTS = {"verl": _verl, "openrlhf": _openrlhf, "skyrl": _skyrl}


def _fixed(cfg: op.LossConfig) -> op.LossConfig:
    # OpenRLHF and SkyRL fix their token count before the loss (renormalize is refused there)
    return cfg.model_copy(update={"correction": cfg.correction.model_copy(update={"denominator": "fixed"})})


def _host_batch(seed=0, b=4, t=5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 2 - 0.05
    old = (lp + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-3)
    mu = (old + 0.3 * torch.randn(b, t, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    mask = torch.ones(b, t)
    mask[1, 3:] = 0
    return lp, old, adv, mask, mu


@pytest.mark.parametrize("name", list(HOSTS))
def test_host_all_masked_micro_batch_is_a_zero_loss(name):
    """A micro-batch without a valid token: every host's own masked sum is 0 there; the adapters
    raised ``mask … has no valid token``. Now 0 on the graph, zero gradient, reported."""
    call = HOSTS[name]()
    cfg = _fixed(op.presets.loss("recommended"))
    lp, old, adv, mask, mu = _host_batch()
    lp = lp.clone().requires_grad_(True)
    loss, metrics = call(cfg, lp, old, adv, torch.zeros_like(mask), mu)
    loss.backward()
    assert loss.item() == 0.0 and lp.grad is not None and bool((lp.grad == 0).all())
    assert metrics["offpolicy/all_masked_micro_batch"] == 1.0
    _, metrics = call(cfg, lp.detach(), old, adv, mask, mu)
    assert metrics["offpolicy/all_masked_micro_batch"] == 0.0


@pytest.mark.parametrize("name", list(HOSTS))
def test_host_nan_sampling_logprob_is_neutral_by_default(name):
    """A NaN μ on a valid token under a preset that leaves nonfinite unset: no crash; the loss and
    gradient equal those with μ_t := sg(π_θ)_t (bypass's trainer side: ρ_t = 1); counted."""
    call = HOSTS[name]()
    cfg = _fixed(op.presets.loss("recommended"))
    lp, old, adv, mask, mu = _host_batch()
    bad, same = mu.clone(), mu.clone()
    bad[2, 1], same[2, 1] = NAN, lp[2, 1]
    bad[1, 4] = NAN  # on padding too: never read
    results = []
    for m in (bad, same):
        x = lp.clone().requires_grad_(True)
        loss, metrics = call(cfg, x, old, adv, mask, m)
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    assert torch.isfinite(results[0][0]) and results[0][2]["offpolicy/nonfinite_tokens"] == 1.0


@pytest.mark.parametrize("name", list(HOSTS))
def test_host_kl_to_rollout_runs_and_kl_to_ref_is_refused(name):
    """prime-rl:dppo's KL is to μ (kl_to rollout), which every host hands the loss: it runs and
    equals op.policy_loss; a KL to a reference model (the host's own term) is still refused."""
    call = HOSTS[name]()
    cfg = op.LossConfig.from_preset("prime-rl:dppo")
    lp, old, adv, mask, mu = _host_batch()
    if name == "verl":
        old = mu  # bypass mode: π_old := μ
    loss, metrics = call(cfg, lp, old, adv, mask, mu)
    per_token, agg_mask, _ = op.policy_loss(lp, old, adv, mask, mu, cfg, reduce=False)
    total = (per_token * agg_mask).sum()
    want = total if name == "skyrl" else total / mask.sum()  # SkyRL: Σ over pre-scaled A; the others token-mean
    torch.testing.assert_close(loss.detach(), want)
    assert "offpolicy/kl_ref" in metrics and metrics["offpolicy/kl_ref"] > 0  # the KL to μ was computed
    with pytest.raises(ConfigError, match="kl_to 'ref'"):
        call(op.LossConfig(kl_coef=0.1, correction=cfg.correction), lp, old, adv, mask, mu)


def test_openrlhf_runtime_env_keeps_nonfinite_unset():
    """The config travels to OpenRLHF's Ray workers as JSON: a nonfinite left unset must arrive
    unset (then neutral in the worker), an explicit one as given."""
    _openrlhf()
    from offpolicy.integrations import openrlhf as adapter

    cfg = _fixed(op.presets.loss("recommended"))
    sent = adapter.resolve_config(adapter.runtime_env(cfg)["env_vars"][adapter.ENV_LOSS])
    assert sent == cfg and adapter.OffpolicyPolicyLoss(clip_eps_low=0.4, clip_eps_high=0.4, loss_config=sent
                                                       ).config.correction.nonfinite == "neutral"
    strict = cfg.model_copy(update={"correction": cfg.correction.model_copy(update={"nonfinite": "error"})})
    sent = adapter.resolve_config(adapter.runtime_env(strict)["env_vars"][adapter.ENV_LOSS])
    assert sent.correction.nonfinite == "error"
    assert adapter.OffpolicyPolicyLoss(clip_eps_low=0.4, clip_eps_high=0.4, loss_config=sent
                                       ).config.correction.nonfinite == "error"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from([-1.0, -0.2, NAN, float("inf"), -float("inf")]), min_size=1, max_size=12),
       st.integers(1, 4))
def test_empty_loss_is_zero_with_a_zero_gradient_whatever_the_masked_values(values, rows):
    """host.empty_loss: 0 and a zero, finite gradient for any log-probs under an all-zero mask
    (a padded micro-batch may hold NaN/inf where nothing counts)."""
    from offpolicy.integrations.host import empty_loss

    lp = torch.tensor(values * rows).reshape(rows, len(values)).requires_grad_(True)
    loss, metrics = empty_loss(lp, torch.zeros(rows, len(values)))
    loss.backward()
    assert loss.item() == 0.0 and bool((lp.grad == 0).all())
    assert metrics.to_dict() == {"offpolicy/all_masked_micro_batch": 1.0}
