"""Run by tests/test_vllm.py in its own process (vLLM changes process-wide state): after a weight
sync no request is served from prefix-cache KV computed by the older weights, even where the
cache reset frees nothing (issue #46: NeMo-RL #4018 found KV up to 17 refits old). Prints one JSON
object: prefix-cache hits and the engine-vs-trainer log-prob gap of each phase."""

from __future__ import annotations

import json
import os
import tempfile


def check() -> dict:
    """The phases below on a fresh tiny Qwen2 and engine (fp32); the engine module's patches put back after."""
    import offpolicy.engines.vllm as ev

    # the CPU backend's default block is 128 tokens, longer than the tiny model's context: with 32
    # (its smallest) a 100-token prompt fills 3 blocks the prefix cache can reuse; stats on to count hits
    plain_kwargs, plain_salt = ev.llm_kwargs, ev.cache_salt
    ev.llm_kwargs = lambda *a, **k: {**plain_kwargs(*a, **k), "block_size": 32, "disable_log_stats": False}
    try:
        return _phases(ev)
    finally:  # put back for whatever runs next in this process (tests/vllm_sync_check.py ... prefix)
        ev.llm_kwargs, ev.cache_salt = plain_kwargs, plain_salt


def _phases(ev) -> dict:
    import torch

    from offpolicy.engines import SamplingConfig
    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer
    from offpolicy.policy.batch import to_batch
    from offpolicy.policy.head import trainer_logprobs

    tok = build_char_tokenizer()
    trainer = build_tiny_qwen2(tok, seed=5)
    path = tempfile.mkdtemp()
    trainer.save_pretrained(path)
    tok.save_pretrained(path)
    engine = ev.VLLMEngine(path, dtype="fp32", seed=0)
    prompts = [[1] + [5 + (3 * i + j) % 40 for j in range(99)] for i in range(4)]
    sampling = SamplingConfig(max_tokens=4)

    def hits() -> int:
        return int(sum(m.value for m in engine.llm.get_metrics() if m.name == "vllm:prefix_cache_hits"))

    def phase(version: int, seed: int) -> dict[str, float]:
        before = hits()
        rollouts = engine.generate(prompts, sampling, seed=seed, version=version)
        batch = to_batch(rollouts, tok.pad_token_id)
        with torch.no_grad():
            ours = trainer_logprobs(trainer, batch, sampling)
        gap = ((ours - batch.rollout_logprobs).abs() * batch.mask).max().item()
        return {"hits": hits() - before, "max_gap": gap}

    def new_weights() -> None:
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_weights(trainer.state_dict().items())

    out = {"v0_first": phase(0, 1), "v0_again": phase(0, 2)}  # the cache works: same weights reuse it
    # a reset that frees nothing (requests holding blocks; an engine without one): the salt alone must do
    engine.llm.reset_prefix_cache = lambda *args, **kwargs: True
    new_weights()
    out["v1_after_sync"] = phase(1, 3)
    # control, what requests without a per-version salt get in the same situation
    ev.cache_salt = lambda version: "one-salt-for-every-version"
    phase(1, 4)  # v1's KV under the shared salt
    new_weights()
    out["v2_unsalted"] = phase(2, 5)
    engine.close()  # one engine a process at a time (vLLM's process-wide parallel state)
    return out


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    print("RESULT " + json.dumps(check()))
