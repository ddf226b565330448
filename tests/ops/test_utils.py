"""The ops' shared plumbing: output poisoning and its scoped switch."""

from __future__ import annotations

import pytest
import torch

from target_stack.ops.utils import alloc, poisoning, set_poison


def test_poisoning_fills_buffers_with_nan_inside_the_block_and_restores_the_setting_after_it():
    before = set_poison(False)
    try:
        with poisoning(True):
            assert torch.isnan(alloc(3, 5, dtype=torch.float32, device=torch.device("cpu"))).all()
            ids = alloc(4, dtype=torch.int64, device=torch.device("cpu"))  # integers: a value no index takes
            assert (ids == torch.iinfo(torch.int64).min).all()
            with pytest.raises(RuntimeError), poisoning(False):
                assert set_poison(False) is False  # off inside the inner block
                raise RuntimeError("a failing timed call")
            assert set_poison(True) is True  # back on after the inner block, even though it raised
        assert set_poison(False) is False  # and off again after the outer one
    finally:
        set_poison(before)
