"""``offpolicy diagnose``: how off-policy is an engine, and which correction would this batch need?

Samples with the engine, recomputes the very same tokens with the trainer (Hugging Face, on the
engine's top-k/top-p support, docs/specification.md §6), and reports:

* every mismatch metric of docs/specification.md §7 (``correct`` with a measure-only config);
* breakdowns by token position and by the sampled token's probability under the trainer —
  where the mismatch lives;
* the fraction of tokens with |log ρ| above log 1.1 and log 2, and with ρ outside [0.9, 1.1],
  [0.8, 1.25] and [0.5, 2] (the bands users quote: |log ρ| > log 1.1 is ρ outside [0.909, 1.1]);
* a what-if table: every preset applied to this very batch (rejected tokens and sequences,
  weight mean/min/max, ESS of the weights);
* PNG plots (histogram of log ρ, log ρ against token probability, mismatch KL per position)
  and ``report.json``;
* per token (``sequences``, ``token_verdicts``): each response's tokens with log π, log μ, the trainer's
  entropy, and what each preset does to each token — the data of ``report.html`` (``offpolicy.measure.viewer``);
* under top-k/top-p, which kept set the trainer scored on (``kept_set``): the engine's, replayed
  (the hf engine records it, ``offpolicy.core.kept_set``) or the trainer's own, recomputed (vLLM, a server,
  a dump) — with replay, the share of engine tokens outside the trainer's own set and the ρ band
  shares both with and without replay (issue #46);
* from a server asked with ``--head-logprobs K``, each token's top-K ids with their log μ, checked, and the
  share of the sampler's mass they cover (``setting.server.head``: score centering's head support, issue #56);
* a flat ``summary`` of the numbers a CI gate reads (``--fail-above STAT=V``, ``--fail-below
  STAT=V``; ``gate``): exit 3 when a bound fails (issue #25, docs/ci-gate.md);
* the sequence weight Π ρ before truncation and the pre-check of every Π-ρ preset (``sequence_weight``:
  warns when one would clamp or mask most rows, ``offpolicy.core.sequence_weight``; issue #56);
* whether every log-ratio is exactly 0, and the first token where one is not (``exact``; ``--require-exact``
  fails the run on it);
* what the engine returned, checked for what the mismatch cannot show (``engine_checks``,
  ``offpolicy.measure.engine_checks``; issue #69): log-probs identical to the trainer's while the engine's dtype,
  device or backend differs (recomputed, not sampled), engine log-probs exactly 0 where the trainer's are not, the
  entropy gap over the kept set, and, where the engine returned text, the retokenisation drift;
* the engine on record (``provenance``: ``offpolicy.measure.provenance.block``, the engine's name, version, dtype,
  attention backend and determinism switches) and the gated speed paths that ran (``speed_paths``);
* with ``--self-check``, the trainer against itself — micro-batch 1 against the configured micro-batches,
  an fp32 head against the configured precision — and, layer by layer, where the engine's precision first
  diverges from fp32 (``self_check``, ``offpolicy.measure.self_check``).
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import offpolicy as op
from offpolicy.core import ops, presets, sequence_weight
from offpolicy.measure import engine_checks, provenance, viewer
from offpolicy.core.config import ConfigError
from offpolicy.measure.diagnose_config import DiagnoseConfig
from offpolicy.policy.scorer_config import MICRO_BATCH_TOKENS
from offpolicy.engines import Rollouts, SamplingConfig, make_engine
from offpolicy.integrations.dump import load_batch
from offpolicy.core.metrics import Metrics
from offpolicy.policy.batch import Batch, to_batch
from offpolicy.policy.score import Scorer, load_policy
from offpolicy.tasks.tokenizer import plain_text_ids

POSITION_EDGES = [0, 4, 8, 16, 32, 64, 128, 256, 1 << 30]
PROBABILITY_EDGES = [0.0, 0.01, 0.1, 0.5, 0.9, 1.0000001]
THRESHOLDS = {"log1.1": math.log(1.1), "log2": math.log(2.0)}
# ρ bands [low, high] whose outside share is reported (TRL #6789 quotes [0.9, 1.1]); name → (low, high)
RATIO_BANDS = {"0.9_1.1": (0.9, 1.1), "0.8_1.25": (0.8, 1.25), "0.5_2": (0.5, 2.0)}


@dataclass
class Sample:
    """One engine batch and the trainer's view of it, ``[B, T]``."""

    batch: Batch
    trainer: torch.Tensor  # log π_train(y_t)
    seconds: float | None  # engine time; None for a batch read from a dump (``--batch``)
    entropy: float | None = None  # the trainer's mean token entropy; None where no logits are at hand
    outside_support: int = 0  # tokens the engine drew outside the trainer's top-k/top-p support (excluded)
    # under top-k/top-p: the trainer's mean probability mass outside its kept set, 1 − S — the factor S a
    # ratio against full-vocabulary trainer log-probs would carry (TRL #6789); None without truncation
    outside_mass: float | None = None
    token_entropy: torch.Tensor | None = None  # [B, T] the trainer's entropy at each token (the viewer's)
    token_text: list[list[str]] | None = None  # each response token as text (None: a dump holds no token ids)
    prompt_text: list[str] | None = None  # each prompt as text (None: a dump holds no token ids)
    # where ``trainer`` replayed the engine's kept sets: the same tokens scored on the trainer's own,
    # recomputed top-k/top-p set (the numbers "without replay"); None where no set was replayed
    without_replay: Sample | None = None
    # [B, T] bool: the tokens ``score_batch`` took out as outside the trainer's support (log π = −inf), by
    # position, for ``exactness``; None where none were taken out or the sample comes from a dump
    outside: torch.Tensor | None = None
    # where the numbers came from (issue #69): the engine on record (``provenance.engine_record``, a server's
    # ``engine_checks.server_record``, a dump's meta), the gated speed paths that ran (``speed.run_paths``), and each
    # side's backend, dtype and device ({"engine": …, "trainer": …}: ``engine_checks.recomputed``); None: unknown
    engine: dict[str, Any] | None = None
    speed_paths: dict[str, str] | None = None
    sides: dict[str, dict[str, Any]] | None = None
    # the engine's entropy, the mass its log-probs cover, and their source ([B, T], [B, T], str:
    # ``engine_checks.engine_entropy``); None where it sent no log-probs beyond the sampled token's
    engine_entropy: tuple[torch.Tensor, torch.Tensor, str] | None = None
    # ``engine_checks.retokenization``'s section where the engine returned text; None: it returned ids only
    retokenization: dict[str, Any] | None = None


def read_prompts(path: Path, tokenizer) -> list[list[int]]:
    """Token ids of each JSONL line's ``prompt`` field, as plain text (``plain_text_ids``: a BOS only where the
    tokenizer itself adds one — SmolLM2's "BOS" ``<|im_start|>`` opens a chat turn and stays out).

    Raises:
        ConfigError: missing/empty file, invalid JSON, a line without a string ``prompt``, or a prompt of
            no token (the first response token is scored from the last prompt position: there is none).
    """
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: file not found")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--prompts {path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ConfigError(f"--prompts {path}:{number}: each line needs a string field \"prompt\"")
        ids = plain_text_ids(tokenizer, record["prompt"])  # the tokenizer's own BOS rule
        if not ids:
            raise ConfigError(f"--prompts {path}:{number}: the prompt {record['prompt']!r} is no token long; the "
                              "first response token is scored from the prompt's last one: give it some text")
        prompts.append(ids)
    if not prompts:
        raise ConfigError(f"--prompts {path}: the file holds no prompt")
    return prompts


@dataclass(frozen=True)
class TrainerSide:
    """The trainer's side of a diagnosis, frozen: the model directory it loads (fp32 master weights,
    ``load_policy``) and how it scores — the engine's ``sampling`` support, the compute ``dtype`` (``fp32``,
    or ``bf16`` autocast), the ``device`` (the hf engine's too), the ``budget`` of padded tokens a
    micro-batch: train's ``Scorer``, with train's numbers."""

    model_path: Path
    sampling: SamplingConfig
    dtype: str = "fp32"
    device: torch.device = torch.device("cpu")
    budget: int | None = MICRO_BATCH_TOKENS
    cpu_linear: str = "auto"  # the linear layers on an fp32 CPU trainer, as train's (``ScorerConfig.cpu_linear``)

    def scorer(self) -> Scorer:
        from offpolicy.speed.cpu_linear import use_onednn_linear

        policy = load_policy(self.model_path, self.device).eval()
        _LINEAR_NOTES[policy] = use_onednn_linear(policy, self.cpu_linear, self.device, self.dtype)
        return Scorer(policy, self.sampling, self.device, self.dtype, self.budget)


