"""The engine's kept set, recorded with each sampled token and replayed by the trainer (issue #46).

Under top-k/top-p the engine draws y_t from its kept set K_t (the tokens its sampler left finite) and
reports log μ(y_t) renormalised over K_t. The trainer used to recompute K on its own logits
(``sampling.renormalize_logprobs``); two numerics (a bf16 engine, a fp32 trainer) disagree at the
set's edge, so a token could lie outside the trainer's set and π̃ and μ were normalised over different
sets. Replay takes the engine's K_t instead:

    log π̃(y_t) = z_y − logsumexp_{v ∈ K_t} z_v        z = trainer logits / τ

the same formula as the trainer's own set (the set is replaced, not the math), and y_t ∈ K_t always.

Representation (``KeptIds``): ragged, compressed-row style. Each position holds ``start`` (int64) and
``count`` (int32) into one flat ``ids`` (int32) vector of kept token ids, ascending within a position:

    memory = 12 bytes per position + 4 bytes per kept id (+ 4 for its log q_v, score centering),
             |K_t| = top_k + the ties at the k-th logit

Flat in V for top-k. Under top-p alone, |K_t| is the smallest prefix of the sorted distribution whose
mass reaches p: a few ids on a peaked distribution, ⌈p·V⌉ on a perfectly flat one (the bound: V ids,
4·V bytes per position — still 8× less than the fp32 row the sampler itself held). A per-position
threshold would be smaller but is exact only on the engine's own logits, which the trainer does not
have: the trainer needs the ids. Positions index like the ``[B, T]`` tensors of a batch (``kept[rows]``,
``kept[:, :t]``, ``kept[rows, cols]``); ``ids`` is shared, never copied by indexing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeptIds:
    """Kept token ids per position: ``ids[start[p] : start[p] + count[p]]`` is the set of position p.

    ``start`` int64 and ``count`` int32 share one shape (``[B, T]`` in a batch, ``[N]`` in the head);
    ``ids`` is int32 ``[nnz]``."""

    start: torch.Tensor
    count: torch.Tensor
    ids: torch.Tensor
    # fp32 ``[nnz]`` aligned with ``ids``: log q_v, the engine's processed log-prob of each kept id (its
    # distribution renormalised over the set), what exact score centering needs; None where not recorded
    logprobs: torch.Tensor | None = None

    def __getitem__(self, index) -> KeptIds:
        return KeptIds(self.start[index], self.count[index], self.ids, self.logprobs)

    @property
    def shape(self) -> torch.Size:
        return self.start.shape

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeptIds:
        return KeptIds(*(t.to(device, non_blocking=non_blocking) for t in (self.start, self.count, self.ids)),
                       None if self.logprobs is None else self.logprobs.to(device, non_blocking=non_blocking))

    def kept_ids(self) -> int:
        """Σ_p |K_p| over these positions (the ids they reference)."""
        return int(self.count.sum())

    def nbytes(self) -> int:
        """Bytes these positions take: 12 per position + 4 per kept id they reference (8 with log-probs)."""
        return self.start.numel() * 12 + (4 if self.logprobs is None else 8) * self.kept_ids()

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(position index, source index into ``ids``) of every kept id, and the counts: ``[nnz']`` each."""
        count = self.count.reshape(-1).long()
        start = self.start.reshape(-1)
        position = torch.repeat_interleave(torch.arange(count.numel(), device=count.device), count)
        first = torch.cumsum(count, 0) - count  # where each position's ids begin in the flat output
        source = start[position] + torch.arange(position.numel(), device=count.device) - first[position]
        return position, source, count

    def dense(self, vocab: int) -> torch.Tensor:
        """The sets as a bool mask ``[*shape, vocab]`` (the head makes one chunk's at a time through
        ``flat``: C·V, the chunk's own budget).

        Raises:
            ValueError: a kept id ≥ ``vocab`` (the engine's vocabulary is not the trainer's).
        """
        flat = self.flat()
        flat.check(vocab)
        return flat.mask(0, flat.positions, vocab).view(*self.start.shape, vocab)

    def flat(self) -> FlatKept:
        """These positions' sets expanded id by id (``FlatKept``), flattened in row-major order. Reads
        two numbers per position back to the host (their ends, and the largest id): done where the
        sets are on the host (``score.to_device``), it costs no device wait."""
        position, source, count = self._flat()
        ids = self.ids[source]
        ends = torch.cumsum(count, 0).tolist()
        top = int(ids.max()) if ids.numel() else -1
        return FlatKept(position.to(torch.int32), ids, ends, top)

    def compact(self, valid: torch.Tensor | None = None) -> KeptIds:
        """The same sets with ``ids`` holding only theirs (and, with ``valid`` a bool of ``shape``, only the
        valid positions'; the others become empty): what a record keeps once the generation is done."""
        count = self.count if valid is None else torch.where(valid, self.count, torch.zeros_like(self.count))
        trimmed = KeptIds(self.start, count, self.ids)
        _, source, flat_count = trimmed._flat()
        start = (torch.cumsum(flat_count, 0) - flat_count).view(self.start.shape)
        return KeptIds(start, count, self.ids[source], None if self.logprobs is None else self.logprobs[source])

    def padded(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sets as ``[*shape, K]`` tensors, K the largest set: the ids (int64, 0 where a row is padded)
        and their log q_v (fp32, −inf where padded; None when not recorded) — the ``ids`` and
        ``rollout_logprobs`` of exact score centering's ``Support`` (``Support.of``; ``centering.support_logprobs``
        gives the trainer's side from the same ids)."""
        position, source, count = self._flat()
        width = int(count.max()) if count.numel() else 0
        first = torch.cumsum(count, 0) - count
        slot = torch.arange(position.numel(), device=count.device) - first[position]
        ids = torch.zeros((count.numel(), width), dtype=torch.int64, device=count.device)
        ids[position, slot] = self.ids[source].long()
        shape = (*self.start.shape, width)
        if self.logprobs is None:
            return ids.view(shape), None
        logq = torch.full((count.numel(), width), float("-inf"), dtype=torch.float32, device=count.device)
        logq[position, slot] = self.logprobs[source].float()
        return ids.view(shape), logq.view(shape)

    def pad(self, width: int) -> KeptIds:
        """``[B, T] → [B, width]``: cut, or extended with empty positions."""
        rows, have = self.start.shape
        if have >= width:
            return self[:, :width]
        start = torch.zeros((rows, width), dtype=self.start.dtype, device=self.start.device)
        count = torch.zeros((rows, width), dtype=self.count.dtype, device=self.count.device)
        start[:, :have], count[:, :have] = self.start, self.count
        return KeptIds(start, count, self.ids, self.logprobs)

    @staticmethod
    def from_rows(rows: list[list[list[int]]], logprobs: list[list[list[float]]] | None = None) -> KeptIds:
        """Kept ids listed per response and per token (a server's sampling masks, each position's ids
        ascending) → ``[B, longest]`` sets, positions past a response's end empty; compact. ``logprobs``,
        laid out as ``rows``: each kept id's log q_v (``KeptIds.logprobs``)."""
        width = max((len(r) for r in rows), default=0)
        count = torch.tensor([[len(r[t]) if t < len(r) else 0 for t in range(width)] for r in rows],
                             dtype=torch.int32).reshape(len(rows), width)
        ids = torch.tensor([v for r in rows for position in r for v in position], dtype=torch.int32)
        start = (torch.cumsum(count.reshape(-1).long(), 0) - count.reshape(-1).long()).view(len(rows), width)
        logq = None if logprobs is None else torch.tensor(
            [v for r in logprobs for position in r for v in position], dtype=torch.float32)
        if logq is not None and logq.shape != ids.shape:
            raise ValueError(f"{logq.numel()} kept log-probs for {ids.numel()} kept ids")
        return KeptIds(start, count, ids, logq)

    @staticmethod
    def from_mask(keep: torch.Tensor, logprobs: torch.Tensor | None = None) -> KeptIds:
        """Bool ``[..., V]`` → the kept ids of each position (ascending), compact; with ``logprobs``
        (``[..., V]``, the distribution the token is drawn from) also each kept id's log q_v."""
        flat = keep.reshape(-1, keep.shape[-1])
        count = flat.sum(-1).to(torch.int32)
        rows, cols = flat.nonzero(as_tuple=True)  # row-major: row by row, ids ascending
        ids = cols.to(torch.int32)
        start = torch.cumsum(count.long(), 0) - count.long()
        logq = None if logprobs is None else logprobs.reshape(-1, keep.shape[-1])[rows, cols].float()
        return KeptIds(start.view(keep.shape[:-1]), count.view(keep.shape[:-1]), ids, logq)


@dataclass(frozen=True)
class FlatKept:
    """The kept sets of ``N`` positions (the counted tokens of a micro-batch, in the head's order), one
    entry per kept id: ``ids[j]`` is kept at position ``position[j]``, positions ascending. ``ends``
    (host ints, ``[N]``): ``ends[p]`` = Σ_{q ≤ p} |K_q|, so any run of positions [a, b) is the slice
    ``[ends[a − 1], ends[b − 1])``; ``top``: the largest id (−1: none).

    Worked out on the host once per micro-batch, it lets the head make each chunk's dense mask from
    slices whose bounds it already knows: no ``nonzero``, no host read of a device value in the forward
    or the backward (on a GPU, each would wait for every kernel queued before it: four per chunk
    before, zero now). Memory: 8 bytes per kept id (the ``KeptIds`` it came from hold 4)."""

    position: torch.Tensor  # [nnz] int32
    ids: torch.Tensor  # [nnz] int32
    ends: list[int]
    top: int

    @property
    def positions(self) -> int:
        return len(self.ends)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> FlatKept:
        return FlatKept(self.position.to(device, non_blocking=non_blocking),
                        self.ids.to(device, non_blocking=non_blocking), self.ends, self.top)

    def check(self, vocab: int) -> None:
        """Raises ValueError when a kept id is outside a vocabulary of ``vocab`` (a host comparison)."""
        if self.top >= vocab:
            raise ValueError(f"kept set: token id {self.top} is outside the trainer's vocabulary of {vocab}; "
                             "the engine that recorded it samples from another vocabulary (replay needs the same model)")

    def mask(self, start: int, end: int, vocab: int) -> torch.Tensor:
        """The sets of positions [start, end) as a bool mask ``[end − start, vocab]``, on their device."""
        first = self.ends[start - 1] if start > 0 else 0
        last = self.ends[end - 1] if end > start else first
        out = torch.zeros((end - start, vocab), dtype=torch.bool, device=self.ids.device)
        rows = self.position[first:last].long() - start
        true = torch.ones((), dtype=torch.bool, device=out.device)  # made there: no host → device copy
        return out.index_put_((rows, self.ids[first:last].long()), true)


class StepRecorder:
    """The kept sets of a generation, one step at a time (``[B]`` positions per step), assembled into
    ``[B, steps]`` (``KeptIds``) at the end. Each step's bool ``[B, V]`` lives only during its call."""

    def __init__(self):
        self.counts: list[torch.Tensor] = []  # [B] int32 per step
        self.ids: list[torch.Tensor] = []  # [Σ_b |K_b|] int32 per step, row-major
        self.logprobs: list[torch.Tensor] = []  # [Σ_b |K_b|] fp32 per step: log q_v of each kept id

    def add(self, keep: torch.Tensor, logprobs: torch.Tensor | None = None) -> None:
        """One step: its kept mask ``[B, V]`` and, to record q_v for exact score centering, the
        processed log-probs ``[B, V]`` the token is drawn from (the engine's distribution over the set)."""
        step = KeptIds.from_mask(keep, logprobs)
        self.counts.append(step.count)
        self.ids.append(step.ids)
        if step.logprobs is not None:
            self.logprobs.append(step.logprobs)

    def add_top(self, logprobs: torch.Tensor, k: int, live: torch.Tensor | None = None) -> None:
        """One step's head: the ``k`` largest of ``logprobs`` ``[B, V]`` each row (ids ascending, −inf dropped:
        ids a truncated sampler cannot draw), with their values; a row ``live`` says has finished records none.
        Built from ``topk`` itself, without a ``[B, V]`` mask."""
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        ids, order = top.indices.sort(dim=-1)
        values = top.values.gather(-1, order)
        valid = values > float("-inf")
        if live is not None:
            valid &= live[:, None]
        self.counts.append(valid.sum(dim=-1).to(torch.int32))
        self.ids.append(ids[valid].to(torch.int32))  # row-major: row by row, ids ascending
        self.logprobs.append(values[valid].float())

    def assemble(self, steps: int, lengths: list[int]) -> KeptIds:
        """``[B, steps]`` sets of the first ``steps`` steps, only the first ``lengths[b]`` of row b kept."""
        counts = torch.stack(self.counts[:steps], dim=1) if steps else torch.zeros((len(lengths), 0), dtype=torch.int32)
        ids = torch.cat(self.ids[:steps]) if steps else torch.zeros(0, dtype=torch.int32)
        logq = None
        if self.logprobs and len(self.logprobs) == len(self.ids):
            logq = torch.cat(self.logprobs[:steps]) if steps else torch.zeros(0, dtype=torch.float32)
        # the ids are step-major (step 0's rows, then step 1's ...): exclusive cumsum in that order
        step_major = counts.t().reshape(-1).long()
        start = (torch.cumsum(step_major, 0) - step_major).view(steps, -1).t()
        valid = torch.arange(steps, device=counts.device) < torch.tensor(lengths, device=counts.device).unsqueeze(1)
        return KeptIds(start.contiguous(), counts, ids, logq).compact(valid)
