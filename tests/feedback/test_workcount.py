"""feedback.workcount on a real Triton kernel under the interpreter (tests/support/workcount.py)."""

from __future__ import annotations

import pytest

from tests.support.workcount import KERNEL, count


def test_counts_loads_per_tensor_operations_and_the_grid_of_a_real_kernel(tmp_path):
    k = tmp_path / "kern.py"
    k.write_text(KERNEL)
    got = count(tmp_path, k)
    assert got["err"] < 1e-5
    assert got["kernels"] == ["rownorm_scale"] and got["grids"] == [[8, 3, 1]]
    # 8 programs per row: each loads the whole row of x (8x its size) and its own tile of w (once)
    assert got["reads_x"] == pytest.approx(8.0) and got["reads_w"] == pytest.approx(1.0)
    # per program: one sqrt of the row's sum; per element: one division and one exp
    assert got["ops"]["sqrt"] == 24 and got["ops"]["fdiv"] == 3 * 32 and got["ops"]["exp"] == 3 * 32
    assert got["out_bytes"] == 0  # the output is not one of the named tensors


def test_refuses_to_count_outside_the_interpreter(monkeypatch):
    import torch

    from feedback.workcount import WorkCount, WorkCountError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(WorkCountError, match="TRITON_INTERPRET=1"), WorkCount(x=torch.ones(4)):
        pass
