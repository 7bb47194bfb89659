"""The Triton rung equals the reference: loss, gradient, the unreduced loss and mask, and every
metric (keys, reducers, values within 1e-4 relative — the rung sums in fp32 per block of tokens
and in fp64 across blocks, the reference in fp64 throughout).

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest
when no GPU is present) at small shapes, with ``BLOCK`` shrunk so that rows span several programs
(the cross-chunk reductions are then exercised). On a GPU the same checks run on CUDA tensors,
plus what only a GPU can show: no host synchronisation, CUDA-graph capture, the deferred check.
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from conftest import random_batch

pytest.importorskip("triton", reason="Triton is not installed (pip install triton); the triton rung is untested")
from offpolicy.core.kernels import triton as tk  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]  # on the CPU: the interpreter (conftest sets TRITON_INTERPRET=1)
cpu_only = pytest.mark.skipif(CUDA, reason="the interpreter runs only where no GPU is (TRITON_INTERPRET is unset)")

CORRECTIONS = [
    None,
    {},
    {"weight": {"level": "token", "mode": "truncate", "high": 2.0}},
    {"weight": {"level": "token", "mode": "mask", "low": 0.5, "high": 5.0}, "denominator": "fixed"},
    {"weight": {"level": "sequence", "mode": "truncate", "low": 0.2, "high": 2.0}},
    {"weight": {"level": "geometric", "mode": "mask", "low": 0.8, "high": 1.25}},
    {"weight": {"level": "sequence", "mode": "truncate", "high": 2.0},
     "reject": [{"stat": "ratio", "level": "any_token", "low": 1e-3}]},
    {"weight": {"level": "token", "mode": "truncate", "high": 2.0},
     "reject": [{"stat": "ratio", "level": "token", "low": 0.3, "high": 3.0}, {"stat": "k3", "level": "seq_mean", "high": 0.3},
                {"stat": "ratio", "level": "geometric", "low": 0.7, "high": 1.4}], "reject_mode": "sequential"},
    {"weight": {"level": "geometric", "mode": "truncate", "high": 1.5},
     "reject": [{"stat": "ratio", "level": "token", "low": 0.3, "high": 3.0}, {"stat": "ratio", "level": "sequence", "low": 0.1, "high": 10}],
     "reject_mode": "sequential", "denominator": "fixed"},
    {"reject": [{"stat": "k1", "level": "seq_sum", "low": -0.7, "high": 0.7}, {"stat": "k2", "level": "seq_max", "high": 0.5},
                {"stat": "k3", "level": "token", "high": 0.4},
                # AReaL's direction (issue #26): k1 = log ρ, k3 = 1/ρ − 1 + log ρ, in the same case (no extra run)
                {"stat": "k1", "level": "token", "low": -0.6, "direction": "pi_mu"},
                {"stat": "k3", "level": "seq_max", "high": 0.6, "direction": "pi_mu"},
                {"stat": "k1", "level": "seq_mean", "low": -0.05, "high": 0.3, "direction": "pi_mu"}]},
    {"anchor": "rollout", "reject": [{"stat": "ratio", "level": "geometric", "low": 0.9, "high": 1.1}]},
    {"anchor": "current", "weight": {"level": "token", "mode": "truncate", "low": 0.8, "high": 1.2}},
    {"weight": {"level": "sequence", "mode": "truncate"}, "log_clamp": None},
]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Rows of ~40 tokens over blocks of 16: every row spans several programs."""
    monkeypatch.setattr(tk, "BLOCK", 16)


def _loss_config(kind: str, agg: str, correction) -> op.LossConfig:
    if correction is not None and correction.get("anchor") == "current":  # reinforce only (cispo would double-count)
        kind = "reinforce"
    extra = {"dual_clip": 3.0} if kind == "ppo" else {}
    return op.LossConfig(kind=kind, agg=agg, correction=correction, **extra)


def _run(batch, cfg, implementation, reduce=True):
    lp = batch["logprobs"].clone().requires_grad_(True)
    out = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"], rollout_logprobs=batch["rollout"], config=cfg,
                         reduce=reduce, implementation=implementation)
    value = out[0] if reduce else (out[0] * torch.linspace(0.5, 1.5, out[0].shape[-1], device=lp.device)).sum()
    value.backward()
    return out, lp.grad


