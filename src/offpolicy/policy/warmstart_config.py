"""The warm start's options, apart from its torch code: the configs (train's, diagnose's) read them
before anything heavy imports."""

from __future__ import annotations

from pydantic import Field

from offpolicy.core.config import _Strict
from offpolicy.tasks import TASKS


class WarmStartConfig(_Strict):
    """Supervised warm start of the embedded default model, cached on disk and reused."""

    seed: int = Field(0, description="initialisation and data order of the warm start; every RL seed "
                      "starts from the same warm-started policy, so seeds vary only the RL")
    target_accuracy: float = Field(0.2, gt=0, lt=1, description="stop SFT once sampled accuracy reaches this")
    max_steps: int = Field(400, gt=0, description="SFT steps at most, if target_accuracy is not reached first")
    batch_size: int = Field(128, gt=0, description="problems per SFT step (task=walk: 64 unless set)")
    lr: float = Field(3e-3, gt=0, description="AdamW's learning rate for the SFT")
    eval_every: int = Field(5, gt=0, description="SFT steps between checks of the sampled accuracy "
                            "(task=walk: 10 unless set)")
    eval_problems: int = Field(128, gt=0, description="problems the sampled accuracy is measured on "
                               "(task=walk: 64 unless set)")


def task_warm_start(task: str, warm_start: WarmStartConfig | None = None) -> WarmStartConfig:
    """``warm_start`` (default: the defaults) with the task's own warm-start values where the user set none."""
    warm_start = warm_start or WarmStartConfig()
    task_ws = {k: v for k, v in getattr(TASKS[task], "warm_start_defaults", {}).items()
               if k not in warm_start.model_fields_set}  # the task's warm start, unless set
    return warm_start.model_copy(update=task_ws) if task_ws else warm_start
