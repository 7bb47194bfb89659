"""``task: count`` — a long, graded answer a small chat model half-solves (issue #54).

"Count from 1 to 17. Write the numbers only, separated by commas." The answer is the count itself,
``1, 2, 3, …, 17`` — 20–110 tokens on SmolLM2's tokenizer, so the responses are long enough for a
length blow-up to show (``max_new_tokens`` 128: the truncated share). The prompt is the user turn of
the model's chat template (rendered by ``ChatRendered``, as ``task=larger``'s), so the task needs a
model directory with a tokenizer (``model=DIR``).

A prompt is one combination of

* a wording (``WORDINGS``: six phrasings of "count from a to b, the numbers only, separated by …"),
* a separator (``SEPARATORS``: spaces, commas or new lines — named in the prompt; the exact answer
  joins the numbers with it),
* a start ``a`` in ``starts`` (1 by default: SmolLM2-135M-Instruct almost never counts from an
  arbitrary number, docs/science.md) and an end ``b`` in ``[low, high]``.

Reward, with partial credit (``count_reward``), on the integers the completion writes, in order::

    r = 1                                     when they are exactly a, a+1, …, b
    r = 0.5 · (correct prefix length) / (b − a + 1)   otherwise

so a sentence before the numbers costs nothing, a skipped number keeps the credit of the numbers
before it, and running past ``b`` (or a list in brackets with a stray number) earns at most 0.5: bad
samples share prefixes with good ones, and GRPO's advantage separates them by how far they got.

Splits: the prompts are shuffled once with ``split_seed`` and the first ``n_held_out`` of them are the
eval set (``held_out``; ≥ 128 by default, the same for every RL seed); training draws only from the
others. The held-out prompts are distinct strings, none of them a training prompt (their ends ``b``
appear in training with other wordings or separators: the eval measures the counting, not a memory
of one prompt).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from offpolicy.tasks.tasks import Problem

_DIGITS = re.compile(r"\d+")

WORDINGS = (
    "Count from {a} to {b}. Write the numbers only, separated by {sep}.",
    "List the numbers from {a} to {b} in order, separated by {sep}. Numbers only.",
    "Write every whole number from {a} to {b}, separated by {sep}, and nothing else.",
    "Please count from {a} up to {b}. Give only the numbers, separated by {sep}.",
    "Count up from {a} to {b}, writing only the numbers separated by {sep}.",
    "Write the numbers {a} to {b} in increasing order, separated by {sep}. No other text.",
)
# the separator's name in the prompt → the text between two numbers in the exact answer
SEPARATORS = {"spaces": " ", "commas": ", ", "new lines": "\n"}


def count_numbers(completion: str) -> list[int]:
    """The non-negative integers written in ``completion``, in order ("1, 2,3\\n4." → [1, 2, 3, 4])."""
    return [int(x) for x in _DIGITS.findall(completion)]


def count_reward(completion: str, target: list[int]) -> float:
    """1 when the integers of ``completion`` are exactly ``target``, else 0.5 × the share of ``target``
    they match from the start (the correct prefix's share)."""
    got = count_numbers(completion)
    if got == target:
        return 1.0
    prefix = 0
    for x, y in zip(got, target):
        if x != y:
            break
        prefix += 1
    return 0.5 * prefix / len(target)


@dataclass(frozen=True)
class Count:
    """Count from ``a`` to ``b`` with the numbers only; see the module docstring."""

    low: int = 8
    high: int = 30
    starts: tuple[int, ...] = (1,)
    n_held_out: int = 160
    split_seed: int = 0
    name: str = "count"
    max_new_tokens: int = 128  # the longest exact answer (1–30 by new lines or commas) is ~90 tokens and EOS
    needs_model_dir: bool = field(default=True, repr=False)  # prompts go through the model's chat template
    answer_is_completion: bool = field(default=True, repr=False)  # the eval's teacher-forced answer (train/evaluate.py)
    train_keys: tuple[tuple[int, int, int, str], ...] = field(init=False, repr=False, compare=False)
    held_out_keys: tuple[tuple[int, int, int, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts = tuple(self.starts)
        object.__setattr__(self, "starts", starts)
        if not starts or min(starts) < 0 or max(starts) >= self.low or self.low > self.high:
            raise ValueError(f"count: need 0 ≤ every start < low ≤ high; got starts={starts}, low={self.low}, "
                             f"high={self.high}")
        keys = [(w, a, b, sep) for w in range(len(WORDINGS)) for sep in SEPARATORS for a in starts
                for b in range(self.low, self.high + 1)]
        if not 1 <= self.n_held_out < len(keys):
            raise ValueError(f"count: n_held_out must be in [1, {len(keys) - 1}] (there are {len(keys)} prompts); "
                             f"got {self.n_held_out}")
        random.Random(self.split_seed).shuffle(keys)
        object.__setattr__(self, "held_out_keys", tuple(keys[: self.n_held_out]))
        object.__setattr__(self, "train_keys", tuple(keys[self.n_held_out:]))

    @staticmethod
    def problem(wording: int, a: int, b: int, sep: str) -> Problem:
        prompt = WORDINGS[wording].format(a=a, b=b, sep=sep)
        return Problem(prompt=prompt, answer=SEPARATORS[sep].join(str(i) for i in range(a, b + 1)))

    def sample(self, rng: random.Random) -> Problem:
        return self.problem(*rng.choice(self.train_keys))

    @property
    def held_out(self) -> tuple[Problem, ...]:
        return tuple(self.problem(*key) for key in self.held_out_keys)

    def reward(self, problem: Problem, completion: str) -> float:
        return count_reward(completion, count_numbers(problem.answer))
