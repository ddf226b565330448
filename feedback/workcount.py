"""What a Triton kernel launch really does, counted under Triton's interpreter.

Interpreter time says nothing about GPU time, but the interpreter executes every program of the
grid, every load, store and arithmetic operation of the kernel exactly as written.  Counting them
gives device-independent work signals that a CPU machine can judge:

* bytes loaded and stored per named tensor: ``reads(name)`` is the bytes loaded divided by the
  tensor's size, so a value of 16 says every element was fetched 16 times in one launch (16
  programs repeating the same per-head work, say);
* elements processed by divisions and special functions (sqrt, rsqrt, exp, log, ...), per kind;
* every launch's kernel name and grid.

Usage, with ``TRITON_INTERPRET=1`` set before triton is imported::

    with WorkCount(q=q, k=k, state=pool) as wc:
        kernel_wrapper(q, k, ...)
    wc.reads("q"), wc.ops["fdiv"], wc.launches

It hooks the interpreter's builder (``triton.runtime.interpreter``), whose memory and arithmetic
entry points have kept their names across the Triton versions this project admits (3.3 to 3.9);
arguments are taken positionally and counted by the array they carry, so a changed keyword list
does not matter.  A hook that cannot be installed is an error, never a silent zero.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any

#: builder method -> the operation kind it counts (the first argument's elements)
OPS = {
    "create_fdiv": "fdiv", "create_precise_divf": "fdiv", "create_approx_divf": "fdiv",
    "create_sqrt": "sqrt", "create_precise_sqrt": "sqrt", "create_rsqrt": "rsqrt",
    "create_exp": "exp", "create_exp2": "exp", "create_log": "log", "create_log2": "log",
    "create_sin": "trig", "create_cos": "trig", "create_erf": "erf",
}


class WorkCountError(RuntimeError):
    pass


@dataclasses.dataclass
class Launch:
    kernel: str
    grid: tuple[int, int, int]

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


class WorkCount:
    """Counts loads and stores per named tensor, operations per kind and launches, while active."""

    def __init__(self, **tensors: Any):
        self.tensors = dict(tensors)
        self.loaded: Counter[str] = Counter()  # bytes
        self.stored: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()  # elements
        self.launches: list[Launch] = []
        self._saved: list[tuple[object, str, Any]] = []

    # --- results ------------------------------------------------------------------------------

    def nbytes(self, name: str) -> int:
        t = self.tensors[name]
        return t.numel() * t.element_size()

    def reads(self, name: str) -> float:
        """Bytes loaded from ``name`` over its size: 1.0 means every byte fetched once."""
        return self.loaded[name] / max(1, self.nbytes(name))

    def writes(self, name: str) -> float:
        return self.stored[name] / max(1, self.nbytes(name))

    # --- hooks --------------------------------------------------------------------------------

    def _ranges(self):
        out = []
        for name, t in self.tensors.items():
            if t.device.type != "cpu":
                raise WorkCountError(f"tensor {name!r} is on {t.device}: the interpreter counts CPU tensors only")
            base = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
            out.append((base, base + t.numel() * t.element_size(), name, t.element_size()))
        return out

    def _attribute(self, counter: Counter, ptrs, mask) -> None:
        import numpy as np

        addr = np.asarray(ptrs.data).reshape(-1)
        if mask is not None:
            addr = addr[np.asarray(mask.data).reshape(-1).astype(bool)]
        if addr.size == 0:
            return
        for lo, hi, name, size in self._ranges_cache:
            n = int(np.count_nonzero((addr >= lo) & (addr < hi)))
            if n:
                counter[name] += n * size

    def __enter__(self) -> WorkCount:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise WorkCountError("WorkCount needs Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")
        from triton.runtime import interpreter as interp

        builder, executor = interp.InterpreterBuilder, interp.GridExecutor
        for name in ("create_masked_load", "create_masked_store", "set_grid_dim"):
            if not hasattr(builder, name):
                raise WorkCountError(f"this Triton's interpreter has no InterpreterBuilder.{name}: cannot count memory")
        self._ranges_cache = self._ranges()
        wc = self

        def patch(owner, name, make):
            orig = getattr(owner, name)
            self._saved.append((owner, name, orig))
            setattr(owner, name, make(orig))

        def load(orig):
            def hooked(b, ptrs, mask, *rest, **kw):
                wc._attribute(wc.loaded, ptrs, mask)
                return orig(b, ptrs, mask, *rest, **kw)
            return hooked

        def store(orig):
            def hooked(b, ptrs, value, mask, *rest, **kw):
                wc._attribute(wc.stored, ptrs, mask)
                return orig(b, ptrs, value, mask, *rest, **kw)
            return hooked

        def op(kind):
            def make(orig):
                def hooked(b, arg, *rest, **kw):
                    wc.ops[kind] += int(getattr(getattr(arg, "data", None), "size", 1))
                    return orig(b, arg, *rest, **kw)
                return hooked
            return make

        def call(orig):
            def hooked(ex, *args, **kwargs):
                wc.launches.append(Launch(kernel=getattr(ex.fn, "__name__", "?"), grid=(0, 0, 0)))
                return orig(ex, *args, **kwargs)
            return hooked

        def grid_dim(orig):
            def hooked(b, *dims):  # the interpreter resolves the grid (a callable one too) and sets it here
                if wc.launches:
                    wc.launches[-1].grid = tuple(int(d) for d in dims)
                return orig(b, *dims)
            return hooked

        try:
            patch(builder, "create_masked_load", load)
            patch(builder, "create_masked_store", store)
            for meth, kind in OPS.items():
                if hasattr(builder, meth):
                    patch(builder, meth, op(kind))
            patch(executor, "__call__", call)
            patch(builder, "set_grid_dim", grid_dim)
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            owner, name, orig = self._saved.pop()
            setattr(owner, name, orig)
