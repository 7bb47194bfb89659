"""The hf engine and the eval after issue #31: sampling bit for bit what the ``output_scores`` path drew,
without keeping a step's scores; μ drawn from the logged sampling config alone (never the model's
``generation_config.json``), with one line naming what was ignored; noise drawn reproducibly."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from offpolicy.measure import diagnose
from offpolicy.measure.diagnose_config import DiagnoseConfig
from offpolicy.engines import SamplingConfig, perturb
from offpolicy.engines.base import left_pad
from offpolicy.engines.generation import generate, explicit_config, without_model_defaults
from offpolicy.engines.hf import HFEngine
from offpolicy.tasks import make_task, problems
from offpolicy.tasks.tokenizer import build_char_tokenizer, prompt_ids
from offpolicy.policy.warmstart import exact_match_accuracy

from hf_fixtures import char_model_dir  # noqa: E402

# what Qwen2.5-Instruct-like files ask for: sampling fields (temperature/top-k/top-p) and processors that
# change the distribution, one of them (suppress_tokens) off only as None
GREEDY_CHANGING = {"repetition_penalty": 1.1, "no_repeat_ngram_size": 1, "top_k": 20, "temperature": 0.7}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return char_model_dir(tmp_path_factory.mktemp("tiny-engine"), hidden_size=64, num_layers=2, seed=3)


@pytest.fixture(scope="module")
def opinionated_dir(tiny_dir, tmp_path_factory) -> Path:
    """The same model, with a generation_config.json that asks for more than offpolicy samples with."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-opinionated")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **GREEDY_CHANGING}))
    return path


class _OldLogitNoise(LogitsProcessor):
    """engines/hf.py's noise at 4efb1a7: drawn on a CPU generator, then moved."""

    def __init__(self, sigma, generator):
        self.sigma, self.generator = sigma, generator

    def __call__(self, input_ids, scores):
        noise = torch.randn(scores.shape, generator=self.generator, dtype=torch.float32).to(scores.device, scores.dtype)
        return torch.where(torch.isfinite(scores), scores + self.sigma * noise, scores)


def output_scores_generate(engine: HFEngine, prompts, sampling: SamplingConfig, seed: int):
    """HFEngine.generate at 4efb1a7, kept as the reference: every step's scores, stacked [B, steps, V]."""
    pad = engine.tokenizer.pad_token_id
    input_ids, attention = left_pad(prompts, pad)
    torch.manual_seed(seed)
    processors = LogitsProcessorList()
    if engine.logit_noise > 0:
        processors.append(_OldLogitNoise(engine.logit_noise, torch.Generator().manual_seed(seed + 1)))
    out = engine.model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                                temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k if sampling.top_k > 0 else 0, max_new_tokens=sampling.max_tokens,
                                logits_processor=processors, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=pad, eos_token_id=engine.stop)
    new_tokens = out.sequences[:, input_ids.shape[1]:]
    scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
    return new_tokens, scores.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("own_loop", [True, False], ids=["own_loop", "generate"])
@pytest.mark.parametrize(("dtype", "noise", "sampling"), [
    ("fp32", 0.0, SamplingConfig(max_tokens=10)),
    ("fp32", 0.5, SamplingConfig(max_tokens=10, temperature=0.7, top_k=10, top_p=0.9)),
    ("bf16", 0.0, SamplingConfig(max_tokens=10, temperature=1.3, top_p=0.8)),
])
def test_sampling_is_bit_for_bit_the_output_scores_path(tiny_dir, dtype, noise, sampling, own_loop):
    """Through transformers' generate: the output_scores path's tokens and log-probs, bit for bit. Through the
    engine's own loop (finished rows leave the forward; issue #49): the same tokens from the same random
    stream, the log-probs to the rounding of the smaller batches' GEMMs."""
    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny_dir), tok, dtype=dtype, logit_noise=noise)
    assert engine._own_loop  # the model can be driven by it: the generate parameter turns it off
    engine._own_loop = own_loop
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 6, seed=4)]
    rollouts = engine.generate(prompts, sampling, seed=7, version=0)
    tokens, logprobs = output_scores_generate(engine, prompts, sampling, seed=7)
    assert any(not f for f in rollouts.finished) and any(rollouts.finished)  # rows that stop, rows cut at the limit
    for i, (ids, lps) in enumerate(zip(rollouts.response_ids, rollouts.logprobs)):
        assert ids == tokens[i, : len(ids)].tolist()
        if own_loop:
            tolerance = 1e-4 if dtype == "fp32" else 5e-2
            assert torch.allclose(torch.tensor(lps), logprobs[i, : len(ids)], atol=tolerance, rtol=0)
        else:
            assert torch.equal(torch.tensor(lps), logprobs[i, : len(ids)])  # the same float32 numbers


