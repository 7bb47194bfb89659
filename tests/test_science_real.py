"""The real-model science (issues #42, #54): task=larger's splits and reward by hand; the trainer's
successive-policy KL and reward-spread metrics; the held-out eval (train/evaluate.py) on a tiny model, with
the teacher-forced answer log-prob checked against a uniform policy's by hand; the pre-registered primary
metric and collapse rule; benchmarks/science_real.py's statistics (exact permutation p, Holm, bootstrap,
detectable effect) against hand-computed values, its report recomputed from a JSON; and the whole path at a
toy scale — the grid on task=count (R and N, one seed, resumed) on the tiny Qwen2 + ChatML fixture."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offpolicy.core.config import ConfigError
from offpolicy.tasks import Larger, larger_reward, make_task
from offpolicy.train.advantages import grpo_advantages
from offpolicy.train.config import load_train_config
from offpolicy.train.loop import groups_with_spread, spread_rows, update_kl_k3
from hf_fixtures import benchmark_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def science():
    return benchmark_module("science_real")


@pytest.mark.parametrize(("completion", "reward"), [
    ("82", 1.0), (" 82.\n", 1.0), ("82 .", 1.0),  # the number alone (whitespace, one trailing period)
    ("The larger number is 82.", 0.5), ("82 is larger than 47", 0.5),  # right number first, not alone
    ("47", 0.0), ("47 is smaller than 82", 0.0), ("Neither.", 0.0), ("", 0.0),  # wrong first number / none
    ("820", 0.0), ("-82", 0.0), ("82..", 0.5),  # whole integers only; one period only
])
def test_larger_reward_by_hand(completion, reward):
    assert larger_reward(completion, "82") == reward


def test_larger_splits_are_disjoint_and_fixed():
    task = Larger()
    assert (len(task.train_pairs), len(task.held_out_pairs)) == (3605, 400)  # C(90, 2) = 4005 pairs, 10 % held out
    held = {frozenset(p) for p in task.held_out_pairs}
    assert not held & {frozenset(p) for p in task.train_pairs}
    assert task.held_out == Larger().held_out and task.held_out != Larger(split_seed=1).held_out
    rng = random.Random(3)
    drawn = [task.sample(rng) for _ in range(500)]
    for p in drawn:  # "Which number is larger, A or B? Answer with the number only."
        a, b = (int(x) for x in p.prompt.split("larger, ")[1].split("?")[0].split(" or "))
        assert frozenset((a, b)) not in held and p.answer == str(max(a, b)) and a != b and 10 <= min(a, b)
    assert {p.prompt.split(", ")[1][:2] == p.answer for p in drawn} == {True, False}  # both orders
    assert task.reward(drawn[0], drawn[0].answer) == 1.0
    assert make_task("larger", low=1, high=3).train_pairs + make_task("larger", low=1, high=3).held_out_pairs


def test_larger_needs_a_model_directory():
    with pytest.raises(ConfigError, match="task=larger renders its prompts with a model's chat template"):
        load_train_config(None, ["task=larger"])
    cfg = load_train_config(None, ["task=larger", "model=/models/any"])
    assert cfg.sampling.max_tokens == 16 and cfg.policy_kl_rows == 0


def test_update_kl_and_spread_by_hand():
    before = torch.log(torch.tensor([[0.5, 0.5, 0.2]]))
    after = torch.log(torch.tensor([[0.25, 1.0, 0.9]]))
    mask = torch.tensor([[1, 1, 0]])
    # r = 0.5 and 2: k3 = (r − 1) − log r = 0.19315 and 0.30685, mean 0.25 (the masked token left out)
    assert math.isclose(update_kl_k3(before, after, mask), 0.25, rel_tol=1e-6)
    assert update_kl_k3(before, before, mask) == 0.0
    inf = before.clone()
    inf[0, 1] = -math.inf  # outside a top-k/top-p support: left out, never a NaN
    assert math.isclose(update_kl_k3(inf, after, mask), 0.5 - 1 - math.log(0.5), rel_tol=1e-6)
    assert groups_with_spread(torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 1.0]), 2) == pytest.approx(1 / 3)
    # the same tie rule as the advantages: rewards equal up to a few roundings give no gradient, no spread
    rewards = torch.tensor([0.1 + 0.2, 0.3, 0.0, 1.0], dtype=torch.float64)
    assert groups_with_spread(rewards, 2) == 0.5 and grpo_advantages(rewards, 2)[:2].eq(0).all()
    assert spread_rows(8, 4, 3).tolist() == [0, 4, 1]


# ---------------------------------------------------------------- the eval and the registered rules (issue #54)

def _chat_count(tiny_qwen2_dir, **params):
    from offpolicy.tasks import ChatRendered
    from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    ensure_pad_token(tokenizer)
    return tokenizer, ChatRendered.of(make_task("count", **params), tokenizer)


def test_answer_logprob_of_a_uniform_policy_by_hand(tiny_qwen2_dir):
    """A policy with a zero output layer is uniform over its V tokens: log π(answer, EOS) = −(tokens)·log V
    exactly, whatever the padding of the batch (rows of different lengths, chunks of 3)."""
    from offpolicy.policy.score import load_policy
    from offpolicy.train.evaluate import answer_logprobs, evaluate

    tokenizer, task = _chat_count(tiny_qwen2_dir)
    policy = load_policy(tiny_qwen2_dir, torch.device("cpu"))
    rows = list(task.held_out[:5])
    with torch.no_grad():
        policy.get_output_embeddings().weight.zero_()  # tied: the inputs are zero too; the logits are 0 anyway
    totals, counts = answer_logprobs(policy, tokenizer, rows, chunk=3)
    vocab = policy.get_output_embeddings().weight.shape[0]
    assert counts == [len(tokenizer(p.answer, add_special_tokens=False).input_ids) + 1 for p in rows]
    assert len(set(counts)) > 1  # rows of different lengths share a chunk
    for total, n in zip(totals, counts):
        assert total == pytest.approx(-n * math.log(vocab), rel=1e-6)
    out = evaluate(policy, tokenizer, task, rows, max_new_tokens=3)
    assert out["eval/answer_logprob"] == pytest.approx(sum(totals) / 5, rel=1e-6)
    assert out["eval/answer_logprob_token"] == pytest.approx(-math.log(vocab), rel=1e-6)


def test_eval_on_a_tiny_model_matches_a_row_by_row_reference(tiny_qwen2_dir):
    """evaluate's greedy answers (chunks of left-padded prompts) against each prompt decoded alone, and its
    teacher-forced log-prob against one unpadded forward per row."""
    from offpolicy.policy.score import load_policy
    from offpolicy.train.evaluate import answer_logprobs, evaluate, greedy

    tokenizer, task = _chat_count(tiny_qwen2_dir)
    policy = load_policy(tiny_qwen2_dir, torch.device("cpu")).train()  # as the trainer holds it
    rows = list(task.held_out[:4])
    texts, lengths, finished = greedy(policy, tokenizer, rows, max_new_tokens=6, chunk=3)
    for p, text, length, done in zip(rows, texts, lengths, finished):
        alone = greedy(policy, tokenizer, [p], max_new_tokens=6)
        assert (alone[0][0], alone[1][0], alone[2][0]) == (text, length, done)
        assert 1 <= length <= 6 and (done or length == 6)
    totals, _ = answer_logprobs(policy, tokenizer, rows, chunk=4)
    for p, total in zip(rows, totals):
        prompt = list(p.prompt_ids)
        answer = [*tokenizer(p.answer, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([prompt + answer])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1: -1], -1).gather(1, torch.tensor(answer)[:, None]).sum()
        assert total == pytest.approx(float(ref), abs=1e-4)
    out = evaluate(policy, tokenizer, task, rows, max_new_tokens=6, chunk=3)
    assert set(out) == {"eval/accuracy", "eval/truncated_share", "eval/response_length", "eval/answer_logprob",
                        "eval/answer_logprob_token"}
    assert out["eval/accuracy"] == pytest.approx(sum(task.reward(p, t) for p, t in zip(rows, texts)) / 4)
    assert out["eval/truncated_share"] == 1 - sum(finished) / 4 and out["eval/response_length"] == sum(lengths) / 4
    assert policy.training  # the eval leaves the policy in training mode


def full_logits_answer_logprobs(policy, tokenizer, problems: list, trainer_dtype: str, chunk: int):
    """``evaluate.answer_logprobs`` before issue #67, kept as the reference: the model's logits [rows, L, V] of a
    chunk, log-softmaxed row by row."""
    from offpolicy.policy.score import precision
    from offpolicy.tasks.tokenizer import prompt_ids

    eos = tokenizer.eos_token_id
    rows = [(prompt_ids(tokenizer, p), [*tokenizer(p.answer, add_special_tokens=False).input_ids, eos])
            for p in problems]
    totals = []
    with torch.no_grad():
        for start in range(0, len(rows), chunk):
            part = rows[start: start + chunk]
            width = max(len(a) + len(b) for a, b in part)
            ids = torch.full((len(part), width), tokenizer.pad_token_id, dtype=torch.long)
            attention = torch.zeros((len(part), width), dtype=torch.long)
            for i, (prompt, answer) in enumerate(part):
                ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                attention[i, : len(prompt) + len(answer)] = 1
            with precision(policy.device, trainer_dtype):
                logits = policy(input_ids=ids, attention_mask=attention).logits
            for i, (prompt, answer) in enumerate(part):
                at = logits[i, len(prompt) - 1: len(prompt) + len(answer) - 1].float()
                totals.append(float(torch.log_softmax(at, dim=-1).gather(1, torch.tensor(answer)[:, None]).sum()))
    return totals


def qwen_sized_policy(vocab: int, tokenizer):
    """A two-layer Qwen2 of width 16 built in code with a ``vocab``-wide head (no file, no download), its head
    scaled so the log-probs spread (as the trainer holds it: train mode)."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    policy = transformers.Qwen2ForCausalLM(config).train()
    with torch.no_grad():
        policy.lm_head.weight.mul_(20.0)
    return policy


