"""benchmarks/sweep_long.py: the staged sweep resumes from its results file (fake runner, no
training), finalists come from the screen, and the table and plot render."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hf_fixtures import benchmark_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    return benchmark_module("sweep_long")


class FakeRunner:
    """Returns numbers derived from the job; counts calls; can fail on the n-th call."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def __call__(self, job):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise KeyboardInterrupt  # the sweep is interrupted mid-way
        self.calls.append(job.key)
        score = 0.5 + 0.01 * len(job.method) - 0.02 * job.staleness + 0.001 * job.seed
        return {"final_reward": score, "reward_auc": score, "eval_accuracy": score, "start_accuracy": 0.2,
                "kl_k3": 1e-3, "chi2_seq": 0.1, "abs_logp_diff_mean": 0.01, "ess": 0.9, "masked_fraction": 0.0,
                "fraction_above_high": 0.1, "response_length": 90.0, "step_seconds": 1.0,
                "rewards": [0.2, score], "seconds": 1.0}


def test_interrupted_sweep_continues_without_rerunning(sweep, tmp_path):
    path = tmp_path / "results.json"
    jobs = sweep.screen_jobs(["reverse", "walk"], ["none", "seq_tis", "token_tis"])
    first = FakeRunner(fail_at=4)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(jobs, first, path, log=lambda _: None)
    saved = json.loads(path.read_text())
    assert [r["key"] for r in saved] == first.calls and len(saved) == 4  # each finished run is on disk
    second = FakeRunner()
    results = sweep.run_sweep(jobs, second, path, log=lambda _: None)
    assert second.calls == [j.key for j in jobs[4:]]  # only the missing runs
    assert sorted(r["key"] for r in results) == sorted(j.key for j in jobs)
    third = FakeRunner()
    sweep.run_sweep(jobs, third, path, log=lambda _: None)
    assert third.calls == []  # a finished sweep runs nothing
    assert not list(tmp_path.glob(".results-*"))  # no temp file left behind


def test_keys_separate_stage_task_method_staleness_dtype_seed(sweep):
    base = sweep.Job("screen", "walk", "none", 4, "bf16", 0)
    variants = [sweep.Job("final", "walk", "none", 4, "bf16", 0), sweep.Job("screen", "reverse", "none", 4, "bf16", 0),
                sweep.Job("screen", "walk", "seq_tis", 4, "bf16", 0), sweep.Job("screen", "walk", "none", 2, "bf16", 0),
                sweep.Job("screen", "walk", "none", 4, "fp16", 0), sweep.Job("screen", "walk", "none", 4, "bf16", 1)]
    assert len({base.key, *(v.key for v in variants)}) == 7


def test_final_stage_takes_the_screens_best_plus_none(sweep, tmp_path):
    path = tmp_path / "results.json"
    sweep.run_sweep(sweep.screen_jobs(["walk"], ["none", "seq_tis", "token_tis", "veto"]), FakeRunner(), path,
                    log=lambda _: None)
    results = sweep.load_results(path)
    # the fake scores by name length: token_tis (9) > seq_tis (7) > veto (4)
    assert sweep.finalists(results, "walk", "auto:2") == ["none", "token_tis", "seq_tis"]
    assert sweep.finalists(results, "walk", "none,veto") == ["none", "veto"]
    jobs = sweep.final_jobs(results, ["walk"], "auto:2", seeds=[0, 1, 2])
    # the no-mismatch reference per seed (none, staleness 0, fp32 engine), then
    # methods × staleness {0,2,4,8} × {bf16, fp16} × seeds
    assert [(j.method, j.staleness, j.dtype) for j in jobs[:3]] == [("none", 0, "fp32")] * 3
    assert len(jobs) == 3 + 3 * 4 * 2 * 3
    assert len(sweep.final_jobs(results, ["walk"], "auto:2", seeds=[0, 1, 2], reference=False)) == 3 * 4 * 2 * 3
    sweep.run_sweep(jobs, FakeRunner(), path, log=lambda _: None)
    assert len(sweep.load_results(path)) == 4 + len(jobs)  # screen results kept, final ones added
    with pytest.raises(SystemExit, match="no screen results"):
        sweep.finalists(results, "reverse", "auto:2")


