"""Continuous batching: admit waiting requests (prefill first), otherwise decode every running one.

A step is either a prefill of newly admitted sequences or one decode token for all running ones.
Admission needs a state slot and pages for the prompt plus the first generated token.  When a decode
step needs a new page and none is free, the most recently admitted sequence is preempted: its pages
and state are swapped to host memory and it goes back to the front of the queue, to be swapped in
(not recomputed) when memory frees up.  With a prefix cache, a new prompt's longest cached prefix
is shared instead of allocated, and cached entries are evicted before anyone is preempted.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from target_stack.engine.cache import FreeList
from target_stack.engine.prefix import PrefixCache
from target_stack.engine.sequence import Sequence, Status


@dataclass
class Plan:
    prefill: list[Sequence] = field(default_factory=list)   # to run through the prompt
    resumed: list[Sequence] = field(default_factory=list)   # swapped in, ready to decode
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # swapped out during this schedule


class Scheduler:
    def __init__(self, pages: FreeList, slots: FreeList, page_size: int, max_batch: int, max_prefill_tokens: int,
                 swap_out: Callable[[Sequence], dict], prefix: PrefixCache | None = None):
        self.pages, self.slots, self.swap_out, self.prefix = pages, slots, swap_out, prefix
        self.page_size, self.max_batch, self.max_prefill_tokens = page_size, max_batch, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def pages_for(self, positions: int) -> int:
        return math.ceil(positions / self.page_size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Plan:
        plan = Plan()
        tokens = 0
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            resuming = seq.swapped is not None
            hit = None
            if self.prefix is not None and not resuming and seq.prompt_embeds is None:
                hit = self.prefix.match(seq.prompt)
            reused = hit.length if hit else 0
            if not resuming and plan.prefill and tokens + seq.num_prompt - reused > self.max_prefill_tokens:
                break
            head = self.prefix.acquire(hit) if hit else []  # held before any eviction below
            need = self.pages_for(seq.length if resuming else seq.num_prompt + 1) - len(head)
            if need > self.pages.free and self.prefix is not None:
                self.prefix.evict(need)
            if need > self.pages.free or self.slots.free < 1:
                if head:
                    self.prefix.unref(head)
                break
            self.waiting.popleft()
            seq.pages = head + self.pages.take(need, seq.id)
            seq.shared, seq.hit = len(head), hit
            if hit:
                self.prefix.record_hit(hit)
            seq.slot = self.slots.take(1, seq.id)[0]
            seq.status = Status.RUNNING
            self.running.append(seq)
            (plan.resumed if resuming else plan.prefill).append(seq)
            tokens += 0 if resuming else seq.num_prompt - reused
        if plan.prefill or plan.resumed:
            return plan
        # decode: every running sequence needs room for its newest token's keys
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below
            need = self.pages_for(seq.length) - len(seq.pages)
            if need > self.pages.free and self.prefix is not None:
                self.prefix.evict(need)
            while need > self.pages.free and self.running:
                victim = self.running[-1]
                self.preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq in self.running and need > 0:
                seq.pages += self.pages.take(need, seq.id)
        plan.decode = list(self.running)
        return plan

    def preempt(self, seq: Sequence) -> None:
        """Swap ``seq`` out to host memory, release its pages and slot, requeue it at the front."""
        seq.swapped = self.swap_out(seq)
        self.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Return a sequence's pages and slot (finished, cancelled, failed or swapped out)."""
        if seq.pages:
            own = seq.pages[seq.shared:]
            if own:
                self.pages.give(own, seq.id)
            if seq.shared:
                self.prefix.unref(seq.pages[:seq.shared])
            seq.pages, seq.shared, seq.hit = [], 0, None
        if seq.slot:
            self.slots.give([seq.slot], seq.id)
            seq.slot = 0
        if seq in self.running:
            self.running.remove(seq)

    def remove_waiting(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
