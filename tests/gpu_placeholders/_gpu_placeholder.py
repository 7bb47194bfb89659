"""Import-time placeholders for OpenRLHF's GPU-only dependencies (DeepSpeed, flash-attn) on a CPU box.

OpenRLHF 0.11.2 imports ``deepspeed`` and ``flash_attn.bert_padding`` at module level in
``openrlhf.models`` / ``ppo_actor``, but the CPU training step the e2e test runs (no ZeRO-3, no
sample packing, no ring attention) never calls them. This directory goes first on the Ray worker's
PYTHONPATH only when the real package is absent; any *use* of a placeholder raises, so a code path
that does need DeepSpeed or flash-attn fails loudly instead of running on a fake.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Unavailable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a CPU import placeholder (tests/gpu_placeholders): the code path "
                           "that called it needs the real GPU package")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")


class _Module(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


# The submodules OpenRLHF 0.11.2 imports at module level on the CPU path (models/, ppo_actor,
# utils/deepspeed). Any other submodule stays absent (ImportError), so OpenRLHF's own fallbacks run:
# models/utils.log_probs_from_logits tries flash_attn.ops.triton.cross_entropy and falls back to torch.
SUBMODULES = {
    "deepspeed": ("runtime", "runtime.zero", "runtime.zero.partition_parameters"),
    "flash_attn": ("bert_padding", "utils", "utils.distributed"),
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str) -> None:
        self.names = {f"{root}.{sub}" for sub in SUBMODULES.get(root, ())}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _Module(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module) -> None:
        pass


def make_package(module: types.ModuleType) -> None:
    """Turn the placeholder package ``module`` into one whose submodules and attributes all import."""
    module.__class__ = _Module
    module.__placeholder__ = True
    sys.meta_path.append(_Finder(module.__name__))
