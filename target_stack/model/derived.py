"""Tensors derived from a module's parameters (stacked, cast, laid out for a kernel), remade on change.

A kernel often wants a module's weights in another form than the one the module keeps: the KDA layer's
four input projections as one matrix (one product per decode step instead of four), the MoE experts
stacked with the shared expert.  Keeping the parameters as they are leaves checkpoints, tensor-parallel
sharding and the float64 references untouched; the derived tensor is a cache, keyed on every part's
version counter (an in-place write bumps it), storage, dtype and device, so a probe or a loaded
checkpoint that changes a weight is seen on the next call.  A CUDA graph captured before such a change
keeps reading the old tensor: capture after loading.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class DerivedWeight:
    """``build(parts, *extra)`` cached until a part or ``extra`` changes."""

    def __init__(self, build: Callable[..., object]):
        self.build = build
        self._entry: tuple | None = None

    def __call__(self, parts: Sequence[torch.Tensor], *extra):
        key = (extra, tuple((w._version, w.data_ptr(), w.dtype, w.device) for w in parts))
        if self._entry is None or self._entry[0] != key:
            self._entry = None  # the old copy goes before the new one is made
            with torch.no_grad():
                self._entry = (key, self.build(parts, *extra))
        return self._entry[1]


def stack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts one under the other: F.linear(x, stack_rows(ws)) is every F.linear(x, w) side by side."""
    return torch.cat(list(parts))
