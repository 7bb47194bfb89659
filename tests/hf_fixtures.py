"""A real-model stand-in for CI: a tiny Qwen2 with a byte-level BPE tokenizer trained here, on the
shipped word problems, with a ChatML chat template — saved with ``save_pretrained`` into a directory
laid out as a downloaded Qwen2-Instruct checkpoint is (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json). No download.

Like Qwen2-Instruct: EOS is ``<|im_end|>``, pad is ``<|endoftext|>``, there is no BOS, and
generation_config lists both end tokens, so a response ends on either.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "arith_word_problems.jsonl"
EVAL_DATA = REPO / "examples" / "data" / "arith_word_problems_eval.jsonl"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2's template renders it (without its default system message)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def train_bpe(vocab_size: int = 384):
    """A byte-level BPE (``tokenizers``) trained on the shipped questions and answers, as a
    ``PreTrainedTokenizerFast`` with Qwen2-Instruct's special tokens and ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator((t for r in rows for t in (r["question"], r["answer"])), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHATML,
                                   model_max_length=1024, clean_up_tokenization_spaces=False)


def save_tiny_qwen2(directory: Path, hidden_size: int = 32, num_layers: int = 2, seed: int = 0,
                    with_tokenizer: bool = True) -> Path:
    """Build, initialise (seeded) and save the tiny model (+ its tokenizer) into ``directory``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_bpe()
    config = Qwen2Config(vocab_size=64 * -(-len(tokenizer) // 64), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    if with_tokenizer:
        tokenizer.save_pretrained(directory)
    return directory
