"""Memory flat in the response length at a real vocabulary (issue #31): `offpolicy train` as a user types
it, in a subprocess, on a tiny Llama with a 49,152-token vocabulary (SmolLM2's), at T and 4T new
tokens. The child's peak RSS comes from the kernel (``os.wait4``'s rusage of that one child).

At 4efb1a7 the trainer held [B, L, V] logits, a gathered [B, T, V] and its fp32 temporaries, and the hf
engine stacked every step's [B, V] scores three times: 4T costs ~1.5 GB more than T here. With the
chunked head and the O(B·V) engine both runs peak inside a head chunk (a sampler of the child's RSS puts
the peak in ``_ChunkedHead.forward`` at T and at 4T alike), and what differs is the heap's state when
they get there: 22 to 76 MiB over six paired runs on the 2-core box (2026-11-26). The bound is half of
one fp32 [B, 4T, V] tensor (100 MB): above that noise, and below what keeping a single fp32 [B, T, V]
adds from T to 4T (151 MB), a fifteenth of the old growth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="task=dataset reads files through `datasets` (install.sh installs it)")

from hf_fixtures import DATA, train_bpe  # noqa: E402

VOCAB = 49_152
ROWS = 8  # prompts_per_step=2 × group_size=4
T = 32


@pytest.fixture(scope="module")
def no_stop_llama(tmp_path_factory) -> Path:
    """A tiny Llama (2 layers, width 64) with a 49,152-token head whose stop token is never drawn: its
    output row is 0 while the others are scaled so the logits have σ ≈ 8 — the stop token's logit 0 sits
    ~4σ below the best one at every step, P(stop) < e^-30. Every response runs to max_new_tokens,
    so the two runs really differ by 4× in length."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("no-stop-llama")
    # a tokenizer that covers the head, as a real model's does: offpolicy refuses one far smaller than the
    # model's vocab_size as incomplete tokenizer files
    tokenizer = train_bpe(family="llama", pad_vocab_to=VOCAB)
    assert len(tokenizer) == VOCAB
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        head = model.get_output_embeddings().weight  # [V, 64], N(0, 0.02²)
        head.mul_(50.0)  # N(0, 1): |h| = 8 after the final RMSNorm, so logits ~ N(0, 64)
        head[tokenizer.eos_token_id].zero_()
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id])
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def peak_rss_of_train(model: Path, out: Path, new_tokens: int) -> tuple[int, dict]:
    """Run `offpolicy train` for one step; return the child's peak RSS in bytes and its metrics row."""
    args = [sys.executable, "-m", "offpolicy", "train", f"model={model}", "task=dataset", f"data.path={DATA}",
            "reward=number", "engine=hf", "engine.dtype=fp32", "trainer.device=cpu", "prompts_per_step=2", "group_size=4",
            f"sampling.max_tokens={new_tokens}", "steps=1", "eval_problems=1", "eval_every=100", f"out_dir={out}",
            # the untrained model's answers all score 0 (no advantage signal): a KL term keeps a gradient, so the
            # step runs its backward and optimizer step rather than skipping them
            "loss.kl_coef=0.01", "loss.kl_to=rollout", "--no-progress"]
    with open(out.with_suffix(".log"), "w") as log:
        child = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, out.with_suffix(".log").read_text()[-3000:]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return usage.ru_maxrss * 1024, row  # Linux reports kilobytes


@pytest.mark.slow
@pytest.mark.xdist_group("real-model")  # one SmolLM2-sized run at a time: a step peaks near 11 GB RSS
def test_a_training_step_at_4x_the_response_length_costs_almost_no_more_memory(no_stop_llama, tmp_path):
    short_rss, short = peak_rss_of_train(no_stop_llama, tmp_path / "short", T)
    long_rss, long = peak_rss_of_train(no_stop_llama, tmp_path / "long", 4 * T)
    # the measurement means something: every response ran to its limit, and a real step was taken
    assert short["response_length"] == T and long["response_length"] == 4 * T
    assert short["truncated_share"] == 1.0 and long["truncated_share"] == 1.0
    assert long["offpolicy/grad_norm"] >= 0
    one_fp32_btv = ROWS * 4 * T * VOCAB * 4  # 201 MB
    growth = long_rss - short_rss
    assert growth < one_fp32_btv / 2, (f"peak RSS {short_rss / 2**20:.0f} MiB at T={T}, {long_rss / 2**20:.0f} MiB "
                                       f"at 4T: +{growth / 2**20:.0f} MiB")
