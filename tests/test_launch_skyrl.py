"""SkyRL 0.4.0's launch as its users write it: ``python examples/skyrl_train.py <overrides>`` in a fresh
interpreter (sys.executable), the README's line. On this machine's Python 3.11 it stops at SkyRL's first
import of ``skyrl.backends``, whose Tinker types need Python >= 3.12 (SkyRL declares ``requires-python >=
3.12``; install.sh installs it with --ignore-requires-python): docs/hosts-end-to-end.md, "## SkyRL". The test
pins that stop, so that a change in where the launch ends (further, or earlier) is seen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("skyrl", reason="SkyRL not installed (install.sh installs skyrl==0.4.0)")

pytestmark = pytest.mark.launch
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the named stop is Python 3.11's; on >= 3.12 the launch "
                    "goes on to SkyRL's Ray placement groups (not run here)")
def test_skyrl_launch_stops_at_its_python_312_import(tmp_path: Path) -> None:
    from offpolicy.policy.warmstart import default_model
    from offpolicy.train.config import TrainConfig

    model = default_model(TrainConfig(task="reverse"))  # the embedded warm start, cached
    overrides = [f"trainer.policy.model.path={model}", "trainer.strategy=fsdp2",
                 "trainer.placement.policy_num_gpus_per_node=1", f"trainer.log_path={tmp_path / 'logs'}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "skyrl_train.py"), *overrides], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    err = proc.stderr
    # the stop: skyrl/backends/__init__.py:3 -> backend.py -> skyrl/tinker/types.py:137, a pydantic model over
    # typing.TypedDict, which pydantic refuses before Python 3.12
    assert 'skyrl/backends/__init__.py", line 3' in err, err[-3000:]
    assert 'skyrl/tinker/types.py", line 137' in err, err[-3000:]
    assert "Please use `typing_extensions.TypedDict` instead of `typing.TypedDict` on Python < 3.12" in err
    # reached from the launch itself (SkyRL's config utilities), not from offpolicy's adapter
    assert 'skyrl/train/utils/utils.py", line 23' in err, err[-3000:]
    assert "offpolicy/integrations" not in err.split("Traceback", 1)[-1]