def test_every_method_builds_a_train_config(sweep, tmp_path):
    for name in sweep.METHODS:
        for task in ("reverse", "walk"):
            cfg = sweep.train_config(sweep.Job("screen", task, name, 4, "bf16", 0), tmp_path)
            assert cfg.engine.kind == "hf" and cfg.max_staleness == 4 and cfg.preset is None
    walk = sweep.train_config(sweep.Job("screen", "walk", "none", 4, "bf16", 0), tmp_path)
    assert walk.sampling.max_tokens >= 151  # the longest walk answer and its EOS fit


def test_register_adds_a_method(sweep, tmp_path):
    sweep.register("adaptive_test", sweep.Method("test entry", {"anchor": "old"}))
    try:
        cfg = sweep.train_config(sweep.Job("screen", "walk", "adaptive_test", 0, "fp16", 0), tmp_path)
        assert cfg.loss.correction.anchor == "old"
    finally:
        sweep.METHODS.pop("adaptive_test")


def test_report_table_and_plot(sweep, tmp_path):
    path = tmp_path / "results.json"
    jobs = sweep.final_jobs([], ["walk"], "none,seq_tis", seeds=[0, 1], staleness=[0, 4], dtypes=["bf16"])
    results = sweep.run_sweep(jobs, FakeRunner(), path, log=lambda _: None)
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(sweep.table(results))
    text = console.export_text()
    assert "±" in text and "seq_tis" in text
    md = sweep.markdown(results).splitlines()
    assert len(md) == 2 + 1 + 2 * 2 and "±" in md[2]  # header + reference + (method × staleness) rows
    sweep.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 5_000


def test_workers_run_in_processes(sweep, tmp_path):
    path = tmp_path / "results.json"
    jobs = sweep.screen_jobs(["walk"], ["none", "seq_tis"])
    results = sweep.run_sweep(jobs, _PicklableRunner(), path, workers=2, log=lambda _: None)
    assert sorted(r["key"] for r in results) == sorted(j.key for j in jobs)
    assert all(r["threads"] == 1 for r in results)  # one torch thread per worker process
    assert sweep.run_sweep(jobs, _PicklableRunner(), path, workers=2, log=lambda _: None) == results


class _PicklableRunner:
    def __call__(self, job):
        import torch

        return {**FakeRunner()(job), "threads": torch.get_num_threads()}


def test_quick_check_names_what_did_not_hold(sweep):
    jobs = sweep.quick_jobs(["walk"])
    assert {(j.method, j.staleness) for j in jobs} == {(m, s) for m in ("none", "recommended") for s in (0, 2)}
    fake = FakeRunner()
    results = [{**job.__dict__, "key": job.key, **fake(job), "steps": 2} for job in jobs]
    assert sweep.check_quick(jobs, results) == []
    results[0]["kl_k3"] = float("nan")
    results[1]["rewards"] = [0.1]
    problems = sweep.check_quick(jobs, results[:-1])
    assert len(problems) == 3
    assert "non-finite kl_k3" in problems[0] and "1 rewards for 2 steps" in problems[1] and "no result" in problems[2]


@pytest.mark.slow
def test_quick_long_sweep_as_a_user_types_it(offpolicy_cache, tmp_path):
    # the CI mode: one command, the long task, every run finishes with finite metrics (< 3 min)
    import os
    import subprocess

    out = tmp_path / "quick"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mismatch_sweep.py"), "--task", "walk", "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "OFFPOLICY_CACHE": str(offpolicy_cache), "COLUMNS": "200"})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "4 runs finished, every metric finite" in run.stdout
    results = json.loads((out / "results.json").read_text())
    assert sorted((r["method"], r["staleness"]) for r in results) == [
        ("none", 0), ("none", 2), ("recommended", 0), ("recommended", 2)]
    assert all(r["task"] == "walk" and len(r["rewards"]) == 3 for r in results)
    no_task = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mismatch_sweep.py"), "--quick"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert no_task.returncode != 0 and "--quick needs --task" in no_task.stderr


