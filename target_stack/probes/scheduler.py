"""The scheduler's contract, checked at every decision of a real engine run under page pressure.

Outputs cannot show a scheduling defect that is still correct by luck (a victim picked out of order,
a slot left pointing at a freed entry, a prefix reference kept by a refused admission): the next
workload, with other lengths, turns it into wrong tokens or a leak.  This probe runs the engine with
the prefix cache on, prompts that share prefixes, too few pages for the batch and a cancellation,
and after every ``Scheduler.schedule`` and ``Scheduler.release`` checks the books against what the
module promises:

- admission is first come, first served: the admitted are the head of the queue, in order;
- a preempted sequence is the most recently admitted of those running; it leaves with no pages and
  no slot, at the front of the queue;
- a running sequence holds a slot of its own (distinct, never 0) and its pages are exactly its own
  plus the prefix cache's shared head; after a decode plan it has room for its newest token, and a
  resumed one has pages for every position it had when it was swapped out;
- a released sequence holds nothing, and nobody holds anything for it;
- every page reference of the prefix cache has a holder (an entry or a live sequence);
- a cancelled or finished request is no longer queued; at the end everything is back.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from feedback.correctness import fresh_generator
from feedback.probe import ProbeContext, probe
from target_stack.engine import LLMEngine, SamplingParams
from target_stack.engine.prefix import OWNER
from target_stack.engine.scheduler import Scheduler
from target_stack.model.model import HybridModel

SCHEDULER = "target_stack/engine/scheduler.py"
ENGINE = "target_stack/engine/engine.py"
PREFIX = "target_stack/engine/prefix.py"


class _Watch:
    """Wraps one engine's scheduler; records every broken promise once per (symbol, kind)."""

    def __init__(self, ctx: ProbeContext, engine: LLMEngine, seen: set[tuple[str, str]]):
        self.ctx, self.engine, self.sched = ctx, engine, engine.scheduler
        self.admitted: dict[int, int] = {}  # sequence id -> admission number (re-admission renumbers)
        self.counter = itertools.count()
        self.seen = seen  # shared by the runs: each broken promise reported once
        self.decisions = self.preempted = self.hits = self.refused_hits = 0
        self.acquired = 0  # prefix-cache acquisitions during the current decision
        schedule, release = self.sched.schedule, self.sched.release
        self.sched.schedule = lambda: self._schedule(schedule)
        self.sched.release = lambda seq: self._release(release, seq)
        if engine.prefix is not None:  # counted, not looked up again: a lookup would reorder the LRU
            acquire = engine.prefix.acquire
            engine.prefix.acquire = lambda hit: self._acquire(acquire, hit)

    def fail(self, symbol: str, kind: str, message: str, file: str = SCHEDULER) -> None:
        if (symbol, kind) not in self.seen:
            self.seen.add((symbol, kind))
            self.ctx.fail(message, file=file, symbol=symbol, condition=f"decision {self.decisions}, page pressure")

    # -- the wrapped calls ------------------------------------------------------------------------------
    def _schedule(self, schedule):
        self.queue_errors()
        queued = list(self.sched.waiting)
        self.acquired = 0
        plan = schedule()
        # an acquisition for no admitted prefill with a shared head: an admission that took prefix
        # references and was refused
        self.refused_hits += self.acquired - sum(1 for s in plan.prefill if s.shared)
        self.decisions += 1
        admitted = plan.resumed + plan.prefill
        ids = {s.id for s in admitted}
        if ids != {s.id for s in queued[:len(admitted)]}:
            self.fail("Scheduler.schedule", "fcfs", f"admitted {sorted(ids)} out of turn: the queue's head was "
                      f"{[s.id for s in queued[:len(admitted)]]} (first come, first served)")
        for seq in sorted(admitted, key=queued.index):
            self.admitted[seq.id] = next(self.counter)
        self.hits += sum(1 for s in plan.prefill if s.shared)
        self._check_victims(plan)
        self.books(plan)
        return plan

    def _acquire(self, acquire, hit):
        self.acquired += 1
        return acquire(hit)

    def _release(self, release, seq) -> None:
        release(seq)
        held = sorted(p for p, o in self.engine.pages.holders().items() if o == seq.id)
        slots = sorted(s for s, o in self.engine.slots.holders().items() if o == seq.id)
        if seq.pages or seq.slot or seq.shared:
            self.fail("Scheduler.release", "stale", f"a released sequence still points at pages {seq.pages} "
                      f"(shared {seq.shared}) and slot {seq.slot}: the next owner's entries")
        if held or slots:
            self.fail("Scheduler.release", "kept", f"after release, pages {held} and slots {slots} are still "
                      f"held for sequence {seq.id}")
        if seq in self.sched.running:
            self.fail("Scheduler.release", "running", "a released sequence is still in the running batch")

    # -- the promises ---------------------------------------------------------------------------------
    def _check_victims(self, plan) -> None:
        if not plan.preempted:
            return
        self.preempted += len(plan.preempted)
        order = [self.admitted.get(s.id, -1) for s in plan.preempted]
        if order != sorted(order, reverse=True):
            self.fail("Scheduler.schedule", "victim-order", f"victims preempted in admission order {order}; the "
                      "most recently admitted goes first")
        newest_kept = max((self.admitted.get(s.id, -1) for s in self.sched.running), default=-1)
        oldest_victim = min(order)
        if newest_kept > oldest_victim:
            self.fail("Scheduler.schedule", "victim", f"preempted the sequence admitted #{oldest_victim} while "
                      f"#{newest_kept} keeps running (the most recently admitted is the victim)")
        head = list(self.sched.waiting)[:len(plan.preempted)]
        if {s.id for s in head} != {s.id for s in plan.preempted}:
            self.fail("Scheduler.preempt", "requeue", "a preempted sequence is not back at the front of the queue")
        for seq in plan.preempted:
            if seq.swapped is None:
                self.fail("Scheduler.preempt", "swap", "a preempted sequence was not swapped out (it would "
                          "resume from nothing)")

    def queue_errors(self) -> None:
        for seq in self.sched.waiting:
            if seq.finished:
                self.fail("LLMEngine._finish", "queued", f"request {seq.id} finished ({seq.finish_reason}) but is "
                          "still queued: it would be admitted again", file=ENGINE)
            if seq.pages or seq.slot:
                self.fail("Scheduler.schedule", "waiting-holds", f"waiting request {seq.id} holds pages {seq.pages} "
                          f"and slot {seq.slot}")

    def books(self, plan=None) -> None:
        running = self.sched.running
        slots = [s.slot for s in running]
        if 0 in slots or len(set(slots)) != len(slots):
            self.fail("Scheduler.schedule", "slots", f"running sequences' state slots {slots}: each needs its own, "
                      "never the reserved 0")
        holders = self.engine.pages.holders()
        owned: dict[int, set[int]] = {}
        for page, owner in holders.items():
            owned.setdefault(owner, set()).add(page)
        for seq in running:
            own, shared = seq.pages[seq.shared:], seq.pages[:seq.shared]
            if set(own) != owned.get(seq.id, set()) or len(set(own)) != len(own):
                self.fail("Scheduler.schedule", "pages", f"sequence {seq.id}'s own pages {own} are not the pages held "
                          f"for it {sorted(owned.get(seq.id, set()))}")
            if any(holders.get(p) != OWNER for p in shared):
                self.fail("Scheduler.schedule", "shared", f"sequence {seq.id}'s shared head {shared} is not the "
                          "prefix cache's")
        if plan is not None:
            # a prefix hit's shared head holds exactly its reused positions: a page more would take the sequence's
            # own writes while the cache still serves it, a page less would leave reused positions unread
            ps = self.engine.page_size
            off = [(s.id, s.shared, s.reused) for s in plan.prefill if s.shared * ps != s.reused]
            if off:
                self.fail("PrefixCache.acquire", "head", "prefilled sequences' shared heads do not hold their reused "
                          "positions: " + ", ".join(f"sequence {i}: {n} shared pages of {ps} for {r} reused positions"
                                                    for i, n, r in off[:3]), file=PREFIX)
            short = [s.id for s in plan.decode if len(s.pages) < self.sched.pages_for(s.length)]
            if short:
                self.fail("Scheduler.schedule", "room", f"decoding sequences {short} have no page for their newest "
                          "token")
            # a resumed sequence is swapped back into pages for every position it had, and its newest token's
            short = [(s.id, len(s.pages), s.length, (s.swapped or {}).get("pages")) for s in plan.resumed
                     if len(s.pages) < max(self.sched.pages_for(s.length), (s.swapped or {}).get("pages", 0))]
            if short:
                self.fail("Scheduler.schedule", "resume", "resumed sequences were given too few pages: " + ", ".join(
                    f"sequence {i}: {n} pages for {length} positions ({saved} swapped out)"
                    for i, n, length, saved in short[:3]))
        prefix = self.engine.prefix
        if prefix is not None:
            problems = prefix.problems({s.id: s.pages[:s.shared] for s in running})
            if problems:
                self.fail("Scheduler.schedule", "refs", "prefix-cache references without a holder: "
                          + "; ".join(problems[:3]), file=SCHEDULER)
        live = {s.id for s in running} | {OWNER}
        stray = Counter(o for o in holders.values() if o not in live)
        if stray:
            self.fail("Scheduler.release", "stray", f"pages held for sequences that are not running: {dict(stray)}")


