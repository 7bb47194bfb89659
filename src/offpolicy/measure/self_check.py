"""``offpolicy diagnose --self-check``: the trainer against itself, and where the gap enters (issue #56, item 5).

``diagnose`` measures the engine against the trainer; here the trainer is measured against itself on the
engine's tokens. Each comparison scores the same tokens twice and reports the share of tokens whose ratio
π_a/π_b lies outside [0.9, 1.1] (read on the log-ratio, as ``diagnose.fraction_outside``), the share that
differs at all, and the mean and max |Δ log π|:

* ``packing``: the configured forward (each group's prompt computed once, its responses packed behind it, where
  the model allows it) against the same micro-batches of whole rows. The two are equal in exact arithmetic; in
  bf16 the packed sums round differently (issue #67: this was read as micro-batching before).
* ``micro_batch``: whole rows in the configured micro-batches (``--micro-batch-tokens``) against micro-batch 1
  (each row scored alone). π_old must not depend on how rows are grouped; in bf16 it does (verl #6280: 1.8–60 %
  of tokens outside [0.9, 1.1] in bf16, 0 % in fp32).
* ``fp32_head``: the configured precision against the same forward with an fp32 head — the decoder's last
  hidden states as the configured precision gives them, then the head's GEMM and the log-softmax in fp32.
  Identical where the configured precision is fp32 (reported as such). Research harnesses credit an fp32
  head with 27–35 % of the bf16 gap.
* ``fp32``: the configured precision against a whole fp32 forward (the total that precision costs).

**Per-layer attribution** (``layers``): the engine's precision (``--engine-dtype``: bf16 weights, as the hf
engine loads them) against fp32, on the engine's sequences (prompt + response), layer by layer through
``output_hidden_states``:

    d_l = ‖h_l^engine − h_l^fp32‖_F / ‖h_l^fp32‖_F     over the sequences' real positions

for the embedding (l = 0), each decoder layer, and the final norm (the last hidden state). The report names
the first layer with d_l above ``DIVERGED`` (1 %) and the layer with the largest step d_l − d_{l−1} (where
the gap grows most; an RMSNorm cast such as verl-omni #637 shows there), and the sampled tokens' mean and
max |Δ log π| at the head (full vocabulary at the sampling temperature). All norms are taken in fp32.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from offpolicy.policy.batch import Batch
from offpolicy.policy.score import Scorer, load_policy, precision, widen

BAND = (0.9, 1.1)
DIVERGED = 0.01  # d_l above which a layer counts as diverged


def compare(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Two scorings ``[B, T]`` of the same tokens on ``mask`` (tokens where either is not finite are left
    out and counted): the share with π_a/π_b outside ``BAND``, the share that differs, mean/max |Δ log π|."""
    valid = mask.bool() & torch.isfinite(a) & torch.isfinite(b)
    n = max(int(valid.sum()), 1)
    d = torch.where(valid, a.double() - b.double(), 0.0)
    outside = valid & ((d < math.log(BAND[0])) | (d > math.log(BAND[1])))
    return {"tokens": int(valid.sum()), "not_finite": int((mask.bool() & ~valid).sum()),
            "fraction_outside_0.9_1.1": float(outside.sum()) / n, "fraction_differing": float((d != 0).sum()) / n,
            "abs_log_diff_mean": float(d.abs().sum()) / n, "abs_log_diff_max": float(d.abs().max())}