def test_kept_share_and_ranking_against_the_no_mismatch_reference(sweep):
    def row(method, st, dtype, reward, seed=0):
        return {"stage": "final", "task": "walk", "method": method, "staleness": st, "dtype": dtype, "seed": seed,
                "final_reward": reward, "eval_accuracy": 2 * reward}

    results = [row("none", 0, "fp32", 0.18, 0), row("none", 0, "fp32", 0.22, 1),  # reference: mean 0.2
               row("none", 0, "bf16", 0.2), row("bypass", 0, "bf16", 0.2), row("seq_tis", 0, "bf16", 0.21),
               row("none", 4, "bf16", 0.1), row("bypass", 4, "bf16", 0.19), row("seq_tis", 4, "bf16", 0.15)]
    table = sweep.kept_share(results)
    assert "| walk | bf16 | 4 | 0.200 (n=2) | **50 %** | 75 % | 95 % |" in table  # METHODS order: none, seq_tis, bypass
    assert "| walk | bf16 | 0 | 0.200 (n=2) | 100 % | 105 % | 100 % |" in table
    ranked = sweep.ranking(results).splitlines()
    assert ranked[0] == "final_reward: goal cells (none ≤ 70 % of the reference's final reward): 1 of 2"
    # best worst case first: bypass keeps 95 % where none fell to 50 %, seq TIS 75 %
    assert ranked[3].startswith("| bypass | 95 % | 95 % | 98 % |") and ranked[4].startswith("| seq_tis | 75 % |")
    grid = sweep.matrix(results).splitlines()
    assert grid[0] == "| task | method | bf16 s=0 | bf16 s=4 |"
    assert grid[2].startswith("| walk | reference (none, fp32 engine, s=0): 0.200 ± 0.028 |")
    assert "| walk | bypass | 0.200 | 0.190 |" in grid
    # accuracy of the trained policy, against the reference's accuracy (0.4); goal cells still by reward
    results[6]["eval_accuracy"] = 0.5  # bypass at staleness 4: 125 %
    assert "| walk | bf16 | 4 | 0.400 (n=2) | **50 %** | 75 % | 125 % |" in sweep.kept_share(results, key="eval_accuracy")
    assert sweep.ranking(results, key="eval_accuracy").splitlines()[3].startswith("| bypass | 125 % |")


def test_mismatch_and_dropped_tokens_per_cell(sweep):
    rows = [{"reward": 0.1, "offpolicy/kl_k3": 0.02, "offpolicy/ess": 0.9,
             "offpolicy/masked_fraction": 0.1, "offpolicy/clip_fraction": 0.03},
            {"reward": 0.3, "offpolicy/kl_k3": 0.04, "offpolicy/ess": 0.7,
             "offpolicy/masked_fraction": 0.3, "offpolicy/clip_fraction": 0.05}]
    run = sweep.summarize(rows)
    assert run["clip_fraction"] == pytest.approx(0.04) and run["masked_fraction"] == pytest.approx(0.2)

    def cell(method, st, seed, kl, ess, masked, clip):
        return {"stage": "final", "task": "walk", "method": method, "staleness": st, "dtype": "bf16", "seed": seed,
                "kl_k3": kl, "ess": ess, "masked_fraction": masked, "clip_fraction": clip}

    results = [cell("none", 4, 0, 0.1, 0.7, 0.0, 0.0), cell("none", 4, 1, 0.3, 0.5, 0.0, 0.0),
               cell("seq_mis", 4, 0, 0.03, 0.9, 0.6, 0.01), cell("bypass", 4, 0, 0.01, 0.98, 0.0, 0.035)]
    kl = sweep.matrix(results, cell=sweep.mismatch_cell).splitlines()
    assert "| walk | none | 2.0e-01 / 0.60 |" in kl  # means over the two seeds
    dropped = sweep.matrix(results, cell=sweep.dropped_cell).splitlines()
    assert "| walk | seq_mis | 60.0 / 1.0 |" in dropped and "| walk | bypass | 0.0 / 3.5 |" in dropped
    del results[3]["clip_fraction"]  # results written before the key existed: shown as unknown, not 0
    assert "| walk | bypass | 0.0 / nan |" in sweep.matrix(results, cell=sweep.dropped_cell).splitlines()
