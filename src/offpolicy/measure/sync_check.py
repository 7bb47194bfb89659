"""Did the weight sync happen? A sync that changed nothing is an error, and the engine's KL to the initial
policy tells "the engine never moved" apart from staleness (issue #56, item 7).

A sync that silently fails looks like staleness: the engine keeps sampling from old weights while the
trainer's move on, so the mismatch KL grows and the ESS collapses (verl #7495: a LoRA adapter never reached
vLLM, rollout KL rose 36×; xtuner #2044: FP8 quantisation that left the engine's weights misaligned).

**The check** (``verified_sync``, engine-agnostic). An engine that can read its own weights back exposes
``weight_fingerprint()`` → {name: (Σ x, Σ |x|, Σ x²)} in float64 over a strided sample of a few of its largest
tensors (``engines.fingerprint``; the hf engine: ``PROBES`` of them, where a norm's few entries under a small
learning rate may round to the same bf16 value). Around each ``sync_weights`` the trainer side reads the
fingerprint before and after, and fingerprints the tensors it sends under those names as they pass, cast to
the engine's dtype (``engine.dtype``) so that an update too small to change the engine's bf16 copy counts as
no change. When what it sent under the probe names differs from what it sent at the previous sync, but the
engine's fingerprint is unchanged, the sync changed nothing: ``SyncError``. What the trainer sent unchanged (a
learning rate of 0, the first sync) is no error. An engine without ``weight_fingerprint`` is synced
unchecked (``checked`` False; vLLM's own verification lives in ``engines/vllm.py``).

**The metric** (``InitialPolicy``, ``offpolicy train initial_kl_rows=K``): on K rows of each step's batch,
the initial policy π_0 (the run's starting model, kept frozen) scores the engine's tokens, and

    sync/engine_kl_to_initial = mean_t (r_t − 1 − log r_t),   r_t = π_0(y_t) / μ(y_t)

is the k3 estimate of KL(μ ‖ π_0) on μ's own samples (unbiased: E_μ[r] = 1). Read beside
``offpolicy/kl_k3`` (KL(μ ‖ π_old), mismatch and staleness together): an engine that never moved keeps its
KL to π_0 at the step-0 level (the numerics' mismatch alone) while its KL to the trainer grows; a stale
engine moves away from π_0, only later than the trainer. ``sync/trainer_kl_to_initial`` is the same
estimate with π_old in μ's place, r_t = π_0(y_t)/π_old(y_t), on the same tokens (still drawn from μ: a
comparison, exact only where μ = π_old). It costs a frozen copy of the model and one no-grad forward of K
rows a step; the log-probs the trainer already has (μ, π_old) alone cannot give it, since none of them is
π_0 on this step's tokens.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from offpolicy.core import ops
from offpolicy.engines.base import EngineError
from offpolicy.engines.fingerprint import (PROBES, Fingerprint, fingerprint, fingerprints, probe_names,  # noqa: F401
                                         sample, summarize)


class SyncError(EngineError):
    """A weight sync that changed nothing in the engine while the trainer's weights changed."""


_SENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine → what the last sync sent (probe names)


def verified_sync(engine: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """``engine.sync_weights(weights)``, checked where the engine has ``weight_fingerprint`` (module doc);
    returns whether it was checked.

    Raises:
        SyncError: the trainer sent changed weights under the probe names and the engine's did not change.
    """
    read = getattr(engine, "weight_fingerprint", None)
    if read is None:
        engine.sync_weights(weights)
        return False
    before = read()
    samples: dict[str, torch.Tensor] = {}
    dtype = getattr(engine, "dtype", None)  # what the engine stores: an update below its precision sends nothing new
    dtype = dtype if isinstance(dtype, torch.dtype) else None

    def tapped() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name in before:
                samples[name] = sample(tensor, dtype)  # summed below, in one host read for all of them
            yield name, tensor

    engine.sync_weights(tapped())
    sent = summarize(samples)
    after = read()
    previous = _SENT.get(engine)
    _SENT[engine] = sent
    moved = [n for n in sent if previous is not None and previous.get(n) != sent[n]]
    if moved and after == before:
        raise SyncError(
            f"{getattr(engine, 'name', 'engine')} engine: the weight sync changed nothing — the trainer sent new "
            f"values of {', '.join(moved)}, but the engine's copies are as before the sync. The engine would keep "
            "sampling from the old policy and the growing mismatch would read as staleness (verl #7495). Check that "
            "the sync reaches the engine's model (names, adapters, quantisation: docs/diagnose.md, \"Sync "
            "verification\")")
    return True


class InitialPolicy:
    """The run's initial policy π_0, frozen, scoring a few rows a step (module doc). ``scorer``: the run's
    (its sampling support, device and dtype); ``model_path``: the model the run started from."""

    def __init__(self, model_path, scorer) -> None:
        from offpolicy.policy.score import load_policy

        model = load_policy(model_path, scorer.device).eval().requires_grad_(False)
        self.scorer = replace(scorer.whole(), model=model)

    def values(self, batch, rows: torch.Tensor, trainer: torch.Tensor | None = None) -> dict[str, float]:
        """``sync/engine_kl_to_initial`` (and, with ``trainer`` = log π_old of these rows ``[k, T]``,
        ``sync/trainer_kl_to_initial``) on ``rows`` of the CPU ``batch``; tokens where a log-prob is not
        finite (outside a top-k/top-p support) are left out."""
        sub = batch.select(rows)
        initial = self.scorer.score(sub).logprobs.float().cpu()
        mu = sub.rollout_logprobs.float()
        valid = sub.mask.bool() & torch.isfinite(initial) & torch.isfinite(mu)
        out = {"sync/engine_kl_to_initial": kl_k3(initial, mu, valid)}
        if trainer is not None:
            trainer = trainer.float().cpu()[:, : mu.shape[1]]
            both = valid & torch.isfinite(trainer)
            out["sync/trainer_kl_to_initial"] = kl_k3(initial, trainer, both)
        return out


def kl_k3(target: torch.Tensor, sampler: torch.Tensor, valid: torch.Tensor) -> float:
    """mean over ``valid`` of k3 = r − 1 − log r, log r = clamp(target − sampler, ±20) (fp32; NaN: no token)."""
    if not bool(valid.any()):
        return float("nan")
    log_r = torch.where(valid, target - sampler, 0.0).clamp(-20.0, 20.0)
    return float(ops.masked_mean(ops.k3(log_r, 20.0), valid))