@pytest.mark.parametrize("own_loop", [True, False], ids=["own_loop", "generate"])
def test_the_engine_draws_from_its_own_generator(tiny_dir, own_loop, monkeypatch):
    """Issue #66: the engine samples in its own thread beside the trainer's, whose activation checkpointing forks
    and resets torch's global generator. Reseeding the global generator before every forward of the engine's
    model (what such a reset does, at the worst moment) changes no draw: the engine samples from its own."""
    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny_dir), tok, dtype="fp32", logit_noise=0.3)
    engine._own_loop = own_loop
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 6, seed=4)]
    sampling = SamplingConfig(max_tokens=10, temperature=1.2, top_p=0.95)
    undisturbed = engine.generate(prompts, sampling, seed=7, version=0)
    forward = engine.model.forward

    @functools.wraps(forward)  # the same signature: generate() asks the forward what it takes
    def reseeding(*args, **kwargs):
        torch.manual_seed(1234)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", reseeding)
    disturbed = engine.generate(prompts, sampling, seed=7, version=0)
    assert disturbed.response_ids == undisturbed.response_ids and disturbed.logprobs == undisturbed.logprobs
    assert engine.generate(prompts, sampling, seed=8, version=0).response_ids != undisturbed.response_ids  # seeded


def test_the_own_loop_leaves_finished_rows_out_of_the_forward(tiny_dir, monkeypatch):
    """Each forward after the first runs only the rows that have not drawn a stop token: the batch shrinks as
    rows finish, never below the rows still running, and transformers' generate is not called."""
    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny_dir), tok)
    rows = []
    forward = engine.model.forward

    @functools.wraps(forward)
    def spy(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", spy)
    monkeypatch.setattr(engine.model, "generate", lambda *a, **k: pytest.fail("generate was called"))
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 12, seed=4)]
    rollouts = engine.generate(prompts, SamplingConfig(max_tokens=10), seed=7, version=0)
    lengths = [len(r) for r in rollouts.response_ids]
    assert rows[0] == 12 and rows == sorted(rows, reverse=True) and rows[-1] < 12
    for step, batch in enumerate(rows[1:], start=1):  # forward k feeds the token drawn at step k − 1
        assert batch == sum(1 for n, done in zip(lengths, rollouts.finished) if n > step or (n == step and not done))


def test_a_model_the_own_loop_cannot_drive_goes_through_generate(tiny_dir):
    from offpolicy.engines.hf import own_loop_fits

    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny_dir), tok)
    assert own_loop_fits(engine.model)

    class NoLogitsToKeep(torch.nn.Module):
        config = engine.model.config

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None):
            raise AssertionError("not called")

    assert not own_loop_fits(NoLogitsToKeep())


def test_generate_keeps_no_step_scores(tiny_dir, monkeypatch):
    """O(B·V) memory: generate (the engine's path for a model its own loop cannot drive) is never asked for
    per-step scores or logits (B·steps·V each)."""
    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny_dir), tok)
    engine._own_loop = False
    seen = {}
    original = engine.model.generate

    def spy(*args, **kwargs):
        config = kwargs.get("generation_config")
        seen.update(kwargs, scores=getattr(config, "output_scores", None), logits=getattr(config, "output_logits", None),
                    as_dict=getattr(config, "return_dict_in_generate", None))
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.model, "generate", spy)
    engine.generate([[1, 5, 6]] * 2, SamplingConfig(max_tokens=4, top_k=5), seed=0, version=0)
    assert not seen.get("output_scores") and not seen.get("output_logits") and not seen.get("return_dict_in_generate")
    assert not seen["scores"] and not seen["logits"] and not seen["as_dict"]


