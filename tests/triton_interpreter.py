"""Triton's interpreter (``TRITON_INTERPRET=1``, the CPU runs of the Triton rung) without its repeated patching.

The interpreter swaps ``triton.language``'s builtins for numpy ones around every kernel launch
(``_patch_lang`` in ``GridExecutor.__call__``, undone when the launch ends). It also does it again at
every call of a ``@triton.jit`` device function from inside a kernel, and never undoes those: the
builtins are patched already, and the second patch re-reads every member of ``triton.language`` through
``inspect.getmembers`` (~2 ms a call). The rung's kernels call their helpers (``_tokens``, ``_row_stats``,
``_finish``, …) thousands of times per test at the tests' shapes, so half of ``tests/test_triton.py``'s
time was that repeated patching.

:func:`install` skips the patch where the same module globals are patched already by the launch that is
running. It changes no numbers: the device function sees the same patched builtins it would have set
itself. A device function from another module (other globals) is patched as before. Were a builtin left
unpatched, the interpreted call would fail loudly (a real ``tl`` builtin needs a compiler's ``_semantic``),
never pass quietly.
"""

from __future__ import annotations


def install() -> bool:
    """Wrap ``triton.runtime.interpreter._patch_lang``; ``False`` (nothing changed) where this Triton's
    interpreter lacks the pieces it wraps."""
    try:
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 - no Triton, or one that does not import: its tests skip on their own
        return False
    original, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "_offpolicy_once", False):
        return False
    patched: set[int] = set()  # id() of the globals whose launch is running, its builtins patched

    def patch_lang(fn):
        key = id(fn.__globals__)
        if key in patched:  # a device function called inside a launch over the same globals
            return scope_type()  # nothing to set, nothing to restore
        scope = original(fn)
        patched.add(key)
        restore = scope.restore

        def restore_and_forget() -> None:
            patched.discard(key)
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang._offpolicy_once = True
    interpreter._patch_lang = patch_lang
    return True