def sample(trainer: TrainerSide, tokenizer, prompts: list[list[int]], engine: str, engine_dtype: str, seed: int = 0,
           logit_noise: float = 0.0, log_path: Path | None = None, max_model_len: int = 1024,
           vllm_options: dict | None = None, gpu_memory_utilization: float = 0.3) -> Sample:
    """Generate with the engine (on ``trainer.device``, with ``trainer.sampling``), then recompute the sampled
    tokens' log-probs with the trainer (``score``). The engine's output goes to ``log_path`` when given (see
    ``engines.make_engine``); ``vllm_options`` are vLLM's batching options (``engines.vllm.OPTIONS``). The
    sample comes back on the CPU."""
    import time

    eng = make_engine(engine, str(trainer.model_path), tokenizer, engine_dtype, seed=seed, logit_noise=logit_noise,
                      max_model_len=max(max_model_len, 1024), log_path=log_path, device=trainer.device,
                      vllm_options=vllm_options, sampling=trainer.sampling, cpu_linear=trainer.cpu_linear,
                      gpu_memory_utilization=gpu_memory_utilization)
    try:
        start = time.perf_counter()
        rollouts = eng.generate(prompts, trainer.sampling, seed=seed, version=0)
        seconds = time.perf_counter() - start
        rollouts.validate(eng.name)
        record = provenance.engine_record(eng, engine_dtype)  # while the engine is up (the hf engine reads its model)
    finally:
        eng.close()
    s = score(rollouts, trainer, tokenizer, seconds=seconds, engine=eng)
    device = str(trainer.device)
    return replace(s, engine=record, sides={
        "engine": {"backend": BACKENDS.get(engine, engine), "dtype": engine_dtype, "device": device},
        "trainer": trainer_side(trainer)})


BACKENDS = {"hf": "transformers", "vllm": "vllm"}  # an in-process engine's backend, as the sides compare it
# the trainer's linear layers in diagnose: load_policy's model as loaded (train's cpu_linear is not applied)
# what the trainer's linear layers ran through, by model: TrainerSide.scorer applies trainer.cpu_linear as train does
_LINEAR_NOTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
DIAGNOSE_LINEAR = "torch's F.linear (a scorer built outside TrainerSide: the model as it was loaded)"


def trainer_side(trainer: TrainerSide) -> dict[str, Any]:
    """The trainer's backend, dtype and device, as ``engine_checks.recomputed`` compares them with the engine's."""
    return {"backend": "transformers", "dtype": trainer.dtype, "device": str(trainer.device)}


def score(rollouts: Rollouts, trainer: TrainerSide, tokenizer, seconds: float | None = None,
          scorer: Scorer | None = None, engine=None) -> Sample:
    """The trainer half: log π_train(y_t) of every sampled token, on the engine's sampling support, as
    ``trainer`` scores them; ``seconds`` is the engine's time, kept for the report. The sample comes back on
    the CPU, with the gated speed paths that ran (``speed.run_paths``: the trainer's, and ``engine``'s where it
    has any) and the engine's entropy where it sent the log-probs to compute it (``engine_checks.engine_entropy``).

    Raises:
        RuntimeError: every response is empty (nothing to compare).
        ConfigError: a prompt of no token (its first response token has no position to be scored from:
            ``to_batch`` would read position −1, the row's last).
    """
    empty = next((i for i, p in enumerate(rollouts.prompt_ids) if not p), None)
    if empty is not None:
        raise ConfigError(f"prompt {empty} has no token: the first response token is scored from the prompt's last one")
    if not any(rollouts.response_ids):
        raise RuntimeError("the engine returned only empty responses: nothing to compare")
    batch = to_batch(rollouts, tokenizer.pad_token_id)
    scorer = scorer or trainer.scorer()  # loaded once: with replay it scores twice
    s = score_batch(trainer, batch, seconds, scorer)
    if replays(batch, trainer.sampling):  # and without replay: the trainer's own set, for the with/without shares
        s = replace(s, without_replay=score_batch(trainer, replace(batch, kept=None), seconds, scorer))
    from offpolicy.speed import run_paths

    # each response token as text, and each prompt, for the per-token viewer (report.html)
    return replace(s, token_text=[[tokenizer.decode([t]) for t in ids] for ids in rollouts.response_ids],
                   prompt_text=[tokenizer.decode(ids) for ids in rollouts.prompt_ids],
                   speed_paths=run_paths(scorer.model, _LINEAR_NOTES.get(scorer.model, DIAGNOSE_LINEAR), engine),
                   engine_entropy=engine_checks.engine_entropy(rollouts.kept, rollouts.head, batch.mask.shape[1]))


def score_batch(trainer: TrainerSide, batch: Batch, seconds: float | None = None, scorer: Scorer | None = None
                ) -> Sample:
    """The trainer's side of a sample: log π_train of the engine's tokens computed as ``train``
    computes them — fp32 master weights, bf16 as autocast, micro-batches of ≤ ``trainer.budget``
    padded tokens trimmed of unused padding (``policy.score.Scorer.score``, train's π_old), the one head
    (``policy/head.py``) — and its mean token entropy.

    Tokens the engine drew outside the trainer's top-k/top-p support (log π_train = −inf) leave the
    statistics, as they leave train's loss, and are counted (``Sample.outside_support``). ``scorer``: one
    already loaded (else ``trainer.scorer()`` loads the model)."""
    seen = Metrics()  # the trainer's token entropy, from its logits (the denominator of kl_over_entropy)
    lp, entropy, _ = (scorer or trainer.scorer()).score(batch, seen, entropy=True)  # and per token, for the viewer (report.html)
    lp = lp.float().cpu()
    outside = (lp == float("-inf")) & batch.mask.bool()  # [B, T]
    batch = replace(batch, mask=batch.mask * ~outside)
    if not bool(batch.mask.any()):
        raise RuntimeError("every sampled token lies outside the trainer's top-k/top-p support: nothing to compare")
    return Sample(batch, torch.where(outside, 0.0, lp), seconds, entropy=seen["entropy"],
                  outside_support=int(outside.sum()), outside=outside if bool(outside.any()) else None,
                  outside_mass=seen["outside_mass"] if "outside_mass" in seen else None,
                  token_entropy=entropy.float().cpu())


def replays(batch: Batch, sampling: SamplingConfig) -> bool:
    """Whether the trainer scores ``batch`` on the engine's kept sets: they were recorded (``Batch.kept``)
    and sampling truncates (top-k or top-p; ``head.replayed_sets``)."""
    return batch.kept is not None and sampling.truncates


def kept_set_report(s: Sample) -> dict[str, Any]:
    """Which kept set the trainer scored on, and with replay the shares it changes, with and without it:

    ``fraction_outside_trainer_support``: engine tokens outside the set the trainer scores on (−inf, no ratio);
    ``fraction_ratio_outside``: tokens with ρ outside each ``RATIO_BANDS`` band (of the tokens with a ratio).
    Without replay, the set is the trainer's own top-k/top-p set recomputed on its logits."""
    def shares(x: Sample) -> dict[str, Any]:
        x, outside = within_support(x)
        lr = (x.trainer - x.batch.rollout_logprobs) * x.batch.mask
        return {"fraction_outside_trainer_support": outside,
                "fraction_ratio_outside": {k: fraction_outside(lr, x.batch.mask, lo, hi)
                                           for k, (lo, hi) in RATIO_BANDS.items()}}

    tokens = int(s.batch.mask.bool().sum())
    if s.without_replay is None:
        return {"applied": "recomputed", "why": "the engine recorded no kept set (or sampling does not truncate): "
                "the trainer recomputes top-k/top-p on its own logits", "replayed_tokens": 0, "tokens": tokens,
                "replayed_share": 0.0, "with_replay": None, "without_replay": shares(s)}
    # the tokens scored on a replayed set: those whose recorded set holds an id (a server's sampling mask)
    replayed = tokens if s.batch.kept is None else int(((s.batch.kept.count > 0) & s.batch.mask.bool()).sum())
    return {"applied": "replayed", "why": "the trainer renormalises over the engine's recorded kept set",
            "replayed_tokens": replayed, "tokens": tokens, "replayed_share": replayed / tokens if tokens else 0.0,
            "with_replay": shares(s), "without_replay": shares(s.without_replay)}


