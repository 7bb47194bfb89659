"""``task: larger`` — a verifiable task a small pretrained chat model half-solves (issue #42).

"Which number is larger, 47 or 82? Answer with the number only." The two numbers are distinct
integers in ``[low, high]`` (10–99 by default). The prompt is the user turn of the model's chat
template (no system prompt of ours: SmolLM2's template adds its own one-line default), so the task
needs a model directory with a tokenizer (``model=DIR``), not the embedded character model.

Reward, with partial credit (``reward``)::

    r = 0.5 · [the first integer in the completion = max(a, b)]
      + 0.5 · [the completion, stripped (and a trailing '.'), is exactly max(a, b)]

so "The larger number is 82." earns 0.5, "82" earns 1 and "47" or a sentence without a number 0.
SmolLM2-135M-Instruct, untrained, mostly answers in sentences: on 40 training prompts × 8 samples
at temperature 0.7 its mean reward is 0.100 (20 % of samples earn 0.5, none 1) with a spread of
rewards in 72.5 % of the groups (docs/science.md, "A real model"), so GRPO has a signal in most
groups, and two things to learn: to put the larger number first, and to answer with it alone.

Splits: the unordered pairs {a, b} are shuffled once with ``split_seed`` and the first
``held_out_share`` of them are held out (each with a fixed order of a and b); training draws only
from the other pairs, in either order. ``held_out`` is the eval set (``eval/accuracy`` is the mean
*reward* of greedy answers to its first ``eval_problems`` rows), the same for every RL seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace
from typing import Any

from offpolicy.tasks.tasks import Problem

_INTEGER = re.compile(r"-?\d+")


def larger_reward(completion: str, answer: str) -> float:
    """0.5 · [first integer of ``completion`` = ``answer``] + 0.5 · [``completion`` is ``answer`` alone].

    "Alone" allows surrounding whitespace and one trailing period ("82." counts, "82 is larger" does not).
    """
    numbers = _INTEGER.findall(completion)
    first = 0.5 if numbers and numbers[0] == answer else 0.0
    text = completion.strip()
    text = text[:-1].rstrip() if text.endswith(".") else text
    return first + (0.5 if text == answer else 0.0)


@dataclass(frozen=True)
class Larger:
    """Which of two integers in ``[low, high]`` is larger; see the module docstring."""

    low: int = 10
    high: int = 99
    held_out_share: float = 0.1
    split_seed: int = 0
    name: str = "larger"
    max_new_tokens: int = 16  # the answer is 2–3 tokens and EOS; a sentence is cut at 16
    needs_model_dir: bool = field(default=True, repr=False)  # prompts go through the model's chat template
    answer_is_completion: bool = field(default=True, repr=False)  # the eval's teacher-forced answer (train/evaluate.py)
    train_pairs: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    held_out_pairs: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"larger: need 0 ≤ low < high; got low={self.low}, high={self.high}")
        if not 0 < self.held_out_share < 1:
            raise ValueError(f"larger: held_out_share must be in (0, 1); got {self.held_out_share}")
        pairs = [(a, b) for a in range(self.low, self.high + 1) for b in range(a + 1, self.high + 1)]
        rng = random.Random(self.split_seed)
        rng.shuffle(pairs)
        n_held = max(1, round(self.held_out_share * len(pairs)))
        held = tuple((a, b) if rng.random() < 0.5 else (b, a) for a, b in pairs[:n_held])  # a fixed order each
        object.__setattr__(self, "held_out_pairs", held)
        object.__setattr__(self, "train_pairs", tuple(pairs[n_held:]))

    @staticmethod
    def problem(a: int, b: int) -> Problem:
        return Problem(prompt=f"Which number is larger, {a} or {b}? Answer with the number only.", answer=str(max(a, b)))

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.choice(self.train_pairs)
        return self.problem(a, b) if rng.random() < 0.5 else self.problem(b, a)

    @property
    def held_out(self) -> tuple[Problem, ...]:
        return tuple(self.problem(a, b) for a, b in self.held_out_pairs)

    def reward(self, problem: Problem, completion: str) -> float:
        return larger_reward(completion, problem.answer)


@dataclass(frozen=True)
class ChatRendered:
    """A synthetic task whose prompts are rendered once with a tokenizer's chat template (a user turn,
    generation prompt added; plain text where the tokenizer has no template), as ``task=dataset`` renders
    its rows (``dataset.render_prompts``)."""

    task: Any
    tokenizer: Any = field(repr=False)
    held_out: tuple[Problem, ...] = ()
    _cache: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, task: Any, tokenizer: Any) -> ChatRendered:
        rendered = cls(task, tokenizer)
        return replace(rendered, held_out=tuple(rendered.render(p) for p in task.held_out), _cache=rendered._cache)

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def max_new_tokens(self) -> int:
        return self.task.max_new_tokens

    def render(self, problem: Problem) -> Problem:
        from offpolicy.tasks.dataset import render_prompts  # (datasets is imported lazily there)

        ids = self._cache.get(problem.prompt)
        if ids is None:
            ids = tuple(render_prompts(self.tokenizer, [problem.prompt], None, "auto")[0])
            self._cache[problem.prompt] = ids
        return replace(problem, prompt_ids=ids)

    def sample(self, rng: random.Random) -> Problem:
        return self.render(self.task.sample(rng))

    def reward(self, problem: Problem, completion: str) -> float:
        return self.task.reward(problem, completion)
