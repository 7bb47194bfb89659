"""Synthetic verifiable tasks, the character tokenizer and the tiny Qwen2 model builder."""

from offpolicy.tasks.larger import ChatRendered, Larger, larger_reward
from offpolicy.tasks.tasks import TASKS, Addition, Problem, Reverse, Task, Walk, make_task, problems

TASKS["larger"] = Larger  # a real chat model's task (model=DIR), registered here: larger.py imports tasks.py

__all__ = ["TASKS", "Addition", "ChatRendered", "Larger", "Problem", "Reverse", "Task", "Walk", "larger_reward",
           "make_task", "problems"]
