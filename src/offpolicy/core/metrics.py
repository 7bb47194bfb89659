"""Metrics that know how they reduce.

A metric is stored as *partial sums*, never as a finished float, so that combining
micro-batches (``merge``) or data-parallel ranks (``all_reduce``) gives exactly the value of
one big batch — including true minima and maxima. The finished value is computed only in
``to_dict``. Each key has one reducer:

=========  ===============================  =========================================
reducer    stored                           value
=========  ===============================  =========================================
``mean``   [Σ x·m, Σ m]                     Σ x·m / Σ m   (token- or sequence-weighted)
``sum``    [Σ x, n_contributions]           Σ x
``min``    [min x, n]                       min x
``max``    [max x, n]                       max x
``std``    [Σ x, Σ x², n]                   sqrt(Σx²/n − (Σx/n)²)
``ess``    [Σ w, Σ w², n]                   (Σw)² / (n · Σw²) = (mean w)² / mean(w²)
=========  ===============================  =========================================

A key with no contribution anywhere (n = 0 on every rank) reports NaN, never a silent 0.
Partial sums are float64 tensors on the data's device; ``to_dict`` synchronises once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, NamedTuple

import torch

Reducer = Literal["mean", "sum", "min", "max", "std", "ess"]
_WIDTH: dict[str, int] = {"mean": 2, "sum": 2, "min": 2, "max": 2, "std": 3, "ess": 3}
_EMPTY_EXTREME: dict[str, float] = {"min": math.inf, "max": -math.inf}
PREFIX = "offpolicy/"


def _f64(x: torch.Tensor | float, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).reshape(())
    return torch.tensor(float(x), dtype=torch.float64, device=device)


class FlatLayout(NamedTuple):
    """What ``Metrics.from_flat`` works out from a layout [(key, reducer), ...], made once per layout
    by a kernel's plan (``FlatLayout.of``): each key's reducer and offset, the widths, their total."""

    reducers: dict[str, str]
    offsets: dict[str, int]
    widths: list[int]
    size: int

    @classmethod
    def of(cls, layout: Sequence[tuple[str, str]]) -> FlatLayout:
        reducers, offsets, widths, offset = {}, {}, [], 0
        for key, reducer in layout:
            reducers[key] = reducer
            offsets[key] = offset
            widths.append(_WIDTH[reducer])
            offset += widths[-1]
        return cls(reducers, offsets, widths, offset)



def _detached_f64(values: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` detached in float64 (a metric's partial sums), and ``mask`` (None: every element)."""
    values = values.detach().to(torch.float64)
    return values, torch.ones_like(values, dtype=torch.bool) if mask is None else mask

