"""The engine's memory: a paged KV cache for the sparse-attention layers, a slot pool for KDA states.

Both are free lists over preallocated tensors.  Page 0 and slot 0 are reserved: block tables are
padded with page 0 and padded decode rows point at slot 0 (the KDA kernel neither reads nor writes
it).  ``leaks()`` is the accounting a probe checks after a run: every page and slot back home.
"""

from __future__ import annotations

import threading

import torch

from target_stack.model.quant import dequantize_kv, quantize_kv


class OutOfMemory(RuntimeError):
    pass


class FreeList:
    """Ids 1..n-1 (0 is reserved), handed out lowest first so runs are reproducible.  Thread-safe:
    a decode worker's receiver thread allocates while its main thread schedules."""

    def __init__(self, n: int, what: str):
        if n < 2:
            raise ValueError(f"{what}: need at least 2 entries (entry 0 is reserved), got {n}")
        self.n, self.what = n, what
        self._free = list(range(n - 1, 0, -1))
        self._owner: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._owner)

    def take(self, count: int, owner: int) -> list[int]:
        with self._lock:
            if count > len(self._free):
                raise OutOfMemory(f"{self.what}: need {count}, {len(self._free)} free")
            ids = [self._free.pop() for _ in range(count)]
            for i in ids:
                self._owner[i] = owner
            return ids

    def give(self, ids: list[int], owner: int) -> None:
        with self._lock:
            for i in ids:
                if self._owner.get(i) != owner:
                    raise RuntimeError(f"{self.what}: {i} is not held by sequence {owner} (double free?)")
            for i in ids:
                del self._owner[i]
                self._free.append(i)
            self._free.sort(reverse=True)

    def transfer(self, ids: list[int], owner: int, new_owner: int) -> None:
        """Hand held ids to another owner (a sequence's prompt pages to the prefix cache)."""
        with self._lock:
            for i in ids:
                if self._owner.get(i) != owner:
                    raise RuntimeError(f"{self.what}: {i} is not held by {owner}")
            for i in ids:
                self._owner[i] = new_owner

    def holders(self) -> dict[int, int]:
        with self._lock:
            return dict(self._owner)


class PagedKV:
    """One attention layer's pages: keys and values (fp32, bf16, int8 or fp8 with per-(token, head)
    scales) and the indexer keys, ``[num_pages, page_size, ...]``."""

    def __init__(self, num_pages: int, page_size: int, heads: int, head_dim: int, index_dim: int,
                 kind: str, device: torch.device):
        probe = torch.zeros(1, heads, head_dim)
        values, scale = quantize_kv(probe, kind)
        self.kind, self.page_size = kind, page_size
        shape = (num_pages, page_size, heads, head_dim)
        self.k = torch.zeros(shape, dtype=values.dtype, device=device)
        self.v = torch.zeros(shape, dtype=values.dtype, device=device)
        self.k_scale = self.v_scale = None
        if scale is not None:
            self.k_scale = torch.ones(num_pages, page_size, heads, 1, device=device)
            self.v_scale = torch.ones(num_pages, page_size, heads, 1, device=device)
        self.ik = torch.zeros(num_pages, page_size, index_dim, device=device)

    def write(self, page: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              ik: torch.Tensor) -> None:
        """Store tokens: page, offset [N]; k, v [N, H, D]; ik [N, Di]."""
        for cache, scale_cache, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values, scale = quantize_kv(x, self.kind)
            cache[page, offset] = values
            if scale is not None:
                scale_cache[page, offset] = scale
        self.ik[page, offset] = ik.float()

    def gather(self, block_table: torch.Tensor, dtype: torch.dtype):
        """Keys, values [B, P * page_size, H, D] and indexer keys [B, P * page_size, Di]."""
        B, P = block_table.shape
        out = []
        for cache, scale_cache in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = dequantize_kv(cache[block_table], None if scale_cache is None else scale_cache[block_table], dtype)
            out.append(x.reshape(B, P * self.page_size, *x.shape[-2:]))
        out.append(self.ik[block_table].reshape(B, P * self.page_size, -1))
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"k": self.k, "v": self.v, "ik": self.ik}
        if self.k_scale is not None:
            out.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return out

    def page_bytes(self) -> int:
        per = sum(t[0].numel() * t.element_size() for t in (self.k, self.v, self.ik))
        if self.k_scale is not None:
            per += 2 * self.k_scale[0].numel() * 4
        return per


class StatePool:
    """Per KDA layer: the recurrent states [num_slots, H, K, V] (fp32, or bf16: ``state_dtype``) and the
    convolution tails."""

    STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def __init__(self, num_slots: int, heads: int, head_k: int, head_v: int, conv_width: int, channels: int,
                 device: torch.device, dtype: torch.dtype = torch.float32, state_dtype: str = "fp32"):
        if state_dtype not in self.STATE_DTYPES:
            raise ValueError(f"kda_state_dtype must be one of {sorted(self.STATE_DTYPES)}, got {state_dtype!r}")
        self.kda = torch.zeros(num_slots, heads, head_k, head_v, device=device, dtype=self.STATE_DTYPES[state_dtype])
        self.conv = torch.zeros(num_slots, conv_width, channels, device=device, dtype=dtype)
