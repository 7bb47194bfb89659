"""task=dataset without training: the shipped file and its generator, loading JSONL/CSV/Parquet
through `datasets`, the chat template, the prompt limit, the held-out split, stop tokens and pad,
and every bad input answered with one clear error before any model loads."""

from __future__ import annotations

import csv
import json
import random
import sys

import pytest

pytest.importorskip("datasets", reason="task=dataset reads files through `datasets` (install.sh installs it)")

from hf_fixtures import DATA, EVAL_DATA, REPO  # noqa: E402
from offpolicy.core.config import ConfigError  # noqa: E402
from offpolicy.engines.base import stop_token_ids  # noqa: E402
from offpolicy.tasks.dataset import load_dataset_task, load_rows, render_prompts  # noqa: E402
from offpolicy.tasks.rewards import number_reward  # noqa: E402
from offpolicy.tasks.tokenizer import ensure_pad_token, load_tokenizer  # noqa: E402
from offpolicy.tasks.dataset import DataConfig  # noqa: E402


@pytest.fixture(scope="module")
def tok(tiny_qwen2_dir):
    return load_tokenizer(tiny_qwen2_dir)


def data(**kw) -> DataConfig:
    return DataConfig(**{"path": str(DATA), **kw})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------ the shipped data
def test_generator_reproduces_the_committed_files_byte_for_byte(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_arith_word_problems as gen
    finally:
        sys.path.pop(0)
    gen.main(["--out-dir", str(tmp_path)])
    for shipped in (DATA, EVAL_DATA):
        assert (tmp_path / shipped.name).read_bytes() == shipped.read_bytes(), shipped.name


def test_shipped_data_is_gsm8k_format_and_self_consistent():
    train = [json.loads(line) for line in DATA.read_text().splitlines()]
    held_out = [json.loads(line) for line in EVAL_DATA.read_text().splitlines()]
    assert (len(train), len(held_out)) == (400, 100)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}  # a real held-out set
    for row in train + held_out:
        assert set(row) == {"question", "answer"} and "\n#### " in row["answer"]
        # every worked step's annotation <<a op b=c>> is right, and the final answer is the last result
        steps = [(expr, int(value)) for expr, value in
                 __import__("re").findall(r"<<([-\d+*/ ]+)=(-?\d+)>>", row["answer"])]
        assert steps, row
        for expr, value in steps:
            assert eval(expr) == value, (expr, value)  # noqa: S307 — digits and + - * / only (regex above)
        assert number_reward(f"so {steps[-1][1]:,}", row["answer"]) == 1.0
    finals = [int(r["answer"].rsplit("#### ", 1)[1]) for r in train]
    assert min(finals) < 0 and max(finals) >= 1000  # negatives and thousands are both represented


# ---------------------------------------------------------------------------------- loading
def test_jsonl_csv_and_parquet_read_the_same_rows(tmp_path):
    rows = [json.loads(line) for line in DATA.read_text().splitlines()][:20]
    with (tmp_path / "d.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    paths = [write_jsonl(tmp_path / "d.jsonl", rows), str(tmp_path / "d.csv")]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
        paths.append(str(tmp_path / "d.parquet"))
    except ImportError:
        pass  # parquet needs pyarrow, which `datasets` itself requires: present wherever datasets is
    for path in paths:
        assert load_rows(path, ["question", "answer"]) == rows, path


def test_a_dataset_directory_reads_its_split(tmp_path):
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "train.jsonl", rows[:5])
    write_jsonl(tmp_path / "d" / "test.jsonl", rows[5:8])
    assert load_rows(str(tmp_path / "d"), ["question", "answer"]) == rows[:5]
    assert load_rows(str(tmp_path / "d"), ["question", "answer"], split="test") == rows[5:8]


@pytest.mark.parametrize("content, message", [
    ("", "is empty: it holds no rows"),
    ('{"prompt": "2+2?", "answer": "4"}\n', "has no field 'question' (data.prompt_field='question'); its fields are: "
     "prompt, answer"),
    ('{"question": "2+2?", "solution": "4"}\n', "has no field 'answer' (data.answer_field='answer')"),
])
def test_bad_files_are_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_rows(str(path), ["question", "answer"])


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_rows(str(tmp_path / "nope.jsonl"), ["question"])
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"unsupported file type '.txt'; use one of .jsonl, .json, .parquet, .csv"):
        load_rows(str(tmp_path / "d.txt"), ["question"])


