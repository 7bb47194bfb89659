"""Synthetic verifiable tasks, the character tokenizer and the tiny Qwen2 model builder."""

from offpolicy.tasks.count import Count, count_reward
from offpolicy.tasks.larger import ChatRendered, Larger, larger_reward
from offpolicy.tasks.tasks import TASKS, Addition, Problem, Reverse, Task, Walk, make_task, problems

TASKS["larger"] = Larger  # a real chat model's task (model=DIR), registered here: larger.py imports tasks.py
TASKS["count"] = Count  # a real chat model's long-answer task (issue #54), likewise

__all__ = ["TASKS", "Addition", "ChatRendered", "Count", "Larger", "Problem", "Reverse", "Task", "Walk", "count_reward",
           "larger_reward", "make_task", "problems"]
