"""The CLI in this test process: ``offpolicy.cli.main(argv)`` with what a subprocess would give —
its own environment, working directory, stdout and stderr, and an exit code — without a new
interpreter's start (~4 s of torch, ~8 s with transformers, for every call of a suite that makes
dozens).

``python -m offpolicy`` itself (the entry point, a fresh process) stays covered by the tests that
must run apart: the README's commands as typed (tests/test_readme.py), signals (Ctrl-C, SIGTERM),
peak memory, the real model and the vLLM engines, and one run of each command in its own module.

What a subprocess would show and this reproduces:

* stdout and stderr as text, rich's console included (it writes to ``sys.stdout`` at print time);
* ``logging`` warnings on stderr, as Python's last-resort handler prints them in a process that
  configured no logging (``%(message)s``): pytest's own handlers on the root logger would otherwise
  take them;
* the exit code: ``main``'s return value, ``SystemExit``'s code (argparse), and 1 with the
  traceback on stderr for any other exception, as the interpreter does;
* afterwards, nothing leaks into the next test: the environment, the working directory, torch's thread
  count and transformers' logging verbosity and progress bars (``main`` quiets them) are put back.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None, cwd: str | Path | None) -> Iterator[None]:
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


@contextlib.contextmanager
def _transformers_logging() -> Iterator[None]:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the core install: main() never touches it
        yield
        return
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()


def _torch_threads() -> int | None:
    import sys

    torch = sys.modules.get("torch")  # the core CLI never imports torch for --help or presets: nor does this
    return None if torch is None else torch.get_num_threads()


def run_cli(*args: str, env: Mapping[str, str] | None = None, cwd: str | Path | None = None
            ) -> subprocess.CompletedProcess:
    """``offpolicy ARGS`` in this process; ``env`` replaces the environment for the call (pass
    ``{**os.environ, ...}`` to add to it), as ``subprocess.run(env=...)`` does."""
    from offpolicy.cli import main

    out, err = io.StringIO(), io.StringIO()
    threads = _torch_threads()  # an engine may set its own (vLLM's CPU worker does): put back after
    handler = logging.StreamHandler(err)  # the last-resort handler's place and format
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with _environment(env, cwd), _transformers_logging(), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as stop:  # argparse's usage errors (2), --help (0)
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if stop.code is not None and not isinstance(stop.code, int):
                    print(stop.code, file=err)
            except Exception:  # noqa: BLE001 - an uncaught exception ends a process with 1 and its traceback
                traceback.print_exc(file=err)
                code = 1
    finally:
        root.removeHandler(handler)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["offpolicy", *args], code, out.getvalue(), err.getvalue())


def vllm_starts_here() -> bool:
    """Whether vLLM can start in this process: not where it has imported Flask (AReaL's tests do). vLLM's CPU
    platform walks every loaded module's attributes at start-up (``_rebind_kernels``), and Flask's context proxies
    (``current_app``) raise RuntimeError there: "Working outside of application context". Where it cannot, a test
    runs the same vLLM code in a fresh interpreter (``run_vllm_cli``, tests/vllm_inprocess.py)."""
    import sys

    return "flask" not in sys.modules


def run_vllm_cli(*args: str) -> subprocess.CompletedProcess:
    """``offpolicy ARGS`` that starts vLLM: in this process (one vLLM import per worker), or as its own
    ``python -m offpolicy`` where vLLM cannot start here (``vllm_starts_here``)."""
    import sys

    if vllm_starts_here():
        return run_cli(*args)
    return subprocess.run([sys.executable, "-m", "offpolicy", *args], capture_output=True, text=True, timeout=900)


def offpolicy(*args: str, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
              process: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """``offpolicy ARGS``: in this process (``run_cli``), or with ``process`` as its own ``python -m offpolicy``
    — from the interpreter, never from PATH (a shell without the venv's bin must pass too, issue #9) — for the
    tests that need the command as typed end to end (its exit status, a fresh interpreter)."""
    import sys

    if not process:
        return run_cli(*args, env=env, cwd=cwd)
    return subprocess.run([sys.executable, "-m", "offpolicy", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)
