"""A work-around for Triton's interpreter: scalar kernel arguments used as Python integers.

In the interpreter every scalar is a one-element NumPy array, and a loop such as
``for p in range(0, P)`` over a runtime argument calls ``int(array)``.  Triton 3.3 to 3.6 do
exactly that, which NumPy 2.5 refuses for arrays of rank one ("only 0-dimensional arrays can
be converted to Python scalars"); Triton 3.7 and later squeeze first.  :func:`patch` makes the
older interpreters squeeze too, so the kernels run in the interpreter with every Triton version
``pyproject.toml`` admits.  Harmless where the interpreter already does it.
"""

from __future__ import annotations

_patched = False


def _scalar_index(self) -> int:
    data = self.handle.data
    return int(data.reshape(-1)[0]) if getattr(data, "size", 1) == 1 else int(data)


def patch() -> bool:
    """Install the work-around once; returns whether the interpreter's tensor patching was found."""
    global _patched
    if _patched:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton, or one without an interpreter: nothing to mend
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False

    def patch_lang_tensor(tensor, *scope):
        original(tensor, *scope)
        if scope:  # Triton >= 3.4 restores what a launch patched through a scope object
            scope[0].set_attr(tensor, "__index__", _scalar_index)
        else:
            tensor.__index__ = _scalar_index

    interpreter._patch_lang_tensor = patch_lang_tensor
    _patched = True
    return True