def test_mu_ignores_the_models_generation_config(opinionated_dir, tiny_dir):
    """A fp32 engine against a fp32 trainer is at the rounding floor although the model's own file asks
    for a repetition penalty and top-k 20 (4efb1a7 sampled from them: kl_k3 ~1e-3 here), and one
    warning line names what was ignored."""
    tok = build_char_tokenizer()
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 16, seed=5)]
    # the engine's own logger, read directly: under xdist a worker has run other tests first, and host
    # frameworks' logging setups (AReaL's dictConfig, Ray's) can disable or reroute loggers caplog reads at root
    records: list[logging.LogRecord] = []
    engine_log = logging.getLogger("offpolicy.engines.hf")
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    engine_log.addHandler(handler)
    try:
        with mock.patch.object(engine_log, "disabled", False), mock.patch.object(engine_log, "level", logging.WARNING):
            s = diagnose.sample(diagnose.TrainerSide(opinionated_dir, SamplingConfig(max_tokens=12)), tok, prompts,
                                "hf", "fp32", seed=1)
    finally:
        engine_log.removeHandler(handler)
    m = diagnose.mismatch(s)
    assert m["kl_k3"] < 1e-10 and m["abs_logp_diff_max"] < 1e-5, m
    lines = [r.getMessage() for r in records if "generation_config.json" in r.getMessage()]
    assert len(lines) == 1
    for asked in ("repetition_penalty=1.1", "no_repeat_ngram_size=1", "top_k=20", "temperature=0.7"):
        assert asked in lines[0]
    # the same draws as from a model whose file asks for nothing
    plain = HFEngine(str(tiny_dir), tok).generate(prompts, SamplingConfig(max_tokens=12), seed=1, version=0)
    again = HFEngine(str(opinionated_dir), tok).generate(prompts, SamplingConfig(max_tokens=12), seed=1, version=0)
    assert plain.response_ids == again.response_ids


def test_the_eval_decodes_with_its_own_config_alone(opinionated_dir, tiny_dir):
    """Greedy and sampled evals give the same completions whatever the model's file asks for (its
    no_repeat_ngram_size = 1 alone changes a greedy decode), and the file is untouched afterwards."""
    from transformers import AutoModelForCausalLM

    tok = build_char_tokenizer()
    task = make_task("reverse")
    batch = problems(task, 8, seed=6)

    def completions(path, seed):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        texts = []
        exact_match_accuracy(model, tok, task, batch, 12, sample_seed=seed, score=lambda p, t: texts.append(t) or 0.0)
        return texts, model

    for seed in (None, 11):
        want, _ = completions(tiny_dir, seed)
        got, model = completions(opinionated_dir, seed)
        assert got == want
        assert model.generation_config.no_repeat_ngram_size == 1  # restored after the eval
    # and the file really would change a greedy decode if generate read it
    model = AutoModelForCausalLM.from_pretrained(opinionated_dir, dtype=torch.float32)
    ids, attention = left_pad([prompt_ids(tok, p) for p in batch], tok.pad_token_id)
    own = generate(model, ids, attention, explicit_config(do_sample=False, max_new_tokens=12, stop=[tok.eos_token_id],
                                                          pad=tok.pad_token_id))
    with_file = model.generate(input_ids=ids, attention_mask=attention, do_sample=False, max_new_tokens=12,
                               pad_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id])
    assert not torch.equal(own, with_file)
    with without_model_defaults(model):
        assert model.generation_config.no_repeat_ngram_size is None


def test_noise_is_drawn_on_the_weights_device_and_reproducible_on_cpu():
    """perturb: on the CPU the same draws as the CPU generator always gave (seed → same ε, tensor after
    tensor); the generator is the tensor's device's."""
    weights = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("n", torch.tensor([1, 2]))]
    got = dict(perturb(weights, 0.1, seed=9))
    g = torch.Generator().manual_seed(9)
    for name, w in weights[:2]:
        want = w + 0.1 * w.std() * torch.randn(w.shape, generator=g, dtype=torch.float32)
        assert torch.equal(got[name], want)
    assert torch.equal(got["n"], weights[2][1])  # integers untouched
    assert all(torch.equal(a, b) for a, b in zip(dict(perturb(weights, 0.1, seed=9)).values(), got.values()))
    if torch.cuda.is_available():
        cuda = [(n, w.cuda()) for n, w in weights]
        on_gpu = dict(perturb(cuda, 0.1, seed=9))
        assert all(t.device.type == "cuda" for t in on_gpu.values())
        assert torch.equal(on_gpu["a"], dict(perturb(cuda, 0.1, seed=9))["a"])  # deterministic per seed


