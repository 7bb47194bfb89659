"""Batch dumps (offpolicy.integrations.dump) and `offpolicy diagnose --batch` as a user types it."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

import offpolicy as op
from offpolicy.integrations.dump import BatchDumper, load_batch


def _tensors(b: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    mask = torch.ones(b, t)
    mask[0, t - 2:] = 0
    return {"old_logprobs": old, "rollout_logprobs": old - 0.1 * torch.randn(b, t, generator=g).abs(), "mask": mask}


def test_dump_selects_steps_writes_once_and_round_trips(tmp_path):
    d = BatchDumper(tmp_path, steps={1}, every=3, host="test", host_version="0")
    x = _tensors(2, 5, 0)
    written = [s for s in range(7) if d.maybe_dump(s, **x) is not None]
    assert written == [0, 1, 3, 6]
    assert d.maybe_dump(1, **x) is None  # already on disk: a later micro-batch of step 1 is not written
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step{s:06d}-rank0.pt" for s in (0, 1, 3, 6)]
    one = load_batch(tmp_path / "step000001-rank0.pt")
    for k in ("old_logprobs", "rollout_logprobs", "mask"):
        assert one[k].dtype == torch.float32 and torch.equal(one[k], x[k])
    assert one["meta"][0] == {"format": 1, "host": "test", "host_version": "0", "step": 1, "rank": 0, "anchor": "old"}


def test_directory_concatenates_and_right_pads(tmp_path):
    d = BatchDumper(tmp_path, every=1)
    a, b = _tensors(2, 5, 0), _tensors(3, 7, 1)
    d.maybe_dump(0, **a, advantages=torch.ones(2, 5))
    d.maybe_dump(1, **b)  # no advantages: the key is dropped from the concatenation, not half-filled
    both = load_batch(tmp_path)
    assert both["mask"].shape == (5, 7) and "advantages" not in both
    assert torch.equal(both["mask"][:2, 5:], torch.zeros(2, 2))  # padding is masked
    assert torch.equal(both["old_logprobs"][2:], b["old_logprobs"])
    assert both["mask"].sum() == a["mask"].sum() + b["mask"].sum()


def test_bad_dumps_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="every=0"):
        BatchDumper(tmp_path, every=0)
    x = _tensors(2, 5, 0)
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(2, 4\)"):
        BatchDumper(tmp_path, every=1).maybe_dump(0, **{**x, "rollout_logprobs": x["rollout_logprobs"][:, :4]})
    torch.save({"mask": x["mask"]}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="missing old_logprobs, rollout_logprobs"):
        load_batch(tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_batch(tmp_path / "nothing")
    assert not list(tmp_path.glob(".tmp-*"))  # a refused dump leaves no temp file


def _diagnose(*args: str, cwd) -> subprocess.CompletedProcess:
    from cli_inprocess import offpolicy  # the CLI in this process (tests/cli_inprocess.py)

    return offpolicy("diagnose", *args, cwd=cwd)


def test_diagnose_batch_cli_reports_like_the_engine_path(tmp_path):
    x = _tensors(4, 6, 2)
    d = BatchDumper(tmp_path / "dump", every=1, host="trl", host_version="1.16.0")
    d.maybe_dump(0, **x)
    d.maybe_dump(1, **_tensors(2, 3, 3))
    out = tmp_path / "report"
    r = _diagnose("--batch", str(tmp_path / "dump" / "step000000-rank0.pt"), "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "what-if" in r.stdout and "kl_k3" in r.stdout
    rep = json.loads((out / "report.json").read_text())
    # the numbers are offpolicy's own measure-only correct() on the dumped tensors
    want = op.correct(x["old_logprobs"], x["rollout_logprobs"], x["mask"]).metrics
    assert math.isclose(rep["mismatch"]["kl_k3"], want["kl_k3"], rel_tol=1e-6)
    assert rep["tokens"] == float(x["mask"].sum()) and rep["engine_tokens_per_s"] is None
    assert {row["preset"] for row in rep["what_if"]} == set(op.presets.names())
    assert all((out / p.split("/")[-1]).is_file() for p in rep["plots"]) and len(rep["plots"]) == 3
    assert rep["setting"]["hosts"] == ["trl 1.16.0"]


def test_diagnose_batch_directory_and_errors(tmp_path, capsys):
    from offpolicy.cli import main

    d = BatchDumper(tmp_path / "dump", every=1)
    d.maybe_dump(0, **_tensors(4, 6, 2))
    d.maybe_dump(1, **_tensors(2, 3, 3))
    out = tmp_path / "report"
    assert main(["diagnose", "--batch", str(tmp_path / "dump"), "--out", str(out)]) == 0  # both steps
    assert json.loads((out / "report.json").read_text())["samples"] == 6
    # a wrong path is one clear error, exit 2
    assert main(["diagnose", "--batch", str(tmp_path / "missing.pt")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_diagnose_batch_writes_its_report_in_one_step(tmp_path, monkeypatch):
    """--batch writes report.json as the server path does (issue #47: one writer, temp file + rename): a
    write that fails leaves the previous report whole and no temporary file. On f7091b3 the --batch path
    wrote with ``write_text`` and replaced the old report in place."""
    import os

    BatchDumper(tmp_path / "dump", every=1).maybe_dump(0, **_tensors(4, 6, 2))
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text('{"previous": true}')

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    r = _diagnose("--batch", str(tmp_path / "dump"), "--out", str(out), cwd=tmp_path)
    assert r.returncode != 0 and "No space left on device" in r.stderr
    assert json.loads((out / "report.json").read_text()) == {"previous": True}
    assert not list(out.glob(".report-*"))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 9)), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_directory_load_keeps_every_valid_token(tmp_path_factory, shapes, seed):
    """Any mix of per-step shapes: the concatenation keeps each file's valid entries in order, pads with mask 0."""
    directory = tmp_path_factory.mktemp("dump")
    d = BatchDumper(directory, every=1)
    parts = [_tensors(b, t, seed + i) for i, (b, t) in enumerate(shapes)]
    for step, x in enumerate(parts):
        d.maybe_dump(step, **x)
    got = load_batch(directory)
    t_max = max(x["mask"].shape[1] for x in parts)
    assert got["mask"].shape == (sum(x["mask"].shape[0] for x in parts), t_max)
    row = 0
    for x in parts:
        b, t = x["mask"].shape
        for k in ("old_logprobs", "rollout_logprobs", "mask"):
            assert torch.equal(got[k][row:row + b, :t], x[k])
        assert not got["mask"][row:row + b, t:].any()
        row += b


def test_text_travels_with_the_tensors_and_is_checked(tmp_path):
    """Issue #69: a dump may carry each row's sampled ids and the engine's text (diagnose re-encodes them); load_batch
    concatenates them across files in the tensors' order, and a malformed one is refused when written."""
    dumper = BatchDumper(tmp_path, every=1, host="t")
    for step, rows in ((0, 2), (1, 1)):
        t = torch.zeros(rows, 3)
        dumper.maybe_dump(step, old_logprobs=t, rollout_logprobs=t, mask=torch.ones(rows, 3), text={
            "prompt_ids": [[1, 2]] * rows, "response_ids": [[step, 5]] * rows, "response_text": [f"s{step}"] * rows})
    text = load_batch(tmp_path)["text"]
    assert text == {"prompt_ids": [[1, 2]] * 3, "response_ids": [[0, 5], [0, 5], [1, 5]],
                    "response_text": ["s0", "s0", "s1"]}
    with pytest.raises(ValueError, match="text.response_text must be a list of 2 rows"):
        dumper.maybe_dump(2, old_logprobs=torch.zeros(2, 3), rollout_logprobs=torch.zeros(2, 3), mask=torch.ones(2, 3),
                          text={"prompt_ids": [[1]] * 2, "response_ids": [[2]] * 2, "response_text": ["x"]})
    with pytest.raises(ValueError, match=r"text.response_ids\[1\] is not a list of ints"):
        dumper.maybe_dump(3, old_logprobs=torch.zeros(2, 3), rollout_logprobs=torch.zeros(2, 3), mask=torch.ones(2, 3),
                          text={"prompt_ids": [[1]] * 2, "response_ids": [[2], ["a"]], "response_text": ["x", "y"]})
