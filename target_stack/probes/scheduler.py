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
- a cancelled or finished request is no longer queued; at the end everything is back;
- a preempted sequence's saved copy is of what it held just before: ``swap_out`` saw its pages and slot
  still held, the copy equals them (not a view of the pools), is unchanged when swapped back in, and
  ``swap_in`` restores it; its tokens then are those of an engine with room;
- admission is live (an engine whose prefill budget is below max_model_len): a step prefills within
  the budget unless it prefills one prompt, no admissible request is left at the queue's head, every
  step makes progress, the run ends within its tokens plus resumptions steps and a wall-clock bound.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import torch

from feedback.correctness import fresh_generator
from feedback.probe import ProbeContext, probe
from target_stack.engine import LLMEngine, SamplingParams
from target_stack.engine.prefix import OWNER
from target_stack.engine.scheduler import Scheduler
from target_stack.engine.sequence import Sequence
from target_stack.model.model import HybridModel

SCHEDULER = "target_stack/engine/scheduler.py"
ENGINE = "target_stack/engine/engine.py"
PREFIX = "target_stack/engine/prefix.py"
RUNNER = "target_stack/engine/runner.py"


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _aliases(runner, saved) -> bool:
    """Whether a tensor of the swap record lies in the memory of a KV or state pool (a view, not a copy)."""
    pools = [t for c in runner.kv.values() for t in c.tensors().values()]
    pools += [getattr(p, n) for p in runner.states.values() for n in ("kda", "conv")]
    spans = [(t.device, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in pools]
    for t in _tensors(saved):
        ptr = t.untyped_storage().data_ptr()
        if any(t.device == d and lo <= ptr < lo + n for d, lo, n in spans):
            return True
    return False


def _same_record(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b.to(a.device))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_record(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_record, a, b))
    return a == b


def _saved_differs(runner, saved: dict, pages: list[int], slot: int) -> str:
    """'' when ``saved`` (a swap record: page count, KV of those pages, state slot's contents) holds the
    pools' entries at ``pages`` and ``slot``; else what differs."""
    if not isinstance(saved, dict) or saved.get("pages") != len(pages):
        n = saved.get("pages") if isinstance(saved, dict) else saved
        return f"{n} pages recorded, {len(pages)} held"
    idx = torch.tensor(pages, dtype=torch.long, device=runner.device)
    out = []
    try:
        for i, cache in runner.kv.items():
            for name, t in cache.tensors().items():
                if not torch.equal(saved["kv"][i][name].to(t.device), t[idx]):
                    out.append(f"KV {name} of layer {i}")
        for i, pool in runner.states.items():
            for name, got in zip(("kda", "conv"), saved["state"][i], strict=True):
                if not torch.equal(got.to(pool.kda.device), getattr(pool, name)[slot]):
                    out.append(f"{name} state of layer {i}")
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        out.append(f"unreadable record ({type(e).__name__}: {e})")
    return ", ".join(out[:4]) + (f" and {len(out) - 4} more" if len(out) > 4 else "")


