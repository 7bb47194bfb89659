"""``scripts/device_check.sh --dry-run`` on a machine without a GPU (issue #44): the script's own steps —
the import check, the carried files each step names, the 9 tests it selects, each step's entry point and
the time budget (the limits add up to at most 7 minutes) — are proved here, so a lent GPU's minutes are
not spent finding out that the script itself is broken."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_device_check_dry_run_proves_its_steps(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "WHEELS": "none", "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    budget = re.search(r"= (\d+)s of (\d+)s", summary)
    assert budget and int(budget.group(1)) <= int(budget.group(2)) == 420, summary
    assert "import offpolicy: ok" in summary
    assert "tests: 9 selected" in summary
    for name in ("tests", "head", "m2po", "loss", "trainer"):
        assert re.search(rf"^{name} +rc=0 ", summary, re.M), (name, summary)
    selected = (tmp_path / "tests-selected.txt").read_text().split()
    assert len(selected) == 9 and all(s.startswith("tests/test_triton.py::") for s in selected)


def test_the_device_check_stops_when_offpolicy_does_not_import(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "WHEELS": "none", "PYTHON": sys.executable,
           "PYTHONPATH": str(tmp_path / "nothing")}
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "offpolicy").mkdir()
    (broken / "offpolicy" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    done = subprocess.run(["bash", str(ROOT / "scripts/device_check.sh"), "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    summary = (tmp_path / "summary.txt").read_text()
    assert "import offpolicy failed: stopping" in summary and "tests:" not in summary
