"""Atomic checkpoints: a run directory's ``checkpoints/step-N`` is written under a temporary name
and renamed into place, then ``checkpoints/latest`` is replaced (also atomically). A crash at
any moment leaves the previous checkpoint intact and ``latest`` pointing at a complete one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, state: dict[str, Any], keep: int = 2) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict(), **state}, tmp / "trainer_state.pt")
    except BaseException:  # a failed or interrupted write leaves nothing behind, ``latest`` untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # the same step saved again: the old copy goes aside first, then away
        aside = Path(tempfile.mkdtemp(dir=root, prefix=".old-"))
        final.rename(aside / final.name)
        tmp.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        tmp.rename(final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    for old in sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of ``run_dir``.

    Raises:
        FileNotFoundError: no run directory or no checkpoint in it.
    """
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        raise FileNotFoundError(f"no checkpoint in {run_dir} (expected {pointer}); is this an offpolicy run directory?")
    return run_dir / "checkpoints" / pointer.read_text().strip()


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The optimizer state and the loop's bookkeeping, every tensor on the CPU whatever device saved it
    (a run saved on cuda:1 resumes on a CPU, or on cuda:0): ``optimizer.load_state_dict`` then moves
    each state tensor to its parameter's device, and the queued rollouts are CPU lists anyway."""
    return torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
