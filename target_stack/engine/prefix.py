"""Prefix reuse: a prompt that starts like an earlier one skips the shared part of its prefill.

What a later prefill needs at a page boundary L of a cached prompt:

* the sparse-attention keys and values of positions < L: the cached prompt's full pages, shared
  read-only (a new sequence writes from position L on, so into pages of its own: no copy on write);
* every KDA layer's recurrent state and convolution tail after L tokens: rebuilt by a
  :class:`ReplaySSM` (the state before the prompt's last ``ring`` tokens plus their (k, u, g)
  records; all KDA layers' heads stacked in one ring, so recording and replaying are a handful of
  launches whatever the depth) and a window of the convolution inputs, so L can be any page
  boundary among the prompt's last ``ring`` tokens, the common case of a conversation that resends
  its history.

Pages are counted: each entry and each live sequence that reads a page holds one reference; the
page goes back to the free list when the last one is dropped.  Entries are evicted least recently
used first when the scheduler needs pages, or beyond ``max_entries``.  Prompts with image
embeddings are neither cached nor matched (their leading positions are not tokens).

Memory per entry besides its pages: the KDA checkpoint and ring, ``kda_layers * heads * (K * V +
ring * (2 K + V))`` floats (31 MB for the bench preset with a 64-token ring), so ``max_entries``
bounds it.  Only the colocated engine uses the cache; the disaggregated prefill worker does not.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from target_stack.engine.cache import FreeList
from target_stack.engine.replay_ssm import ReplaySSM
from target_stack.model.kda_layer import CONV, KDAState, KDATail

OWNER = -1  # the FreeList owner of every page the cache holds


@dataclass(eq=False)
class PrefixEntry:
    tokens: tuple[int, ...]
    pages: list[int]  # pages[i] holds positions [i * page_size, (i + 1) * page_size): the prompt's full pages
    first: int  # the earliest position the KDA states can be rebuilt at
    layers: list[int] = field(default_factory=list)  # the KDA layers, in the order their heads are stacked
    ssm: ReplaySSM | None = None  # every KDA layer's heads stacked in one ring: one replay rebuilds them all
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> convolution inputs from first - 3 on
    keys: list[int] = field(default_factory=list)  # its boundaries' hashes in the cache's index
    id: int = 0

    def restore(self, position: int) -> dict[int, KDAState]:
        """Every KDA layer's state after ``position`` tokens (first <= position <= len(tokens))."""
        if self.ssm is None:
            return {}
        states = self.ssm.state(position).chunk(len(self.layers))  # [L * H, K, V] -> per layer
        i = position - self.first  # conv[layer][j] is the convolution input of position first - (CONV - 1) + j
        return {layer: KDAState(conv=self.conv[layer][i:i + CONV - 1][None], kda=s[None])
                for layer, s in zip(self.layers, states, strict=True)}


@dataclass
class Hit:
    entry: PrefixEntry
    length: int  # reused positions, a multiple of the page size


