"""Shared plumbing for target_stack's Triton ops: runtime selection, precision policy, checks."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
import triton

DOT_PRECISIONS = ("tf32", "tf32x3", "ieee")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def has_tf32(device: torch.device) -> bool:
    """tf32 tensor cores exist on NVIDIA GPUs of compute capability 8.0 and newer."""
    if interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def resolve_dot_precision(precision: str | None, device: torch.device, arg: str = "precision") -> str:
    """The precision policy for fp32 ``tl.dot``: None means tf32x3 where tf32 exists, else ieee.

    Naming a precision is a decision; leaving ``tl.dot`` at Triton's default (tf32) is the
    accident this project's harness exists to catch, so every fp32 dot states its precision.
    """
    if precision is None:
        return "tf32x3" if has_tf32(device) else "ieee"
    if precision not in DOT_PRECISIONS:
        raise ValueError(f"{arg} must be one of {DOT_PRECISIONS} or None, got {precision!r}")
    return precision


def block_size(n: int, minimum: int = 16) -> int:
    """Power-of-two tile covering ``n`` (tl.dot needs every tile dimension >= 16)."""
    return max(minimum, triton.next_power_of_2(n))


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    state_batch: int | None = None,
    max_k: int = 256,
) -> tuple[int, int, int, int, int]:
    """Validate KDA inputs (fla conventions); return (B, T, H, K, V) or raise ValueError."""
    for name, t, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have shape {tuple(q.shape)} ([B, T, H, K]), got {tuple(g.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must have shape [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if T == 0:
        raise ValueError("the sequence length T must be at least 1")
    if max_k < K:
        raise ValueError(f"head dimension K={K} is above the supported maximum {max_k}")
    if initial_state is not None:
        nb = B if state_batch is None else state_batch
        if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
            raise ValueError("initial_state must be a rank-4 tensor [N, H, K, V]")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
        if tuple(initial_state.shape[1:]) != (H, K, V) or (nb >= 0 and initial_state.shape[0] != nb):
            want = f"[{nb if nb >= 0 else 'N'}, {H}, {K}, {V}]"
            raise ValueError(f"initial_state must have shape {want}, got {tuple(initial_state.shape)}")
    return B, T, H, K, V


# Poisoning: when on, every buffer a wrapper allocates for a kernel to fill starts as NaN, so a
# kernel that skips part of its output cannot pass on stale memory that happens to be right.
_poison = os.environ.get("TARGET_STACK_POISON", "") not in ("", "0")


def set_poison(enabled: bool) -> bool:
    """Turn output poisoning on or off; returns the previous setting."""
    global _poison
    previous, _poison = _poison, bool(enabled)
    return previous


@contextlib.contextmanager
def poisoning(enabled: bool) -> Iterator[None]:
    """Output poisoning on or off inside the block.  Timed calls run with it off: a NaN fill of every
    output is a kernel launch of its own (at 4096 prefill tokens 59 of 646 us on an H200), which
    would be charged to the kernel being timed."""
    previous = set_poison(enabled)
    try:
        yield
    finally:
        set_poison(previous)


def alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer a kernel will overwrite completely: uninitialised, or NaN (an integer buffer: its most negative
    value) while poisoning."""
    if _poison:
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


class CachedLaunch:
    """Launch a Triton kernel through its compiled launcher once it has been compiled for a key.

    Triton's generic ``kernel[grid](...)`` path binds and specialises every argument on every
    call: on an H200 with Triton 3.6 that costs 26 to 36 us for the decode kernel, six times the
    kernel itself at batch 1 (bench/RESULTS.md).  For a key that pins everything Triton
    specialises on (shapes, dtypes, flags; the 16-byte alignment of every pointer is checked per
    call), the compiled kernel is reused and launched directly with the constexpr tail prepared
    once.  Anything unexpected (the interpreter, other Triton internals) falls back to the
    generic path for good.  The runtime arguments must come first in the kernel's signature.
    """

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}
        self.enabled = not interpreting()

    @staticmethod
    def _stream(device: torch.device) -> int:
        try:
            return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else 0)
        except Exception:  # noqa: BLE001 - older/other torch: the public (slower) way
            return torch.cuda.current_stream(device).cuda_stream

    def __call__(self, grid, key, args: tuple, constexprs: dict):
        if self.enabled:
            for a in args:
                if a is not None and not isinstance(a, (int, float)) and a.data_ptr() % 16:
                    break  # an unaligned pointer: Triton must specialise it
            else:
                entry = self.compiled.get(key)
                if entry is not None:
                    compiled, tail, device = entry
                    try:
                        compiled.run(grid[0], grid[1], grid[2], self._stream(device), compiled.function,
                                     compiled.packed_metadata, None, None, None, *args, *tail)
                        return
                    except Exception as exc:  # noqa: BLE001 - internals differ: use the generic path from now on
                        self.enabled = False
                        warnings.warn(f"{self.fn.__name__}: direct launch failed ({type(exc).__name__}: {exc}); "
                                      "using Triton's generic launch path from now on", RuntimeWarning, stacklevel=2)
                compiled = self.fn[grid](*args, **constexprs)
                if self.enabled and hasattr(compiled, "run") and hasattr(compiled, "packed_metadata"):
                    names = self.fn.arg_names[len(args):]
                    tensor = next(a for a in args if isinstance(a, torch.Tensor))
                    self.compiled[key] = (compiled, tuple(constexprs[n] for n in names), tensor.device)
                return
        self.fn[grid](*args, **constexprs)