def answer_problems(count: int = 7, seed: int = 1) -> list:
    """Prompts and digit answers of 1–39 characters (the character tokenizer: a token each)."""
    from offpolicy.tasks.tasks import Problem

    g = torch.Generator().manual_seed(seed)
    return [Problem(f"what is {i} + {7 * i}?", "".join(map(str, torch.randint(0, 10, (int(n),), generator=g).tolist())))
            for i, n in enumerate(torch.randint(1, 40, (count,), generator=g))]


@pytest.mark.parametrize(("vocab", "trainer_dtype"), [(151_936, "fp32"), (4096, "fp32"), (4096, "bf16")])
def test_answer_logprob_through_the_trainer_head_equals_the_full_logits(vocab, trainer_dtype):
    """Issue #67: the eval's answer log-prob goes through the trainer's head (hidden states, then chunks of tokens)
    instead of a chunk's [rows, L, V] logits. Against the full-logits computation it replaced, at Qwen's vocabulary
    and a small one, rows of different lengths in chunks of 3: the same sums to fp32 rounding (measured 1.6e-7
    relative at most; bf16 autocast: the same bf16 logits, cast to fp32 in both)."""
    from offpolicy.tasks.tokenizer import build_char_tokenizer
    from offpolicy.train.evaluate import answer_logprobs

    tokenizer = build_char_tokenizer()
    policy = qwen_sized_policy(vocab, tokenizer)
    problems = answer_problems()
    want = full_logits_answer_logprobs(policy, tokenizer, problems, trainer_dtype, chunk=3)
    got, counts = answer_logprobs(policy, tokenizer, problems, trainer_dtype, chunk=3)
    assert counts == [len(p.answer) + 1 for p in problems] and len(set(counts)) > 1
    assert policy.training  # handed back as it came
    assert got == pytest.approx(want, rel=1e-6)
    assert len(set(map(round, want))) == len(want)  # the sums differ from row to row: a mix-up would show