def _refused_admission_with_a_hit(ctx: ProbeContext, model: HybridModel, p: dict, seen: set) -> int:
    """A deterministic case of what the random runs reach only sometimes: a prompt extending a cached
    stem arrives while a long sequence holds most pages, so its admission takes the stem's references,
    evicts the entry, still lacks pages and is refused; the books are checked right after."""
    ps, usable = p["page_size"], p["num_pages"] - 1
    engine = _engine(ctx, model, p)
    watch = _Watch(ctx, engine, seen)
    gen = fresh_generator()
    vocab = model.cfg.vocab
    draw = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    stem = draw(2 * ps)
    engine.generate([stem + draw(1)], SamplingParams(max_tokens=1))  # the stem's two pages are cached
    free = usable - 2
    long_len = (free - 2) * ps - 1  # leaves two pages free once it runs
    engine.add_request(draw(long_len), SamplingParams(max_tokens=min(8, p["max_model_len"] - long_len - 1)))
    engine.step()
    engine.add_request(stem + draw(5 * ps), SamplingParams(max_tokens=1))  # needs 4 more pages than free
    before = watch.refused_hits
    engine.step()
    refused = watch.refused_hits - before
    _drain(engine, watch, "after a refused admission with a prefix hit")
    return refused


def _hit_and_preemption(ctx: ProbeContext, model: HybridModel, p: dict, seen: set) -> tuple[int, int]:
    """A deterministic case of a prefill from a cached stem and of decode growth that must preempt:
    two sequences of three pages each grow to eight, more than the pool holds.  (hits, preemptions).

    The cached prompt runs a page past the stem, so the hit (the stem's two pages) is shorter than its
    entry (three): a head that took one page too many shows here on every run, not only when the random
    runs happen to hit an entry short."""
    ps = p["page_size"]
    engine = _engine(ctx, model, p)
    watch = _Watch(ctx, engine, seen)
    gen = fresh_generator()
    draw = lambda n: torch.randint(0, model.cfg.vocab, (n,), generator=gen).tolist()  # noqa: E731
    stem = draw(2 * ps)
    engine.generate([stem + draw(ps + 1)], SamplingParams(max_tokens=1))  # an entry of three full pages
    engine.generate([stem + draw(3)], SamplingParams(max_tokens=1))  # from the cached stem: two of them
    n = 3 * ps - 1
    grow = min(5 * ps, p["max_model_len"] - n)  # to 8 pages each: 16 of the pool's num_pages - 1
    for _ in range(2):
        engine.add_request(draw(n), SamplingParams(max_tokens=grow))
    _drain(engine, watch, "after a cached prefill and a preemption")
    return watch.hits, watch.preempted


