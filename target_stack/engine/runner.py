"""The model runner: the model's layers driven over the engine's paged KV cache and state pools.

``prefill`` runs one sequence's prompt through every layer, fills its pages and state slot, and
returns the logits of its last position; ``decode`` runs one token for a batch of sequences,
reading and writing the caches in place.  ``layer_done`` (when set) is called after each layer of
a prefill: the disaggregated prefill worker hooks the KV transfer there (Layer Split).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from target_stack.engine.cache import PagedKV, StatePool
from target_stack.engine.sequence import Sequence
from target_stack.model.kda_layer import CONV
from target_stack.model.layers import sparse_attention, sparse_decode_attention
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
                                           self.device, self.dtype)
        self.layer_done: Callable[[Sequence, int], None] | None = None

    # -- prefill ----------------------------------------------------------------------------------
    def _positions(self, seq: Sequence, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, stop)
        pages = torch.tensor(seq.pages, dtype=torch.long)[pos // self.page_size]
        return pages.to(self.device), (pos % self.page_size).to(self.device)

    @torch.no_grad()
    def prefill(self, seq: Sequence) -> torch.Tensor:
        model, cfg = self.model, self.cfg
        h = model.embed_tokens(torch.tensor(seq.prompt, device=self.device))
        if seq.prompt_embeds is not None:
            h = torch.cat([seq.prompt_embeds.to(h.dtype), h])
        T = h.shape[0]
        page, offset = self._positions(seq, 0, T)
        h = h[None]
        for i, block in enumerate(model.blocks):
            x = block.norm1(h)
            if block.is_attn:
                q, k, v, iq, ik = block.mixer.project(x[0])
                self.kv[i].write(page, offset, k, v, ik)
                o = sparse_attention(q, k, v, iq, ik, cfg.block, cfg.top_k_blocks, cfg.window)
                mix = F.linear(o.reshape(T, -1), block.mixer.w_o)[None]
            else:
                mix, state = block.mixer.prefill(x)
                pool = self.states[i]
                pool.kda[seq.slot] = state.kda[0]
                pool.conv[seq.slot] = state.conv[0].to(pool.conv.dtype)
            h = h + mix
            h = h + block.ffn(block.norm2(h))
            if self.layer_done is not None:
                self.layer_done(seq, i)
        return F.linear(model.norm(h[0, -1:]), model.lm_head)[0]

    # -- decode -----------------------------------------------------------------------------------
    def block_table(self, seqs: list[Sequence], width: int | None = None) -> torch.Tensor:
        width = width or max(len(s.pages) for s in seqs)
        rows = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token; logits [B, vocab]."""
        tokens = torch.tensor([s.output[-1] for s in seqs], device=self.device)
        lengths = torch.tensor([s.length for s in seqs], device=self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        need = max(math.ceil(s.length / self.page_size) for s in seqs)
        table = self.block_table(seqs, need)
        return self.decode_step(tokens, lengths, slots, table)

    def decode_step(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                    table: torch.Tensor) -> torch.Tensor:
        """The tensor-only decode step (no host synchronisation outside the MoE's grouping)."""
        model, cfg = self.model, self.cfg
        pos = lengths - 1
        page = table.gather(1, (pos // self.page_size)[:, None])[:, 0]
        offset = pos % self.page_size
        h = model.embed_tokens(tokens)[:, None]  # [B, 1, dim]
        for i, block in enumerate(model.blocks):
            x = block.norm1(h)
            if block.is_attn:
                q, k, v, iq, ik = block.mixer.project(x[:, 0])
                cache = self.kv[i]
                cache.write(page, offset, k, v, ik)
                ks, vs, iks = cache.gather(table, q.dtype)
                o = sparse_decode_attention(q, ks, vs, iq, iks, lengths, cfg.block, cfg.top_k_blocks, cfg.window)
                mix = F.linear(o.reshape(o.shape[0], -1), block.mixer.w_o)[:, None]
            else:
                pool = self.states[i]
                mix = block.mixer.decode_pooled(x, pool.conv, pool.kda, slots)
            h = h + mix
            h = h + block.ffn(block.norm2(h))
        return F.linear(model.norm(h[:, 0]), model.lm_head)

    # -- preemption by swapping -------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> dict:
        """Host copies of the sequence's pages and state slots (so resuming never recomputes)."""
        pages = torch.tensor(seq.pages, dtype=torch.long, device=self.device)
        out: dict = {"kv": {}, "state": {}, "pages": len(seq.pages)}
        for i, cache in self.kv.items():
            out["kv"][i] = {name: t[pages].cpu() for name, t in cache.tensors().items()}
        for i, pool in self.states.items():
            out["state"][i] = (pool.kda[seq.slot].cpu(), pool.conv[seq.slot].cpu())
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
