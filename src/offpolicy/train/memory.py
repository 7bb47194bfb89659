"""The memory figures every step logs (``memory/*``), in GiB and never a NaN: the process's resident host
memory everywhere, and on CUDA the trainer's peak GPU memory apart from the rollout engine's share."""

from __future__ import annotations

import resource

import torch


def reset_memory_peaks(device: torch.device) -> None:
    """Start the step's peaks: CUDA's allocator statistics, and the process's peak resident memory
    (Linux: writing 5 to /proc/self/clear_refs resets VmHWM; elsewhere it stays the run's peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def _resident_bytes() -> tuple[int, int]:
    """(now, peak since ``reset_memory_peaks``) resident memory of this process, in bytes: Linux's
    /proc/self/status (VmRSS, VmHWM); elsewhere getrusage's peak for both (never missing, never NaN)."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        peak = peak if peak > 1 << 32 else peak * 1024
        return peak, peak


def memory_metrics(device: torch.device, engine_bytes: int = 0) -> dict[str, float]:
    """The step's memory, in GiB, never a NaN. Everywhere: the process's resident memory at the end of
    the step and its peak during it (``memory/rss_gib``, ``memory/peak_rss_gib``: host memory, the
    engine's included — on a CPU all of it). On CUDA: ``memory/peak_gib``, the trainer's peak allocated
    GPU memory over the step without the engine's share, and that share, ``memory/engine_gib`` (what
    the engine allocated on the trainer's device when it started: its weights and KV cache).

    The share is subtracted because vLLM allocates through a torch memory pool and ``sleep`` only unmaps
    those pages: torch's allocator counts them in every step's peak, asleep or not.
    """
    rss, peak_rss = _resident_bytes()
    out = {"memory/rss_gib": rss / 2**30, "memory/peak_rss_gib": max(peak_rss, rss) / 2**30}
    if device.type == "cuda":
        out["memory/peak_gib"] = max(0, torch.cuda.max_memory_allocated(device) - engine_bytes) / 2**30
        out["memory/engine_gib"] = engine_bytes / 2**30
    return out
