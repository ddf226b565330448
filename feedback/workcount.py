"""What a Triton kernel launch really does, counted under Triton's interpreter.

Interpreter time says nothing about GPU time, but the interpreter executes every program of the
grid, every load, store and arithmetic operation of the kernel exactly as written.  Counting them
gives device-independent work signals that a CPU machine can judge:

* bytes loaded and stored per named tensor: ``reads(name)`` is the bytes loaded divided by the
  tensor's size, so a value of 16 says every element was fetched 16 times in one launch (16
  programs repeating the same per-head work, say);
* elements processed by divisions and special functions (sqrt, rsqrt, exp, log, ...), per kind, and
  the multiply-accumulates of ``tl.dot`` (``dot_macs``);
* every launch's kernel name and grid;
* the same per kernel: ``kernel_loaded`` / ``kernel_stored`` count every byte a kernel moves (named
  tensor or not: its scratch buffers too), ``kernel_ops`` its operations.  ``report`` turns them into
  counted metrics (``Metric.counted``), which the verdict judges against the base exactly.

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
        # per kernel (by name): every byte loaded and stored, at any address, and operations by kind
        self.kernel_loaded: Counter[str] = Counter()
        self.kernel_stored: Counter[str] = Counter()
        self.kernel_ops: Counter[tuple[str, str]] = Counter()
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

    def kernels(self) -> list[str]:
        """The kernels launched, by name, in the order of their first launch."""
        return list(dict.fromkeys(launch.kernel for launch in self.launches))

    @property
    def _current(self) -> str:
        return self.launches[-1].kernel if self.launches else "?"

    # --- hooks --------------------------------------------------------------------------------

    def _ranges(self):
        out = []
        for name, t in self.tensors.items():
            if t.device.type != "cpu":
                raise WorkCountError(f"tensor {name!r} is on {t.device}: the interpreter counts CPU tensors only")
            base = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
            out.append((base, base + t.numel() * t.element_size(), name, t.element_size()))
        return out

    def _attribute(self, counter: Counter, per_kernel: Counter, ptrs, mask) -> None:
        import numpy as np

        addr = np.asarray(ptrs.data).reshape(-1)
        if mask is not None:
            addr = addr[np.asarray(mask.data).reshape(-1).astype(bool)]
        if addr.size == 0:
            return
        per_kernel[self._current] += int(addr.size) * _element_bytes(ptrs)
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
                wc._attribute(wc.loaded, wc.kernel_loaded, ptrs, mask)
                return orig(b, ptrs, mask, *rest, **kw)
            return hooked

        def store(orig):
            def hooked(b, ptrs, value, mask, *rest, **kw):
                wc._attribute(wc.stored, wc.kernel_stored, ptrs, mask)
                return orig(b, ptrs, value, mask, *rest, **kw)
            return hooked

        def op(kind):
            def make(orig):
                def hooked(b, arg, *rest, **kw):
                    n = int(getattr(getattr(arg, "data", None), "size", 1))
                    wc.ops[kind] += n
                    wc.kernel_ops[wc._current, kind] += n
                    return orig(b, arg, *rest, **kw)
                return hooked
            return make

        def dot(orig):
            def hooked(b, a, bb, *rest, **kw):  # [.., M, K] x [.., K, N]: M K N multiply-accumulates a batch
                lhs, rhs = getattr(a, "data", None), getattr(bb, "data", None)
                if getattr(lhs, "size", None) is None or not getattr(rhs, "shape", None):
                    raise WorkCountError("this Triton's interpreter hands tl.dot operands without arrays: "
                                         "cannot count its multiply-accumulates")
                n = int(lhs.size) * int(rhs.shape[-1])
                wc.ops["dot_macs"] += n
                wc.kernel_ops[wc._current, "dot_macs"] += n
                return orig(b, a, bb, *rest, **kw)
            return hooked

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
            if hasattr(builder, "create_dot"):
                patch(builder, "create_dot", dot)
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


def _element_bytes(ptrs) -> int:
    """The size of what a block of pointers points at (the interpreter keeps its Triton pointer type)."""
    ty = getattr(getattr(ptrs, "dtype", None), "element_ty", None)
    bits = getattr(ty, "primitive_bitwidth", None)
    if not bits:
        raise WorkCountError(f"cannot tell the element size of a load through {getattr(ptrs, 'dtype', None)!r}")
    return max(1, bits // 8)


def report(ctx, wc: WorkCount, per: float, unit: str, kernel_location=None, prefix: str = "") -> None:
    """Counted metrics of everything ``wc`` saw, divided by ``per`` (tokens, outputs): over all kernels
    ``loaded_bytes`` and ``stored_bytes`` (every byte, scratch buffers too), ``<op>`` (divisions, special functions,
    dot multiply-accumulates) and ``launches``, lower-is-better and ``counted``: the verdict calls any change of
    them beyond ``verdict.COUNT_TOLERANCE`` a change, with no noise floor.  The same per kernel
    (``<kernel>.loaded_bytes``, ``<kernel>.<op>``, ...) as parts, shown with their moves and not judged (work moved
    from one kernel to another, two kernels fused, is no regression); where a total regressed, the kernels whose
    own counts grew localise it.  One finding per kernel states its counts, bound to ``kernel_location(kernel)``
    (a dict of file / kernel / condition) where given.  ``prefix`` goes before every metric's name (several
    counted calls in one probe)."""
    per = float(per)
    if per <= 0:
        raise ValueError(f"per must be positive, got {per}")
    launches: Counter[str] = Counter(launch.kernel for launch in wc.launches)
    for kernel in wc.kernels():
        ops = {kind: n for (k, kind), n in sorted(wc.kernel_ops.items()) if k == kernel and n}
        loaded, stored = wc.kernel_loaded[kernel] / per, wc.kernel_stored[kernel] / per
        ctx.metric(f"{prefix}{kernel}.loaded_bytes", loaded, unit=f"B/{unit}", counted=True)
        ctx.metric(f"{prefix}{kernel}.stored_bytes", stored, unit=f"B/{unit}", counted=True)
        for kind, n in ops.items():
            ctx.metric(f"{prefix}{kernel}.{kind}", n / per, unit=f"/{unit}", counted=True)
        ctx.metric(f"{prefix}{kernel}.launches", launches[kernel], counted=True)
        grids = sorted({launch.grid for launch in wc.launches if launch.kernel == kernel})
        text = ", ".join([f"{loaded:.4g} B loaded", f"{stored:.4g} B stored"]
                         + [f"{n / per:.4g} {kind}" for kind, n in ops.items()])
        where = dict(kernel_location(kernel) if kernel_location else {}, kernel=kernel, part=f"{prefix}{kernel}")
        ctx.finding(f"per {unit}: {text}; {launches[kernel]} launch(es), grid {', '.join(map(str, grids))}", **where)
    ctx.metric(f"{prefix}launches", len(wc.launches), better="lower", counted=True)
    ctx.metric(f"{prefix}loaded_bytes", sum(wc.kernel_loaded.values()) / per, unit=f"B/{unit}", better="lower",
               counted=True)
    ctx.metric(f"{prefix}stored_bytes", sum(wc.kernel_stored.values()) / per, unit=f"B/{unit}", better="lower",
               counted=True)
    totals: Counter[str] = Counter()
    for (_, kind), n in wc.kernel_ops.items():
        totals[kind] += n
    for kind, n in sorted(totals.items()):
        if n:
            ctx.metric(f"{prefix}{kind}", n / per, unit=f"/{unit}", better="lower", counted=True)
