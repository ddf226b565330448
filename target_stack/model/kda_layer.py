"""The KDA layer of target_stack: projections, short causal convolution, gates, KDA, gated output norm.

    q, k, v = silu(conv(W x))            short depthwise causal convolutions (kernel 4)
    q, k    = l2norm(q), l2norm(k)
    g       = -exp(A_log) * softplus(W_f x + dt_bias)      per-channel log decay
    beta    = sigmoid(W_b x)
    o       = KDA(q, k, v, g, beta)       chunk_kda for prefill, fused_recurrent_kda for decode
    y       = W_o (rmsnorm(o) * sigmoid(W_g x))

``forward`` uses the kernels of ``backend``: 'triton' (the Triton kernels), 'torch' (the chunked
torch form, the engine's CPU path: the Triton interpreter is a correctness tool, ~20x slower), or
'auto' (Triton on a GPU, torch on the CPU).  ``reference`` is the float64 token-loop reference of
the same maths.  ``prefill`` / ``decode`` carry the convolution and KDA states between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from target_stack.model.derived import DerivedWeight, stack_rows
from target_stack.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, naive_chunk_kda, naive_recurrent_kda
from target_stack.ops.kda.decode_inputs import CONV, kda_decode_inputs
from target_stack.ops.norm import rms_norm


@dataclass
class KDAState:
    conv: torch.Tensor  # [B, CONV - 1, 2 * H * K + H * V]: the last inputs of the convolution (q, k, v)
    kda: torch.Tensor  # [B, H, K, V] fp32


@dataclass
class KDATail:
    """The last n tokens of a prefill, as prefix reuse needs them: the KDA state before them, their
    kernel inputs, and the convolution inputs from CONV - 1 positions before them to the end."""

    start: int  # tokens before the tail (within this prefill's input)
    state: torch.Tensor  # [B, H, K, V] fp32, after ``start`` tokens
    k: torch.Tensor  # [B, n, H, K]
    v: torch.Tensor  # [B, n, H, V]
    g: torch.Tensor  # [B, n, H, K]
    beta: torch.Tensor  # [B, n, H]
    conv: torch.Tensor  # [B, CONV - 1 + n, C]


class KDALayer(torch.nn.Module):
    def __init__(self, dim: int, heads: int, head_k: int, head_v: int, generator: torch.Generator | None = None,
                 backend: str = "auto"):
        super().__init__()
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"KDA backend must be 'auto', 'triton' or 'torch', got {backend!r}")
        self.backend = backend
        self.H, self.K, self.V = heads, head_k, head_v
        g = generator
        s = dim**-0.5
        self.w_qkv = torch.nn.Parameter(torch.randn(heads * (2 * head_k + head_v), dim, generator=g) * s)
        self.conv = torch.nn.Parameter(torch.randn(heads * (2 * head_k + head_v), CONV, generator=g) * 0.5)
        self.w_f = torch.nn.Parameter(torch.randn(heads * head_k, dim, generator=g) * s)
        self.dt_bias = torch.nn.Parameter(torch.randn(heads * head_k, generator=g) * 0.1 - 2.0)
        self.A_log = torch.nn.Parameter(torch.log(torch.rand(heads, generator=g) * 0.5 + 0.1))
        self.w_b = torch.nn.Parameter(torch.randn(heads, dim, generator=g) * s)
        self.w_g = torch.nn.Parameter(torch.randn(heads * head_v, dim, generator=g) * s)
        self.norm_w = torch.nn.Parameter(torch.ones(head_v))
        self.w_o = torch.nn.Parameter(torch.randn(dim, heads * head_v, generator=g) * (heads * head_v) ** -0.5)
        self.fused = False  # on the Triton path: the one-launch decode inputs and output norm (fused_kernels)
        self._w_in = DerivedWeight(stack_rows)  # [w_qkv; w_f; w_g; w_b] for the fused decode step

    def input_weight(self) -> torch.Tensor:
        """The four projections of the layer's input stacked, [w_qkv; w_f; w_g; w_b]: the fused decode step
        takes them as one product (one launch instead of four; at batch 1 each is a few microseconds of
        launch around a matrix-vector product).  Remade after any change to a part (``DerivedWeight``);
        w_b last keeps the wide slices of the product 16-byte aligned."""
        return self._w_in((self.w_qkv, self.w_f, self.w_g, self.w_b))

    def _inputs(self, x: torch.Tensor, conv_state: torch.Tensor | None):
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        pre = F.linear(x, self.w_qkv)  # [B, T, C]
        hist = conv_state if conv_state is not None else pre.new_zeros(B, CONV - 1, pre.shape[-1])
        full = torch.cat([hist, pre], dim=1)  # causal: each token sees the CONV - 1 before it
        windows = full.unfold(1, CONV, 1)  # [B, T, C, CONV]
        mixed = F.silu((windows * self.conv[None, None]).sum(-1))
        q, k, v = mixed.split([H * K, H * K, H * V], dim=-1)
        q = F.normalize(q.reshape(B, T, H, K), dim=-1)
        k = F.normalize(k.reshape(B, T, H, K), dim=-1)
        v = v.reshape(B, T, H, V)
        gate = kda_gate(F.linear(x, self.w_f).reshape(B, T, H, K), self.A_log, self.dt_bias)
        beta = torch.sigmoid(F.linear(x, self.w_b))
        return (q, k, v, gate, beta), full  # full[:, i] is the convolution input of position i - (CONV - 1)

    def _output(self, o: torch.Tensor, x: torch.Tensor, fused: bool | None = None,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        """W_o (rmsnorm(o) * sigmoid(W_g x)); ``gate``: W_g x when already computed (the fused decode step)."""
        B, T = x.shape[:2]
        # rmsnorm per head times the output gate, in fp32: one launch instead of ten, with the Triton kernels
        if (self.fused and self.uses_triton(o)) if fused is None else fused:
            gate = F.linear(x, self.w_g) if gate is None else gate
            gated = rms_norm(o, self.norm_w, 1e-6, gate=gate.reshape(o.shape), out_dtype=x.dtype)
            return F.linear(gated.reshape(B, T, -1), self.w_o)
        of = o.float()
        normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_w
        gated = normed.reshape(B, T, -1) * torch.sigmoid(F.linear(x, self.w_g) if gate is None else gate)
        return F.linear(gated.to(x.dtype), self.w_o)

    def uses_triton(self, x: torch.Tensor) -> bool:
        return self.backend == "triton" or (self.backend == "auto" and x.is_cuda)

    def prefill(self, x: torch.Tensor, state: KDAState | None = None) -> tuple[torch.Tensor, KDAState]:
        out, new, _ = self.prefill_with_tail(x, state, 0)
        return out, new

    def prefill_with_tail(self, x: torch.Tensor, state: KDAState | None, tail: int
                          ) -> tuple[torch.Tensor, KDAState, KDATail | None]:
        """``prefill`` that also returns the last ``tail`` tokens as a :class:`KDATail` (``None`` for 0):
        the kernel runs in two calls, up to the tail and from there, to expose the state between."""
        inputs, full = self._inputs(x, state.conv if state else None)
        conv = full[:, -(CONV - 1):]
        h0 = state.kda if state else None
        kernel = chunk_kda if self.uses_triton(x) else naive_chunk_kda
        if not tail:
            o, s = kernel(*inputs, initial_state=h0, output_final_state=True)
            return self._output(o, x), KDAState(conv=conv, kda=s.float()), None
        B, T = x.shape[:2]
        cut = max(0, T - tail)
        outs = []
        if cut:
            o, h0 = kernel(*(t[:, :cut] for t in inputs), initial_state=h0, output_final_state=True)
            outs.append(o)
        if h0 is None:
            h0 = x.new_zeros(B, self.H, self.K, self.V, dtype=torch.float32)
        last = [t[:, cut:] for t in inputs]
        o, s = kernel(*last, initial_state=h0, output_final_state=True)
        outs.append(o)
        _, k, v, g, beta = last
        rec = KDATail(start=cut, state=h0.float().clone(), k=k, v=v, g=g, beta=beta, conv=full[:, cut:])
        return self._output(torch.cat(outs, dim=1), x), KDAState(conv=conv, kda=s.float()), rec

    def decode(self, x: torch.Tensor, state: KDAState) -> tuple[torch.Tensor, KDAState]:
        inputs, full = self._inputs(x, state.conv)
        conv = full[:, -(CONV - 1):]
        kernel = fused_recurrent_kda if self.uses_triton(x) else naive_recurrent_kda
        o, s = kernel(*inputs, initial_state=state.kda, output_final_state=True)
        return self._output(o, x), KDAState(conv=conv, kda=s.float())

    def decode_pooled(self, x: torch.Tensor, conv_pool: torch.Tensor, kda_pool: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
        """One decode step for a batch whose states live in pools ([num_slots, ...]) at ``slots``.

        The KDA states and convolution tails are updated in place; slot 0 (padding) reads zeros and
        keeps them (the torch path writes it and resets it; the kernels never write it).
        """
        if self.fused and self.uses_triton(x):  # one product, the inputs in one launch (tails shifted in place)
            H, K, V = self.H, self.K, self.V
            pre, f, gate, b = F.linear(x, self.input_weight()).split([H * (2 * K + V), H * K, H * V, H], dim=-1)
            inputs = kda_decode_inputs(pre, f, b, conv_pool, slots, self.conv, self.dt_bias, self.A_log, H, K, V)
            o, _ = fused_recurrent_kda(*inputs, initial_state=kda_pool, ssm_state_indices=slots)
            return self._output(o, x, gate=gate)
        inputs, full = self._inputs(x, conv_pool[slots])
        if self.uses_triton(x):
            o, _ = fused_recurrent_kda(*inputs, initial_state=kda_pool, ssm_state_indices=slots)
        else:  # the same contract in torch: slot 0 reads zeros and is never written
            live = slots > 0
            h0 = kda_pool[slots].float() * live[:, None, None, None]
            o, ht = naive_recurrent_kda(*inputs, initial_state=h0, output_final_state=True)
            kda_pool[slots[live]] = ht[live].to(kda_pool.dtype)
        conv_pool.index_copy_(0, slots, full[:, -(CONV - 1):].to(conv_pool.dtype))
        conv_pool[0].zero_()
        return self._output(o, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.prefill(x)[0]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        inputs, _ = self._inputs(x, None)
        o, _ = naive_recurrent_kda(*(t.double() for t in inputs))
        return self._output(o.to(x.dtype), x)
