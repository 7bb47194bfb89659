"""The run logger's summary table: start and end windows that never overlap."""

from __future__ import annotations

import pytest
from rich.console import Console

from offpolicy.train.logger import RunLogger


@pytest.mark.parametrize("rewards, start, end", [
    ([0.0, 1.0, 2.0, 3.0], 0.5, 2.5),  # 4 steps: windows of 2 (a window of 5 read 1.5 twice)
    ([0.0, 1.0, 2.0, 3.0, 4.0], 0.5, 3.5),  # 5 steps: 2 and 2, the middle step in neither
    ([float(i) for i in range(12)], 2.0, 9.0),  # ≥ 10 steps: the first and last 5
    ([7.0], 7.0, 7.0),  # one step is both ends
])
def test_summary_start_and_end_windows(tmp_path, rewards, start, end):
    logger = RunLogger(tmp_path, len(rewards), console=Console(quiet=True), progress=False)
    for step, reward in enumerate(rewards):
        logger.log(step, {"reward": reward})
    logger.close()
    out = logger.summary()
    assert (out["reward/start"], out["reward/end"]) == (start, end)
