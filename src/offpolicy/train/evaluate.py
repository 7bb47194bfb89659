"""The held-out eval of ``offpolicy train`` and the rules read off it (issue #54).

Every ``eval_every`` steps (and at the last step) the trainer's own weights answer the eval set
greedily. For a task with a held-out split (``task=larger``, ``count``, ``dataset``) ``evaluate``
logs, over the first ``eval_problems`` held-out prompts:

* ``eval/accuracy`` — the mean reward of the greedy answers (the task's own reward, partial credit
  included; the name is kept from the synthetic tasks, where it is exact match);
* ``eval/truncated_share`` — the share of greedy answers cut by ``max_new_tokens`` before their stop
  token, and ``eval/response_length`` — their mean length in tokens (the stop token counted), which
  show a length blow-up before the reward does;
* ``eval/answer_logprob`` — the teacher-forced log-probability of the exact answer (its tokens and the
  stop token after the prompt), summed over the answer's tokens and averaged over the prompts, and
  ``eval/answer_logprob_token`` — the same per token (the mean over all the answers' tokens). It moves
  smoothly where the greedy reward moves in steps: a policy that drifts from the right answer loses
  log-probability on it before its greedy answer changes. Only for tasks whose reference is the exact
  completion (``Problem.answer`` is what the model should write: ``larger``, ``count``), not for
  ``task=dataset`` (a GSM8K reference is a worked solution, not the completion scored).

For the synthetic tasks (no held-out split) it logs ``eval/accuracy`` as before: the greedy exact match
on freshly drawn problems (``policy.warmstart.exact_match_accuracy``).

The pre-registered rules of docs/science.md ("The long-answer experiment") are here too, so the run's
report and the tests read one definition: ``primary_metric`` (the mean greedy reward of the last two
evals) and ``collapsed`` (the last eval's reward ≥ 0.2 below the run's own best eval, or > 50 % of the
greedy answers truncated at the last eval, or a non-finite eval metric at any eval): judged where the run
ends, so a dip it recovers from is not a collapse.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from offpolicy.engines.base import left_pad, stop_token_ids
from offpolicy.engines.generation import explicit_config, generate
from offpolicy.policy.head import PROBE_TOKENS, check_head, decoder_hidden, linear_head, token_logprobs
from offpolicy.policy.score import precision
from offpolicy.core.sampling import SamplingConfig
from offpolicy.tasks.tokenizer import prompt_ids

COLLAPSE_DROP = 0.2  # below the run's own best eval reward
COLLAPSE_TRUNCATED = 0.5  # share of greedy answers cut at max_new_tokens
COLLAPSE_RULE = (f"the last eval's held-out reward {COLLAPSE_DROP} or more below the run's own best eval, more "
                 f"than {COLLAPSE_TRUNCATED:.0%} of the greedy held-out answers truncated at the last eval, or a "
                 "non-finite eval metric at any eval")
# The training metrics whose non-finite value means the run failed (the science amendment, docs/science.md, from
# each metric's definition): the loss, the gradient's norm, the reward and the response length — a NaN there is a
# NaN loss, NaN weights or a broken reward. Every other training metric is a statistic over a set that can be empty
# (the kept tokens, the masked ones, the rows with a reward spread, a micro-batch's support): NaN there says "no
# such token this step" and does not sink a run. Every eval metric is a failure key (``collapsed``).
FAILURE_KEYS = ("offpolicy/loss", "offpolicy/grad_norm", "reward", "response_length")
EVAL_KEYS = ("eval/accuracy", "eval/truncated_share", "eval/response_length", "eval/answer_logprob",
             "eval/answer_logprob_token")


def has_exact_answer(task) -> bool:
    """Whether ``task``'s reference is the exact completion (``answer_is_completion``; ``ChatRendered``
    passes its inner task's)."""
    inner = getattr(task, "task", task)
    return bool(getattr(inner, "answer_is_completion", False))