def test_answer_logprob_never_computes_the_vocabulary_at_every_position():
    """Issue #67: the eval held a 16-row chunk's [rows, L, V] logits (2.3 GB at V = 151,936 and 232 tokens,
    benchmarks/bench_memory.py). The model's own output layer now runs only on ``check_head``'s probe (at most
    ``PROBE_TOKENS`` positions, once per model); the answer tokens' log-probs come from ``token_logprobs``' chunks."""
    from offpolicy.policy.head import PROBE_TOKENS
    from offpolicy.tasks.tokenizer import build_char_tokenizer
    from offpolicy.train.evaluate import answer_logprobs

    tokenizer = build_char_tokenizer()
    policy = qwen_sized_policy(4096, tokenizer)
    positions = []
    policy.lm_head.register_forward_hook(lambda module, args, out: positions.append(out.shape[:-1].numel()))
    answer_logprobs(policy, tokenizer, answer_problems(), chunk=3)
    assert positions and max(positions) <= PROBE_TOKENS, positions


def test_primary_metric_and_collapse_rule_by_hand():
    from offpolicy.train.evaluate import collapsed, eval_points, primary_metric

    def ev(*rewards, truncated=0.0):
        return [{"step": 10 * i, "eval/accuracy": r, "eval/truncated_share": truncated} for i, r in enumerate(rewards)]

    assert primary_metric(ev(0.1, 0.4, 0.5)) == pytest.approx(0.45) and primary_metric(ev(0.3)) is None
    assert not collapsed(ev(0.1, 0.5, 0.45))  # 0.05 below the best
    assert collapsed(ev(0.1, 0.5, 0.3))  # 0.2 below the best: a drop of ≥ 0.2 (1e-9 of rounding slack)
    assert not collapsed(ev(0.1, 0.5, 0.31))
    assert not collapsed(ev(0.5, 0.2, 0.45))  # a dip the run recovered from
    assert collapsed(ev(0.1, 0.2, truncated=0.51)) and not collapsed(ev(0.1, 0.2, truncated=0.5))
    assert collapsed([*ev(0.1), {"step": 10, "eval/accuracy": 0.2, "eval/answer_logprob": float("nan")}])
    assert not collapsed([])
    rows = [{"step": 0, "reward": 0.1, "eval/accuracy": 0.2, "eval/answer_logprob": -3.0}, {"step": 1, "reward": 0.2}]
    assert eval_points(rows) == [{"step": 0, "eval/accuracy": 0.2, "eval/answer_logprob": -3.0}]