def assert_same(batch, cfg, reduce=True):
    (ref, ref_grad), (fast, fast_grad) = _run(batch, cfg, "reference", reduce), _run(batch, cfg, "triton", reduce)
    torch.testing.assert_close(fast_grad, ref_grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fast[0], ref[0], rtol=1e-4, atol=1e-6)
    if not reduce:
        torch.testing.assert_close(fast[1], ref[1])
    ref_m, fast_m = ref[-1].to_dict(), fast[-1].to_dict()
    assert ref_m.keys() == fast_m.keys(), ref_m.keys() ^ fast_m.keys()
    for key, value in ref_m.items():
        assert fast[-1].reducer(key) == ref[-1].reducer(key), key
        assert math.isclose(fast_m[key], value, rel_tol=1e-4, abs_tol=1e-6) or (
            math.isnan(value) and math.isnan(fast_m[key])), (key, value, fast_m[key])


def _batch(seed, device, t=40, noise=0.4, b=4):
    # 4 rows by default: the interpreter runs each row's program block by block at ~0.1 s a program, and
    # rows of up to 40 tokens over blocks of 16 still span up to three blocks
    return {k: v.to(device) for k, v in random_batch(seed, b=b, t=t, noise=noise).items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(len(CORRECTIONS)))
def test_triton_equals_reference(device, index):
    batch = _batch(index, device)
    correction = CORRECTIONS[index]
    for j, kind in enumerate(("ppo", "cispo", "reinforce")):
        agg = AGGS[(index + j) % len(AGGS)]
        cfg = _loss_config(kind, agg, correction)
        assert tk.supports(cfg, None)
        assert_same(batch, cfg)
    assert_same(batch, _loss_config("ppo", AGGS[index % 4], correction), reduce=False)


@pytest.mark.parametrize("device", DEVICES)
def test_unclamped_ratios_past_fp32_squares_keep_finite_metrics(device):
    """log_clamp null (= 60): ρ² of a token with log ρ = 50 is e^100, past fp32; the partial sums
    then live in fp64 (the 300-example fuzz found chi2_token = inf when they were fp32)."""
    batch = _batch(2, device, t=12)
    batch["rollout"][1, 0] = batch["old"][1, 0] - 50.0
    cfg = op.LossConfig(correction={"log_clamp": None, "weight": {"level": "token", "mode": "truncate", "high": 2.0}})
    assert_same(batch, cfg)
    values = _run(batch, cfg, "triton")[0][-1].to_dict()
    assert math.isfinite(values["offpolicy/chi2_token"]) and values["offpolicy/chi2_token"] > 1e40


@pytest.mark.parametrize("device", DEVICES)
def test_equal_weights_have_no_spread(device, monkeypatch):
    """Every row's weight truncated to 0.1: is_std is 0. From fp32 partial sums of (w − 1)² the
    difference of moments kept ~1e-8 and its square root read 1.7e-4 (the 5000-example fuzz)."""
    monkeypatch.setattr(tk, "BLOCK", None)  # the block size the rung picks, not the tests' 16
    batch = _batch(4, device, t=300)
    cfg = op.LossConfig(correction={"weight": {"level": "geometric", "mode": "truncate", "low": 0.0, "high": 0.1}})
    values = _run(batch, cfg, "triton")[0][-1].to_dict()
    assert values["offpolicy/is_mean"] == pytest.approx(0.1, rel=1e-6)
    assert values["offpolicy/is_std"] < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_global_normalisers_and_max_len(device):
    batch = _batch(3, device)
    assert_same(batch, op.LossConfig(global_tokens=97.0, correction=CORRECTIONS[2]))
    assert_same(batch, op.LossConfig(agg="seq-mean-token-mean", global_seqs=11.0, correction=CORRECTIONS[4]))
    assert_same(batch, op.LossConfig(agg="seq-mean-token-sum-norm", max_len=64, correction=CORRECTIONS[7]))


