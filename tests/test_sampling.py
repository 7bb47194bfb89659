"""renormalize_logprobs against a brute-force reference written from docs/specification.md §6's definition."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import offpolicy as op


def brute_force(logits: list[float], top_p: float, top_k: int, temperature: float) -> tuple[list[float], float]:
    """One row, plain Python: temperature, then top-k (ties kept), then top-p (crossing token kept)."""
    z = (torch.tensor(logits).float() / temperature).double().tolist()  # the same fp32 rounding
    kept = set(range(len(z)))
    if 0 < top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        kept = {i for i in kept if z[i] >= kth}
    if top_p < 1.0:
        norm = sum(math.exp(z[i]) for i in kept)
        mass = 0.0
        nucleus = set()
        for i in sorted(kept, key=lambda i: -z[i]):
            if mass >= top_p and nucleus:
                break
            nucleus.add(i)
            mass += math.exp(z[i]) / norm
        kept = nucleus
    log_norm = math.log(sum(math.exp(z[i]) for i in kept))
    full_norm = sum(math.exp(v) for v in z)
    out = [z[i] - log_norm if i in kept else -math.inf for i in range(len(z))]
    outside = 1.0 - sum(math.exp(z[i]) for i in kept) / full_norm
    return out, outside


@given(st.lists(st.integers(-600, 600).map(lambda i: i / 100), min_size=2, max_size=12, unique=True),
       st.sampled_from([1.0, 0.95, 0.7, 0.3, 0.05]), st.sampled_from([-1, 1, 2, 5, 50]), st.sampled_from([0.5, 1.0, 1.7]))
def test_matches_brute_force(logits, top_p, top_k, temperature):
    expected, outside = brute_force(logits, top_p, top_k, temperature)
    got, got_outside = op.renormalize_logprobs(torch.tensor([logits]), top_p=top_p, top_k=top_k,
                                               temperature=temperature, return_outside_mass=True)
    got = got[0].tolist()
    for g, e in zip(got, expected):
        if e == -math.inf:
            assert g == -math.inf
        else:
            assert g == pytest.approx(e, abs=1e-5)
    assert got_outside.item() == pytest.approx(outside, abs=1e-5)


def test_hand_case():
    # probs ∝ [4, 3, 2, 1] (logits = log of them): top_p 0.6 keeps 4 and 3 (0.4 < 0.6, then 0.7 ≥ 0.6)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]]).log()
    lp, outside = op.renormalize_logprobs(logits, top_p=0.6, return_outside_mass=True)
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([4 / 7, 3 / 7]))
    assert torch.isinf(lp[0, 2:]).all()
    assert outside.item() == pytest.approx(0.3)
    # top_k 3 keeps 4, 3, 2 → renormalised by 9
    torch.testing.assert_close(op.renormalize_logprobs(logits, top_k=3)[0, :3].exp(), torch.tensor([4 / 9, 3 / 9, 2 / 9]))


def test_no_truncation_is_log_softmax_and_batched_shapes_work():
    logits = torch.randn(2, 3, 11)
    torch.testing.assert_close(op.renormalize_logprobs(logits, temperature=0.8), torch.log_softmax(logits / 0.8, -1))


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        op.renormalize_logprobs(torch.zeros(1, 3), temperature=0.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        op.renormalize_logprobs(torch.zeros(1, 3), top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be -1"):
        op.renormalize_logprobs(torch.zeros(1, 3), top_k=0)


def test_outside_mass_metrics_merge_to_the_whole_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, 11, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    _, outside = op.renormalize_logprobs(logits, top_p=0.7, top_k=6, return_outside_mass=True)
    whole = op.outside_mass_metrics(outside, mask).to_dict()
    halves = op.outside_mass_metrics(outside[:2], mask[:2])
    halves.update(op.outside_mass_metrics(outside[2:], mask[2:]))
    got = halves.to_dict()
    assert whole["offpolicy/outside_mass"] == pytest.approx(outside[mask.bool()].double().mean().item(), rel=1e-9)
    assert 0 < whole["offpolicy/outside_mass"] < whole["offpolicy/outside_mass_max"] < 1
    assert got == pytest.approx(whole, rel=1e-12)


def test_tied_probabilities_at_the_top_p_cut_keep_the_larger_token_id():
    """Issue #43: ties at the cut are broken by token id, the larger first — the order of the stable
    ascending sort vLLM's and transformers' top-p take. probs [0.4, 0.2, 0.2, 0.2], p = 0.5: 0.4, then one
    of the three tied 0.2s (mass above it 0.4 < 0.5); the next has 0.6 above it. The kept one is id 3."""
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2]]).log()
    lp = op.renormalize_logprobs(logits, top_p=0.5)
    assert torch.isfinite(lp[0]).tolist() == [True, False, False, True]
    # float64 too, and behind a top-k that keeps every tie (z ≥ the k-th largest)
    lp64 = op.renormalize_logprobs(torch.tensor([[0.1, 0.2, 0.2, 0.2, 0.3]], dtype=torch.float64).log(), top_p=0.6,
                                   top_k=2)
    assert torch.isfinite(lp64[0]).tolist() == [False, False, True, True, True]  # top-k keeps all three 0.2s
    # renormalised over those four, mass above: id 4 → 0, id 3 → 0.3/0.9, id 2 → 0.5/0.9 < 0.6, id 1 → 0.7/0.9
    # the rule does not depend on where the ties sit in the vocabulary
    wide = torch.full((1, 1000), -30.0)
    wide[0, [17, 500, 998]] = 0.0
    kept = torch.isfinite(op.renormalize_logprobs(wide, top_p=0.5))[0].nonzero().flatten().tolist()
    assert kept == [500, 998]


# ---------------------------------------------------------------- the sampling contract (issue #57 item 3)
BAD = [("temperature", 0.0), ("temperature", -1.0), ("temperature", float("nan")), ("temperature", float("inf")),
       ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_k", 0), ("top_k", -2), ("min_p", -0.1),
       ("min_p", 1.0), ("min_p", float("nan"))]
GOOD = [("temperature", 0.1), ("temperature", 1.7), ("top_p", 1e-3), ("top_p", 1.0), ("top_k", -1), ("top_k", 1),
        ("top_k", 50), ("min_p", 0.0), ("min_p", 0.05), ("min_p", 0.99)]


def _every_place(key: str, value):
    """Each place that takes a sampling value: the contract itself, train's key=value, diagnose's flags and
    the trainer-side renormalisation. Returns the errors, one per place (None where it accepted)."""
    from offpolicy.measure.diagnose_config import DiagnoseConfig
    from offpolicy.core.sampling import SamplingConfig
    from offpolicy.train.config import load_train_config

    errors = []
    for build in (lambda: SamplingConfig(**{key: value}),
                  lambda: load_train_config(None, [f"sampling.{key}={value}"]),
                  lambda: DiagnoseConfig(**{key: value}),
                  lambda: op.renormalize_logprobs(torch.zeros(1, 3), **{key: value})):
        try:
            build()
            errors.append(None)
        except ValueError as err:  # ConfigError is one
            errors.append(str(err))
    return errors


@pytest.mark.parametrize(("key", "value"), BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_every_place_refuses_a_value_against_its_rule_with_the_rule(key, value):
    """One rule a key (sampling.RULES), checked the same way wherever a value enters: on 65ba3dd train took
    top_k=0 (its field allowed ≥ -1) and failed only in the first step's renormalisation, after the model
    loaded, while diagnose refused it up front."""
    from offpolicy.core.sampling import RULES

    errors = _every_place(key, value)
    assert all(errors), errors
    # the rule, in the refusal's words, everywhere (train's sampling section states it for non-finite values too)
    assert all(RULES[key][1] in e for e in errors), errors
    assert f"sampling.{key}" in errors[1]  # train names the dotted key
    assert f"--{key.replace('_', '-')} " in errors[2]  # diagnose names the flag


@pytest.mark.parametrize(("key", "value"), GOOD, ids=[f"{k}={v}" for k, v in GOOD])
def test_every_place_takes_a_value_its_rule_allows(key, value):
    assert _every_place(key, value) == [None] * 4


def test_train_and_diagnose_sampling_is_the_contract():
    from offpolicy.measure.diagnose_config import DiagnoseConfig
    from offpolicy.core.sampling import SamplingConfig
    from offpolicy.train.config import load_train_config

    cfg = load_train_config(None, ["sampling.temperature=0.7", "sampling.top_p=0.9", "sampling.top_k=5", "sampling.max_tokens=12"])
    assert cfg.sampling_config() == SamplingConfig(max_tokens=12, temperature=0.7, top_p=0.9, top_k=5)
    assert DiagnoseConfig(max_tokens=9, top_k=3).sampling_config() == SamplingConfig(max_tokens=9, top_k=3)
    with pytest.raises(op.ConfigError, match="unknown key 'topk'"):
        SamplingConfig(topk=3)


@pytest.mark.parametrize(("top_k", "top_p", "truncates"), [(-1, 1.0, False), (1, 1.0, True), (50, 1.0, True),
                                                             (-1, 0.99, True), (3, 0.5, True)])
def test_truncates_is_top_k_on_or_top_p_below_one(top_k, top_p, truncates):
    """The one answer to "is the support truncated?" (head.py said top_k != -1, hf.py top_k > 0 on 65ba3dd:
    the same only because 0 is refused). Where it says no, the trainer's renormalised log-probs are the
    plain log-softmax and nothing lies outside the support."""
    from offpolicy.core.sampling import SamplingConfig

    sampling = SamplingConfig(top_k=top_k, top_p=top_p, temperature=0.8)
    assert sampling.truncates is truncates
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(top_k + 7))
    lp, outside = op.renormalize_logprobs(logits, top_p=top_p, top_k=top_k, temperature=0.8, return_outside_mass=True)
    if not truncates:
        torch.testing.assert_close(lp, torch.log_softmax(logits / 0.8, -1))
        assert torch.equal(outside, torch.zeros(4))
    else:
        assert torch.isinf(lp).any() and (outside > 0).all()



# ---------------------------------------------------------------- min-p (issue #69 item 5)
def brute_force_min_p(logits: list[float], top_p: float, top_k: int, temperature: float, min_p: float, order: str
                      ) -> list[float]:
    """One row, plain Python, each engine's order: vLLM (min_p_first) applies min-p to the whole distribution,
    then top-k and top-p over what is left; transformers (min_p_last) top-k, top-p, then min-p."""
    z = (torch.tensor(logits).float() / temperature).double().tolist()

    def probs(kept):
        norm = sum(math.exp(z[i]) for i in kept)
        return {i: math.exp(z[i]) / norm for i in kept}

    def min_p_cut(kept):
        p = probs(kept)
        top = max(p.values())
        return {i for i in kept if p[i] >= min_p * top}

    def top_k_cut(kept):
        if not 0 < top_k < len(z):
            return kept
        kth = sorted((z[i] for i in kept), reverse=True)[min(top_k, len(kept)) - 1]
        return {i for i in kept if z[i] >= kth}

    def top_p_cut(kept):
        if top_p >= 1.0:
            return kept
        p, mass, nucleus = probs(kept), 0.0, set()
        for i in sorted(kept, key=lambda i: -z[i]):
            if mass >= top_p and nucleus:
                break
            nucleus.add(i)
            mass += p[i]
        return nucleus

    kept = set(range(len(z)))
    steps = [min_p_cut, top_k_cut, top_p_cut] if order == "min_p_first" else [top_k_cut, top_p_cut, min_p_cut]
    for step in steps:
        kept = step(kept)
    log_norm = math.log(sum(math.exp(z[i]) for i in kept))
    return [z[i] - log_norm if i in kept else -math.inf for i in range(len(z))]


@given(st.lists(st.integers(-600, 600).map(lambda i: i / 100), min_size=2, max_size=12, unique=True),
       st.sampled_from([1.0, 0.95, 0.7, 0.3]), st.sampled_from([-1, 2, 5]), st.sampled_from([0.5, 1.0, 1.7]),
       st.sampled_from([0.0, 0.01, 0.1, 0.4, 0.9]), st.sampled_from(["min_p_first", "min_p_last"]))
def test_min_p_matches_brute_force_in_each_order(logits, top_p, top_k, temperature, min_p, order):
    expected = brute_force_min_p(logits, top_p, top_k, temperature, min_p, order)
    got = op.renormalize_logprobs(torch.tensor([logits]), top_p=top_p, top_k=top_k, temperature=temperature,
                                  min_p=min_p, min_p_order=order)[0].tolist()
    for g, e in zip(got, expected):
        assert (g == -math.inf) if e == -math.inf else g == pytest.approx(e, abs=1e-5)


def test_min_p_hand_case_where_the_orders_differ():
    # probs [0.5, 0.3, 0.15, 0.05], min_p 0.2 (cut at 0.1: drops 0.05), top_p 0.83:
    # vLLM (first): min-p leaves [.5, .3, .15]/.95 = [.526, .316, .158]; mass above the third = .842 ≥ .83 → {0, 1}
    # transformers (last): top-p on the whole: mass above the third = .8 < .83 → {0, 1, 2}; min-p keeps all three
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    first = op.renormalize_logprobs(logits, top_p=0.83, min_p=0.2, min_p_order="min_p_first")[0]
    last = op.renormalize_logprobs(logits, top_p=0.83, min_p=0.2, min_p_order="min_p_last")[0]
    torch.testing.assert_close(first[:2].exp(), torch.tensor([0.5 / 0.8, 0.3 / 0.8]))
    assert torch.isinf(first[2:]).all()
    torch.testing.assert_close(last[:3].exp(), torch.tensor([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]))
    assert torch.isinf(last[3])
    # min-p alone: either order, the 0.05 token goes and the rest renormalise by 0.95
    alone = op.renormalize_logprobs(logits, min_p=0.2, return_outside_mass=True)
    torch.testing.assert_close(alone[0][0, :3].exp(), torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    assert alone[1].item() == pytest.approx(0.05)
    with pytest.raises(ValueError, match="min_p_order"):
        op.renormalize_logprobs(logits, min_p=0.2, min_p_order="sideways")


def test_min_p_truncates_and_reaches_each_engines_request():
    from offpolicy.core.sampling import SamplingConfig
    from offpolicy.engines import min_p_order
    from offpolicy.engines.server import completion_body, sglang_generate_body
    from offpolicy.measure.diagnose_config import DiagnoseConfig
    from offpolicy.train.config import load_train_config

    sampling = SamplingConfig(min_p=0.1)
    assert sampling.truncates and not SamplingConfig().truncates
    assert completion_body("m", [1, 2], sampling, seed=0)["min_p"] == 0.1
    assert sglang_generate_body([1, 2], sampling, seed=0)["sampling_params"]["min_p"] == 0.1
    assert (min_p_order("vllm"), min_p_order("hf"), min_p_order("sglang")) == ("min_p_first", "min_p_last",
                                                                                "min_p_last")
    assert load_train_config(None, ["sampling.min_p=0.05"]).sampling.min_p == 0.05
    assert DiagnoseConfig(min_p=0.05, engine="vllm").sampling_config().min_p_order == "min_p_first"
    assert DiagnoseConfig(min_p=0.05, engine="hf").sampling_config().min_p_order == "min_p_last"
    # engine auto: each setting's engine, once resolved on the model, sets the order it samples with
    assert DiagnoseConfig(min_p=0.05).sampling_config(engine="hf").min_p_order == "min_p_last"
