"""CPU emulation of tensor-core dot precision for Triton's interpreter.

Triton's interpreter (``TRITON_INTERPRET=1``) computes every ``tl.dot`` as an exact fp32 NumPy
product and ignores ``input_precision``, so a kernel that leaves an fp32 accumulation chain at
Triton's default precision (tf32) looks perfect on a CPU.  This module makes interpreted dots
behave like the tensor cores:

* ``tf32`` (and the default, since Triton's default fp32 precision *is* tf32): both fp32
  operands are reduced to tf32 (1 sign, 8 exponent, 10 mantissa bits) by **truncating** the 13
  low mantissa bits, then multiplied and accumulated in fp32.
* ``tf32x3``: each operand is split into a tf32 ``big`` part and a tf32 ``small`` remainder and
  the product is ``big*big + big*small + small*big`` (the small*small term is dropped), which
  recovers nearly full fp32 accuracy.
* ``ieee``: the exact fp32 product (unchanged).

Only fp32 x fp32 dots are touched; bf16/fp16/int8 dots are already exact in the interpreter.

Why truncation: measured on an H200 (DESIGN.md, bench/RESULTS.md), the error of a 64x64 fp32
affine chain through ``tl.dot`` at tf32 matches truncation within a few percent at 2 to 128
links, while round-to-nearest underestimates it more than tenfold at 128 links (its error is
unbiased and grows like the square root of the chain length; truncation's is biased and grows
almost linearly).  ``rounding="nearest"`` is kept only to reproduce that comparison.

Use :func:`dot_precision` as a context manager, or set ``INFRA_AGENT_EMULATE_DOT=1`` (or
``=nearest``) in a subprocess's environment and call :func:`install_from_env` there (the
feedback runner does this for every probe it starts without a GPU).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import numpy as np

ENV_VAR = "INFRA_AGENT_EMULATE_DOT"
ROUNDINGS = ("truncate", "nearest")

_lock = threading.Lock()
_active: list[str] = []  # stack of rounding modes; the innermost wins
_original_create_dot = None


def to_tf32(x: np.ndarray, rounding: str = "truncate") -> np.ndarray:
    """Reduce fp32 values to tf32 precision (10 explicit mantissa bits), kept in fp32 storage."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if rounding == "nearest":
        # round half to even on bit 13, then clear the 13 low bits (infinities/NaNs untouched)
        finite = (bits & 0x7F800000) != 0x7F800000
        lsb = (bits >> 13) & 1
        rounded = (bits + np.uint32(0x0FFF) + lsb) & np.uint32(0xFFFFE000)
        bits = np.where(finite, rounded, bits)
    elif rounding == "truncate":
        bits = bits & np.uint32(0xFFFFE000)
    else:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return bits.astype(np.uint32).view(np.float32)


def split_tf32(x: np.ndarray, rounding: str = "truncate") -> tuple[np.ndarray, np.ndarray]:
    """x ~= big + small, both tf32: the operand split used by the tf32x3 algorithm."""
    x = np.asarray(x, dtype=np.float32)
    big = to_tf32(x, rounding)
    small = to_tf32((x - big).astype(np.float32), rounding)
    return big, small


