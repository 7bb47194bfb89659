"""The ladder of implementations of ``policy_loss``, from the formula to the fastest kernel.

=============  ====================================================================  ============
rung           what it is                                                            runs on
=============  ====================================================================  ============
``reference``  readable torch, autograd through every intermediate; the oracle       any device
``eager``      a few fused eager passes with an analytic backward                    any device
``compiled``   the whole forward as one ``torch.compile``d function (inductor)       CPU, CUDA
``triton``     one token-parallel Triton kernel + segmented row reductions           CUDA (CPU
               (no host synchronisation, CUDA-graph capturable)                      interpreter)
=============  ====================================================================  ============

Every rung is a module with the same small interface:

* ``NAME``                                  its name (``implementation=`` of ``policy_loss``);
* ``supports(config, ref_logprobs) -> bool`` whether it computes *exactly* what the reference
  computes for this configuration (configurations it does not cover go down the ladder);
* ``preferred(mask) -> bool``               whether ``auto`` should use it for this batch
  (device, size);
* ``policy_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs, config, reduce,
  ref_logprobs) -> result | None``          ``None`` hands the batch down the ladder (a rung
  that meets a non-finite value returns ``None``: the reference owns the ``nonfinite`` policy).

``auto`` tries, in order, triton → compiled → eager → reference, taking a rung when it both
supports the configuration and prefers the batch. Naming a rung runs that rung or raises if it
does not support the configuration; non-finite inputs still go to the reference.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from offpolicy.core.config import LossConfig
from offpolicy.core.kernels.common import per_config

# readable → fastest; ``auto`` walks it from the end
IMPLEMENTATIONS: tuple[str, ...] = ("reference", "eager", "compiled", "triton")
_ALIASES = {"fused": "eager"}  # the name of the eager rung before the ladder had four rungs


@functools.lru_cache(maxsize=None)
def get(name: str) -> ModuleType:
    """The module of rung ``name`` (imported on first use: triton is optional)."""
    name = _ALIASES.get(name, name)
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be 'auto' or one of {', '.join(IMPLEMENTATIONS)}; got {name!r}")
    return importlib.import_module(f"offpolicy.core.kernels.{name}")


# stands for a KL term's log-probs in ``supports``, which reads only whether they are given
_A_KL_TERM = torch.empty(0)


@per_config(256)
def _supporting(config: LossConfig, without_kl: bool) -> list[ModuleType]:
    """The fast rungs (fastest first) that cover ``config`` (with a KL term unless ``without_kl``);
    worked out once per config object."""
    ref = None if without_kl else _A_KL_TERM
    return [rung for rung in (get(name) for name in reversed(IMPLEMENTATIONS[1:])) if rung.supports(config, ref)]


def choose(config: LossConfig, ref_logprobs: torch.Tensor | None, mask: torch.Tensor, implementation: str) -> list[ModuleType]:
    """The rungs to try, in order; the reference is always last.

    Raises:
        ValueError: a named rung that does not support ``config`` (the message says what it covers).
    """
    reference = get("reference")
    if implementation == "auto":
        return [*(rung for rung in _supporting(config, ref_logprobs is None) if rung.preferred(mask)), reference]
    rung = get(implementation)
    if rung is reference:
        return [reference]
    if rung not in _supporting(config, ref_logprobs is None):  # worked out once per config object
        raise ValueError(
            f"implementation {implementation!r} does not cover kind {config.kind!r}"
            f"{' with a KL term' if ref_logprobs is not None else ''} with this correction: "
            f"{' '.join(rung.supports.__doc__.split())} Use implementation='auto' to take the next rung."
        )
    return [rung, reference]
