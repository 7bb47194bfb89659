"""offpolicy inside host RL frameworks: TRL, verl, OpenRLHF, SkyRL.

Each adapter lives in its own module and is imported on demand (``import offpolicy`` never
imports a host): ``offpolicy.integrations.trl``, ``.verl``, ``.openrlhf``, ``.skyrl``. Every
adapter hands its host the unreduced per-token loss (``op.policy_loss(..., reduce=False)``) and
the mask to aggregate over, so the host's own micro-batching and cross-rank aggregation stay as
they are; ``offpolicy.integrations.dump`` writes the tensors offpolicy saw for
``offpolicy diagnose --batch``. ``offpolicy.integrations.areal`` is no adapter but a translator:
AReaL's actor-loss settings → the ``LossConfig`` computing the same loss (docs/areal.md).
"""

from __future__ import annotations
