"""Shared fixtures and builders. Hypothesis runs a fixed, CI-sized number of examples."""

from __future__ import annotations

import math
import os
import types
from collections.abc import Callable

import pytest
import torch

# Triton kernels run on the CPU under Triton's interpreter; it must be chosen before they are defined
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        import triton_interpreter  # tests/triton_interpreter.py: the interpreter patches once per launch

        triton_interpreter.install()
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import parallel_plan as parallel  # noqa: E402 - tests/parallel_plan.py: how the suite spreads over xdist workers

# at most 2 threads as before, and under xdist the cores shared out among the workers (1 each on 2 cores):
# two workers with two OpenMP threads each on two cores only wait on each other. Subprocesses (the CLI,
# vLLM servers, hosts' workers) inherit OMP_NUM_THREADS.
torch.set_num_threads(min(parallel.threads_per_worker(), torch.get_num_threads()))
if parallel.worker_count() > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(parallel.threads_per_worker()))


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="merge each test's seconds into tests/durations.json, which orders the tests of a "
                          "parallel run longest first")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `-p no:xdist` must still load this file
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: cores, capped by memory (tests/parallel_plan.py); PYTEST_XDIST_AUTO_NUM_WORKERS overrides."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    return int(env) if env else parallel.auto_workers()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    parallel.add_groups(items, pytest.mark.xdist_group)
    if hasattr(config, "workerinput"):  # an xdist worker; a serial run keeps the files' order
        parallel.longest_first(items, parallel.load_durations())


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    nodeid = parallel.strip_group(report.nodeid)
    _seconds[nodeid] = _seconds.get(nodeid, 0.0) + report.duration  # setup + call + teardown


def pytest_sessionfinish(session):
    if session.config.getoption("--record-durations") and not hasattr(session.config, "workerinput") and _seconds:
        parallel.record(_seconds, parallel.DURATIONS)  # the controller (or a serial run) writes it

# the cache the user built SmolLM2 into, read before any fixture points OFFPOLICY_CACHE at a temporary one
_USER_CACHE = os.environ.get("OFFPOLICY_CACHE")


def require_host(*modules: str, why: str):
    """Import a host framework's modules, or skip the calling test module with the reason.

    ``pytest.importorskip`` on the top package alone is not enough: a host's package can import while
    the submodule a test needs fails on a dependency the environment lacks (verl's tensordict_utils
    needs orjson), which was a collection error, not a skip. Any exception from the *host's* import
    skips, with its type and message; offpolicy's own adapter is imported after this, unguarded, so a
    defect of ours still fails.
    """
    import importlib

    loaded = []
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except Exception as err:  # noqa: BLE001 - any failure of the host's own import is a skip
            pytest.skip(f"{why}: `import {name}` failed with {type(err).__name__}: {err}", allow_module_level=True)
    return loaded[0] if len(loaded) == 1 else tuple(loaded)


class LazyModule:
    """A module imported when a test first reads one of its attributes: ``load()`` returns it. Keeps a heavy
    host import (AReaL's, vLLM's) off the collection path, which every xdist worker pays for every test
    module. Dunder lookups never load it: pytest's collection probes module-level objects for
    ``__test__``, ``__wrapped__``, … and would otherwise import it on every worker."""

    def __init__(self, load: Callable[[], types.ModuleType]):
        self._load = load

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._load(), name)


LN2 = math.log(2.0)
BASE = -3.0  # log μ of every golden token: low enough that log μ + log ρ stays ≤ 0 for ρ ≤ 8


def fixed_denominator(cfg):
    """``cfg`` with ``denominator: fixed``: OpenRLHF and SkyRL fix their token count before the loss."""
    return cfg.model_copy(update={"correction": cfg.correction.model_copy(update={"denominator": "fixed"})})


def previous_recommended():
    """``recommended`` before the long-response sweep (issue #12): PPO ε = 0.2, token-mean, sequence
    TIS w = min(Π ρ_t, 2) + the any-token veto at 1e-4 — a sequence weight and a row veto through a
    host — with the denominator fixed."""
    import offpolicy as op

    return fixed_denominator(op.LossConfig(correction=op.CorrectionConfig(
        anchor="old", weight={"level": "sequence", "mode": "truncate", "high": 2.0},
        reject=[{"stat": "ratio", "level": "any_token", "low": 1e-4}])))


