"""``--resume`` after a hard stop (issue #43 item 8): a torn last line of ``metrics.jsonl`` /
``samples.jsonl`` is left out with a note; a corrupt line before the last is still an error."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from offpolicy.train.logger import RunLogger, read_jsonl


def write_run(run_dir, metrics_tail: bytes = b"", samples_tail: bytes = b""):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_bytes(b"".join(json.dumps({"step": s, "reward": s / 10}).encode() + b"\n"
                                                     for s in range(3)) + metrics_tail)
    (run_dir / "samples.jsonl").write_bytes(b"".join(json.dumps({"step": s, "completion": "café"},
                                                                ensure_ascii=False).encode() + b"\n"
                                                     for s in range(3)) + samples_tail)


@pytest.mark.parametrize("tail", [b'{"step": 3, "rew', b'{"step": 3, "reward": 0.3}\n\x00\x00\x00\x00',
                                  '{"step": 3, "completion": "caf\u00e9'.encode()[:-1], b'{"step": 3, "reward": 0.3}\n{'])
def test_a_torn_last_line_is_left_out_with_a_note(tmp_path, tail):
    write_run(tmp_path / "run", tail, tail)
    console = Console(record=True, width=200)
    logger = RunLogger(tmp_path / "run", total_steps=5, start_step=2, console=console, progress=False)
    logger.close()
    assert [r["step"] for r in logger.records] == [0, 1]
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "samples.jsonl")] == [0, 1]
    text = console.export_text()
    assert "metrics.jsonl: left out its incomplete last line" in text
    assert "samples.jsonl: left out its incomplete last line" in text
    # the files were rewritten whole: every line parses again
    for name in ("metrics.jsonl", "samples.jsonl"):
        assert (tmp_path / "run" / name).read_bytes().endswith(b"}\n")


def test_a_corrupt_line_before_the_last_is_an_error(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, b'{"step": 3, "rew\n{"step": 4, "reward": 0.4}\n')
    before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 4 is not JSON .* repair or delete that line"):
        RunLogger(run_dir, total_steps=5, start_step=2, console=Console(record=True), progress=False)
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # nothing rewritten


def test_complete_files_resume_without_a_note(tmp_path):
    write_run(tmp_path / "run")
    console = Console(record=True, width=200)
    RunLogger(tmp_path / "run", total_steps=5, start_step=3, console=console, progress=False).close()
    assert "incomplete" not in console.export_text()
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]
