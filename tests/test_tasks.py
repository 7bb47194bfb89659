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
    assert cfg.sampling.max_tokens >= 151 and longest_prompt + cfg.sampling.max_tokens <= context_length(cfg.sampling.max_tokens)
    assert load_train_config(None, []).sampling.max_tokens == 10  # the short tasks keep their limit
    assert make_task("walk", min_len=20, max_len=40).max_new_tokens == 50
    with pytest.raises(ValueError, match="min_len"):
        Walk(min_len=60, max_len=50)


# ---------------------------------------------------------------- task=count (issue #54)

@pytest.mark.parametrize(("completion", "reward"), [
    ("1 2 3 4", 1.0), ("1, 2, 3, 4", 1.0), ("1\n2\n3\n4.", 1.0), ("Sure! 1-2-3-4", 1.0),  # the numbers, in order
    ("1 2 4", 0.5 * 2 / 4), ("1 2 3", 0.5 * 3 / 4), ("1 2 3 4 5", 0.5),  # a skip, stopped early, ran past
    ("1 to 4: 1 2 3 4", 0.5 * 1 / 4),  # the prompt's numbers repeated first: only "1" matches
    ("0 1 2 3 4", 0.0), ("four", 0.0), ("", 0.0), ("12 3 4", 0.0),  # wrong start, no numbers, glued digits
])
def test_count_reward_by_hand(completion, reward):
    from offpolicy.tasks import count_reward

    assert count_reward(completion, [1, 2, 3, 4]) == pytest.approx(reward, abs=1e-12)


def test_count_prompts_answers_and_splits():
    from offpolicy.tasks import Count
    from offpolicy.tasks.count import SEPARATORS, WORDINGS

    task = Count()
    train = {task.problem(*k).prompt for k in task.train_keys}
    held = [p.prompt for p in task.held_out]
    # 6 wordings × 3 separators × ends 8–30: 414 distinct prompts, 160 of them held out, none of those trained on
    assert (len(WORDINGS), len(SEPARATORS), len(train), len(held), len(set(held))) == (6, 3, 254, 160, 160)
    assert not train & set(held)
    assert Count().held_out == task.held_out and Count(split_seed=1).held_out != task.held_out
    rng = random.Random(0)
    drawn = [task.sample(rng) for _ in range(300)]
    assert all(p.prompt in train for p in drawn)
    assert {p.answer.count("\n") > 0 for p in drawn} == {True, False}  # separators vary
    p = Count.problem(0, 1, 5, "commas")
    assert (p.prompt, p.answer) == ("Count from 1 to 5. Write the numbers only, separated by commas.", "1, 2, 3, 4, 5")
    assert Count.problem(1, 2, 4, "new lines").answer == "2\n3\n4"
    assert task.reward(p, p.answer) == 1.0 and task.reward(p, "1, 2") == pytest.approx(0.2)
    near = make_task("count", starts=[0, 1, 2], n_held_out=200)  # YAML's list, a start near 1
    assert len(near.train_keys) + len(near.held_out_keys) == 3 * 414 and {k[1] for k in near.train_keys} == {0, 1, 2}
    for bad in ({"starts": (8,)}, {"low": 10, "high": 9}, {"n_held_out": 414}, {"n_held_out": 0}):
        with pytest.raises(ValueError, match="count:"):
            Count(**bad)


def test_count_needs_a_model_directory_and_takes_its_limit():
    from offpolicy.core.config import ConfigError
    from offpolicy.train.config import load_train_config

    with pytest.raises(ConfigError, match="task=count renders its prompts with a model's chat template"):
        load_train_config(None, ["task=count"])
    cfg = load_train_config(None, ["task=count", "model=/models/any", "task_params={n_held_out: 130}"])
    assert cfg.sampling.max_tokens == 128 and make_task(cfg.task, **cfg.task_params).n_held_out == 130
