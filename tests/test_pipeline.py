"""The overlapped rollout pipeline and the trainer's shortcuts: staleness bounded under real
overlap, no batch lost or generated twice across a checkpoint, the π_old skip identical to the
recompute path, stage timings in the summary, and the engine dtype chosen (with its reason) in the run's config."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import offpolicy as op
import yaml

from conftest import FAST
from offpolicy.engines import Rollouts, SamplingConfig
from offpolicy.tasks import make_task
from offpolicy.tasks.tokenizer import build_char_tokenizer
from offpolicy.train.config import load_train_config, resolve_engine_dtype
from offpolicy.train.loop import train
from offpolicy.train.pipeline import RolloutPipeline


class RecordingEngine:
    """Answers every prompt with one token, after ``delay`` s; records what ran when, in which thread."""

    name = "recording"

    def __init__(self, delay: float = 0.0):
        self.delay, self.version, self.events = delay, 0, []

    def generate(self, prompt_ids, sampling, seed, version):
        start = time.perf_counter()
        time.sleep(self.delay)
        if version != self.version:  # the pipeline promised these weights
            raise AssertionError(f"generate asked for version {version}, engine holds {self.version}")
        self.events.append(("generate", seed, version, start, time.perf_counter(), threading.get_ident()))
        return Rollouts([list(p) for p in prompt_ids], [[5] for _ in prompt_ids], [[-1.0] for _ in prompt_ids],
                        [False] * len(prompt_ids), version)

    def sync_weights(self, named_tensors):
        self.version = dict(named_tensors)["version"].item()

    def close(self):
        pass


def pipeline(engine, staleness: int, pending=None) -> RolloutPipeline:
    return RolloutPipeline(engine, make_task("reverse"), build_char_tokenizer(), SamplingConfig(max_tokens=1), 2, 2,
                           staleness, seed=0, pending=pending)


def drive(pipe: RolloutPipeline, steps: range, version: int, train_seconds: float = 0.0, record=None):
    """The trainer's side of the loop: take the batch, 'train', sync the next version, commit. Per step,
    ``record(pipe, item)`` where given, else (step, the batch's version, training's start and end)."""
    trained = []
    for step in steps:
        item, _ = pipe.next(step, version)
        start = time.perf_counter()
        time.sleep(train_seconds)
        trained.append(record(pipe, item) if record else (step, item.rollouts.version, start, time.perf_counter()))
        version += 1
        pipe.sync([("version", torch.tensor(version))])
        pipe.commit(step)
    return trained, version


@pytest.mark.parametrize("staleness", [1, 3])
def test_overlap_keeps_staleness_exact_and_really_overlaps(staleness):
    engine = RecordingEngine(delay=0.03)
    pipe = pipeline(engine, staleness)
    # training takes 150 ms: the worker has that long to start the next batch (margin for a loaded machine)
    trained, _ = drive(pipe, range(6), version=0, train_seconds=0.15)
    pipe.close()
    # batch k is sampled by version max(0, k − s), however the threads interleave
    assert [v for _, v, _, _ in trained] == [max(0, k - staleness) for k in range(6)]
    gens = {seed: (start, end, tid) for _, seed, _, start, end, tid in engine.events}
    assert {tid for _, _, tid in gens.values()} == {next(iter(gens.values()))[2]} != {threading.get_ident()}
    # overlap: the batch for step k + 1 started generating before step k finished training
    for step, _, _, train_end in trained[:-1]:
        assert gens[step + 1][0] < train_end, step


def test_synchronous_pipeline_runs_in_the_calling_thread():
    engine = RecordingEngine()
    trained, _ = drive(pipeline(engine, 0), range(3), version=0)
    assert [v for _, v, _, _ in trained] == [0, 1, 2]
    assert {e[-1] for e in engine.events} == {threading.get_ident()}


@pytest.mark.parametrize("cut", [1, 4])
def test_checkpoint_mid_pipeline_loses_and_duplicates_no_batch(cut):
    staleness, total = 2, 7
    straight = RecordingEngine(delay=0.01)
    pipe = pipeline(straight, staleness)
    reference, _ = drive(pipe, range(total), version=0)
    pipe.close()

    first = RecordingEngine(delay=0.01)
    pipe = pipeline(first, staleness)
    trained, version = drive(pipe, range(cut), version=0)
    pending = pipe.state()  # what a checkpoint holds: generated, not yet trained
    pipe.close()
    assert [p.step for p in pending] == list(range(cut, cut + staleness))
    second = RecordingEngine(delay=0.01)
    second.version = version  # a resumed engine starts from the checkpoint's weights
    pipe = pipeline(second, staleness, pending=pending)
    rest, _ = drive(pipe, range(cut, total), version=version)
    pipe.close()
    # every batch id generated at most once over both halves, none missing, each trained exactly once; the
    # batches queued beyond the last step may or may not have started when the pipeline closed (timing)
    ids = [e[1] for e in first.events + second.events]
    assert len(ids) == len(set(ids)) and set(range(total)) <= set(ids) <= set(range(total + staleness))
    assert [e[1] for e in first.events] == list(range(cut + staleness))  # the queued ones were checkpointed
    assert pipe.generated == [e[1] for e in second.events]
    assert [(s, v) for s, v, _, _ in trained + rest] == [(s, v) for s, v, _, _ in reference]


def test_engine_failure_in_the_worker_reaches_the_trainer():
    class Broken(RecordingEngine):
        def generate(self, *args, **kwargs):
            raise RuntimeError("engine died")

    pipe = pipeline(Broken(), 1)
    with pytest.raises(RuntimeError, match="engine died"):
        pipe.next(0, 0)
    pipe.close()


def _run(tmp_path: Path, name: str, *overrides: str):
    cfg = load_train_config(None, [*FAST, "minibatches=1", f"out_dir={tmp_path / name}", *overrides])
    return train(cfg, progress=False)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(a: list[dict], b: list[dict]) -> None:
    """Every logged number equal, step by step, except wall-clock times."""
    for ra, rb in zip(a, b, strict=True):
        for key in ra:
            if not key.startswith(("time/", "memory/")) and key not in ("step_seconds", "generate/tokens_per_s"):
                assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


@pytest.mark.slow
def test_bypass_never_runs_the_pi_old_forward(offpolicy_cache, tmp_path):
    # anchor 'rollout' puts μ where π_old would go: with two mini-batches (π_old ≠ π_θ on the second)
    # the forward would still be wasted, so it is skipped — and the run is the one that computes it
    bypass = ("steps=2", "minibatches=2", "preset=verl:bypass_ppo_clip")
    skipped = _records(_run(tmp_path, "bypass", *bypass).run_dir)
    computed = _records(_run(tmp_path, "bypass-recompute", *bypass, "recompute_old=true").run_dir)
    assert all(r["time/pi_old"] < 1e-3 for r in skipped) and all(r["time/pi_old"] > 0 for r in computed)
    _assert_same_run(skipped, computed)


def test_which_losses_read_pi_old():
    from offpolicy.train.loop import uses_old

    assert uses_old(op.presets.loss("recommended").model_copy(update={"correction": op.CorrectionConfig()}))
    assert not uses_old(op.presets.loss("verl:bypass_ppo_clip"))
    assert not uses_old(op.presets.loss("slime:current"))  # REINFORCE, weight sg(π_θ)/μ
    assert not uses_old(op.LossConfig(kind="reinforce"))
    assert uses_old(op.LossConfig(kind="reinforce", correction={"anchor": "old", "weight": {
        "level": "token", "mode": "truncate", "high": 2.0}}))  # the weight is π_old/μ


def test_choose_old_gives_each_source_of_pi_old():
    """``choose_old`` (train/loop.py), the π_old choice as one named function: the π_old forward's rows where it
    ran; the update's own forward, detached, where it is skipped — keeping the shown rows' log-probs only with one
    update per batch; AReaL's log-linear interpolation under prox_logp=loglinear."""
    from types import SimpleNamespace

    from offpolicy.train.loop import choose_old

    old = torch.arange(12.0).reshape(4, 3)
    mb = SimpleNamespace(mask=torch.ones(2, 2), rollout_logprobs=torch.full((2, 2), -1.0))
    logprobs = torch.full((2, 2), -0.5, requires_grad=True)
    rows = torch.tensor([1, 3])
    scored = SimpleNamespace(item=SimpleNamespace(rollouts=SimpleNamespace(version=4)))

    def run(**kw):
        return SimpleNamespace(**{"cfg": SimpleNamespace(prox_logp="forward"), "version": 5,
                                  "device": torch.device("cpu"), "single": False, "skip_old": False, **kw})

    old_of, kept = choose_old(run(), scored, old, {1})
    assert kept is None and torch.equal(old_of(rows, mb, logprobs), old[[1, 3], :2])
    for single, want in ((True, {1}), (False, None)):
        old_of, kept = choose_old(run(skip_old=True, single=single), scored, None, {1})
        got = old_of(rows, mb, logprobs)
        assert torch.equal(got, logprobs.detach()) and not got.requires_grad
        assert (None if kept is None else set(kept)) == want
    old_of, kept = choose_old(run(cfg=SimpleNamespace(prox_logp="loglinear"), skip_old=True), scored, None, {1})
    want = op.loglinear_proximal(logprobs, mb.rollout_logprobs, 4, current_version=6)
    assert kept is None and torch.equal(old_of(rows, mb, logprobs), want)