def test_the_eval_generates_under_the_trainers_precision(tiny_dir, monkeypatch):
    """trainer.dtype=bf16: the eval's generate runs under bf16 autocast over the fp32 weights, as the
    update's forward does (4efb1a7 generated in fp32 without autocast)."""
    from transformers import AutoModelForCausalLM

    from offpolicy.policy import warmstart

    seen = []
    real = warmstart.generate

    def spy(model, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                     next(model.parameters()).dtype))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(warmstart, "generate", spy)
    tok = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    batch = problems(make_task("reverse"), 2, seed=0)
    exact_match_accuracy(model, tok, make_task("reverse"), batch, 4, sample_seed=None, trainer_dtype="bf16")
    exact_match_accuracy(model, tok, make_task("reverse"), batch, 4, sample_seed=None)
    assert seen == [(True, torch.bfloat16, torch.float32), (False, seen[1][1], torch.float32)]


def test_diagnose_scores_with_trains_loader_and_forward(tiny_dir):
    """--trainer-dtype bf16 is bf16 autocast over fp32 weights — score.load_policy + Scorer.forward, the
    very numbers train computes — not bf16 weights (4efb1a7); and the CLI's default is train's `auto`."""
    from offpolicy import cli
    from offpolicy.policy import score
    from offpolicy.policy.score import Scorer

    tok = build_char_tokenizer()
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 8, seed=2)]
    sampling = SamplingConfig(max_tokens=8)
    s = diagnose.sample(diagnose.TrainerSide(tiny_dir, sampling, "bf16"), tok, prompts, "hf", "fp32", seed=0)
    cpu = torch.device("cpu")
    with torch.no_grad():
        want = Scorer(score.load_policy(tiny_dir, cpu).eval(), sampling, cpu, "bf16").forward(s.batch).logprobs
    counted = s.batch.mask.bool()
    assert torch.equal(s.trainer[counted], want[counted])
    assert 0 < float((s.trainer - s.batch.rollout_logprobs)[counted].abs().max()) < 0.5  # bf16 compute really ran
    assert DiagnoseConfig().trainer.dtype == "auto" and "trainer_dtype" not in vars(cli.build_parser().parse_args(["diagnose"]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [-1, 3])
@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.9])
def test_engine_and_trainer_keep_the_same_tokens_under_exact_ties(temperature, top_k, top_p):
    """Issue #43: with exactly tied probabilities at the top-p cut, the hf engine's warpers (transformers'
    sort, ascending) and the trainer's renormalize_logprobs (descending) kept different tokens at 3be706e.
    Both now take one tie rule (offpolicy.core.sampling.top_p_keep): the kept sets agree, row by row."""
    from offpolicy.engines.hf import warpers
    from offpolicy.core.sampling import renormalize_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (256, 12), generator=g).float()  # few distinct values: ties everywhere
    sampling = SamplingConfig(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    scores = logits.clone()
    for warper in warpers(sampling):
        scores = warper(None, scores)
    engine_kept = torch.isfinite(scores)
    trainer_kept = torch.isfinite(renormalize_logprobs(logits, top_p=top_p, top_k=top_k, temperature=temperature))
    assert (engine_kept.sum(-1) < (logits > -1).sum(-1)).any()  # the nucleus cuts somewhere
    assert torch.equal(engine_kept, trainer_kept)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 1.0), (3, 1.0), (-1, 0.8), (5, 0.6)])
