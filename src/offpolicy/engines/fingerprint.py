"""A few of an engine's weights summed in float64: what ``offpolicy.sync_check`` compares around a weight sync
to tell a sync that changed nothing (an engine's ``weight_fingerprint`` returns ``fingerprints`` of its own
weights)."""

from __future__ import annotations

import torch

PROBES = 4  # tensors fingerprinted per sync (the largest: every update moves them)

Fingerprint = tuple[float, float, float]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """(Σ x, Σ |x|, ‖x‖₂) of ``tensor``, accumulated in float64: one host read for the three."""
    x = tensor.detach()
    sums = torch.stack([x.sum(dtype=torch.float64), torch.linalg.vector_norm(x, 1, dtype=torch.float64),
                        torch.linalg.vector_norm(x, 2, dtype=torch.float64)])  # no float64 copy of the tensor
    return tuple(float(v) for v in sums.cpu())


def probe_names(named: dict[str, torch.Tensor], k: int = PROBES) -> list[str]:
    """The ``k`` largest floating tensors of ``named`` (ties by name; a tied weight once, under its first
    name), in name order."""
    seen: set[int] = set()
    floats = []
    for n, t in sorted(named.items()):
        if t.is_floating_point() and t.numel() > 0 and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            floats.append((n, t))
    return sorted(n for n, _ in sorted(floats, key=lambda nt: (-nt[1].numel(), nt[0]))[:k])


def fingerprints(named: dict[str, torch.Tensor], k: int = PROBES) -> dict[str, Fingerprint]:
    """``fingerprint`` of each of ``named``'s ``probe_names``: an engine's ``weight_fingerprint``."""
    return {n: fingerprint(named[n]) for n in probe_names(named, k)}
