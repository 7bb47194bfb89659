"""One compile per kernel, dtype and rule structure, whatever the data or the batch (issue #44).

A GPU pays ~1 s per Triton compile and 10–20 s per torch.compile of the CPU rung; both used to compile
anew (1) every optimizer step under a data-chosen bound, whose number ``resolve_thresholds`` wrote into
the configuration and the kernels took as a constant, and (2) for micro-batch shapes whose sizes,
strides or buffer offsets fell into another divisibility-by-16 class. Counted here without a GPU:

* Triton: each launch's specialisation key — computed by Triton's own binder
  (``triton.runtime.jit.create_function_from_signature``, what ``JITFunction.run`` keys its cache on)
  for the kernel's own ``do_not_specialize`` settings — is recorded and the launch skipped, so the count
  covers real trainer shapes (blocks of 1,024 tokens) at the cost of the host side alone.
* The compiled rung: dynamo's frame counter across two thresholds.
"""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.core.step import resolve_thresholds

pytest.importorskip("triton", reason="Triton is not installed")
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from offpolicy.core.kernels import triton as tk  # noqa: E402

KERNELS = ("_row_stats", "_tokens", "_finish")


@pytest.fixture
def compile_keys(monkeypatch):
    """kernel name → the set of specialisation keys its launches asked for (launches stubbed out)."""
    monkeypatch.setattr(tk, "BLOCK", None)  # the rung's own block sizes
    keys: dict[str, set] = {name: set() for name in KERNELS}
    for name in KERNELS:
        kernel = getattr(tk, name)
        settings = getattr(kernel, "kwargs", None)  # InterpretedFunction (TRITON_INTERPRET=1)
        if settings is None:  # a JITFunction (CUDA)
            settings = {"do_not_specialize": kernel.do_not_specialize,
                        "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment}
        jit = JITFunction(kernel.fn, do_not_specialize=settings.get("do_not_specialize"),
                          do_not_specialize_on_alignment=settings.get("do_not_specialize_on_alignment"))
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)

        def run(*args, grid, warmup, _binder=binder, _name=name, **kwargs):
            _, specialization, options = _binder(*args, **kwargs)
            keys[_name].add((repr(specialization), repr(sorted(options.items()))))
            if _name == "_finish":  # its output, as the kernel writes it: the host reads the input checks back
                args[1].zero_()  # (uninitialised memory could read as a refusal, or NaN)

        monkeypatch.setattr(kernel, "run", run)
    return keys


def _batch(g: torch.Generator, B: int, T: int, dtype=torch.float32, noise: float = 0.3) -> dict[str, torch.Tensor]:
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3 - 0.05
    rollout = (old + noise * torch.randn(B, T, generator=g)).clamp(max=0.0)
    logprobs = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0.0).to(dtype)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    return {"logprobs": logprobs, "old_logprobs": old, "rollout_logprobs": rollout, "advantages": adv, "mask": mask}


def _launch(batch: dict[str, torch.Tensor], cfg: op.LossConfig, reduce: bool = True) -> None:
    tk.policy_loss(batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["mask"],
                   batch["rollout_logprobs"], cfg, reduce)


def _data_chosen_presets() -> list[str]:
    names = []
    for name in op.presets.names():
        corr = op.LossConfig.from_preset(name).correction
        if corr is not None and corr.data_dependent:
            names.append(name)
    return names


def test_there_are_data_chosen_presets():
    assert "areal:m2po" in _data_chosen_presets()


@pytest.mark.parametrize("name", _data_chosen_presets())
def test_data_chosen_bounds_do_not_recompile_across_steps(name, compile_keys):
    """Item 1: three optimizer steps of the preset, each with its own cut (resolve_thresholds), ask
    each kernel for one specialisation — the bounds are a runtime vector, not constants."""
    cfg = op.LossConfig.from_preset(name)
    g = torch.Generator().manual_seed(0)
    bounds, specs = set(), set()
    for step in range(3):
        batch = _batch(g, 6, 48, noise=0.2 + 0.1 * step)
        resolved = resolve_thresholds(cfg, [batch])
        bounds.add(tk.bounds_of(resolved))
        specs.add(tk.spec_of(resolved, True))
        _launch(batch, resolved)
    assert len(bounds) == 3, "the steps chose the same cut: the comparison would be vacuous"
    assert len(specs) == 1, specs
    launched = {k: len(v) for k, v in compile_keys.items() if v}
    assert launched.get("_tokens") == 1 and set(launched.values()) == {1}, launched