# --------------------------------------------------------------------- rendering and the prompt limit
def test_chat_template_renders_prompts_as_the_model_expects(tok):
    ids = render_prompts(tok, ["What is 2+3?"], "Answer with a number.", "auto")[0]
    assert tok.decode(ids) == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n"
                               "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    raw = render_prompts(tok, ["What is 2+3?"], "Answer with a number.", "none")[0]
    assert tok.bos_token_id is None and tok.decode(raw) == "Answer with a number.\n\nWhat is 2+3?"


def test_without_a_template_the_bos_leads(tok):
    from offpolicy.tasks.tokenizer import build_char_tokenizer

    char = build_char_tokenizer()  # has a BOS and no chat template: 'auto' falls back to raw text
    ids = render_prompts(char, ["1+2="], None, "auto")[0]
    assert ids[0] == char.bos_token_id and char.decode(ids[1:]) == "1+2="


def test_long_prompts_are_refused_or_dropped(tok, tmp_path):
    rows = [{"question": "Ava has 3 apples.", "answer": "#### 3"},
            {"question": "Ava has 3 apples. " * 30, "answer": "#### 3"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    short = len(render_prompts(tok, [rows[0]["question"]], None, "auto")[0])
    with pytest.raises(ConfigError, match=rf"1 of 2 prompts exceed max_prompt_tokens={short} \(row 2 has"):
        load_dataset_task(data(path=path, eval_fraction=0), tok, "number", short, 8)
    task = load_dataset_task(data(path=path, eval_fraction=0, drop_long_prompts=True), tok, "number", short, 8)
    assert [p.prompt for p in task.train] == [rows[0]["question"]] and task.dropped == 1
    assert len(task.train[0].prompt_ids) == short  # kept whole, never truncated


# ------------------------------------------------------------------------------- splits and sampling
def test_held_out_fraction_is_deterministic_and_disjoint(tok):
    task = load_dataset_task(data(eval_fraction=0.1), tok, "number", 512, 8)
    again = load_dataset_task(data(eval_fraction=0.1), tok, "number", 512, 8)
    other = load_dataset_task(data(eval_fraction=0.1, seed=1), tok, "number", 512, 8)
    assert (len(task.train), len(task.held_out)) == (360, 40)  # round(0.1 · 400) held out
    assert task.held_out == again.held_out and task.held_out != other.held_out
    assert not {p.prompt for p in task.train} & {p.prompt for p in task.held_out}
    rng_a, rng_b = random.Random(5), random.Random(5)
    assert [task.sample(rng_a) for _ in range(8)] == [again.sample(rng_b) for _ in range(8)]
    separate = load_dataset_task(data(eval_path=str(EVAL_DATA)), tok, "number", 512, 8)
    assert (len(separate.train), len(separate.held_out)) == (400, 100)
    problem = separate.held_out[0]
    assert separate.reward(problem, "the answer: " + problem.answer.rsplit("#### ", 1)[1]) == 1.0
    assert tok.decode(problem.prompt_ids).endswith(problem.prompt + "<|im_end|>\n<|im_start|>assistant\n")


def test_a_fraction_that_leaves_no_training_row(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(ConfigError, match="leaves no training row"):
        load_dataset_task(data(path=path, eval_fraction=0.5), tok, "number", 512, 8)


@pytest.mark.parametrize("overrides", [
    [],  # a synthetic task: its saved config holds data.*'s defaults, which must not count as set
    ["task=dataset", "model=/m", f"data.path={DATA}", f"data.eval_path={EVAL_DATA}", "reward=boxed"],
    ["task=dataset", "model=/m", f"data.path={DATA}", "data.eval_fraction=0.2", "reward=number"],
])
def test_the_saved_config_loads_again(tmp_path, overrides):
    """--resume reads config.yaml, where every field is written out: it must load to the same config."""
    import yaml

    from offpolicy.train.config import load_train_config

    cfg = load_train_config(None, overrides)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"train": cfg.model_dump(mode="json")}))
    assert load_train_config(tmp_path / "c.yaml") == cfg