@pytest.mark.slow
def test_pi_old_skip_is_identical_to_recomputing_it(offpolicy_cache, tmp_path):
    skipped = _run(tmp_path, "skip", "steps=3")
    recomputed = _run(tmp_path, "recompute", "steps=3", "recompute_old=true")
    a, b = _records(skipped.run_dir), _records(recomputed.run_dir)
    assert all(r["time/pi_old"] < 1e-3 for r in a)  # the skip happened (no forward takes under 1 ms)
    assert all(r["time/pi_old"] > 0 for r in b)
    _assert_same_run(a, b)
    from safetensors.torch import load_file

    wa = load_file(skipped.run_dir / "checkpoints" / "step-3" / "model.safetensors")
    wb = load_file(recomputed.run_dir / "checkpoints" / "step-3" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # the summary shows where the time went, stage by stage
    for stage in ("generate", "score", "pi_old", "train", "sync", "log", "eval", "write"):
        assert f"time/{stage}" in skipped.summary, stage
    # the eval has its own stage, on the steps that evaluate only (step 0 and the last): not inside "log"
    assert [r["step"] for r in a if "time/eval" in r] == [r["step"] for r in a if "eval/accuracy" in r] == [0, 2]


def test_engine_dtype_auto_is_resolved_with_a_reason(monkeypatch):
    from offpolicy.train import config as train_config

    cfg = load_train_config(None, [])
    assert cfg.engine.dtype == "auto"
    monkeypatch.setattr(train_config, "_native_bf16", lambda: (False, "CPU has no native bf16"))
    assert resolve_engine_dtype(cfg) == ("fp32", "auto: CPU has no native bf16")
    monkeypatch.setattr(train_config, "_native_bf16", lambda: (True, "CPU has native bf16 (amx_bf16)"))
    assert resolve_engine_dtype(cfg)[0] == "bf16"
    forced = load_train_config(None, ["engine.dtype=fp16"])  # mismatch experiments still force a dtype
    assert resolve_engine_dtype(forced) == ("fp16", "set in the config")


def test_a_resumed_run_keeps_the_engine_dtype_auto_chose(monkeypatch):
    """A run created where auto chose bf16 and resumed on a machine without native bf16 keeps bf16 (its
    mismatch is its engine's); engine_dtype set on the resume still wins. On 65ba3dd the resume chose again."""
    from offpolicy.train import config as train_config

    monkeypatch.setattr(train_config, "_native_bf16", lambda: (False, "CPU has no native bf16"))
    recorded = {"engine_dtype": "bf16", "engine_dtype_reason": "auto: CPU has native bf16 (amx_bf16)"}
    dtype, why = resolve_engine_dtype(load_train_config(None, []), recorded)
    assert dtype == "bf16" and "a resume keeps it" in why and "amx_bf16" in why
    assert resolve_engine_dtype(load_train_config(None, ["engine.dtype=fp32"]), recorded) == ("fp32", "set in the config")
    assert resolve_engine_dtype(load_train_config(None, []), {})[0] == "fp32"  # nothing recorded: chosen now


@pytest.mark.slow
def test_run_config_records_the_dtype_and_resumes_from_it(offpolicy_cache, tmp_path):
    first = _run(tmp_path, "auto", "steps=2", "engine.dtype=auto", "max_staleness=1")
    saved = yaml.safe_load((first.run_dir / "config.yaml").read_text())
    assert saved["resolved"]["engine_dtype"] in ("fp32", "bf16") and saved["resolved"]["engine_dtype_reason"]
    assert saved["train"]["engine"]["dtype"] == "auto"
    again = load_train_config(first.run_dir / "config.yaml", ["steps=3"])  # what --resume reads
    resumed = train(again, resume=first.run_dir, progress=False)
    assert [r["step"] for r in _records(resumed.run_dir)] == [0, 1, 2]
    assert [r["staleness"] for r in _records(resumed.run_dir)] == [0, 1, 1]


def test_threads_auto_leaves_torchs_default_and_a_set_number_is_taken():
    from offpolicy.train import loop

    cfg = load_train_config(None, [])
    assert cfg.trainer.threads == "auto" and loop.cpu_threads(cfg)[0] is None
    assert loop.cpu_threads(load_train_config(None, ["trainer.threads=3"])) == (3, "set in the config")
    with pytest.raises(Exception, match="trainer.threads=0"):
        load_train_config(None, ["trainer.threads=0"])


def test_a_run_trains_at_its_thread_count_and_gives_the_callers_back(offpolicy_cache, tmp_path):
    """The run's torch threads are set before the engine starts and restored when it ends, even after vLLM's
    CPU worker (engine=vllm) has made torch.set_num_threads a no-op in this process."""
    from offpolicy.train.logger import RunLogger

    seen: list[int] = []
    log = RunLogger.log
    before = torch.get_num_threads()
    torch._C.set_num_threads(2)  # the caller's count, other than the run's (torch's own setter: see set_threads)
    try:
        RunLogger.log = lambda self, step, values: (seen.append(torch.get_num_threads()), log(self, step, values))
        _run(tmp_path, "threads", "steps=1", "trainer.threads=1")
        after = torch.get_num_threads()
    finally:
        RunLogger.log = log
        torch._C.set_num_threads(before)
    assert seen == [1] and after == 2


def test_samples_take_log_pi_old_from_the_update_forward(offpolicy_cache, tmp_path, monkeypatch):
    """With one update per batch the sample rows' log π_old come from the update's own forward (issue #49): no
    forward of their own — the same numbers, to fp32 rounding, as the π_old forward of recompute_old=true."""
    from offpolicy.policy.score import Scorer

    calls = []
    forward = Scorer.score  # a no-grad forward of some rows: π_old's, or the sample rows' own
    monkeypatch.setattr(Scorer, "score", lambda *a, **k: (calls.append(1), forward(*a, **k))[1])
    kept = _run(tmp_path, "kept", "steps=2")
    assert calls == []  # old code: one forward of the sample rows per step
    recomputed = _run(tmp_path, "recomputed", "steps=2", "recompute_old=true")

    def samples(run_dir):
        return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]

    a, b = samples(kept.run_dir), samples(recomputed.run_dir)
    assert len(a) == len(b) == 2 * 4 and all(r["tokens"] > 0 for r in a)
    for ra, rb in zip(a, b):
        assert ra["log_mu"] == rb["log_mu"] and len(ra["log_pi"]) == ra["tokens"]
        assert ra["log_pi"] == pytest.approx(rb["log_pi"], abs=1e-5)