@pytest.mark.parametrize("name", _data_chosen_presets())
def test_a_data_chosen_bound_rebuilds_only_the_bounds_vector(name, compile_keys, monkeypatch):
    """Optimizer steps of a data-chosen preset bring one config each (``resolve_thresholds``), alike but for
    a bound. The plan's structure — metric layouts (``_layout``), shapes, launch arguments and the metric
    index's device copy — is built for the first and found for the others: each later step costs one host
    tensor (its bounds vector) and the launches get the same index tensor. On 953ff76 every step rebuilt the
    plan: 2 ``_layout`` calls and 3 tensors copied to the device (bounds, index, index_global) a step."""
    cfg = op.LossConfig.from_preset(name)
    g = torch.Generator().manual_seed(4)
    steps = [_batch(g, 5, 40, noise=0.2 + 0.1 * i) for i in range(4)]
    resolved = [resolve_thresholds(cfg, [b]) for b in steps]
    assert len({tk.bounds_of(r) for r in resolved}) == len(steps), "the steps chose the same bounds: vacuous"
    launches: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bounds given to _tokens, index given to _finish)
    run_tokens, run_finish = tk._tokens.run, tk._finish.run  # compile_keys' stubs (they record, launch nothing)
    monkeypatch.setattr(tk._tokens, "run", lambda *a, **kw: (launches.append((a[10], None)), run_tokens(*a, **kw)))
    monkeypatch.setattr(tk._finish, "run", lambda *a, **kw: (launches.__setitem__(
        -1, (launches[-1][0], a[4])), run_finish(*a, **kw)))
    layout, tensor = tk._layout, torch.tensor
    calls = {"_layout": 0, "tensor": 0}

    def counted_layout(*args, **kwargs):
        calls["_layout"] += 1
        return layout(*args, **kwargs)

    def counted_tensor(*args, **kwargs):
        calls["tensor"] += 1
        return tensor(*args, **kwargs)

    monkeypatch.setattr(tk, "_layout", counted_layout)
    _launch(steps[0], resolved[0])  # the first step may build the structure (or find it: an earlier test's)
    monkeypatch.setattr(torch, "tensor", counted_tensor)
    calls["_layout"] = 0
    for batch, rcfg in zip(steps[1:], resolved[1:]):
        _launch(batch, rcfg)
    assert calls == {"_layout": 0, "tensor": len(steps) - 1}, calls
    index = launches[0][1]
    assert all(i is index for _, i in launches), "the metric index was copied to the device again"
    for (bounds, _), rcfg in zip(launches, resolved):  # each step's own numbers, never a stale vector
        assert torch.equal(bounds, torch.tensor(tk.bounds_of(rcfg), dtype=torch.float32))
    # the same numbers in a fresh config object (one made per call): no copy at all
    again = op.LossConfig(**resolved[-1].model_dump())
    assert again is not resolved[-1]
    calls["tensor"] = 0
    _launch(steps[-1], again)
    assert calls["tensor"] == 0 and launches[-1][0] is launches[-2][0], calls


def test_the_per_config_cache_holds_its_key_and_starts_afresh_past_its_size():
    """``kernels.common.per_config``, the one invalidation rule of the rungs' per-config caches: a hit is
    the very object (its id cannot be reused while the cache holds it), other arguments are part of the
    key, and past ``maxsize`` entries the cache is emptied rather than grown."""
    from offpolicy.core.kernels.common import per_config

    made = []

    @per_config(3)
    def f(config, flag):
        made.append((config, flag))
        return len(made)

    a, b = op.LossConfig(), op.LossConfig()
    assert (f(a, True), f(a, True), f(a, False), f(b, True)) == (1, 1, 2, 3)
    assert f(op.LossConfig(), True) == 4  # the cache was full: emptied, then this entry
    assert f(a, True) == 5 and len(made) == 5


def test_one_variant_per_kernel_over_forty_trainer_shapes(compile_keys):
    """Item 4: 40 random micro-batch shapes (1–64 rows × 1–4,096 tokens, odd sizes, offsets and strides
    included), fp32 log-probs, with and without a row-level rule, reduced and not: one variant per
    kernel and rule structure. Rows of > 8,192 tokens or batches of > 2²⁰ tokens are the second size
    class (blocks of 4,096: see ``triton._block``), named and counted below."""
    g = torch.Generator().manual_seed(1)
    token_rules = op.LossConfig(dual_clip=3.0,
                                correction={"weight": {"level": "token", "mode": "truncate", "high": 2.0}})
    row_rules = op.LossConfig(correction={"reject": [{"stat": "k3", "level": "seq_mean", "high": 0.3}],
                                          "weight": {"level": "sequence", "mode": "truncate", "high": 2.0}})
    for i in range(40):
        B = int(torch.randint(1, 65, (1,), generator=g))
        T = int(torch.randint(1, 4097, (1,), generator=g))
        batch = _batch(g, B, T + 1)
        # a trainer view: the first T columns of a wider batch (rows start at stride T + 1)
        batch = {k: v[:, :T] for k, v in batch.items()}
        _launch(batch, token_rules)
        _launch(batch, row_rules, reduce=i % 4 != 0)
    counts = {k: len(v) for k, v in compile_keys.items()}
    # _tokens and _finish: one variant per rule structure × (reduced, unreduced) for _tokens
    assert counts == {"_row_stats": 1, "_tokens": 3, "_finish": 2}, counts
    # the large size class: one more variant of each kernel, whatever its shape
    for B, T in ((2, 9000), (300, 4000), (3, 12_345)):
        _launch(_batch(g, B, T), row_rules)
    counts = {k: len(v) for k, v in compile_keys.items()}
    assert counts == {"_row_stats": 2, "_tokens": 4, "_finish": 2}, counts


