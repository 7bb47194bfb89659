"""The speed paths that reach into a library's internals (docs/performance.md, "Speed paths"), each behind a
gate (``gates.py``) that knows the versions and model families it was checked against:

- ``hf_loop.py``: the hf engine's own sampling loop (transformers' cache internals); fallback ``model.generate``;
- ``shared_prompt.py``: a group's prompt computed once, in the hf engine and in the trainer (the one planner);
  fallback: every row computes its whole prompt;
- ``cpu_linear.py``: the linear layers through oneDNN (torch's private ``mkldnn._linear_pointwise``); fallback
  ``F.linear``;
- the vLLM CPU direct weight sync (code in ``engines/vllm.py``, the one module that imports vLLM; its gate here);
  fallback vLLM's public weight-transfer API (its private ``reload_weights`` where this vLLM has none).

A ground-floor room: it imports nothing of the package above the core, so ``engines/`` and ``policy/`` both
use it (docs/development.md, "Layout")."""


def run_paths(policy, linear: str, engine) -> dict[str, str]:
    """Which path each gate took in a training run, and why, for its header and config.yaml
    (``resolved.speed_paths``): the trainer's linear layers (``linear``, from ``cpu_linear.use_onednn_linear``),
    the trainer's shared prompt (``policy``), and the engine's own (its ``speed_paths``, where it has any)."""
    from offpolicy.speed import shared_prompt

    reason = shared_prompt.decision(policy, "packed").reason
    return {"trainer_linear": linear, "trainer_shared_prompt": reason, **getattr(engine, "speed_paths", {})}