# ----------------------------------------------------------------------------- the user's reward
@pytest.mark.parametrize("body, message", [
    ("return 'correct'", r"returned str 'correct'; it must return a number"),
    ("return '1.0'", r"returned str '1.0'; it must return a number .*not text"),  # issue #32 item 8
    ("return float('nan')", "rewards must be finite"),
    ("raise KeyError('score')", "KeyError: 'score'"),
])
def test_user_reward_is_checked_on_a_real_row_before_training(tok, tmp_path, monkeypatch, body, message):
    module = f"user_reward_{abs(hash(body)) % 10**8}"
    (tmp_path / f"{module}.py").write_text(f"def score(completion, reference):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"reward='{module}:score' on the first training row.*{message}"):
        load_dataset_task(data(), tok, f"{module}:score", 512, 8)


def test_user_reward_that_works(tok, tmp_path, monkeypatch):
    (tmp_path / "length_reward.py").write_text(
        "def score(completion, reference):\n    return min(len(completion), 10) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_dataset_task(data(), tok, "length_reward:score", 512, 8)
    assert task.reward(task.train[0], "abcde") == 0.5


# --------------------------------------------------------------------------------- tokens that end
def test_stop_tokens_and_pad(tiny_qwen2_dir, tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    # generation_config lists <|im_end|> and <|endoftext|>, as Qwen2.5-Instruct's does
    assert stop_token_ids(tok, model) == sorted({tok.eos_token_id, tok.pad_token_id})
    assert stop_token_ids(tok) == [tok.eos_token_id]
    assert ensure_pad_token(tok) is None  # it has one
    no_pad = load_tokenizer(tiny_qwen2_dir)
    no_pad.pad_token = None
    assert "pad = eos" in ensure_pad_token(no_pad) and no_pad.pad_token_id == no_pad.eos_token_id


# ------------------------------------------------------------------- issue #32: the file's text, early errors
def test_the_shipped_format_reads_the_same_through_every_reader(tmp_path):
    """JSONL, a JSON array, a JSON object of columns, CSV and a directory of them give the same rows."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()][:6]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "c.json").write_text(json.dumps({"question": [r["question"] for r in rows],
                                                 "answer": [r["answer"] for r in rows]}))
    (tmp_path / "dir").mkdir()
    write_jsonl(tmp_path / "dir" / "train.jsonl", rows)
    for path in (tmp_path / "a.json", tmp_path / "c.json", tmp_path / "dir"):
        assert load_rows(str(path), ["question", "answer"]) == rows, path


NUMBERS = [{"question": "Ava has 70 apples and finds 2. How many?", "answer": 72},
           {"question": "Half of 145.00?", "answer": 72.50},
           {"question": "How much is 1e3?", "answer": 1000},
           {"question": "Is 2 even?", "answer": True}]
WRITTEN = ["72", "72.50", "1000", "true"]  # what the files below hold, as text


def test_numeric_answers_keep_the_files_text(tok, tmp_path):
    """Issue #32 item 6: `datasets` inferred a float column (72 → '72.0', a CSV cell 72.50 → '72.5'), and
    reward=exact scored the file's own answer 0. Prompts and answers are now the file's text."""
    lines = ['{"question": "Ava has 70 apples and finds 2. How many?", "answer": 72}',
             '{"question": "Half of 145.00?", "answer": 72.50}',
             '{"question": "How much is 1e3?", "answer": 1000}',
             '{"question": "Is 2 even?", "answer": true}']
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "d.json").write_text("[" + ",\n".join(lines) + "]")
    (tmp_path / "d.csv").write_text("question,answer\n" + "".join(
        f'"{r["question"]}",{w}\n' for r, w in zip(NUMBERS, WRITTEN)))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "train.csv").write_text((tmp_path / "d.csv").read_text())
    for name in ("d.jsonl", "d.json", "d.csv", "dir"):
        got = load_rows(str(tmp_path / name), ["question", "answer"])
        assert [r["answer"] for r in got] == WRITTEN, name
        assert [r["question"] for r in got] == [r["question"] for r in NUMBERS], name
        task = load_dataset_task(data(path=str(tmp_path / name), eval_fraction=0), tok, "exact", 512, 8)
        assert all(task.reward(p, p.answer) == 1.0 for p in task.train), name  # the file's own answer scores
        assert task.reward(task.train[0], "72") == 1.0 and task.reward(task.train[0], "72.0") == 0.0


def test_typed_columns_become_their_numbers_text(tmp_path):
    """Parquet (and a saved dataset) store numbers, not text: an int column reads '72'; a whole float '72',
    as the number it is (pandas turns an int column with a gap into floats); other floats their repr."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": ["a", "b", "c"], "n": [72, 18, -3], "x": [72.0, 72.5, float("nan")]})
    pq.write_table(table, tmp_path / "d.parquet")
    assert [r["n"] for r in load_rows(str(tmp_path / "d.parquet"), ["question", "n"])] == ["72", "18", "-3"]
    assert [r["x"] for r in load_rows(str(tmp_path / "d.parquet"), ["question", "x"])] == ["72", "72.5", None]


def test_a_save_to_disk_directory_is_loaded(tmp_path):
    """Issue #32 item 10: refused before with "use load_from_disk", which a CLI user cannot do."""
    import datasets

    rows = [json.loads(line) for line in DATA.read_text().splitlines()][:6]
    datasets.Dataset.from_list(rows[:4]).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "two"))
    assert load_rows(str(tmp_path / "one"), ["question", "answer"]) == rows[:4]
    assert load_rows(str(tmp_path / "two"), ["question", "answer"], split="test") == rows[4:]
    with pytest.raises(ConfigError, match=r"has no split 'validation'; its splits: train, test"):
        load_rows(str(tmp_path / "two"), ["question", "answer"], split="validation")


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_an_empty_prompt_is_refused_with_its_file_and_row(tok, tmp_path, prompt):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2?", "answer": "4"}, {"question": prompt, "answer": "1"}])
    with pytest.raises(ConfigError, match=r"data.path='.*d.jsonl' row 2: the prompt \('question'\) is empty"):
        load_dataset_task(data(path=path, eval_fraction=0), tok, "exact", 512, 8)


