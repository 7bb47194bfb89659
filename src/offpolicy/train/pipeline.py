"""Rollouts with bounded staleness.

With ``max_staleness`` = s, before training step j the pipeline makes sure the batches for
steps j..j+s exist, generating the missing ones with the engine's current weights (version j).
So the batch trained at step k was sampled with version max(0, k − s): staleness k − version
≤ s, exactly s once the pipeline is full. s = 0 is synchronous on-policy sampling.

Generation is sequential and seeded by step, so runs (and resumed runs) are reproducible.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from offpolicy.engines import RolloutEngine, Rollouts, SamplingConfig
from offpolicy.tasks import Problem, Task, problems
from offpolicy.train.warmstart import prompt_ids


@dataclass
class Pending:
    step: int
    problems: list[Problem]
    rollouts: Rollouts
    seconds: float


class RolloutPipeline:
    def __init__(self, engine: RolloutEngine, task: Task, tokenizer, sampling: SamplingConfig, prompts_per_step: int,
                 group_size: int, max_staleness: int, seed: int, pending: list[Pending] | None = None):
        self.engine, self.task, self.tokenizer, self.sampling = engine, task, tokenizer, sampling
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_staleness, self.seed = max_staleness, seed
        self.pending: deque[Pending] = deque(pending or [])

    def _generate(self, step: int, version: int) -> Pending:
        import time

        batch = problems(self.task, self.prompts_per_step, seed=self.seed * 1_000_003 + step)
        rows = [p for p in batch for _ in range(self.group_size)]  # groups are consecutive rows
        start = time.perf_counter()
        rollouts = self.engine.generate([prompt_ids(self.tokenizer, p) for p in rows], self.sampling,
                                        seed=self.seed * 7_919 + step, version=version)
        rollouts.validate(self.engine.name)
        return Pending(step, rows, rollouts, time.perf_counter() - start)

    def next(self, step: int, version: int) -> Pending:
        """The batch for ``step``; generates what the staleness window needs with ``version``.
        The batch stays queued until ``commit(step)``, so a checkpoint taken before the step's
        update still holds it."""
        while not self.pending or self.pending[-1].step < step + self.max_staleness:
            target = self.pending[-1].step + 1 if self.pending else step
            self.pending.append(self._generate(target, version))
        item = self.pending[0]
        if item.step != step:
            raise RuntimeError(f"rollout pipeline out of order: wanted step {step}, have {item.step}")
        staleness = step - item.rollouts.version
        if not 0 <= staleness <= self.max_staleness:
            raise RuntimeError(f"staleness {staleness} outside [0, {self.max_staleness}] at step {step}")
        return item

    def commit(self, step: int) -> None:
        """The batch of ``step`` has been trained on: drop it."""
        if self.pending and self.pending[0].step == step:
            self.pending.popleft()

    def state(self) -> list[Pending]:
        return list(self.pending)
