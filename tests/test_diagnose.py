"""`offpolicy diagnose` on the HF engine (bf16 engine vs fp32 trainer as the mismatch source):
report schema, what-if numbers equal to `correct` on the same tensors, breakdowns, CLI errors."""

from __future__ import annotations

import json
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
    real = score.trainer_logprobs
    monkeypatch.setattr(score, "trainer_logprobs", lambda model, mb, *a, **k: shapes.append(
        (tuple(mb.input_ids.shape), int(mb.attention_mask.sum(1).max()))) or real(model, mb, *a, **k))
    budget = 3 * 19  # a few rows a micro-batch (the longest row is 19 tokens)
    split = diagnose.score_batch(diagnose.TrainerSide(tiny_model, sampling, budget=budget), batch)
    assert len(shapes) > 1 and all(rows * width <= budget or rows == 1 for (rows, width), _ in shapes)
    assert all(width == used for (_, width), used in shapes)  # trimmed: no column of padding only
    counted = batch.mask.bool()
    torch.testing.assert_close(split.trainer[counted], whole.trainer[counted], rtol=0, atol=1e-5)
    model = score.load_policy(tiny_model, torch.device("cpu")).eval()
    trains = score.Scorer(model, sampling, torch.device("cpu"), "fp32", budget).score(batch)
    assert torch.equal(split.trainer[counted], trains.float()[counted])


@pytest.mark.parametrize("flags, message", [
    ({"top_k": 0}, "--top-k 0: expected -1"),
    ({"temperature": float("nan")}, "--temperature nan: expected a finite number > 0"),
    ({"compare": "seed=1,2"}, "--compare 'seed=1,2': expected KEY=V1,V2,..."),
    ({"micro_batch_tokens": 0}, "--micro-batch-tokens: Input should be greater than 0"),
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
                  "bf16", "--micro-batch-tokens", "64", "--self-check", "--out", str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr[-2000:]
    check = json.loads((tmp_path / "s" / "report.json").read_text())["self_check"]
    trainer = check["trainer"]
    assert trainer["configured"]["dtype"] == "bf16" and trainer["configured"]["micro_batches"] > 1
    for part in ("micro_batch", "fp32_head", "fp32"):
        assert 0 <= trainer[part]["fraction_outside_0.9_1.1"] <= trainer[part]["fraction_differing"] <= 1
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
    torch.testing.assert_close(configured[counted], scorer.score(s).float()[counted], rtol=0, atol=1e-5)


def bf16_batch(tiny_model):
    from offpolicy.engines.hf import HFEngine
    from offpolicy.policy.batch import to_batch

    tok = build_char_tokenizer()
    prompts = [prompt_ids(tok, p) for p in problems(make_task("reverse"), 6, seed=3)]
    rollouts = HFEngine(str(tiny_model), tok, "bf16").generate(prompts, SamplingConfig(max_tokens=8), seed=0, version=0)
    return to_batch(rollouts, tok.pad_token_id)
