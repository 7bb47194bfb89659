"""Tasks, tokenizer and model builders: deterministic, exact-match rewards, round trips."""

from __future__ import annotations

import random

import pytest

from offpolicy.tasks import Addition, Problem, Reverse, make_task, problems
from offpolicy.tasks.model import build_tiny_qwen2
from offpolicy.tasks.tokenizer import build_char_tokenizer, load_tokenizer


def test_tokenizer_round_trip_keeps_spaces(tmp_path):
    tok = build_char_tokenizer()
    text = "rev 12 345="
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded(text, add_special_tokens=False).input_ids == ids
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 0)


def test_tasks_are_seeded_and_rewards_exact():
    assert problems(Reverse(), 5, seed=3) == problems(Reverse(), 5, seed=3)
    assert problems(Reverse(), 5, seed=3) != problems(Reverse(), 5, seed=4)
    p = Addition(digits=2).sample(random.Random(0))
    assert p.prompt.endswith("=") and int(p.answer) == sum(int(x) for x in p.prompt[:-1].split("+"))
    assert Addition().reward(Problem("1+2=", "3"), " 3 ") == 1.0
    assert Addition().reward(Problem("1+2=", "3"), "33") == 0.0
    r = Reverse(min_len=4, max_len=4).sample(random.Random(1))
    assert r.answer == r.prompt[4:-1][::-1] and len(r.answer) == 4


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task 'sort'; available: addition, reverse"):
        make_task("sort")


def test_tiny_model_size():
    model = build_tiny_qwen2(build_char_tokenizer())
    n = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n < 5e6
    assert model.config.model_type == "qwen2"