class _Watch:
    """Wraps one engine's scheduler; records every broken promise once per (symbol, kind)."""

    def __init__(self, ctx: ProbeContext, engine: LLMEngine, seen: set[tuple[str, str]]):
        self.ctx, self.engine, self.sched = ctx, engine, engine.scheduler
        self.admitted: dict[int, int] = {}  # sequence id -> admission number (re-admission renumbers)
        self.counter = itertools.count()
        self.seen = seen  # shared by the runs: each broken promise reported once
        self.decisions = self.preempted = self.hits = self.refused_hits = 0
        self.acquired = 0  # prefix-cache acquisitions during the current decision
        self.swaps: dict[int, tuple[list[int], int, object]] = {}  # seq id -> (pages, slot) swap_out saw, record
        self.unswapped: dict[int, Sequence] = {}  # resumed by the last decision, not yet swapped in
        self.held: dict[int, tuple[list[int], int]] = {}  # running sequences' pages and slot before the decision
        self.steps_resumed = 0
        self.snapshots: dict[int, object] = {}  # seq id -> a copy of its swap record, taken when it was checked
        schedule, release, swap_out = self.sched.schedule, self.sched.release, self.sched.swap_out
        self.sched.schedule = lambda: self._schedule(schedule)
        self.sched.release = lambda seq: self._release(release, seq)
        self.sched.swap_out = lambda seq: self._swap_out(swap_out, seq)
        swap_in = engine.runner.swap_in
        engine.runner.swap_in = lambda seq, saved: self._swap_in(swap_in, seq, saved)
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
        if self.unswapped:
            self.fail("LLMEngine.step", "swap-in", f"resumed sequences {sorted(self.unswapped)} decoded without being "
                      "swapped in (their pages and state are whatever the last holder left)", file=ENGINE)
            self.unswapped.clear()
        queued = list(self.sched.waiting)
        self.held = {s.id: (list(s.pages), s.slot) for s in self.sched.running}
        self.swaps.clear()
        self.acquired = 0
        plan = schedule()
        self.unswapped = {s.id: s for s in plan.resumed}
        self.steps_resumed += bool(plan.resumed)
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
        self._check_saved(plan)
        self._check_admission(plan)
        self.books(plan)
        return plan

    def _swap_out(self, swap_out, seq):
        saved = swap_out(seq)
        self.swaps[seq.id] = (list(seq.pages), seq.slot, saved)
        return saved

    def _swap_in(self, swap_in, seq, saved) -> None:
        kept = self.snapshots.pop(seq.id, None)
        if kept is not None and not _same_record(kept, saved):
            self.fail("ModelRunner.swap_out", "snapshot", f"sequence {seq.id}'s saved copy changed while it was "
                      "swapped out (it shares memory with the pools their next holders write)", file=RUNNER)
        swap_in(seq, saved)
        self.unswapped.pop(seq.id, None)
        n = saved.get("pages", 0) if isinstance(saved, dict) else 0
        if len(seq.pages) < n:
            return  # too few pages: the scheduler's "resume" promise reports it
        diff = _saved_differs(self.engine.runner, saved, seq.pages[:n], seq.slot)
        if diff:
            self.fail("ModelRunner.swap_in", "restore", f"after swap_in, sequence {seq.id}'s pages and state slot "
                      f"do not hold what was saved: {diff}", file=RUNNER)

    def _check_saved(self, plan) -> None:
        """A preempted sequence's saved copy is of the pages and state slot it held just before: swap_out
        saw them still held, and copied them (nothing writes the pools inside a decision, so the pools'
        entries at those pages and that slot are still the values it held)."""
        for seq in plan.preempted:
            before = self.held.get(seq.id)
            if before is None:
                continue  # not running before this decision: the victim checks report it
            pages, slot = before
            if seq.id not in self.swaps:
                self.fail("Scheduler.preempt", "no-copy", f"sequence {seq.id} was preempted without a host copy of "
                          f"its {len(pages)} pages and state slot {slot} (swap_out never called on it)")
                continue
            seen_pages, seen_slot, saved = self.swaps[seq.id]
            if (seen_pages, seen_slot) != (pages, slot):
                self.fail("Scheduler.preempt", "copy-of-held", f"sequence {seq.id} held pages {pages} and state slot "
                          f"{slot} when preempted, but swap_out was given pages {seen_pages} and slot {seen_slot}: "
                          f"the saved copy is not of what it held (released before it was copied?)")
                continue
            if seq.swapped is not saved:
                self.fail("Scheduler.preempt", "record", f"sequence {seq.id} keeps a swap record that is not the one "
                          "swap_out returned for its pages")
                continue
            diff = _saved_differs(self.engine.runner, saved, pages, slot)
            if diff:
                self.fail("ModelRunner.swap_out", "copy", f"the copy saved for preempted sequence {seq.id} differs "
                          f"from the {len(pages)} pages and state slot {slot} it held: {diff}", file=RUNNER)
            elif _aliases(self.engine.runner, saved):
                self.fail("ModelRunner.swap_out", "snapshot", f"the copy saved for preempted sequence {seq.id} shares "
                          "memory with the KV or state pools: their next holders' writes reach it", file=RUNNER)
            else:
                self.snapshots[seq.id] = _clone(saved)

    def _check_admission(self, plan) -> None:
        """The prefill budget bounds a step's prompt tokens, except the first prompt's (a prompt longer than
        the budget is admitted alone); and a decision leaves no admissible request at the queue's head:
        with pages for its prompt and first token (or, resumed, for every position it had), a free slot,
        room in the batch and in the step's budget, it is admitted.  Judged without a prefix cache only,
        where what a request needs does not depend on what could be evicted."""
        sched = self.sched
        tokens = sum(s.num_prompt - s.reused for s in plan.prefill)
        if len(plan.prefill) > 1 and tokens > sched.max_prefill_tokens:
            self.fail("Scheduler.schedule", "budget", f"a step prefills {len(plan.prefill)} prompts of {tokens} "
                      f"tokens, over the budget max_prefill_tokens={sched.max_prefill_tokens}")
        if self.engine.prefix is not None or plan.preempted or not sched.waiting:
            return
        head = sched.waiting[0]
        resuming = head.swapped is not None
        need = sched.pages_for(head.length if resuming else head.num_prompt + 1)
        fits = resuming or not plan.prefill or tokens + head.num_prompt <= sched.max_prefill_tokens
        if (fits and need <= self.engine.pages.free and self.engine.slots.free >= 1
                and len(sched.running) < sched.max_batch):
            self.fail("Scheduler.schedule", "refused", f"request {head.id} ({head.num_prompt} prompt positions"
                      f"{', resuming' if resuming else ''}) was left queued though admissible: it needs {need} pages "
                      f"of {self.engine.pages.free} free and a slot of {self.engine.slots.free}; the step prefilled "
                      f"{len(plan.prefill)} prompts of {tokens} tokens (budget {sched.max_prefill_tokens}, a step's "
                      f"first prompt exempt from it); {len(sched.running)} of {sched.max_batch} running")

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
    prompts = [draw(n) for _ in range(2)]
    ids = [engine.add_request(q, SamplingParams(max_tokens=grow)) for q in prompts]
    outs = _drain(engine, watch, "after a cached prefill and a preemption")
    # resumed from what was saved, a preempted sequence continues as it would have without the pressure
    roomy = LLMEngine(model, device=ctx.device, page_size=ps, max_model_len=p["max_model_len"])
    want = roomy.generate(prompts, SamplingParams(max_tokens=grow))
    explained = {k for k in seen if k[0].startswith("ModelRunner.swap") or k[0] == "Scheduler.preempt"}
    for i, w in zip(ids, want, strict=True):
        got = outs[i].tokens if i in outs else []
        if got != w.tokens and not explained:  # else already located at the copy that was wrong
            k = next((j for j, (x, y) in enumerate(zip(got, w.tokens)) if x != y), min(len(got), len(w.tokens)))
            watch.fail("Scheduler.preempt", "resumed-tokens", f"request {i}, preempted under page pressure, generated "
                       f"{got[k:k + 4]} from token {k} where an engine with room generates "
                       f"{w.tokens[k:k + 4]}: it did not resume from what it held", file=SCHEDULER)
    return watch.hits, watch.preempted


