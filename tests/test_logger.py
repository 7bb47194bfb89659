"""The run logger's summary table: start and end windows that never overlap."""

from __future__ import annotations

import pytest
from rich.console import Console

from offpolicy.train.logger import RunLogger, read_jsonl


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


def test_samples_with_line_separators_read_back(tmp_path):
    """A completion holding U+2028 (written raw: ensure_ascii=False) is one line of samples.jsonl: reading it
    back (a resume keeps the lines before its checkpoint) must not split it there, as str.splitlines() does."""
    logger = RunLogger(tmp_path, 2, console=Console(quiet=True), progress=False, log_to=[])
    record = {"prompt": "p", "completion": "a\u2028b\u2029c\x85d", "answer": "x", "reward": 1.0, "advantage": 0.0,
              "tokens": 1, "outside_support": 0, "finished": True, "abs_log_ratio_mean": 0.0, "abs_log_ratio_max": 0.0}
    logger.log(0, {"reward": 1.0})
    logger.log_samples(0, [record])
    logger.close()
    resumed = RunLogger(tmp_path, 2, start_step=1, console=Console(quiet=True), progress=False, log_to=[])
    resumed.close()
    assert read_jsonl(tmp_path / "samples.jsonl") == [{"step": 0, **record}]