def exactness(s: Sample) -> dict[str, Any]:
    """Is every log-ratio exactly 0 — log π_train(y_t) == log μ(y_t) to the bit, on every sampled token — and
    if not, the first token (row-major: the lowest row, then its earliest position) where it is not, with
    both log-probs (verl #7688, NeMo-RL #3208: engines run with exactly zero difference; ``--require-exact``
    fails the run on any). A token outside the trainer's top-k/top-p support (log π = −inf) differs; NaN on
    either side differs. Rows and positions index the sample (a dump's rows in its files' order) and the
    response tokens (0 = the first response token)."""
    mask = s.batch.mask.bool()
    outside = s.outside if s.outside is not None else torch.zeros_like(mask)
    counted = mask | outside
    trainer = torch.where(outside, float("-inf"), s.trainer.float())
    rollout = s.batch.rollout_logprobs.float()
    differ = counted & ~(trainer == rollout)
    n = int(differ.sum())
    out: dict[str, Any] = {"exact": n == 0, "tokens": int(counted.sum()), "differing_tokens": n, "first": None}
    if n:
        row, position = (int(i) for i in differ.nonzero()[0])
        lp, mu = float(trainer[row, position]), float(rollout[row, position])
        out["first"] = {"row": row, "position": position, "trainer_logprob": lp, "engine_logprob": mu,
                        "log_ratio": lp - mu,
                        "token": None if s.token_text is None else s.token_text[row][position]}
    return out


def exact_failure(exact: dict[str, Any], engine: dict[str, Any] | None = None) -> str | None:
    """``--require-exact``'s line for a report's ``exact`` section (None: every log-ratio is 0); ``engine``, the
    engine on record (its name, version, dtype, attention backend and determinism switches), is named where known."""
    if exact["exact"]:
        return None
    f = exact["first"]
    token = "" if f["token"] is None else f" (token {f['token']!r})"
    return (f"FAIL --require-exact: {exact['differing_tokens']} of {exact['tokens']} tokens have log π_train ≠ "
            f"log μ; the first is row {f['row']}, position {f['position']}{token}: log π_train = "
            f"{f['trainer_logprob']:.9g}, log μ = {f['engine_logprob']:.9g} (log ρ = {f['log_ratio']:.3g})"
            + ("" if not engine else f"; engine: {engine_checks.describe(engine)}"))


def exact_verdict(r: dict[str, Any]) -> str:
    """The console's verdict on a report's ``exact`` section, naming the engine on record (``--require-exact``
    gates on it): exact, or where it first breaks."""
    exact, engine = r["exact"], (r.get("provenance") or {}).get("engine")
    if exact["exact"]:
        return (f"exact: every log-ratio is 0 ({exact['tokens']} tokens); engine: {engine_checks.describe(engine)}")
    return f"exact: no — {exact_failure(exact, engine).removeprefix('FAIL --require-exact: ')}" + (
        "" if engine else f"; engine: {engine_checks.describe(engine)}")


def from_dump(path: Path, tokenizer=None) -> tuple[Sample, dict[str, Any]]:
    """A ``Sample`` from a host framework's batch dump (``offpolicy.integrations.dump``): the trainer
    view is the dump's ``old_logprobs`` (log π_old), the engine's its ``rollout_logprobs`` (log μ).
    Returns the sample and a description of its source (files, hosts, steps) for the report. The engine and
    trainer on record come from the meta's ``engine`` and ``trainer`` (where the host wrote them); a dump with
    text is re-encoded with ``tokenizer`` (the trainer's, ``--model``) for the retokenisation drift."""
    data = load_batch(path)
    mask = data["mask"]
    rows, t = mask.shape
    zeros = torch.zeros((rows, t), dtype=torch.long)
    # Only mask and rollout_logprobs of a Batch feed the report; token ids are not dumped.
    keep = mask.bool()  # padding may hold anything (a host's fill value); it never reaches the report
    batch = Batch(input_ids=zeros, attention_mask=zeros, positions=zeros, response_ids=zeros, mask=mask,
                  rollout_logprobs=torch.where(keep, data["rollout_logprobs"], 0.0),
                  versions=torch.zeros(rows, dtype=torch.long))
    meta = data["meta"]
    source = {"files": data["files"], "hosts": sorted({f"{m.get('host')} {m.get('host_version')}" for m in meta}),
              "steps": sorted({m.get("step") for m in meta if m.get("step") is not None}),
              "anchors": sorted({str(m.get("anchor")) for m in meta})}
    # the engine and the trainer on record, where the host wrote them into the meta (one per file; all alike)
    engines = [m.get("engine") for m in meta]
    trainers = [m.get("trainer") for m in meta]
    engine = engines[0] if isinstance(engines[0], dict) and all(e == engines[0] for e in engines) else None
    trainer = trainers[0] if isinstance(trainers[0], dict) and all(t == trainers[0] for t in trainers) else None
    sides = None if engine is None and trainer is None else {
        "engine": {k: (engine or {}).get(k) for k in engine_checks.SIDES},
        "trainer": {k: (trainer or {}).get(k) for k in engine_checks.SIDES}}
    return Sample(batch, torch.where(keep, data["old_logprobs"], 0.0), None, engine=engine, sides=sides,
                  retokenization=dump_retokenization(data.get("text"), tokenizer)), source


def dump_retokenization(text: dict[str, list] | None, tokenizer) -> dict[str, Any] | None:
    """``engine_checks.retokenization`` on a dump's text (``load_batch``'s ``text``); "not reported" where the dump
    holds none or no trainer tokenizer is at hand (``tokenizer`` None: ``--batch`` without ``--model``)."""
    if text is None:
        return {"reported": False, "why": "not reported: the dump holds no text (BatchDumper.maybe_dump's text: the "
                "sampled ids and the text the engine returned for them)"}
    if tokenizer is None:
        return {"reported": False, "source": "the dump's text",
                "why": "not reported: the dump holds text, and re-encoding it needs the trainer's tokenizer: pass "
                       "--model DIR with --batch"}
    return engine_checks.retokenization(tokenizer, text["prompt_ids"], text["response_ids"], text["response_text"],
                                        "the dump's text", prompt_texts=text.get("prompt_text"))


def sample_server(config, trainer: TrainerSide, tokenizer, prompts: list[list[int]], seed: int = 0,
                  console=None) -> tuple[Sample, dict[str, Any]]:
    """Sample through a running server (``engines.server.generate``, a ``ServerConfig``), then score the
    same tokens with the trainer. With temperature, top-k or top-p the server's log-probs are checked to
    belong to the distribution it sampled from (``logprob_semantics``). Returns the sample and what the
    report says about the server.

    Raises:
        ServerError: the server failed, broke the alignment contract, or reports raw log-probs.
    """
    from transformers import AutoConfig

    from offpolicy.engines import server

    sampling = trainer.sampling
    vocab_size = AutoConfig.from_pretrained(trainer.model_path).get_text_config().vocab_size  # the embedding's rows
    rollouts, info = server.generate(config, tokenizer, prompts, sampling, seed=seed, model_path=trainer.model_path,
                                     console=console, vocab_size=vocab_size)
    scorer = trainer.scorer()  # one model for both scorings below
    s = score(rollouts, trainer, tokenizer, seconds=info["seconds"], scorer=scorer)
    # the server on record (what it says about itself), its side against the trainer's, and its text re-encoded
    record = engine_checks.server_record(config, info)
    returned = info.pop("returned_text", None) or []
    retokenized = engine_checks.retokenization(
        tokenizer, rollouts.prompt_ids, rollouts.response_ids, [r["text"] for r in returned],
        f"the server's text ({info['endpoint']})", forms=[r["form"] for r in returned]) if returned else None
    s = replace(s, engine=record, retokenization=retokenized, sides={
        "engine": {"backend": record["name"], "dtype": record["dtype"], "device": None},
        "trainer": trainer_side(trainer)})
    if (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, -1):
        info["logprob_check"] = {"verdict": "not needed: at temperature 1, top_p 1, top_k -1 the sampling "
                                 "distribution is the model's own (processed = raw log-probs)"}
    else:
        raw = replace(trainer, sampling=SamplingConfig(max_tokens=sampling.max_tokens))  # the full vocabulary
        untruncated = score(rollouts, raw, tokenizer, scorer=replace(scorer, sampling=raw.sampling))
        info["logprob_check"] = logprob_semantics(s, untruncated.trainer, sampling)
    return s, info