class Metrics:
    """A dict-like bag of reducible metrics (docs/specification.md §7). Keys are stored without the prefix."""

    def __init__(self, device: torch.device | None = None) -> None:
        # where a partial sum given as a Python number goes (None: the default device); a kernel
        # that reads its sums on the host sets the data's device, so they go back there
        self._device = device
        self._reducer: dict[str, str] = {}
        self._store: dict[str, torch.Tensor] = {}
        self._pending: tuple[torch.Tensor, int, list[int]] | None = None  # from_flat's slices, made on first use
        # (counts on the device, describe(counts) -> error message or None): input checks that a
        # kernel made without a host synchronisation, raised at the first host read (``to_dict``)
        self._checks: list[tuple[torch.Tensor, Callable[[list[float]], str | None]]] = []
        # set by from_flat while every part is still a slice of one vector: to_dict then copies
        # that vector alone (no cat, no per-key work on the device)
        self._flat: tuple[torch.Tensor, dict[str, int]] | None = None

    @classmethod
    def from_flat(cls, flat: torch.Tensor, layout: Sequence[tuple[str, str]] | FlatLayout) -> Metrics:
        """Metrics whose partial sums are consecutive slices (views) of one fp64 vector ``flat``,
        in the order of ``layout`` = [(key, reducer), ...] (or its ``FlatLayout``, which a caller
        that calls often builds once) — how a kernel hands over its metrics without a copy per key.
        Entries of ``flat`` past the layout are left alone (a kernel's input checks may follow, see
        ``defer_check``)."""
        if not isinstance(layout, FlatLayout):
            layout = FlatLayout.of(layout)
        if layout.size > flat.numel():
            raise ValueError(f"layout covers {layout.size} partial sums but the vector holds {flat.numel()}")
        out = cls()
        out._reducer.update(layout.reducers)
        out._flat = (flat, layout.offsets)
        out._pending = (flat, layout.size, layout.widths)  # views are made only if a caller needs them
        return out

    @property
    def _parts(self) -> dict[str, torch.Tensor]:
        """key → partial sums (a tensor on the data's device)."""
        if self._pending is not None:
            flat, size, widths = self._pending
            self._pending = None
            self._store.update(zip(self._reducer, flat[:size].split(widths)))
        return self._store

    def defer_check(self, counts: torch.Tensor, describe: Callable[[list[float]], str | None]) -> None:
        """Raise ``ValueError(describe(counts))`` at the first ``to_dict`` if it returns a message."""
        self._checks.append((counts, describe))

    # ------------------------------------------------------------------ recording
    def _put(self, key: str, reducer: str, parts: torch.Tensor) -> None:
        self._parts  # noqa: B018 — make from_flat's views before the key set changes
        self._flat = None
        if key in self._reducer:
            if self._reducer[key] != reducer:
                raise ValueError(
                    f"metric {key!r} was recorded with reducer {self._reducer[key]!r} and now "
                    f"{reducer!r}; one key has one reducer"
                )
            self._parts[key] = _combine(reducer, self._parts[key], parts)
        else:
            self._reducer[key] = reducer
            self._parts[key] = parts

    def mean(self, key: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Record the mean of ``values`` over ``mask`` (all elements if ``mask`` is None)."""
        values, mask = _detached_f64(values, mask)
        total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
        self._put(key, "mean", torch.stack([total, mask.sum().to(torch.float64)]))

    def ratio(self, key: str, numerator: torch.Tensor | float, denominator: torch.Tensor | float) -> None:
        """Record a mean given as already-summed numerator and denominator."""
        # the device of whichever side is a tensor: a float side must not land on the default device
        device = next((x.device for x in (numerator, denominator) if isinstance(x, torch.Tensor)), self._device)
        self._put(key, "mean", torch.stack([_f64(numerator, device), _f64(denominator, device)]))

    def sum(self, key: str, value: torch.Tensor | float) -> None:
        """Record a quantity whose batch value is the sum of its parts (counts, global-normalised losses)."""
        v = _f64(value, self._device)
        self._put(key, "sum", torch.stack([v, torch.ones_like(v)]))

    def min(self, key: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self._extreme(key, "min", values, mask)

    def max(self, key: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self._extreme(key, "max", values, mask)

    def _extreme(self, key: str, reducer: str, values: torch.Tensor, mask: torch.Tensor | None) -> None:
        values, mask = _detached_f64(values, mask)
        fill = torch.full((), _EMPTY_EXTREME[reducer], dtype=torch.float64, device=values.device)
        selected = torch.where(mask, values, fill)
        value = selected.amin() if reducer == "min" else selected.amax()
        self._put(key, reducer, torch.stack([value, mask.sum().to(torch.float64)]))

    def std(self, key: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self._moments(key, "std", values, mask)

    def ess(self, key: str, weights: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Effective sample size fraction (mean w)² / mean(w²) ∈ (0, 1] of ``weights`` over ``mask``."""
        self._moments(key, "ess", weights, mask)

    def _moments(self, key: str, reducer: str, values: torch.Tensor, mask: torch.Tensor | None) -> None:
        values, mask = _detached_f64(values, mask)
        zero = torch.zeros((), dtype=torch.float64, device=values.device)
        selected = torch.where(mask, values, zero)
        parts = torch.stack([selected.sum(), (selected * selected).sum(), mask.sum().to(torch.float64)])
        self._put(key, reducer, parts)

    # ------------------------------------------------------------------ combining
    def update(self, other: Metrics) -> Metrics:
        """Merge ``other`` into ``self`` in place (see ``merge``); returns ``self``."""
        for key, reducer in other._reducer.items():
            self._put(key, reducer, other._parts[key])
        self._checks.extend(other._checks)
        return self

    def merge(self, other: Metrics) -> Metrics:
        """A new Metrics equal to one computed on the union of both batches."""
        out = Metrics()
        out.update(self)
        out.update(other)
        return out

    def with_prefix(self, prefix: str) -> Metrics:
        """A copy whose keys are ``prefix + key`` (for per-rule or per-setting namespaces)."""
        out = Metrics()
        for key, reducer in self._reducer.items():
            out._put(prefix + key, reducer, self._parts[key])
        out._checks = list(self._checks)
        return out

    def renamed(self, rename: Callable[[str], str | None]) -> Metrics:
        """A copy with each key ``k`` stored as ``rename(k)``, or left out where that is None (a
        quantity the caller records itself, a namespace it reports under its own name)."""
        out = Metrics()
        for key, reducer in self._reducer.items():
            new = rename(key)
            if new is not None:
                out._put(new, reducer, self._parts[key])
        out._checks = list(self._checks)
        return out

    def all_reduce(self, group: torch.distributed.ProcessGroup | None = None) -> Metrics:
        """Reduce across the ranks of ``group`` in place; a no-op unless torch.distributed is initialised.

        The key set is agreed first (union over ranks, reducers must match); a rank without a key
        contributes an empty entry. Three collectives follow: SUM, MIN and MAX.

        Raises:
            ValueError: if two ranks recorded one key with different reducers.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return self
        self._flat = None
        world = dist.get_world_size(group)
        gathered: list[dict[str, str] | None] = [None] * world
        dist.all_gather_object(gathered, dict(self._reducer), group=group)
        agreed: dict[str, str] = {}
        for rank_keys in gathered:
            for key, reducer in (rank_keys or {}).items():
                if agreed.setdefault(key, reducer) != reducer:
                    raise ValueError(f"metric {key!r} has reducer {agreed[key]!r} on one rank and {reducer!r} on another")
        device = _device_for_collectives(group, self._parts)
        keys = sorted(agreed)
        for key in keys:
            if key not in self._parts:
                self._parts[key] = _empty(agreed[key], device)
                self._reducer[key] = agreed[key]
            self._parts[key] = self._parts[key].to(device)

        sum_slices, min_keys, max_keys = [], [], []
        for key in keys:
            reducer = self._reducer[key]
            if reducer in ("min", "max"):
                sum_slices.append(self._parts[key][1:])
                (min_keys if reducer == "min" else max_keys).append(key)
            else:
                sum_slices.append(self._parts[key])
        if sum_slices:
            flat = torch.cat(sum_slices)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for key in keys:
                reducer = self._reducer[key]
                if reducer in ("min", "max"):
                    self._parts[key] = torch.stack([self._parts[key][0], flat[offset]])
                    offset += 1
                else:
                    width = _WIDTH[reducer]
                    self._parts[key] = flat[offset : offset + width].clone()
                    offset += width
        for op, op_keys in ((dist.ReduceOp.MIN, min_keys), (dist.ReduceOp.MAX, max_keys)):
            if op_keys:
                extremes = torch.stack([self._parts[k][0] for k in op_keys])
                dist.all_reduce(extremes, op=op, group=group)
                for i, key in enumerate(op_keys):
                    self._parts[key] = torch.stack([extremes[i], self._parts[key][1]])
        return self

    # ------------------------------------------------------------------ reading
    def to_dict(self, prefix: str = PREFIX) -> dict[str, float]:
        """Finished values as Python floats under ``prefix`` (one device-to-host copy for all keys).

        Raises:
            ValueError: a deferred input check failed (see ``defer_check``).
        """
        if not self._reducer and not self._checks:
            return {}
        keys = sorted(self._reducer)
        backing = self._flat
        if backing is not None and all(_offset_in(c, backing[0]) is not None for c, _ in self._checks):
            flat = backing[0].cpu().tolist()  # the one device-to-host copy
            values = {key: flat[backing[1][key] : backing[1][key] + _WIDTH[self._reducer[key]]] for key in keys}
            counts = [flat[_offset_in(c, backing[0]) :][: c.numel()] for c, _ in self._checks]
        else:
            pieces = [self._parts[k].reshape(-1) for k in keys] + [c.reshape(-1).to(torch.float64) for c, _ in self._checks]
            device = pieces[0].device
            flat = torch.cat([p.to(device) for p in pieces]).cpu().tolist()  # the one device-to-host copy
            values, offset = {}, 0
            for key in keys:
                values[key] = flat[offset : offset + _WIDTH[self._reducer[key]]]
                offset += _WIDTH[self._reducer[key]]
            counts = []
            for c, _ in self._checks:
                counts.append(flat[offset : offset + c.numel()])
                offset += c.numel()
        for (_, describe), found in zip(self._checks, counts):
            message = describe(found)
            if message is not None:
                raise ValueError(message)
        return {prefix + key: _finish(self._reducer[key], values[key]) for key in keys}

    def __getitem__(self, key: str) -> float:
        key = key.removeprefix(PREFIX)
        if key not in self._parts:
            raise KeyError(f"no metric {key!r}; recorded: {sorted(self._parts)}")
        return _finish(self._reducer[key], self._parts[key].cpu().tolist())

    def reducer(self, key: str) -> str:
        return self._reducer[key.removeprefix(PREFIX)]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.removeprefix(PREFIX) in self._reducer

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._reducer))

    def __len__(self) -> int:
        return len(self._reducer)

    def keys(self) -> list[str]:
        return sorted(self._reducer)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v:.6g}" for k, v in self.to_dict(prefix="").items())
        return f"Metrics({body})"


def _offset_in(view: torch.Tensor, flat: torch.Tensor) -> int | None:
    """Where the 1-D contiguous ``view`` starts inside ``flat``, or None if it is not a slice of it."""
    if view.dim() != 1 or view.dtype != flat.dtype or view.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        return None
    return view.storage_offset() - flat.storage_offset()


def _combine(reducer: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    b = b.to(a.device)
    if reducer == "min":
        return torch.stack([torch.minimum(a[0], b[0]), a[1] + b[1]])
    if reducer == "max":
        return torch.stack([torch.maximum(a[0], b[0]), a[1] + b[1]])
    return a + b


def _empty(reducer: str, device: torch.device) -> torch.Tensor:
    parts = torch.zeros(_WIDTH[reducer], dtype=torch.float64, device=device)
    if reducer in _EMPTY_EXTREME:
        parts[0] = _EMPTY_EXTREME[reducer]
    return parts


def _finish(reducer: str, p: list[float]) -> float:
    if reducer == "mean":
        return p[0] / p[1] if p[1] > 0 else math.nan
    if reducer == "sum":
        return p[0] if p[1] > 0 else math.nan
    if reducer in ("min", "max"):
        return p[0] if p[1] > 0 else math.nan
    total, total_sq, n = p
    if n <= 0:
        return math.nan
    if reducer == "std":
        return math.sqrt(max(total_sq / n - (total / n) ** 2, 0.0))
    # ess; all weights 0 on a non-empty selection: no effective sample, 0 (not 0/0 = NaN, issue #9)
    return total * total / (n * total_sq) if total_sq > 0 else 0.0


def _device_for_collectives(group, parts: dict[str, torch.Tensor]) -> torch.device:
    """NCCL reduces CUDA tensors; every other backend here (gloo) reduces CPU tensors."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
