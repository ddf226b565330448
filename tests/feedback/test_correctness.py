"""Correctness building blocks: relative error, partitioned against whole, error growth."""

from __future__ import annotations

import pytest
import torch

from feedback.correctness import compare_sweep, error_growth, partitioned_vs_whole, rel_err


def test_rel_err_flags_non_finite_and_shape_mismatch():
    ref = torch.ones(4, dtype=torch.float64)
    assert rel_err(ref * (1 + 1e-6), ref) == pytest.approx(1e-6, rel=1e-6)
    assert rel_err(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == float("inf")
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_err(torch.ones(3), ref)


def test_compare_sweep_partitioned_and_growth_on_a_real_reduction():
    # fp32 sequential sum against float64: error grows with the length, the helpers must see it
    def f32_sum(x):
        acc = torch.zeros((), dtype=torch.float32)
        for chunk in x.float().split(256):
            acc = acc + chunk.sum()
        return acc.reshape(1)

    def f64_sum(x):
        return x.double().sum().reshape(1)

    sweep = compare_sweep(f32_sum, f64_sum, lambda c, g: (torch.rand(c["n"], generator=g, dtype=torch.float64),),
                          [{"n": 1000}, {"n": 100000}])
    assert all(0 <= e < 1e-5 for _, e in sweep)
    x = torch.rand(4096, dtype=torch.float64)
    parts = partitioned_vs_whole(lambda p: torch.stack([c.sum() for c in x.split(4096 // p)]).sum().reshape(1),
                                 lambda: x.sum().reshape(1), [1, 4, 16])
    assert [p for p, _ in parts] == [1, 4, 16] and all(e < 1e-12 for _, e in parts)
    errs, growth = error_growth(lambda n: 10.0 * n, [1, 8])
    assert errs == [10.0, 80.0] and growth == 8.0
