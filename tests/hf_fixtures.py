"""A real-model stand-in for CI: a tiny Qwen2 with a byte-level BPE tokenizer trained here, on the
shipped word problems, with a ChatML chat template — saved with ``save_pretrained`` into a directory
laid out as a downloaded Qwen2-Instruct checkpoint is (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json). No download.

Like Qwen2-Instruct: EOS is ``<|im_end|>``, pad is ``<|endoftext|>``, there is no BOS, and
generation_config lists both end tokens, so a response ends on either. ``family="qwen3"`` builds the
same with Qwen3's architecture (q/k norms); ``family="llama"`` is laid out as Llama 3 is: a BOS token
that its chat template writes itself (``{{ bos_token }}``), no pad token, one end token.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data" / "arith_word_problems.jsonl"


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` imported by its name: benchmarks/ joins sys.path for good, since pool workers
    a benchmark spawns unpickle its objects by that name (they inherit sys.path)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module(name)
EVAL_DATA = REPO / "examples" / "data" / "arith_word_problems_eval.jsonl"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
# ChatML, as Qwen2's template renders it (without its default system message)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA = "{{ bos_token }}" + CHATML  # Llama 3's template starts with the BOS it wants


def train_bpe(vocab_size: int = 384, family: str = "qwen2", pad_vocab_to: int | None = None):
    """A byte-level BPE (``tokenizers``) trained on the shipped questions and answers, as a
    ``PreTrainedTokenizerFast`` with Qwen2-Instruct's special tokens and ChatML template.

    ``pad_vocab_to``: a real vocabulary's size (49,152; 151,936) without a corpus to learn it from: the
    trained vocabulary is extended with entries no merge produces (``<reserved_i>``), in the BPE model
    itself. Not as added tokens: transformers deep-copies every added token when it loads or saves a
    tokenizer (~4 s each way for 49k of them), and a real vocabulary lives in the model too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator((t for r in rows for t in (r["question"], r["answer"])), trainer=trainer)
    if pad_vocab_to is not None:
        spec = json.loads(core.to_str())
        vocab = spec["model"]["vocab"]
        start = max(vocab.values()) + 1
        if start > pad_vocab_to:
            raise ValueError(f"the trained vocabulary ({start}) is already larger than {pad_vocab_to}")
        vocab.update({f"<reserved_{i}>": i for i in range(start, pad_vocab_to)})
        core = Tokenizer.from_str(json.dumps(spec))
    if family == "llama":
        return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
                                       additional_special_tokens=["<|im_start|>"], chat_template=LLAMA,
                                       model_max_length=1024, clean_up_tokenization_spaces=False)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHATML,
                                   model_max_length=1024, clean_up_tokenization_spaces=False)


def save_tiny_qwen2(directory: Path, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                    with_tokenizer: bool = True, family: str = "qwen2", tokenizer=None) -> Path:
    """Build, initialise (seeded) and save the tiny model (+ its tokenizer: ``train_bpe``'s unless given)
    into ``directory``. Heads of width 32: vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112,
    128 ..., not 16."""
    import torch
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    tokenizer = tokenizer if tokenizer is not None else train_bpe(family=family)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    config = config_cls(vocab_size=64 * -(-len(tokenizer) // 64), hidden_size=hidden_size,
                        intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=2, head_dim=hidden_size // 2,
                        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = model_cls(config)
    ends = [tokenizer.eos_token_id] if family == "llama" else [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config = GenerationConfig(eos_token_id=ends, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    if with_tokenizer:
        tokenizer.save_pretrained(directory)
    return directory


# the tiny shape the host tests (TRL, verl) train: one layer, heads of 16, a short context
HOST_SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
              "max_positions": 64}
# the trainer tests' shape (micro-batching, top-k/top-p support): two layers, heads of 16
TRAINER_SHAPE = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


def char_model(**shape):
    """The embedded model's architecture (``offpolicy.tasks.model.build_tiny_qwen2``, ``shape`` its options,
    ``seed`` included) over the character tokenizer."""
    from offpolicy.tasks.model import build_tiny_qwen2
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    return build_tiny_qwen2(build_char_tokenizer(), **shape)


def char_model_dir(directory: Path, *, with_tokenizer: bool = True, **shape) -> Path:
    """``char_model(**shape)`` saved into ``directory`` with the character tokenizer (unless ``with_tokenizer``
    is False): a model directory train, diagnose and the hosts load."""
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    char_model(**shape).save_pretrained(directory)
    if with_tokenizer:
        build_char_tokenizer().save_pretrained(directory)
    return directory
