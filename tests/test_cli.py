"""The CLI as a user types it: `offpolicy presets`, `offpolicy presets NAME`, and its errors."""

from __future__ import annotations


import pytest
import yaml

import offpolicy as op
from cli_inprocess import offpolicy


def test_console_script_is_installed():
    """The `offpolicy` command is declared and resolves to the CLI (checked through the package
    metadata, not PATH, which may lack the venv's bin)."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "offpolicy"]
    assert script.value == "offpolicy.cli:main" and script.load() is __import__("offpolicy.cli").cli.main


def test_presets_lists_every_preset():
    result = offpolicy("presets", process=True)
    assert result.returncode == 0, result.stderr
    for name in op.presets.names():
        assert name in result.stdout


def test_presets_name_shows_the_config_as_yaml():
    result = offpolicy("presets", "openrlhf:seq-mask-tis")
    assert result.returncode == 0, result.stderr
    assert "unclamped" in result.stdout
    body = yaml.safe_load(result.stdout[result.stdout.index("correction:"):])
    assert op.CorrectionConfig.from_dict(body["correction"]) == op.CorrectionConfig.from_preset("openrlhf:seq-mask-tis")
    assert body["loss"]["kind"] == "ppo"


def test_unknown_preset_is_one_clear_line():
    result = offpolicy("presets", "verl:nope")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "offpolicy presets: error: unknown preset 'verl:nope'. List them with `offpolicy presets`."
    ]


@pytest.mark.parametrize("args", [[], ["frobnicate"]])
def test_usage_errors(args):
    result = offpolicy(*args)
    assert result.returncode == 2
    assert "usage: offpolicy" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--engine", "hf", "--vllm-max-num-seqs", "8"],
     "--vllm-max-num-seqs is read with --engine vllm only (engine is 'hf'). Fix: --engine vllm, or drop it"),
    (["--engine-url", "http://127.0.0.1:1", "--no-vllm-enforce-eager"],
     "--no-vllm-enforce-eager configures the in-process vLLM engine; a server batches as it was started"),
], ids=["hf-engine", "server"])
def test_diagnose_vllm_flags_without_the_vllm_engine_are_refused(args, message):
    """train refuses vllm.* without engine=vllm; diagnose's --vllm-* flags likewise, before any model loads
    (the model directory does not exist), never silently ignored."""
    result = offpolicy("diagnose", "--model", "/nonexistent/model", *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"offpolicy diagnose: error: {message}" + (
        " (pass the option to the server instead)" if "server" in message else "")]
