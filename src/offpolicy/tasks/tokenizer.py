"""A character-level tokenizer built in code, as a Hugging Face ``PreTrainedTokenizerFast``.

One token per character, plus ``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>``. Saved with the model
(``save_pretrained``) so that transformers and vLLM load the same vocabulary from the run
directory — no download, no external file.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = "0123456789+-*=<>:|,.? abcdefghijklmnopqrstuvwxyz"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Vocabulary: the four special tokens, then ``CHARACTERS`` in order (ids are stable)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer. The character tokenizer is loaded as itself: ``AutoTokenizer`` would
    pick the model family's class (``Qwen2Tokenizer``), whose own pre-tokenizer drops spaces."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    spec = Path(path) / "tokenizer.json"
    if spec.is_file():
        data = json.loads(spec.read_text())
        vocab = data.get("model", {}).get("vocab", {})
        if data.get("model", {}).get("type") == "WordLevel" and all(tok in vocab for tok in SPECIAL):
            return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def ensure_pad_token(tokenizer) -> str | None:
    """Give a tokenizer without a pad token (Llama's) its EOS as pad — padding is masked everywhere it
    is read, so its id never matters; returns what was done (for the run's config.yaml), or None.

    Raises:
        ValueError: the tokenizer has neither a pad nor an EOS token (responses could never end).
    """
    if tokenizer.pad_token_id is not None:
        return None
    if tokenizer.eos_token is None:
        raise ValueError("the tokenizer has neither a pad token nor an EOS token; responses could never end. "
                         "Fix: set eos_token (and pad_token) in the model directory's tokenizer_config.json")
    tokenizer.pad_token = tokenizer.eos_token
    return f"pad = eos ({tokenizer.eos_token!r}): the tokenizer has no pad token"
