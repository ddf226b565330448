"""target_stack model layers with plain torch reference paths: RMSNorm, SwiGLU MLP, MoE, sparse attention.

Each layer's ``forward`` is the serving path; ``reference`` (or a ``*_reference`` function) is the
plain, obviously-correct version that tests and the target's correctness probes compare against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        xd = x.double()
        return (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + self.eps) * self.weight.double()).to(x.dtype)


class SwiGLU(torch.nn.Module):
    """The dense MLP (first layer) and each expert: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, generator: torch.Generator | None = None):
        super().__init__()
        s = dim**-0.5
        self.w_gate = torch.nn.Parameter(torch.randn(hidden, dim, generator=generator) * s)
        self.w_up = torch.nn.Parameter(torch.randn(hidden, dim, generator=generator) * s)
        self.w_down = torch.nn.Parameter(torch.randn(dim, hidden, generator=generator) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)


class MoE(torch.nn.Module):
    """Sigmoid-routed top-k mixture of SwiGLU experts plus one shared expert.

    ``forward`` groups tokens by expert (one sort, one matmul per expert over its tokens), never a
    Python loop over tokens; ``reference`` computes every expert on every token and masks.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, generator: torch.Generator | None = None,
                 backend: str = "torch"):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if backend not in ("torch", "native"):
            raise ValueError(f"MoE backend must be 'torch' or 'native', got {backend!r}")
        self.top_k = top_k
        self.backend = backend  # 'native': the compiled dispatch/expert/combine step on CPU fp32 inputs
        self.grouped = True  # False: the per-expert loop even where grouped GEMMs work (a plain-eager baseline)
        self._stacked: tuple | None = None
        self.router = torch.nn.Parameter(torch.randn(n_experts, dim, generator=generator) * dim**-0.5)
        self.router_bias = torch.nn.Parameter(torch.zeros(n_experts))
        self.experts = torch.nn.ModuleList(SwiGLU(dim, hidden, generator) for _ in range(n_experts))
        self.shared = SwiGLU(dim, hidden, generator)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): sigmoid scores, top-k chosen with the bias, normalised."""
        scores = torch.sigmoid(F.linear(x.float(), self.router.float()))
        _, idx = torch.topk(scores + self.router_bias.float(), self.top_k, dim=-1)
        w = scores.gather(-1, idx)
        return w / w.sum(-1, keepdim=True).clamp_min(1e-9), idx

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert weights as [E, H, D], [E, H, D], [E, D, H] (cached; rebuilt if a weight changes)."""
        key = tuple((e.w_gate._version, e.w_up._version, e.w_down._version) for e in self.experts)
        if self._stacked is None or self._stacked[0] != key:
            with torch.no_grad():
                w = tuple(torch.stack([getattr(e, n).float() for e in self.experts]).contiguous()
                          for n in ("w_gate", "w_up", "w_down"))
            self._stacked = (key, w)
        return self._stacked[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w, idx = self.route(x2)
        if self.backend == "native" and x.is_cuda:
            return (self._native_cuda(x2, w, idx) + self.shared(x2).float()).to(x.dtype).reshape(shape)
        if self.backend == "native" and x.device.type == "cpu" and x.dtype == torch.float32:
            from target_stack.engine.native import moe_dispatch_combine

            # one call per layer, as a fused MoE kernel is: the whole batch's dispatch, experts, combine
            out = moe_dispatch_combine(x2, idx, w, *self.stacked_weights())
            return (out + self.shared(x2).float()).reshape(shape)
        if self.grouped and self._grouped_ok(x2):  # a GPU in bf16: two grouped GEMMs, no host sync
            out = self._grouped(x2, w, idx)
        else:
            flat_e = idx.reshape(-1)
            order = torch.argsort(flat_e, stable=True)
            ends = torch.bincount(flat_e, minlength=len(self.experts)).cumsum(0).tolist()
            out = self._expert_groups(x2, w, order, ends)
        out += self.shared(x2).float()
        return out.to(x.dtype).reshape(shape)

    def _expert_groups(self, x2: torch.Tensor, w: torch.Tensor, order: torch.Tensor, ends: list[int]) -> torch.Tensor:
        """sum_k w[t, k] expert_k(x[t]) with the (token, expert) pairs already sorted by expert:
        ``order`` holds the pair indices, ``ends`` (host ints) where each expert's group ends.
        One matmul chain per expert over its contiguous group, never a loop over tokens."""
        tok = order // self.top_k
        xs = x2[tok]
        ws = w.reshape(-1)[order, None]
        out = torch.zeros(x2.shape[0], x2.shape[1], device=x2.device, dtype=torch.float32)
        for e, (a, b) in enumerate(zip([0, *ends], ends, strict=False)):
            if b > a:
                out.index_add_(0, tok[a:b], self.experts[e](xs[a:b]).float() * ws[a:b])
        return out

    def _native_cuda(self, x2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The GPU prefill's MoE with a host-side dispatch layout (the native extension): the routing
        goes to pinned host memory with a sequence number behind it; the native call waits for the
        number (for the device to get there), sorts the pairs by expert, and the experts run on their
        contiguous groups.  Host buffers are reused: the next layer's call writes them only after
        its own flag, which the device publishes after this layer's uploads."""
        from target_stack.engine.native import moe_layout_wait

        P, E = idx.numel(), len(self.experts)
        st = getattr(self, "_staging", None)
        if st is None or st["idx"].numel() < P or st["dev_flag"].device != x2.device:
            n = max(P, 1024)
            pinned = dict(device="cpu", pin_memory=True)
            st = self._staging = {"idx": torch.empty(n, dtype=torch.int64, **pinned),
                                  "order": torch.empty(n, dtype=torch.int64, **pinned),
                                  "ends": torch.empty(E, dtype=torch.int64, **pinned),
                                  "flag": torch.zeros(1, dtype=torch.int32, **pinned),
                                  "dev_flag": torch.zeros(1, dtype=torch.int32, device=x2.device), "seq": 0}
        st["seq"] = st["seq"] % (2**30) + 1
        host_idx = st["idx"][:P]
        host_idx.copy_(idx.reshape(-1), non_blocking=True)
        st["dev_flag"].fill_(st["seq"])
        st["flag"].copy_(st["dev_flag"], non_blocking=True)  # stream order: after the routing copy
        order, ends = moe_layout_wait(st["flag"], st["seq"], host_idx, E, st["order"][:P], st["ends"])
        order = order.to(x2.device, non_blocking=True)
        if self._grouped_ok(x2):  # two grouped GEMMs over the host-made layout: a few launches per layer
            offs = ends.to(x2.device, non_blocking=True).to(torch.int32)
            return self._grouped_layout(x2, w, order, offs)
        # the group ends are already on the host: no device sync before the expert launches
        return self._expert_groups(x2, w, order, ends.tolist())

    def forward_static(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE with no host synchronisation, for decode steps captured in a CUDA graph.

        On a GPU where ``torch._grouped_mm`` works (bf16, Hopper), the (token, expert) pairs are
        sorted by expert and run as two grouped GEMMs with device-side offsets; elsewhere every
        expert runs on every token and the routing weights (zero off the top-k) mask the result,
        which reads each expert's weights once: the same bytes as grouped once a batch touches
        most experts.
        """
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w, idx = self.route(x2)
        out = self._grouped(x2, w, idx) if self._grouped_ok(x2) else self._masked_dense(x2, w, idx)
        out += self.shared(x2).float()
        return out.to(x.dtype).reshape(shape)

    def _masked_dense(self, x2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, masked by the routing weights (zero off the top-k); fp32."""
        wg, wu, wd = (t.to(x2.dtype) for t in self.stacked_weights())
        dense_w = torch.zeros(x2.shape[0], len(self.experts), device=x2.device).scatter_(1, idx, w)
        act = F.silu(torch.einsum("td,ehd->teh", x2, wg)) * torch.einsum("td,ehd->teh", x2, wu)
        return torch.einsum("teh,edh->td", act * dense_w.to(x2.dtype)[..., None], wd).float()

    def _grouped_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        wg, wu, wd = self.stacked_weights()
        key = ("grouped", dtype, wg.data_ptr())
        if getattr(self, "_grouped_cache", (None,))[0] != key:
            gate_up = torch.cat([wg, wu], dim=1).transpose(1, 2).contiguous().to(dtype)  # [E, D, 2H]
            down = wd.transpose(1, 2).contiguous().to(dtype)  # [E, H, D]
            self._grouped_cache = (key, gate_up, down)
        return self._grouped_cache[1], self._grouped_cache[2]

    def _grouped(self, x2: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The layout on the device (sort by expert, group ends), then :meth:`_grouped_layout`."""
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(len(self.experts), dtype=torch.int32, device=x2.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        return self._grouped_layout(x2, w, order, torch.cumsum(counts, 0, dtype=torch.int32))

    def _grouped_layout(self, x2: torch.Tensor, w: torch.Tensor, order: torch.Tensor,
                        offs: torch.Tensor) -> torch.Tensor:
        """Two grouped GEMMs over pairs sorted by expert (``order``, device) with group ends ``offs``
        (device int32), then the weighted combine."""
        gate_up, down = self._grouped_weights(x2.dtype)
        tok = order // self.top_k
        h = torch._grouped_mm(x2[tok], gate_up, offs=offs)
        g, u = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(g) * u, down, offs=offs)
        out = torch.zeros(x2.shape[0], x2.shape[1], device=x2.device, dtype=torch.float32)
        return out.index_add_(0, tok, y.float() * w.reshape(-1)[order, None])

    def _grouped_ok(self, x2: torch.Tensor) -> bool:
        """Whether the grouped-GEMM path works here: checked once per device and dtype against the
        masked dense form (a private torch API: verify, never assume)."""
        if not (x2.is_cuda and x2.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
            return False
        key = (x2.device, x2.dtype)
        cache = MoE._grouped_support
        if key not in cache:
            try:
                probe = torch.randn(8, x2.shape[-1], device=x2.device, dtype=x2.dtype)
                w, idx = self.route(probe)
                got = self._grouped(probe, w, idx)
                ref = self._masked_dense(probe, w, idx)
                cache[key] = bool(((got - ref).norm() / ref.norm().clamp_min(1e-6)) < 2e-2)
            except Exception:  # noqa: BLE001 - unsupported here: the dense form it is
                cache[key] = False
        return cache[key]

    _grouped_support: dict = {}

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        w, idx = self.route(x2)
        dense_w = torch.zeros(x2.shape[0], len(self.experts), dtype=torch.float32, device=x.device)
        dense_w.scatter_(1, idx, w)
        every = torch.stack([e(x2).float() for e in self.experts], dim=1)  # [T, E, D]
        out = (every * dense_w[..., None]).sum(1) + self.shared(x2).float()
        return out.to(x.dtype).reshape(x.shape)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx_q: torch.Tensor, idx_k: torch.Tensor,
                     block: int, top_k: int, window: int) -> torch.Tensor:
    """Causal block-sparse attention for one sequence: q [Tq, H, D], idx_q [Tq, Di] for the last Tq
    of the Tk positions of k, v [Tk, H, D], idx_k [Tk, Di] (Tq < Tk: a prefill after a reused prefix).

    An indexer scores each key block for each query (max over the block of idx_q . idx_k);
    each query attends to its top_k highest-scoring causal blocks plus a local window of
    ``window`` tokens.  With Tk <= top_k * block every causal key is kept: it equals dense.
    """
    Tq, H, D = q.shape
    T = k.shape[0]
    if Tq > T:
        raise ValueError(f"{Tq} queries for {T} keys: queries must be the last positions of the keys")
    nb = math.ceil(T / block)
    pos = torch.arange(T, device=q.device)
    qpos = pos[T - Tq:]
    causal = pos[None, :] <= qpos[:, None]  # [Tq, Tk]
    scores = (idx_q.float() @ idx_k.float().t()).masked_fill(~causal, float("-inf"))  # [Tq, Tk]
    pad = nb * block - T
    blk = F.pad(scores, (0, pad), value=float("-inf")).reshape(Tq, nb, block).amax(-1)  # [Tq, nb]
    keep_blocks = torch.zeros(Tq, nb, dtype=torch.bool, device=q.device)
    k_sel = min(top_k, nb)
    top = torch.topk(blk, k_sel, dim=-1).indices
    keep_blocks.scatter_(1, top, True)
    keep_blocks &= torch.isfinite(blk)
    keep = keep_blocks.repeat_interleave(block, dim=1)[:, :T]
    keep |= (qpos[:, None] - pos[None, :] < window) & causal
    keep &= causal
    att = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(D)
    att = att.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(att, dim=-1), v.float()).to(q.dtype)


def sparse_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx_q: torch.Tensor,
                            idx_k: torch.Tensor, lengths: torch.Tensor, block: int, top_k: int,
                            window: int) -> torch.Tensor:
    """The last row of :func:`sparse_attention` for a batch of sequences of different lengths.

    q [B, H, D] and idx_q [B, Di] belong to each sequence's newest token at position lengths - 1;
    k, v [B, L, H, D] and idx_k [B, L, Di] hold its keys, padded past ``lengths`` (ignored).
    No host synchronisation: a decode step stays capturable in a CUDA graph.
    """
    B, L, H, D = k.shape
    nb = math.ceil(L / block)
    pos = torch.arange(L, device=q.device)
    valid = pos[None, :] < lengths[:, None]  # [B, L]
    scores = torch.einsum("bd,bld->bl", idx_q.float(), idx_k.float()).masked_fill(~valid, float("-inf"))
    blk = F.pad(scores, (0, nb * block - L), value=float("-inf")).reshape(B, nb, block).amax(-1)
    top = torch.topk(blk, min(top_k, nb), dim=-1).indices
    keep_blocks = torch.zeros(B, nb, dtype=torch.bool, device=q.device).scatter_(1, top, True)
    keep_blocks &= torch.isfinite(blk)
    keep = keep_blocks.repeat_interleave(block, dim=1)[:, :L]
    keep |= (lengths[:, None] - 1 - pos[None, :]) < window
    keep &= valid
    att = torch.einsum("bhd,blhd->bhl", q.float(), k.float()) / math.sqrt(D)
    att = att.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", torch.softmax(att, dim=-1), v.float()).to(q.dtype)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: plain causal softmax attention in float64."""
    T, H, D = q.shape
    att = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(D)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(att, dim=-1), v.double()).to(q.dtype)