def test_permutation_p_by_hand(science):
    # pooled 0.5 0.2 0.4 | 0.3 0.1 0.0: the difference grows with group a's sum S (observed 1.1); of the 20
    # three-subsets, two reach S ≥ 1.1 ({.5 .4 .3} 1.2, {.5 .4 .2} 1.1) and two S ≤ 0.4 ({0 .1 .2}, {0 .1 .3})
    a, b = [0.5, 0.2, 0.4], [0.3, 0.1, 0.0]
    assert science.permutation_p(a, b) == pytest.approx(2 / 20)
    assert science.permutation_p(a, b, "two-sided") == pytest.approx(4 / 20)
    assert science.permutation_p(b, a) == pytest.approx(19 / 20)  # all but the one subset above S = 0.4's
    assert science.permutation_p([1.0, 0.9], [0.0, 0.1, 0.2]) == pytest.approx(1 / 10)  # the most extreme of C(5, 2)
    assert science.permutation_p([0.3, 0.3], [0.3, 0.3]) == 1.0  # all splits tie
    assert science.permutation_p([0.1] * 3, [0.2] * 3) == 1.0  # the least extreme: every split at least as large
    with pytest.raises(ValueError):
        science.permutation_p([], [0.1])


def test_holm_by_hand(science):
    # sorted 0.01, 0.03, 0.04 (m = 3): 3·0.01 = 0.03; max(0.03, 2·0.03) = 0.06; max(0.06, 1·0.04) = 0.06
    assert science.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    assert science.holm({"x": 0.02, "y": 0.5}) == pytest.approx({"x": 0.04, "y": 0.5})
    assert science.holm({"x": 0.6, "y": 0.7}) == {"x": 1.0, "y": 1.0}  # capped at 1
    assert science.holm({}) == {}