def _admission_liveness(ctx: ProbeContext, model: HybridModel, p: dict, seen: set) -> dict:
    """Every admissible request is admitted and finishes: prompts longer than the per-step prefill budget
    (within max_model_len), at it, one past it and pairs filling it exactly, over too few pages, some sent
    while others run.  Each step must make progress (a token, or a swapped-out sequence resumed) while
    requests are unfinished, and the run must end within as many steps as it has tokens to generate plus
    its resumptions (a resume step generates none).  Run in a thread with a wall-clock bound: a decision
    that never returns is a located failure, not a hang."""
    a = p["admission"]
    budget, mt = a["budget"], a["max_tokens"]
    engine = LLMEngine(model, device=ctx.device, num_pages=p["num_pages"], page_size=p["page_size"],
                       max_model_len=p["max_model_len"], max_prefill_tokens=budget, max_batch=p.get("max_batch", 8))
    watch = _Watch(ctx, engine, seen)
    gen = fresh_generator()
    draw = lambda n: torch.randint(0, model.cfg.vocab, (n,), generator=gen).tolist()  # noqa: E731
    lengths, late = list(a["lengths"]), list(a.get("late", []))
    stats = {"steps": 0, "tokens": 0, "longest": max(lengths + late), "where": "before the first step"}
    stop = threading.Event()

    def produced() -> int:
        return sum(len(s.output) for s in engine.seqs.values()) + stats["tokens"]

    def drive() -> None:
        for n in lengths:
            engine.add_request(draw(n), SamplingParams(max_tokens=mt))
        total = mt * (len(lengths) + len(late))
        while engine.has_unfinished() and not stop.is_set():
            before, resumed = produced(), watch.steps_resumed
            waiting = [(s.id, s.num_prompt) for s in engine.scheduler.waiting]
            stats["where"] = f"step {stats['steps']}, waiting (id, prompt) {waiting[:4]}"
            outs = engine.step()
            stats["tokens"] += sum(len(o.tokens) for o in outs)
            stats["steps"] += 1
            if stats["steps"] == 2:  # arrivals while others run
                for n in late:
                    engine.add_request(draw(n), SamplingParams(max_tokens=mt))
            if produced() == before and watch.steps_resumed == resumed and not outs:
                ctx.fail(f"step {stats['steps']} made no progress (no token, nothing resumed) while requests "
                         f"{waiting} waited and {len(engine.scheduler.running)} ran: an admissible request is never "
                         f"admitted (prefill budget {budget}, {engine.pages.free} pages free)",
                         file=SCHEDULER, symbol="Scheduler.schedule",
                         condition=f"max_prefill_tokens={budget} < max_model_len={p['max_model_len']}")
                return
            if stats["steps"] > total + watch.preempted:
                ctx.fail(f"{stats['steps']} steps and not done: {total} tokens to generate and {watch.preempted} "
                         "resumptions bound the steps", file=SCHEDULER, symbol="Scheduler.schedule",
                         condition=f"max_prefill_tokens={budget}")
                return
        if not stop.is_set():
            _drain(engine, watch, "after prompts around the prefill budget")

    errors: list[BaseException] = []

    def run() -> None:
        try:
            drive()
        except BaseException as e:  # noqa: BLE001 - re-raised in the probe's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="admission-liveness", daemon=True)
    thread.start()
    thread.join(a.get("timeout_s", 60))
    if thread.is_alive():
        stop.set()
        ctx.fail(f"no end within {a.get('timeout_s', 60)} s ({stats['where']}): a scheduler decision or step never "
                 "returns", file=SCHEDULER, symbol="Scheduler.schedule", condition=f"max_prefill_tokens={budget}")
    elif errors:
        raise errors[0]
    return stats


