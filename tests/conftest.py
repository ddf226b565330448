import os

# Kernels run in Triton's interpreter on machines without a GPU; outputs are poisoned (NaN)
# before every kernel run so a kernel that skips work cannot pass on stale memory.
os.environ.setdefault("TARGET_STACK_POISON", "1")

import pytest
import torch

import target_stack.ops  # noqa: F401  (decides TRITON_INTERPRET before triton is imported)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator seeded from the OS: fresh random inputs on every run, reported on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    print(f"input seed: {seed}")
    return g
