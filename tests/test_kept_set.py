"""Replay of the engine's kept set (issue #46 item 1): the ragged representation (``offpolicy.core.kept_set``),
the hf engine's record of the set it sampled from, the head renormalising over it (values and gradients
against a float64 full-logits reference, on sets that differ from the trainer's own), the train path
carrying it, and diagnose's shares with and without replay."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from offpolicy.measure import diagnose
from offpolicy.engines import SamplingConfig
from offpolicy.engines.hf import HFEngine
from offpolicy.core.kept_set import KeptIds, StepRecorder
from offpolicy.core.metrics import Metrics
from offpolicy.core.sampling import renormalize_logprobs
from offpolicy.tasks import make_task, problems
from offpolicy.tasks.model import build_tiny_qwen2
from offpolicy.tasks.tokenizer import build_char_tokenizer
from offpolicy.policy.batch import Batch, to_batch
from offpolicy.policy.head import trainer_logprobs
from offpolicy.policy.score import Scorer, to_device, trim
from offpolicy.tasks.tokenizer import prompt_ids

from cli_inprocess import run_cli  # noqa: E402
from test_head import _LargestTensor, long_rows_batch, ragged_batch, tiny_causal_lm, value_and_grads  # noqa: E402

VOCAB = 97
SAMPLING = SamplingConfig(temperature=1.3, top_p=0.8)


def response_logits(model, batch: Batch) -> torch.Tensor:
    """The model's own logits ``[B, T, V]`` at the response positions (≥ fp32), the full-logits reference."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    index = batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return logits.gather(1, index).to(torch.promote_types(logits.dtype, torch.float32))


def engine_sets(model, batch: Batch, sampling: SamplingConfig, noise: float = 0.6) -> torch.Tensor:
    """An engine's kept sets ``[B, T, V]``: top-p of noisy logits (another numerics), the sampled token in
    each (the engine drew it from its set)."""
    with torch.no_grad():
        z = response_logits(model, batch).double()
    z = z + noise * torch.randn(z.shape, generator=torch.Generator().manual_seed(3), dtype=z.dtype)
    keep = torch.isfinite(renormalize_logprobs(z, top_p=sampling.top_p, temperature=sampling.temperature))
    return keep.scatter(-1, batch.response_ids.unsqueeze(-1), True)


# ---------------------------------------------------------------------------------------- the representation
def test_flat_sets_give_every_run_of_positions_its_mask_from_host_bounds():
    """``FlatKept.mask(a, b)`` — what the head builds per chunk — is the dense mask of positions [a, b),
    for every chunking, on sets gathered like the head's (``kept[rows, cols]``), including empty sets and
    empty runs; the bounds are host ints (no device read per chunk), the vocabulary checked once."""
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(4, 6, 13, generator=g) < 0.25
    keep[1, 2] = False  # an empty set
    kept = KeptIds.from_mask(keep)
    rows, cols = torch.tensor([3, 0, 1, 1, 2, 0, 3]), torch.tensor([5, 1, 2, 0, 4, 4, 0])
    flat = kept[rows, cols].flat()
    want = keep[rows, cols]
    assert flat.positions == 7 and all(isinstance(e, int) for e in flat.ends)
    assert flat.top == int(want.nonzero()[:, 1].max())
    for chunk in range(1, 9):
        parts = [flat.mask(a, min(7, a + chunk), 13) for a in range(0, 7, chunk)]
        assert torch.equal(torch.cat(parts), want)
    assert flat.mask(3, 3, 13).shape == (0, 13)
    flat.check(13)
    with pytest.raises(ValueError, match="outside the trainer's vocabulary of 12"):
        flat.check(12)


def test_the_head_replays_the_same_sets_whatever_its_chunk():
    """Values and gradients of the replayed head do not depend on how the tokens are chunked (each chunk's
    mask is a slice of one expansion): chunks of 1, 3 and all tokens agree, to the matrix products' rounding."""
    model = tiny_causal_lm("llama", VOCAB)
    batch = ragged_batch(model, VOCAB)
    replayed = replace(batch, kept=KeptIds.from_mask(engine_sets(model, batch, SAMPLING)))
    results = []
    for chunk in (1, 3, None):
        model.zero_grad()
        lp = trainer_logprobs(model, replayed, SAMPLING, chunk=chunk)
        lp[batch.mask.bool()].sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    for lp, grads in results[:2]:
        assert torch.allclose(lp, results[-1][0], rtol=1e-6, atol=1e-6) and torch.isfinite(lp[batch.mask.bool()]).all()
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads, results[-1][1]))



