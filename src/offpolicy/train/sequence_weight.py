"""``offpolicy train``'s per-step sequence weights: the trainer's side of the sequence-weight pre-check
(``offpolicy.core.sequence_weight``), recorded on the device as each micro-batch's π_old becomes known."""

from __future__ import annotations

import torch

from offpolicy.core.config import CorrectionConfig
from offpolicy.core.sequence_weight import (MOST, SequenceBound, distribution, is_sequence_level, row_sums,
                                            sequence_bounds, shares, warning)


class StepSequenceWeights:
    """``offpolicy train``'s per-step view of log W_i = Σ_t clamp(log π_old − log μ): each micro-batch's rows
    are recorded on the device as π_old becomes known (``record``; no host read in the loss path), and the
    step's distribution and the run's own pre-check are read once at log time (``values``). Made only for a
    Π-ρ correction (``for_loss``)."""

    def __init__(self, correction: CorrectionConfig, rows: int, device: torch.device) -> None:
        self.correction = correction
        self.bounds, _ = sequence_bounds(correction)
        self.sums = torch.zeros(rows, dtype=torch.float32, device=device)
        self.counts = torch.zeros(rows, dtype=torch.float32, device=device)
        self.device = device
        self.last: list[tuple[SequenceBound, dict[str, float], float, float]] = []  # values()'s, for warnings()

    @classmethod
    def for_loss(cls, correction: CorrectionConfig | None, rows: int, device: torch.device
                 ) -> StepSequenceWeights | None:
        return cls(correction, rows, device) if is_sequence_level(correction) else None

    def wrap(self, old_of):
        """``old_of(rows, mb, logprobs)`` (the trainer's π_old of a device micro-batch) that also records the
        rows' log W_i from what it returns."""
        def recorded(rows: torch.Tensor, mb, logprobs: torch.Tensor | None) -> torch.Tensor | None:
            old = old_of(rows, mb, logprobs)
            self.record(rows, mb.mask, old, mb.rollout_logprobs)
            return old
        return recorded

    def record(self, rows: torch.Tensor, mask: torch.Tensor, old: torch.Tensor | None,
               rollout: torch.Tensor) -> None:
        """Rows ``rows`` (CPU indices into the step's batch) of a device micro-batch: log π_old ``old`` and
        log μ ``rollout`` ``[b, T']`` on its ``mask``. A repeated row (another PPO epoch) is overwritten."""
        if old is None:
            return
        from offpolicy.policy.score import device_index

        s, n = row_sums(old.detach().float() - rollout.float(), mask, self.correction.log_clamp)
        index = device_index(rows, self.device)  # pinned, non-blocking: no host wait in the loss path
        self.sums.index_copy_(0, index, s)
        self.counts.index_copy_(0, index, n)

    def values(self) -> dict[str, float]:
        """``seq_weight/{log_,}{min,median,max}`` and, per fixed bound of the run's correction,
        ``seq_weight/predicted_outside`` and ``seq_weight/measured_outside`` (the largest over its bounds)."""
        sums, counts = self.sums.cpu(), self.counts.cpu()
        out = {f"seq_weight/{k}": v for k, v in distribution(sums, counts).items() if k != "rows"}
        tokens = float(counts.sum())
        m = float(sums.double().sum()) / tokens if tokens else 0.0
        self.last = []
        for bound in self.bounds:
            s = shares(bound, sums, counts, m)
            self.last.append((bound, s, m, float(counts[counts > 0].median()) if bool((counts > 0).any()) else 0.0))
        if self.last:
            out["seq_weight/predicted_outside"] = max(s["predicted_outside"] for _, s, _, _ in self.last)
            out["seq_weight/measured_outside"] = max(s["measured_outside"] for _, s, _, _ in self.last)
        return out

    def warnings(self, name: str) -> list[str]:
        """The pre-check's lines for the last ``values`` (empty when no bound is crossed by most rows)."""
        return [warning(name, bound, s, m, length) for bound, s, m, length in self.last
                if max(s["predicted_outside"], s["measured_outside"]) > MOST]
