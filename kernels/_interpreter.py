"""Compatibility of the Triton interpreter (``TRITON_INTERPRET=1``) with the installed numpy."""

from __future__ import annotations


def fix_interpreter_index() -> None:
    """Let the Triton 3.6 interpreter run loops with runtime bounds under numpy >= 2.4.

    The interpreter turns scalars into ``int`` with ``int(array)`` on 1-element arrays, which numpy
    2.4 refuses (triton-lang/triton#9171, fixed upstream by #9172 after 3.6), so every
    ``tl.range(0, n)`` fails. Called by whatever switches to the interpreter (the test tiers,
    ``tune --device cpu``), never at import. Drop it once the project requires a Triton with the fix.
    """
    import numpy as np
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "_tritune_index_fix", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._tritune_index_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