def test_ragged_sets_round_trip_and_index_like_the_batch():
    g = torch.Generator().manual_seed(0)
    keep = torch.rand(3, 5, 11, generator=g) < 0.3
    keep[..., 0] = True
    kept = KeptIds.from_mask(keep)
    assert kept.shape == (3, 5) and kept.ids.dtype == torch.int32 and kept.count.dtype == torch.int32
    assert torch.equal(kept.dense(11), keep)
    assert torch.equal(kept[torch.tensor([2, 0])].dense(11), keep[[2, 0]])
    assert torch.equal(kept[:, :3].dense(11), keep[:, :3])
    rows, cols = torch.tensor([0, 2, 1]), torch.tensor([4, 0, 2])
    assert torch.equal(kept[rows, cols].dense(11), keep[rows, cols])
    assert torch.equal(kept.pad(7).dense(11)[:, :5], keep) and not kept.pad(7).dense(11)[:, 5:].any()
    valid = torch.arange(5)[None] < torch.tensor([[5], [2], [0]])
    compact = kept.compact(valid)
    assert torch.equal(compact.dense(11), keep & valid.unsqueeze(-1))
    assert compact.ids.numel() == int((keep & valid.unsqueeze(-1)).sum())  # only the valid positions' ids remain
    with pytest.raises(ValueError, match="outside the trainer's vocabulary of 10"):
        kept.dense(10)


def test_steps_assemble_into_rows_and_drop_what_follows_each_response():
    g = torch.Generator().manual_seed(1)
    steps = [torch.rand(4, 13, generator=g) < 0.4 for _ in range(6)]
    recorder = StepRecorder()
    for keep in steps:
        recorder.add(keep)
    lengths = [6, 3, 0, 5]
    kept = recorder.assemble(5, lengths)  # the sixth step is not part of any response
    want = torch.stack(steps[:5], dim=1) & (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).unsqueeze(-1)
    assert torch.equal(kept.dense(13), want)
    assert kept.ids.numel() == int(want.sum())


def test_recorded_log_probs_follow_their_ids_through_assembly_and_indexing():
    """With each step's log-probs recorded, every kept id keeps its own log q_v through assemble, compact,
    indexing and pad, and ``padded`` lays them out as [*, K] with −inf on the padding."""
    g = torch.Generator().manual_seed(4)
    steps = [torch.rand(3, 11, generator=g) < 0.5 for _ in range(4)]
    logps = [torch.log_softmax(torch.randn(3, 11, generator=g), -1) for _ in steps]
    recorder = StepRecorder()
    for keep, lp in zip(steps, logps):
        recorder.add(keep, lp)
    lengths = [4, 2, 3]
    kept = recorder.assemble(4, lengths)
    dense_keep = torch.stack(steps, dim=1) & (torch.arange(4)[None] < torch.tensor(lengths)[:, None]).unsqueeze(-1)
    dense_lp = torch.stack(logps, dim=1)
    for view, rows in ((kept, slice(None)), (kept[1:], slice(1, None)), (kept.pad(6)[:, :4], slice(None))):
        ids, logq = view.padded()
        present = torch.isfinite(logq)
        assert torch.equal(present.sum(-1), dense_keep[rows].sum(-1))
        want = dense_lp[rows].gather(-1, ids)
        assert torch.equal(logq[present], want[present])
        assert torch.equal(dense_keep[rows].gather(-1, ids)[present], torch.ones(int(present.sum()), dtype=torch.bool))


def test_memory_is_bounded_by_the_kept_ids_not_the_vocabulary():
    """top_k 20 at V = 49,152: 20 ids a token, 12 + 4·20 bytes, where a bool mask takes V bytes a token."""
    logits = torch.randn(64, 49_152, generator=torch.Generator().manual_seed(2))
    keep = torch.isfinite(renormalize_logprobs(logits, top_k=20))
    kept = KeptIds.from_mask(keep)
    assert (kept.count == 20).all()
    assert kept.nbytes() == 64 * (12 + 4 * 20) == kept.start.numel() * 12 + kept.ids.numel() * 4
    assert kept.nbytes() < keep.numel() / 100