@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_engine_and_trainer_keep_the_same_tokens_under_min_p(temperature, top_k, top_p, min_p):
    """Issue #69: min-p in the sampling contract. The hf engine's warpers (transformers' order: top-k → top-p →
    min-p) and the trainer's renormalisation in that order (min_p_last, the hf engine's) keep the same tokens."""
    from offpolicy.engines.hf import HFEngine, warpers
    from offpolicy.core.sampling import renormalize_logprobs

    g = torch.Generator().manual_seed(1)
    logits = torch.randn((256, 40), generator=g) * 2
    sampling = SamplingConfig(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    scores = logits.clone()
    for warper in warpers(sampling):
        scores = warper(None, scores)
    engine_kept = torch.isfinite(scores)
    trainer = renormalize_logprobs(logits, **sampling.model_copy(update={"min_p_order": HFEngine.min_p_order}).support())
    assert (engine_kept.sum(-1) < 40).any()  # min-p cuts somewhere
    assert torch.equal(engine_kept, torch.isfinite(trainer))


def test_the_hf_engine_samples_and_the_trainer_scores_on_the_min_p_support(tiny_dir):
    """fp32 engine and trainer, min-p with top-p: every sampled token lies in the trainer's own kept set (computed
    in the engine's order, no replay), and its log-prob there equals the engine's to fp32 rounding."""
    from offpolicy.core.sampling import renormalize_logprobs

    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny_dir), tok, dtype="fp32")
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 6, seed=4)]
    sampling = SamplingConfig(max_tokens=8, temperature=1.3, top_p=0.9, min_p=0.15)
    rollouts = engine.generate(prompts, sampling, seed=3, version=0)
    support = sampling.model_copy(update={"min_p_order": engine.min_p_order}).support()
    for prompt, ids, lps in zip(prompts, rollouts.response_ids, rollouts.logprobs):
        full = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = engine.model(input_ids=full).logits[0, len(prompt) - 1: -1].float()
        mine = renormalize_logprobs(logits, **support).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, torch.tensor(lps), atol=1e-5, rtol=0)
    assert rollouts.kept is not None  # min-p truncates: the engine records its kept sets for replay


@pytest.mark.parametrize("own_loop", [True, False], ids=["own_loop", "generate"])
@pytest.mark.parametrize("sampling", [SamplingConfig(max_tokens=10), SamplingConfig(max_tokens=8, top_p=0.8),
                                      SamplingConfig(max_tokens=10, temperature=0.7, top_k=10, top_p=0.9)])
def test_a_repeated_prompt_is_prefilled_once_and_samples_as_before(tiny_dir, sampling, own_loop, monkeypatch):
    """Issue #49: a GRPO batch (each prompt group-size times) prefills each distinct prompt once and copies its
    KV cache to the prompt's rows. Against the engine with the sharing turned off: the same tokens from the same
    random stream, and log-probs equal to the rounding of a smaller GEMM; the kept sets the same. A batch of
    distinct prompts takes no shared cache (so the bit-for-bit test above still holds)."""
    tok = build_char_tokenizer()
    engine = HFEngine(str(tiny_dir), tok)
    engine._own_loop = own_loop
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 4, seed=11) for _ in range(6)]
    shapes = []
    forward = engine.model.forward

    @functools.wraps(forward)  # generate reads the forward's signature (position_ids, logits_to_keep)
    def spy(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", spy)
    for seed in range(4):
        shapes.clear()
        shared = engine.generate(prompts, sampling, seed=seed, version=0)
        width = max(map(len, prompts))
        if own_loop:  # the distinct prompts whole, then the first drawn tokens of the rows that did not stop
            assert shapes[0] == (4, width) and shapes[1][0] <= 24 and shapes[1][1] == 1
        else:  # the distinct prompts but their last token, then generate's own first forward: that token
            assert shapes[:2] == [(4, width - 1), (24, 1)]
        with monkeypatch.context() as plain:
            plain.setattr(engine, "_shared_prompts", lambda *args, **kwargs: None)
            full = engine.generate(prompts, sampling, seed=seed, version=0)
        assert shared.response_ids == full.response_ids and shared.finished == full.finished
        for a, b in zip(shared.logprobs, full.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
        if sampling.top_p < 1 or sampling.top_k > 0:
            assert all(torch.equal(getattr(shared.kept, f), getattr(full.kept, f)) for f in ("start", "count", "ids"))
    shapes.clear()
    distinct = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 5, seed=12)]
    assert len(set(map(tuple, distinct))) == 5
    engine.generate(distinct, sampling, seed=0, version=0)
    assert shapes[0] == (5, max(map(len, distinct)))  # generate's own prefill


