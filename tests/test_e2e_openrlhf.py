"""OpenRLHF 0.11.2 end to end on the CPU: offpolicy's PolicyLoss installed the way a user installs
it — ``ray.init(runtime_env=op_openrlhf.runtime_env(cfg))``, Ray's ``worker_process_setup_hook``
running ``offpolicy.integrations.openrlhf.setup_worker`` in the worker — and OpenRLHF's own
``ActorPPOTrainer`` (its ``__init__`` from ``train_ppo_ray``'s parsed arguments, its
``training_step``, its ``Actor``) taking two optimizer steps on a tiny Qwen2 in that Ray worker.
The weights it ends with must equal those from calling ``op.policy_loss`` directly on the same
batches (the reference here, in the driver, with no OpenRLHF in it).

What is not OpenRLHF's here (tests/openrlhf_cpu_worker.py): DeepSpeed's engine → a torch strategy
with the same backward / step / clip, and import placeholders for DeepSpeed and flash-attn
(tests/gpu_placeholders, only when the real packages are absent), which OpenRLHF imports at
module level and this path never calls. Also examples/openrlhf_train.py --dry-run: the README's
launch script, arguments parsed by OpenRLHF's own parser, the registration checked in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import util as importlib_util
from pathlib import Path

import pytest
pytest.importorskip("openrlhf", reason="OpenRLHF not installed (pip install offpolicy[openrlhf])")
ray = pytest.importorskip("ray", reason="Ray not installed (OpenRLHF's launcher needs it)")
pytest.importorskip("pylatexenc", reason="pylatexenc (an OpenRLHF dependency) not installed: run install.sh")

from host_packages import worker_pythonpath  # noqa: E402
from conftest import fixed_denominator  # noqa: E402
from e2e_reference import LR, MAX_NORM, MODEL, assert_host_steps_equal_policy_loss, make_setup, statuses  # noqa: E402

import offpolicy as op  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster / fresh processes importing the host: tens of seconds each

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# A GRPO launch as the README's users write it (model and reward URL are only parsed here); clip 0.4 =
# recommended's ε, token-mean aggregation, OpenRLHF's own IS correction off (the default).
ARGV = ["--actor.model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct",
        "--reward.remote_url", "http://127.0.0.1:5000/get_reward",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "8",
        "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--actor.eps_clip_low_high", "0.4", "0.4",
        "--actor.loss_agg_mode", "token-mean", "--actor.max_norm", str(MAX_NORM)]
CFG = fixed_denominator(op.presets.loss("recommended")).model_copy(update={"agg": "token-mean"})
# the same steps without any correction (plain PPO on π_θ/π_old, same clip): a host run that ignored
# offpolicy's loss would land here
PLAIN = op.LossConfig(clip_low=0.4, clip_high=0.4, agg="token-mean")


def _worker_pythonpath() -> str:
    # the worker imports tests/openrlhf_cpu_worker.py and src/ (host_packages.worker_pythonpath)
    return worker_pythonpath(("deepspeed", "flash_attn"))


@pytest.fixture(scope="module")
def ray_worker_run():
    from offpolicy.integrations import openrlhf as op_openrlhf

    import openrlhf_cpu_worker

    env = op_openrlhf.runtime_env(CFG)  # what the README's launch script passes to ray.init
    env["env_vars"]["PYTHONPATH"] = _worker_pythonpath()
    env["env_vars"]["OMP_NUM_THREADS"] = "1"
    state, batches = make_setup()
    assert not ray.is_initialized(), "a Ray session is already open in this process: it would not get the hook"
    t0 = time.perf_counter()
    try:  # address="local": a new one-CPU cluster of our own, never a cluster someone else started here
        ray.init(address="local", num_cpus=1, include_dashboard=False, runtime_env=env, log_to_driver=False)
    except Exception as err:  # noqa: BLE001 - a sandbox where Ray cannot start its processes
        pytest.skip(f"a local Ray does not start here: {type(err).__name__}: {err}")
    t_init = time.perf_counter() - t0
    try:
        task = ray.remote(num_cpus=1)(openrlhf_cpu_worker.train_steps)
        out = ray.get(task.remote(ARGV, MODEL, state, batches, LR), timeout=600)
    finally:
        ray.shutdown()
    print(f"ray.init {t_init:.1f}s, init + 2 steps in the worker + shutdown {time.perf_counter() - t0:.1f}s")
    return state, batches, out


def test_setup_hook_installed_the_loss_in_the_ray_worker(ray_worker_run) -> None:
    _, _, out = ray_worker_run
    hooked = dict(out["hooked"])
    # the worker's $OFFPOLICY_OPENRLHF_LOSS holds the config as set (unset fields stay unset there)
    assert op.LossConfig.model_validate_json(hooked.pop("env")) == CFG
    assert hooked == {"openrlhf.models": "OffpolicyPolicyLoss", "ppo_actor": "OffpolicyPolicyLoss"}
    assert out["loss_fn"] == "OffpolicyPolicyLoss"  # built by ActorPPOTrainer.__init__ from the parsed arguments


def test_two_openrlhf_training_steps_equal_op_policy_loss(ray_worker_run) -> None:
    # the same weights as op.policy_loss called directly, not those of an uncorrected PPO step
    assert_host_steps_equal_policy_loss("OpenRLHF", *ray_worker_run, CFG, PLAIN)


def test_offpolicy_metrics_reach_openrlhf_s_status(ray_worker_run) -> None:
    _, batches, out = ray_worker_run
    for b, status in zip(batches, statuses(out)):
        assert status["offpolicy/valid_tokens"] == b["action_mask"].sum().item()  # 4·5 − 2 = 18
        assert "offpolicy/kl_k3" in status and "vllm_kl" in status and status["policy_loss"] != 0.0
        assert status["actor_grad_norm"] > 0


def test_readme_launch_script_dry_run() -> None:
    # examples/openrlhf_train.py --dry-run: OpenRLHF's own parser, ActorPPOTrainer's PolicyLoss from it,
    # the worker hook in a fresh process. A clip that disagrees with the LossConfig is refused there.
    env = {**os.environ, "PYTHONPATH": _worker_pythonpath(), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "examples" / "openrlhf_train.py")
    ok = subprocess.run([sys.executable, script, "--dry-run", *ARGV], env=env, capture_output=True, text=True,
                        timeout=600, check=False)
    assert ok.returncode == 0, ok.stderr[-3000:]
    got = json.loads(ok.stdout.strip().splitlines()[-1])
    assert got == {"policy_loss": "OffpolicyPolicyLoss", "clip": [0.4, 0.4], "token_level_loss": True,
                   "worker": {"models": "OffpolicyPolicyLoss", "ppo_actor": "OffpolicyPolicyLoss"}}


@pytest.mark.skipif(all(importlib_util.find_spec(m) is not None for m in ("flash_attn", "deepspeed")),
                    reason="OpenRLHF's GPU dependencies are installed: openrlhf.models imports as it is")
def test_adapter_imports_without_openrlhf_s_gpu_dependencies() -> None:
    # A fresh process without flash-attn/DeepSpeed (this machine): the driver-side API works, and the
    # loss refuses with the reason instead of failing at `import offpolicy.integrations.openrlhf`.
    code = ("import json\nfrom offpolicy.integrations import openrlhf as a\n"
            "env = a.runtime_env('recommended')\n"
            "try:\n    a.OffpolicyPolicyLoss(loss_config='openrlhf:tis')\n    err = ''\n"
            "except ImportError as e:\n    err = str(e)\n"
            "print(json.dumps({'hook': env['worker_process_setup_hook'], 'err': err}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["hook"] == "offpolicy.integrations.openrlhf.setup_worker"
    assert "GPU dependencies" in got["err"] and ("flash_attn" in got["err"] or "deepspeed" in got["err"])