# ---------------------------------------------------------------------------------------------- the head
@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_replayed_head_is_exact_against_float64_full_logits_over_the_engines_set(precision):
    """log π̃(y) = z_y − logsumexp_{v ∈ K_engine} z_v and its gradient, with K_engine ≠ the trainer's own
    top-p set (tokens the trainer's set lacks, sets of other sizes), chunks that split rows."""
    model = tiny_causal_lm("llama", VOCAB)
    reference = tiny_causal_lm("llama", VOCAB).double()  # the same weights (same seed), in float64
    if precision == "fp64":
        model = model.double()
    batch = ragged_batch(model, VOCAB)
    keep = engine_sets(reference, batch, SAMPLING)
    own = torch.isfinite(renormalize_logprobs(response_logits(reference, batch).detach(), top_p=SAMPLING.top_p,
                                              temperature=SAMPLING.temperature))
    counted = batch.mask.bool()
    assert (keep != own)[counted].any(-1).sum() >= 5  # the engine's sets differ from the trainer's
    drawn_outside_own = ~own.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) & counted
    assert drawn_outside_own.any()  # some tokens the trainer's own set would give −inf
    replayed = replace(batch, kept=KeptIds.from_mask(keep))
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))

    def full_reference():
        z = response_logits(reference, batch) / SAMPLING.temperature  # float64 [B, T, V]
        lp = z.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
            z.masked_fill(~keep, float("-inf")), dim=-1)
        return torch.where(counted, lp, torch.zeros((), dtype=lp.dtype))

    want, want_grads = value_and_grads(full_reference, reference, batch, weights)
    tol = {"fp64": 1e-12, "fp32": 2e-5}[precision]
    for chunk in (None, 4):
        got, grads = value_and_grads(lambda: trainer_logprobs(model, replayed, SAMPLING, chunk=chunk), model,
                                     batch, weights)
        assert torch.isfinite(got).all()  # every token is in the set it was drawn from: none is −inf
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * (float(b.abs().max()) + 1e-30))
    recomputed = trainer_logprobs(model, batch, SAMPLING).detach()
    assert torch.isneginf(recomputed[drawn_outside_own]).all()  # without replay those tokens had no ratio


def test_replay_keeps_the_head_flat_in_tokens():
    """Forward and backward with the engine's sets at 4 × 32 tokens, chunks of 8: no op returns more than a
    chunk's [8, V] (each chunk's sets are made dense one chunk at a time)."""
    vocab, chunk, b, t = 2048, 8, 4, 32

    def sets(input_ids, g):  # ~1 % of the vocabulary, and the drawn token
        keep = torch.rand(b, t, vocab, generator=g) < 0.01
        return KeptIds.from_mask(keep.scatter(-1, input_ids[:, 6:].unsqueeze(-1), True))

    model, batch = long_rows_batch(vocab, b, t, kept=sets)
    sampling = SamplingConfig(top_p=0.9)
    trainer_logprobs(model, batch, sampling, chunk=chunk)  # the one-time head check runs outside the count
    with _LargestTensor() as seen:
        lp = trainer_logprobs(model, batch, sampling, Metrics(), chunk=chunk)
        lp.sum().backward()
    assert torch.isfinite(lp).all()
    assert seen.largest <= chunk * vocab < b * (t + 6) * vocab // 16


def test_the_train_path_carries_the_sets_and_says_which_applied():
    """select, trim and to_device keep each token's set; π_old on the engine's sets is finite where the
    trainer's own set leaves tokens out; ``kept_set_replayed`` says which set was used."""
    model = tiny_causal_lm("llama", VOCAB)
    batch = ragged_batch(model, VOCAB)
    keep = engine_sets(model, batch, SAMPLING)
    replayed = replace(batch, kept=KeptIds.from_mask(keep))
    moved = to_device(trim(replayed.select(torch.tensor([2, 0]))), torch.device("cpu"))
    t = moved.mask.shape[1]
    assert torch.equal(moved.kept.dense(VOCAB), keep[[2, 0], :t])
    scorer = Scorer(model, SAMPLING, torch.device("cpu"), "fp32", 12)  # π_old, as train scores it
    own = scorer.score(batch).logprobs
    engine = scorer.score(replayed).logprobs
    counted = batch.mask.bool()
    assert torch.isneginf(own[counted]).any() and torch.isfinite(engine[counted]).all()
    for sample, flag in ((replayed, 1.0), (batch, 0.0)):
        metrics = Metrics()
        trainer_logprobs(model, sample, SAMPLING, metrics)
        assert float(metrics["kept_set_replayed"]) == flag


