"""The trained model's own room: the head (hidden states → per-token log-probs), the ``[B, T]`` batch,
loading, precision, micro-batches and the one ``Scorer.score`` that train and diagnose both call, and the
embedded default model's warm start. Imports nothing from ``train/`` or ``diagnose`` (docs/development.md,
"Layout"). Nothing is imported here: ``offpolicy.policy.warmstart_config`` stays light for the configs.
"""
