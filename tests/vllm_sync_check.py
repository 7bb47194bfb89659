"""Run by tests/test_vllm.py in its own process (vLLM changes process-wide thread and seed
state): checks that weight sync is real. Prints one JSON object a check.

``vllm_sync_check.py DTYPE`` checks the sync the engine takes by default (the tiny Qwen2 on the CPU: the gated
direct sync); ``vllm_sync_check.py DTYPE weight_transfer`` the route through vLLM's public weight-transfer API
(issue #69 item 6), the direct sync's gate made to refuse the model (no families), and times its syncs against
vLLM's private reload_weights on the same engine, interleaved.

``vllm_sync_check.py DTYPE ROUTE ROUTE ...`` runs several checks one after another in this one process (one
interpreter start and one vLLM import for all, each check its own engines, one engine alive at a time), ``prefix``
being tests/vllm_prefix_check.py's; each prints its own ``RESULT`` line, its name under ``"check"``."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
import time


def check(dtype: str, route: str = "default") -> dict:
    """One route's check on a fresh tiny Qwen2 and engine (``weight_transfer``: the direct sync's gate refusing
    the model while it runs)."""
    if route != "weight_transfer":
        return _check(dtype, route)
    import dataclasses

    from offpolicy.engines import vllm as engine_module

    gate = engine_module.VLLM_DIRECT_SYNC
    engine_module.VLLM_DIRECT_SYNC = dataclasses.replace(gate, families=frozenset())
    try:
        return _check(dtype, route)
    finally:
        engine_module.VLLM_DIRECT_SYNC = gate


def _check(dtype: str, route: str) -> dict:
    import torch

    from offpolicy.engines import EngineError, SamplingConfig
    from offpolicy.engines.vllm import VLLMEngine
    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer
    from offpolicy.policy.batch import to_batch
    from offpolicy.policy.head import trainer_logprobs

    tok = build_char_tokenizer()
    trainer = build_tiny_qwen2(tok, seed=5)
    path = tempfile.mkdtemp()
    trainer.save_pretrained(path)
    tok.save_pretrained(path)
    engine = VLLMEngine(path, dtype=dtype, seed=0)
    prompts = [[1, 5, 6, 7, 17], [1, 43, 30, 47, 25, 8, 9, 17]] * 8

    def gap(sampling: SamplingConfig, seed: int, rows=prompts, keep: list | None = None) -> dict[str, float]:
        rollouts = engine.generate(rows, sampling, seed=seed, version=0)
        if keep is not None:
            keep.append(rollouts)
        batch = to_batch(rollouts, tok.pad_token_id)
        with torch.no_grad():
            ours = trainer_logprobs(trainer, batch, sampling)
        diff = (ours - batch.rollout_logprobs).abs() * batch.mask
        return {"max": diff.max().item(), "mean": (diff.sum() / batch.mask.sum()).item(), "tokens": batch.mask.sum().item()}

    plain = SamplingConfig(max_tokens=8)
    truncated = SamplingConfig(max_tokens=8, temperature=0.7, top_p=0.8, top_k=5)
    out = {"dtype": dtype, "at_start": gap(plain, 0)}
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out["without_sync"] = gap(plain, 1)
    start = time.perf_counter()
    engine.sync_weights(trainer.state_dict().items())
    out["sync_ms"] = (time.perf_counter() - start) * 1e3
    out["after_sync"] = gap(plain, 2)
    out["sync_route"], out["speed_paths"] = engine.sync_route, engine.speed_paths
    # the direct sync (issue #49) against vLLM's own loading: an engine started from the synced weights samples
    # the same tokens with the same log-probs, to the bit (same kernels, same packed weights)
    out["direct_sync_blockers"] = engine.direct_sync_blockers
    synced = engine.generate(prompts, plain, seed=2, version=0)
    # the engine asks vLLM for no text (detokenize=False): the same tokens and log-probs as with it
    import vllm

    params = vllm.SamplingParams
    vllm.SamplingParams = lambda *args, **kwargs: params(*args, **{**kwargs, "detokenize": True})
    texted = engine.generate(prompts, plain, seed=2, version=0)
    vllm.SamplingParams = params
    out["detokenize_same"] = texted.response_ids == synced.response_ids and texted.logprobs == synced.logprobs
    moved = tempfile.mkdtemp()
    trainer.save_pretrained(moved)
    tok.save_pretrained(moved)
    # a sync that leaves a parameter as it was is refused, naming it
    try:
        engine.sync_weights([(n, t) for n, t in trainer.state_dict().items() if n != "model.norm.weight"])
        out["partial_sync_error"] = None
    except EngineError as err:
        out["partial_sync_error"] = str(err)
    # vLLM loads q, k and v into one qkv_proj and counts it loaded after any one of them (issue #55): a sync
    # without one of them is refused too, naming the fused parameter and the tensor it lacks
    try:
        engine.sync_weights([(n, t) for n, t in trainer.state_dict().items()
                             if n != "model.layers.0.self_attn.k_proj.weight"])
        out["partial_shard_error"] = None
    except EngineError as err:
        out["partial_shard_error"] = str(err)
    engine.sync_weights(trainer.state_dict().items())
    out["after_sync_top_p_top_k_temperature"] = gap(truncated, 3)
    # min-p (issue #69): vLLM applies it to the whole distribution, then top-k/top-p (min_p_first)
    out["after_sync_min_p"] = gap(SamplingConfig(max_tokens=8, temperature=0.9, top_p=0.7, top_k=8, min_p=0.15,
                                                 min_p_order="min_p_first"), 6)

    def timed() -> float:
        start = time.perf_counter()
        engine.sync_weights(trainer.state_dict().items())
        return (time.perf_counter() - start) * 1e3

    if route == "weight_transfer":
        # one sync (the whole sync_weights, its checks included) through each route, alternating on this engine:
        # the public API against vLLM's private reload_weights (what the engine took before; its log watch installed
        # for the duration)
        from offpolicy.engines.vllm import _UnloadedWatch

        times: dict[str, list[float]] = {"weight_transfer": [], "reload_weights": []}
        engine._watch = _UnloadedWatch()
        for _ in range(10):
            for name in times:
                engine.sync_route = name
                times[name].append(timed())
        engine.sync_route = "weight_transfer"
        engine._watch.close()
        engine._watch = None
        out["sync_ms_by_route"] = times
        out["after_timed_syncs"] = gap(plain, 7)  # the last sync was the public route's: still the trainer's
        engine.close()
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(moved, ignore_errors=True)
        return out
    out["sync_ms_by_route"] = {"direct": [timed() for _ in range(10)]}
    # One batch over vLLM's CPU token budget (4,096 tokens an engine step): 48 prompts of 100 tokens (the
    # model has 128 positions). With chunked prefill on, vLLM split a seeded prompt here and rewound its
    # CPU generator: "CPU Generator does not use offset" (issue #30 item 1). Seeded per request, its first
    # rows must sample what they sample alone, and the log-probs must still be the trainer's.
    long_prompts = [[1] + [5 + (3 * i + j) % 40 for j in range(99)] for i in range(48)]
    short = SamplingConfig(max_tokens=2)
    runs: list = []
    out["over_budget"] = gap(short, 4, long_prompts, runs)
    alone = engine.generate(long_prompts[:4], short, seed=4, version=0)
    out["over_budget"].update({
        "prompt_tokens": sum(map(len, long_prompts)),
        "same_tokens_alone": runs[0].response_ids[:4] == alone.response_ids,
        "max_logprob_diff_alone": max(abs(a - b) for r, q in zip(runs[0].logprobs, alone.logprobs)
                                      for a, b in zip(r, q)),
    })
    engine.close()  # one engine a process at a time (vLLM's process-wide parallel state)
    engine = None  # the closures above hold the name: drop the engine itself
    gc.collect()
    fresh = VLLMEngine(moved, dtype=dtype, seed=0)
    started = fresh.generate(prompts, plain, seed=2, version=0)
    out["fresh_engine_same"] = (synced.response_ids == started.response_ids
                                and synced.logprobs == started.logprobs)
    fresh.close()
    for directory in (path, moved):  # the saved models (a few MB each) do not outlive the check
        shutil.rmtree(directory, ignore_errors=True)
    return out


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    dtype = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    for name in sys.argv[2:] or ["default"]:
        if name == "prefix":
            import vllm_prefix_check  # this script's folder is on sys.path

            result = vllm_prefix_check.check()
        else:
            result = check(dtype, name)
        gc.collect()
        print("RESULT " + json.dumps({"check": name, **result}), flush=True)