@torch.no_grad()
def fp32_head_score(scorer: Scorer, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(configured head, fp32 head) log π ``[B, T]`` fp32 on the CPU, both from the same decoder hidden
    states (computed under the configured precision, the configured micro-batches), so their difference
    is the head's alone."""
    from offpolicy.policy.head import (
        counted_positions,
        decoder_hidden,
        linear_head,
        per_token,
        replayed_sets,
        token_logprobs,
    )

    width = batch.mask.shape[1]
    configured, full = torch.zeros(batch.mask.shape), torch.zeros(batch.mask.shape)
    head = linear_head(scorer.model)
    for part in scorer.micro_batches(batch, torch.arange(len(batch.mask))):
        mb = scorer.to_device(batch, part)
        r, c = counted_positions(mb)
        kept = replayed_sets(mb, scorer.sampling, r, c)
        tokens = mb.response_ids[r, c]
        with precision(scorer.device, scorer.dtype):
            hidden = decoder_hidden(scorer.model, mb.input_ids, mb.attention_mask)[r, mb.positions[r, c]]
            lp_configured = token_logprobs(hidden, tokens, head, scorer.sampling, kept=kept).logprobs
        with torch.autocast(scorer.device.type, enabled=False):
            fp32_head = replace(head, weight=head.weight.float(), bias=None if head.bias is None else head.bias.float())
            lp_fp32 = token_logprobs(hidden.float(), tokens, fp32_head, scorer.sampling, kept=kept).logprobs
        for out, lp in ((configured, lp_configured), (full, lp_fp32)):
            out[part.rows] = widen(per_token(lp.float(), mb.mask, r, c).cpu(), width)
    return configured, full


def trainer_against_itself(scorer: Scorer, batch: Batch) -> dict[str, Any]:
    """The three comparisons of the module doc on ``batch`` (CPU), under ``scorer``'s configuration."""
    mask = batch.mask
    configured = scorer.score(batch).logprobs.float().cpu()
    # a row longer than the budget goes alone (whole rows: by packs, a budget of 1 would leave each pack whole)
    one = replace(scorer, budget=1, by_packs=False, packs=False).score(batch).logprobs.float().cpu()
    unpacked = replace(scorer, packs=False).score(batch).logprobs.float().cpu()  # the same micro-batches, whole rows
    rows = replace(scorer, packs=False, by_packs=False).score(batch).logprobs.float().cpu()  # micro-batches of whole rows
    out: dict[str, Any] = {"configured": {"dtype": scorer.dtype, "micro_batch_tokens": scorer.budget,
                                          "micro_batches": len(scorer.micro_batches(batch, torch.arange(len(mask))))},
                           "packing": {"against": "the same micro-batches of whole rows",
                                       **compare(configured, unpacked, mask)},
                           "micro_batch": {"against": "micro-batch 1 (each row alone), whole rows both",
                                           **compare(rows, one, mask)}}
    if scorer.dtype == "fp32":
        same = "the configured precision is fp32: identical by construction"
        out["fp32_head"] = {"against": same}
        out["fp32"] = {"against": same}
    else:
        head_configured, head_fp32 = fp32_head_score(scorer, batch)
        out["fp32_head"] = {"against": f"the same {scorer.dtype} decoder with an fp32 head",
                            **compare(head_configured, head_fp32, mask)}
        fp32 = replace(scorer, dtype="fp32").score(batch).logprobs.float().cpu()
        out["fp32"] = {"against": "a whole fp32 forward", **compare(configured, fp32, mask)}
    return out


@torch.no_grad()
def layer_attribution(model_path, batch: Batch, engine_dtype: str, device: torch.device,
                      temperature: float = 1.0, rows: int | None = 16) -> dict[str, Any]:
    """Per-layer relative difference of the ``engine_dtype`` forward (weights in that dtype) against the fp32
    one (module doc), on the first ``rows`` sequences of ``batch`` (None: all), one sequence at a time (the
    logits of one row at a time: memory flat in the rows)."""
    from transformers import AutoModelForCausalLM

    if engine_dtype == "fp32":
        return {"engine_dtype": "fp32", "note": "the engine's precision is fp32: nothing to attribute", "layers": []}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    models = {"fp32": load_policy(model_path, device).eval(),
              "engine": AutoModelForCausalLM.from_pretrained(model_path, dtype=dtypes[engine_dtype]).to(device).eval()}
    take = len(batch.mask) if rows is None else min(rows, len(batch.mask))
    diff_sq: list[float] = []
    ref_sq: list[float] = []
    deltas = []
    for i in range(take):
        real = int(batch.attention_mask[i].sum())  # right-padded: the sequence's first ``real`` positions
        ids = batch.input_ids[i : i + 1, :real].to(device)
        hidden, logprob = {}, {}
        t = batch.mask[i].bool()
        positions, tokens = batch.positions[i][t].to(device), batch.response_ids[i][t].to(device)
        for name, model in models.items():
            out = model(input_ids=ids, output_hidden_states=True)
            hidden[name] = [h[0].float() for h in out.hidden_states]  # [real, H] each
            logits = out.logits[0, positions].float() / temperature  # [n, V]: the response tokens' logits
            logprob[name] = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        if not diff_sq:
            diff_sq, ref_sq = [0.0] * len(hidden["fp32"]), [0.0] * len(hidden["fp32"])
        for layer, (ref, eng) in enumerate(zip(hidden["fp32"], hidden["engine"])):
            diff_sq[layer] += float(torch.linalg.vector_norm(eng - ref, dtype=torch.float64) ** 2)
            ref_sq[layer] += float(torch.linalg.vector_norm(ref, dtype=torch.float64) ** 2)
        deltas.append((logprob["engine"] - logprob["fp32"]).double().cpu())
    layers, previous, n = [], 0.0, len(diff_sq)
    for layer in range(n):
        d = math.sqrt(diff_sq[layer]) / max(math.sqrt(ref_sq[layer]), 1e-30)
        label = "embedding" if layer == 0 else f"layer {layer}" + (" + final norm" if layer == n - 1 else "")
        layers.append({"layer": label, "index": layer, "relative_difference": d, "step": d - previous})
        previous = d
    first = next((row["layer"] for row in layers if row["relative_difference"] > DIVERGED), None)
    largest = max(layers[1:] or layers, key=lambda row: row["step"])["layer"] if layers else None
    d = torch.cat(deltas) if deltas else torch.zeros(0, dtype=torch.float64)
    head = {"tokens": int(d.numel()),
            "abs_log_diff_mean": float(d.abs().mean()) if d.numel() else math.nan,
            "abs_log_diff_max": float(d.abs().max()) if d.numel() else math.nan,
            "fraction_outside_0.9_1.1": float(((d < math.log(BAND[0])) | (d > math.log(BAND[1]))).double().mean())
            if d.numel() else math.nan}
    return {"engine_dtype": engine_dtype, "rows": take, "threshold": DIVERGED, "first_above_threshold": first,
            "largest_step": largest, "layers": layers, "head": head}


def run(batch: Batch, scorer: Scorer, model_path, engine_dtype: str, temperature: float = 1.0) -> dict[str, Any]:
    """``diagnose --self-check``'s section of report.json: ``trainer`` (the comparisons) and ``layers``."""
    return {"trainer": trainer_against_itself(scorer, batch),
            "layers": layer_attribution(model_path, batch, engine_dtype, scorer.device, temperature)}
