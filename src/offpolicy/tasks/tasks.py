"""Synthetic verifiable tasks: seeded problems with exact-match rewards.

Each task turns a ``random.Random`` into a ``Problem(prompt, answer)`` and scores a completion
with 1.0 for an exact match (after stripping) and 0.0 otherwise — a verifiable reward with no
model in the loop. The two tasks have different length profiles: ``addition`` answers in 1–3
characters, ``reverse`` in 3–5 (both configurable).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Problem: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


def exact_match(problem: Problem, completion: str) -> float:
    return 1.0 if completion.strip() == problem.answer else 0.0


@dataclass(frozen=True)
class Addition:
    """``a+b=`` → ``a+b`` with a, b uniform in [0, 10^digits)."""

    digits: int = 2
    name: str = "addition"

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    def reward(self, problem: Problem, completion: str) -> float:
        return exact_match(problem, completion)


@dataclass(frozen=True)
class Reverse:
    """``rev 1234=`` → ``4321`` for digit strings of length in [min_len, max_len]."""

    min_len: int = 3
    max_len: int = 5
    name: str = "reverse"

    def sample(self, rng: random.Random) -> Problem:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))
        return Problem(prompt=f"rev {digits}=", answer=digits[::-1])

    def reward(self, problem: Problem, completion: str) -> float:
        return exact_match(problem, completion)


TASKS: dict[str, type] = {"addition": Addition, "reverse": Reverse}


def make_task(name: str, **params) -> Task:
    """The task called ``name`` (``addition`` | ``reverse``) with its parameters.

    Raises:
        ValueError: unknown task name.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return TASKS[name](**params)


def problems(task: Task, n: int, seed: int) -> list[Problem]:
    """``n`` problems from ``task``, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(n)]
