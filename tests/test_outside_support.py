"""Tokens the engine drew outside the trainer's top-k/top-p support (issue #31): with a bf16 engine and a
fp32 trainer the two keep different sets, so log π̃ = −inf for such a token. They leave the loss like
rejected tokens — exactly, also across micro-batches — are counted per step and in `diagnose`, and
no longer stop a run with "logprobs has N non-finite value(s)"."""

from __future__ import annotations

import json
import math

import pytest
import torch

import offpolicy as op
from conftest import FAST
from hf_fixtures import TRAINER_SHAPE, char_model, char_model_dir
from offpolicy.measure import diagnose
from offpolicy.engines import Rollouts, SamplingConfig
from offpolicy.core.metrics import Metrics
from offpolicy.policy.batch import to_batch
from offpolicy.policy.score import Scorer
from offpolicy.tasks import make_task, problems
from offpolicy.tasks.tokenizer import build_char_tokenizer, prompt_ids
from offpolicy.train import update
from offpolicy.train.config import load_train_config
from offpolicy.train.loop import train


@pytest.fixture
def no_recorded_set(monkeypatch):
    """The hf engine without its kept sets (issue #46): the trainer recomputes top-k/top-p on its own logits,
    as it does for vLLM, whose CPU build records none — the path where tokens can fall outside its set."""
    from dataclasses import replace

    from offpolicy.engines.hf import HFEngine

    generate = HFEngine.generate
    monkeypatch.setattr(HFEngine, "generate", lambda self, *a, **k: replace(generate(self, *a, **k), kept=None))

TOP3 = SamplingConfig(max_tokens=8, top_k=3)  # uniform random responses mostly fall outside a top-3


def test_within_support_masks_minus_inf_counts_it_and_leaves_nan_alone():
    inf = float("inf")
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    logprobs = torch.tensor([[-0.5, -inf, -1.0, 0.0], [float("nan"), -2.0, 0.0, 0.0]])
    old = torch.tensor([[-0.25, -0.75, -inf, 0.0], [-1.0, -2.5, 0.0, 0.0]])
    b = to_batch(Rollouts([[1], [1]], [[5, 6, 7], [5, 6]], [[-1.0] * 3, [-1.0] * 2], [True, True], version=0), 0)
    b.mask = mask
    metrics = Metrics()
    kept, lp, old_kept = update.within_support(b, logprobs, old, metrics)
    # row 0: π_θ outside at t=1, π_old outside at t=2 → both leave the mask; row 1's NaN stays for `nonfinite`
    assert kept.mask.tolist() == [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert lp[0].tolist() == [-0.5, 0.0, 0.0, 0.0] and math.isnan(lp[1, 0])
    assert old_kept[0].tolist() == [-0.25, 0.0, 0.0, 0.0]
    values = metrics.to_dict()
    assert values["offpolicy/outside_support_tokens"] == 2  # of the 5 tokens that counted
    assert values["offpolicy/outside_support_share"] == pytest.approx(2 / 5)


def tiny_setup(seed: int = 0):
    """A float64 tiny Qwen2 and 6 rows of uniformly random responses (as in test_train_device)."""
    tok = build_char_tokenizer()
    model = char_model(**TRAINER_SHAPE, seed=seed).double()
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, *torch.randint(5, 40, (n,), generator=g).tolist()] for n in (3, 6, 2, 5, 4, 7)]
    responses = [torch.randint(5, 40, (n,), generator=g).tolist() for n in (5, 1, 8, 3, 6, 2)]
    logprobs = [(-0.5 - torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in responses]
    batch = to_batch(Rollouts(prompts, responses, logprobs, [True] * 6, version=0), tok.pad_token_id)
    batch.rollout_logprobs = batch.rollout_logprobs.double()
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.9], dtype=torch.float64)
    return model, batch, adv.unsqueeze(-1).expand_as(batch.mask).contiguous()


def step_gradient(model, batch, adv, loss_cfg, budget, old=None, update_weights=True):
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = Metrics()

    def old_of(rows, mb, logprobs):
        return logprobs.detach() if old is None else old[rows, : mb.mask.shape[1]]

    update.optimizer_step(Scorer(model, TOP3, torch.device("cpu"), "fp32", budget), opt, batch, torch.arange(6), adv,
                          old_of=old_of, loss_cfg=loss_cfg, max_grad_norm=1e12, metrics=metrics, update=update_weights)
    grads = [b - p.detach() for b, p in zip(before, model.parameters())]
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    return grads, metrics.to_dict()