def _engine(ctx: ProbeContext, model: HybridModel, p: dict) -> LLMEngine:
    return LLMEngine(model, device=ctx.device, num_pages=p["num_pages"], page_size=p["page_size"],
                     max_model_len=p["max_model_len"], prefix_cache=True, prefix_entries=p.get("entries", 4),
                     max_batch=p.get("max_batch", 8))


def _drain(engine: LLMEngine, watch: _Watch, what: str) -> None:
    """Run to the end; then everything must be back once the cache is cleared."""
    while engine.has_unfinished():
        engine.step()
    watch.books()
    engine.prefix.clear()
    leaks = engine.leaks()
    if any(leaks.values()) or engine.pages.used or engine.slots.used:
        watch.fail("Scheduler.release", f"end {what}", f"{what} and the cache cleared, {engine.pages.used} pages "
                   f"and {engine.slots.used} slots are held: {leaks}")


def _prompts(gen: torch.Generator, vocab: int, p: dict) -> list[list[int]]:
    """Prompts of random lengths, half of them extending a shared stem (prefix-cache hits)."""
    stem = torch.randint(0, vocab, (p["stem"],), generator=gen).tolist()
    lo, hi = p["lengths"]
    out = []
    for i in range(p["requests"]):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        tail = torch.randint(0, vocab, (n,), generator=gen).tolist()
        out.append(stem + tail if i % 2 else tail)
    return out


