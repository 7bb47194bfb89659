"""OpenRLHF 0.11.2 with offpolicy's PolicyLoss — the README's launch section as a script.

    python examples/openrlhf_train.py <your usual openrlhf.cli.train_ppo_ray arguments>
    python examples/openrlhf_train.py --dry-run <the same arguments>

A real run needs OpenRLHF's GPU stack (DeepSpeed, flash-attn, vLLM on GPUs). ``--dry-run`` runs
what does not: the arguments are parsed by OpenRLHF's own ``train_ppo_ray`` parser and checks
(everything in its ``__main__`` block up to ``train(args)``), the actor's ``PolicyLoss`` is built
from them exactly as ``ActorPPOTrainer.__init__`` builds it (so a clip or loss type that disagrees
with the LossConfig is refused here, not on the cluster), and a fresh Python process started with
the Ray ``runtime_env``'s variables runs the worker setup hook and reports which ``PolicyLoss``
OpenRLHF's actor would import. ``$OFFPOLICY_EXAMPLE_LOSS`` picks the LossConfig (a preset name or
a YAML path; default ``recommended`` with ``denominator: fixed``, as OpenRLHF needs).
"""

from __future__ import annotations

import ast
import json
import os
import runpy
import subprocess
import sys
from importlib import util as importlib_util
from typing import Any

import offpolicy as op

ENTRY = "openrlhf.cli.train_ppo_ray"


def loss_config() -> op.LossConfig:
    spec = os.environ.get("OFFPOLICY_EXAMPLE_LOSS")
    if spec:
        from offpolicy.integrations.openrlhf import resolve_config

        return resolve_config(spec)
    cfg = op.presets.loss("recommended")
    # OpenRLHF fixes its global token count before the loss runs: renormalize is refused.
    return cfg.model_copy(update={"correction": cfg.correction.model_copy(update={"denominator": "fixed"})})


def host_args(argv: list[str]) -> Any:
    """``train_ppo_ray``'s parsed and validated arguments (a nested namespace, ``args.actor.*``) for
    ``argv``: its own ``__main__`` block, run up to (not including) the final ``train(args)`` call."""
    spec = importlib_util.find_spec(ENTRY)
    if spec is None or spec.origin is None:
        raise ImportError(f"{ENTRY} not found: install openrlhf==0.11.2")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    main = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    last = main[0].body[-1] if len(main) == 1 else None
    if last is None or ast.unparse(last).strip() != "train(args)":
        raise RuntimeError(f"{spec.origin}: expected an `if __name__ == '__main__':` block ending in train(args) "
                           "(OpenRLHF 0.11.2's layout); this OpenRLHF release differs")
    main[0].body.pop()  # everything but train(args)
    code = compile(tree, spec.origin, "exec")
    old_argv = sys.argv
    sys.argv = [spec.origin, *argv]
    try:
        namespace: dict[str, Any] = {"__name__": "__main__", "__file__": spec.origin}
        exec(code, namespace)  # noqa: S102 - the host's own parser, from its installed source
    finally:
        sys.argv = old_argv
    return namespace["args"]


def actor_policy_loss(args: Any) -> Any:
    """The ``PolicyLoss`` ``ActorPPOTrainer.__init__`` (0.11.2) builds from ``args``, through the
    name ``ppo_actor`` imports — offpolicy's once :func:`install` has run."""
    from openrlhf.trainer.ray import ppo_actor

    return ppo_actor.PolicyLoss(
        clip_eps_low=args.actor.eps_clip_low_high[0],
        clip_eps_high=args.actor.eps_clip_low_high[1],
        dual_clip=args.actor.dual_clip,
        token_level_loss=args.actor.loss_agg_mode == "token-mean",
        policy_loss_type=args.actor.policy_loss_type,
        is_correction_level=args.algo.advantage.is_correction_level,
        is_correction_mode=args.algo.advantage.is_correction_mode,
        is_correction_gating=args.algo.advantage.is_correction_gating,
        is_correction_threshold=args.algo.advantage.is_correction_threshold,
    )


_WORKER_PROBE = """
import json, os
from offpolicy.integrations import openrlhf as op_openrlhf
op_openrlhf.setup_worker()   # what Ray runs in each worker (worker_process_setup_hook)
import openrlhf.models, openrlhf.trainer.ray.ppo_actor as ppo_actor
print(json.dumps({"models": openrlhf.models.PolicyLoss.__qualname__, "ppo_actor": ppo_actor.PolicyLoss.__qualname__,
                  "config": op_openrlhf.OffpolicyPolicyLoss.loss_config.model_dump(mode="json")}))
"""


def dry_run(argv: list[str]) -> dict[str, Any]:
    from offpolicy.integrations import openrlhf as op_openrlhf

    cfg = loss_config()
    env = op_openrlhf.runtime_env(cfg)
    args = host_args(argv)
    op_openrlhf.install(cfg)
    loss = actor_policy_loss(args)  # raises ConfigError where the arguments disagree with cfg
    assert isinstance(loss, op_openrlhf.OffpolicyPolicyLoss), type(loss)
    hook_module, hook_fn = env["worker_process_setup_hook"].rsplit(".", 1)
    assert getattr(__import__(hook_module, fromlist=[hook_fn]), hook_fn) is op_openrlhf.setup_worker
    proc = subprocess.run([sys.executable, "-c", _WORKER_PROBE], env={**os.environ, **env["env_vars"]},
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the worker setup hook failed in a fresh process:\n{proc.stderr[-3000:]}")
    worker = json.loads(proc.stdout.strip().splitlines()[-1])
    if worker["config"] != cfg.model_dump(mode="json"):
        raise RuntimeError(f"the worker's LossConfig differs from the driver's: {worker['config']}")
    return {"policy_loss": type(loss).__qualname__, "clip": [loss.clip_eps_low, loss.clip_eps_high],
            "token_level_loss": loss.token_level_loss, "worker": {k: worker[k] for k in ("models", "ppo_actor")}}


def ray_bounds(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    """``--ray-num-cpus N`` and ``--ray-object-store-mb M`` (this script's, taken out of ``argv``): a local Ray
    bounded to fit beside other work, e.g. on a CPU machine; the rest is OpenRLHF's."""
    bounds, rest, it = {}, [], iter(argv)
    for arg in it:
        if arg == "--ray-num-cpus":
            bounds["num_cpus"] = int(next(it))
        elif arg == "--ray-object-store-mb":
            bounds["object_store_memory"] = int(next(it)) << 20
        else:
            rest.append(arg)
    return bounds, rest


def main(argv: list[str]) -> None:
    if argv[:1] == ["--dry-run"]:
        print(json.dumps(dry_run(argv[1:])))
        return
    import ray

    from offpolicy.integrations import openrlhf as op_openrlhf

    bounds, argv = ray_bounds(argv)
    cfg = loss_config()
    local = {"include_dashboard": False, **bounds} if bounds else {}  # a cluster's own Ray takes no bounds
    ray.init(runtime_env=op_openrlhf.runtime_env(cfg), **local)  # workers: PolicyLoss replaced, rollout log-probs on
    op_openrlhf.install(cfg)                             # driver: vLLM engines return processed log-probs
    sys.argv = [ENTRY, *argv]
    runpy.run_module(ENTRY, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