def test_power_bootstrap_and_pooled_sd(science):
    # (z_0.95 + z_0.8)·σ·√(2/n) = (1.6449 + 0.8416)·0.204·√0.4 = 0.3208 at 5 seeds; 0.10 needs 52 a cell
    assert science.detectable(0.204, 5, 5) == pytest.approx(0.32081, abs=1e-4)
    assert science.detectable(0.204, 5, 5, one_sided=False) == pytest.approx((1.95996 + 0.84162) * 0.204 * 0.4 ** 0.5,
                                                                             rel=1e-4)
    assert science.seeds_needed(0.10, 0.204) == 52 and science.seeds_needed(0.321, 0.204) == 5
    assert science.pooled_sd([1.0, 3.0], [2.0, 2.0, 5.0]) == pytest.approx(math.sqrt((2 + 6) / 3))
    assert science.bootstrap_ci(science.mean_diff, [[0.5, 0.5], [0.2, 0.2]]) == pytest.approx((0.3, 0.3))
    ci = science.bootstrap_ci(science.mean_diff, [[0.5, 0.6, 0.7], [0.1, 0.2, 0.3]])
    assert ci == science.bootstrap_ci(science.mean_diff, [[0.5, 0.6, 0.7], [0.1, 0.2, 0.3]])  # seeded
    assert 0.2 <= ci[0] < 0.4 < ci[1] <= 0.6  # inside the extremes of the resampled means
    assert science.bootstrap_ci(science.mean_diff, [[0.5], [0.2, 0.3]]) is None
    assert science.recovered_share([0.3], [0.1], [0.5]) == pytest.approx(0.5)
    assert science.recovered_share([0.3], [0.1], [0.1]) is None


def _run_rows(evals: dict[int, float], steps: int, kl=1e-3, truncated=0.1) -> list[dict]:
    def evaluated(s):
        return {"eval/accuracy": evals[s], "eval/truncated_share": truncated, "eval/response_length": 50.0,
                "eval/answer_logprob": -20.0} if s in evals else {}

    return [{"step": s, "reward": 0.1, "response_length": 40.0, "truncated_share": truncated, "offpolicy/kl_k3_start": kl,
             "step_seconds": 2.0, **evaluated(s)} for s in range(steps)]


def _fake_runs(science, gap: float) -> dict:
    """R, N, C and tier 2 at 5 seeds each: N at 0.2 + seed/100, R and the others ``gap`` above, C half of it."""
    runs = {}
    for cell, shift in (("R", gap), ("N", 0.0), ("C", gap / 2), ("token_is", 0.01), ("icepop", 0.0),
                        ("none_1mb", gap)):
        runs[cell] = {str(s): science.run_stats(_run_rows({0: 0.1, 10: 0.2 + s / 100 + shift,
                                                            19: 0.2 + s / 100 + shift}, 20), 20) for s in range(5)}
    return runs


def test_report_and_the_registered_rule(science, tmp_path):
    runs = _fake_runs(science, gap=0.3)
    stats = runs["R"]["0"]
    assert stats["done"] and not stats["collapsed"] and stats["primary"] == pytest.approx(0.5)
    table, analysis, text = science.report(runs)
    gate, rescue = analysis["gate"], analysis["rescue"]
    # every R seed above every N seed: the most extreme of C(10, 5) = 252 splits
    assert gate["diff"] == pytest.approx(0.3) and gate["p"] == pytest.approx(1 / 252) and gate["sd"] > 0
    assert rescue["diff"] == pytest.approx(0.15) and rescue["recovered_share"] == pytest.approx(0.5)
    assert rescue["recovered_ci"] == pytest.approx((0.5, 0.5), abs=0.2)
    assert any(line.startswith("gate PASSES") for line in analysis["verdict"])
    assert any(line.startswith("the correction MATTERS") for line in analysis["verdict"])
    tier2 = {t["contrast"]: t for t in analysis["tier2"]}
    assert set(tier2) == {"token_is − N", "icepop − N", "none_1mb − N", "C − token_is"}
    assert tier2["none_1mb − N"]["p_holm"] == pytest.approx(min(1, 4 * 1 / 252))  # the smallest of four: × 4
    # icepop equals N seed by seed: every split is mirrored by its swap, and the ties count for both
    assert tier2["icepop − N"]["diff"] == pytest.approx(0) and 0.5 < tier2["icepop − N"]["p"] < 1
    assert tier2["C − token_is"]["alternative"] == "two-sided"
    assert "| R | 5/5 | 0.520 ± 0.016 | 0/5 (0) | 0.10 | 50.0 | -20.0 | 1.0e-03 | 2.0 |" in text
    # the report recomputed from the JSON the script writes, as a user types it
    path = tmp_path / "science.json"
    path.write_text(json.dumps({"runs": runs}))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "science_real.py"), "--from-json", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == text.strip()
    # a gate that fails: the bound on the harm is R − N's CI; a collapsed run keeps its primary metric
    flat = science.report(_fake_runs(science, gap=0.02))[1]
    assert any(line.startswith("gate FAILS") for line in flat["verdict"])
    low = science.run_stats(_run_rows({0: 0.6, 10: 0.3, 19: 0.3}, 20), 20)
    assert low["collapsed"] and low["primary"] == pytest.approx(0.3)
    cut = science.run_stats(_run_rows({0: 0.1}, 5), 20)  # stopped from outside: not scored, it resumes
    assert not cut["done"] and cut["primary"] is None and not cut["collapsed"]
    # a statistic over no kept token is a harmless NaN; a NaN loss is a failure (the amendment)
    assert not science.run_stats(_run_rows({0: 0.1, 19: 0.1}, 20, kl=float("nan")), 20)["collapsed"]
    rows = _run_rows({0: 0.1, 19: 0.1}, 20)
    rows[7]["offpolicy/loss"] = float("nan")
    assert science.run_stats(rows, 20)["collapsed"]