def golden_batch() -> dict[str, torch.Tensor]:
    """Four rows, T = 3, with ratios ρ = π_old/μ chosen to be easy on paper:

        row 0: ρ = [0.5, 1, 4]      product 2, geometric 2^(1/3) = 1.259921
        row 1: ρ = [2, 1, ·]        product 2, geometric √2 = 1.414214   (last token padding)
        row 2: ρ = [1, 1, 1]        product 1
        row 3: all padding           (a fully padded row)

    log μ = −3 everywhere; padding positions hold NaN to prove they are never read.
    """
    ratios = torch.tensor([[0.5, 1.0, 4.0], [2.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
    rollout = torch.full((4, 3), BASE)
    old = rollout + ratios.log()
    nan = torch.tensor(float("nan"))
    rollout = torch.where(mask.bool(), rollout, nan)
    old = torch.where(mask.bool(), old, nan)
    return {"old": old, "rollout": rollout, "mask": mask, "ratios": ratios}


@pytest.fixture
def gb() -> dict[str, torch.Tensor]:
    return golden_batch()


def random_batch(seed: int, b: int = 6, t: int = 9, noise: float = 0.3) -> dict[str, torch.Tensor]:
    """A realistic batch: right-padded rows of random length, one per-row advantage."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=g) * 3 - 0.05
    rollout = (old + noise * torch.randn(b, t, generator=g)).clamp(max=0.0)
    logprobs = (old + 0.1 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    return {"old": old, "rollout": rollout, "logprobs": logprobs, "adv": adv, "mask": mask}


def host_batch(seed: int = 0, b: int = 6, t: int = 7, noise: float = 0.3) -> dict[str, torch.Tensor]:
    """A host adapter's micro-batch (π_θ ``logp``, π_old ``old``, μ ``mu``, ``adv``, ``mask``): μ = π_old plus
    N(0, noise²) per token, row 2 with log ρ = +2 everywhere (ρ = 7.4, outside every band), rows 0 and 3
    right-padded."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 2 - 0.05
    old = (logp + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-3)  # log-probs are ≤ 0
    mu = (old + noise * torch.randn(b, t, generator=g)).clamp(max=-1e-3)
    mu[2] = old[2] - 2.0
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    mask = torch.ones(b, t)
    mask[0, 4:] = 0
    mask[3, 2:] = 0
    return {"logp": logp, "old": old, "mu": mu, "adv": adv, "mask": mask}


def _gloo_rank(rank: int, fn, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(fn(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(fn, tmp_path, world: int = 2) -> list:
    """``fn(rank)`` on each of ``world`` gloo ranks, each in its own process with the process group
    up; returns what each rank's call returned, in rank order. ``fn`` must be a module-level
    function (the spawned processes import it by name)."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_rank, args=(fn, world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="session")
def offpolicy_cache(tmp_path_factory):
    """One warm-start cache for the whole run, shared by the xdist workers (the warm start runs once,
    ~15 s; its cache entries appear by an atomic rename, so two workers never see half of one)."""
    path = parallel.built_once(tmp_path_factory, "offpolicy-cache", lambda directory: None)
    old = os.environ.get("OFFPOLICY_CACHE")
    os.environ["OFFPOLICY_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("OFFPOLICY_CACHE", None)
    else:
        os.environ["OFFPOLICY_CACHE"] = old


# a small, fast training config shared by the end-to-end tests (same warm start for all)
FAST = ["engine=hf", "engine.dtype=fp32", "prompts_per_step=4", "group_size=4", "minibatches=2", "eval_every=2",
        "eval_problems=16", "checkpoint_every=2"]


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A local 'real' model directory: tiny Qwen2 + BPE tokenizer trained on the shipped data + ChatML
    (tests/hf_fixtures.py), built once per run (every xdist worker reads the same directory)."""
    from hf_fixtures import save_tiny_qwen2

    return parallel.built_once(tmp_path_factory, "tiny-qwen2", save_tiny_qwen2)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as built by ``scripts/smollm2.py`` (``bash install.sh`` runs it), found in
    the user's offpolicy cache; the test skips, naming the command that builds it, where it is absent."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "smollm2.py"
    spec = importlib.util.spec_from_file_location("offpolicy_smollm2_script", script)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    root = Path(_USER_CACHE) if _USER_CACHE else Path.home() / ".cache" / "offpolicy"
    path = builder.model_dir(root)
    if not builder.is_built(path):
        pytest.skip(f"SmolLM2-135M-Instruct is not built at {path}: run `python scripts/smollm2.py` "
                    "(bash install.sh does, unless --no-model)")
    return path
