"""Dump the tensors a host framework hands offpolicy, and read them back for ``diagnose --batch``.

One file per (step, rank): ``step{step:06d}-rank{rank}.pt``, a ``torch.save`` of a dict

    {"old_logprobs": [B, T] fp32, "rollout_logprobs": [B, T] fp32, "mask": [B, T] fp32,
     "advantages"?: [B, T] fp32, "logprobs"?: [B, T] fp32,
     "text"?: {"prompt_ids": [[int]] × B, "response_ids": [[int]] × B, "response_text": [str | None] × B,
               "prompt_text"?: [str | None] × B},
     "meta": {"format": 1, "host", "host_version", "step", "rank", "anchor", "engine"?, "trainer"?, ...}}

``old_logprobs`` is log π_old (the trainer's recompute), ``rollout_logprobs`` log μ (the engine's),
so ``diagnose --batch`` measures log ρ = log π_old − log μ exactly as it does for the embedded
engine. In a host's bypass mode (π_old := μ, anchor "rollout") the host never recomputes π_old;
adapters then store π_θ (detached; equal to π_old on the first micro-batch of a step) as
``old_logprobs`` and record ``anchor: rollout`` in the meta.

Optional, for ``diagnose``'s checks of what the engine returned (issue #69): ``text``, the ids each row sampled
and the text the engine returned for them (``diagnose --batch DIR --model M`` re-encodes prompt + response with
M's tokenizer: the retokenisation drift), and the meta's ``engine`` and ``trainer``, each a dict with ``backend``,
``dtype``, ``device`` (and any of ``provenance.engine_record``'s keys): log-probs identical to the trainer's while
these differ look recomputed, not sampled.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
REQUIRED = ("old_logprobs", "rollout_logprobs", "mask")
OPTIONAL = ("advantages", "logprobs")
TEXT = ("prompt_ids", "response_ids", "response_text")  # a dump's ``text``: these, and ``prompt_text`` if kept


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


class BatchDumper:
    """Writes the tensors offpolicy sees for chosen steps (``steps``) or every ``every``-th step.

    ``BatchDumper(dir, steps={0, 100})`` dumps steps 0 and 100; ``every=50`` dumps 0, 50, 100, ...;
    both None dumps nothing. One file per step and rank is written once (later micro-batches of a
    step that is already on disk are skipped), atomically (temp file + rename), so a reader never
    sees half a file.
    """

    def __init__(self, directory: str | os.PathLike, steps: set[int] | None = None, every: int | None = None,
                 host: str = "unknown", host_version: str = "unknown") -> None:
        if every is not None and every <= 0:
            raise ValueError(f"BatchDumper(every={every}): must be a positive number of steps, or None")
        self.directory = Path(directory)
        self.steps = set(steps) if steps is not None else None
        self.every = every
        self.host = host
        self.host_version = host_version

    def wants(self, step: int) -> bool:
        return (self.steps is not None and step in self.steps) or (self.every is not None and step % self.every == 0)

    def maybe_dump(self, step: int, *, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                   mask: torch.Tensor, advantages: torch.Tensor | None = None,
                   logprobs: torch.Tensor | None = None, meta: dict[str, Any] | None = None,
                   text: dict[str, list] | None = None) -> Path | None:
        """Write ``step{step:06d}-rank{r}.pt`` if ``step`` is selected and not yet written; return its path.
        ``text`` (optional): ``prompt_ids`` and ``response_ids`` (the sampled ids, one list a row),
        ``response_text`` (the text the engine returned for them) and, where the host kept it, ``prompt_text``."""
        if not self.wants(step):
            return None
        rank = _rank()
        path = self.directory / f"step{step:06d}-rank{rank}.pt"
        if path.exists():
            return None
        record: dict[str, Any] = {}
        for name, value in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs), ("mask", mask),
                            ("advantages", advantages), ("logprobs", logprobs)):
            if value is not None:
                record[name] = value.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if text is not None:
            record["text"] = {k: list(v) for k, v in text.items()}
        record["meta"] = {"format": FORMAT, "host": self.host, "host_version": self.host_version, "step": step,
                          "rank": rank, "anchor": "old", **(meta or {})}
        _check(record, str(path))
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".pt")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(record, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def _check(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not an offpolicy batch dump (expected a dict, got {type(record).__name__})")
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; a batch dump needs {', '.join(REQUIRED)} "
                         "(write it with offpolicy.integrations.dump.BatchDumper)")
    shape = record["mask"].shape
    if "text" in record:
        _check_text(record["text"], shape[0], where)
    for k in (*REQUIRED, *OPTIONAL):
        if k not in record:
            continue
        v = record[k]
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{where}: {k} is a {type(v).__name__}, expected a tensor")
        if v.dim() != 2 or v.shape != shape:
            raise ValueError(f"{where}: {k} has shape {tuple(v.shape)}, expected [B, T] = {tuple(shape)} like mask")


def _check_text(text: Any, rows: int, where: str) -> None:
    """A dump's ``text``: ``TEXT``'s lists (``prompt_text`` optional), one entry a row: ids lists of ints, texts
    strings (None: a row without)."""
    if not isinstance(text, dict) or any(k not in text for k in TEXT):
        raise ValueError(f"{where}: text must be a dict with {', '.join(TEXT)} (and optionally prompt_text)")
    for k in (*TEXT, "prompt_text"):
        if k not in text:
            continue
        v = text[k]
        if not isinstance(v, list) or len(v) != rows:
            raise ValueError(f"{where}: text.{k} must be a list of {rows} rows (one per row of mask)")
        ids = k.endswith("_ids")
        for i, entry in enumerate(v):
            fine = (isinstance(entry, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in entry)
                    if ids else entry is None or isinstance(entry, str))
            if not fine:
                raise ValueError(f"{where}: text.{k}[{i}] is {'not a list of ints' if ids else 'not a string'}")


def _pad(x: torch.Tensor, t: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, t - x.shape[1])) if x.shape[1] < t else x


def load_batch(path: str | os.PathLike) -> dict[str, Any]:
    """Read one dump file, or every ``*.pt`` of a directory (steps and ranks concatenated along B,
    right-padded with mask 0 to a common T). Returns the tensor dict plus ``meta`` (a list, one per file) and,
    where every file holds one, ``text`` (its lists concatenated in the same order).

    Raises:
        FileNotFoundError: no such file, or a directory without ``.pt`` files.
        ValueError: a file that is not a batch dump, or tensors of inconsistent shapes.
    """
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.pt") if not f.name.startswith(".tmp-"))
        if not files:
            raise FileNotFoundError(f"--batch {p}: the directory holds no .pt batch dump")
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"--batch {p}: no such file or directory")
    records = []
    for f in files:
        try:
            record = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:  # a pickle error or a truncated file: name the file
            raise ValueError(f"--batch {f}: cannot read it as a torch file ({err})") from None
        _check(record, f"--batch {f}")
        records.append(record)
    t = max(r["mask"].shape[1] for r in records)
    keys = [k for k in (*REQUIRED, *OPTIONAL) if all(k in r for r in records)]
    out: dict[str, Any] = {k: torch.cat([_pad(r[k].float(), t) for r in records]) for k in keys}
    out["meta"] = [r.get("meta", {}) for r in records]
    out["files"] = [str(f) for f in files]
    # the text, where every file holds it (rows in the files' order, as the tensors)
    if all("text" in r for r in records):
        keys = [k for k in (*TEXT, "prompt_text") if all(k in r["text"] for r in records)]
        out["text"] = {k: [entry for r in records for entry in r["text"][k]] for k in keys}
    return out
