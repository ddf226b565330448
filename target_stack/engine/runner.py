"""The model runner: the model's layers driven over the engine's paged KV cache and state pools.

``prefill`` runs one sequence's prompt through every layer, fills its pages and state slot, and
returns the logits of its last position; ``decode`` runs one token for a batch of sequences,
reading and writing the caches in place.  ``mixer_done`` (when set) is called in a prefill as soon
as a layer's KV or state is final, before its FFN: the disaggregated prefill worker hooks the KV
transfer there (Layer Split), so a stage moves while the layer's MoE computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from target_stack.engine.cache import PagedKV, StatePool
from target_stack.engine.sequence import Sequence
from target_stack.model.kda_layer import CONV, KDATail
from target_stack.model.layers import MoE, sparse_attention, sparse_decode_attention
from target_stack.model.model import HybridModel


class ModelRunner:
    def __init__(self, model: HybridModel, num_pages: int, page_size: int, num_slots: int):
        self.model = model
        cfg = self.cfg = model.cfg
        self.page_size = page_size
        self.device = model.embed.device
        self.dtype = model.embed.dtype
        self.kv: dict[int, PagedKV] = {}
        self.states: dict[int, StatePool] = {}
        for i, block in enumerate(model.blocks):
            if block.is_attn:
                self.kv[i] = PagedKV(num_pages, page_size, cfg.attn_heads, cfg.attn_head_dim, cfg.index_dim,
                                     cfg.kv_dtype_for(i), self.device)
            else:
                channels = cfg.heads * (2 * cfg.head_k + cfg.head_v)
                self.states[i] = StatePool(num_slots, cfg.heads, cfg.head_k, cfg.head_v, CONV - 1, channels,
                                           self.device, self.dtype, cfg.kda_state_dtype)
        self.mixer_done: Callable[[Sequence, int], None] | None = None
        self.graphs: CudaGraphDecoder | None = None

    # -- prefill ----------------------------------------------------------------------------------
    def _positions(self, seq: Sequence, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, stop)
        pages = torch.tensor(seq.pages, dtype=torch.long)[pos // self.page_size]
        return pages.to(self.device), (pos % self.page_size).to(self.device)

    @torch.no_grad()
    def prefill(self, seq: Sequence) -> torch.Tensor:
        return self.prefill_from(seq)[0]

    @torch.no_grad()
    def prefill_from(self, seq: Sequence, tail: int = 0) -> tuple[torch.Tensor, dict[int, KDATail]]:
        """Prefill positions [start, num_prompt), start = ``seq.reused``: with a prefix-cache hit the
        keys before it are already in the sequence's first pages and every KDA layer's state there is
        rebuilt from the hit's entry.  ``tail`` > 0 also returns each KDA layer's last ``tail`` tokens,
        for the prefix cache.  Returns the logits of the last position and the tails."""
        model, cfg = self.model, self.cfg
        start = seq.reused
        restore = seq.hit.entry.restore(start) if start else None
        if start and (seq.prompt_embeds is not None or start % self.page_size or start >= seq.num_prompt):
            raise ValueError(f"cannot start a prefill at {start}: it must be a page boundary inside a "
                             "token-only prompt")
        h = model.embed_tokens(torch.tensor(seq.prompt[start:], device=self.device))
        if seq.prompt_embeds is not None:
            h = torch.cat([seq.prompt_embeds.to(device=h.device, dtype=h.dtype), h])
        T = h.shape[0]
        page, offset = self._positions(seq, start, start + T)
        prefix = torch.tensor([seq.pages[:start // self.page_size]], device=self.device) if start else None
        tails: dict[int, KDATail] = {}
        h = h[None]
        for i, block in enumerate(model.blocks):
            x = block.norm1(h)
            if block.is_attn:
                q, k, v, iq, ik = block.mixer.project(x[0])
                self.kv[i].write(page, offset, k, v, ik)
                if prefix is not None:  # the reused positions' keys, from the shared pages
                    kp, vp, ikp = self.kv[i].gather(prefix, k.dtype)
                    k, v, ik = torch.cat([kp[0], k]), torch.cat([vp[0], v]), torch.cat([ikp[0].to(ik.dtype), ik])
                o = sparse_attention(q, k, v, iq, ik, cfg.block, cfg.top_k_blocks, cfg.window)
                mix = F.linear(o.reshape(T, -1), block.mixer.w_o)[None]
            else:
                mix, state, rec = block.mixer.prefill_with_tail(x, restore[i] if restore else None, tail)
                if rec is not None:
                    tails[i] = rec
                pool = self.states[i]
                pool.kda[seq.slot] = state.kda[0]
                pool.conv[seq.slot] = state.conv[0].to(pool.conv.dtype)
            if self.mixer_done is not None:
                self.mixer_done(seq, i)
            h = h + mix
            h = h + block.ffn(block.norm2(h))
        return F.linear(model.norm(h[0, -1:]), model.lm_head)[0], tails

    # -- decode -----------------------------------------------------------------------------------
    def block_table(self, seqs: list[Sequence], width: int | None = None) -> torch.Tensor:
        width = width or max(len(s.pages) for s in seqs)
        rows = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token; logits [B, vocab].  Through a captured CUDA graph
        when the runner has a graph decoder and the batch fits its largest bucket."""
        if self.graphs is not None and len(seqs) <= self.graphs.buckets[-1]:
            return self.graphs.run(seqs)
        tokens = torch.tensor([s.output[-1] for s in seqs], device=self.device)
        lengths = torch.tensor([s.length for s in seqs], device=self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        need = max(math.ceil(s.length / self.page_size) for s in seqs)
        table = self.block_table(seqs, need)
        return self.decode_step(tokens, lengths, slots, table)

    def decode_step(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                    table: torch.Tensor, static: bool = False) -> torch.Tensor:
        """The tensor-only decode step.  ``static``: no host synchronisation anywhere (the MoE's
        graph-safe form), as a CUDA graph capture requires."""
        model, cfg = self.model, self.cfg
        pos = lengths - 1
        page = table.gather(1, (pos // self.page_size)[:, None])[:, 0]
        offset = pos % self.page_size
        h = model.embed_tokens(tokens, check=False)[:, None]  # [B, 1, dim]: the sampler's own tokens
        x = model.blocks[0].norm1(h)
        # each residual add goes with the norm after it (RMSNorm.add_forward: one launch with the fused kernels)
        after = [b.norm1 for b in model.blocks[1:]] + [model.norm]
        for i, block in enumerate(model.blocks):
            if block.is_attn:
                q, k, v, iq, ik = block.mixer.project(x[:, 0])
                cache = self.kv[i]
                cache.write(page, offset, k, v, ik)
                ks, vs, iks = cache.gather(table, q.dtype)
                o = sparse_decode_attention(q, ks, vs, iq, iks, lengths, cfg.block, cfg.top_k_blocks, cfg.window,
                                            fused=block.mixer.fused)
                mix = F.linear(o.reshape(o.shape[0], -1), block.mixer.w_o)[:, None]
            else:
                pool = self.states[i]
                mix = block.mixer.decode_pooled(x, pool.conv, pool.kda, slots)
            h, y = block.norm2.add_forward(h, mix)
            h, x = after[i].add_forward(h, block.ffn.forward_static(y) if static and isinstance(block.ffn, MoE)
                                        else block.ffn(y))
        return F.linear(x[:, 0], model.lm_head)

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        self.graphs = CudaGraphDecoder(self, max_batch, math.ceil(max_model_len / self.page_size))

    # -- preemption by swapping -------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> dict:
        """Host copies of the sequence's pages and state slots (so resuming never recomputes)."""
        pages = torch.tensor(seq.pages, dtype=torch.long, device=self.device)
        out: dict = {"kv": {}, "state": {}, "pages": len(seq.pages)}
        for i, cache in self.kv.items():
            out["kv"][i] = {name: t[pages].cpu() for name, t in cache.tensors().items()}
        for i, pool in self.states.items():
            out["state"][i] = (pool.kda[seq.slot].to("cpu", copy=True), pool.conv[seq.slot].to("cpu", copy=True))
        return out

    def swap_in(self, seq: Sequence, saved: dict) -> None:
        """Copy a swapped-out sequence back into its (possibly more numerous) new pages and slot."""
        pages = torch.tensor(seq.pages[: saved["pages"]], dtype=torch.long, device=self.device)
        for i, cache in self.kv.items():
            for name, t in cache.tensors().items():
                t[pages] = saved["kv"][i][name].to(self.device)
        for i, pool in self.states.items():
            kda, conv = saved["state"][i]
            pool.kda[seq.slot] = kda.to(self.device)
            pool.conv[seq.slot] = conv.to(self.device)


class CudaGraphDecoder:
    """Decode steps replayed from CUDA graphs, one per batch-size bucket, captured on first use.

    The graph reads static buffers (tokens, lengths, slots, block table of a fixed width); a batch
    of n is padded to the next bucket with rows that point at the null slot and the reserved page
    0, so padding reads zeros, writes nothing anyone reads, and costs one bucket's work.
    """

    BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

    def __init__(self, runner: ModelRunner, max_batch: int, max_pages: int):
        self.runner = runner
        self.buckets = sorted({b for b in self.BUCKETS if b < max_batch} | {max_batch})
        n, dev = self.buckets[-1], runner.device
        self.max_pages = max_pages
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.lengths = torch.ones(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.table = torch.zeros(n, max_pages, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        # the next step's inputs are written here on the host (page-locked: the copies to the device are
        # asynchronous DMA, no kernels), and ``copied`` marks when the device has read them
        self.host_ids = torch.zeros(3, n, dtype=torch.long, pin_memory=True)  # tokens, lengths, slots
        self.host_table = torch.zeros(n, max_pages, dtype=torch.long, pin_memory=True)
        self.copied: torch.cuda.Event | None = None

    def _pad(self) -> None:
        self.tokens.zero_()
        self.lengths.fill_(1)
        self.slots.zero_()
        self.table.zero_()

    def capture(self, b: int) -> None:
        self._pad()  # warm-up and capture see padding only: no sequence's state moves
        args = (self.tokens[:b], self.lengths[:b], self.slots[:b], self.table[:b])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):  # compile kernels, settle the allocator and the MoE path choice
                self.runner.decode_step(*args, static=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
            self.outputs[b] = self.runner.decode_step(*args, static=True)
        self.pool = graph.pool()
        self.graphs[b] = graph

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        n = len(seqs)
        b = next(x for x in self.buckets if x >= n)
        if b not in self.graphs:
            self.capture(b)
        pages = max(len(s.pages) for s in seqs)
        if pages > self.max_pages:
            raise ValueError(f"a sequence holds {pages} pages, more than the graph's {self.max_pages}")
        pad = b - n  # rows for the null slot and the reserved page 0
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have read the host buffers
        self.host_ids[:, :b] = torch.tensor([[s.output[-1] for s in seqs] + [0] * pad,
                                             [s.length for s in seqs] + [1] * pad,
                                             [s.slot for s in seqs] + [0] * pad])
        self.host_table[:b] = torch.tensor([s.pages + [0] * (self.max_pages - len(s.pages)) for s in seqs]
                                           + [[0] * self.max_pages] * pad)
        for dst, src in ((self.tokens, self.host_ids[0]), (self.lengths, self.host_ids[1]),
                         (self.slots, self.host_ids[2]), (self.table, self.host_table)):
            dst[:b].copy_(src[:b], non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        self.graphs[b].replay()
        return self.outputs[b][:n]