# ---------------------------------------------------------------------------------------------- the hf engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kept")
    tok = build_char_tokenizer()
    build_tiny_qwen2(tok, hidden_size=64, num_layers=2, seed=2).save_pretrained(path)
    tok.save_pretrained(path)
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 12, seed=1)]
    return path, tok, prompts


@pytest.mark.parametrize("sampling", [SamplingConfig(max_tokens=10, top_k=5),
                                      SamplingConfig(max_tokens=10, temperature=0.7, top_p=0.8)],
                         ids=["top_k", "top_p"])
def test_hf_engine_records_the_set_it_sampled_from(tiny, sampling):
    """Every drawn token lies in its recorded set (over three seeds), the set is the top-k/top-p set of the
    engine's own logits (fp32, the model re-run on the prompt and the response so far), and nothing is
    recorded past a response's end."""
    path, tok, prompts = tiny
    engine = HFEngine(str(path), tok, "fp32")
    for seed in range(3):
        rollouts = engine.generate(prompts, sampling, seed=seed, version=0)
        batch = to_batch(rollouts, tok.pad_token_id)
        keep = batch.kept.dense(engine.model.config.vocab_size)  # [B, T, V]
        counted = batch.mask.bool()
        assert keep.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)[counted].all()
        assert not keep[~counted].any()
        with torch.no_grad():
            logits = response_logits(engine.model, batch)
        own = torch.isfinite(renormalize_logprobs(logits, top_p=sampling.top_p, top_k=sampling.top_k,
                                                  temperature=sampling.temperature))
        assert torch.equal(keep[counted], own[counted])
        # q_v of every kept id (exact score centering): the engine's processed distribution over the set —
        # it sums to 1 there, gives the drawn token its reported log μ, and is the set's own softmax
        ids, logq = batch.kept.padded()
        present = torch.isfinite(logq)
        assert torch.equal(present.sum(-1), batch.kept.count.long())
        total = torch.logsumexp(logq, dim=-1)[counted]
        torch.testing.assert_close(total, torch.zeros_like(total), atol=1e-5, rtol=0)
        drawn = torch.where(present & (ids == batch.response_ids.unsqueeze(-1)), logq, torch.zeros_like(logq)).sum(-1)
        torch.testing.assert_close(drawn[counted], batch.rollout_logprobs[counted], atol=1e-6, rtol=0)
        own_lp = renormalize_logprobs(logits, top_p=sampling.top_p, top_k=sampling.top_k,
                                      temperature=sampling.temperature)
        want = torch.where(present, own_lp.gather(-1, ids).float(), logq)
        torch.testing.assert_close(logq[counted], want[counted], atol=1e-4, rtol=0)
        if sampling.top_k > 0:
            assert (batch.kept.count[counted] == sampling.top_k).all()
            assert batch.kept.nbytes() == 12 * counted.numel() + 8 * sampling.top_k * int(counted.sum())
    untruncated = engine.generate(prompts, SamplingConfig(max_tokens=4), seed=0, version=0)
    assert untruncated.kept is None  # the whole vocabulary: nothing to record
    engine.close()