def test_cells_commands_and_order(science, tmp_path):
    cells = science.CELLS
    assert science.TIERS["1"] == ("R", "N", "C") and set(science.TIERS["2"]) == {"token_is", "icepop", "none_1mb"}
    args = science.parse(["--tier", "all", "--model", "M", "--out", str(tmp_path), "--steps", "7", "--seeds", "0,1"])
    assert args.cell_names == ("R", "N", "C", "token_is", "icepop", "none_1mb") and args.seed_list == [0, 1]
    order = science.schedule([cells[n] for n in ("icepop", "R", "N")], [0, 1])  # tier 1 first, each seed-major
    assert [(c.name, s) for c, s in order] == [("R", 0), ("N", 0), ("R", 1), ("N", 1), ("icepop", 0), ("icepop", 1)]
    n = set(science.command(cells["N"], 2, args, tmp_path / "r"))
    assert {"max_staleness=4", "engine.dtype=bf16", "preset=none", "seed=2", "steps=7", "task=count", "minibatches=4",
            "loss.correction={}", "eval_every=10", "eval_problems=128", "trainer.dtype=fp32"} <= n
    assert {"max_staleness=0", "engine.dtype=fp32", "minibatches=4"} <= set(science.command(cells["R"], 0, args,
                                                                                              tmp_path / "r"))
    assert "minibatches=1" in science.command(cells["none_1mb"], 0, args, tmp_path / "r")
    c = science.command(cells["C"], 0, args, tmp_path / "r")
    assert "preset=recommended" in c and "loss.correction={}" not in c
    assert "loss.score_centering=head" in science.command(cells["centered"], 0, args, tmp_path / "r")
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step-5")
    assert science.command(cells["N"], 2, args, tmp_path / "r")[-3:] == ["--resume", str(tmp_path / "r"), "steps=7"]
    assert science.parse(["--pilot", "--model", "M"]).cell_names == ("R", "N", "C")
    assert science.parse(["--cells", "all", "--model", "M"]).cell_names == science.TIERS["all"]
    for bad in (["--cells", "R,nope"], ["--tier", "1", "--cells", "R"], ["--pilot", "--tier", "2"]):
        with pytest.raises(SystemExit):
            science.parse([*bad, "--model", "M"])


