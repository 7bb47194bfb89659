"""SkyRL 0.4.0 end to end on the CPU: offpolicy's loss registered as the README says
(``op_skyrl.register(cfg)``, ``op_skyrl.configure(SkyRLTrainConfig.from_cli_overrides(...))``)
and SkyRL's policy worker taking two optimizer steps with it as SkyRL's trainer drives it —
advantages pre-scaled by SkyRL's ``apply_loss_reduction_to_advantages_minibatch``, then
``PolicyWorkerBase.forward_backward`` (two micro-batches each, gradients accumulated) and
``optim_step`` (SkyRL's ``FSDPStrategy``: clip, step, zero). The weights it ends with must equal
those from calling ``op.policy_loss`` directly on the same batches (tests/e2e_reference.py).

The worker runs in a fresh Python process (tests/skyrl_cpu_worker.py, which lists its CPU
stand-ins): it needs a process group, a flash-attn import placeholder and ``skyrl.backends``
loaded around its Python ≥ 3.12 ``__init__``, none of which should leak into this test session.
Also the README's launch section as examples/skyrl_train.py --dry-run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("skyrl", reason="SkyRL not installed (pip install offpolicy[skyrl]; Python >= 3.12)")
for _dep in ("ray", "omegaconf", "jaxtyping", "loguru"):
    pytest.importorskip(_dep, reason=f"{_dep} (a SkyRL dependency) not installed: run install.sh")

from host_packages import worker_env  # noqa: E402
from conftest import fixed_denominator  # noqa: E402
from e2e_reference import LR, MAX_NORM, MODEL, assert_host_steps_equal_policy_loss, make_setup, statuses  # noqa: E402

import offpolicy as op  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster / fresh processes importing the host: tens of seconds each

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Explicit where it matters here: token_mean reduction, the grad clip, and SkyRL's own KL term off (on by
# default, coefficient 1e-3: offpolicy's loss is compared alone); console logger (wandb needs an API key).
OVERRIDES = ["trainer.logger=console", "trainer.micro_train_batch_size_per_gpu=2",
             "trainer.algorithm.loss_reduction=token_mean",
             f"trainer.policy.optimizer_config.max_grad_norm={MAX_NORM}", "trainer.algorithm.use_kl_loss=false",
             "trainer.algorithm.use_entropy_loss=false"]
CFG = fixed_denominator(op.presets.loss("recommended")).model_copy(update={"agg": "token-mean"})
PLAIN = op.LossConfig(clip_low=CFG.clip_low, clip_high=CFG.clip_high, agg="token-mean")  # no correction


def _env() -> dict[str, str]:
    return worker_env(("flash_attn",))  # model_wrapper imports flash_attn.bert_padding at import


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory):
    state, batches = make_setup()
    d = tmp_path_factory.mktemp("skyrl_e2e")
    skyrl_batches = [{"sequences": b["sequences"], "attention_mask": b["attention_mask"], "loss_mask": b["action_mask"],
                      "old": b["old"], "mu": b["mu"], "adv": b["adv"]} for b in batches]
    torch.save({"loss_config": CFG, "overrides": OVERRIDES, "model": MODEL, "state": state, "batches": skyrl_batches,
                "lr": LR}, d / "in.pt")
    proc = subprocess.run([sys.executable, str(TESTS / "skyrl_cpu_worker.py"), str(d / "in.pt"), str(d / "out.pt")],
                          env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return state, batches, torch.load(d / "out.pt", weights_only=False)


def test_worker_uses_the_registered_offpolicy_loss(worker_run) -> None:
    _, _, out = worker_run
    assert out["policy_loss_type"] == "offpolicy" and out["loss_fn"] == "OffpolicyLoss"
    assert out["logprobs"] == 1  # configure() asked the sampler for log μ


def test_two_skyrl_worker_steps_equal_op_policy_loss(worker_run) -> None:
    # SkyRL: Σ over two micro-batches of Σ_t ℓ_t·m_t on A / Σ m (token_mean) == offpolicy's token-mean loss
    assert_host_steps_equal_policy_loss("SkyRL", *worker_run, CFG, PLAIN)


def test_offpolicy_metrics_reach_skyrl_s_status(worker_run) -> None:
    for status in statuses(worker_run[2]):
        # the worker averages each micro-batch's metrics (2 micro-batches of 2 rows: 10 and 8 valid tokens)
        assert status["loss_metrics/offpolicy/valid_tokens"] == pytest.approx((10 + 8) / 2)
        assert "loss_metrics/offpolicy/kl_k3" in status and status["grad_norm"] > 0


def test_readme_launch_script_dry_run() -> None:
    # examples/skyrl_train.py --dry-run: the overrides parsed and validated by SkyRL's own config,
    # the loss registered, and the registration seen by a fresh process that unpickles it as SkyRL's
    # registry actor ships it to the workers.
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "skyrl_train.py"), "--dry-run", *OVERRIDES],
                          env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["policy_loss_type"] == "offpolicy" and got["logprobs"] == 1
    assert got["worker"] == {"registered": True, "loss": "OffpolicyLoss", "config_equal": True}
