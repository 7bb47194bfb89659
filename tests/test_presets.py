"""Each preset reproduces its framework's loss. The references below are independent, literal
transcriptions of each framework's formula (as described in docs/specification.md §9 and the preset notes), not
calls into offpolicy; a preset passes only if our loss and gradient equal theirs."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from conftest import random_batch

LN = math.log


def masked_mean(x, m, dim=None):
    return (x * m).sum() / m.sum() if dim is None else (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def ppo_terms(lp, old, adv, eps=0.2, dual=None):
    ratio = torch.exp((lp - old).clamp(-20, 20))
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    if dual is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual), loss)
    return loss


def verl_weight(b, level, cap):
    lr = (b["old"] - b["rollout"]).clamp(-20, 20) * b["mask"]
    if level == "sequence":
        lr = lr.sum(-1, keepdim=True).clamp(-20, 20)
    return torch.exp(lr).clamp(max=cap).expand_as(lr if level == "token" else b["mask"]) * b["mask"]


def ref_verl_token_is(lp, b):
    loss = ppo_terms(lp, b["old"], b["adv"], dual=3.0) * verl_weight(b, "token", 2.0)
    return masked_mean(loss, b["mask"])


def ref_verl_seq_is(lp, b):
    loss = ppo_terms(lp, b["old"], b["adv"], dual=3.0) * verl_weight(b, "sequence", 2.0)
    return masked_mean(loss, b["mask"])


def ref_verl_seq_is_rs(lp, b):
    k1 = (b["rollout"] - b["old"]) * b["mask"]  # verl's k1 = −log(π_old/μ)
    keep = ((k1.sum(-1) >= LN(0.5)) & (k1.sum(-1) <= LN(2.0))).float().unsqueeze(-1)
    mask = b["mask"] * keep  # rejection edits the response mask
    loss = ppo_terms(lp, b["old"], b["adv"], dual=3.0) * verl_weight({**b, "mask": mask}, "sequence", 2.0)
    return masked_mean(loss, mask)


def ref_verl_geo_rs(lp, b):
    k1 = masked_mean(b["rollout"] - b["old"], b["mask"], dim=-1)
    keep = ((k1 >= LN(0.999)) & (k1 <= LN(1.001))).float().unsqueeze(-1)
    mask = b["mask"] * keep
    return masked_mean(ppo_terms(lp, b["old"], b["adv"], dual=3.0), mask)


def ref_verl_icepop(lp, b):
    rho = torch.exp((b["old"] - b["rollout"]).clamp(-20, 20))
    w = rho * ((rho >= 0.5) & (rho <= 5.0))
    return masked_mean(ppo_terms(lp, b["old"], b["adv"], dual=3.0) * w, b["mask"])  # mask unchanged


def ref_verl_bypass_ppo_clip(lp, b):
    return masked_mean(ppo_terms(lp, b["rollout"], b["adv"], dual=3.0), b["mask"])


def ref_verl_bypass_pg_is(lp, b):
    lr = ((lp.detach() - b["rollout"]) * b["mask"]).sum(-1, keepdim=True).clamp(-20, 20)
    w = torch.exp(lr).clamp(max=2.0)
    return masked_mean(-b["adv"] * lp * w, b["mask"])


def trl_ratio(b, level):
    diff = (b["old"] - b["rollout"]) * b["mask"]  # no clamp
    if level == "sequence":
        diff = diff.sum(-1, keepdim=True)
    return torch.exp(diff)


def ref_trl(level, mode):
    def ref(lp, b):
        is_ratio = trl_ratio(b, level)
        if mode == "truncate":
            is_ratio = torch.clamp(is_ratio, max=3.0)
        else:
            is_ratio = is_ratio.masked_fill(is_ratio > 3.0, 0.0)
        coef_1 = torch.exp(lp - b["old"])
        coef_2 = torch.clamp(coef_1, 0.8, 1.2)
        per_token = -torch.min(coef_1 * b["adv"], coef_2 * b["adv"]) * is_ratio
        return (per_token * b["mask"]).sum() / b["mask"].sum()
    return ref


def ref_openrlhf(kind):
    def ref(lp, b):
        log_ratio = b["old"] - b["rollout"]
        loss = ppo_terms(lp, b["old"], b["adv"])
        if kind == "tis":
            loss = loss * torch.exp(log_ratio).clamp(0.5, 5.0)
        elif kind == "icepop":
            vllm_is = torch.exp(log_ratio)
            loss = loss * vllm_is * ((vllm_is >= 0.5) & (vllm_is <= 5.0))
        else:  # seq-mask-tis
            seq_is = torch.exp(masked_mean(log_ratio, b["mask"], dim=-1))
            seq_mask = ((seq_is >= 0.5) & (seq_is <= 5.0)).float().unsqueeze(-1)
            loss = seq_mask * torch.exp(log_ratio) * loss
        return masked_mean(loss, b["mask"])
    return ref


def ref_skyrl_token_tis(lp, b):
    w = torch.exp((b["old"] - b["rollout"]).clamp(-20, 20)).clamp(max=2.0)
    return (ppo_terms(lp, b["old"], b["adv"]) * w * b["mask"]).sum() / b["mask"].sum()


def ref_skyrl_geometric(lp, b):
    geo = torch.exp(masked_mean((b["old"] - b["rollout"]).clamp(-20, 20), b["mask"], dim=-1))
    keep = ((geo >= 0.99) & (geo <= 1.01)).float().unsqueeze(-1)
    return (ppo_terms(lp, b["old"], b["adv"]) * keep * b["mask"]).sum() / b["mask"].sum()  # fixed denominator


def ref_slime_current(lp, b):
    w = torch.exp((lp.detach() - b["rollout"]).clamp(-20, 20)).clamp(0.8, 1.2)
    per_row = ((-w * b["adv"] * lp) * b["mask"]).sum(-1) / b["mask"].sum(-1).clamp(min=1)
    return per_row[b["mask"].sum(-1) > 0].mean()


REFERENCES = {
    "verl:decoupled_token_is": ref_verl_token_is,
    "verl:tis_imp_ratio_cap": ref_verl_token_is,
    "verl:decoupled_seq_is": ref_verl_seq_is,
    "verl:decoupled_seq_is_rs": ref_verl_seq_is_rs,
    "verl:decoupled_geo_rs": ref_verl_geo_rs,
    "verl:decoupled_token_icepop": ref_verl_icepop,
    "verl:bypass_ppo_clip": ref_verl_bypass_ppo_clip,
    "verl:bypass_pg_is": ref_verl_bypass_pg_is,
    "trl:token_truncate": ref_trl("token", "truncate"),
    "trl:token_mask": ref_trl("token", "mask"),
    "trl:sequence_truncate": ref_trl("sequence", "truncate"),
    "trl:sequence_mask": ref_trl("sequence", "mask"),
    "openrlhf:tis": ref_openrlhf("tis"),
    "openrlhf:icepop": ref_openrlhf("icepop"),
    "openrlhf:seq-mask-tis": ref_openrlhf("seq-mask-tis"),
    "skyrl:token_tis": ref_skyrl_token_tis,
    "skyrl:geometric_mask": ref_skyrl_geometric,
    "slime:current": ref_slime_current,
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("seed, noise", [(0, 0.02), (1, 0.3), (2, 1.0), (3, 0.004)])
def test_preset_reproduces_framework_loss(name, seed, noise):
    b = random_batch(seed=seed, b=8, t=12, noise=noise)
    lp_ours = b["logprobs"].clone().requires_grad_(True)
    lp_ref = b["logprobs"].clone().requires_grad_(True)
    ours, _ = op.policy_loss(lp_ours, b["old"], b["adv"], b["mask"], rollout_logprobs=b["rollout"],
                             config=op.LossConfig.from_preset(name))
    theirs = REFERENCES[name](lp_ref, b)
    ours.backward()
    if math.isnan(theirs.item()):
        # every token rejected: verl divides 0/0; docs/specification.md §9 has us return a zero loss and gradient
        assert ours.item() == 0.0 and lp_ours.grad.abs().max() == 0.0
        return
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad, rtol=1e-5, atol=1e-7)


def test_references_are_not_vacuous():
    # with real mismatch the corrections must disagree with each other, or the test above is weak
    b = random_batch(seed=1, b=8, t=12, noise=0.3)
    values = {name: ref(b["logprobs"].clone(), b).item() for name, ref in REFERENCES.items()}
    assert len({round(v, 6) for v in values.values()}) >= 8


def test_trl_sequence_product_is_unclamped_but_finite():
    # a long completion whose summed log-ratio is 100: TRL computes exp(100) = inf; we cap at exp(60) (ops.FP32_EXP_LIMIT)
    mask = torch.ones(1, 50)
    old = torch.full((1, 50), -1.0)
    rollout = old - 2.0  # log ρ = 2 per token, Σ = 100
    w = op.correct(old, rollout, mask, op.CorrectionConfig.from_preset("trl:sequence_truncate")).weights
    assert (w == 3.0).all()  # min(inf, 3) = 3 in TRL too
    raw = op.correct(old, rollout, mask, {"weight": {"level": "sequence", "mode": "truncate"}, "log_clamp": None})
    assert torch.isfinite(raw.weights).all() and raw.weights[0, 0].item() == pytest.approx(math.exp(60.0), rel=1e-4)
    verl = op.correct(old, rollout, mask, {"weight": {"level": "sequence", "mode": "truncate"}})
    assert verl.weights[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)


def test_skyrl_sequential_order_matters():
    # outlier → token mask → sequence mask: the product is taken over the tokens that survived
    mask = torch.ones(1, 3)
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = old - torch.tensor([[LN(1.5), LN(1.5), LN(3.0)]])  # ρ = [1.5, 1.5, 3]
    rules = [{"stat": "ratio", "level": "token", "low": 0.5, "high": 2.0},
             {"stat": "ratio", "level": "sequence", "low": 0.5, "high": 2.5}]
    seq = op.correct(old, rollout, mask, {"reject": rules, "reject_mode": "sequential"})
    ind = op.correct(old, rollout, mask, {"reject": rules, "reject_mode": "independent"})
    assert seq.mask.tolist() == [[1.0, 1.0, 0.0]]  # Π over survivors = 2.25 ∈ band
    assert ind.mask.tolist() == [[0.0, 0.0, 0.0]]  # Π over all = 6.75 ∉ band


def test_every_preset_has_a_note_summary_and_valid_configs():
    names = op.presets.names()
    assert names[0] == "recommended"
    frameworks = {n.split(":")[0].split("@")[0] for n in names if ":" in n}  # prime-rl@<commit>: an older form
    assert frameworks == {"verl", "trl", "skyrl", "openrlhf", "slime", "areal", "nemorl", "roll", "prime-rl"}
    for name in names:
        preset = op.presets.get(name)
        assert preset.summary and len(preset.note) > 40
        op.LossConfig.from_preset(name)
        assert op.CorrectionConfig.from_preset(name) == preset.correction_config()


def test_spec_modes_are_all_there():
    expected = {
        "verl:decoupled_token_is", "verl:decoupled_seq_is", "verl:decoupled_seq_is_rs", "verl:decoupled_geo_rs",
        "verl:decoupled_token_icepop", "verl:bypass_ppo_clip", "verl:bypass_pg_is", "verl:tis_imp_ratio_cap",
        "trl:token_truncate", "trl:token_mask", "trl:sequence_truncate", "trl:sequence_mask",
        "skyrl:token_tis", "skyrl:sequence_tis", "skyrl:geometric_mask", "skyrl:product_mask", "skyrl:outlier_mask",
        "skyrl:token_mask", "openrlhf:tis", "openrlhf:icepop", "openrlhf:seq-mask-tis", "openrlhf:binary-kl",
        "slime:tis", "slime:icepop", "slime:current", "recommended",
    }
    assert expected <= set(op.presets.names())


def test_unknown_preset_suggests():
    with pytest.raises(op.ConfigError, match=r"unknown preset 'verl:decoupled_tokn_is'. Did you mean 'verl:decoupled_token_is'"):
        op.presets.get("verl:decoupled_tokn_is")


def test_preset_quirks_are_documented():
    assert "unclamped" in op.presets.get("openrlhf:seq-mask-tis").note
    assert "no clamp" in op.presets.get("trl:sequence_truncate").note or "unclamped" in op.presets.get(
        "trl:sequence_truncate").note
    assert "dual" in op.presets.get("verl:decoupled_token_is").loss.__repr__() or \
        op.LossConfig.from_preset("verl:decoupled_token_is").dual_clip == 3.0
