"""Kimi Delta Attention (KDA): Triton kernels and float64-capable torch references.

Shapes and conventions follow flash-linear-attention: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``,
g ``[B, T, H, K]`` (log decay), beta ``[B, T, H]``, states ``[N, H, K, V]`` in fp32.
"""

from target_stack.ops.kda.chunk import chunk_kda
from target_stack.ops.kda.cp import chunk_kda_cp
from target_stack.ops.kda.fused_recurrent import fused_recurrent_kda
from target_stack.ops.kda.naive import kda_gate, naive_chunk_kda, naive_recurrent_kda

__all__ = ["chunk_kda", "chunk_kda_cp", "fused_recurrent_kda", "kda_gate", "naive_chunk_kda", "naive_recurrent_kda"]
