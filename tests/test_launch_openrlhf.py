"""OpenRLHF 0.11.2's ``train_ppo_ray`` launched as its users launch it: ``python examples/openrlhf_train.py
<train_ppo_ray arguments>`` in a fresh interpreter (sys.executable), the README's script, with a local Ray
bounded by the script's ``--ray-num-cpus`` / ``--ray-object-store-mb``. Without OpenRLHF's GPU stack it stops
at ``openrlhf/models/ring_attn_utils.py:3`` (``from flash_attn.bert_padding import ...``), which every
OpenRLHF trainer module imports: docs/hosts-end-to-end.md, "## OpenRLHF". The test pins that stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import util as importlib_util
from pathlib import Path

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF not installed (install.sh installs openrlhf==0.11.2)")
pytest.importorskip("ray", reason="Ray not installed (OpenRLHF's launcher needs it)")

pytestmark = pytest.mark.launch
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib_util.find_spec("flash_attn") is not None,
                    reason="flash-attn is installed: the launch goes past the stop this test names")
def test_openrlhf_launch_stops_at_flash_attn(tmp_path: Path) -> None:
    from offpolicy.policy.warmstart import default_model
    from offpolicy.tasks.tasks import make_task, problems
    from offpolicy.train.config import TrainConfig

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.prompt, "label": p.answer}) + "\n"
                               for p in problems(make_task("reverse"), 16, seed=0)))
    argv = ["--ray-num-cpus", "2", "--ray-object-store-mb", "300",
            "--actor.model_name_or_path", str(default_model(TrainConfig(task="reverse"))),
            "--data.prompt_data", str(prompts),
            "--data.input_key", "prompt", "--data.label_key", "label", "--algo.advantage.estimator", "group_norm",
            "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "4", "--train.batch_size", "4",
            "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--actor.eps_clip_low_high", "0.4", "0.4",
            "--actor.loss_agg_mode", "token-mean"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "openrlhf_train.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    err = proc.stderr
    assert "Started a local Ray instance" in err, err[-3000:]  # the bounded local Ray came up first
    # the stop: openrlhf/models/__init__ -> actor.py:11 -> ring_attn_utils.py:3, flash-attn (a CUDA package)
    assert 'openrlhf/models/actor.py", line 11' in err, err[-3000:]
    assert 'openrlhf/models/ring_attn_utils.py", line 3' in err, err[-3000:]
    assert "No module named 'flash_attn'" in err
