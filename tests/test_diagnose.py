"""`offpolicy diagnose` on the HF engine (bf16 engine vs fp32 trainer as the mismatch source):
report schema, what-if numbers equal to `correct` on the same tensors, breakdowns, CLI errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

import offpolicy as op
from offpolicy.measure import diagnose
from offpolicy.engines import SamplingConfig
from offpolicy.tasks import make_task, problems
from offpolicy.tasks.tokenizer import build_char_tokenizer, prompt_ids

from cli_inprocess import offpolicy  # noqa: E402
from hf_fixtures import char_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return char_model_dir(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, seed=2)


def diag(*args: str, cache: Path | None = None, process: bool = False) -> subprocess.CompletedProcess:
    """``offpolicy diagnose ARGS``: in this process (tests/cli_inprocess.py), or with ``process`` as its own
    ``python -m offpolicy`` (the report test: the command as typed, end to end)."""
    return offpolicy("diagnose", *args, env={**os.environ, **({"OFFPOLICY_CACHE": str(cache)} if cache else {})},
                     process=process)


@pytest.fixture(scope="module")
def bf16_sample(tiny_model):
    tok = build_char_tokenizer()
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 48, seed=1)]
    return diagnose.sample(diagnose.TrainerSide(tiny_model, SamplingConfig(max_tokens=12)), tok, prompts, "hf", "bf16")


def test_what_if_equals_correct_on_the_same_tensors(bf16_sample):
    s = bf16_sample
    rows = {r["preset"]: r for r in diagnose.what_if(s)}
    assert set(rows) == set(op.presets.names())
    for name in ("recommended", "verl:decoupled_geo_rs", "trl:sequence_mask", "skyrl:token_mask"):
        out = op.correct(s.trainer, s.batch.rollout_logprobs, s.batch.mask, name, logprobs=s.trainer,
                         advantages=torch.zeros_like(s.batch.mask))
        assert rows[name]["token_rejected"] == out.metrics["masked_fraction"]
        assert rows[name]["weight_mean"] == out.metrics["is_mean"]
        assert rows[name]["ess"] == out.metrics["is_ess"]
        non_empty = s.batch.mask.any(-1)
        expected_seq = float((non_empty & ~out.mask.bool().any(-1)).sum() / non_empty.sum())
        assert rows[name]["seq_rejected"] == pytest.approx(expected_seq)


def test_bf16_engine_has_small_nonzero_mismatch(bf16_sample):
    m = diagnose.mismatch(bf16_sample)
    assert 0 < m["abs_logp_diff_mean"] < 0.05
    b = diagnose.breakdowns(bf16_sample)
    assert sum(r["tokens"] for r in b["by_probability"]) == m["valid_tokens"]
    assert sum(r["tokens"] for r in b["by_position"]) == m["valid_tokens"]
    assert sum(r["abs_log_ratio_share"] for r in b["by_probability"]) == pytest.approx(1.0)
    assert 0 <= b["fraction_abs_log_ratio_above"]["log2"] <= b["fraction_abs_log_ratio_above"]["log1.1"] <= 1


def test_ratio_band_shares_are_exact_bands():
    # ρ = 0.905 is inside [0.9, 1.1] but |log ρ| = 0.0998 > log 1.1 = 0.0953: the log band is [0.909, 1.1]
    ratios = torch.tensor([[0.89, 0.905, 1.05, 1.12, 0.7, 2.5, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.float32)  # the last token is padding
    rollout = torch.full_like(ratios, -3.0)
    zeros = torch.zeros_like(ratios, dtype=torch.long)
    batch = diagnose.Batch(input_ids=zeros, attention_mask=zeros, positions=zeros, response_ids=zeros, mask=mask,
                           rollout_logprobs=rollout, versions=torch.zeros(1, dtype=torch.long))
    s = diagnose.Sample(batch, rollout + ratios.log(), None)
    b = diagnose.breakdowns(s)
    # outside [0.9, 1.1]: 0.89, 1.12, 0.7, 2.5; outside [0.8, 1.25]: 0.7, 2.5; outside [0.5, 2]: 2.5 — of 6
    assert b["fraction_ratio_outside"] == pytest.approx({"0.9_1.1": 4 / 6, "0.8_1.25": 2 / 6, "0.5_2": 1 / 6})
    assert b["fraction_abs_log_ratio_above"]["log1.1"] == pytest.approx(5 / 6)  # 0.905 too
    values, _ = diagnose.summary({"mismatch": diagnose.mismatch(s), "breakdowns": b, "what_if": []}, None)
    assert values["fraction_outside_0.9_1.1"] == pytest.approx(4 / 6)
    bounds = diagnose.parse_bounds(["fraction_outside_0.9_1.1=0.5"], "--fail-above")
    assert diagnose.gate(values, bounds, []) == [
        "FAIL fraction_outside_0.9_1.1 = 0.666667 is above the bound 0.5 (--fail-above fraction_outside_0.9_1.1=0.5)"]


def test_tokens_outside_the_trainers_top_p_set_are_counted_not_fatal(tmp_path):
    # under top-p each side keeps its own set: the engine sampled token (0, 1) from its set, the trainer's set
    # lacks it (log π = −inf). It is counted and left out; the rest is measured as usual.
    rollout = torch.tensor([[-0.5, -2.0, -0.1], [-0.3, -0.2, -0.4]])
    trainer = rollout + torch.tensor([[0.01, 0.0, -0.02], [0.0, 0.03, 0.0]])
    trainer[0, 1] = float("-inf")
    mask = torch.ones(2, 3)
    zeros = torch.zeros(2, 3, dtype=torch.long)
    batch = diagnose.Batch(input_ids=zeros, attention_mask=zeros, positions=zeros, response_ids=zeros, mask=mask,
                           rollout_logprobs=rollout, versions=torch.zeros(2, dtype=torch.long))
    r = diagnose.report(diagnose.Sample(batch, trainer, None), {"name": "x", "label": "x"}, tmp_path)
    assert r["fraction_outside_trainer_support"] == pytest.approx(1 / 6)
    assert r["summary"]["fraction_outside_trainer_support"] == pytest.approx(1 / 6)
    assert r["mismatch"]["valid_tokens"] == 5 and r["tokens"] == 6
    # kl_k1 = mean(log μ − log π) over the 5 kept tokens = −(0.01 − 0.02 + 0.03) / 5
    assert r["mismatch"]["kl_k1"] == pytest.approx(-0.02 / 5, abs=1e-7)


@pytest.mark.slow
def test_cli_report_and_plots(tiny_model, tmp_path):
    out = tmp_path / "d"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"rev {n}="}) for n in (123, 4567, 89)) + "\n")
    result = diag("--model", str(tiny_model), "--engine", "hf", "--prompts", str(prompts), "--n", "24",
                  "--max-tokens", "8", "--out", str(out), process=True)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert {"setting", "samples", "tokens", "mismatch", "breakdowns", "what_if", "plots"} <= report.keys()
    assert report["samples"] == 24
    for key in ("kl_k1", "kl_k3", "ppl_ratio", "chi2_token", "chi2_seq", "ess", "abs_logp_diff_max"):
        assert key in report["mismatch"]
    for plot in report["plots"]:
        assert Path(plot).stat().st_size > 5_000
    assert "what-if" in result.stdout and "recommended" in result.stdout


@pytest.mark.slow
def test_cli_compare_fp32_has_no_mismatch(tiny_model, tmp_path):
    # the gate (issue #25) applies to every setting: bf16 fails this bound, fp32 holds it → exit 3, one line
    result = diag("--model", str(tiny_model), "--engine", "hf", "--n", "16", "--max-tokens", "6",
                  "--compare", "engine_dtype=bf16,fp32", "--out", str(tmp_path / "c"),
                  "--fail-above", "max_abs_log_ratio=1e-4")
    assert result.returncode == 3, result.stderr[-2000:]
    failed = [line for line in result.stderr.splitlines() if "FAIL" in line]
    assert len(failed) == 1 and "bf16" in failed[0] and "max_abs_log_ratio" in failed[0]
    runs = json.loads((tmp_path / "c" / "report.json").read_text())["runs"]
    for r in runs:  # every setting's what-if table is printed, not only the first's (issue #30)
        assert f"what-if: each preset on this batch — {r['setting']['name']}" in result.stdout
    by = {r["setting"]["engine_dtype"]: r["mismatch"] for r in runs}
    assert by["fp32"]["abs_logp_diff_max"] < 1e-4 < by["bf16"]["abs_logp_diff_max"]
    for r in runs:  # the engine path has the trainer's logits: prime-rl's KL over entropy is there
        s = r["summary"]
        assert s["entropy"] > 0 and s["kl_over_entropy"] == pytest.approx(s["kl_k3"] / s["entropy"])


@pytest.mark.parametrize("content, message", [
    ("", "holds no prompt"),
    ('{"text": "a"}\n', "p.jsonl:1: each line needs a string field \\\"prompt\\\""),
    ("not json\n", "p.jsonl:1: not valid JSON"),
])
def test_cli_prompt_file_errors(tiny_model, tmp_path, content, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    result = diag("--model", str(tiny_model), "--engine", "hf", "--prompts", str(prompts))
    assert result.returncode == 2
    assert message.replace("\\", "") in result.stderr


def test_raw_prompts_carry_no_bos_the_tokenizer_does_not_add(tmp_path):
    from transformers import PreTrainedTokenizerFast

    # a tokenizer with a bos_token it never puts in front of text (SmolLM2's is <|im_start|>, a turn marker)
    char = build_char_tokenizer()
    chat = PreTrainedTokenizerFast(tokenizer_object=char.backend_tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", add_bos_token=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "rev 12="}) + "\n")
    assert diagnose.read_prompts(prompts, chat) == [chat("rev 12=", add_special_tokens=False).input_ids]
    assert diagnose.read_prompts(prompts, char)[0][0] == char.bos_token_id  # the char tokenizer's own rule adds it


def test_smollm2_raw_text_has_no_im_start(smollm2_dir, tmp_path):
    from offpolicy.tasks.dataset import render_prompts
    from offpolicy.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    assert tok.bos_token == "<|im_start|>"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 3?"}) + "\n")
    ids = diagnose.read_prompts(prompts, tok)[0]
    assert tok.decode(ids) == "What is 2 + 3?" and tok.bos_token_id not in ids
    assert render_prompts(tok, ["What is 2 + 3?"], None, "none") == [ids]


def test_cli_model_without_tokenizer(tmp_path):
    char_model_dir(tmp_path, with_tokenizer=False, hidden_size=64, num_layers=1)
    result = diag("--model", str(tmp_path), "--engine", "hf")
    assert result.returncode == 2 and "has no tokenizer files" in result.stderr


def test_cli_bad_compare(tiny_model):
    result = diag("--model", str(tiny_model), "--engine", "hf", "--compare", "colour=red")
    assert result.returncode == 2 and "expected KEY=V1,V2,..." in result.stderr


def test_diagnose_scores_as_train_does_in_token_budget_micro_batches(tiny_model, monkeypatch):
    """diagnose's trainer side is train's ``Scorer.score`` with the same token budget (issue #47): micro-batches
    of at most ``micro_batch_tokens`` padded tokens, trimmed of the padding no row uses, the same numbers to
    the bit as train's π_old on that batch. On f7091b3 diagnose cut fixed 64-row slices, untrimmed, and took
    no budget."""
    from offpolicy.engines import Rollouts
    from offpolicy.policy import score
    from offpolicy.policy.batch import to_batch

    g = torch.Generator().manual_seed(4)
    prompts = [[1, *torch.randint(5, 40, (n,), generator=g).tolist()] for n in (3, 9, 2, 6, 4, 8, 5, 7)]
    responses = [torch.randint(5, 40, (n,), generator=g).tolist() for n in (6, 1, 9, 3, 7, 2, 5, 4)]
    batch = to_batch(Rollouts(prompts, responses, [[-1.0] * len(r) for r in responses], [True] * 8, version=0), 0)
    sampling = SamplingConfig(max_tokens=10)
    whole = diagnose.score_batch(diagnose.TrainerSide(tiny_model, sampling, budget=None), batch)
    shapes = []
    real = score.trainer_scores
    monkeypatch.setattr(score, "trainer_scores", lambda model, mb, *a, **k: shapes.append(
        (tuple(mb.input_ids.shape), int(mb.attention_mask.sum(1).max()))) or real(model, mb, *a, **k))
    budget = 3 * 19  # a few rows a micro-batch (the longest row is 19 tokens)
    split = diagnose.score_batch(diagnose.TrainerSide(tiny_model, sampling, budget=budget), batch)
    assert len(shapes) > 1 and all(rows * width <= budget or rows == 1 for (rows, width), _ in shapes)
    assert all(width == used for (_, width), used in shapes)  # trimmed: no column of padding only
    counted = batch.mask.bool()
    torch.testing.assert_close(split.trainer[counted], whole.trainer[counted], rtol=0, atol=1e-5)
    model = score.load_policy(tiny_model, torch.device("cpu")).eval()
    trains = score.Scorer(model, sampling, torch.device("cpu"), "fp32", budget).score(batch).logprobs
    assert torch.equal(split.trainer[counted], trains.float()[counted])


@pytest.mark.parametrize("flags, message", [
    ({"top_k": 0}, "--top-k 0: expected -1"),
    ({"temperature": float("nan")}, "--temperature nan: expected a finite number > 0"),
    ({"compare": "seed=1,2"}, "--compare 'seed=1,2': expected KEY=V1,V2,..."),
    ({"trainer_micro_batch_tokens": 0}, "--trainer-micro-batch-tokens: Input should be greater than 0"),
    ({"batch": "d", "compare": "engine=hf,vllm"}, "--batch reports on the dumped tensors as they are"),
    ({"served_model_name": "m"}, "--served-model-name needs --engine-url URL"),
])
def test_diagnose_config_refuses_in_the_flags_words(flags, message):
    """``DiagnoseConfig`` is the command line's one set of rules (issue #47): a refused value is one
    ConfigError that names the flag, as ``offpolicy diagnose`` prints it."""
    from offpolicy.measure.diagnose_config import DiagnoseConfig

    with pytest.raises(op.ConfigError) as err:
        DiagnoseConfig(**flags)
    assert str(err.value).startswith(message), str(err.value)


# ============================================================ issue #56: pre-check, exact gate, self-check
def dump(directory: Path, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> Path:
    from offpolicy.integrations.dump import BatchDumper

    BatchDumper(directory, every=1, host="test").maybe_dump(0, old_logprobs=old, rollout_logprobs=rollout, mask=mask)
    return directory


def test_require_exact_passes_on_identical_log_probs_as_typed(tmp_path):
    rollout = -torch.rand(3, 5, generator=torch.Generator().manual_seed(0)) - 0.01
    path = dump(tmp_path / "d", rollout.clone(), rollout, torch.ones(3, 5))
    result = diag("--batch", str(path), "--out", str(tmp_path / "o"), "--require-exact", process=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exact: every log-ratio is 0 (15 tokens)" in result.stdout
    assert "gate passed" in result.stderr
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["exact"] == {"exact": True, "tokens": 15, "differing_tokens": 0, "first": None}
    assert report["summary"]["differing_tokens"] == 0


def test_require_exact_names_the_first_differing_token(tmp_path):
    """verl #7688 / NeMo-RL #3208: one token one fp32 step apart fails the gate, and the line says where —
    the lowest row, then its earliest position (row 1, position 3 comes before row 2, position 0); padding
    (mask 0) never counts."""
    rollout = torch.full((3, 6), -0.5)
    old = rollout.clone()
    old[2, 0] = -0.25
    old[1, 3] = torch.nextafter(torch.tensor(-0.5), torch.tensor(0.0))  # one fp32 ulp: log ρ ≈ 6e-8
    old[0, 5] = -9.0  # padding
    mask = torch.ones(3, 6)
    mask[0, 5] = 0
    path = dump(tmp_path / "d", old, rollout, mask)
    result = diag("--batch", str(path), "--out", str(tmp_path / "o"), "--require-exact")
    assert result.returncode == 3
    (line,) = [x for x in result.stderr.splitlines() if "FAIL" in x]
    assert line == ("offpolicy diagnose: FAIL --require-exact: 2 of 17 tokens have log π_train ≠ log μ; the first is "
                    "row 1, position 3: log π_train = -0.49999997, log μ = -0.5 (log ρ = 2.98e-08)")
    # without the flag the same run passes: the section is a report, the gate is opt-in
    assert diag("--batch", str(path), "--out", str(tmp_path / "o2")).returncode == 0


def test_exactness_counts_a_token_outside_the_trainers_support():
    rollout = torch.tensor([[-0.5, -0.7]])
    zeros = torch.zeros(1, 2, dtype=torch.long)
    batch = diagnose.Batch(input_ids=zeros, attention_mask=zeros, positions=zeros, response_ids=zeros,
                           mask=torch.tensor([[1.0, 0.0]]), rollout_logprobs=rollout, versions=torch.zeros(1, dtype=torch.long))
    # score_batch took token 1 out (log π = −inf there) and left the trainer's value 0 in its place
    s = diagnose.Sample(batch, torch.tensor([[-0.5, 0.0]]), None, outside=torch.tensor([[False, True]]),
                        token_text=[["a", "b"]])
    out = diagnose.exactness(s)
    assert out["differing_tokens"] == 1 and out["tokens"] == 2
    assert out["first"] == {"row": 0, "position": 1, "trainer_logprob": float("-inf"),
                            "engine_logprob": pytest.approx(-0.7), "log_ratio": float("-inf"), "token": "b"}


def test_sequence_precheck_warns_as_typed(tmp_path):
    """A dump of 60-token rows at mean log ρ = 0.03: Π ρ ≈ e^1.8 = 6 crosses TRL's cap of 3 on every row (and
    SkyRL's product mask's 2): the run warns, names the preset and both shares, and logs the distribution."""
    g = torch.Generator().manual_seed(1)
    rollout = -torch.rand(8, 60, generator=g) - 0.1
    old = rollout + 0.03 + 0.01 * torch.randn(8, 60, generator=g)
    path = dump(tmp_path / "d", old.clamp(max=0.0), rollout, torch.ones(8, 60))
    result = diag("--batch", str(path), "--out", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr[-2000:]
    out = " ".join(result.stdout.split())  # rich wraps long lines
    assert ("warning: trl:sequence_mask: weight (mask) Π ρ outside [0, 3] — the sequence weight Π ρ would mask "
            "most rows: predicted 100%") in out
    assert "warning: skyrl:product_mask: reject/0 (mask) Π ρ outside [0.5, 2]" in out
    assert "warning: trl:token_mask" not in out  # token-level: no product
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    seq = report["sequence_weight"]
    assert seq["mean_log_ratio"] == pytest.approx(float((old.clamp(max=0.0) - rollout).mean()), rel=1e-5)
    sums = (old.clamp(max=0.0) - rollout).sum(-1)
    assert seq["distribution"]["log_max"] == pytest.approx(float(sums.max()), rel=1e-5)
    assert report["summary"]["seq_log_weight_min"] == pytest.approx(float(sums.min()), rel=1e-5)
    rows = {r["preset"]: r for r in seq["presets"]}
    assert rows["trl:sequence_mask"]["measured_outside"] == 1.0 and rows["trl:sequence_mask"]["warn"]
    # the what-if table agrees: TRL's mask zeroes every row's weight
    what_if = {r["preset"]: r for r in report["what_if"]}
    assert what_if["trl:sequence_mask"]["weight_max"] == 0.0


def test_self_check_comparisons_by_hand():
    from offpolicy.measure import self_check
    a = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    b = a + torch.tensor([[0.0, 0.05, -0.2, 0.0]])
    b[0, 3] = float("-inf")  # not finite on one side: counted apart
    out = self_check.compare(a, b, torch.ones(1, 4))
    # Δ = a − b = 0, −0.05, 0.2 over 3 tokens: only 0.2 > log 1.1 = 0.0953
    assert out == pytest.approx({"tokens": 3, "not_finite": 1, "fraction_outside_0.9_1.1": 1 / 3,
                                 "fraction_differing": 2 / 3, "abs_log_diff_mean": 0.25 / 3, "abs_log_diff_max": 0.2})


def test_self_check_refuses_a_dump():
    from offpolicy.measure.diagnose_config import DiagnoseConfig

    with pytest.raises(op.ConfigError, match="--self-check scores the engine's tokens again"):
        DiagnoseConfig(batch="d", self_check=True)


@pytest.mark.slow
def test_cli_self_check(tiny_model, tmp_path):
    """``--self-check`` on the hf engine with a bf16 trainer: the three comparisons and the per-layer table.
    In fp32 an fp32 head changes nothing; the micro-batch comparison is the trainer's own scoring twice."""
    result = diag("--model", str(tiny_model), "--engine", "hf", "--n", "12", "--max-tokens", "6", "--trainer-dtype",
                  "bf16", "--trainer-micro-batch-tokens", "64", "--self-check", "--out", str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr[-2000:]
    check = json.loads((tmp_path / "s" / "report.json").read_text())["self_check"]
    trainer = check["trainer"]
    assert trainer["configured"]["dtype"] == "bf16" and trainer["configured"]["micro_batches"] > 1
    for part in ("packing", "micro_batch", "fp32_head", "fp32"):
        assert 0 <= trainer[part]["fraction_outside_0.9_1.1"] <= trainer[part]["fraction_differing"] <= 1
    assert "whole rows" in trainer["packing"]["against"] and "whole rows" in trainer["micro_batch"]["against"]
    assert trainer["fp32"]["fraction_differing"] > 0  # bf16 autocast against fp32: every token moves a little
    layers = check["layers"]
    assert [row["layer"] for row in layers["layers"]] == ["embedding", "layer 1", "layer 2 + final norm"]
    # the embedding's difference is bf16's rounding of the weights alone: below 2⁻⁸ relative
    assert 0 < layers["layers"][0]["relative_difference"] < 2 ** -8
    assert layers["head"]["tokens"] > 0 and layers["head"]["abs_log_diff_max"] > 0
    assert "self-check: the trainer against itself" in result.stdout and "where bf16 diverges from fp32" in result.stdout

    from offpolicy.measure import self_check
    from offpolicy.policy.score import Scorer, load_policy

    # the fp32 head's baseline is the configured scoring: in fp32 both columns are Scorer.score's numbers
    s = bf16_batch(tiny_model)
    scorer = Scorer(load_policy(tiny_model, torch.device("cpu")).eval(), SamplingConfig(max_tokens=12),
                    torch.device("cpu"), "fp32", 64)
    configured, fp32_head = self_check.fp32_head_score(scorer, s)
    counted = s.mask.bool()
    assert torch.equal(configured[counted], fp32_head[counted])
    torch.testing.assert_close(configured[counted], scorer.score(s).logprobs.float()[counted], rtol=0, atol=1e-5)


def bf16_batch(tiny_model):
    from offpolicy.engines.hf import HFEngine
    from offpolicy.policy.batch import to_batch

    tok = build_char_tokenizer()
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 6, seed=3)]
    rollouts = HFEngine(str(tiny_model), tok, "bf16").generate(prompts, SamplingConfig(max_tokens=8), seed=0, version=0)
    return to_batch(rollouts, tok.pad_token_id)