def evaluate(policy, tokenizer, task, eval_set: list, max_new_tokens: int, trainer_dtype: str = "fp32",
             chunk: int = 64) -> dict[str, float]:
    """The eval metrics of ``policy`` on ``eval_set`` (module doc): the held-out set's five metrics for a
    task with ``held_out``, else ``eval/accuracy`` alone (greedy exact match, as before issue #54)."""
    if not hasattr(task, "held_out"):
        from offpolicy.policy.warmstart import exact_match_accuracy

        return {"eval/accuracy": exact_match_accuracy(policy, tokenizer, task, eval_set, max_new_tokens,
                                                      sample_seed=None, trainer_dtype=trainer_dtype)}
    texts, lengths, finished = greedy(policy, tokenizer, eval_set, max_new_tokens, trainer_dtype, chunk)
    out = {"eval/accuracy": sum(task.reward(p, t) for p, t in zip(eval_set, texts)) / len(eval_set),
           "eval/truncated_share": 1.0 - sum(finished) / len(eval_set),
           "eval/response_length": sum(lengths) / len(eval_set)}
    if has_exact_answer(task):
        total, tokens = answer_logprobs(policy, tokenizer, eval_set, trainer_dtype, max(1, chunk // 4))
        out["eval/answer_logprob"] = sum(total) / len(total)
        out["eval/answer_logprob_token"] = sum(total) / sum(tokens)
    return out


@torch.no_grad()
def greedy(policy, tokenizer, problems: list, max_new_tokens: int, trainer_dtype: str = "fp32", chunk: int = 64
           ) -> tuple[list[str], list[int], list[bool]]:
    """Greedy answers of ``policy`` to ``problems`` in chunks of ``chunk`` prompts: their text (special
    tokens dropped), their length in tokens up to and including the stop token, and whether they stopped
    (False: cut at ``max_new_tokens``). Decoding uses this explicit config alone (never the model's
    ``generation_config.json``), under the trainer's precision."""
    stop = stop_token_ids(tokenizer, policy)
    config = explicit_config(do_sample=False, max_new_tokens=max_new_tokens, stop=stop, pad=tokenizer.pad_token_id)
    was_training = policy.training
    policy.eval()
    texts, lengths, finished = [], [], []
    try:
        for start in range(0, len(problems), chunk):
            part = problems[start: start + chunk]
            input_ids, attention = left_pad([prompt_ids(tokenizer, p) for p in part], tokenizer.pad_token_id)
            input_ids, attention = input_ids.to(policy.device), attention.to(policy.device)
            with precision(policy.device, trainer_dtype):
                out = generate(policy, input_ids, attention, config)
            new = out[:, input_ids.shape[1]:].cpu()
            is_stop = (torch.isin(new, torch.tensor(stop, dtype=new.dtype)) if stop
                       else torch.zeros_like(new, dtype=torch.bool))
            for row, stops in zip(new, is_stop):
                where = stops.nonzero()
                if len(where):  # what follows the first stop token is padding
                    end = int(where[0]) + 1
                    lengths.append(end)
                    finished.append(True)
                    row = row[:end]
                else:
                    lengths.append(len(row))
                    finished.append(False)
                texts.append(tokenizer.decode(row, skip_special_tokens=True))
    finally:
        policy.train(was_training)
    return texts, lengths, finished


@torch.no_grad()
def answer_logprobs(policy, tokenizer, problems: list, trainer_dtype: str = "fp32", chunk: int = 16
                    ) -> tuple[list[float], list[int]]:
    """Per problem: log π(answer, EOS | prompt) teacher-forced (the sum over the answer's tokens and the
    tokenizer's EOS, in fp32 from the logits) and the number of those tokens. Rows are right-padded, so
    every row's positions are 0, 1, … as in generation.

    Through the trainer's head (``policy.head``): the decoder's hidden states of a chunk of ``chunk`` rows, those
    that predict an answer token gathered, then ``token_logprobs`` over chunks of tokens (untruncated, temperature
    1: z − logsumexp z), so memory is O(chunk of tokens · V), never the chunk's ``[rows, L, V]`` logits (issue #67:
    16 rows of 232 tokens at V = 151,936 held 2.3 GB; docs/performance.md)."""
    eos = tokenizer.eos_token_id
    rows = [(prompt_ids(tokenizer, p), [*tokenizer(p.answer, add_special_tokens=False).input_ids, eos])
            for p in problems]
    head = linear_head(policy)
    was_training = policy.training
    policy.eval()
    totals, counts = [], []
    try:
        for start in range(0, len(rows), chunk):
            part = rows[start: start + chunk]
            width = max(len(a) + len(b) for a, b in part)
            ids = torch.full((len(part), width), tokenizer.pad_token_id, dtype=torch.long)
            attention = torch.zeros((len(part), width), dtype=torch.long)
            for i, (prompt, answer) in enumerate(part):
                ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                attention[i, : len(prompt) + len(answer)] = 1
            # the state at position t predicts token t + 1: the answer's tokens from the prompt's last one on
            row = torch.cat([torch.full((len(a),), i) for i, (_, a) in enumerate(part)])
            col = torch.cat([torch.arange(len(p) - 1, len(p) + len(a) - 1) for p, a in part])
            tokens = torch.tensor([t for _, a in part for t in a])
            ids, attention = ids.to(policy.device), attention.to(policy.device)
            check_head(policy, head, ids[:1, :PROBE_TOKENS])
            with precision(policy.device, trainer_dtype):
                hidden = decoder_hidden(policy, ids, attention)[row.to(policy.device), col.to(policy.device)]
                logp = token_logprobs(hidden, tokens.to(policy.device), head, SamplingConfig()).logprobs  # [N] fp32
            for answer_lp in torch.split(logp.float(), [len(a) for _, a in part]):
                totals.append(float(answer_lp.sum()))
                counts.append(len(answer_lp))
    finally:
        policy.train(was_training)
    return totals, counts


def eval_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's evals from its metrics rows: ``{"step", and every EVAL_KEYS metric it logged}``, in step order. Rows
    may be read straight from ``metrics.jsonl``: a ``null`` eval metric (a non-finite value, ``logger.encode_row``)
    reads as NaN here, whatever its reason, so the rules below see it as the non-finite value it was."""
    return [{"step": r["step"], **{k: _number(r[k]) for k in EVAL_KEYS if k in r}} for r in rows
            if "eval/accuracy" in r]


def failed_metrics(rows: list[dict[str, Any]]) -> list[str]:
    """The non-finite failure metrics of a run's rows (``FAILURE_KEYS`` and every eval metric) as "step N: key"; a
    ``null`` read straight from ``metrics.jsonl`` counts as non-finite. Empty: no metric says the run failed."""
    keys = (*FAILURE_KEYS, *EVAL_KEYS)
    return [f"step {r['step']}: {k}" for r in rows for k in keys if k in r and not math.isfinite(_number(r[k]))]


def _number(value: Any) -> float:
    """A metric's value as a float: ``null`` (JSON's only way to write NaN or ±inf) as NaN."""
    return math.nan if value is None else float(value)


def primary_metric(evals: list[dict[str, Any]]) -> float | None:
    """The pre-registered primary metric: the mean greedy held-out reward (``eval/accuracy``) of the run's
    last two evals; None with fewer than two. A non-finite (or null) reward counts as 0, the task's lowest
    reward: an eval that produced no number is no better than one that earned nothing (the science amendment,
    docs/science.md; such a run is collapsed too, by ``collapsed``)."""
    if len(evals) < 2:
        return None
    return (_reward(evals[-1]) + _reward(evals[-2])) / 2


def _reward(point: dict[str, Any]) -> float:
    value = _number(point.get("eval/accuracy"))
    return value if math.isfinite(value) else 0.0


def collapsed(evals: list[dict[str, Any]]) -> bool:
    """The pre-registered collapse rule (``COLLAPSE_RULE``) on a run's evals: the last eval's reward at
    least ``COLLAPSE_DROP`` below the run's best (1e-9 of slack for the sums' rounding), more than
    ``COLLAPSE_TRUNCATED`` of its greedy answers truncated, or any eval metric non-finite (a ``null`` read back
    from ``metrics.jsonl`` is one). No evals: False (a run that never evaluated did not finish; the report
    counts that apart)."""
    if any(not math.isfinite(_number(v)) for e in evals for k, v in e.items() if k != "step"):
        return True
    if not evals:
        return False
    if evals[-1].get("eval/truncated_share", 0.0) > COLLAPSE_TRUNCATED:
        return True
    rewards = [e["eval/accuracy"] for e in evals]
    return rewards[-1] <= max(rewards) - COLLAPSE_DROP + 1e-9