@pytest.mark.parametrize(("family", "extra"), [("mistral", {"sliding_window": 4}), ("gemma2", {"sliding_window": 4}),
                                               ("qwen3", {}), ("llama", {})])
def test_the_own_loop_draws_generates_tokens_across_architectures(family, extra, tmp_path):
    """Sliding-window caches (mistral), hybrid sliding/global layers with soft-capped logits (gemma2), qk-norm
    (qwen3): the engine's own loop, with repeated prompts shared, draws transformers' generate's tokens, the
    log-probs to fp32 rounding."""
    import transformers

    tok = build_char_tokenizer()
    config_cls, model_cls = {"mistral": ("MistralConfig", "MistralForCausalLM"),
                             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                             "llama": ("LlamaConfig", "LlamaForCausalLM")}[family]
    config = getattr(transformers, config_cls)(
        vocab_size=64 * ((len(tok) + 63) // 64), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(0)
    getattr(transformers, model_cls)(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path), tok)
    assert engine._own_loop
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(4, len(tok), (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (6,),
                                                                                                 generator=g)]
    prompts = [p for p in distinct for _ in range(3)]
    sampling = SamplingConfig(max_tokens=12, top_p=0.9)
    own = engine.generate(prompts, sampling, seed=3, version=0)
    engine._own_loop = False
    through_generate = engine.generate(prompts, sampling, seed=3, version=0)
    assert own.response_ids == through_generate.response_ids and any(own.finished)
    for a, b in zip(own.logprobs, through_generate.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def llama_dir(path: Path, tok, vocab: int, seed: int = 0, eos_scale: float = 0.0, **extra) -> Path:
    """A two-layer Llama of ``vocab`` tokens saved with ``tok`` (built in code); ``eos_scale`` > 0 makes the stop
    token the likeliest at about half the positions (its output row a large random vector), so rows finish early."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id, **{"max_position_embeddings": 64, **extra})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    if eos_scale:
        with torch.no_grad():
            model.lm_head.weight[tok.eos_token_id] = eos_scale * torch.randn(32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("sampling", [SamplingConfig(max_tokens=14, top_k=5), SamplingConfig(max_tokens=14, top_p=0.5)],
                         ids=["top_k", "top_p"])
def test_a_finished_row_records_no_kept_set(sampling, tmp_path, monkeypatch):
    """Issue #55 item 2: the own loop gives finished rows all-zero logits (they left the forward), where every
    token ties; on 65ba3dd the recorder stored the whole vocabulary as their kept set every step (V = 8,192,
    16 rows, top_k 5: 1,311,040 ids against 1,120 through generate). Now a finished row records nothing: each
    step records the running rows' sets alone, at most what generate's path records (it runs every row to
    the end), and the tokens, log-probs and assembled kept sets are generate's."""
    from offpolicy.core.kept_set import StepRecorder

    tok = build_char_tokenizer()
    engine = HFEngine(str(llama_dir(tmp_path, tok, 8192, eos_scale=8.0)), tok)
    assert engine._own_loop
    recorded, live = [], []
    add = StepRecorder.add

    def counting(self, keep, *args, **kwargs):  # the kept ids' q_v too, where recorded (score centering)
        recorded.append(int(keep.sum()))
        return add(self, keep, *args, **kwargs)

    monkeypatch.setattr(StepRecorder, "add", counting)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, len(tok), (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (16,), generator=g)]
    own = engine.generate(prompts, sampling, seed=5, version=0)
    own_counts = list(recorded)
    recorded.clear()
    engine._own_loop = False
    through_generate = engine.generate(prompts, sampling, seed=5, version=0)
    assert own.response_ids == through_generate.response_ids and own.finished == through_generate.finished
    assert sum(own.finished) >= 4 and not all(len(r) == len(own.response_ids[0]) for r in own.response_ids)
    for a, b in zip(own.logprobs, through_generate.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    assert all(torch.equal(getattr(own.kept, f), getattr(through_generate.kept, f)) for f in ("start", "count", "ids"))
    # step t records the sets of the rows still running at t: those whose response reaches past t − 1 unfinished
    lengths = [len(r) for r in own.response_ids]
    for step, total in enumerate(own_counts):
        running = [i for i, n in enumerate(lengths) if n > step]
        assert total == int(own.kept[running, [step] * len(running)].count.sum()) if running else total == 0
    assert sum(own_counts) <= sum(recorded)
    if sampling.top_k > 0:  # generate: 5 ids for every row at every step (~1,120); the own loop fewer
        assert sum(recorded) == 16 * 5 * len(recorded) and max(own_counts) <= 16 * 5


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_length_dependent_rotary_samples_through_generate_without_sharing(rope, tmp_path):
    """A rope whose frequencies follow the forward's longest position (issue #55 item 1) changes as the own loop
    drops finished rows and as a shared prefill computes the prompts alone: the engine takes generate, whole
    prompts, and its speed paths say why."""
    import transformers

    tok = build_char_tokenizer()
    common = dict(vocab_size=64 * ((len(tok) + 63) // 64), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    if rope == "dynamic":
        config = transformers.LlamaConfig(**common, max_position_embeddings=8,
                                          rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Phi3Config(
            **common, max_position_embeddings=64, original_max_position_embeddings=8,
            rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 8.0,
                             "original_max_position_embeddings": 8, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
        model = transformers.Phi3ForCausalLM(config)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path), tok)
    assert not engine._own_loop
    for key in ("hf_own_loop", "hf_shared_prefill"):
        assert engine.speed_paths[key].startswith(("transformers' model.generate", "every row computes")), key
        assert "changes its frequencies with the forward's length" in engine.speed_paths[key]
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]] * 3
    input_ids, attention = left_pad(prompts, tok.pad_token_id)
    assert engine._shared_prompts(prompts, input_ids, attention, whole=False) is None
    rollouts = engine.generate(prompts, SamplingConfig(max_tokens=6), seed=0, version=0)
    assert len(rollouts.response_ids) == 6


def unreviewed_generation_fields(neutral, not_sampling) -> tuple[list[str], list[str]]:
    """The installed transformers' ``GenerationConfig()`` fields in neither table, and the tables' names that are no
    field of it (a renamed field: the table would neutralise a name transformers no longer reads)."""
    from transformers import GenerationConfig

    fields = set(GenerationConfig().to_dict())
    return sorted(fields - set(neutral) - set(not_sampling)), sorted((set(neutral) | set(not_sampling)) - fields)


def test_neutral_covers_every_field_of_the_installed_generation_config():
    """engines/generation.py's NEUTRAL is written by hand (issue #68): every field of the installed transformers'
    GenerationConfig() is either neutralised there or listed as one that cannot change the sampled distribution,
    every name in either table is a field of it, and explicit_config sets each neutral value it holds."""
    from offpolicy.engines.generation import NEUTRAL, NOT_SAMPLING, explicit_config

    unreviewed, stale = unreviewed_generation_fields(NEUTRAL, NOT_SAMPLING)
    assert not unreviewed, (f"GenerationConfig fields neither neutralised (NEUTRAL) nor listed as not sampling "
                            f"(NOT_SAMPLING): {unreviewed}")
    assert not stale, f"names in NEUTRAL or NOT_SAMPLING that the installed GenerationConfig does not have: {stale}"
    assert not set(NEUTRAL) & NOT_SAMPLING
    applied = explicit_config(do_sample=True, max_new_tokens=4, stop=[0], pad=0).to_dict()
    assert {k: applied[k] for k, v in NEUTRAL.items() if v is not None} == {k: v for k, v in NEUTRAL.items()
                                                                           if v is not None}
    # the check fails on a field left out of both tables, and on a name the installed transformers does not have
    assert unreviewed_generation_fields({k: v for k, v in NEUTRAL.items() if k != "top_k"}, NOT_SAMPLING)[0] == [
        "top_k"]
    assert unreviewed_generation_fields({**NEUTRAL, "top_q": 1.0}, NOT_SAMPLING)[1] == ["top_q"]