class PrefixCache:
    def __init__(self, pages: FreeList, page_size: int, ring: int = 64, max_entries: int = 64):
        if ring < 1:
            raise ValueError(f"prefix ring must be >= 1 token, got {ring}")
        self.pages, self.page_size, self.ring, self.max_entries = pages, page_size, ring, max_entries
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self.refs: dict[int, int] = {}  # page -> entries and live sequences holding it
        self._index: dict[int, tuple[PrefixEntry, int]] = {}  # chained hash of tokens[:L] -> (entry, L)
        self._ids = itertools.count(1)
        self.stats = {"lookups": 0, "hits": 0, "reused_tokens": 0, "inserted": 0, "evicted": 0}

    # -- keys -------------------------------------------------------------------------------------
    def _boundaries(self, tokens: list[int] | tuple[int, ...], upto: int):
        """(L, chained hash of tokens[:L]) for every page boundary 0 < L <= upto."""
        h = 0
        ps = self.page_size
        for L in range(ps, upto + 1, ps):
            h = hash((h, tuple(tokens[L - ps:L])))
            yield L, h

    # -- lookup and references ------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> Hit | None:
        """The longest cached prefix of ``tokens`` that leaves at least one token to prefill."""
        self.stats["lookups"] += 1
        found = [(L, self._index[h][0]) for L, h in self._boundaries(tokens, len(tokens) - 1)
                 if h in self._index and self._index[h][1] == L]
        for L, entry in reversed(found):  # longest first; the token check guards against hash collisions
            if tuple(tokens[:L]) == entry.tokens[:L]:
                self.entries.move_to_end(entry.id)
                return Hit(entry, L)
        return None

    def acquire(self, hit: Hit) -> list[int]:
        """References for a sequence on the hit's pages; returns them (the head of its block table)."""
        pages = hit.entry.pages[: hit.length // self.page_size]
        for p in pages:
            self.refs[p] += 1
        return list(pages)

    def unref(self, pages: list[int]) -> None:
        freed = []
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                del self.refs[p]
                freed.append(p)
        if freed:
            self.pages.give(freed, OWNER)

    def record_hit(self, hit: Hit) -> None:
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += hit.length

    # -- insertion and eviction -----------------------------------------------------------------------
    def insert(self, tokens: list[int], owner: int, pages: list[int], shared: int, start: int,
               tails: dict[int, KDATail]) -> int:
        """Cache a just-prefilled prompt.  ``pages``: the sequence's block table, the first ``shared``
        already the cache's; ``start``: where its prefill began; ``tails``: each KDA layer's last tokens.
        The prompt's own full pages move from the sequence to the cache (the sequence keeps a
        reference).  Returns how many leading pages the sequence now shares."""
        full = len(tokens) // self.page_size
        if full == 0 or any(e.tokens == tuple(tokens) for e in self.entries.values()):
            return shared
        own = pages[shared:full]
        self.pages.transfer(own, owner, OWNER)
        for p in own:
            self.refs[p] = 1  # the sequence's
        for p in pages[:full]:
            self.refs[p] += 1  # the entry's
        first = start + next(iter(tails.values())).start if tails else 0
        entry = PrefixEntry(tokens=tuple(tokens), pages=list(pages[:full]), first=first, id=next(self._ids))
        if tails:  # the layers' heads side by side: one WY solve records them all (a handful of launches)
            entry.layers = sorted(tails)
            ts = [tails[layer] for layer in entry.layers]
            stack = lambda name, dim: torch.cat([getattr(t, name)[0] for t in ts], dim=dim)  # noqa: E731
            entry.ssm = ReplaySSM.from_state(stack("state", 0), stack("k", 1), stack("v", 1), stack("g", 1),
                                             stack("beta", 1), capacity=self.ring, position=first)
            entry.conv = {layer: tails[layer].conv[0].clone() for layer in entry.layers}
        self.entries[entry.id] = entry
        for L, h in self._boundaries(tokens, full * self.page_size):
            if first <= L:
                self._index[h] = (entry, L)
                entry.keys.append(h)
        self.stats["inserted"] += 1
        while len(self.entries) > self.max_entries:
            self._evict_one()
        return max(shared, full)

    def _evict_one(self) -> None:
        _, entry = self.entries.popitem(last=False)
        for h in entry.keys:
            if self._index.get(h, (None,))[0] is entry:  # a later entry may have taken the key over
                del self._index[h]
        self.stats["evicted"] += 1
        self.unref(entry.pages)

    def evict(self, pages_needed: int) -> None:
        """Drop least recently used entries until ``pages_needed`` pages are free or none is left."""
        while self.entries and self.pages.free < pages_needed:
            self._evict_one()

    def clear(self) -> None:
        while self.entries:
            self._evict_one()

    # -- accounting -----------------------------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return len(self.refs)

    def problems(self, live_shared: dict[int, list[int]]) -> list[str]:
        """Disagreements between the reference counts and their holders (``live_shared``: each live
        sequence's shared pages); empty when the books balance."""
        expect = Counter(p for entry in self.entries.values() for p in entry.pages)
        expect.update(p for pages in live_shared.values() for p in pages)
        out = [f"page {p}: {self.refs.get(p, 0)} references, {n} holders" for p, n in sorted(expect.items())
               if self.refs.get(p, 0) != n]
        out += [f"page {p}: {n} references, no holder" for p, n in sorted(self.refs.items()) if p not in expect]
        owned = {p for p, o in self.pages.holders().items() if o == OWNER}
        if owned != set(self.refs):
            out.append(f"pages owned by the cache {sorted(owned ^ set(self.refs))} disagree with its references")
        return out