def emulated_matmul(a: np.ndarray, b: np.ndarray, precision: str, rounding: str = "truncate") -> np.ndarray:
    """fp32 ``a @ b`` as a tensor core computes it at ``precision`` ('tf32', 'tf32x3', 'ieee')."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    if precision == "ieee":
        return np.matmul(a, b, dtype=np.float32)
    if precision == "tf32":
        return np.matmul(to_tf32(a, rounding), to_tf32(b, rounding), dtype=np.float32)
    if precision == "tf32x3":
        a_big, a_small = split_tf32(a, rounding)
        b_big, b_small = split_tf32(b, rounding)
        # small terms first, as the hardware algorithm accumulates them before the big product
        acc = np.matmul(a_big, b_small, dtype=np.float32) + np.matmul(a_small, b_big, dtype=np.float32)
        return acc + np.matmul(a_big, b_big, dtype=np.float32)
    raise ValueError(f"precision must be 'tf32', 'tf32x3' or 'ieee', got {precision!r}")


def _precision_name(input_precision) -> str:
    name = getattr(input_precision, "name", str(input_precision)).lower()
    return {"tf32": "tf32", "tf32x3": "tf32x3", "ieee": "ieee"}.get(name, name)


def _patched_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    rounding = _active[-1] if _active else None
    if rounding is None or a.data.dtype != np.float32 or b.data.dtype != np.float32:
        return _original_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    from triton.runtime.interpreter import TensorHandle

    product = emulated_matmul(a.data, b.data, _precision_name(input_precision), rounding)
    return TensorHandle((product + d.data).astype(d.data.dtype, copy=False), d.dtype.scalar)


def _scalar_index(self) -> int:
    data = self.handle.data
    return int(data.reshape(-1)[0]) if getattr(data, "size", 1) == 1 else int(data)


def _patch_scalar_index() -> None:
    """Interpreted scalars are one-element arrays; Triton 3.3-3.6 turn them into loop bounds with
    ``int(array)``, which NumPy 2.5 refuses for rank-one arrays (Triton 3.7+ squeeze first).  The
    harness mends that for any target it interprets (targets cannot be expected to)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "__infra_agent__", False):
        return

    def patch_lang_tensor(tensor, *scope):
        original(tensor, *scope)
        if scope:  # Triton >= 3.4 restores what a launch patched through a scope object
            scope[0].set_attr(tensor, "__index__", _scalar_index)
        else:
            tensor.__index__ = _scalar_index

    patch_lang_tensor.__infra_agent__ = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_autotune() -> None:
    """An autotuned kernel with several configs benchmarks them through a GPU driver, which the
    interpreter has none of (``0 active drivers``); and interpreter times mean nothing anyway.  Under
    the interpreter each autotuned kernel runs its first config (after the kernel's own pruning)."""
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.run
    if getattr(original, "__infra_agent__", False):
        return

    def run(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return original(self, *args, **kwargs)

    run.__infra_agent__ = True
    Autotuner.run = run


class _NoScope:
    """What a skipped re-patch returns where Triton expects a patch scope (3.4+; 3.3 ignores it)."""

    def restore(self) -> None:
        pass


def _patch_nested_calls() -> None:
    """Triton's interpreter re-patches ``triton.language`` (``_patch_lang``: a scan of every member of
    ``tl``, ``tl.tensor`` and ``tl.math``, ~0.3 ms) on every call of a ``@triton.jit`` helper, in every
    program of the grid, though the launch has already patched the same modules for its whole duration:
    in a decode step of the bundled model under the interpreter, 9,000 such calls were a quarter of the
    time.  Within a launch, a helper whose language modules the launch has already patched is not patched
    again; the first to see a module patches it as before.  What runs is unchanged: the patches a skipped
    call would make are the ones in force (Triton 3.3 keeps patches for good, 3.4+ restores them when
    the launch ends)."""
    import inspect

    from triton.runtime import interpreter

    original, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or getattr(original, "__infra_agent__", False):
        return
    lang = (getattr(interpreter, "tl", None), getattr(getattr(interpreter, "tl", None), "core", None))
    launches: list[set[int]] = []  # per launch in progress: the language modules it has patched
    langs_of: dict[int, tuple[dict, frozenset[int]]] = {}  # per module namespace (held: its id stays its own)

    def patch_lang(fn):
        space = fn.__globals__
        held = langs_of.get(id(space))
        if held is None or held[0] is not space:
            held = langs_of[id(space)] = (space, frozenset(id(v) for v in space.values()
                                                           if inspect.ismodule(v) and any(v is m for m in lang)))
        mine = held[1]
        if launches and launches[-1] and mine <= launches[-1]:
            return _NoScope()
        scope = original(fn)
        if launches:
            launches[-1].update(mine)
        return scope

    call = executor.__call__

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return call(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang.__infra_agent__ = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch


def mend_interpreter() -> None:
    """What the harness mends in Triton's interpreter for any target it interprets (targets cannot be
    expected to): scalar loop bounds under NumPy 2.5, autotuned kernels without a driver, helpers'
    redundant re-patching of the language (a quarter of an interpreted decode step's time)."""
    with _lock:
        _patch_scalar_index()
        _patch_autotune()
        _patch_nested_calls()


def _patch() -> None:
    global _original_create_dot
    from triton.runtime.interpreter import InterpreterBuilder

    if _original_create_dot is None:
        _original_create_dot = InterpreterBuilder.create_dot
        InterpreterBuilder.create_dot = _patched_create_dot
        _patch_scalar_index()


def active() -> str | None:
    """The rounding mode in force, or None when interpreted dots are exact."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def dot_precision(rounding: str = "truncate") -> Iterator[None]:
    """Within the block, interpreted fp32 ``tl.dot`` honours ``input_precision`` (tf32 by default)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    with _lock:
        _patch()
        _active.append(rounding)
    try:
        yield
    finally:
        with _lock:
            _active.remove(rounding)


def install(rounding: str = "truncate") -> None:
    """Turn the emulation on for the rest of the process."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    with _lock:
        _patch()
        _active.insert(0, rounding)


def env_setting() -> str | None:
    """The rounding requested by ``INFRA_AGENT_EMULATE_DOT`` ('1'/'truncate' or 'nearest'), else None."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return None
    if value in ("1", "on", "true", "yes", "truncate"):
        return "truncate"
    if value == "nearest":
        return "nearest"
    raise ValueError(f"{ENV_VAR} must be 1/truncate, nearest or 0, got {value!r}")


def install_from_env() -> str | None:
    """Mend the interpreter where it runs (``TRITON_INTERPRET=1``), and install the emulation if the
    environment asks for it; return the rounding installed."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        mend_interpreter()
    rounding = env_setting()
    if rounding is not None:
        install(rounding)
    return rounding