# ============================================================ issue #69: what the engine returned, and the engine on record
def sample_of(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor | None = None, **fields):
    mask = torch.ones_like(rollout) if mask is None else mask
    zeros = torch.zeros(rollout.shape, dtype=torch.long)
    batch = diagnose.Batch(input_ids=zeros, attention_mask=zeros, positions=zeros, response_ids=zeros, mask=mask,
                           rollout_logprobs=rollout, versions=torch.zeros(len(rollout), dtype=torch.long))
    return diagnose.Sample(batch, trainer, None, **fields)


SIDES = {"engine": {"backend": "vllm", "dtype": "bf16", "device": "cuda:0"},
         "trainer": {"backend": "transformers", "dtype": "fp32", "device": "cuda:0"}}


def test_recomputed_log_probs_are_flagged_only_where_the_sides_differ(tmp_path):
    """tinker-cloud #66: a hosted trainer returned its own log-probs as the sampler's — identical to the bit while
    the engine ran in bf16 on another backend: flagged, and the gate fails on it. The same identical numbers from an
    engine with the trainer's backend, dtype and device, or from too few tokens, are not."""
    lp = -torch.rand(4, 64, generator=torch.Generator().manual_seed(0)) - 0.02
    r = diagnose.report(sample_of(lp.clone(), lp, sides=SIDES), {"name": "x", "label": "x"}, tmp_path, plots=False)
    rec = r["engine_checks"]["recomputed"]
    assert rec["flagged"] and rec["differs_in"] == ["backend", "dtype"] and rec["tokens"] == 256
    assert rec["verdict"].startswith("FLAGGED: identical to the bit on all 256 tokens")
    assert r["summary"]["recomputed_logprobs"] == 1.0
    failed = diagnose.gate(r["summary"], diagnose.parse_bounds(["recomputed_logprobs=0"], "--fail-above"), [])
    assert failed == ["FAIL recomputed_logprobs = 1 is above the bound 0 (--fail-above recomputed_logprobs=0)"]

    same = {"engine": SIDES["trainer"], "trainer": SIDES["trainer"]}
    r = diagnose.report(sample_of(lp.clone(), lp, sides=same), {"name": "x", "label": "x"}, tmp_path, plots=False)
    assert not r["engine_checks"]["recomputed"]["flagged"] and r["summary"]["recomputed_logprobs"] == 0.0
    short = diagnose.report(sample_of(lp[:, :60].clone(), lp[:, :60], sides=SIDES), {"name": "x", "label": "x"},
                            tmp_path, plots=False)
    assert not short["engine_checks"]["recomputed"]["measured"] and "recomputed_logprobs" not in short["summary"]
    assert any(n.startswith("recomputed_logprobs: left out, not decided: identical on all 240 tokens")
               for n in short["summary_notes"])
    unknown = diagnose.report(sample_of(lp.clone(), lp), {"name": "x", "label": "x"}, tmp_path, plots=False)
    assert "neither side's backend, dtype or device is on record" in unknown["engine_checks"]["recomputed"]["verdict"]
    # exact by design: a batch-invariant vLLM against a trainer of its dtype and device (slime's true on-policy)
    invariant = {"engine": {**SIDES["engine"], "dtype": "fp32"}, "trainer": SIDES["trainer"]}
    r = diagnose.report(sample_of(lp.clone(), lp, sides=invariant, engine={"determinism": ["VLLM_BATCH_INVARIANT=1"]}),
                        {"name": "x", "label": "x"}, tmp_path, plots=False)
    assert r["engine_checks"]["recomputed"]["verdict"].endswith("VLLM_BATCH_INVARIANT=1: exact by design")
    assert r["summary"]["recomputed_logprobs"] == 0.0
    moved = lp.clone()
    moved[3, 63] += 1e-3  # one token apart decides it: sampled, whatever the sides
    r = diagnose.report(sample_of(moved, lp, sides=SIDES), {"name": "x", "label": "x"}, tmp_path, plots=False)
    assert r["engine_checks"]["recomputed"]["verdict"].startswith("no: the engine's log-probs differ from the "
                                                                 "trainer's on 1 of 256 tokens")
    assert r["summary"]["recomputed_logprobs"] == 0.0