def logprob_semantics(s: Sample, untruncated: torch.Tensor, sampling: SamplingConfig) -> dict[str, Any]:
    """Is log μ the engine's sampling distribution (temperature, top-k, top-p applied: vLLM's
    ``--logprobs-mode processed_logprobs``) or the model's raw one (vLLM's default ``raw_logprobs``)?

        d_sampled = median_t |log π̃_train(y_t) − log μ(y_t)|   (π̃: the sampling support, docs/specification.md §6)
        d_raw     = median_t |log π_train(y_t) − log μ(y_t)|    (π: logits / 1, the full vocabulary)

    ``untruncated`` is log π_train ``[B, T]``. Medians, because a token the engine kept at the top-k
    edge that the trainer's rounding leaves out has log π̃ = −inf. μ is taken as raw when
    d_raw < d_sampled / 2: a factor, so that an engine's rounding noise larger than the temperature's
    effect never trips it.

    Raises:
        ServerError: μ is the raw distribution: the ratio π̃/μ would measure the temperature, not the engine.
    """
    from offpolicy.engines.server import ServerError

    keep = s.batch.mask.bool()
    d_sampled = float((s.trainer - s.batch.rollout_logprobs)[keep].abs().median())
    d_raw = float((untruncated - s.batch.rollout_logprobs)[keep].abs().median())
    stated = f"temperature {sampling.temperature:g}, top_p {sampling.top_p:g}, top_k {sampling.top_k}"
    if d_raw < d_sampled / 2:
        raise ServerError(
            f"the server's log-probs are those of the model's raw distribution, not of the one it sampled from "
            f"({stated}): median |log π − log μ| = {d_raw:.3g} against the raw one, {d_sampled:.3g} against the "
            "sampled one. Restart it with --logprobs-mode processed_logprobs (trl vllm-serve sets it), or diagnose "
            "at --temperature 1 --top-p 1 --top-k -1")
    return {"verdict": f"the server's log-probs follow the distribution it sampled from ({stated})",
            "median_abs_log_ratio_sampled": d_sampled, "median_abs_log_ratio_raw": d_raw}


def _bucket_rows(log_ratio, mask, index, edges, labels) -> list[dict[str, float]]:
    total_abs = float((log_ratio.abs() * mask).sum())
    n_all = float(mask.sum())
    rows = []
    for lo, hi, label in zip(edges[:-1], edges[1:], labels):
        sel = mask.bool() & (index >= lo) & (index < hi)
        n = int(sel.sum())
        if n == 0:
            continue
        x = log_ratio[sel]
        rows.append({
            "bucket": label, "tokens": n, "token_share": n / n_all,
            "abs_log_ratio_mean": float(x.abs().mean()),
            "kl_k3": float(ops.k3(x, None).mean()),
            "abs_log_ratio_share": float(x.abs().sum()) / total_abs if total_abs > 0 else 0.0,
        })
    return rows


