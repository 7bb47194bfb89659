"""A character-level tokenizer built in code, as a Hugging Face ``PreTrainedTokenizerFast``.

One token per character, plus ``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>``. Saved with the model
(``save_pretrained``) so that transformers and vLLM load the same vocabulary from the run
directory — no download, no external file.

Plain text (no chat template) is tokenised by every path the same way, ``plain_text_ids``: the tokenizer's
own rule, ``tokenizer(text)``, with whatever it puts in front of text. Llama's tokenizers add their BOS;
Qwen's and SmolLM2's add nothing (SmolLM2's ``bos_token`` is ``<|im_start|>``, which opens a chat turn, not
a document); the character tokenizer adds ``<bos>`` (``add_bos_token``): its model is trained with it.
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
        add_bos_token=True,  # tokenizer(text) = <bos> + text: the embedded model's prompts start so
    )


def plain_text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` rendered as plain text: ``tokenizer(text)``, the tokenizer's own special tokens
    included (module docstring) — never a BOS it would not add itself."""
    return tokenizer(text).input_ids


def prompt_ids(tokenizer, problem) -> list[int]:
    """A ``Problem``'s prompt as token ids: as task=dataset rendered it (chat template, BOS) when it loaded,
    else its text by ``plain_text_ids``."""
    if problem.prompt_ids is not None:
        return list(problem.prompt_ids)
    return plain_text_ids(tokenizer, problem.prompt)


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
            # add_bos_token: character tokenizers saved before it was part of build_char_tokenizer
            return PreTrainedTokenizerFast.from_pretrained(path, add_bos_token=True)
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
