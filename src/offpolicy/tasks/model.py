"""A tiny Qwen2-architecture causal LM built from a config (no download).

Defaults give ~0.8M parameters: 4 layers, width 128, 4 heads (2 KV heads), tied embeddings.
Any Hugging Face causal LM saved locally works the same way (pass its path instead).
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, PreTrainedTokenizerBase


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_positions: int = 128,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2ForCausalLM sized for ``tokenizer`` (fp32, seeded)."""
    vocab = 64 * ((len(tokenizer) + 63) // 64)  # round up: friendlier to kernels, unused ids never sampled
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)