@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_makes_few_torch_calls_on_the_host(device, monkeypatch):
    """Issue #44: the host work of one Triton forward, its three launches stubbed, counted as torch
    calls (a TorchFunctionMode sees every tensor method, property and factory the rung calls): the
    inputs' shapes, dtypes and strides read once, one workspace and one metrics vector allocated and the
    workspace's parts cut by one ``as_strided`` each (a plan per shape holds the offsets), no ``len()`` of
    a tensor. 43 calls on f7091b3 (slice + view per part, strides read twice, the metrics vector's length
    from a tensor); 27 now (on CUDA the input checks are not read on the host: one fewer)."""
    from collections import Counter

    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls[getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    for kernel in (tk._row_stats, tk._tokens, tk._finish):
        monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: None)
    monkeypatch.setattr(tk, "_check_message", lambda *args: None)  # the stubs leave the checks unwritten
    b = {k: v.to(device) for k, v in random_batch(0).items()}
    cfg = op.LossConfig(correction={"weight": {"level": "token", "mode": "truncate", "high": 2.0}})
    lp = b["logprobs"].detach().requires_grad_(True)
    args = (lp, b["old"], b["adv"], b["mask"], b["rollout"], cfg)
    op.policy_loss(*args, implementation="triton")  # the plan and the shape's layout are made once
    with Count() as count:
        loss, _ = op.policy_loss(*args, implementation="triton")
    assert loss.requires_grad and loss.grad_fn is not None
    calls = count.calls
    assert sum(calls.values()) <= 27 and "__len__" not in calls, dict(calls)
    assert calls["empty"] == 2 and calls["as_strided"] == 3 and calls["stride"] <= 5, dict(calls)


@pytest.mark.parametrize("device", DEVICES)
def test_configs_sharing_a_structure_keep_their_own_bounds(device):
    """Configs alike but for their numbers — a rule's band, the weight's cap, the clip range, the dual clip
    (what a data-chosen bound changes every step) — share one plan structure and differ in their bounds
    vector alone: called in turn, each gives exactly its own result (bit for bit the same on every call,
    also from a fresh config object with the same numbers: one made per call) and the reference's, never a
    neighbour's numbers."""
    batch = _batch(8, device, t=32)

    def config(x: float) -> op.LossConfig:
        return op.LossConfig(clip_low=x / 3, clip_high=x / 3, dual_clip=2 + x, correction={
            "weight": {"level": "token", "mode": "truncate", "high": 1 + x},
            "reject": [{"stat": "k3", "level": "seq_mean", "high": x / 4}, {"stat": "ratio", "level": "token",
                                                                            "low": 1 - x, "high": 1 + 2 * x}]})

    values = (0.3, 0.5)
    plans = [tk._plan(config(x), True) for x in values]
    assert plans[0].structure is plans[1].structure and plans[0].bounds != plans[1].bounds
    first = {}
    for x in (*values, values[0]):
        (loss, metrics), grad = _run(batch, config(x), "triton")
        got = (loss, grad, metrics.to_dict())
        if x not in first:
            first[x] = got
            assert_same(batch, config(x))
        else:
            assert torch.equal(got[0], first[x][0]) and torch.equal(got[1], first[x][1]) and got[2] == first[x][2]
    a, b = (first[x][2] for x in values)
    assert first[0.3][0] != first[0.5][0]  # the bounds bind: a stale vector could not pass unseen
    assert {k for k in a if a[k] != b[k]} >= {"offpolicy/clip_fraction", "offpolicy/masked_fraction",
                                             "offpolicy/fraction_above_high"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["mask_token", "mask_sequence"])
def test_nonfinite_policies_match_the_reference(device, policy):
    """NaN/±inf in every input, in valid tokens and in padding: the rung applies the policy itself."""
    batch = _batch(5, device, b=6)
    batch["old"][0, 3] = float("nan")
    batch["rollout"][2, 1] = float("-inf")
    batch["logprobs"][3, 0] = float("nan")
    batch["adv"][4, 2] = float("inf")
    batch["rollout"][1, -1] = float("nan")  # padding or not: either way the reference and the rung agree
    cfg = op.LossConfig(dual_clip=3.0, correction={"weight": {"level": "sequence", "mode": "truncate", "high": 2.0},
                                                  "reject": [{"stat": "ratio", "level": "any_token", "low": 1e-3}],
                                                  "nonfinite": policy})
    assert_same(batch, cfg)
    assert_same(batch, cfg, reduce=False)


@cpu_only
def test_refusals_on_the_cpu_are_the_references_messages():
    batch = _batch(1, "cpu")
    cfg = op.LossConfig(correction=CORRECTIONS[2])
    bad = dict(batch, old=batch["old"].clone())
    bad["old"][1, 0] = 0.5
    with pytest.raises(ValueError, match=r"old_logprobs has 1 positive log-prob\(s\) on valid tokens .*first at \(1, 0\)"):
        _run(bad, cfg, "triton")
    nan = dict(batch, rollout=batch["rollout"].clone())
    nan["rollout"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="rollout_logprobs has 1 non-finite value"):
        _run(nan, cfg, "triton")
    empty = dict(batch, mask=torch.zeros_like(batch["mask"]))
    with pytest.raises(ValueError, match="no valid token"):
        _run(empty, cfg, "triton")


