"""task=larger (issue #42): the generator's splits and the partial-credit reward by hand; the trainer's
successive-policy KL and reward-spread metrics; benchmarks/science_real.py's table and collapse rule;
and the whole path at a toy scale — a train run of task=larger and the science_real grid (two cells,
one seed, resumed) on the tiny Qwen2 + ChatML fixture with the hf engine."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offpolicy.config import ConfigError
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
    assert cfg.max_new_tokens == 16 and cfg.policy_kl_rows == 0


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


def _rows(evals: dict[int, float], steps: int, kl=1e-3) -> list[dict]:
    return [{"step": s, "reward": 0.1, "offpolicy/kl_k3": kl, "policy/kl_k3_update": 0.01,
             **({"eval/accuracy": evals[s]} if s in evals else {})} for s in range(steps)]


def test_table_and_collapse_rule(science):
    ok = science.run_stats(_rows({0: 0.0, 3: 0.5}, 4), steps=4, start=0.1)
    assert ok["done"] and not ok["collapsed"] and ok["final"] == 0.5 and ok["start"] == 0.1
    assert science.run_stats(_rows({0: 0.3, 3: 0.24}, 4), 4, start=0.3)["collapsed"]  # 0.06 below the start
    assert not science.run_stats(_rows({0: 0.0, 3: 0.26}, 4), 4, start=0.3)["collapsed"]  # within 0.05
    cut = science.run_stats(_rows({0: 0.1}, 2), 4, start=0.1)
    assert not cut["done"] and cut["collapsed"] and cut["final"] is None  # a run that did not finish
    nan = science.run_stats(_rows({0: 0.1, 3: 0.5}, 4, kl=float("nan")), 4, start=0.1)
    assert nan["collapsed"] and nan["mismatch_k3"] is None
    runs = {"reference": {0: ok, 1: science.run_stats(_rows({0: 0.1, 3: 0.3}, 4), 4, start=0.1)},
            "bf16_s4_none": {0: science.run_stats(_rows({0: 0.1, 3: 0.2}, 4), 4, start=0.1), 1: cut}}
    table = {row["cell"]: row for row in science.summarize(runs)}
    assert table["reference"]["final"] == pytest.approx(0.4) and table["reference"]["share_of_reference"] == 1.0
    assert table["bf16_s4_none"]["share_of_reference"] == pytest.approx(0.5)  # 0.2 / 0.4; the cut run not averaged
    assert (table["bf16_s4_none"]["finished"], table["bf16_s4_none"]["collapsed"]) == (1, 1)
    text = science.markdown(science.summarize(runs))
    assert "| bf16_s4_none | 1/2 | 0.100 → 0.200 ± 0.000 | 50 % | 1.0e-03 | 1.0e-02 (1.0e-02) | 1/2 |" in text


def test_cells_and_commands(science, tmp_path):
    cells = science.all_cells()
    assert len(cells) == 11 and cells["reference"] == science.Cell("reference", "fp32", 0, "none")
    assert cells["bf16_s4_icepop"].preset == "verl:decoupled_token_icepop"
    args = science.parse(["--pilot", "--model", "M", "--out", str(tmp_path), "--steps", "7"])
    assert args.cell_names == science.PILOT and args.seed_list == [0, 1, 2]
    cmd = science.command(cells["bf16_s4_none"], 2, args, tmp_path / "r")
    assert {"max_staleness=4", "engine_dtype=bf16", "preset=none", "seed=2", "steps=7", "task=larger",
            "loss.correction={}"} <= set(cmd)
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step-5")
    assert science.command(cells["bf16_s4_none"], 2, args, tmp_path / "r")[-3:] == ["--resume", str(tmp_path / "r"),
                                                                                    "steps=7"]
    with pytest.raises(SystemExit):
        science.parse(["--cells", "reference,nope", "--model", "M"])


@pytest.mark.slow
def test_larger_trains_and_the_grid_runs_at_toy_scale(tiny_qwen2_dir, tmp_path):
    """science_real.py as typed, at a toy scale: two cells × one seed at once (hf engine, 2 steps), then
    again with 3 steps — both runs resume from their checkpoints and finish; the table, JSON and plot."""
    out = tmp_path / "grid"
    base = [sys.executable, str(ROOT / "benchmarks" / "science_real.py"), "--model", str(tiny_qwen2_dir),
            "--cells", "reference,bf16_s4_recommended", "--seeds", "0", "--jobs", "2",
            "--prompts-per-step", "2", "--group-size", "2", "--eval-problems", "2", "--eval-every", "1",
            "--max-new-tokens", "4", "--out", str(out)]
    first = subprocess.run([*base, "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert "0 runs finished already, 2 to run, 2 at once" in first.stdout
    second = subprocess.run([*base, "--steps", "3", "--json", str(tmp_path / "t.json")], capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "start reference seed 0 (resume)" in second.stdout
    result = json.loads((tmp_path / "t.json").read_text())
    table = {row["cell"]: row for row in result["table"]}
    ref = table["reference"]
    assert ref["finished"] == 1 and ref["share_of_reference"] == (1.0 if ref["final"] else None)  # none of 0
    assert table["bf16_s4_recommended"]["finished"] == 1 and table["bf16_s4_recommended"]["mismatch_k3"] > 0
    assert table["reference"]["mismatch_k3"] is not None  # measured under no correction too (fp32: ~0)
    metrics = [json.loads(line) for line in (out / "bf16_s4_recommended" / "seed0" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all("policy/kl_k3_update" in m and "reward/groups_with_spread" in m for m in metrics)
    assert all(m["policy/kl_k3_update"] == 0.0 for m in metrics if m["skipped_update"])  # nothing moved
    assert (out / "science_real.png").stat().st_size > 0
    third = subprocess.run([*base, "--steps", "3", "--report"], capture_output=True, text=True, timeout=120)
    assert third.returncode == 0 and "| reference | 1/1 |" in third.stdout
    assert "untrained model, held-out reward (greedy, 2 pairs)" in third.stdout
