"""Synthetic verifiable tasks: seeded problems with exact-match rewards.

Each task turns a ``random.Random`` into a ``Problem(prompt, answer)`` and scores a completion
with 1.0 for an exact match (after stripping) and 0.0 otherwise — a verifiable reward with no
model in the loop. The tasks have different length profiles: ``addition`` answers in 1–3
characters, ``reverse`` in 3–5 (both configurable), ``walk`` in 50–150 (long responses, where
products of per-token ratios stop being near 1).

Each task also says how many tokens a response may need (``max_new_tokens``: the train config's
default for it) — the longest answer plus EOS and a little slack for wrong answers to end.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    prompt_ids: tuple[int, ...] | None = None  # rendered once (chat template, BOS) by task=dataset; else None


class Task(Protocol):
    name: str
    max_new_tokens: int

    def sample(self, rng: random.Random) -> Problem: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


def exact_match(problem: Problem, completion: str) -> float:
    return 1.0 if completion.strip() == problem.answer else 0.0


@dataclass(frozen=True)
class Addition:
    """``a+b=`` → ``a+b`` with a, b uniform in [0, 10^digits)."""

    digits: int = 2
    name: str = "addition"
    max_new_tokens: int = 10

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
    max_new_tokens: int = 10

    def sample(self, rng: random.Random) -> Problem:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))
        return Problem(prompt=f"rev {digits}=", answer=digits[::-1])

    def reward(self, problem: Problem, completion: str) -> float:
        return exact_match(problem, completion)


@dataclass(frozen=True)
class Walk:
    """``walk mj`` → ``wgdk…cc``: run a fixed transition table for 50–150 steps (state tracking).

    The alphabet is the 26 letters. A table g (26 × 26, drawn once from ``table_seed``; each
    column a permutation, so the pair map is a bijection and every walk is a cycle) defines
    x_{t+1} = g(x_{t−1}, x_t). The prompt ends with the two seed letters x_1 x_2; the answer is
    x_3 x_4 … up to and including the first *doubled stop letter* — x_{t−1} = x_t ∈ the first
    ``stop_letters`` letters (a–e) — then EOS. Every step is a local rule (the previous two
    letters), so a 0.8M-parameter model learns it in ~200 SFT steps; one wrong letter anywhere
    sends the walk elsewhere, and the exact-match reward is 0. Only seed pairs whose walk stops
    after ``min_len``…``max_len`` letters are sampled (183 of the 676 pairs by default, answers
    ~97 letters on average): every response is long.

    Reward (``partial_credit``, on by default): 1 for the exact answer, else 0.5 × the fraction
    of the answer's letters that the completion gets right before its first mistake. Exact match
    alone was not enough: with 80 % of 100-token responses scored 0, token-mean GRPO pushed down
    the (mostly correct) letters of the failures and the reward fell from 0.22 to 0.05 in 6 steps
    (recommended, bf16, lr 3e-4). Accuracy (warm start, eval) is always exact match.
    """

    min_len: int = 50
    max_len: int = 150
    stop_letters: int = 5
    table_seed: int = 0
    partial_credit: bool = True
    name: str = "walk"
    # warm-start settings the train config uses unless set: long answers make a batch of 128 and
    # an eval of 128 × 160 sampled tokens every 5 steps cost ~10 s a step on 2 cores
    warm_start_defaults: ClassVar[dict[str, Any]] = {"batch_size": 64, "eval_every": 10, "eval_problems": 64}
    table: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    seeds: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 2 <= self.min_len <= self.max_len:
            raise ValueError(f"walk: need 2 ≤ min_len ≤ max_len; got min_len={self.min_len}, max_len={self.max_len}")
        if not 1 <= self.stop_letters <= 26:
            raise ValueError(f"walk: stop_letters must be in [1, 26]; got {self.stop_letters}")
        rng = random.Random(self.table_seed)
        columns = []
        for _ in range(26):
            perm = list(range(26))
            rng.shuffle(perm)
            columns.append(perm)
        table = tuple(tuple(columns[y][x] for y in range(26)) for x in range(26))  # table[x][y] = g(x, y)
        object.__setattr__(self, "table", table)
        seeds = tuple((a, b) for a in range(26) for b in range(26) if self._trace(a, b) is not None)
        if not seeds:
            raise ValueError(f"walk: no seed pair stops within [{self.min_len}, {self.max_len}] letters; "
                             "widen the range or change stop_letters / table_seed")
        object.__setattr__(self, "seeds", seeds)

    @property
    def max_new_tokens(self) -> int:
        return self.max_len + 10  # EOS, and room for a wrong walk to run a little past the longest answer

    def _trace(self, a: int, b: int) -> str | None:
        """The answer for seeds (a, b), or None if the walk does not stop within [min_len, max_len]
        (or the seeds themselves are a doubled stop letter)."""
        if a == b and a < self.stop_letters:
            return None
        seq = [a, b]
        while len(seq) - 2 < self.max_len:
            seq.append(self.table[seq[-2]][seq[-1]])
            if seq[-1] == seq[-2] and seq[-1] < self.stop_letters:
                n = len(seq) - 2
                return "".join(string.ascii_lowercase[x] for x in seq[2:]) if n >= self.min_len else None
        return None

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.choice(self.seeds)
        letters = string.ascii_lowercase
        return Problem(prompt=f"walk {letters[a]}{letters[b]}", answer=self._trace(a, b))

    def reward(self, problem: Problem, completion: str) -> float:
        exact = exact_match(problem, completion)
        if exact or not self.partial_credit:
            return exact
        text, answer = completion.strip(), problem.answer
        prefix = next((i for i, (x, y) in enumerate(zip(text, answer)) if x != y), min(len(text), len(answer)))
        return 0.5 * prefix / len(answer)


TASKS: dict[str, type] = {"addition": Addition, "reverse": Reverse, "walk": Walk}


def make_task(name: str, **params) -> Task:
    """The task called ``name`` (``addition`` | ``reverse`` | ``walk`` | ``larger`` | ``count``) with its parameters.

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