@pytest.mark.parametrize("budget", [20, 30])
@pytest.mark.parametrize("preset", [None, "verl:decoupled_token_is", "verl:decoupled_seq_is_rs"])
def test_micro_batched_step_drops_outside_tokens_exactly_as_the_whole_batch(preset, budget):
    """The step's global count is taken after the support mask: split and whole give one gradient — and every
    metric the same (issue #43: a micro-batch whose tokens all fell outside the support got no forward that
    recorded entropy and outside mass; float64, top_k=3: entropy 1.08380 whole against 1.08192 split)."""
    model, batch, adv = tiny_setup()
    loss_cfg = op.LossConfig() if preset is None else op.LossConfig.from_preset(preset)
    with torch.no_grad():
        other, _, _ = tiny_setup(seed=1)
        old = Scorer(other, TOP3, torch.device("cpu"), "fp32", 20).score(batch).logprobs  # π_old's support too
        assert torch.isneginf(old).any()
    whole, m_whole = step_gradient(model, batch, adv, loss_cfg, None, old)
    split, m_split = step_gradient(model, batch, adv, loss_cfg, budget, old)
    tokens = int(batch.mask.sum())
    assert 0 < m_whole["offpolicy/outside_support_tokens"] < tokens  # some tokens left, some stayed
    assert m_split["offpolicy/outside_support_tokens"] == m_whole["offpolicy/outside_support_tokens"]
    assert any(g.abs().max() > 1e-6 for g in whole)
    scale = max(g.abs().max().item() for g in whole)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale)
    assert_same_metrics(m_whole, m_split)
    # the measuring pass of a skipped update (loop.py) reports the same numbers split or whole too
    _, measured_whole = step_gradient(model, batch, adv, loss_cfg, None, old, update_weights=False)
    _, measured_split = step_gradient(model, batch, adv, loss_cfg, budget, old, update_weights=False)
    assert_same_metrics(measured_whole, measured_split)
    assert "offpolicy/entropy" in measured_split and "offpolicy/loss" not in measured_split


def assert_same_metrics(whole: dict[str, float], split: dict[str, float]) -> None:
    """Every key, every value: the float64 model gives the unsplit step's numbers to float64 rounding. A
    statistic over an empty set (``kl_k3_masked`` where nothing was masked) is NaN in both, never a number
    in one of them."""
    assert whole.keys() == split.keys()
    assert {"offpolicy/entropy", "offpolicy/outside_mass", "offpolicy/outside_mass_max"} <= whole.keys()
    for key, value in whole.items():
        if math.isnan(value) or math.isnan(split[key]):
            assert math.isnan(value) and math.isnan(split[key]), (key, value, split[key])
            continue
        assert math.isclose(value, split[key], rel_tol=1e-9, abs_tol=1e-12), (key, value, split[key])


def test_old_logprobs_puts_each_micro_batch_back_in_its_rows():
    model, batch, _ = tiny_setup()
    with torch.no_grad():
        whole = Scorer(model, TOP3, torch.device("cpu"), "fp32", None).score(batch).logprobs
        split = Scorer(model, TOP3, torch.device("cpu"), "fp32", 20).score(batch).logprobs  # 4 groups, reordered
    assert torch.equal(torch.isneginf(whole), torch.isneginf(split))
    torch.testing.assert_close(torch.where(torch.isfinite(whole), whole, 0), torch.where(torch.isfinite(split), split, 0),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_the_issue_setting_trains_and_reports_the_count(offpolicy_cache, tmp_path, no_recorded_set):
    """engine=hf engine_dtype=bf16 top_k=10 top_p=0.9 temperature=0.7 — at 4efb1a7 step 0 stopped with
    "logprobs has N non-finite value(s)". Engine logit noise (σ = 1) makes a token outside the fp32
    trainer's kept set certain rather than likely; π_old is recomputed in micro-batches, so the π_old
    path, the micro-batched count and the update all meet such tokens."""
    cfg = load_train_config(None, [*FAST, "steps=1", "engine.dtype=bf16", "sampling.top_k=10", "sampling.top_p=0.9", "sampling.temperature=0.7",
                                   "engine.logit_noise=1.0", "recompute_old=true", "trainer.micro_batch_tokens=64",
                                   "preset=verl:decoupled_token_is", f"out_dir={tmp_path / 'run'}"])
    train(cfg, progress=False)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["offpolicy/outside_support_tokens"] > 0
    assert 0 < row["offpolicy/outside_support_share"] < 0.5
    assert math.isfinite(row["offpolicy/loss"]) and row["offpolicy/grad_norm"] > 0


def test_diagnose_counts_and_excludes_outside_tokens(tmp_path, no_recorded_set):
    tok = build_char_tokenizer()
    char_model_dir(tmp_path, with_tokenizer=False, hidden_size=64, num_layers=2, seed=2)
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 16, seed=1)]
    sampling = SamplingConfig(max_tokens=8, temperature=0.7, top_k=10, top_p=0.9)
    s = diagnose.sample(diagnose.TrainerSide(tmp_path, sampling), tok, prompts, "hf", "bf16", logit_noise=1.0)
    assert s.outside_support > 0
    assert torch.isfinite(s.trainer[s.batch.mask.bool()]).all()  # every statistic sees finite numbers only
    result = diagnose.report(s, {"engine": "hf", "engine_dtype": "bf16", "trainer_dtype": "fp32"}, tmp_path / "r",
                             plots=False)
    assert result["outside_support_tokens"] == s.outside_support == result["summary"]["outside_support_tokens"]
    assert result["tokens"] == float(s.batch.mask.sum()) + s.outside_support  # every token sampled
    assert result["mismatch"]["valid_tokens"] == float(s.batch.mask.sum())  # the statistics leave them out
    assert math.isfinite(result["mismatch"]["kl_k3"])
