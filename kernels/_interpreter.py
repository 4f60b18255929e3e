"""Compatibility of the Triton interpreter (``TRITON_INTERPRET=1``) with the installed numpy."""

from __future__ import annotations


def fix_interpreter_index() -> None:
    """Let the Triton 3.6 interpreter run loops with runtime bounds under numpy >= 2.4.

    The interpreter turns scalars into ``int`` with ``int(array)`` on 1-element arrays, which numpy
    2.4 refuses (triton-lang/triton#9171, fixed upstream by #9172 after 3.6), so every
    ``tl.range(0, n)`` fails. The op bodies apply this at their first interpreted launch
    (``_launch.prepare_interpreter``); whatever launches kernels below them on the interpreter (the
    test tiers, ``tune --device cpu``) calls it itself. Never at import, and idempotent. A Triton
    whose interpreter no longer has the patched hook is left alone. Drop this once the project
    requires a Triton with the fix.
    """
    import numpy as np
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_tritune_index_fix", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._tritune_index_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
