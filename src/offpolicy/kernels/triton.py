"""Triton rung (GPU): see ``offpolicy.kernels``. Covers nothing until its kernel lands."""

from __future__ import annotations

import torch

from offpolicy.config import LossConfig

NAME = "triton"


def supports(config: LossConfig, ref_logprobs: torch.Tensor | None) -> bool:
    """No configuration yet."""
    return False


def preferred(mask: torch.Tensor) -> bool:
    return False


def policy_loss(*args, **kwargs):
    return None
