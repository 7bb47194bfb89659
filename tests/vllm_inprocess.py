"""A test's vLLM engine code (a script that starts ``offpolicy.engines.vllm.VLLMEngine`` and prints one JSON
object last) run in this worker where vLLM can start here, else in a fresh interpreter, as
tests/cli_inprocess.py's ``run_vllm_cli`` runs the CLI: the same script, the same real engine either way.

In this worker the tests that use it are in the ``real-model`` xdist group, whose worker imports vLLM once a run
(tests/test_vllm_api.py, SmolLM2's runs): a fresh interpreter pays torch, transformers and vLLM's imports again
(~10 s of CPU on the 2-core box) for each engine. It is a fresh interpreter where vLLM cannot start in this
worker (``cli_inprocess.vllm_starts_here``: the worker imported Flask).

Afterwards nothing leaks into the next test: the environment (the engine sets vLLM's variables) and torch's
thread count are put back, and the script's names live in their own namespace.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from cli_inprocess import vllm_starts_here

SRC = Path(__file__).resolve().parents[1] / "src"


def run_engine_script(script: str, timeout: float = 600) -> dict:
    """``script``'s last line of stdout, read as JSON: run here (see the module's docstring) or, where vLLM cannot
    start in this worker (``cli_inprocess.vllm_starts_here``), by ``python -c`` with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and this checkout's ``src``."""
    if not vllm_starts_here():
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                              timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    import torch

    saved_env, threads, out = dict(os.environ), torch.get_num_threads(), io.StringIO()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(script, "<vllm engine script>", "exec"), {"__name__": "__vllm_engine_script__"})
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
    return json.loads(out.getvalue().strip().splitlines()[-1])