# ---------------------------------------------------------------------------------------------- diagnose
def test_diagnose_reports_the_shares_with_and_without_replay(tmp_path):
    """With replay every engine token has a ratio; the recomputed set lost one of six, and its ρ band shares
    are reported beside, in the report and the summary."""
    rollout = torch.tensor([[-0.5, -2.0, -0.1], [-0.3, -0.2, -0.9]])
    replayed = rollout + torch.tensor([[0.01, 0.0, -0.02], [0.0, 0.03, 0.5]])
    recomputed = rollout + torch.tensor([[0.2, 0.0, -0.02], [0.0, 0.03, 0.5]])
    recomputed[0, 1] = float("-inf")
    zeros = torch.zeros(2, 3, dtype=torch.long)
    batch = Batch(zeros, zeros, zeros, zeros, torch.ones(2, 3), rollout, torch.zeros(2, dtype=torch.long))
    s = diagnose.Sample(batch, replayed, None, without_replay=diagnose.Sample(batch, recomputed, None))
    r = diagnose.report(s, {"name": "x", "label": "x"}, tmp_path, plots=False)
    kept = r["kept_set"]
    assert kept["applied"] == "replayed"
    assert kept["with_replay"]["fraction_outside_trainer_support"] == 0.0
    assert kept["without_replay"]["fraction_outside_trainer_support"] == pytest.approx(1 / 6)
    # ρ outside [0.9, 1.1]: with replay exp(0.5) only, 1 of 6; without, exp(0.2) and exp(0.5) of the 5 with a ratio
    assert kept["with_replay"]["fraction_ratio_outside"]["0.9_1.1"] == pytest.approx(1 / 6)
    assert kept["without_replay"]["fraction_ratio_outside"]["0.9_1.1"] == pytest.approx(2 / 5)
    assert r["fraction_outside_trainer_support"] == 0.0  # the headline numbers are the replayed ones
    summary = r["summary"]
    assert summary["kept_set_replayed"] == 1.0
    assert summary["fraction_outside_trainer_support_without_replay"] == pytest.approx(1 / 6)
    assert summary["fraction_outside_0.9_1.1_without_replay"] == pytest.approx(2 / 5)
    plain = diagnose.report(diagnose.Sample(batch, recomputed, None), {"name": "x", "label": "x"}, tmp_path,
                            plots=False)
    assert plain["kept_set"]["applied"] == "recomputed" and plain["summary"]["kept_set_replayed"] == 0.0
    assert plain["kept_set"]["without_replay"]["fraction_outside_trainer_support"] == pytest.approx(1 / 6)
    bound = diagnose.parse_bounds(["fraction_outside_0.9_1.1_without_replay=0.5"], "--fail-above")
    with pytest.raises(Exception, match="no kept set was replayed"):
        diagnose.gate(plain["summary"], bound, [], plain["summary_notes"])


@pytest.mark.slow
def test_cli_diagnose_replays_the_hf_engines_set(tmp_path):
    """``offpolicy diagnose`` on the embedded tiny model, a bf16 engine with logit noise σ = 1 at top_p 0.8: the
    trainer scores on the engine's sets (no engine token outside), and the report says what the trainer's
    own sets would have left out."""
    out = tmp_path / "d"
    result = run_cli("diagnose", "--engine", "hf", "--engine-dtype", "bf16", "--engine-logit-noise", "1.0", "--top-p",
                     "0.8", "--temperature", "0.7", "--n", "16", "--max-tokens", "8", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    kept = report["kept_set"]
    assert kept["applied"] == "replayed" and report["summary"]["kept_set_replayed"] == 1.0
    assert kept["with_replay"]["fraction_outside_trainer_support"] == 0.0 == report["fraction_outside_trainer_support"]
    assert kept["without_replay"]["fraction_outside_trainer_support"] > 0
    assert "without replay: outside trainer's set" in result.stdout


def test_a_train_step_replays_the_hf_engines_set(offpolicy_cache, tmp_path):
    """The setting of ``test_outside_support.py``'s issue test (a bf16 engine with logit noise σ = 1 at top_k 10,
    top_p 0.9, π_old in micro-batches), with the engine's sets: no engine token falls outside the trainer's
    set, and the step says the set was replayed."""
    from conftest import FAST

    from offpolicy.train.config import load_train_config
    from offpolicy.train.loop import train

    cfg = load_train_config(None, [*FAST, "steps=1", "engine.dtype=bf16", "sampling.top_k=10", "sampling.top_p=0.9", "sampling.temperature=0.7",
                                   "engine.logit_noise=1.0", "recompute_old=true", "trainer.micro_batch_tokens=64",
                                   "preset=verl:decoupled_token_is", f"out_dir={tmp_path / 'run'}"])
    train(cfg, progress=False)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["offpolicy/kept_set_replayed"] == 1.0
    assert row["offpolicy/outside_support_tokens"] == 0
    assert row["offpolicy/grad_norm"] > 0