def test_a_dtype_is_one_more_variant(compile_keys):
    g = torch.Generator().manual_seed(2)
    cfg = op.LossConfig(correction={})
    for dtype in (torch.float32, torch.bfloat16):
        for B, T in ((3, 17), (16, 1000), (1, 1)):
            _launch(_batch(g, B, T, dtype), cfg)
    assert len(compile_keys["_tokens"]) == 2 and len(compile_keys["_finish"]) == 1


@pytest.mark.slow
def test_the_compiled_rung_does_not_recompile_for_a_new_threshold(monkeypatch):
    """Item 1 on the CPU rung: a quantile bound resolved over two different steps gives two numbers
    and one torch.compile (dynamo's frame count), and each step's result is the reference's."""
    from torch._dynamo.utils import counters

    from offpolicy.core.kernels import compiled

    monkeypatch.setenv("OFFPOLICY_COMPILE", "1")
    quantile = {"rule": "quantile", "q": 0.9}
    cfg = op.LossConfig(correction={"reject": [{"stat": "ratio", "level": "token", "high": quantile}]})
    g = torch.Generator().manual_seed(3)
    steps = [_batch(g, 4, 24, noise=n) for n in (0.2, 0.5)]
    resolved = [resolve_thresholds(cfg, [b]) for b in steps]
    assert resolved[0].correction.reject[0].high != resolved[1].correction.reject[0].high
    assert compiled.core_spec(resolved[0], True, True) == compiled.core_spec(resolved[1], True, True)
    frames = []
    for batch, rcfg in zip(steps, resolved):
        before = counters["frames"]["ok"]
        args = (batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["mask"])
        fast = op.policy_loss(*args, rollout_logprobs=batch["rollout_logprobs"], config=rcfg, implementation="compiled")
        ref = op.policy_loss(*args, rollout_logprobs=batch["rollout_logprobs"], config=rcfg, implementation="reference")
        frames.append(counters["frames"]["ok"] - before)
        torch.testing.assert_close(fast[0], ref[0], rtol=1e-5, atol=1e-6)
        assert fast[1]["masked_fraction"] == pytest.approx(ref[1]["masked_fraction"])
    assert not compiled._compile_failed
    assert frames[1] == 0, frames


def test_the_compiled_rung_reads_each_configs_own_bounds(monkeypatch):
    """The compiled rung takes the Triton rung's bounds vector (``common.bounds_of``: ±inf where a bound is
    open, which its core never reads — the spec says which are set) through the same value-keyed device
    copy: configs alike but for their numbers, called in turn, each get the reference's result, and a
    fresh config object with the same numbers reuses the copy (953ff76 made one per config object). The
    core runs uncompiled here: the graph is the same function of the same vector, compiled or not."""
    import functools

    from offpolicy.core.kernels import compiled

    monkeypatch.setattr(compiled, "_compiled", lambda spec: functools.partial(compiled._core, spec=spec))
    monkeypatch.setenv("OFFPOLICY_COMPILE", "1")

    def config(x: float) -> op.LossConfig:  # open bounds among the set ones: the rule's high, the weight's low
        return op.LossConfig(clip_low=x / 3, clip_high=x / 3, dual_clip=2 + x, correction={
            "weight": {"level": "sequence", "mode": "truncate", "high": 1 + x},
            "reject": [{"stat": "ratio", "level": "token", "low": 1 - x}]})

    batch = _batch(torch.Generator().manual_seed(5), 6, 32, noise=0.5)
    args = (batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["mask"])
    results = {}
    for x in (0.3, 0.5, 0.3):
        fast = op.policy_loss(*args, rollout_logprobs=batch["rollout_logprobs"], config=config(x),
                              implementation="compiled")
        ref = op.policy_loss(*args, rollout_logprobs=batch["rollout_logprobs"], config=config(x),
                             implementation="reference")
        torch.testing.assert_close(fast[0], ref[0], rtol=1e-5, atol=1e-6)
        got, want = fast[1].to_dict(), ref[1].to_dict()
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        if x in results:  # called again after another config: bit for bit the same
            assert torch.equal(results[x][0], fast[0]) and results[x][1] == got
        results[x] = (fast[0], got)
    assert results[0.3][1]["offpolicy/masked_fraction"] != results[0.5][1]["offpolicy/masked_fraction"]
    assert results[0.3][1]["offpolicy/clip_fraction"] != results[0.5][1]["offpolicy/clip_fraction"]
    device = batch["mask"].device
    assert compiled._bounds(config(0.3), device) is compiled._bounds(config(0.3), device)
    assert torch.equal(compiled._bounds(config(0.5), device),
                       torch.tensor(tk.bounds_of(config(0.5)), dtype=torch.float32))
