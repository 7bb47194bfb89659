"""SkyRL 0.4.0 with offpolicy's loss — the README's launch section as a script.

    python examples/skyrl_train.py <your usual SkyRL overrides, e.g. trainer.policy.model.path=...>
    python examples/skyrl_train.py --dry-run <the same overrides>

A real run needs SkyRL's GPU stack (Ray GPU actors, FSDP, vLLM) and Python ≥ 3.12. ``--dry-run``
runs what does not: the overrides are parsed by SkyRL's own ``SkyRLTrainConfig`` and checked by its
``validate_cfg``, offpolicy's loss is registered and the config pointed at it, and a fresh Python
process loads the registered loss from the bytes SkyRL's registry actor would ship to each worker
(``cloudpickle``, as ``PolicyLossRegistry.sync_with_actor`` does), then looks it up by name.
``$OFFPOLICY_EXAMPLE_LOSS`` picks the LossConfig (a preset name or a YAML path; default
``recommended`` with ``denominator: fixed``, as SkyRL needs).
"""

from __future__ import annotations

import base64
import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
import types
from typing import Any

import offpolicy as op


def load_skyrl_backends() -> None:
    """SkyRL 0.4.0's ``skyrl/backends/__init__`` imports its Tinker backend, whose pydantic models
    need Python ≥ 3.12; on 3.11 load the ``skyrl.backends`` package without that ``__init__``
    (SkyRL declares ≥ 3.12: this is for trying the loss path on an older interpreter only)."""
    try:
        importlib.import_module("skyrl.backends")
        return
    except Exception:  # noqa: BLE001 - pydantic's TypedDict error on 3.11
        pass
    import skyrl

    for k in [k for k in sys.modules if k.startswith("skyrl.backends")]:
        del sys.modules[k]
    pkg = types.ModuleType("skyrl.backends")
    pkg.__path__ = [skyrl.__path__[0] + "/backends"]
    pkg.__spec__ = importlib.machinery.ModuleSpec("skyrl.backends", None, is_package=True)
    sys.modules["skyrl.backends"] = pkg


def loss_config() -> op.LossConfig:
    spec = os.environ.get("OFFPOLICY_EXAMPLE_LOSS")
    if spec:
        from offpolicy.integrations.skyrl import resolve_config

        return resolve_config(spec)
    cfg = op.presets.loss("recommended")
    # SkyRL divides the advantages by its token count before the loss: renormalize is refused.
    return cfg.model_copy(update={"correction": cfg.correction.model_copy(update={"denominator": "fixed"})})


_WORKER_PROBE = """
import base64, json, sys
sys.path.insert(0, {example_dir!r})
import skyrl_train
skyrl_train.load_skyrl_backends()
import cloudpickle
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
loss = cloudpickle.loads(base64.b64decode(sys.stdin.read()))   # what sync_with_actor does in a worker
PolicyLossRegistry.register("offpolicy", loss)
got = PolicyLossRegistry.get("offpolicy")
print(json.dumps({{"registered": "offpolicy" in PolicyLossRegistry.list_available(),
                  "loss": type(got).__qualname__, "config": got.config.model_dump(mode="json")}}))
"""


def dry_run(overrides: list[str]) -> dict[str, Any]:
    load_skyrl_backends()
    import cloudpickle
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg

    from offpolicy.integrations import skyrl as op_skyrl

    cfg_loss = loss_config()
    op_skyrl.register(cfg_loss)
    cfg = op_skyrl.configure(SkyRLTrainConfig.from_cli_overrides(overrides))
    validate_cfg(cfg)
    registered = PolicyLossRegistry.get(op_skyrl.NAME)
    payload = base64.b64encode(cloudpickle.dumps(registered)).decode()
    probe = _WORKER_PROBE.format(example_dir=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", probe], input=payload, capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"loading the registered loss in a fresh process failed:\n{proc.stderr[-3000:]}")
    worker = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"policy_loss_type": cfg.trainer.algorithm.policy_loss_type,
            "logprobs": cfg.generator.sampling_params.logprobs,
            "loss_reduction": cfg.trainer.algorithm.loss_reduction,
            "worker": {"registered": worker["registered"], "loss": worker["loss"],
                       # the loss the worker unpickled is the one registered here (host defaults resolved)
                       "config_equal": worker["config"] == registered.config.model_dump(mode="json")}}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--dry-run"]:
        print(json.dumps(dry_run(argv[1:])))
        return
    import ray
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg

    from offpolicy.integrations import skyrl as op_skyrl

    op_skyrl.register(loss_config())  # before initialize_ray: SkyRL syncs its registries to every worker
    cfg = op_skyrl.configure(SkyRLTrainConfig.from_cli_overrides(argv))  # policy_loss_type offpolicy, logprobs 1
    validate_cfg(cfg)
    print(json.dumps({"skyrl_config": "validated", "policy_loss_type": cfg.trainer.algorithm.policy_loss_type}),
          flush=True)
    # SkyRL's entry point and its Ray start (skyrl.train.entrypoints.main_base imports skyrl.backends: Python >= 3.12)
    from skyrl.train.entrypoints.main_base import skyrl_entrypoint
    from skyrl.train.utils.utils import initialize_ray

    initialize_ray(cfg)
    ray.get(skyrl_entrypoint.remote(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
