"""Issue #25, part 3: the trainer's staleness policy. ``wait`` never trains a batch older than
``max_staleness`` (the engine waits); ``drop`` lets the engine keep one batch more in flight, discards
what has grown older than the bound (counted) and trains the next, newer one — deterministically, so
a resumed run drops and trains exactly what an uninterrupted one does. Sync and async, on the fake
engine of test_pipeline and on the embedded default model."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from conftest import FAST
from offpolicy.engines import SamplingConfig
from offpolicy.tasks import make_task
from offpolicy.tasks.tokenizer import build_char_tokenizer
from offpolicy.train.config import load_train_config
from offpolicy.train.loop import train
from offpolicy.train.pipeline import RolloutPipeline
from test_pipeline import RecordingEngine, drive


def _pipe(engine, staleness, policy, **state) -> RolloutPipeline:
    return RolloutPipeline(engine, make_task("reverse"), build_char_tokenizer(), SamplingConfig(max_tokens=1), 2, 2,
                           staleness, seed=0, staleness_policy=policy, **state)


def _drive(pipe, steps, version):
    """(batch index, its version, rollouts dropped to get it) per step, as the trainer's loop sees them."""
    return drive(pipe, steps, version, record=lambda p, item: (item.step, item.rollouts.version, p.last_dropped))


@pytest.mark.parametrize("staleness", [0, 1])
def test_drop_discards_what_grew_too_old_and_wait_never_does(staleness):
    waited, _ = _drive(_pipe(RecordingEngine(), staleness, "wait"), range(6), 0)
    assert [(i, v) for i, v, _ in waited] == [(k, max(0, k - staleness)) for k in range(6)]
    assert all(d == 0 for _, _, d in waited)
    engine = RecordingEngine()
    dropped, _ = _drive(_pipe(engine, staleness, "drop"), range(6), 0)
    # each request tops the queue up to s + 2 batches on the current weights, then drops heads older
    # than s (4 rollouts each = 2 prompts × group 2). s = 0: step 0 queues 0,1 @v0, trains 0; step 1
    # queues 2 @v1, drops 1 (1 old), trains 2; step 2 queues 3,4 @v2, trains 3; step 3 queues 5 @v3,
    # drops 4 ... s = 1: step 0 queues 0,1,2 @v0; step 1 adds 3 @v1, trains 1 (1 old); step 2 adds 4 @v2,
    # drops 2 (2 old), trains 3 @v1; step 3 adds 5,6 @v3, trains 4 @v2; step 4 adds 7, trains 5; step 5
    # adds 8, drops 6 @v3, trains 7 @v4
    want = {0: [(0, 0, 0), (2, 1, 4), (3, 2, 0), (5, 3, 4), (6, 4, 0), (8, 5, 4)],
            1: [(0, 0, 0), (1, 0, 0), (3, 1, 4), (4, 2, 0), (5, 3, 0), (7, 4, 4)]}[staleness]
    assert dropped == want
    assert all(step - v <= staleness for step, (_, v, _) in enumerate(dropped))  # nothing trained too old
    assert [e[1] for e in engine.events] == list(range(len(engine.events)))  # every index generated once


@pytest.mark.parametrize(("staleness", "cut"), [(0, 2), (1, 4), (1, 3)])
def test_drop_resumes_exactly(staleness, cut):
    straight, _ = _drive(_pipe(RecordingEngine(), staleness, "drop"), range(7), 0)
    first = _pipe(RecordingEngine(), staleness, "drop")
    head, version = _drive(first, range(cut), 0)
    saved = {"pending": first.state(), "last": first.last, "dropped": first.dropped}  # what the checkpoint holds
    first.close()
    engine = RecordingEngine()
    engine.version = version
    rest, _ = _drive(_pipe(engine, staleness, "drop", **saved), range(cut, 7), version)
    assert head + rest == straight


class _StopWhileWaiting(Exception):
    """Stands for the KeyboardInterrupt a SIGTERM raises in the trainer's thread while it waits."""


@pytest.mark.parametrize(("staleness", "stop_at"), [(0, 1), (0, 3), (1, 2)])
def test_a_stop_while_waiting_after_a_drop_resumes_exactly(monkeypatch, staleness, stop_at):
    """Issue #43: SIGTERM while ``next`` waits for the batch after a drop. The dropped batch has left the
    queue; at 3be706e its rows were counted only once ``next`` returned, so the checkpoint lost them and
    the resumed run's dropped_rollouts_total fell short of the uninterrupted run's for good."""
    from concurrent.futures import Future

    straight, _ = _drive(_pipe(RecordingEngine(), staleness, "drop"), range(6), 0)
    first = _pipe(RecordingEngine(), staleness, "drop")
    head, version = _drive(first, range(stop_at), 0)
    assert straight[stop_at][2] > 0  # the step cut here drops a batch first
    real_result = Future.result
    calls = []

    def result(self, timeout=None):  # the first wait after the drop is interrupted, its batch still generated
        value = real_result(self, timeout)
        if first.step_dropped and not calls:
            calls.append(value)
            raise _StopWhileWaiting()
        return value

    monkeypatch.setattr(Future, "result", result)
    with pytest.raises(_StopWhileWaiting):
        first.next(stop_at, version)
    monkeypatch.setattr(Future, "result", real_result)
    saved = {"pending": first.state(), **first.counters()}  # what the interrupt checkpoint holds
    first.close()
    engine = RecordingEngine()
    engine.version = version
    resumed = _pipe(engine, staleness, "drop", **saved)
    rest, _ = _drive(resumed, range(stop_at, 6), version)
    assert head + rest == straight  # each step's batch, version and dropped_rollouts
    total = sum(d for _, _, d in straight)
    assert resumed.dropped == total  # dropped_rollouts_total


