"""Synthetic verifiable tasks, the character tokenizer and the tiny Qwen2 model builder."""

from offpolicy.tasks.tasks import TASKS, Addition, Problem, Reverse, Task, Walk, make_task, problems

__all__ = ["TASKS", "Addition", "Problem", "Reverse", "Task", "Walk", "make_task", "problems"]