@pytest.mark.slow
def test_the_grid_runs_at_toy_scale(tiny_qwen2_dir, tmp_path):
    """science_real.py as typed, at a toy scale on task=count: R and N (4 mini-batches, N at staleness 4 with
    a bf16 engine) × one seed at once (hf engine, 2 steps), then again with 3 steps — both resume and finish,
    their checkpoints are removed once finished; the eval's metrics are logged; the table and the JSON, and
    the report recomputed from that JSON."""
    out = tmp_path / "grid"
    base = [sys.executable, str(ROOT / "benchmarks" / "science_real.py"), "--model", str(tiny_qwen2_dir),
            "--cells", "R,N", "--seeds", "0", "--jobs", "2", "--prompts-per-step", "2", "--group-size", "2",
            "--eval-problems", "3", "--eval-every", "1", "--max-new-tokens", "6", "--out", str(out),
            "--set", "checkpoint_every=1"]
    first = subprocess.run([*base, "--steps", "2", "--keep-checkpoints"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert "0 runs finished already, 2 to run, 2 at once" in first.stdout
    assert (out / "N" / "seed0" / "checkpoints" / "latest").exists()  # kept on request
    second = subprocess.run([*base, "--steps", "3", "--json", str(tmp_path / "t.json")], capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "start R seed 0 (resume)" in second.stdout and "start N seed 0 (resume)" in second.stdout
    assert not (out / "N" / "seed0" / "checkpoints").exists()  # finished: removed
    metrics = [json.loads(line) for line in (out / "N" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for key in ("eval/accuracy", "eval/truncated_share", "eval/response_length", "eval/answer_logprob"):
        assert all(key in m and math.isfinite(m[key]) for m in metrics)
    assert metrics[-1]["staleness_max"] >= 1  # the bf16 engine ran ahead: stale rollouts with 4 mini-batches
    result = json.loads((tmp_path / "t.json").read_text())
    table = {row["cell"]: row for row in result["table"]}
    assert table["R"]["finished"] == 1 and table["N"]["finished"] == 1 and table["N"]["mismatch_k3"] > 0
    assert result["runs"]["R"]["0"]["primary"] is not None and result["untrained"]["eval/response_length"] > 0
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "science_real.py"), "--from-json",
                            str(tmp_path / "t.json")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "| R | 1/1 |" in again.stdout and "| R − N (≥) | 1 v 1 |" in again.stdout
    assert (out / "science_long.png").stat().st_size > 0


@pytest.mark.slow
def test_device_script_dry_run_resumes(tiny_qwen2_dir, tmp_path):
    """scripts/device_science.sh --dry-run as typed, at toy scale on the CPU: a tier-1 cell before a tier-2 one,
    the report and the packed runs in OUT; a second call given that pack runs nothing again."""
    import os

    runs = tmp_path / "m1" / "science_long"
    # from any shell: the virtualenv's python by its path, PATH without it (issue #67: the script called python3)
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "MODEL": str(tiny_qwen2_dir), "OUT": str(tmp_path / "out"), "RUNS": str(runs),
           "SEEDS": "0", "JOBS": "2", "CELLS": "none_1mb,R", "RESUME_FROM": str(tmp_path / "none.tgz")}
    first = subprocess.run(["bash", "scripts/device_science.sh", "--dry-run"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=400)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    starts = [line for line in first.stdout.splitlines() if line.startswith("start ")]
    assert starts == ["start R seed 0", "start none_1mb seed 0"], first.stdout  # tier 1 first
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"grid.log", "science_long_gpu.json",
                                                              "science_long_gpu.png", "runs.tgz"}
    report = json.loads((tmp_path / "out" / "science_long_gpu.json").read_text())
    assert {row["cell"]: row["finished"] for row in report["table"]} == {"R": 1, "none_1mb": 1}
    assert not list(runs.rglob("checkpoints"))  # finished runs keep none
    # a fresh machine: nothing under RUNS, the pack of the first call carried
    (tmp_path / "out" / "runs.tgz").rename(tmp_path / "runs.tgz")
    second = subprocess.run(["bash", "scripts/device_science.sh", "--dry-run"], cwd=ROOT, timeout=400,
                            env={**env, "RUNS": str(tmp_path / "m2" / "science_long"),
                                 "RESUME_FROM": str(tmp_path / "runs.tgz")}, capture_output=True, text=True)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "2 runs finished already, 0 to run" in second.stdout


def test_untrained_probe_at_toy_scale(tiny_qwen2_dir, tmp_path, science, capsys):
    """``--untrained`` as the task's probe runs it (hf engine here, vLLM on the real model): its numbers are in
    range and its groups counted as ``groups_with_spread`` counts them."""
    assert science.main(["--untrained", "3", "--engine", "hf", "--model", str(tiny_qwen2_dir), "--group-size", "2",
                         "--max-new-tokens", "5", "--out", str(tmp_path)]) == 0
    probe = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert probe["task"] == "count" and probe["samples"] == 6
    assert 0 <= probe["mean_reward"] <= 1 and 0 <= probe["groups_with_spread"] <= 1 and 1 <= probe["mean_length"] <= 5
    assert probe["truncated"] in {i / 6 for i in range(7)}
