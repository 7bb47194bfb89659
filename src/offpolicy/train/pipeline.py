"""Rollouts with bounded staleness, generated in the engine's own thread while the trainer trains.

With ``max_staleness`` = s the batch trained at step k is sampled with policy version
max(0, k − s) — staleness k − version ≤ s, exactly s once the pipeline is full — whatever the
timing: the version a batch needs is a function of its step, not of which thread is faster.

s = 0 is synchronous on-policy sampling: generate, then train, in this thread.

s ≥ 1 overlaps. One worker thread owns the engine and runs a FIFO of jobs: ``sync(v)`` (load
version v's weights) and ``generate(k, v)``. At step j (weights at version j) the trainer asks for
batch j and, before waiting for it, submits ``generate(j + s, j)``; after its update it submits
``sync(j + 1)``. So batch j + 1 … j + s are being generated while step j trains, and because the
queue is FIFO a generate job always runs on exactly the weights submitted before it (no lock
on the weights is needed: ``sync`` gets a snapshot the trainer never touches again).

Batches stay queued until ``commit(step)``; ``state()`` waits for the in-flight jobs and returns
the queued batches, so a checkpoint holds every batch generated but not trained on, and a resumed
run trains on exactly the batches — and generates exactly the ones — an uninterrupted run would.
Every job is seeded by its step, so timing never changes a sample.

``staleness_policy`` (issue #25) says what happens to a batch older than ``max_staleness`` when
the trainer reaches it. ``wait`` (the default, above): the engine never runs ahead of the bound,
it waits for the trainer's weights, so nothing is ever too old. ``drop``: the engine keeps one batch
more in flight than the bound allows (it does not wait for the newest weights — prime-rl's
``max_async_level`` above its off-policy bound, TRL's async worker), and a batch that has grown older
than the bound is discarded, counted in ``dropped``, and the next one — sampled on newer weights —
is taken (TRL's AsyncGRPO: "drop stale, pull next"). A batch's index (its seed) then runs ahead of
the step; the queue, the newest index and the drop count are part of the checkpoint, so a resumed
run drops and trains exactly what an uninterrupted one would.

Staleness, split (issue #46; prime-rl #3313, verl #6736, miles #3334). A trained batch's staleness
— the trainer's version when it trains the batch minus the version that sampled it — is the sum of
* in-flight staleness: the versions the trainer published while the batch was still being
  generated (queued in the engine or running): ``finished_version − rollouts.version``, and
* in-queue staleness: the versions published after it was done, while it waited for the trainer:
  ``trained version − finished_version``.
``finished_version`` is the trainer's published version when the job returned (``sync`` and
``next`` advance it in the trainer's thread; the worker reads it), so the split depends on thread
timing — the sum does not. A generate job runs on one set of weights (a ``sync`` job never runs
inside it: one FIFO worker), so no trajectory mixes versions: ``version_span`` counts the syncs
the engine executed while the job ran, 0 by construction here and the quantity a partial-rollout
engine (weights updated mid-generation, verl's fully-async ``min/max_global_steps``) would show.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from offpolicy.engines import RolloutEngine, Rollouts, SamplingConfig
from offpolicy.measure.sync_check import verified_sync
from offpolicy.tasks import Problem, Task, problems
from offpolicy.tasks.tokenizer import prompt_ids


@dataclass
class Pending:
    step: int  # the batch's index (its seed): the step it is trained at under wait; ahead of it after drops
    problems: list[Problem]
    rollouts: Rollouts
    seconds: float  # engine time generating it (in the worker thread when overlapped)
    # the trainer's published version when the job returned (None in checkpoints older than issue #46)
    finished_version: int | None = None
    version_span: int = 0  # weight syncs the engine executed while generating it (module doc)


class RolloutPipeline:
    def __init__(self, engine: RolloutEngine, task: Task, tokenizer, sampling: SamplingConfig, prompts_per_step: int,
                 group_size: int, max_staleness: int, seed: int, pending: list[Pending] | None = None,
                 staleness_policy: str = "wait", last: int | None = None, dropped: int = 0, step_dropped: int = 0,
                 filled: bool = False):
        self.engine, self.task, self.tokenizer, self.sampling = engine, task, tokenizer, sampling
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_staleness, self.seed = max_staleness, seed
        self.policy = staleness_policy
        self.pending: deque[Pending | Future[Pending]] = deque(pending or [])
        # newest batch index requested (a checkpoint's, where a drop emptied the queue)
        self._last = self.pending[-1].step if self.pending else last
        self.dropped = dropped  # rollouts (rows) discarded as too old, over the whole run
        # of those, the ones dropped for the step not yet committed: a stop while ``next`` waits after a
        # drop keeps them with the queue they left, so the resumed step reports them as an uninterrupted one
        self.step_dropped = step_dropped
        self.filled = filled  # the uncommitted step's request has topped the queue up (once per request)
        self.last_dropped, self._taken = 0, None
        # one worker = one engine user at a time, jobs in submission order
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="offpolicy-engine") if max_staleness > 0 else None
        self._syncing: Future | None = None
        self.generated: list[int] = []  # steps generated by this pipeline, in order (tests count them)
        self.published = 0  # the trainer's newest version (read by the worker when a job returns)
        self._syncs_done = 0  # weight syncs the engine has executed (worker thread)

    @property
    def overlapped(self) -> bool:
        return self._worker is not None

    def _generate(self, step: int, version: int) -> Pending:
        batch = problems(self.task, self.prompts_per_step, seed=self.seed * 1_000_003 + step)
        rows = [p for p in batch for _ in range(self.group_size)]  # groups are consecutive rows
        start, syncs = time.perf_counter(), self._syncs_done
        # each prompt tokenized once, its rows given copies (64 tokenizer calls: 1.1 → 0.14 ms, issue #49)
        ids = [prompt_ids(self.tokenizer, p) for p in batch]
        rollouts = self.engine.generate([list(p) for p in ids for _ in range(self.group_size)], self.sampling,
                                        seed=self.seed * 7_919 + step, version=version)
        rollouts.validate(self.engine.name)
        self.generated.append(step)
        return Pending(step, rows, rollouts, time.perf_counter() - start, finished_version=max(self.published, version),
                       version_span=self._syncs_done - syncs)

    def _sync_job(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        verified_sync(self.engine, weights)  # a sync that changed nothing is an error (offpolicy.measure.sync_check)
        self._syncs_done += 1

    def _submit(self, fn: Callable, *args) -> Future:
        if self._worker is not None:
            return self._worker.submit(fn, *args)
        done: Future = Future()
        done.set_result(fn(*args))
        return done

    def next(self, step: int, version: int) -> tuple[Pending, float]:
        """The batch to train at ``step`` (weights at ``version``) and the seconds this thread waited
        for it; ``last_dropped`` counts the rollouts dropped as too old to get it (``drop`` only).
        Requests what the staleness window needs with ``version`` first, so those generate while
        ``step`` trains."""
        self.published = max(self.published, version)
        depth = self.max_staleness + (2 if self.policy == "drop" else 1)  # batches queued after the request
        waited = 0.0
        fill = not self.filled  # once per request (again only if drops empty the queue): the engine's pace
        while True:
            while fill and len(self.pending) < depth or not self.pending:
                target = step if self._last is None else self._last + 1
                self.pending.append(self._submit(self._generate, target, version))
                self._last = target
            fill, self.filled = False, True
            start = time.perf_counter()
            head = self.pending[0]
            item = head.result() if isinstance(head, Future) else head
            self.pending[0] = item
            waited += time.perf_counter() - start
            staleness = version - item.rollouts.version
            if self.policy == "drop" and staleness > self.max_staleness:
                self.pending.popleft()  # too old: discard it and pull the next, newer one
                # counted at once: a stop in the next wait (SIGTERM) checkpoints the queue without it
                self.dropped += len(item.rollouts)
                self.step_dropped += len(item.rollouts)
                continue
            break
        self.last_dropped, self._taken = self.step_dropped, item
        if self.policy == "wait" and item.step != step:
            raise RuntimeError(f"rollout pipeline out of order: wanted step {step}, have {item.step}")
        if not 0 <= staleness <= self.max_staleness:
            raise RuntimeError(f"staleness {staleness} outside [0, {self.max_staleness}] at step {step}")
        return item, waited

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load new weights into the engine, after every job submitted so far. Overlapped, the
        engine reads them later: pass tensors the trainer will not modify (a snapshot).
        ``version``: the trainer's version these weights are (default: one more than the last
        published), the in-flight / in-queue split's clock (module doc)."""
        if self._syncing is not None and self._syncing.done():
            self._syncing.result()  # surface a failed earlier sync here, not never
        self.published = self.published + 1 if version is None else version
        self._syncing = self._submit(self._sync_job, weights)

    @staticmethod
    def split_staleness(item: Pending, version: int) -> tuple[int, int]:
        """(in-flight, in-queue) staleness of ``item`` trained at ``version``; they add up to
        ``version − item.rollouts.version``. A batch from a checkpoint without the split counts
        as done when sampled (all in-queue)."""
        sampled = item.rollouts.version
        finished = sampled if item.finished_version is None else min(max(item.finished_version, sampled), version)
        return finished - sampled, version - finished

    def commit(self, step: int) -> None:
        """The batch ``next`` gave for ``step`` has been trained on: drop it."""
        if self.pending and self.pending[0] is self._taken:
            self.pending.popleft()
        self.step_dropped, self.filled = 0, False

    def counters(self) -> dict[str, int | None]:
        """What a checkpoint keeps beside the queue (``state``): the keyword arguments that restore it."""
        return {"last": self._last, "dropped": self.dropped, "step_dropped": self.step_dropped, "filled": self.filled}

    @property
    def last(self) -> int | None:
        """The newest batch index requested (saved with the queue: see the module doc)."""
        return self._last

    def state(self) -> list[Pending]:
        """The queued batches, oldest first (waits for those still generating)."""
        self.pending = deque(p.result() if isinstance(p, Future) else p for p in self.pending)
        if self._syncing is not None:
            self._syncing.result()
        return list(self.pending)

    def close(self) -> None:
        """Stop the worker: finish the job it runs, drop the queued ones."""
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
