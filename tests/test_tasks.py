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


def test_plain_text_takes_the_tokenizers_own_bos_rule(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from offpolicy.tasks.tokenizer import plain_text_ids
    from offpolicy.tasks.tokenizer import prompt_ids

    tok = build_char_tokenizer()  # its rule: <bos> + text, as the embedded model is trained
    assert plain_text_ids(tok, "12=") == [tok.bos_token_id, *tok("12=", add_special_tokens=False).input_ids]
    assert prompt_ids(tok, Problem("12=", "21")) == plain_text_ids(tok, "12=")
    # a chat tokenizer whose bos_token only opens a turn (SmolLM2: <|im_start|>) and whose rule adds nothing
    chat = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", add_bos_token=False)
    assert plain_text_ids(chat, "12=") == chat("12=", add_special_tokens=False).input_ids
    # a character tokenizer saved before add_bos_token was set still loads with its <bos> rule
    chat.save_pretrained(tmp_path)
    assert plain_text_ids(load_tokenizer(tmp_path), "12=")[0] == tok.bos_token_id


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


def test_walk_is_seeded_long_verifiable_and_fits_the_response_limit():
    from offpolicy.tasks import Walk
    from offpolicy.train.config import load_train_config
    from offpolicy.policy.warmstart import context_length

    task = make_task("walk")
    batch = problems(task, 300, seed=7)
    assert batch == problems(Walk(), 300, seed=7) and batch != problems(task, 300, seed=8)
    assert 100 < len(task.seeds) < 676  # many distinct problems; only seeds whose walk is long
    for p in batch:
        assert 50 <= len(p.answer) <= 150  # 50–150 tokens with the character tokenizer (+ EOS)
        assert task.reward(p, p.answer) == 1.0 and task.reward(p, f" {p.answer}\n") == 1.0
        # partial credit: half the share of the answer right before the first mistake, never 1
        n = len(p.answer)
        assert task.reward(p, p.answer[:-1]) == pytest.approx(0.5 * (n - 1) / n)
        assert task.reward(p, p.answer[:10] + "#") == pytest.approx(0.5 * 10 / n)
        assert task.reward(p, p.answer + "a") == 0.5 and task.reward(p, "") == 0.0
        assert Walk(partial_credit=False).reward(p, p.answer[:-1]) == 0.0
        # the rule, recomputed from the prompt: x_{t+1} = g(x_{t-1}, x_t), stop after a doubled a–e
        seq = [ord(c) - 97 for c in p.prompt[-2:]]
        for c in p.answer:
            seq.append(task.table[seq[-2]][seq[-1]])
            assert chr(97 + seq[-1]) == c
        assert seq[-1] == seq[-2] < 5
        assert not any(seq[i] == seq[i + 1] < 5 for i in range(len(seq) - 2))  # the first stop ends it
    assert all(sorted(task.table[x][y] for x in range(26)) == list(range(26)) for y in range(26))
    cfg = load_train_config(None, ["task=walk"])
    longest_prompt = max(len(p.prompt) for p in batch) + 1  # + BOS
    assert cfg.max_new_tokens >= 151 and longest_prompt + cfg.max_new_tokens <= context_length(cfg.max_new_tokens)
    assert load_train_config(None, []).max_new_tokens == 10  # the short tasks keep their limit
    assert make_task("walk", min_len=20, max_len=40).max_new_tokens == 50
    with pytest.raises(ValueError, match="min_len"):
        Walk(min_len=60, max_len=50)
