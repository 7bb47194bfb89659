"""A few of an engine's weights summed in float64: what ``offpolicy.measure.sync_check`` compares around a weight sync
to tell a sync that changed nothing (an engine's ``weight_fingerprint`` returns ``fingerprints`` of its own
weights)."""

from __future__ import annotations

import torch

PROBES = 4  # tensors fingerprinted per sync (the largest: every update moves them)
BLOCKS, BLOCK = 8, 2048  # the sample of each: 8 runs of 2,048 consecutive entries

Fingerprint = tuple[float, float, float]


def sample(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The entries a fingerprint sums, float64 ``[≤ BLOCKS·BLOCK]``: ``BLOCKS`` runs of ``BLOCK`` consecutive entries,
    evenly spaced (the same positions for every tensor of that shape; the whole tensor where it is smaller), cast to
    ``dtype`` first when given (the engine's: what it stores of what the trainer sends). A copy: the tensor may
    change after it is taken (a sync writes the engine's weights in place)."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n > BLOCKS * BLOCK:
        starts = [i * (n - BLOCK) // (BLOCKS - 1) for i in range(BLOCKS)]
        flat = torch.cat([flat[s : s + BLOCK] for s in starts])
    x = flat if dtype is None else flat.to(dtype)
    return x.to(torch.float64, copy=True)


def summarize(samples: dict[str, torch.Tensor]) -> dict[str, Fingerprint]:
    """(Σ x, Σ |x|, Σ x²) of each ``sample``, all read back to the host at once (one read, whatever the count)."""
    if not samples:
        return {}
    sums = torch.stack([torch.stack([x.sum(), x.abs().sum(), (x * x).sum()]) for x in samples.values()]).cpu()
    return {name: tuple(row) for name, row in zip(samples, sums.tolist())}


def fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Fingerprint:
    """(Σ x, Σ |x|, Σ x²) in float64 over ``sample(tensor, dtype)``; one host read. The sample keeps it cheap — the
    whole 28M-entry embedding of SmolLM2 took 0.4 s a sum on the CPU, a strided sample of 65,536 entries 8 ms (a
    cache miss each), these runs well under 1 ms — and a sync of changed weights changes some sampled entries
    wherever an update moves the tensor at all."""
    return summarize({"": sample(tensor, dtype)})[""]


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
    """``fingerprint`` of each of ``named``'s ``probe_names``, in one host read: an engine's ``weight_fingerprint``."""
    return summarize({n: sample(named[n]) for n in probe_names(named, k)})
