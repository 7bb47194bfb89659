"""`offpolicy train` end to end on the HF engine: a run as typed, resume equivalence, bounded
staleness, a local model by path, and every error a user can make answered in one line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offpolicy as op
from conftest import FAST
from hf_fixtures import char_model, char_model_dir
from offpolicy.engines import Rollouts, SamplingConfig
from offpolicy.engines.hf import HFEngine
from offpolicy.tasks.tokenizer import build_char_tokenizer
from offpolicy.train import loop as train_loop
from offpolicy.train.config import load_train_config
from offpolicy.train.loop import train

# timings, and how the staleness splits into in flight / in queue, which depends on when the engine thread
# finished against the trainer (issue #46); their sum, ``staleness``, is still compared
TIMING = {"step_seconds", "generate/tokens_per_s", "staleness/in_flight", "staleness/in_queue"}


def cli(*args: str, env_cache: Path, process: bool = False) -> subprocess.CompletedProcess:
    """``offpolicy train ARGS`` in this process (tests/cli_inprocess.py), or with ``process`` as its own
    ``python -m offpolicy``."""
    from cli_inprocess import offpolicy

    return offpolicy("train", *args, env={**os.environ, "OFFPOLICY_CACHE": str(env_cache)}, process=process)


def records(run_dir: Path) -> list[dict]:
    return records_of(run_dir / "metrics.jsonl")


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(tmp_path: Path, name: str, *overrides: str, resume: bool = False):
    cfg = load_train_config(None, [*FAST, f"out_dir={tmp_path / name}", *overrides])
    return train(cfg, resume=(tmp_path / name) if resume else None, progress=False)


@pytest.mark.slow
def test_cli_run_writes_everything(offpolicy_cache, tmp_path):
    out = tmp_path / "run"
    result = cli(*FAST, "steps=3", f"out_dir={out}", "--no-progress", env_cache=offpolicy_cache, process=True)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward", "eval/accuracy", "response_length", "generate/tokens_per_s", "staleness", "offpolicy/kl_k1",
                "offpolicy/ess", "offpolicy/masked_fraction", "offpolicy/is_mean", "offpolicy/clip_fraction",
                "offpolicy/loss", "offpolicy/chi2_token", "offpolicy/ppl_ratio"):
        assert key in rows[0], key
    assert 0 < rows[0]["reward"] < 1 or rows[0]["eval/accuracy"] > 0  # the warm start works at all
    assert (out / "training.png").stat().st_size > 10_000
    assert any((out / "tensorboard").iterdir())
    assert (out / "checkpoints" / "latest").read_text() == "step-3"
    assert "run summary" in result.stdout and "reward" in result.stdout
    # a few completions per step as text (issue #30): one row of each of the 4 groups, default 4 a step
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [0] * 4 + [1] * 4 + [2] * 4
    for r in samples:
        assert r["prompt"].startswith("rev ") and r["answer"] and isinstance(r["completion"], str)
        assert r["reward"] in (0.0, 1.0) and r["tokens"] >= 1 and 0 <= r["abs_log_ratio_mean"] <= r["abs_log_ratio_max"]
    assert len({r["prompt"] for r in samples[:4]}) > 1  # one per group, not four answers to one prompt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert "samples/text_summary" in events.Tags()["tensors"]
    warm = json.loads(next(offpolicy_cache.glob("warmstart/*/warmstart.json")).read_text())
    assert 0.1 <= warm["sampled_accuracy"] <= 0.6  # RL starts from a partly competent policy


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 2])
def test_resume_continues_identically(offpolicy_cache, tmp_path, staleness):
    straight = run(tmp_path, "straight", "steps=4", f"max_staleness={staleness}")
    run(tmp_path, "split", "steps=2", f"max_staleness={staleness}")
    # a hard stop while writing step 2's lines (issue #43): at 3be706e --resume died on a JSONDecodeError
    with (tmp_path / "split" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "reward": 0.2')
    with (tmp_path / "split" / "samples.jsonl").open("ab") as f:
        f.write('{"step": 2, "completion": "caf\u00e9'.encode()[:-1])  # a multi-byte character cut too
    resumed = run(tmp_path, "split", "steps=4", f"max_staleness={staleness}", resume=True)
    assert resumed.run_dir == tmp_path / "split"
    a, b = records(straight.run_dir), records(tmp_path / "split")
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        for key in {k for k in ra.keys() - TIMING if not k.startswith(("time/", "memory/"))}:
            va, vb = ra[key], rb[key]
            assert (va is None and vb is None) or math.isclose(va, vb, rel_tol=1e-6, abs_tol=1e-9), (ra["step"], key)
    sa, sb = (records_of(run_dir / "samples.jsonl") for run_dir in (straight.run_dir, tmp_path / "split"))
    assert [(r["step"], r["completion"], r["reward"]) for r in sa] == [(r["step"], r["completion"], r["reward"]) for r in sb]


@pytest.mark.slow
def test_async_staleness_is_bounded_and_corrected(offpolicy_cache, tmp_path):
    result = run(tmp_path, "async", "steps=5", "max_staleness=2", "preset=verl:decoupled_token_is")
    rows = records(result.run_dir)
    assert [r["staleness"] for r in rows] == [0, 1, 2, 2, 2]  # version max(0, k − 2)
    # the correction sees real staleness once the pipeline is full: π_old has moved away from μ
    assert rows[4]["offpolicy/kl_k3"] > rows[0]["offpolicy/kl_k3"]


@pytest.mark.slow
def test_any_local_hf_model_by_path(offpolicy_cache, tmp_path):
    model_dir = char_model_dir(tmp_path / "my-model", hidden_size=64, num_layers=2, seed=3)
    from rich.console import Console

    console = Console(record=True, width=300)
    cfg = load_train_config(None, [*FAST, f"out_dir={tmp_path / 'local'}", "steps=2", f"model={model_dir}",
                                   "preset=trl:token_truncate"])
    result = train(cfg, console=console, progress=False)
    assert [r["step"] for r in records(result.run_dir)] == [0, 1]
    # a pretrained model on a synthetic task takes a pretrained model's defaults, and says so (issue #43)
    assert "a pretrained model's (model=DIR) defaults: lr 1e-06, trainer.micro_batch_tokens 2048" in console.export_text()
    import yaml

    assert yaml.safe_load((result.run_dir / "config.yaml").read_text())["train"]["lr"] == 1e-6


def test_hf_engine_sync_and_logprobs(tmp_path):
    tok = build_char_tokenizer()
    trainer = char_model(hidden_size=64, num_layers=2, seed=1)
    trainer.save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path), tok, dtype="fp32")
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts = [[1, 5, 6, 17]] * 4

    def gap() -> float:
        from offpolicy.policy.batch import to_batch
        from offpolicy.policy.head import trainer_logprobs

        rollouts = engine.generate(prompts, SamplingConfig(max_tokens=6), seed=0, version=0)
        batch = to_batch(rollouts, tok.pad_token_id)
        with torch.no_grad():
            ours = trainer_logprobs(trainer, batch, SamplingConfig(max_tokens=6))
        return ((ours - batch.rollout_logprobs).abs() * batch.mask).max().item()

    assert gap() > 1e-2  # engine still has the old weights
    engine.sync_weights(trainer.state_dict().items())
    assert gap() < 1e-4  # fp32 engine, synced: identical up to float noise


# ---------------------------------------------------------------------- errors a user can make
def test_cli_unknown_key_is_one_clear_line(offpolicy_cache, tmp_path):
    result = cli("stepz=3", f"out_dir={tmp_path / 'x'}", env_cache=offpolicy_cache)
    assert result.returncode == 2
    assert "unknown key 'stepz' (did you mean 'steps'?)" in result.stderr
    assert not (tmp_path / "x").exists()


def test_cli_bad_override_and_bad_values(offpolicy_cache, tmp_path):
    result = cli("steps", env_cache=offpolicy_cache)
    assert result.returncode == 2 and "'steps' is neither a config file nor a key=value override" in result.stderr
    result = cli("prompts_per_step=3", "group_size=3", "minibatches=2", env_cache=offpolicy_cache)
    assert result.returncode == 2 and "is not divisible by minibatches=2" in result.stderr
    result = cli("preset=verl:decoupled_tokn_is", env_cache=offpolicy_cache)
    assert result.returncode == 2 and "Did you mean 'verl:decoupled_token_is'" in result.stderr


def test_cli_missing_model_path_leaves_nothing(offpolicy_cache, tmp_path):
    out = tmp_path / "run"
    result = cli("engine=hf", f"model={tmp_path / 'nope'}", f"out_dir={out}", env_cache=offpolicy_cache)
    assert result.returncode == 2
    assert "is not a local Hugging Face model directory (no config.json)" in result.stderr
    assert not out.exists()


def test_cli_missing_config_file_and_resume_dir(offpolicy_cache, tmp_path):
    result = cli(str(tmp_path / "missing.yaml"), env_cache=offpolicy_cache)
    assert result.returncode == 2 and "config file not found" in result.stderr
    result = cli("--resume", str(tmp_path), env_cache=offpolicy_cache)
    assert result.returncode == 2 and "no config.yaml there" in result.stderr


def test_engine_without_logprobs_is_refused_and_nothing_half_written(offpolicy_cache, tmp_path, monkeypatch):
    class NoLogprobs:
        name = "broken"

        def generate(self, prompt_ids, sampling, seed, version):
            return Rollouts(prompt_ids, [[5, 2]] * len(prompt_ids), [None] * len(prompt_ids),
                            [True] * len(prompt_ids), version)

        def sync_weights(self, named_tensors):
            list(named_tensors)

        def close(self):
            pass

    monkeypatch.setattr(train_loop, "make_engine", lambda *a, **k: NoLogprobs())
    with pytest.raises(RuntimeError, match="engine 'broken' returned no per-token log-probs for response 0"):
        run(tmp_path, "broken", "steps=2")
    assert not (tmp_path / "broken").exists()


def test_existing_run_dir_is_not_overwritten(offpolicy_cache, tmp_path):
    (tmp_path / "taken" / "checkpoints").mkdir(parents=True)
    with pytest.raises(op.ConfigError, match="already holds a run; use --resume"):
        run(tmp_path, "taken", "steps=1")


def wait_or_dump(proc: subprocess.Popen, stderr: Path, timeout: float = 120) -> None:
    """Wait for a signalled run to exit; one that does not within ``timeout`` is aborted (SIGABRT) and the
    test fails with every thread's stack, which the run's faulthandler (``PYTHONFAULTHANDLER=1``) writes
    to its stderr: a hang at exit then says where it hung."""
    import signal

    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        pytest.fail(f"the run did not exit within {timeout:.0f} s of the signal; its threads, as faulthandler "
                    f"dumped them:\n{stderr.read_text()[-6000:]}")


def signal_after_steps(proc: subprocess.Popen, out: Path, stderr: Path, steps: int, signum: int) -> None:
    """Send ``signum`` to the run ``proc`` once it has provably finished ``steps`` steps (that many lines in
    ``out``/metrics.jsonl) and is still running — never on a timer, which sent it during start-up on a slow
    box (issue #9 item 11: rc 0 instead of 130) — then wait for it to exit (``wait_or_dump``). The deadline
    only fails the test."""
    import time

    deadline = time.time() + 900
    while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= steps):
        if proc.poll() is not None:
            pytest.fail(f"the run exited (rc {proc.returncode}) before step {steps}: {stderr.read_text()[-2000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"the run did not reach step {steps} within 900 s")
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before the signal could reach it"
    proc.send_signal(signum)
    wait_or_dump(proc, stderr)


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_resume_continues(offpolicy_cache, tmp_path):
    import os
    import signal

    out = tmp_path / "interrupted"
    env = {**os.environ, "OFFPOLICY_CACHE": str(offpolicy_cache), "PYTHONFAULTHANDLER": "1"}  # wait_or_dump
    proc = subprocess.Popen([sys.executable, "-m", "offpolicy", "train", *FAST, "steps=400", f"out_dir={out}", "--no-progress"],
                            stdout=(tmp_path / "stdout").open("w"), stderr=(tmp_path / "stderr").open("w"), text=True,
                            env=env,  # files, not pipes: a full pipe buffer would block the run before step 3
                            # a shell starts background jobs with SIGINT ignored, and Python then installs no
                            # KeyboardInterrupt handler: under `pytest &` the run would ignore the signal and finish
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    signal_after_steps(proc, out, tmp_path / "stderr", 3, signal.SIGINT)  # deterministic: after step 3
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted after" in stdout and "--resume" in stdout
    done = int((out / "checkpoints" / "latest").read_text().split("-")[1])
    assert done >= 2
    # the resume in this process: the interrupted run above is the one that must be its own process
    result = cli("--resume", str(out), f"steps={done + 2}", "--no-progress", env_cache=offpolicy_cache)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r["step"] for r in records(out)] == list(range(done + 2))


@pytest.mark.slow
@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_a_second_signal_during_the_interrupt_checkpoint_waits_for_it(offpolicy_cache, tmp_path, monkeypatch, second):
    """Issue #43: a SIGTERM at step 1 starts the interrupt checkpoint; a second SIGTERM (or Ctrl-C) while it is
    written cut it short at 3be706e — a KeyboardInterrupt out of train(), a traceback, no checkpoint of step 1."""
    import os
    import signal

    from offpolicy.train.pipeline import RolloutPipeline

    real_next, real_save = RolloutPipeline.next, train_loop.save_checkpoint

    def next_then_stop(self, step, version):
        if step == 1:  # between updates: Terminated at once
            os.kill(os.getpid(), signal.SIGTERM)
        return real_next(self, step, version)

    def save_interrupted(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, second))  # the second signal, mid-checkpoint
        return real_save(*args, **kwargs)

    monkeypatch.setattr(RolloutPipeline, "next", next_then_stop)
    monkeypatch.setattr(train_loop, "save_checkpoint", save_interrupted)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    result = run(tmp_path, "twice", "steps=4", "checkpoint_every=10", "samples_per_step=0")
    assert result.interrupted and result.stop_signal == signal.SIGTERM
    checkpoints = result.run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step-1"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-1"]  # nothing half-written
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_failed_checkpoint_write_leaves_nothing_and_latest_untouched(tmp_path):
    from offpolicy.train.checkpoint import latest_checkpoint, save_checkpoint

    tok = build_char_tokenizer()
    model = char_model(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path, 1, model, tok, optimizer, {"step": 1})

    class Interrupted:  # a tokenizer whose save is cut short (a signal, a full disk)
        def save_pretrained(self, path):
            (Path(path) / "partial").write_text("x")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, Interrupted(), optimizer, {"step": 2})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-1"]
    assert latest_checkpoint(tmp_path).name == "step-1"
    save_checkpoint(tmp_path, 1, model, tok, optimizer, {"step": 1, "again": True})  # the same step, replaced
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-1"]
    assert torch.load(tmp_path / "checkpoints" / "step-1" / "trainer_state.pt", weights_only=False)["again"]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_continues(offpolicy_cache, tmp_path):
    # issue #30: a scheduler's, a container's or `timeout`'s SIGTERM ended the run with no checkpoint
    import os
    import signal

    out = tmp_path / "terminated"
    env = {**os.environ, "OFFPOLICY_CACHE": str(offpolicy_cache), "PYTHONFAULTHANDLER": "1"}  # wait_or_dump
    # checkpoint_every past the run: the only checkpoint can be SIGTERM's
    proc = subprocess.Popen([sys.executable, "-m", "offpolicy", "train", *FAST, "steps=400", "checkpoint_every=1000",
                             "samples_per_step=0", f"out_dir={out}", "--no-progress"],
                            stdout=(tmp_path / "stdout").open("w"), stderr=(tmp_path / "stderr").open("w"), env=env)
    signal_after_steps(proc, out, tmp_path / "stderr", 2, signal.SIGTERM)  # once 2 steps are provably done
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert proc.returncode == 143, stderr[-2000:]  # 128 + SIGTERM
    assert "terminated (SIGTERM) after" in stdout and "--resume" in stdout and "Traceback" not in stderr
    done = int((out / "checkpoints" / "latest").read_text().split("-")[1])
    assert done >= 2 and len(records(out)) == done  # the checkpoint holds every logged step
    result = cli("--resume", str(out), f"steps={done + 1}", "--no-progress", env_cache=offpolicy_cache)  # in-process
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r["step"] for r in records(out)] == list(range(done + 1))


def test_sigterm_waits_for_the_update_and_the_handler_is_restored():
    import os
    import signal
    import time

    before = signal.getsignal(signal.SIGTERM)
    stop = train_loop.GracefulStop()
    try:
        stop.updating = True  # mid-update: the step finishes first
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.pending
        with pytest.raises(train_loop.Terminated):
            stop.check()
        stop.updating = False  # between updates: at once
        with pytest.raises(train_loop.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode boundary; never reached
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
@pytest.mark.parametrize("reward", [0.0, 0.7])
def test_flat_rewards_skip_the_update(offpolicy_cache, tmp_path, monkeypatch, reward):
    # every reward equal → every advantage 0 and no KL term: a zero gradient, so no backward and no optimizer step
    # (issue #30); the mismatch is still measured by a no-grad forward. A partial credit of 0.7 for every
    # response (issue #43): at 3be706e its float32 mean rounded off, every row got +0.06 and the run trained
    from offpolicy.tasks.tasks import Reverse
    from offpolicy.train.checkpoint import load_trainer_state

    monkeypatch.setattr(Reverse, "reward", lambda self, problem, completion: reward)
    result = run(tmp_path, "flat", "steps=2", "checkpoint_every=1", "minibatches=1")
    rows = records(result.run_dir)
    assert [r["skipped_update"] for r in rows] == [1.0, 1.0] and [r["policy_version"] for r in rows] == [0.0, 0.0]
    assert all("offpolicy/loss" not in r and "offpolicy/grad_norm" not in r for r in rows)  # no update
    assert all(0 <= r["offpolicy/kl_k3"] < 1 and 0 < r["offpolicy/ess"] <= 1 + 1e-6 for r in rows)  # but measured
    state = load_trainer_state(result.run_dir / "checkpoints" / "step-2")
    assert state["version"] == 0 and state["optimizer"]["state"] == {}  # Adam never stepped: no moments, no count
    from transformers import AutoModelForCausalLM

    from offpolicy.policy.warmstart import default_model

    start = default_model(load_train_config(None, [*FAST]))  # the warm start the run began from (cached)
    before = AutoModelForCausalLM.from_pretrained(start).state_dict()
    after = AutoModelForCausalLM.from_pretrained(result.run_dir / "checkpoints" / "step-2").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a KL term still has a gradient: that step runs
    kl = run(tmp_path, "flat-kl", "steps=1", "loss.kl_coef=0.1", "loss.kl_to=rollout")
    assert records(kl.run_dir)[0]["skipped_update"] == 0.0 and records(kl.run_dir)[0]["policy_version"] == 1.0


def test_warm_start_that_never_succeeds_is_refused(tmp_path, monkeypatch):
    from offpolicy.policy import warmstart

    monkeypatch.setenv("OFFPOLICY_CACHE", str(tmp_path))
    monkeypatch.setattr(warmstart, "exact_match_accuracy", lambda *a, **k: 0.0)
    cfg = load_train_config(None, ["engine=hf", "warm_start.max_steps=2", "warm_start.eval_every=1",
                                   "warm_start.batch_size=4"])
    with pytest.raises(RuntimeError, match="reached 0% sampled accuracy in 2 steps.*try another warm_start.seed"):
        warmstart.default_model(cfg)
    assert not list((tmp_path / "warmstart").glob("reverse-*"))  # nothing cached


def test_warm_start_at_zero_accuracy_proceeds_on_partial_credit(tmp_path, monkeypatch):
    # walk rewards the correct prefix of a wrong answer: a 0 % exact-match start still gives RL a signal
    from offpolicy.policy import warmstart

    monkeypatch.setenv("OFFPOLICY_CACHE", str(tmp_path))
    monkeypatch.setattr(warmstart, "exact_match_accuracy", lambda *a, **k: 0.0)
    warnings = []  # recorded on the module's logger itself: other tests may reconfigure logging's handlers
    monkeypatch.setattr(warmstart.log, "warning", lambda msg, *args: warnings.append(msg % args))
    cfg = load_train_config(None, ["engine=hf", "task=walk", "warm_start.max_steps=1", "warm_start.eval_every=1",
                                   "warm_start.batch_size=2"])
    path = warmstart.default_model(cfg)
    assert (path / "warmstart.json").exists() and any("partial credit" in w for w in warnings), warnings
    off = load_train_config(None, ["engine=hf", "task=walk", "task_params={partial_credit: false}",
                                   "warm_start.max_steps=1", "warm_start.eval_every=1", "warm_start.batch_size=2"])
    with pytest.raises(RuntimeError, match="reached 0% sampled accuracy"):
        warmstart.default_model(off)


def test_rl_seeds_share_the_warm_start():
    from offpolicy.policy.warmstart import warm_start_key

    base = load_train_config(None, [])
    assert warm_start_key(base) == warm_start_key(load_train_config(None, ["seed=7"]))
    assert warm_start_key(base) != warm_start_key(load_train_config(None, ["warm_start.seed=1"]))


def test_the_cpu_trainers_fused_adamw_is_the_plain_update():
    """Issue #49: on the CPU the trainer's AdamW is torch's fused one. Over 20 steps on the embedded model's
    shapes with gradients of every scale it gives the for-loop AdamW's weights to fp32 rounding."""
    from hf_fixtures import char_model

    torch.manual_seed(0)
    plain, fused = char_model(seed=1), char_model(seed=1)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.0, fused=f)
                  for m, f in ((plain, None), (fused, True))]
    assert optimizers[1].defaults["fused"] and not optimizers[0].defaults["fused"]
    for step in range(20):
        grads = [torch.randn_like(p) * 10.0 ** (step % 5 - 2) for p in plain.parameters()]
        for model, optimizer in zip((plain, fused), optimizers):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            optimizer.step()
    for a, b in zip(plain.parameters(), fused.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_functional_dropout_through_a_config_field_keeps_the_old_policy_forward():
    """Suspicion of issue #55: OPT applies its ``config.dropout`` (0.1 in OPT-125m) with
    ``nn.functional.dropout``, no ``nn.Dropout`` module, so two training-mode forwards differ and π_old may not
    be taken from the update's own forward (``single_update``). Any config number > 0 named "…drop…" counts,
    in a sub-config too; with every one 0 the reuse stays on."""
    from types import SimpleNamespace

    from transformers import OPTConfig, OPTForCausalLM, PretrainedConfig

    cfg = load_train_config(None, ["minibatches=1", "ppo_epochs=1"])
    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                 max_position_embeddings=32, word_embed_proj_dim=16)
    torch.manual_seed(0)
    opt = OPTForCausalLM(OPTConfig(**small, dropout=0.1, attention_dropout=0.0)).train()
    assert not any(isinstance(m, torch.nn.Dropout) for m in opt.modules())  # nothing a module scan finds
    ids = torch.randint(0, 64, (2, 12))
    assert not torch.equal(opt(ids).logits, opt(ids).logits)  # and yet the forward is random
    assert train_loop.dropout_in(opt) == ["config.dropout=0.1"]
    assert not train_loop.single_update(cfg, opt)
    quiet = OPTForCausalLM(OPTConfig(**small, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)).train()
    assert torch.equal(quiet(ids).logits, quiet(ids).logits)
    assert train_loop.dropout_in(quiet) == [] and train_loop.single_update(cfg, quiet)

    for fields in ({"hidden_dropout": 0.1}, {"attention_probs_dropout_prob": 0.1}, {"resid_pdrop": 0.05},
                   {"embd_pdrop": 0.1}, {"activation_dropout": 0.2}, {"layerdrop": 0.1}, {"attention_dropout": 0.1},
                   {"text_config": {"attention_dropout": 0.1}}):
        model = SimpleNamespace(modules=lambda: [], config=PretrainedConfig(**fields))
        assert train_loop.dropout_in(model), fields
        assert not train_loop.single_update(cfg, model), fields
    flags = SimpleNamespace(modules=lambda: [], config=PretrainedConfig(hidden_dropout=0.0, use_dropout=True))
    assert train_loop.dropout_in(flags) == [] and train_loop.single_update(cfg, flags)
