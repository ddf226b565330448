"""The MoE op, beside its reference (as the KDA op is): top-k routed SwiGLU experts combined by
their routing weights.

- :mod:`.reference`: every expert on every token, masked by the routing weights; in any dtype
  (float64 for the probes).
- :mod:`.grouped`: the serving forms in torch: the pairs sorted into expert groups (one matmul
  chain per expert), every expert masked (no host synchronisation: CUDA-graph safe), and two
  grouped GEMMs over a layout made on the device or on the host.
- :mod:`.native`: the compiled CPU dispatch / experts / combine step, and the GPU path's host-side
  layout (C source beside it, built at first use, loaded with ctypes).

The model's MoE layer (``target_stack/model/layers.py``) routes and chooses among them.
"""

from target_stack.ops.moe.grouped import (
    device_layout,
    expert_groups,
    grouped_gemm,
    grouped_gemm_weights,
    masked_dense,
    sort_pairs,
)
from target_stack.ops.moe.reference import moe_reference

__all__ = ["device_layout", "expert_groups", "grouped_gemm", "grouped_gemm_weights", "masked_dense", "moe_reference",
           "sort_pairs"]