class HeldEngine(RecordingEngine):
    """Holds the generation of batch k until the trainer has published version ``hold[k]``."""

    def __init__(self, hold: dict[int, int]):
        super().__init__()
        self.hold, self.pipe = hold, None

    def generate(self, prompt_ids, sampling, seed, version):
        deadline = time.monotonic() + 30
        while self.pipe.published < self.hold.get(seed, -1):  # seed = batch index (pipeline seed 0)
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {seed} held for version {self.hold[seed]}, never published")
            time.sleep(0.001)
        return super().generate(prompt_ids, sampling, seed, version)


def test_staleness_splits_into_in_flight_and_in_queue():
    """Issue #46 (prime-rl #3313, verl #6736): max_staleness 1, wait. Batch k ≥ 1 is sampled on
    version k − 1 and trained on version k. Batches 1 and 3 are held until the trainer published
    k: the version went by while they were generating (in flight 1, in queue 0). Batch 2 is done
    before the trainer publishes 2: it waited in the queue (in flight 0, in queue 1)."""
    engine = HeldEngine({1: 1, 3: 3})
    pipe = _pipe(engine, 1, "wait")
    engine.pipe = pipe
    version, got = 0, []
    for step in range(4):
        item, _ = pipe.next(step, version)
        got.append((version - item.rollouts.version, *pipe.split_staleness(item, version), item.version_span))
        if step == 1:
            pipe.pending[-1].result()  # batch 2, on version 1, finishes before version 2 is published
        version += 1
        pipe.sync([("version", torch.tensor(version))], version)
        pipe.commit(step)
    pipe.close()
    # (staleness, in flight, in queue, version span)
    assert got == [(0, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 0), (1, 1, 0, 0)]


def test_split_of_a_batch_from_an_older_checkpoint_is_all_in_queue():
    item, _ = _pipe(RecordingEngine(), 0, "wait").next(0, 0)
    item.finished_version = None  # what unpickling a Pending saved before issue #46 gives
    item.rollouts.version = 2
    assert RolloutPipeline.split_staleness(item, 5) == (0, 3)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_train_logs_staleness_and_drops_and_resumes_exactly(offpolicy_cache, tmp_path, staleness):
    def run(name, steps, resume=False):
        cfg = load_train_config(None, [*FAST, f"out_dir={tmp_path / name}", f"steps={steps}",
                                       f"max_staleness={staleness}", "staleness_policy=drop",
                                       "split_metrics=true"])
        return train(cfg, resume=(tmp_path / name) if resume else None, progress=False)

    straight = _records(run("straight", 4).run_dir)
    # 16 rollouts = 4 prompts × group 4, on the steps the pipeline test works out by hand
    drops = {0: [0, 16, 0, 16], 1: [0, 0, 16, 0]}[staleness]
    assert [r["dropped_rollouts"] for r in straight] == drops
    assert [r["dropped_rollouts_total"] for r in straight] == [sum(drops[: i + 1]) for i in range(4)]
    assert all(r["staleness_max"] <= staleness and r["staleness_mean"] <= r["staleness_max"] for r in straight)
    # issue #46: the split adds up to the staleness; one job, one set of weights (no version span)
    assert all(r["staleness/in_flight"] + r["staleness/in_queue"] == r["staleness"] for r in straight)
    assert all(r["staleness/in_flight"] >= 0 and r["staleness/in_queue"] >= 0 for r in straight)
    assert all(r["staleness/version_span"] == 0 for r in straight)
    if staleness == 0:  # generated and trained on the same version: nothing in flight or queued
        assert all(r["staleness/in_flight"] == r["staleness/in_queue"] == 0 for r in straight)
    for key in ("offpolicy/mult_prob_error", "offpolicy/abs_logp_diff_mean", "offpolicy/entropy",
                "offpolicy/kl_over_entropy", "offpolicy/drift/abs_logp_mean", "offpolicy/kl_k3_kept"):  # + issue #46
        assert key in straight[0], key
    run("split", 2)
    run("split", 4, resume=True)
    split = _records(tmp_path / "split")
    for a, b in zip(straight, split):
        # timings, the process's memory, and where the staleness accrued (in flight or queued: thread timing)
        for key in {k for k in a if not k.startswith(("time/", "memory/"))
                    and k not in ("step_seconds", "generate/tokens_per_s", "staleness/in_flight",
                                  "staleness/in_queue", "nonfinite")}:
            assert (a[key] is None and b[key] is None) or math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-9), key
        assert a.get("nonfinite") == b.get("nonfinite")  # each null's reason (train/logger.py, encode_row)
