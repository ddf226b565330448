"""Correctness building blocks for probes: reference comparison, partitioned vs whole, error growth.

All comparisons use the relative error ||out - ref|| / ||ref|| in float64 on fresh random inputs
(a new seed every call unless one is given); NaN or Inf anywhere counts as an infinite error.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


def fresh_generator(seed: int | None = None, device: str = "cpu") -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    g = torch.Generator(device=device).manual_seed(seed)
    return g


def rel_err(out: Any, ref: Any) -> float:
    """Relative error of a tensor, or the worst over matching tuples/lists of tensors."""
    if isinstance(out, (tuple, list)):
        pairs = [(o, r) for o, r in zip(out, ref) if o is not None and r is not None]
        return max(rel_err(o, r) for o, r in pairs) if pairs else 0.0
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if o.shape != r.shape:
        raise ValueError(f"shape mismatch: {tuple(o.shape)} vs reference {tuple(r.shape)}")
    if not torch.isfinite(o).all():
        return math.inf
    denom = r.norm().item()
    return (o - r).norm().item() / (denom if denom > 0 else 1.0)


def compare_sweep(fn: Callable[..., Any], ref: Callable[..., Any],
                  make_inputs: Callable[[dict, torch.Generator], tuple],
                  cases: Iterable[dict], seed: int | None = None, device: str = "cpu",
                  recheck: bool = True) -> list[tuple[dict, float]]:
    """fn(*inputs) against ref(*inputs) for every case of a shape sweep; fresh inputs per case.

    ``make_inputs`` gets a generator on ``device`` (``gen.device``) and makes its inputs there.
    With ``recheck`` the first case runs a second time on the same tensors refilled in place with new
    values (same storage, pointers and shapes): a result cached by pointer, shape or call count, or a
    constant that matched the first draw, fails there.  A case's error is the worse of its runs.
    """
    gen = fresh_generator(seed, device)
    out = []
    for i, case in enumerate(cases):
        inputs = make_inputs(case, gen)
        err = rel_err(fn(*inputs), ref(*inputs))
        if recheck and i == 0 and refill(inputs, make_inputs(case, gen)):
            err = max(err, rel_err(fn(*inputs), ref(*inputs)))
        out.append((case, err))
    return out


def refill(inputs: Sequence[Any], fresh: Sequence[Any]) -> bool:
    """Copy ``fresh``'s values into ``inputs``' tensors in place; whether any floating tensor changed."""
    changed = False
    for old, new in zip(inputs, fresh, strict=False):
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape:
            old.copy_(new)
            changed |= old.is_floating_point()
    return changed


def partitioned_vs_whole(partitioned: Callable[[int], Any], whole: Callable[[], Any],
                         partitions: Sequence[int]) -> list[tuple[int, float]]:
    """Error of a partitioned computation against the unpartitioned one, per partition count."""
    base = whole()
    return [(p, rel_err(partitioned(p), base)) for p in partitions]


def error_growth(error_at: Callable[[Any], float], sizes: Sequence[Any]) -> tuple[list[float], float]:
    """Errors along a size parameter (context length, partitions) and the growth last / first."""
    errs = [float(error_at(s)) for s in sizes]
    first = errs[0] if errs[0] > 0 else 1e-30
    return errs, errs[-1] / first