def test_engine_log_probs_of_zero_are_counted_where_the_trainer_says_otherwise():
    """tinker-cookbook #396: sampling-time log-probs of 0 on tokens the recomputed distribution does not give
    probability 1. Counted: μ = 0 exactly, log π < −0.01
    and a kept set of more than one token. Not counted: a recorded one-token kept set (an honest 0), log π ≥ −0.01
    (p ≥ 0.99: bf16 may round log p to 0), padding."""
    from offpolicy.measure import engine_checks

    trainer = torch.tensor([[-0.5, -0.005, -2.0, -0.3, -0.7]])
    rollout = torch.tensor([[0.0, 0.0, 0.0, -0.29, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    out = engine_checks.zero_logprobs(trainer, rollout, mask)
    assert (out["suspect_tokens"], out["engine_zero_tokens"], out["tokens"]) == (2, 3, 4)
    assert out["fraction"] == 0.5 and out["first"] == {"row": 0, "position": 0, "trainer_logprob": -0.5,
                                                       "engine_logprob": 0.0}
    kept = torch.tensor([[3, 5, 1, 4, 1]], dtype=torch.int32)  # token 2's recorded set held one id
    assert engine_checks.zero_logprobs(trainer, rollout, mask, kept)["suspect_tokens"] == 1


@pytest.fixture(scope="module")
def top_k_rollouts(tiny_model):
    """The tiny model's hf engine in bf16 under top-k 5: it records each token's kept set with log q_v."""
    from offpolicy.engines.hf import HFEngine

    tok = build_char_tokenizer()
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 8, seed=4)]
    sampling = SamplingConfig(max_tokens=8, top_k=5)
    rollouts = HFEngine(str(tiny_model), tok, "bf16").generate(prompts, sampling, seed=0, version=0)
    return tok, sampling, rollouts


def test_a_fake_engine_that_zeroes_log_probs_and_sharpens_its_kept_set_fires_both_checks(tiny_model, top_k_rollouts,
                                                                                         tmp_path):
    """A fake engine: the hf engine's bf16 rollouts with every third log μ set to 0 and its kept sets' log q_v those
    of temperature 0.25. The honest rollouts: no zero, an entropy gap of bf16's rounding. The fake: the zeros counted
    exactly, and an entropy gap far above it, which --fail-above entropy_gap gates."""
    import copy

    from offpolicy.core.kept_set import KeptIds

    tok, sampling, honest = top_k_rollouts
    trainer = diagnose.TrainerSide(tiny_model, sampling)
    scorer = trainer.scorer()
    r = diagnose.report(diagnose.score(honest, trainer, tok, scorer=scorer), {"name": "h", "label": "h"}, tmp_path,
                        plots=False)
    checks = r["engine_checks"]
    assert checks["zero_logprobs"]["suspect_tokens"] == 0
    assert checks["entropy_gap"]["reported"] and checks["entropy_gap"]["covered_share"] == 1.0
    assert checks["entropy_gap"]["source"] == "the engine's kept-set log-probs"
    assert 0 < r["summary"]["entropy_gap"] < 0.01

    fake = copy.deepcopy(honest)
    zeroed = 0
    for row, values in enumerate(fake.logprobs):
        for t in range(0, len(values), 3):
            zeroed += values[t] < -0.011  # the trainer's is then below −0.01 too (bf16 is ~1e-3 off here)
            values[t] = 0.0
    kept = fake.kept
    sharp = torch.empty_like(kept.logprobs)
    position, index, _ = kept._flat()
    logits = kept.logprobs[index] / 0.25
    norm = torch.zeros(kept.start.numel()).index_add_(0, position, logits.exp())
    sharp[index] = logits - norm.log()[position]
    fake.kept = KeptIds(kept.start, kept.count, kept.ids, sharp)
    r = diagnose.report(diagnose.score(fake, trainer, tok, scorer=scorer), {"name": "f", "label": "f"}, tmp_path,
                        plots=False)
    zero = r["engine_checks"]["zero_logprobs"]
    assert zero["suspect_tokens"] == zeroed > 0 and zero["kept_set"].startswith("the engine's recorded kept set")
    assert r["summary"]["fraction_engine_logprob_zero"] == pytest.approx(zeroed / r["tokens"])
    gap = r["engine_checks"]["entropy_gap"]
    assert gap["engine_entropy_mean"] < gap["trainer_entropy_mean"] - 0.3  # the sharper set: lower entropy
    bounds = diagnose.parse_bounds(["entropy_gap=0.05", "fraction_engine_logprob_zero=0"], "--fail-above")
    assert [line.split(" = ")[0] for line in diagnose.gate(r["summary"], bounds, [])] == [
        "FAIL entropy_gap", "FAIL fraction_engine_logprob_zero"]


def test_the_entropy_gap_needs_log_probs_covering_the_engines_mass(tmp_path):
    """A top-2 head covering 0.9 of μ's mass: "not reported", and the gate on it is a config error naming why."""
    from offpolicy.core.kept_set import KeptIds
    from offpolicy.measure import engine_checks

    head = KeptIds.from_rows([[[3, 4], [1, 2]]], [[[-0.2, -2.0], [-0.5, -1.2]]])
    triple = engine_checks.engine_entropy(None, head, 2)
    assert triple[1][0].tolist() == pytest.approx([math.exp(-0.2) + math.exp(-2.0), math.exp(-0.5) + math.exp(-1.2)])
    out = engine_checks.entropy_gap(torch.ones(1, 2), triple, torch.ones(1, 2))
    assert not out["reported"] and "cover less than 0.99" in out["why"]
    s = sample_of(torch.full((1, 2), -0.5), torch.full((1, 2), -0.4), token_entropy=torch.ones(1, 2),
                  engine_entropy=triple)
    r = diagnose.report(s, {"name": "x", "label": "x"}, tmp_path, plots=False)
    assert "entropy_gap" not in r["summary"]
    with pytest.raises(op.ConfigError, match="--fail-above entropy_gap: entropy_gap: left out, the engine's top-k log-probs "
                       r"\(head\) cover less than 0.99"):
        diagnose.gate(r["summary"], diagnose.parse_bounds(["entropy_gap=0.1"], "--fail-above"), [],
                      r["summary_notes"])


def test_engine_on_record_and_speed_paths_in_the_report(bf16_sample, tmp_path):
    """The hf engine's record (name, version, dtype, attention backend, determinism) is the provenance block's
    engine, and the speed paths that ran (the trainer's and the engine's) are in the report."""
    r = diagnose.report(bf16_sample, {"name": "x", "label": "x"}, tmp_path, plots=False, settings={"n": 48})
    engine = r["provenance"]["engine"]
    assert engine["name"] == "hf" and engine["dtype"] == "bfloat16" and engine["determinism"] == "none"
    assert engine["version"].startswith("transformers ") and engine["attention_backend"]
    assert r["provenance"]["settings"] == {"n": 48} and r["provenance"]["code"]["tree_hash"]
    assert {"trainer_linear", "trainer_shared_prompt", "hf_own_loop", "hf_linear"} <= set(r["speed_paths"])
    assert r["engine_checks"]["recomputed"]["engine"] == {"backend": "transformers", "dtype": "bf16", "device": "cpu"}


def test_require_exact_names_the_engine_on_record_of_a_dump(tmp_path):
    """A host that writes its engine into the dump's meta: --require-exact's verdict line names it, and identical
    log-probs from a bf16 vLLM against an fp32 trainer are flagged as recomputed (the console says so)."""
    from offpolicy.integrations.dump import BatchDumper

    engine = {"name": "vllm", "version": "0.32.0", "dtype": "bf16", "attention_backend": "FLASH_ATTN",
              "determinism": ["VLLM_BATCH_INVARIANT=1"], "backend": "vllm", "device": "cuda:0"}
    rollout = -torch.rand(4, 70, generator=torch.Generator().manual_seed(2)) - 0.02
    old = rollout.clone()
    BatchDumper(tmp_path / "d", every=1, host="test").maybe_dump(
        0, old_logprobs=old, rollout_logprobs=rollout, mask=torch.ones(4, 70),
        meta={"engine": engine, "trainer": SIDES["trainer"]})
    result = diag("--batch", str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--require-exact")
    assert result.returncode == 0, result.stderr[-2000:]
    named = "engine: vllm (0.32.0), dtype bf16, attention FLASH_ATTN, determinism: VLLM_BATCH_INVARIANT=1"
    assert f"--require-exact: every log-ratio is 0 on {named.removeprefix('engine: ')}" in result.stderr
    out = " ".join(result.stdout.split())  # rich wraps long lines
    assert f"exact: every log-ratio is 0 (280 tokens); {named}" in out
    assert "recomputed log-probs: FLAGGED: identical to the bit on all 280 tokens" in out
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["provenance"]["engine"] == engine and report["speed_paths"] is None

    old[1, 5] -= 0.25
    (tmp_path / "d" / "step000000-rank0.pt").unlink()
    BatchDumper(tmp_path / "d", every=1, host="test").maybe_dump(
        0, old_logprobs=old, rollout_logprobs=rollout, mask=torch.ones(4, 70), meta={"engine": engine})
    result = diag("--batch", str(tmp_path / "d"), "--out", str(tmp_path / "o2"), "--require-exact")
    assert result.returncode == 3
    (line,) = [x for x in result.stderr.splitlines() if "FAIL" in x]
    assert line.startswith("offpolicy diagnose: FAIL --require-exact: 1 of 280 tokens") and line.endswith(named)


# SmolLM2's ids that decode to a text whose re-encoding is other ids: a sampler may draw a non-canonical split
PROMPT_2_PLUS_2 = [1780, 314, 216, 34, 8055, 216, 34, 47]  # "What is 2 plus 2?"
RETOKENIZED = [
    ([657, 314, 216, 36, 30], None),  # " It is 4.": canonical, re-encodes to itself
    ([216, 216], [256]),  # two 'Ġ' → "  " → one 'ĠĠ' (merged whitespace)
    ([198, 198], [1116]),  # two 'Ċ' → "\n\n" → 'ĊĊ'
    ([216, 40533, 226], [21004, 226]),  # 'Ġ' 'âī' 'Ī' → " ≈" → 'Ġâī' 'Ī' (a multi-byte character split elsewhere)
    ([21004], [216, 24211]),  # 'Ġâī' alone: two of ≈'s three bytes → " \ufffd" → 'Ġ' and U+FFFD's own token
]


def test_retokenization_drift_on_smollm2s_tokenizer(smollm2_dir):
    """Agent Lightning v1.0.3 (#646): text re-encoded is not always the ids sampled. SmolLM2's tokenizer: merged
    whitespace and a multi-byte character split across tokens differ at the first response token; a canonical
    response does not, nor one whose stop token a server left out of its text."""
    from offpolicy.measure import engine_checks
    from offpolicy.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    assert tok.encode("What is 2 plus 2?", add_special_tokens=False) == PROMPT_2_PLUS_2
    responses = [ids for ids, _ in RETOKENIZED] + [[657, 314, 216, 36, 30, tok.eos_token_id]]
    texts = [tok.decode(ids, skip_special_tokens=False) for ids, _ in RETOKENIZED] + [" It is 4."]
    assert texts[1:5] == ["  ", "\n\n", " ≈", " \ufffd"]
    for (ids, again), text in zip(RETOKENIZED, texts):
        assert tok.encode(tok.decode(PROMPT_2_PLUS_2) + text, add_special_tokens=False)[8:] == (again or ids)
    out = engine_checks.retokenization(tok, [PROMPT_2_PLUS_2] * 6, responses, texts, "the server's text",
                                       forms=[[]] * 5 + [["stop_token_left_out"]])
    assert (out["rows"], out["rows_differing"], out["share"]) == (6, 4, 4 / 6)
    assert out["first_positions"] == [None, 0, 0, 0, 0, None] and out["stop_token_left_out_rows"] == 1
    assert out["first"] == {"row": 1, "position": 8, "response_position": 0, "in": "response", "sampled": [216, 216],
                            "reencoded": [256], "sampled_tokens": ["Ġ", "Ġ"], "reencoded_tokens": ["ĠĠ"],
                            "sampled_length": 10, "reencoded_length": 9}


def test_a_dump_with_text_is_re_encoded_and_gated(smollm2_dir, tmp_path):
    """A host's dump with the sampled ids and the engine's text: ``diagnose --batch DIR --model M`` reports the drift
    with M's tokenizer, prints the first difference, and --fail-above retokenization_drift gates it; without --model
    the drift is not reported, and the gate on it says why."""
    from offpolicy.integrations.dump import BatchDumper
    from offpolicy.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    rows = len(RETOKENIZED)
    rollout = torch.full((rows, 5), -0.5)
    text = {"prompt_ids": [PROMPT_2_PLUS_2] * rows, "response_ids": [ids for ids, _ in RETOKENIZED],
            "response_text": [tok.decode(ids) for ids, _ in RETOKENIZED]}
    BatchDumper(tmp_path / "d", every=1, host="test").maybe_dump(
        0, old_logprobs=rollout - 0.01, rollout_logprobs=rollout, mask=torch.ones(rows, 5), text=text)
    result = diag("--batch", str(tmp_path / "d"), "--model", str(smollm2_dir), "--out", str(tmp_path / "o"),
                  "--fail-above", "retokenization_drift=0.5")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "FAIL retokenization_drift = 0.8 is above the bound 0.5" in result.stderr
    out = " ".join(result.stdout.split())
    assert ("retokenisation drift (the dump's text): 4 of 5 rows re-encode to other ids (80.0%); the first is row 1, "
            "response position 0: sampled [216, 216] ['Ġ', 'Ġ'], re-encoded [256] ['ĠĠ']") in out
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["engine_checks"]["retokenization"]["first_positions"] == [None, 0, 0, 0, 0]
    result = diag("--batch", str(tmp_path / "d"), "--out", str(tmp_path / "o2"), "--fail-above",
                  "retokenization_drift=0.5")
    assert result.returncode == 2 and "needs the trainer's tokenizer: pass --model DIR with --batch" in result.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("real-model")  # one SmolLM2-sized run at a time
def test_smollm2_hf_engine_is_honest(smollm2_dir, tmp_path):
    """The real model, sampled by the hf engine in bf16 and scored by the fp32 trainer under top-k 20: none of the
    checks fires — its log-probs differ from the trainer's (not recomputed, decided on ≥ 256 tokens), none is 0 where
    the trainer's is not, and the entropy over the kept set agrees to bf16's rounding. The report names the engine."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in (
        "The capital of France is", "Water boils at", "A list of prime numbers: 2, 3,", "Once upon a time"))
        + "\n")
    result = diag("--model", str(smollm2_dir), "--engine", "hf", "--engine-dtype", "bf16", "--trainer-dtype", "fp32",
                  "--prompts", str(prompts), "--n", "8", "--max-tokens", "40", "--top-k", "20", "--out",
                  str(tmp_path / "o"), "--fail-above", "recomputed_logprobs=0", "--fail-above",
                  "fraction_engine_logprob_zero=0", "--fail-above", "entropy_gap=0.05")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    checks = report["engine_checks"]
    print(json.dumps({k: v for k, v in checks.items() if k != "retokenization"}, indent=1))
    assert report["tokens"] >= 256 and checks["recomputed"]["measured"] and not checks["recomputed"]["flagged"]
    assert checks["recomputed"]["differs_in"] == ["dtype"]
    assert checks["zero_logprobs"]["suspect_tokens"] == 0
    assert checks["entropy_gap"]["covered_share"] == 1.0 and checks["entropy_gap"]["abs_gap_mean"] < 0.05
    assert not checks["retokenization"]["reported"]
    assert report["provenance"]["engine"]["name"] == "hf" and report["provenance"]["engine"]["dtype"] == "bfloat16"
    assert "engine: hf (transformers" in result.stdout and "trainer_linear:" in result.stdout



def test_self_check_tells_packing_from_micro_batching(tiny_model):
    """Issue #67: the micro-batch row compared the packed forward against whole rows, so a packing difference read
    as a micro-batch dependence. In fp32 with one micro-batch of whole rows, micro-batching changes nothing at all
    (the same forward); packing is its own row."""
    from offpolicy.measure import self_check
    from offpolicy.policy.score import Scorer, load_policy

    s = bf16_batch(tiny_model)
    scorer = Scorer(load_policy(tiny_model, torch.device("cpu")).eval(), SamplingConfig(max_tokens=12),
                    torch.device("cpu"), "bf16", None)  # one micro-batch: the whole batch
    out = self_check.trainer_against_itself(scorer, s)
    assert set(out) >= {"packing", "micro_batch", "fp32_head", "fp32"}
    assert out["micro_batch"]["tokens"] == out["packing"]["tokens"] > 0