def _engine(ctx: ProbeContext, model: HybridModel, p: dict) -> LLMEngine:
    return LLMEngine(model, device=ctx.device, num_pages=p["num_pages"], page_size=p["page_size"],
                     max_model_len=p["max_model_len"], prefix_cache=True, prefix_entries=p.get("entries", 4),
                     max_batch=p.get("max_batch", 8))


def _drain(engine: LLMEngine, watch: _Watch, what: str) -> dict:
    """Run to the end; then everything must be back once the cache is cleared.  The outputs by id."""
    outs = {}
    while engine.has_unfinished():
        outs.update((o.id, o) for o in engine.step())
    watch.books()
    if engine.prefix is not None:
        engine.prefix.clear()
    leaks = engine.leaks()
    if any(leaks.values()) or engine.pages.used or engine.slots.used:
        watch.fail("Scheduler.release", f"end {what}", f"{what} and the cache cleared, {engine.pages.used} pages "
                   f"and {engine.slots.used} slots are held: {leaks}")
    return outs


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
    if "admission" in p:
        live = _admission_liveness(ctx, model, p, seen)
        ctx.metric("admission_steps", live["steps"])
        ctx.check(live["longest"] > p["admission"]["budget"], "no prompt longer than the prefill budget: the "
                  "probe tests no oversized admission", file=SCHEDULER, symbol="Scheduler.schedule")
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