@probe(kind="correctness")
def scheduler_contract(ctx: ProbeContext) -> None:
    """Several seeded engine runs under page pressure, the scheduler's promises checked at every
    decision (see the module docstring); a run that never preempts or never hits the prefix cache
    is itself a failure (the probe's parameters are too loose to test anything)."""
    p = ctx.params
    model = HybridModel("tiny")
    gen = fresh_generator()
    preempted = hits = decisions = refused = 0
    seen: set[tuple[str, str]] = set()
    for run in range(p.get("runs", 3)):
        engine = _engine(ctx, model, p)
        if not isinstance(engine.scheduler, Scheduler):
            ctx.fail("the engine's scheduler is not target_stack's Scheduler", file=ENGINE, symbol="LLMEngine")
            return
        watch = _Watch(ctx, engine, seen)
        prompts = _prompts(gen, model.cfg.vocab, p)
        lo, hi = p["max_tokens"]
        ids = [engine.add_request(q, SamplingParams(max_tokens=int(torch.randint(lo, hi + 1, (1,), generator=gen))))
               for q in prompts]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps == 1:  # the last request is still queued: cancel it there
                engine.cancel(ids[-1])
                watch.queue_errors()
            if steps > p.get("max_steps", 400):
                ctx.fail(f"run {run}: no end after {steps} steps (a request never finishes)", file=SCHEDULER,
                         symbol="Scheduler.schedule")
                break
        watch.books()
        if engine.prefix is not None:
            engine.prefix.clear()
        leaks = engine.leaks()
        if any(leaks.values()) or engine.pages.used or engine.slots.used:
            watch.fail("Scheduler.release", "end", f"after the run and clearing the prefix cache, {engine.pages.used} "
                       f"pages and {engine.slots.used} slots are held: {leaks}")
        preempted, hits, decisions = preempted + watch.preempted, hits + watch.hits, decisions + watch.decisions
        refused += watch.refused_hits
    refused += _refused_admission_with_a_hit(ctx, model, p, seen)
    forced_hits, forced_preemptions = _hit_and_preemption(ctx, model, p, seen)
    hits, preempted = hits + forced_hits, preempted + forced_preemptions
    ctx.metric("decisions", decisions)
    ctx.metric("preemptions", preempted)
    ctx.metric("prefix_hits", hits)
    ctx.metric("refused_with_prefix_hit", refused)
    ctx.metric("broken_promises", len(ctx.findings), better="lower")
    ctx.check(preempted > 0, "no run preempted: the probe's pages are too many to test preemption",
              file=SCHEDULER, symbol="Scheduler.schedule", condition=f"num_pages={p['num_pages']}")
    ctx.check(refused > 0, "no admission that had taken prefix-cache references was refused: the probe tests "
              "no refusal's cleanup", file=SCHEDULER, symbol="Scheduler.schedule")
    ctx.check(hits > 0, "no prefill hit the prefix cache: the probe's prompts test no shared pages",
              file=PREFIX, symbol="PrefixCache.match")