def no_system_tokenizer(tok):
    """``tok`` with a chat template that refuses a system turn, as Gemma's and Mistral's do."""
    import copy

    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return strict


def test_a_template_that_refuses_the_system_prompt_is_one_clear_error(tok):
    strict = no_system_tokenizer(tok)
    with pytest.raises(ConfigError, match=r"^data.system_prompt: the model's chat template refuses a system turn "
                                          r"\(TemplateError: System role not supported\). Fix: drop data.system_prompt"):
        load_dataset_task(data(system_prompt="Be brief."), strict, "number", 512, 8)
    assert load_dataset_task(data(), strict, "number", 512, 8).train  # without a system prompt it renders
    raw = load_dataset_task(data(system_prompt="Be brief.", chat_template="none"), strict, "number", 512, 8)
    assert strict.decode(raw.train[0].prompt_ids).startswith("Be brief.\n\n")


def incomplete_model_dir(tiny_qwen2_dir, tmp_path):
    """The model directory with only tokenizer_config.json of its tokenizer files: transformers loads a
    Qwen2Tokenizer of 3 tokens from it, which encodes every prompt to nothing."""
    import shutil

    out = tmp_path / "incomplete"
    out.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "model.safetensors"):
        if (tiny_qwen2_dir / name).exists():
            shutil.copy(tiny_qwen2_dir / name, out / name)
    return out


def test_an_incomplete_tokenizer_is_refused_before_the_model_loads(tiny_qwen2_dir, tmp_path):
    bad = load_tokenizer(incomplete_model_dir(tiny_qwen2_dir, tmp_path))
    assert len(bad) < 10 and bad("What is 2+3?", add_special_tokens=False).input_ids == []
    with pytest.raises(ConfigError, match=r"the tokenizer has \d+ tokens but the model's vocab_size is 384"):
        load_dataset_task(data(), bad, "number", 512, 8, vocab_size=384)
    with pytest.raises(ConfigError, match=r"row 1: the prompt .* encodes to no token"):
        load_dataset_task(data(), bad, "number", 512, 8)  # without the model's size: the prompts give it away


def test_a_small_working_tokenizer_under_a_larger_head_is_accepted():
    """A 384-token BPE under a 49,152-row head (a test model's shapes; a head padded for tokens to come):
    every prompt encodes, so nothing is broken and nothing is refused."""
    from hf_fixtures import train_bpe

    task = load_dataset_task(data(), train_bpe(), "number", 512, 8, vocab_size=49_152)
    assert task.train and all(p.prompt_ids for p in task.train)


def test_cli_refuses_an_incomplete_tokenizer_in_one_line(tiny_qwen2_dir, tmp_path):
    import subprocess

    model = incomplete_model_dir(tiny_qwen2_dir, tmp_path)
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "offpolicy", "train", "task=dataset", f"model={model}",
                             f"data.path={DATA}", "reward=number", "engine=hf", f"out_dir={out}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "vocab_size is 384" in result.stderr
    assert not out.exists()


def test_system_prompt_refusal_leaves_no_run_directory(tiny_qwen2_dir, tmp_path):
    """Through the trainer: the error comes before any weight loads, and the run directory is gone."""
    from offpolicy.train.config import load_train_config
    from offpolicy.train.loop import train

    model = tmp_path / "model"
    import shutil

    shutil.copytree(tiny_qwen2_dir, model)
    no_system_tokenizer(load_tokenizer(model)).save_pretrained(model)
    cfg = load_train_config(None, ["task=dataset", f"model={model}", f"data.path={DATA}", "reward=number",
                                   "engine=hf", "data.system_prompt=Be brief.", f"out_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="data.system_prompt"):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()