def breakdowns(s: Sample) -> dict[str, Any]:
    log_ratio = (s.trainer - s.batch.rollout_logprobs) * s.batch.mask  # log ρ = log π_train − log μ
    mask = s.batch.mask
    t = torch.arange(mask.shape[1]).expand_as(mask)
    pos_labels = [f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+" for lo, hi in zip(POSITION_EDGES[:-1], POSITION_EDGES[1:])]
    prob = s.trainer.exp()
    prob_labels = ["<0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", "≥0.9"]
    n = float(mask.sum())
    return {
        "by_position": _bucket_rows(log_ratio, mask, t, POSITION_EDGES, pos_labels),
        "by_probability": _bucket_rows(log_ratio, mask, prob, PROBABILITY_EDGES, prob_labels),
        "fraction_abs_log_ratio_above": {k: float(((log_ratio.abs() > v) & mask.bool()).sum()) / n
                                         for k, v in THRESHOLDS.items()},
        "fraction_ratio_outside": {k: fraction_outside(log_ratio, mask, lo, hi) for k, (lo, hi) in RATIO_BANDS.items()},
    }


def fraction_outside(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """Share of valid tokens with ρ ∉ [low, high], read on log ρ in fp64 against log low, log high
    (no rounding of ρ at the band's edges)."""
    lr = log_ratio.double()
    outside = ((lr < math.log(low)) | (lr > math.log(high))) & mask.bool()
    return float(outside.sum()) / max(float(mask.sum()), 1.0)


def what_if(s: Sample, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Every preset's ``correct`` on this batch (π_old = π_θ = the trainer's log-probs, A = 0)."""
    rows = []
    mask = s.batch.mask
    adv = torch.zeros_like(mask)
    non_empty = mask.any(dim=-1)
    for name in names or presets.names():
        cfg = presets.correction(name)
        out = op.correct(s.trainer, s.batch.rollout_logprobs, mask, cfg, logprobs=s.trainer, advantages=adv)
        m = out.metrics
        kept_rows = out.mask.bool().any(dim=-1)
        rows.append({
            "preset": name,
            "token_rejected": m["masked_fraction"],
            "seq_rejected": float((non_empty & ~kept_rows).sum()) / float(non_empty.sum()),
            "weight_mean": m["is_mean"], "weight_min": m["is_min"], "weight_max": m["is_max"],
            "ess": m["is_ess"],
        })
    return rows


def mismatch(s: Sample) -> dict[str, float]:
    out = op.correct(s.trainer, s.batch.rollout_logprobs, s.batch.mask)  # measure only
    keys = ["kl_k1", "kl_k3", "ppl_train", "ppl_rollout", "log_ppl_diff", "ppl_ratio", "chi2_token", "chi2_seq",
            "abs_logp_diff_mean", "abs_logp_diff_max", "prob_diff_mean", "prob_diff_max", "mult_prob_error", "ess",
            "valid_tokens"]
    values = out.metrics.to_dict(prefix="")
    return {k: values[k] for k in keys}


# ============================================================================ CI gate (issue #25)
# summary name → (where it comes from, what it is); the names a --fail-above/--fail-below may bound
SUMMARY_STATS = {
    "kl_k1": "mean(log μ − log π_train)",
    "kl_k3": "mean(ρ − 1 − log ρ), the mismatch KL (prime-rl's mismatch_kl; its nightly gate: ≤ 5e-4)",
    "mean_abs_log_ratio": "mean |log π_train − log μ| (slime's CI: ≤ 0.1)",
    "max_abs_log_ratio": "max |log π_train − log μ|",
    "mult_prob_error": "mean exp(|log π_train − log μ|) ≥ 1, NeMo-RL's token_mult_prob_error",
    "kl_over_entropy": "kl_k3 / the trainer's mean token entropy (prime-rl's kl_ent_ratio)",
    "entropy": "the trainer's mean token entropy −Σ p log p",
    "chi2": "mean(ρ²) − 1 per token", "chi2_seq": "mean_rows(Π ρ²) − 1",
    "ess": "(mean ρ)² / mean(ρ²) of the raw token ratios", "ppl_ratio": "mean_rows ppl_train / ppl_rollout",
    "prob_diff_max": "max |π_train − μ|",
    "fraction_above_log2": "fraction of tokens with |log ρ| > log 2",
    "outside_support_tokens": "tokens drawn outside the trainer's top-k/top-p support (left out of every other statistic)",
    **{f"fraction_outside_{k}": f"fraction of tokens with ρ outside [{lo:g}, {hi:g}]" for k, (lo, hi) in RATIO_BANDS.items()},
    "fraction_outside_trainer_support": "fraction of sampled tokens outside the trainer's own top-k/top-p set "
                                        "(log π = −inf: no ratio; left out of every other statistic)",
    "outside_mass": "top-k/top-p runs: the trainer's mean probability mass outside its kept set (1 − S, the bias "
                    "of a ratio against full-vocabulary log-probs, TRL #6789)",
    "kept_set_replayed": "1 where the trainer renormalised over the engine's recorded kept set, 0 where it "
                         "recomputed top-k/top-p on its own logits",
    "kept_set_replayed_share": "the share of counted tokens the trainer scored on the engine's recorded kept set "
                               "(its sampling mask, --sampling-mask against a server)",
    "fraction_outside_trainer_support_without_replay": "with replay: the share of engine tokens outside the "
                                                       "trainer's own recomputed top-k/top-p set",
    **{f"fraction_outside_{k}_without_replay": f"with replay: fraction of tokens with ρ outside [{lo:g}, {hi:g}] "
       "on the trainer's own recomputed set" for k, (lo, hi) in RATIO_BANDS.items()},
    "differing_tokens": "tokens whose log π_train differs from log μ at all (0: exact; --require-exact)",
    **{f"seq_log_weight_{k}": f"the {k} over rows of log Π_t ρ_t, the sequence weight before truncation"
       for k in ("min", "median", "max")},
    "recomputed_logprobs": "1 where the engine's log-probs equal the trainer's to the bit on every token (≥ 256) while "
                           "the engine's dtype, device or backend differs: recomputed on the trainer's weights, not "
                           "sampled (every correction off); 0 otherwise (engine_checks.recomputed)",
    "fraction_engine_logprob_zero": "share of tokens whose engine log-prob is exactly 0 where the trainer's over the "
                                    "same kept set is below -0.01 and the set holds more than one token",
    "entropy_gap": "mean |H_trainer − H_engine| over the kept set, on tokens whose engine log-probs cover ≥ 0.99 of "
                   "its mass (nats)",
    "retokenization_drift": "share of rows whose prompt + returned text, re-encoded with the trainer's tokenizer, "
                            "differs from the sampled ids (where the engine returned text)",
    "self_check_micro_batch_fraction_outside_0.9_1.1": "--self-check: share of tokens whose π at the configured "
                                                       "micro-batches over π at micro-batch 1 is outside [0.9, 1.1]",
    "self_check_fp32_head_fraction_outside_0.9_1.1": "--self-check: share of tokens whose π with the configured "
                                                     "head over π with an fp32 head is outside [0.9, 1.1]",
}
NO_SELF_CHECK = "left out, run with --self-check (the trainer scores the tokens again)"
# per preset, "STAT@PRESET": what that preset's correct() does to this batch (the what-if table)
PRESET_STATS = {"masked_fraction": "token_rejected", "seq_masked_fraction": "seq_rejected", "weight_ess": "ess"}
NO_LOGITS = ("left out, no trainer logits are at hand (a --batch dump holds log-probs only); the engine path "
             "(diagnose --model) measures it")
NO_ENTROPY = f"kl_over_entropy: {NO_LOGITS}"


def summary(result: dict[str, Any], entropy: float | None) -> tuple[dict[str, float], list[str]]:
    """The flat numbers a gate reads (``SUMMARY_STATS``, then ``STAT@PRESET``) and notes on what is left out."""
    m = result["mismatch"]
    out = {"kl_k1": m["kl_k1"], "kl_k3": m["kl_k3"], "mean_abs_log_ratio": m["abs_logp_diff_mean"],
           "max_abs_log_ratio": m["abs_logp_diff_max"], "mult_prob_error": m["mult_prob_error"],
           "chi2": m["chi2_token"], "chi2_seq": m["chi2_seq"], "ess": m["ess"], "ppl_ratio": m["ppl_ratio"],
           "prob_diff_max": m["prob_diff_max"],
           "fraction_above_log2": result["breakdowns"]["fraction_abs_log_ratio_above"]["log2"],
           "outside_support_tokens": float(result.get("outside_support_tokens", 0)),
           **{f"fraction_outside_{k}": v for k, v in result["breakdowns"]["fraction_ratio_outside"].items()},
           "fraction_outside_trainer_support": result.get("fraction_outside_trainer_support", 0.0)}
    notes = []
    kept_set = result.get("kept_set")
    out["kept_set_replayed"] = float(kept_set is not None and kept_set["applied"] == "replayed")
    out["kept_set_replayed_share"] = float(kept_set["replayed_share"]) if kept_set is not None else 0.0
    if out["kept_set_replayed"]:
        without = kept_set["without_replay"]
        out["fraction_outside_trainer_support_without_replay"] = without["fraction_outside_trainer_support"]
        out.update({f"fraction_outside_{k}_without_replay": v for k, v in without["fraction_ratio_outside"].items()})
    else:
        notes += [f"{name}: left out, no kept set was replayed (the figures without the suffix are already the "
                  "trainer's own recomputed set)" for name in SUMMARY_STATS if name.endswith("_without_replay")]
    if result.get("outside_mass") is not None:
        out["outside_mass"] = result["outside_mass"]
    else:
        notes.append("outside_mass: left out, nothing was truncated (top_k = -1, top_p = 1) or no logits are at hand")
    if entropy is None:
        notes += [f"entropy: {NO_LOGITS}", NO_ENTROPY]
    else:
        out["entropy"] = entropy
        if entropy > 0:  # prime-rl sets kl_ent_ratio only when the entropy is positive
            out["kl_over_entropy"] = m["kl_k3"] / entropy
        else:
            notes.append("kl_over_entropy: left out, the trainer's entropy is 0 (a deterministic policy)")
    if result.get("exact") is not None:
        out["differing_tokens"] = float(result["exact"]["differing_tokens"])
    if result.get("sequence_weight") is not None:
        dist = result["sequence_weight"]["distribution"]
        out.update({f"seq_log_weight_{k}": dist[f"log_{k}"] for k in ("min", "median", "max")})
    checks = result.get("engine_checks")
    if checks is not None:  # issue #69: each where it could be measured, else a note saying why not
        recomputed = checks["recomputed"]
        if recomputed["measured"]:
            out["recomputed_logprobs"] = float(recomputed["flagged"])
        else:
            notes.append(f"recomputed_logprobs: left out, {recomputed['verdict']}")
        out["fraction_engine_logprob_zero"] = checks["zero_logprobs"]["fraction"]
        for stat, part, value in (("entropy_gap", "entropy_gap", "abs_gap_mean"),
                                  ("retokenization_drift", "retokenization", "share")):
            if checks[part]["reported"]:
                out[stat] = checks[part][value]
            else:
                notes.append(f"{stat}: left out, {checks[part]['why'].removeprefix('not reported: ')}")
    trainer_check = (result.get("self_check") or {}).get("trainer")
    for part in ("packing", "micro_batch", "fp32_head"):
        stat = f"self_check_{part}_fraction_outside_0.9_1.1"
        if trainer_check is not None and "fraction_outside_0.9_1.1" in trainer_check[part]:
            out[stat] = trainer_check[part]["fraction_outside_0.9_1.1"]
        else:
            notes.append(f"{stat}: " + (NO_SELF_CHECK if trainer_check is None else trainer_check[part]["against"]))
    for row in result["what_if"]:
        for stat, column in PRESET_STATS.items():
            out[f"{stat}@{row['preset']}"] = row[column]
    return out, notes


def parse_bounds(items: list[str] | None, flag: str) -> list[tuple[str, float]]:
    """``["kl_k3=5e-4", "masked_fraction@verl:decoupled_seq_is_rs=0.05"]`` → [(stat, value)], checked
    before any work.

    Raises:
        ConfigError: not STAT=VALUE, a value that is not a number, an unknown STAT (the message
            lists the allowed names), or a rejected fraction of a preset that rejects nothing
            (``can_reject``: a gate that can never fail).
    """
    bounds = []
    for item in items or []:
        stat, sep, raw = item.rpartition("=")
        stat = stat.strip()
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not sep or not stat or math.isnan(value):
            raise ConfigError(f"{flag} {item!r}: expected STAT=VALUE with a number, e.g. {flag} kl_k3=5e-4")
        name, at, preset = stat.partition("@")
        known = (name in PRESET_STATS and preset in presets.names()) if at else name in SUMMARY_STATS
        if not known:
            raise ConfigError(
                f"{flag} {item!r}: unknown STAT {stat!r}. Allowed: {', '.join(SUMMARY_STATS)}; per preset "
                f"{', '.join(s + '@PRESET' for s in PRESET_STATS)} with PRESET one of {', '.join(presets.names())}")
        if name in ("masked_fraction", "seq_masked_fraction") and not can_reject(preset):
            raise ConfigError(
                f"{flag} {item!r}: {preset} rejects no token (no rejection rule, and non-finite values are "
                f"{presets.correction(preset).nonfinite}, not masked), so {stat} is 0 on every batch and this bound "
                f"cannot gate anything. Gate a preset that rejects, e.g. {name}@verl:decoupled_seq_is_rs "
                "(offpolicy presets lists them)")
        bounds.append((stat, value))
    return bounds


def bounds(config: DiagnoseConfig) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The gate's (``--fail-above``, ``--fail-below``) bounds of ``config`` (``parse_bounds``)."""
    return parse_bounds(config.fail_above, "--fail-above"), parse_bounds(config.fail_below, "--fail-below")


def gate_failures(config: DiagnoseConfig, reports: list[dict[str, Any]]) -> list[str]:
    """One line per failed bound of ``config``'s gate over every setting's report (prefixed by the setting's
    name when there are several); empty when every bound holds.

    Raises:
        ConfigError: a bounded STAT a report does not hold (``gate``).
    """
    above, below = bounds(config)
    failed = []
    for r in reports:
        prefix = f"{r['setting']['name']}: " if len(reports) > 1 else ""
        failed += [prefix + line for line in gate(r["summary"], above, below, r["summary_notes"])]
        engine = (r.get("provenance") or {}).get("engine")
        line = exact_failure(r["exact"], engine) if getattr(config, "require_exact", False) else None
        if line:
            failed.append(prefix + line)
    return failed


def can_reject(preset: str) -> bool:
    """Whether ``preset``'s correction can take a token out of the mask: a rejection rule, or a
    ``nonfinite`` policy that masks (under ``error`` a bad value raises, under ``neutral`` it is kept)."""
    corr = presets.correction(preset)
    return bool(corr.reject) or corr.nonfinite in ("mask_token", "mask_sequence")


def gate(values: dict[str, float], above: list[tuple[str, float]], below: list[tuple[str, float]],
         notes: list[str] = ()) -> list[str]:
    """One line per failed bound: a value above its ``--fail-above`` bound or below its ``--fail-below``
    bound, or not a number (NaN never passes a gate).

    Raises:
        ConfigError: a bounded STAT this report does not hold (e.g. kl_over_entropy on a dump).
    """
    failed = []
    for flag, bounds, worse in (("--fail-above", above, lambda v, b: v > b), ("--fail-below", below, lambda v, b: v < b)):
        for stat, bound in bounds:
            if stat not in values:
                why = next((n for n in notes if n.startswith(stat.split("@")[0] + ":")), "not in this report")
                raise ConfigError(f"{flag} {stat}: {why}")
            value = values[stat]
            if math.isnan(value) or worse(value, bound):
                side = "above" if flag == "--fail-above" else "below"
                failed.append(f"FAIL {stat} = {value:.6g} is {side} the bound {bound:g} ({flag} {stat}={bound:g})")
    return failed


def plot(s: Sample, out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mask = s.batch.mask.bool()
    log_ratio = (s.trainer - s.batch.rollout_logprobs)[mask]
    prob = s.trainer.exp()[mask]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    lo, hi = (float(log_ratio.min()), float(log_ratio.max())) if log_ratio.numel() else (0.0, 0.0)
    # a (near-)constant log ρ — e.g. every token shifted alike — has no 80 finite bins inside [lo, hi]
    span = (lo, hi) if hi - lo > 1e-6 * max(1.0, abs(lo)) else (lo - 0.5, hi + 0.5)
    ax.hist(log_ratio.numpy(), bins=80, range=span, color="#3a6ea5", log=True)
    ax.set_xlabel("log ρ = log π_train − log μ_engine")
    ax.set_ylabel("tokens (log scale)")
    ax.set_title(f"{title}: log-ratio histogram", fontsize=10)
    ax.axvline(0, color="k", lw=0.5)
    paths.append(out_dir / "log_ratio_hist.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.scatter(prob.numpy(), log_ratio.numpy(), s=3, alpha=0.3, color="#3a6ea5")
    ax.set_xscale("log")
    ax.set_xlabel("π_train(y_t) of the sampled token (log scale)")
    ax.set_ylabel("log ρ")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_title(f"{title}: mismatch against token probability", fontsize=10)
    paths.append(out_dir / "log_ratio_vs_prob.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    lr = (s.trainer - s.batch.rollout_logprobs)
    k3 = ops.k3(lr, None) * s.batch.mask
    counts = s.batch.mask.sum(0)
    per_pos = (k3.sum(0) / counts.clamp(min=1))[counts > 0]
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.plot(per_pos.numpy(), marker="o", ms=3, color="#3a6ea5")
    ax.set_xlabel("response token position")
    ax.set_ylabel("mean k3 = ρ − 1 − log ρ")
    ax.set_title(f"{title}: mismatch KL per position", fontsize=10)
    ax.grid(alpha=0.3)
    paths.append(out_dir / "kl_per_position.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def within_support(s: Sample) -> tuple[Sample, float]:
    """``s`` without the tokens the trainer gives no finite log-prob, and their share of the sampled tokens.

    Under top-k/top-p each side keeps its own set: a token near the edge of the engine's set can lie outside
    the trainer's (log π = −inf there), and no ratio exists for it. Those tokens are counted
    (``Sample.outside_support``; ``score_batch`` has already taken out the ones it scored) and left out of
    every other number — which would otherwise stop on the non-finite value. The share is
    outside / (outside + tokens that count), over every token the engine sampled."""
    mask = s.batch.mask
    outside = mask.bool() & ~torch.isfinite(s.trainer)
    if bool(outside.any()):
        batch = replace(s.batch, mask=mask * ~outside)
        s = replace(s, batch=batch, trainer=torch.where(outside, 0.0, s.trainer),
                    outside_support=s.outside_support + int(outside.sum()))
    sampled = float(s.batch.mask.sum()) + s.outside_support
    return s, s.outside_support / max(sampled, 1.0)


def checks_of_the_engine(s: Sample, exact: dict[str, Any], kept_count: torch.Tensor | None) -> dict[str, Any]:
    """``report.json``'s ``engine_checks`` (``offpolicy.measure.engine_checks``, issue #69): log-probs recomputed
    rather than sampled, engine log-probs exactly 0 where the trainer's are not, the entropy gap over the kept set,
    and the retokenisation drift where the engine returned text. ``s`` is counted within the trainer's support."""
    sides = s.sides or {}
    no_entropy = ("not reported: a dump holds log-probs only, no engine top-k log-probs or trainer logits"
                  if s.token_entropy is None else None)
    return {"recomputed": engine_checks.recomputed(exact, sides.get("engine"), sides.get("trainer"),
                                                   determinism=(s.engine or {}).get("determinism")),
            "zero_logprobs": engine_checks.zero_logprobs(s.trainer, s.batch.rollout_logprobs, s.batch.mask, kept_count),
            "entropy_gap": engine_checks.entropy_gap(s.token_entropy, s.engine_entropy, s.batch.mask, no_entropy),
            "retokenization": s.retokenization or {
                "reported": False, "why": "not reported: the engine returned token ids, no text (a server's "
                "completions or a dump with text carry it)"}}


def report(s: Sample, setting: dict[str, Any], out_dir: Path, plots: bool = True,
           self_check: dict[str, Any] | None = None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of one setting (module doc); ``self_check``: ``--self-check``'s section, when it ran;
    ``settings``: the run's flags that differ from their defaults (the provenance block's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    kept_set = kept_set_report(s)  # before within_support: "without replay" has its own outside tokens
    exact = exactness(s)  # before within_support: a token outside the trainer's support is a difference too
    # the kept set's size per token where the trainer replayed the engine's (zero_logprobs); before within_support
    kept_count = s.batch.kept.count if s.batch.kept is not None and s.without_replay is not None else None
    s, outside = within_support(s)
    tokens = float(s.batch.mask.sum()) + s.outside_support  # every token the engine sampled
    result = {
        "setting": setting,
        "samples": len(s.batch.mask),
        "tokens": tokens,
        "outside_support_tokens": s.outside_support,  # left out of every statistic (within_support)
        "engine_tokens_per_s": None if s.seconds is None else tokens / max(s.seconds, 1e-9),
        "fraction_outside_trainer_support": outside,
        "outside_mass": s.outside_mass,
        "kept_set": kept_set,
        "mismatch": mismatch(s),
        "breakdowns": breakdowns(s),
        "what_if": what_if(s),
        "exact": exact,
        "sequence_weight": sequence_weight.precheck(s.trainer - s.batch.rollout_logprobs, s.batch.mask,
                                                    {name: presets.correction(name) for name in presets.names()}),
        "engine_checks": checks_of_the_engine(s, exact, kept_count),
        # the engine on record and the code, stack and machine (one provenance block), and the speed paths
        "provenance": provenance.block(settings, s.engine),
        "speed_paths": s.speed_paths,
    }
    if self_check is not None:
        result["self_check"] = self_check
    result["summary"], result["summary_notes"] = summary(result, s.entropy)
    if plots:
        label = setting.get("label") or f"{setting['engine']} {setting['engine_dtype']} vs trainer {setting['trainer_dtype']}"
        result["plots"] = [str(p) for p in plot(s, out_dir, label)]
    # per token, for report.html (offpolicy.measure.viewer): each response's tokens with log π, log μ, the trainer's
    # entropy, and what each preset does to each token (presets that agree share one group)
    result["sequences"] = viewer.sequences(s.trainer, s.batch.rollout_logprobs, s.batch.mask, s.token_text,
                                           s.token_entropy, s.prompt_text)
    result["token_verdicts"] = viewer.token_verdicts(s.trainer, s.batch.rollout_logprobs, s.batch.mask)
    return result


# ------------------------------------------------------------------ one run: config in, reports written
@dataclass
class Diagnosis:
    """What ``run`` wrote: each setting's report (``report``), report.json, report.html, the plots, and
    where the trackers of ``--log-to`` stored their copy (name → place)."""

    reports: list[dict[str, Any]]
    report_path: Path
    page: Path
    places: dict[str, str]

    @property
    def plots(self) -> list[str]:
        return [p for r in self.reports for p in r.get("plots", [])]


def write_atomically(path: Path, body: dict[str, Any]) -> None:
    """``body`` as JSON at ``path`` in one step (a temporary file beside it, then a rename): a run that
    fails or is stopped midway never leaves a half-written report."""
    import os
    import tempfile

    fd, staging = tempfile.mkstemp(prefix=".report-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def run(config: DiagnoseConfig, console) -> Diagnosis:
    """``offpolicy diagnose``: sample (an engine in each setting, the server of ``engine_url``) or read a dump
    (``batch``), score with the trainer, and write report.json (atomically), the plots and report.html into
    ``config.out``, and the summary, what-if table and plots to the trackers of ``log_to``. Progress goes to
    ``console``; the tables are the caller's to print.

    Raises:
        ConfigError: a model, prompt or data file that cannot be used; ServerError: the server failed.
    """
    from offpolicy.trackers import open_trackers, parse_log_to

    bounds(config)  # a mistyped gate fails now, not after sampling
    out = Path(config.out)
    names = parse_log_to(config.log_to)
    trackers = None
    if names:  # a missing tracker is one line now, before any sampling
        out.mkdir(parents=True, exist_ok=True)
        trackers = open_trackers(names, out, out.resolve().name, config.model_dump(exclude={"api_key_env"}), console)
    reports = _batch_reports(config, console) if config.batch else _sampled_reports(config, console)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "report.json", reports[0] if len(reports) == 1 else {"runs": reports})
    views = [viewer.diagnose_view(r, out) for r in reports]
    page = viewer.write_html(out / "report.html", views, f"offpolicy diagnose — {out.resolve().name}")
    return Diagnosis(reports, out / "report.json", page, _to_trackers(trackers, reports))


def _to_trackers(trackers, reports: list[dict[str, Any]]) -> dict[str, str]:
    """Every setting's summary, what-if table and plots to ``trackers`` (prefixed by the setting's name when
    there are several); returns where each tracker stored them."""
    if not trackers:
        return {}
    columns = ["preset", "token_rejected", "seq_rejected", "weight_mean", "weight_min", "weight_max", "ess"]
    for r in reports:
        prefix = f"{r['setting']['name']}/" if len(reports) > 1 else ""
        trackers.log_summary({prefix + k: v for k, v in r["summary"].items()})
        trackers.log_table(prefix + "what_if", 0, columns, [[row[c] for c in columns] for row in r["what_if"]])
        trackers.log_images(0, {prefix + Path(p).stem: Path(p) for p in r.get("plots", [])})
    trackers.close()
    return trackers.places()


def run_settings(config: DiagnoseConfig) -> dict[str, Any]:
    """The flags that differ from their defaults: the provenance block's ``settings``."""
    return config.model_dump(mode="json", exclude_defaults=True, exclude={"api_key_env"})


def _batch_reports(config: DiagnoseConfig, console) -> list[dict[str, Any]]:
    """``--batch FILE_OR_DIR``: the report on tensors a host framework dumped (with ``--model``, its text, where it
    holds some, re-encoded with that model's tokenizer)."""
    tokenizer = None
    if config.model != "default":
        from offpolicy.policy.warmstart import model_dir
        from offpolicy.tasks.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir(config.model, config.warm_start_spec()))
    s, source = from_dump(Path(config.batch), tokenizer)
    name = "batch " + ", ".join(source["hosts"])
    console.print(f"diagnose: {config.batch} ({len(source['files'])} file(s), {len(s.batch.mask)} samples) ...")
    print_on_record(console, s)
    return [report(s, {"name": name, "label": name, "batch": str(config.batch), **source}, Path(config.out),
                   settings=run_settings(config))]


def _sampled_reports(config: DiagnoseConfig, console) -> list[dict[str, Any]]:
    """Sample in each setting (or through the server), score with the trainer, one report each."""
    from offpolicy.policy.score import resolve_device, resolve_dtype
    from offpolicy.policy.warmstart import model_dir, warm_start_progress
    from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer

    device = resolve_device(config.trainer.device)
    threads = config.trainer.threads
    if threads != "auto":  # as train's trainer.threads (torch's own setter: vLLM's CPU worker replaces the public one)
        torch._C.set_num_threads(threads)
    budget = config.trainer.budget(MICRO_BATCH_TOKENS)
    settings = config.settings()
    for setting in settings:  # the trainer's numerics are train's: its dtype resolution, its forward
        setting["trainer_dtype"] = resolve_dtype(setting["trainer_dtype"], device)[0]
    model_path = model_dir(config.model, config.warm_start_spec(), warm_start_progress(console))
    tokenizer = load_tokenizer(model_path)
    ensure_pad_token(tokenizer)
    prompts = _prompts(config, tokenizer)
    server = config.server()
    if server is not None:
        trainer = TrainerSide(model_path, config.sampling_config(), settings[0]["trainer_dtype"], device, budget,
                              config.trainer.cpu_linear)
        return [_server_report(config, console, server, trainer, tokenizer, prompts)]
    _resolve_auto_engines(config, settings, model_path, device, console)
    out, reports = Path(config.out), []
    for setting in settings:
        sampling = config.sampling_config(engine=setting["engine"])
        name = f"{setting['engine']}-{setting['engine_dtype']}-vs-{setting['trainer_dtype']}"
        if setting["logit_noise"]:
            name += f"-noise{setting['logit_noise']}"
        console.print(f"diagnose: {name} on {len(prompts)} samples ...")
        trainer = TrainerSide(model_path, sampling, setting["trainer_dtype"], device, budget, config.trainer.cpu_linear)
        s = sample(trainer, tokenizer, prompts, setting["engine"], setting["engine_dtype"], seed=config.seed,
                   logit_noise=setting["logit_noise"], log_path=out / "engine.log",
                   max_model_len=max(map(len, prompts)) + sampling.max_tokens,
                   vllm_options=config.vllm_options() if setting["engine"] == "vllm" else None,
                   gpu_memory_utilization=config.engine.gpu_memory_utilization)
        print_on_record(console, s)
        checked = _self_check(config, console, s, trainer, setting["engine_dtype"])
        reports.append(report(s, {**setting, "name": name, "model": str(model_path), "sampling": sampling.__dict__},
                              out / name if len(settings) > 1 else out, self_check=checked,
                              settings=run_settings(config)))
    return reports


def _resolve_auto_engines(config: DiagnoseConfig, settings: list[dict[str, Any]], model_path: Path, device,
                          console) -> None:
    """Each setting's engine ``auto`` as train resolves it (``offpolicy.engines.choice.choose``: by the device, the
    model's parameters and its vocabulary), printed with its reason; the settings are updated in place."""
    if all(setting["engine"] != "auto" for setting in settings):
        return
    from transformers import AutoConfig

    from offpolicy.engines.choice import choose

    model = AutoConfig.from_pretrained(model_path)
    parameters = _parameter_count(model_path)
    for setting in settings:
        if setting["engine"] == "auto":
            setting["engine"], why = choose(device, parameters, model.vocab_size, logit_noise=setting["logit_noise"],
                                            vllm_options_set=bool(config.engine.vllm.set_options()))
            console.print(f"diagnose: engine {setting['engine']} ({why})")


def _parameter_count(model_path: Path) -> int:
    """The model's parameters, from its safetensors headers (no weight is read)."""
    import json
    import struct

    total = 0
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for n in entry["shape"]:
                    count *= n
                total += count
    if total == 0:
        raise ConfigError(f"{model_path}: no *.safetensors weights to count for --engine auto; name the engine "
                          "(--engine vllm or --engine hf)")
    return total


def _prompts(config: DiagnoseConfig, tokenizer) -> list[list[int]]:
    """``config.n`` prompts as token ids, cycling through ``--data``, ``--prompts`` or the task's problems.

    Raises:
        ConfigError: a prompt that renders to no token.
    """
    from offpolicy.tasks import make_task, problems
    from offpolicy.tasks.dataset import dataset_prompts
    from offpolicy.tasks.tokenizer import prompt_ids

    if config.data:  # the same data.* fields, chat template and prompt limit as task=dataset
        prompts = dataset_prompts(config.data_config(), tokenizer, config.max_prompt_tokens)
    elif config.prompts:
        prompts = read_prompts(Path(config.prompts), tokenizer)
    else:
        prompts = [prompt_ids(tokenizer, p) for p in problems(make_task(config.task), config.n, seed=config.seed)]
    prompts = [prompts[i % len(prompts)] for i in range(config.n)]
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None:  # before a request goes out or an engine starts (score refuses it too)
        raise ConfigError(f"prompt {empty} renders to no token; the first response token is scored from the "
                          "prompt's last one: give every prompt some text")
    return prompts


def _server_report(config: DiagnoseConfig, console, server, trainer: TrainerSide, tokenizer,
                   prompts: list[list[int]]) -> dict[str, Any]:
    """Sample through the server, score with the trainer: its report (nothing is written before it is whole)."""
    from rich.text import Text

    console.print(f"diagnose: {server.url} on {len(prompts)} samples ({server.concurrency} in flight) ...")
    s, info = sample_server(server, trainer, tokenizer, prompts, seed=config.seed, console=console)
    print_on_record(console, s)
    for note in info["notes"]:
        console.print(Text(f"note: {note}", style="yellow"))
    console.print(Text(f"log-probs: {info['logprob_check']['verdict']}; prompt ids: {info['alignment']['prompt_ids']}"))
    if info.get("sampling_mask"):  # --sampling-mask: how many tokens carried a mask, and were scored on it
        m, kept = info["sampling_mask"], kept_set_report(s)
        console.print(Text(f"sampling masks ({m['engine']}, {m['endpoint']}): {m['tokens_with_mask']} of {m['tokens']} "
                           f"tokens carried one (mean {m['kept_ids_mean']:.1f} ids, max {m['kept_ids_max']}); the "
                           f"trainer replayed them on {kept['replayed_tokens']} of {kept['tokens']} counted tokens "
                           f"({kept['replayed_share']:.0%}); kept ids' log-probs: {m['kept_logprobs']}"))
    if info.get("head"):  # --head-logprobs: the sampler's top-k and the share of its mass they cover
        h = info["head"]
        console.print(Text(f"head (top-{h['k']} log-probs, {h['endpoint']}): {h['tokens_with_head']} of {h['tokens']} "
                           f"tokens carried one (mean {h['ids_mean']:.1f} ids); head mass Σ q_v mean "
                           f"{h['mass_mean']:.3f}, min {h['mass_min']:.3f}; the sampled id in it on "
                           f"{h['sampled_in_head_share']:.0%} of tokens; its log-probs checked (finite, ≤ 0, the "
                           "sampled id's equal to log μ)"))
    dtype = trainer.dtype
    setting = {"engine": "server", "engine_dtype": "as served", "trainer_dtype": dtype, "name": f"server-vs-{dtype}",
               "label": f"server {info['served_model']} vs trainer {dtype}", "model": str(trainer.model_path),
               "sampling": trainer.sampling.__dict__, "server": info}
    return report(s, setting, Path(config.out), self_check=_self_check(config, console, s, trainer,
                                                                        config.settings()[0]["engine_dtype"]),
                  settings=run_settings(config))


def _self_check(config: DiagnoseConfig, console, s: Sample, trainer: TrainerSide, engine_dtype: str
                ) -> dict[str, Any] | None:
    """``--self-check`` on the sample's tokens (``offpolicy.measure.self_check``); None without the flag."""
    if not getattr(config, "self_check", False):
        return None
    from offpolicy.measure import self_check
    layers = "no per-layer attribution (the engine's precision is fp32)" if engine_dtype == "fp32" else \
        f"{engine_dtype} against fp32 layer by layer"
    console.print(f"diagnose: --self-check: the trainer ({trainer.dtype}) against itself, and {layers} ...")
    return self_check.run(s.batch, trainer.scorer(), trainer.model_path, engine_dtype, trainer.sampling.temperature)


def print_on_record(console, s: Sample, prefix: str = "") -> None:
    """The header of a setting: the engine on record (name, version, dtype, attention backend, determinism
    switches) and each gated speed path that ran, with why (as train's header prints them)."""
    from rich.text import Text

    console.print(Text(f"  {prefix}engine: {engine_checks.describe(s.engine)}"))
    if s.speed_paths is None:
        console.print(Text(f"  {prefix}speed paths: not recorded (a dump holds the tensors, not the run's paths)"))
    for gate, reason in (s.speed_paths or {}).items():
        console.print(Text(f"  {prefix}{gate}: {reason}"))


def print_engine_checks(console, r: dict[str, Any], prefix: str = "") -> None:
    """One line per check of what the engine returned (``engine_checks``; issue #69): a flag in yellow."""
    from rich.text import Text

    checks = r.get("engine_checks")
    if checks is None:
        return
    rec = checks["recomputed"]
    console.print(Text(f"{prefix}recomputed log-probs: {rec['verdict']}", style="yellow" if rec["flagged"] else ""))
    zero = checks["zero_logprobs"]
    line = (f"{prefix}engine log-probs exactly 0 where log π < {zero['below']:g}: {zero['suspect_tokens']} of "
            f"{zero['tokens']} tokens ({zero['fraction']:.4f})")
    if zero["first"] is not None:
        f = zero["first"]
        line += (f"; the first is row {f['row']}, position {f['position']} (log π = {f['trainer_logprob']:.4g}): "
                 "a sampler cannot have drawn it with probability 1")
    console.print(Text(line, style="yellow" if zero["suspect_tokens"] else ""))
    gap = checks["entropy_gap"]
    console.print(Text(f"{prefix}entropy gap: " + (
        f"H_π {gap['trainer_entropy_mean']:.4g}, H_μ {gap['engine_entropy_mean']:.4g} over the kept set, mean "
        f"|ΔH| {gap['abs_gap_mean']:.3g} (max {gap['abs_gap_max']:.3g}) on {gap['covered_tokens']} of "
        f"{gap['tokens']} tokens ({gap['source']} cover ≥ {gap['coverage']:g} of the mass)"
        if gap["reported"] else gap["why"])))
    retok = checks["retokenization"]
    if not retok["reported"]:
        console.print(Text(f"{prefix}retokenisation drift: {retok['why']}"))
        return
    line = (f"{prefix}retokenisation drift ({retok['source']}): {retok['rows_differing']} of {retok['rows']} rows "
            f"re-encode to other ids ({retok['share']:.1%})")
    if retok["first"] is not None:
        f = retok["first"]
        line += (f"; the first is row {f['row']}, {f['in']} position {f['response_position']}: sampled "
                 f"{f['sampled']} {f['sampled_tokens']}, re-encoded {f['reencoded']} {f['reencoded_tokens']}")
    console.print(Text(line, style="yellow" if retok["rows_differing"] else ""))


def print_checks(console, reports: list[dict[str, Any]]) -> None:
    """The checks of issue #56 after the tables: the sequence weight's distribution and the pre-check's
    warnings, whether the log-ratios are exactly 0, and ``--self-check``'s tables."""
    from rich.table import Table
    from rich.text import Text

    for r in reports:
        prefix = f"{r['setting']['name']}: " if len(reports) > 1 else ""
        seq = r.get("sequence_weight")
        if seq is not None:
            d = seq["distribution"]
            console.print(f"{prefix}sequence weight Π ρ before truncation over {d['rows']:.0f} rows: log min "
                          f"{d['log_min']:.4g}, median {d['log_median']:.4g}, max {d['log_max']:.4g} (Π ρ {d['min']:.4g}"
                          f" … {d['median']:.4g} … {d['max']:.4g}); mean log ρ a token {seq['mean_log_ratio']:.3g}")
            for line in seq["warnings"]:
                console.print(Text(f"warning: {prefix}{line}", style="yellow"))
        if r.get("exact") is not None:
            console.print(Text(prefix + exact_verdict(r)))
        print_engine_checks(console, r, prefix)
        check = r.get("self_check")
        if check is None:
            continue
        table = Table(title=f"{prefix}self-check: the trainer against itself (configured: "
                      f"{check['trainer']['configured']['dtype']}, {check['trainer']['configured']['micro_batches']} "
                      "micro-batch(es))")
        for col in ("configured against", "ρ outside [0.9, 1.1]", "differing", "mean |Δ log π|", "max |Δ log π|"):
            table.add_column(col, justify="right" if col != "configured against" else "left")
        for part in ("packing", "micro_batch", "fp32_head", "fp32"):
            row = check["trainer"][part]
            if "tokens" not in row:
                table.add_row(row["against"], "–", "–", "–", "–")
                continue
            table.add_row(row["against"], f"{row['fraction_outside_0.9_1.1']:.4f}", f"{row['fraction_differing']:.4f}",
                          f"{row['abs_log_diff_mean']:.3g}", f"{row['abs_log_diff_max']:.3g}")
        console.print(table)
        layers = check["layers"]
        if not layers["layers"]:
            console.print(f"{prefix}per-layer attribution: {layers.get('note', 'none')}")
            continue
        table = Table(title=f"{prefix}where {layers['engine_dtype']} diverges from fp32 ({layers['rows']} sequences): "
                      f"first above {layers['threshold']:g}: {layers['first_above_threshold']}; largest step: "
                      f"{layers['largest_step']}")
        for col in ("layer", "‖Δh‖/‖h‖", "step"):
            table.add_column(col, justify="right")
        for row in layers["layers"]:
            table.add_row(row["layer"], f"{row['relative_difference']:.3e}", f"{row['step']:+.2e}")
        head = layers["head"]
        table.add_row("head: |Δ log π| mean / max", f"{head['abs_log_diff_mean']:.3g}", f"{head['abs_log_diff_max']:.3g}")
        console.print(table)