def test_configurations_outside_the_rung_are_refused_by_name_and_routed_by_auto():
    batch = _batch(2, "cpu")
    for cfg in (op.LossConfig(kind="gspo"), op.LossConfig(correction={"nonfinite": "neutral"}),
                op.LossConfig(correction={"weight": {"level": "token", "mode": "truncate", "high": 2, "normalize": True}}),
                op.LossConfig(correction={"reject": [{"stat": "opsm", "delta": 0.1}]})):
        assert not tk.supports(cfg, None)
        with pytest.raises(ValueError, match="implementation 'triton' does not cover"):
            _run(batch, cfg, "triton")
    assert not tk.preferred(batch["mask"]), "auto must not pick the interpreter on CPU tensors"


@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_inputs_give_gradients_in_their_dtype(device):
    batch = {k: (v.to(torch.bfloat16) if k != "mask" else v) for k, v in _batch(4, device).items()}
    cfg = op.LossConfig(correction=CORRECTIONS[6])
    (ref, ref_grad), (fast, fast_grad) = _run(batch, cfg, "reference"), _run(batch, cfg, "triton")
    assert fast_grad.dtype == torch.bfloat16 and fast[0].dtype == torch.float32
    torch.testing.assert_close(fast_grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-3)


# ------------------------------------------------------------------------------------ GPU only
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the device machine)")


@needs_cuda
def test_auto_takes_the_triton_rung_on_cuda_without_a_host_sync():
    batch = _batch(7, "cuda", t=3000)
    cfg = op.LossConfig(correction=CORRECTIONS[7])
    lp = batch["logprobs"].clone().requires_grad_(True)
    op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"], rollout_logprobs=batch["rollout"], config=cfg)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"], rollout_logprobs=batch["rollout"],
                                       config=cfg)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert "Coef" in type(loss.grad_fn).__name__
    ref, _ = _run(batch, cfg, "reference")
    torch.testing.assert_close(loss, ref[0], rtol=1e-4, atol=1e-6)
    assert math.isclose(metrics.to_dict()["offpolicy/kl_k3"], ref[-1].to_dict()["offpolicy/kl_k3"], rel_tol=1e-4)


@needs_cuda
def test_the_step_is_capturable_in_a_cuda_graph():
    batch = _batch(8, "cuda", t=2048)
    cfg = op.LossConfig(correction=CORRECTIONS[8])
    lp = batch["logprobs"].clone().requires_grad_(True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up on a side stream, as torch.cuda.graphs requires
            lp.grad = None
            loss, _ = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"], rollout_logprobs=batch["rollout"],
                                     config=cfg)
            loss.backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    lp.grad = None
    with torch.cuda.graph(graph):
        loss, metrics = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"],
                                       rollout_logprobs=batch["rollout"], config=cfg)
        loss.backward()
    new = _batch(9, "cuda", t=2048)
    with torch.no_grad():
        for key in ("old", "rollout", "adv", "mask"):
            batch[key].copy_(new[key])
        lp.copy_(new["logprobs"])
    lp.grad.zero_()
    graph.replay()
    ref, ref_grad = _run(new, cfg, "reference")
    torch.testing.assert_close(loss, ref[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert math.isclose(metrics.to_dict()["offpolicy/is_mean"], ref[-1].to_dict()["offpolicy/is_mean"], rel_tol=1e-4)


@needs_cuda
def test_refusals_on_cuda_are_raised_at_the_first_read_of_the_metrics():
    batch = _batch(1, "cuda")
    batch["rollout"][0, 0] = float("nan")
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss, metrics = op.policy_loss(lp, batch["old"], batch["adv"], batch["mask"], rollout_logprobs=batch["rollout"],
                                   config=op.LossConfig(correction=CORRECTIONS[2]), implementation="triton")
    assert torch.isfinite(loss).item(), "the refused token never reaches the loss"
    with pytest.raises(ValueError, match="rollout_logprobs has 1 non-finite value"):
        metrics.to_dict()
