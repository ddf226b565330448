"""target_stack's engine probes: outputs against a full recompute, pool accounting, the
disaggregated KV-transfer path seen through its events, and an end-to-end serving run."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile

import torch

from feedback.correctness import fresh_generator
from feedback.events import SAMPLE_VAR, gil_blocked, load_events, read_events, sampler_faults, spans
from feedback.probe import ProbeContext, probe
from target_stack.engine import LLMEngine, SamplingParams
from target_stack.model.model import PRESETS, HybridModel, ModelConfig

ENGINE = "target_stack/engine/engine.py"
SCHEDULER = "target_stack/engine/scheduler.py"
RUNNER = "target_stack/engine/runner.py"
PREFIX = "target_stack/engine/prefix.py"
DISAGG_TRANSFER = "target_stack/engine/disagg/transfer.py"
DISAGG_WORKERS = "target_stack/engine/disagg/workers.py"
NATIVE = "target_stack/ops/moe/native/__init__.py"
EVENTS = "target_stack/events.py"


def _greedy_recompute(model: HybridModel, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq], device=model.embed.device))[0, -1].argmax()))
    return seq[len(prompt):]


def _first_off_greedy(model: HybridModel, prompt: list[int], tokens: list[int]) -> tuple[int, int] | None:
    """(i, the recompute's token) for the first of ``tokens`` that is not the argmax of a full recompute of
    ``prompt + tokens[:i]``, or None: the same verdict as ``_greedy_recompute``, in one forward (teacher forced)."""
    if not tokens:
        return None
    logits = model(torch.tensor([prompt + tokens[:-1]], device=model.embed.device))[0, len(prompt) - 1:]
    want = logits.argmax(-1).tolist()
    return next(((i, w) for i, (t, w) in enumerate(zip(tokens, want, strict=True)) if t != w), None)


@probe(kind="correctness")
def engine_correctness(ctx: ProbeContext) -> None:
    """Greedy outputs of the batched engine (paged KV, slot pool, pooled decode) equal a full
    recompute of the whole sequence for every token; stop tokens end a request where they come; with
    ``limits``, requests at the boundaries of the page size and the model length (``_limit_cases``)
    run to the same outputs, and those one past the model length are refused."""
    gen = fresh_generator()
    model = HybridModel(ModelConfig(kda_backend=ctx.params.get("kda_backend", "auto")))
    n = int(ctx.params.get("max_tokens", 4))
    prompts = [torch.randint(0, model.cfg.vocab, (L,), generator=gen).tolist() for L in ctx.params["prompt_lengths"]]
    engine = LLMEngine(model, device=ctx.device)  # the model moves to the probe's device
    outs = engine.generate(prompts, SamplingParams(max_tokens=n))
    mismatches = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _greedy_recompute(model, prompt, n)
        if out.tokens != ref:
            mismatches += 1
            first = next(i for i, (a, b) in enumerate(zip(out.tokens, ref, strict=True)) if a != b)
            ctx.fail(f"engine token {first} differs from a full recompute ({out.tokens} vs {ref})",
                     file=RUNNER, symbol="ModelRunner.decode" if first else "ModelRunner.prefill",
                     condition=f"prompt length {len(prompt)}")
    _check_stop_tokens(ctx, model, prompts, max(n, 4), gen)
    if "limits" in ctx.params:
        mismatches += _check_limits(ctx, model, gen, **ctx.params["limits"])
    ctx.metric("mismatched_requests", mismatches, better="lower")


def _limit_cases(ps: int, limit: int) -> tuple[list[list[tuple[int, int]]], list[tuple[int, int]]]:
    """Batches of (prompt length, max_tokens) the engine must run, and requests it must refuse, for pages of
    ``ps`` positions and a model length ``limit``: a batch of one exactly at the limit with max_tokens = 1; a
    page-aligned prompt decoding through a whole new page to exactly the limit; prompts one below, at and
    one past a page multiple finishing in the same step; the same finishing at different steps, one of them
    at its prefill (max_tokens = 1).  Refused: one position past the limit, by the prompt alone or by its
    max_tokens."""
    aligned = (limit - 1) // ps * ps  # the last page boundary short of the limit
    batches = [[(limit - 1, 1)], [(aligned, limit - aligned)],
               [(ps - 1, 2), (ps, 2), (ps + 1, 2)], [(2 * ps - 1, 1), (2 * ps, 3), (2 * ps + 1, 5)]]
    refused = [(limit, 1), (aligned, limit - aligned + 1), (limit + 1, 1)]
    return batches, refused


def _check_limits(ctx: ProbeContext, model: HybridModel, gen: torch.Generator, page_size: int,
                  max_model_len: int) -> int:
    """Requests at the boundaries of the engine's limits (see ``_limit_cases``) on an engine of small pages and a
    short model length: every request that fits (prompt + max_tokens <= max_model_len) is accepted and its greedy
    output is a full recompute's, ``max_tokens`` long; one that does not is refused at ``add_request`` with a
    ``RequestError`` naming max_model_len.  Returns the mismatched (or wrongly refused) requests."""
    from target_stack.engine.sequence import RequestError

    vocab = model.cfg.vocab
    batches, refused = _limit_cases(page_size, max_model_len)
    bad = 0
    for batch in batches:
        engine = LLMEngine(model, device=ctx.device, page_size=page_size, max_model_len=max_model_len)
        shape = " + ".join(f"{L}+{n}" for L, n in batch)
        ids = {}
        for L, n in batch:
            prompt = torch.randint(0, vocab, (L,), generator=gen).tolist()
            cond = f"prompt {L} + max_tokens {n} = {L + n} of max_model_len {max_model_len} (pages of " \
                   f"{page_size}), in a batch of {len(batch)} ({shape})"
            try:
                ids[engine.add_request(prompt, SamplingParams(max_tokens=n))] = (prompt, n, cond)
            except RequestError as e:
                bad += 1
                ctx.fail(f"a request that fits the model length was refused: {e}", file=ENGINE,
                         symbol="LLMEngine.add_request", condition=cond)
        outs = {}
        for _ in range(max_model_len + 2):  # every request ends within max_tokens steps after its prefill
            if not engine.has_unfinished():
                break
            for o in engine.step():
                outs[o.id] = o
        for rid, (prompt, n, cond) in ids.items():
            out = outs.get(rid)
            off = None if out is None else _first_off_greedy(model, prompt, out.tokens)
            if out is not None and len(out.tokens) == n and out.finish_reason == "length" and off is None:
                continue
            bad += 1
            if out is None:
                ctx.fail("the request never finished", file=ENGINE, symbol="LLMEngine.step", condition=cond)
            elif off is not None:
                i, want = off
                ctx.fail(f"engine token {i} is {out.tokens[i]}, a full recompute's {want} (outputs {out.tokens})",
                         file=RUNNER, symbol="ModelRunner.decode" if i else "ModelRunner.prefill", condition=cond)
            else:
                ctx.fail(f"ended {out.finish_reason!r} after {len(out.tokens)} tokens, not 'length' after {n}",
                         file=ENGINE, symbol="LLMEngine._append", condition=cond)
    engine = LLMEngine(model, device=ctx.device, page_size=page_size, max_model_len=max_model_len)
    for L, n in refused:
        prompt = torch.randint(0, vocab, (L,), generator=gen).tolist()
        cond = f"prompt {L} + max_tokens {n} = {L + n}, one past max_model_len {max_model_len}" \
            if L + n == max_model_len + 1 else f"prompt {L} + max_tokens {n} = {L + n} > max_model_len {max_model_len}"
        try:
            rid = engine.add_request(prompt, SamplingParams(max_tokens=n))
        except RequestError as e:
            ctx.check("max_model_len" in str(e), f"refused without naming the limit: {e}", file=ENGINE,
                      symbol="LLMEngine.add_request", condition=cond)
            continue
        except Exception as e:  # noqa: BLE001
            ctx.fail(f"refused with {type(e).__name__} instead of a RequestError: {e}", file=ENGINE,
                     symbol="LLMEngine.add_request", condition=cond)
            continue
        bad += 1
        ctx.fail("a request longer than the model length was accepted", file=ENGINE, symbol="LLMEngine.add_request",
                 condition=cond)
        engine.cancel(rid)
        engine.step()
    ctx.check(not engine.has_unfinished() and not engine.scheduler.waiting, "refused requests were kept: "
              f"{len(engine.seqs)} request(s), {len(engine.scheduler.waiting)} queued", file=ENGINE,
              symbol="LLMEngine.add_request", condition=f"requests past max_model_len {max_model_len} refused")
    return bad


def _steer(runner, forced: dict[int, dict[int, int]], banned: dict[int, int]) -> None:
    """Wrap the runner's prefill and decode so that sequence ``id`` samples ``forced[id][step]`` at that step
    (every other logit -inf) and never ``banned[id]``: the engine's handling of what it samples is judged,
    whatever the model would have said."""
    prefill_from, decode = runner.prefill_from, runner.decode

    def steer(seq, row: torch.Tensor) -> torch.Tensor:
        row = row.clone()
        if seq.id in banned:
            row[banned[seq.id]] = -torch.inf
        token = forced.get(seq.id, {}).get(len(seq.output))
        if token is not None:
            row.fill_(-torch.inf)
            row[token] = 0.0
        return row

    def steered_prefill(seq, *args, **kwargs):
        logits, *rest = prefill_from(seq, *args, **kwargs)
        return (steer(seq, logits), *rest)

    def steered_decode(seqs, *args, **kwargs):
        logits = decode(seqs, *args, **kwargs)
        return torch.stack([steer(seq, row) for seq, row in zip(seqs, logits, strict=True)])

    runner.prefill_from, runner.decode = steered_prefill, steered_decode


def _check_stop_tokens(ctx: ProbeContext, model: HybridModel, prompts: list[list[int]], n: int,
                       gen: torch.Generator) -> None:
    """Stop tokens, in one batch: a request ends at the first token equal to its stop token, that token included,
    with reason "stop"; a request whose stop token never comes runs to ``max_tokens`` ("length").  The runner's
    logits are steered so that each stop token comes at a chosen step; the stop tokens are the vocabulary's first
    and last ids and one inside it."""
    vocab = model.cfg.vocab
    inside = int(torch.randint(1, vocab - 1, (1,), generator=gen))
    # (stop token, step at which it is sampled or None: never)
    cases = [(0, 1), (vocab - 1, n - 2), (inside, 0), (inside, None)]
    engine = LLMEngine(model, device=ctx.device)
    ids = [engine.add_request(prompts[i % len(prompts)], SamplingParams(max_tokens=n, stop_token=stop))
           for i, (stop, _) in enumerate(cases)]
    forced = {rid: {at: stop} for rid, (stop, at) in zip(ids, cases, strict=True) if at is not None}
    # banned at every other step, so each stop token comes exactly where it is forced, or never
    _steer(engine.runner, forced, {rid: stop for rid, (stop, _) in zip(ids, cases, strict=True)})
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.id] = o
    for rid, (stop, at) in zip(ids, cases, strict=True):
        out = outs.get(rid)
        want_len, want_reason = (at + 1, "stop") if at is not None else (n, "length")
        cond = f"stop_token={stop} (vocab {vocab}), " + (f"sampled at step {at}" if at is not None else "never sampled")
        where = dict(file=ENGINE, symbol="LLMEngine._append (stop tokens)", condition=cond)
        if not ctx.check(out is not None, "the request never finished", **where):
            continue
        ctx.check(len(out.tokens) == want_len and out.finish_reason == want_reason
                  and (at is None or out.tokens[-1] == stop),
                  f"ended {out.finish_reason!r} after {len(out.tokens)} tokens {out.tokens}, not {want_reason!r} after "
                  f"{want_len}", **where)


CACHE = "target_stack/engine/cache.py"


def _check_pool_threads(ctx: ProbeContext) -> None:
    """The page pool (``FreeList``) is thread-safe, as the decode worker needs (its receiver thread reserves pages
    while its main thread schedules): threads taking and returning pages of one near-full pool see nothing but
    the pool's own ``OutOfMemory``, never get a page another holds, and afterwards every page is home: free +
    held = total, no page twice, and a take of all of them hands out 1..n-1, lowest first.  Thread switches are
    forced as often as the interpreter allows so that a check-then-act outside the lock loses its race."""
    import random
    import sys
    import threading
    import time

    from target_stack.engine.cache import FreeList, OutOfMemory

    c = {"pages": 16, "resident": 12, "threads": 6, "max_take": 3, "seconds": 1.0, **ctx.params.get("pool_threads", {})}
    n, resident = int(c["pages"]), int(c["resident"])
    pool = FreeList(n, "KV pages")
    where = dict(file=CACHE, condition=f"{c['threads']} threads taking 1-{c['max_take']} and returning pages of one "
                 f"pool of {n - 1} with {resident} held elsewhere (near full)")
    kept = pool.take(resident, 10**6)  # the pool is near full: every take races for the last few pages
    claimed: dict[int, int] = {}  # page -> the thread that holds it, by this probe's own account
    claim_lock = threading.Lock()
    errors: list[tuple[str, str]] = []
    stop = threading.Event()
    counts = {"takes": 0, "refused": 0}
    seed = random.randrange(2**31)

    def worker(k: int) -> None:
        rng, held = random.Random(seed + k), []
        while not stop.is_set():
            want = rng.randint(1, c["max_take"])
            try:
                ids = pool.take(want, k)
            except OutOfMemory:
                counts["refused"] += 1
                ids = None
            except Exception as exc:  # noqa: BLE001 - the contract: OutOfMemory or pages
                errors.append(("FreeList.take", f"{type(exc).__name__}: {exc}"))
                break
            if ids is not None:
                counts["takes"] += 1
                with claim_lock:
                    dup = {i: claimed[i] for i in ids if i in claimed}
                    bad = len(ids) != want or len(set(ids)) != want or dup or not all(0 < i < n for i in ids)
                    claimed.update((i, k) for i in ids)
                if bad:
                    errors.append(("FreeList.take", f"take({want}) handed out {sorted(ids)}"
                                   + (f", of which {sorted(dup)} another thread held" if dup else "")))
                    break
                held += ids
            if held and (rng.random() < 0.6 or ids is None):
                back = rng.sample(held, rng.randint(1, len(held)))
                with claim_lock:
                    for i in back:
                        claimed.pop(i, None)
                held = [i for i in held if i not in back]
                try:
                    pool.give(back, k)
                except Exception as exc:  # noqa: BLE001 - the contract: a holder's give always works
                    errors.append(("FreeList.give", f"{type(exc).__name__}: {exc}"))
                    break
        with claim_lock:
            for i in held:
                claimed.pop(i, None)
        try:
            pool.give(held, k)
        except Exception as exc:  # noqa: BLE001
            errors.append(("FreeList.give", f"{type(exc).__name__}: {exc}"))

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(k,), name=f"pool-{k}", daemon=True)
                   for k in range(int(c["threads"]))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + float(c["seconds"])
        while time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join(5.0)
    finally:
        sys.setswitchinterval(before)
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        ctx.fail(f"threads using the page pool did not finish: {stuck} (a lock never released?)",
                 symbol="FreeList", **where)
        return
    for symbol, msg in errors[:1]:
        ctx.fail(f"{symbol} under concurrent use: {msg}; the pool's only refusal is OutOfMemory "
                 f"({len(errors)} such error(s) in {counts['takes']} takes)", symbol=symbol, **where)
    free, used = pool.free, pool.used
    ctx.check(free + used == n - 1 and used == resident, f"after every thread returned its pages, {free} free + "
              f"{used} held (want {n - 1 - resident} + {resident}): {n - 1 - free - used:+d} page(s) unaccounted for",
              symbol="FreeList", **where)
    pool.give(kept, 10**6)
    try:
        everything = pool.take(n - 1, 0)
    except OutOfMemory as exc:
        ctx.fail(f"after the threads, the whole pool cannot be taken again: {exc}", symbol="FreeList.take", **where)
        return
    ctx.check(everything == list(range(1, n)), f"after the threads, taking the whole pool handed out "
              f"{everything[:12]}{'...' if len(everything) > 12 else ''} instead of 1..{n - 1}, lowest first (a page "
              "lost or listed twice)", symbol="FreeList", **where)
    try:
        extra = pool.take(1, 0)
        ctx.fail(f"an empty pool handed out page {extra}", symbol="FreeList.take", **where)
    except OutOfMemory:
        pass


@probe(kind="correctness")
def pool_accounting(ctx: ProbeContext) -> None:
    """A run with preemption (too few pages), a cancellation and a refused request hands every
    page and state slot back, and preempted requests resume with the same outputs; the page pool
    keeps its accounting under threads (``_check_pool_threads``)."""
    _check_pool_threads(ctx)
    gen = fresh_generator()
    model = HybridModel("tiny")
    p = ctx.params
    prompts = [torch.randint(0, model.cfg.vocab, (p["prompt_length"],), generator=gen).tolist()
               for _ in range(p["requests"])]
    params = SamplingParams(max_tokens=p["max_tokens"])
    roomy = LLMEngine(model, device=ctx.device).generate(prompts, params)
    tight = LLMEngine(model, device=ctx.device, num_pages=p["num_pages"], page_size=p["page_size"],
                      max_model_len=p["max_model_len"])
    ids = [tight.add_request(q, params) for q in prompts]
    extra = tight.add_request(prompts[0], SamplingParams(max_tokens=p["max_tokens"]))
    try:
        tight.add_request([])
    except ValueError:
        pass
    outs, steps = {}, 0
    while tight.has_unfinished():
        for o in tight.step():
            outs[o.id] = o
        steps += 1
        if steps == 2:
            tight.cancel(extra)
    leaks = tight.leaks()
    usage = tight.usage()
    ctx.metric("preemptions", tight.preemptions)
    ctx.metric("leaked_pages", len(leaks["pages"]) + usage["pages_used"], better="lower")
    ctx.metric("leaked_slots", len(leaks["slots"]) + usage["slots_used"], better="lower")
    ctx.check(tight.preemptions > 0, "the workload did not force a preemption (probe parameters too loose)",
              file=SCHEDULER, symbol="Scheduler.schedule", condition=f"num_pages={p['num_pages']}")
    ctx.check(not leaks["pages"] and not usage["pages_used"],
              f"pages still held after the run: {usage['pages_used']} in use, by sequences no longer live: "
              f"{leaks['pages'] or 'none'}",
              file="target_stack/engine/cache.py", symbol="FreeList", condition="after preemption and cancel")
    ctx.check(not leaks["slots"] and not usage["slots_used"],
              f"state slots still held: {usage['slots_used']} in use, by sequences no longer live: "
              f"{leaks['slots'] or 'none'}",
              file="target_stack/engine/cache.py", symbol="FreeList", condition="after preemption and cancel")
    ctx.check(outs[extra].finish_reason == "cancelled", "a cancelled request did not finish as cancelled",
              file=ENGINE, symbol="LLMEngine.cancel")
    same = [outs[i].tokens == r.tokens for i, r in zip(ids, roomy, strict=True)]
    ctx.check(all(same), f"{same.count(False)} preempted request(s) resumed with different tokens",
              file="target_stack/engine/runner.py", symbol="ModelRunner.swap_in")
    _check_swap_snapshot(ctx, model, prompts[0])


def _check_swap_snapshot(ctx: ProbeContext, model: HybridModel, prompt: list[int]) -> None:
    """What ``swap_out`` saves is a snapshot: the next holder of the sequence's slot and pages writing there before
    it resumes changes nothing that ``swap_in`` gives back (the run above resumes only where no one did)."""
    engine = LLMEngine(model, device=ctx.device)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8))
    engine.step()  # the prefill
    engine.step()  # a decode step
    seq, runner = engine.seqs[rid], engine.runner
    pages = torch.tensor(seq.pages, dtype=torch.long, device=ctx.device)
    where = dict(file=RUNNER, symbol="ModelRunner.swap_out / swap_in",
                 condition="the slot and pages written by their next holder before the resume")
    before_kv = {(i, n): t[pages].clone() for i, c in runner.kv.items() for n, t in c.tensors().items()}
    before_state = {(i, n): getattr(pool, n)[seq.slot].clone() for i, pool in runner.states.items()
                    for n in ("kda", "conv")}
    saved = runner.swap_out(seq)
    for c in runner.kv.values():  # the next holder's own values
        for t in c.tensors().values():
            t[pages] = (torch.randn(t[pages].shape, device=t.device) * 3).to(t.dtype)
    for pool in runner.states.values():
        pool.kda[seq.slot].normal_()
        pool.conv[seq.slot].normal_()
    runner.swap_in(seq, saved)
    changed = [f"KV {n} of layer {i}" for (i, n), t in before_kv.items()
               if not torch.equal(runner.kv[i].tensors()[n][pages], t)]
    changed += [f"{n} state of layer {i}" for (i, n), t in before_state.items()
                if not torch.equal(getattr(runner.states[i], n)[seq.slot], t)]
    ctx.check(not changed, f"after the swap, {len(changed)} part(s) came back as the next holder left them: "
              f"{', '.join(changed[:4])}", **where)


@probe(kind="correctness")
def prefix_reuse(ctx: ProbeContext) -> None:
    """A prefill that starts from a cached prefix (shared KV pages, KDA states rebuilt by ReplaySSM)
    against a full prefill of the same prompt, for prompts that extend a cached one and prompts that
    leave it inside its ring; then page boundaries: prompts one below, at and one past a page multiple,
    resent whole and sent as a prefix of the cached prompt (a hit is the longest cached page-aligned
    prefix that leaves at least one token to prefill); then the cache's page references after
    eviction and clearing."""
    gen = fresh_generator()
    p = ctx.params
    ps = int(p.get("page_size", 16))
    model = HybridModel("tiny")
    vocab = model.cfg.vocab
    draw = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    base = draw(p["base_length"])
    cached = LLMEngine(model, device=ctx.device, page_size=ps, prefix_cache=True, prefix_ring=p.get("ring", 64))
    plain = LLMEngine(model, device=ctx.device, page_size=ps)
    cached.generate([base], SamplingParams(max_tokens=1))
    worst, hits = 0.0, 0
    for keep, extra in p["cases"]:  # (positions of base kept, new tokens after them)
        tokens = base[:keep] + draw(extra)
        err, hit = _prefill_against_full(ctx, cached, plain, tokens, f"kept {keep} of {len(base)} cached positions, "
                                         f"{extra} new")
        worst, hits = max(worst, err), hits + hit
    ctx.check(hits == len(p["cases"]), f"only {hits} of {len(p['cases'])} prompts reused the cached prefix",
              file=PREFIX, symbol="PrefixCache.match")
    # page boundaries: (tokens, the cached prompt they are matched against, what they are)
    bounds = p.get("boundary", {})
    sent = [draw(n * ps + d) for n in bounds.get("resend_pages", []) for d in (-1, 0, 1)]
    if sent:  # cached through the engine (outputs against the uncached engine), then sent again
        _same_outputs(ctx, cached, plain, sent, SamplingParams(max_tokens=2), "first sent, then cached")
    boundary = [(q, q, "resent whole") for q in sent]
    boundary += [(base[:n * ps + d], base, f"a prefix of the cached {len(base)}-position prompt")
                 for n in bounds.get("prefix_pages", []) for d in (-1, 0, 1)]
    for tokens, source, what in boundary:
        m = len(tokens)
        cond = f"a {m}-position prompt ({_page_relation(m, ps)}), {what}"
        want = min(m - 1, len(source)) // ps * ps  # the longest cached page boundary short of the whole prompt
        err, hit = _prefill_against_full(ctx, cached, plain, tokens, cond, want=want)
        worst, hits = max(worst, err), hits + hit
    ctx.metric("max_rel_err", worst, better="lower")
    ctx.metric("hits", hits, better="higher")
    problems = cached.leaks()
    cached.clear_prefix_cache()
    leaked = len(problems["pages"]) + len(problems["prefix"]) + cached.usage()["pages_used"]
    ctx.metric("leaked_pages", leaked, better="lower")
    ctx.check(not leaked, f"pages or references left after clearing the cache: {problems}",
              file=PREFIX, symbol="PrefixCache")
    _check_mixed_traffic(ctx, model, gen, ps, int(p.get("ring", 64)))  # ~0.2 s on CPU (18 short requests)
    if ctx.failed:  # the benchmark's accounting means something only on an engine whose reuse is right
        ctx.finding("the prefix benchmark's accounting was not checked: the engine's prefix reuse failed above",
                    file="target_stack/bench/prefix.py", symbol="run")
    else:
        _check_prefix_bench(ctx, gen)  # ~0.15 s on CPU (the benchmark's own code, 2 conversations x 3 turns)


def _near_tie(model: HybridModel, prompt: list[int], image: torch.Tensor | None, tokens: list[int], i: int,
              a: int, b: int, tol: float) -> bool:
    """Whether tokens ``a`` and ``b`` are within ``tol`` (relative to the largest logit) of each other in a full
    recompute of ``prompt + tokens[:i]`` (``image``: the prompt's image embeddings [patches, dim]): a greedy
    choice that rounding may flip, not a different answer."""
    x = torch.tensor([prompt + tokens[:i]], device=model.embed.device)
    logits = model(x, prefix=None if image is None else image[None])[0, -1].float()
    return bool((logits[a] - logits[b]).abs() <= tol * logits.abs().max())


def _cached_prefix_of(q: list[int], tokens: list[int], ps: int, ring: int) -> bool:
    """Whether ``tokens`` must hit a cache that holds the prompt ``q``: q's last full page boundary is within
    its ring (KDA states rebuildable there), starts ``tokens`` and leaves at least one token to prefill."""
    full = len(q) // ps * ps
    return ps <= full < len(tokens) and full >= len(q) - ring and tokens[:full] == q[:full]


def _check_mixed_traffic(ctx: ProbeContext, model: HybridModel, gen: torch.Generator, ps: int, ring: int) -> None:
    """The prefix cache never changes an answer: a realistic sequence of requests, one at a time, on an engine with
    the cache gives the greedy tokens of the same engine without it.  Image prompts and text-only prompts share
    token prefixes in both orders (image first, then the same tokens as text and a text extension of them; text
    first, then the same tokens with an image, then a text extension), and a conversation resends its history
    (shared-prefix text turns, which must hit).  A difference on a text-only request whose tokens an image prompt
    sent before is bound to the engine (what it enters in the cache); on an image prompt, to the scheduler when it
    matched the cache (image positions are not tokens), else to the engine; on text alone, to the cache.  A first
    difference where a full recompute puts the two tokens within ``mixed_tie_tol`` is a near tie, not a failure."""
    from target_stack.model.image import load_image

    n, tol = int(ctx.params.get("mixed_max_tokens", 3)), float(ctx.params.get("mixed_tie_tol", 1e-3))
    vocab, patch = model.cfg.vocab, model.cfg.patch
    draw = lambda k: torch.randint(0, vocab, (k,), generator=gen).tolist()  # noqa: E731
    image = lambda: torch.rand(3, 2 * patch, 2 * patch, generator=gen)  # noqa: E731
    cached = LLMEngine(model, device=ctx.device, page_size=ps, prefix_cache=True, prefix_ring=ring)
    plain = LLMEngine(model, device=ctx.device, page_size=ps)
    a, b, c = draw(2 * ps + 5), draw(2 * ps + 3), draw(ps + 7)
    img_a, img_b = image(), image()
    # (tokens, image, what); None tokens: the conversation's next turn, built from the uncached engine's answer
    steps = [(a, img_a, "an image prompt whose tokens were not sent before"),
             (a, None, "text-only, the tokens of the image prompt sent before it"),
             (a + draw(ps), None, "text-only, the tokens of an earlier image prompt extended by a page"),
             (b, None, "text-only, new tokens"),
             (b, img_b, "an image prompt with the tokens of a text-only prompt sent before it"),
             (b + draw(3), None, "text-only, extending a text-only prompt later resent with an image"),
             (c, None, "a conversation's first turn (text-only)"),
             (None, None, "a conversation's second turn, its history resent (text-only)"),
             (None, None, "a conversation's third turn, its history resent (text-only)")]
    sent_text: list[list[int]] = []
    sent_image: list[tuple[list[int], bool]] = []  # (tokens, whether the request grew the cache)
    last, mismatches, ties = None, 0, 0
    for k, (tokens, img, what) in enumerate(steps):
        if tokens is None:
            tokens = last[0] + last[1] + draw(5)
        stats = dict(cached.prefix.stats)
        params = SamplingParams(max_tokens=n)
        out = cached.generate([tokens], params, images=[img])[0]
        ref = plain.generate([tokens], params, images=[img])[0]
        last = (tokens, ref.tokens)
        hit = cached.prefix.stats["hits"] > stats["hits"]
        grew = cached.prefix.stats["inserted"] > stats["inserted"]
        cond = f"request {k + 1} of {len(steps)} in a mixed sequence: {what}; {len(tokens)} tokens " \
               f"({_page_relation(len(tokens), ps)}){', with an image' if img is not None else ''}"
        if img is None and any(_cached_prefix_of(q, tokens, ps, ring) for q in sent_text):
            ctx.check(hit, "a text-only prompt whose page-aligned prefix was sent before as text did not reuse it",
                      file=PREFIX, symbol="PrefixCache.match", condition=cond)
        (sent_text if img is None else sent_image).append(tokens if img is None else (tokens, grew))
        if (out.tokens, out.finish_reason) == (ref.tokens, ref.finish_reason):
            continue
        i = next((j for j, (x, y) in enumerate(zip(out.tokens, ref.tokens)) if x != y), None)
        if i is not None:
            emb = None if img is None else model.image_encoder(
                load_image(img, patch, model.cfg.max_image_side).to(model.embed.device, model.embed.dtype))
            if _near_tie(model, tokens, emb, ref.tokens, i, ref.tokens[i], out.tokens[i], tol):
                ties += 1
                continue
        mismatches += 1
        msg = (f"{out.tokens} ({out.finish_reason}) with the prefix cache, {ref.tokens} ({ref.finish_reason}) "
               f"without{' (a prefix hit)' if hit else ''}")
        by_image = [g for q, g in sent_image if q[:ps] == tokens[:ps]]  # (text-only requests)
        if img is not None:
            where = (dict(file=SCHEDULER, symbol="Scheduler.schedule (prefix match)") if hit
                     else dict(file=ENGINE, symbol="LLMEngine.step (prefix cache)"))
        elif by_image:
            where = dict(file=ENGINE, symbol="LLMEngine.step (what enters the prefix cache)")
            msg += "; an image prompt with the same leading tokens came before" + \
                (" and entered the prefix cache" if any(by_image) else "")
        else:
            where = dict(file=PREFIX, symbol="PrefixCache.insert / match")
        ctx.fail(f"the prefix cache changed an answer: {msg}", condition=cond, **where)
    ctx.metric("mixed_mismatches", mismatches, better="lower")
    ctx.metric("mixed_near_ties", ties)
    problems = cached.leaks()
    cached.clear_prefix_cache()
    ctx.check(not any(problems.values()) and not cached.usage()["pages_used"],
              f"pages or references left after the mixed sequence and clearing the cache: {problems}, "
              f"{cached.usage()['pages_used']} pages in use", file=PREFIX, symbol="PrefixCache",
              condition="image and text-only prompts sharing tokens")


def _check_prefix_bench(ctx: ProbeContext, gen: torch.Generator) -> None:
    """The prefix benchmark's per-turn figures (``target_stack.bench.prefix.run``, its own code, the tiny preset on
    the CPU, a fresh seed) agree with an independent accounting of the same run, read from the engines' own
    ``prefill.start`` events (each prefill's prompt positions and reused positions): per turn, the reused share is
    the turn's reused positions over its prompt positions (so in [0, 1]) and the prompt p50 is its prompts'
    median; the turns' reused positions sum to the cached engine's total reuse counter (``prefix_stats``)."""
    import io
    import json
    import pathlib
    from unittest import mock

    from rich.console import Console

    from target_stack.bench import prefix as bench_prefix
    from target_stack.events import EVENTS_VAR

    bench = "target_stack/bench/prefix.py"
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    spec = f"{ctx.params.get('bench', 'conversations=2,turns=3,first=24-40,user=4-12,output=2')},seed={seed}"
    conv = bench_prefix.Conversations.parse(spec)
    where = dict(file=bench, symbol="run", condition=f"the prefix benchmark on {spec}, tiny preset, CPU")
    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as tmp:
        events_path, out_path = os.path.join(tmp, "events.jsonl"), pathlib.Path(tmp, "result.json")
        try:
            with mock.patch.dict(os.environ, {EVENTS_VAR: events_path}):
                rc = bench_prefix.run("tiny", spec, out_path, Console(file=io.StringIO()), device="cpu")
            result = json.loads(out_path.read_text())
            prefills = [e for e in load_events(events_path) if e.get("event") == "prefill.start"]
        except Exception as exc:  # noqa: BLE001 - the benchmark's failure is this check's finding, not the probe's end
            from target_stack.probes.reference import culprit, raised_message

            file, symbol = culprit(exc, ctx.tree) or (bench, "run")
            ctx.fail(f"the prefix benchmark {raised_message(exc)}", **dict(where, file=file, symbol=symbol))
            return
    ctx.check(rc == 0, f"the prefix benchmark reported leaks: {result.get('leaks')}, "
              f"{result.get('pages_used_after_clear')} pages in use after clearing", **where)
    rows, per = result.get("turns", []), 2 * conv.conversations  # each turn: every conversation on both engines
    if not ctx.check(len(rows) == conv.turns and len(prefills) >= conv.turns * per,
                     f"{len(rows)} turns reported and {len(prefills)} prefills run for {conv.turns} turns of "
                     f"{conv.conversations} conversations on two engines", **where):
        return
    turns = [prefills[len(prefills) - (conv.turns - t) * per:][:per] for t in range(conv.turns)]
    total_reused = 0
    for t, (row, evs) in enumerate(zip(rows, turns, strict=True)):
        positions = sum(e["tokens"] for e in evs) / 2  # both engines take the same prompts
        reused = sum(e.get("reused", 0) for e in evs)  # the uncached engine reuses nothing
        total_reused += reused
        cond = dict(where, condition=f"turn {t + 1} of {conv.turns} ({conv.conversations} conversations, "
                    f"{positions:.0f} prompt positions, {reused} reused by the prefills), {spec}")
        share = row["reused_share"]
        ctx.check(0.0 <= share <= 1.0 and abs(share - reused / positions) <= 1e-9,
                  f"turn {row['turn']} reports a reused share of {share:.4f}; its prefills reused {reused} of "
                  f"{positions:.0f} prompt positions ({reused / positions:.4f})", **cond)
        p50 = statistics.median(e["tokens"] for e in evs)
        ctx.check(row["prompt_p50"] == p50, f"turn {row['turn']} reports a prompt p50 of {row['prompt_p50']}; "
                  f"its prompts' median is {p50}", **cond)
    counter, everything = result.get("prefix_stats", {}).get("reused_tokens"), sum(e.get("reused", 0) for e in prefills)
    ctx.check(counter == everything, f"the run's prefills reused {everything} positions in all; the cached "
              f"engine's counter says {counter}", **where)
    reported = sum(r["reused_share"] * sum(e["tokens"] for e in evs) / 2 for r, evs in zip(rows, turns, strict=True))
    ctx.check(abs(reported - total_reused) <= 1e-6 * max(1, total_reused),
              f"the reported per-turn reuse sums to {reported:.1f} positions, the engine reused {total_reused}",
              **where)


def _page_relation(m: int, ps: int) -> str:
    d = (m + ps // 2) % ps - ps // 2  # signed distance to the nearest page multiple
    return f"{'at' if d == 0 else 'one below' if d == -1 else 'one past' if d == 1 else f'{d:+d} from'} " \
           f"a multiple of the page size {ps}"


def _prefill_against_full(ctx: ProbeContext, cached: LLMEngine, plain: LLMEngine, tokens: list[int], cond: str,
                          want: int | None = None) -> tuple[float, bool]:
    """The prefill of ``tokens`` the prefix-cached engine schedules against the uncached engine's full prefill
    (neither enters the cache: both are cancelled before their step).  ``want``: the positions the hit must reuse.
    Returns (relative error, whether it reused a cached prefix)."""
    from target_stack.ops.kda.testing import rel_err

    logits, reused, ok = {}, 0, True
    for name, engine in (("cached", cached), ("plain", plain)):
        engine.add_request(tokens, SamplingParams(max_tokens=1))
        seq = engine.scheduler.schedule().prefill[0]
        if name == "cached":
            reused = seq.reused
            ok = ctx.check(reused < len(tokens), f"the prefix hit covers {reused} positions of a {len(tokens)}-"
                           "position prompt: nothing is left to prefill (no logits for its first token)",
                           file=PREFIX, symbol="PrefixCache.match", condition=cond)
            if ok and want is not None:
                ok = ctx.check(reused == want, f"the prefix hit reuses {reused} positions; the longest cached page-"
                               f"aligned prefix that leaves a token to prefill has {want}", file=PREFIX,
                               symbol="PrefixCache.match", condition=cond)
        try:
            logits[name] = engine.runner.prefill_from(seq)[0]
        except Exception as e:  # noqa: BLE001 - reported, and the next case still runs
            if name == "plain" or ok:  # a prefill from a hit already reported wrong is that hit's failure
                ctx.fail(f"the {name} engine's prefill raised {type(e).__name__}: {e}", file=RUNNER,
                         symbol="ModelRunner.prefill_from", condition=cond)
        engine.cancel(seq.id)
        engine.step()
    if len(logits) < 2:
        return 0.0, bool(reused)
    err = rel_err(logits["cached"], logits["plain"])
    ctx.check(err <= ctx.params["max_rel_err"], f"a prefill from the cached prefix differs from a full prefill: "
              f"rel. err. {err:.2e}", file=RUNNER, symbol="ModelRunner.prefill_from",
              condition=f"{cond}, {reused} positions reused")
    return err, bool(reused)


def _same_outputs(ctx: ProbeContext, engine: LLMEngine, other: LLMEngine, prompts: list[list[int]],
                  params: SamplingParams, what: str) -> None:
    """``engine``'s outputs for ``prompts`` (one batch, none of them cached yet) are ``other``'s (the same engine
    without a prefix cache), token for token, with the same finish: what differs is their recording."""
    outs, refs = engine.generate(prompts, params), other.generate(prompts, params)
    for prompt, out, ref in zip(prompts, outs, refs, strict=True):
        ctx.check((out.tokens, out.finish_reason) == (ref.tokens, ref.finish_reason),
                  f"{out.tokens} ({out.finish_reason}) with the prefix cache, {ref.tokens} ({ref.finish_reason}) "
                  "without", file=PREFIX, symbol="PrefixCache.insert",
                  condition=f"a {len(prompt)}-position prompt ({_page_relation(len(prompt), engine.page_size)}), "
                  f"{what}")


_SAMPLED_CHILD = """
import time
from target_stack.events import emit
emit("exit_check.start")
time.sleep(0.15)  # the sampler writes a few batches of ticks
emit("exit_check.main_end")
"""


def _check_sampled_process_exits(ctx: ProbeContext) -> None:
    """A process that writes events with the GIL sampler on (as every disaggregated worker does) ends when its
    main code ends: whatever the event machinery starts must not keep the interpreter alive (a worker or a probe
    that hangs at shutdown).  Run in a short child (this tree's ``target_stack``): it must exit within
    ``exit_grace_s`` of its last statement, cleanly, with its sampler's ticks written."""
    import subprocess
    import sys
    import time

    import target_stack.events as events_mod

    p = ctx.params
    grace, start_s = float(p.get("exit_grace_s", 3.0)), float(p.get("exit_start_s", 30.0))
    root = os.path.dirname(os.path.dirname(os.path.abspath(events_mod.__file__)))
    where = dict(file=EVENTS, symbol="emit / _start_sampler",
                 condition=f"a child process writing events with {SAMPLE_VAR} set, after its main code ends")
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    env = {**os.environ, "INFRA_AGENT_EVENTS": path, SAMPLE_VAR: str(p.get("gil_sample_s", 5e-4)),
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}

    def read() -> list[dict]:  # polled while the child runs: not exported as a trace each time
        return load_events(path)

    proc = subprocess.Popen([sys.executable, "-c", _SAMPLED_CHILD], cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        t0, ended = time.monotonic(), None
        while proc.poll() is None:
            now = time.monotonic()
            if ended is None and any(e.get("event") == "exit_check.main_end" for e in read()):
                ended = now
            if (ended is not None and now - ended > grace) or (ended is None and now - t0 > start_s):
                break
            time.sleep(0.02)
        hung = proc.poll() is None
        if hung:
            proc.kill()
        _, err = proc.communicate(timeout=30)
        evs = read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(path)
    main_end = any(e.get("event") == "exit_check.main_end" for e in evs)
    if hung:
        ctx.fail(f"a process writing events with {SAMPLE_VAR} set did not exit: still alive "
                 + (f"{grace:g} s after its main code ended (a thread the event machinery started keeps the "
                    "interpreter alive: not a daemon?)" if main_end else f"{start_s:g} s after it started, its main "
                    "code unfinished (an emit that blocks?)"), **where)
        return
    tail = (err or "").strip().splitlines()[-3:]
    ctx.check(proc.returncode == 0 and "Exception in thread" not in (err or ""),
              f"a process writing events with {SAMPLE_VAR} set ended with status {proc.returncode}: "
              f"{' | '.join(tail)[:300]}", **where)
    ticks = [e for e in evs if e.get("event") == "gil.ticks"]
    ctx.check(main_end and bool(ticks), f"the event stream of a sampled process lacks "
              f"{'its own events' if not main_end else 'the GIL sampler ticks'} ({len(evs)} events)", **where)
    faults = sampler_faults(evs)
    ctx.check(not faults, f"the GIL sampler's ticks are not each written once, in order: {faults[0] if faults else ''}",
              **where)


@probe(kind="events")
def kv_transfer_events(ctx: ProbeContext) -> None:
    """The disaggregated prefill worker's events: how long each Layer Split stage waited between
    submission and completion, against how long the native MoE dispatch calls ran.  A transfer
    thread starved by a call that holds the GIL waits as long as the call.  First, a process with the
    sampler on must exit when its main code ends (``_check_sampled_process_exits``)."""
    from target_stack.bench.serve import Workload, _pct
    from target_stack.engine.disagg import DisaggCluster

    _check_sampled_process_exits(ctx)
    p = ctx.params
    workload = Workload.parse(p["workload"])
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    os.environ["INFRA_AGENT_EVENTS"] = path  # inherited by the spawned workers
    os.environ[SAMPLE_VAR] = str(p.get("gil_sample_s", 5e-4))  # and a GIL sampler in each of them
    model_cfg = {"preset": "tiny", **p.get("model", {})}
    cfg = dataclasses.replace(PRESETS["tiny"], **p.get("model", {}))  # the workers' config, no model built
    try:
        requests, arrivals = workload.build(cfg.vocab, cfg.patch)
        with DisaggCluster(model_cfg, stages=p.get("stages", 2), copy=p.get("copy", "gather"),
                           page_size=p.get("page_size", 16), num_pages=p.get("num_pages", 512),
                           decode=p.get("decode", True)) as cluster:
            result = cluster.run(requests, arrivals)
            pools = cluster.close()
        events = read_events(path)
    finally:
        os.environ.pop("INFRA_AGENT_EVENTS", None)
        os.environ.pop(SAMPLE_VAR, None)
        os.unlink(path)
    errors = [str(o) for o in result.outputs if isinstance(o, Exception)]
    ctx.check(not errors, f"{len(errors)} request(s) failed: {errors[:1]}", file=DISAGG_WORKERS)
    stage_events = [e for e in events if e["event"].startswith("kv_transfer.")
                    and not str(e.get("id", "")).endswith(("reserve", "ready", "abort"))]
    stages = [1e3 * secs for _, secs in spans(stage_events, ".submit", ".done")]
    dispatch = [1e3 * secs for name, secs in spans(events, ".enter", ".exit", key="tokens") if name == "dispatch"]
    if not stages or not dispatch:
        ctx.fail(f"events missing: {len(stages)} stage transfers, {len(dispatch)} dispatch calls",
                 file=DISAGG_TRANSFER, symbol="TransferEngine")
        return
    worst = max(stages)
    moe_layers = cfg.layers - 1  # every layer after the first has a MoE FFN
    served = len(requests) - len(errors)
    per_layer = sum(dispatch) / max(1, served * moe_layers)  # native time of one MoE layer of one prefill
    ctx.metric("stage_transfer_ms_p50", statistics.median(stages), "ms", better="lower")
    ctx.metric("stage_transfer_ms_max", worst, "ms", better="lower")
    ctx.metric("native_ms_per_moe_layer", per_layer, "ms")
    # the 90th percentile, not the max: starved, nearly every stage waits out a whole native call;
    # one stage that met a busy moment of the machine should not decide the verdict
    p90 = _pct(stages, 0.9)
    ratio = p90 / per_layer
    ctx.metric("stage_transfer_ms_p90", p90, "ms", better="lower")
    ctx.metric("transfer_stall_ratio", ratio, better="lower")
    # the cause, read directly: how much of each native call the prefill worker's GIL sampler sat out.
    # Unlike the stage waits it does not depend on whether a stage happened to be in flight
    faults = sampler_faults(events)
    ctx.check(not faults, f"the GIL sampler's ticks are not each written once, in order: {faults[0] if faults else ''}",
              file=EVENTS)
    blocked = gil_blocked(events)
    ctx.check(bool(blocked), "the prefill worker's GIL sampler observed none of the native calls", file=DISAGG_WORKERS)
    if blocked:
        frac = statistics.median(blocked)
        ctx.metric("gil_blocked_fraction", frac, better="lower")
        ctx.check(frac <= p.get("max_gil_blocked", 0.5),
                  f"the native MoE dispatch keeps the GIL: no other Python thread ran during {frac:.0%} of a "
                  f"call (median of {len(blocked)}), so the KV-transfer thread waits for it",
                  file=NATIVE, symbol="library / ts_moe_dispatch_combine", condition="disaggregated prefill")
    ctx.check(ratio <= p["max_stall_ratio"],
              f"KV-transfer stages waited {p90:.1f} ms (p90), {ratio:.2f}x the native MoE time of a layer "
              f"({per_layer:.1f} ms): the transfer thread does not run beside the native dispatch "
              "(a call that holds the GIL?)",
              file=NATIVE, symbol="library / ts_moe_dispatch_combine", condition="disaggregated prefill")
    leaked = {w: s for w, s in pools.items() if any(s.values())}
    ctx.check(not leaked, f"pages or slots leaked by the workers: {leaked}", file=DISAGG_WORKERS)


TAIL_SAMPLES = 100  # the samples a p99 needs to be more than the largest value seen
SERVE = "target_stack/bench/serve.py"


def _nearest_rank(xs: list[float], q: float) -> float:
    """The percentile the serving benchmark documents (``bench/serve.py``'s ``_pct``): the sorted sample nearest
    the linear position q·(n−1), a half rounded up; NaN for no sample.  Written here from that definition: the
    index at the smallest distance to the position, the larger of two at equal ones."""
    if not xs:
        return float("nan")
    pos, ordered = q * (len(xs) - 1), sorted(xs)
    return ordered[min(range(len(xs)), key=lambda i: (abs(i - pos), -i))]


def _pct_ties(n: int, q: float) -> bool:
    """Whether q·(n−1) is within rounding of a half for a q other than 0.5 (either neighbour is then right)."""
    frac = (q * (n - 1)) % 1.0
    return q != 0.5 and abs(frac - 0.5) < 1e-9


def _check_serve_statistics(ctx: ProbeContext, gen: torch.Generator) -> None:
    """The serving benchmark's statistics against an independent computation on fresh samples (microseconds):
    ``_pct`` for every sample count 1..``pct_counts`` and a few longer runs (odd and even counts, p99 of short runs,
    shuffled), q in ``pct_qs``, against ``_nearest_rank``; ``_latency_stats`` (TTFT and TPOT p50/p99 in ms, output
    throughput = tokens / makespan, the request count) against the same definitions with ``statistics``."""
    from target_stack.bench import serve as bench_serve

    p = ctx.params
    qs = [float(q) for q in p.get("pct_qs", [0.5, 0.9, 0.99])]
    counts = list(range(1, int(p.get("pct_counts", 40)) + 1)) + [int(n) for n in p.get("pct_long", [64, 99, 100, 101])]
    bad = 0
    for n in counts:
        xs = (torch.rand(n, generator=gen, dtype=torch.float64) * 100).tolist()
        for q in qs:
            got, want = bench_serve._pct(list(xs), q), _nearest_rank(xs, q)
            if got == want or _pct_ties(n, q) and got in sorted(xs)[int(q * (n - 1)):int(q * (n - 1)) + 2]:
                continue
            bad += 1
            if bad <= 3:
                rank = sorted(xs).index(got) if got in xs else None
                ctx.fail(f"the p{100 * q:g} of {n} samples is {got:.6g} (sorted index {rank}); nearest rank on the "
                         f"position q(n-1) = {q * (n - 1):.4g} gives {want:.6g} (index "
                         f"{sorted(xs).index(want)})", file=SERVE, symbol="_pct",
                         condition=f"{n} samples ({'odd' if n % 2 else 'even'} count), q={q}")
    ctx.metric("pct_mismatches", bad, better="lower")
    ctx.check(math.isnan(bench_serve._pct([], 0.5)), "the percentile of no sample is not NaN", file=SERVE,
              symbol="_pct", condition="no samples")
    for n in (1, 2, 5, 6, 31):
        ttft = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.01).tolist()
        tpot = (torch.rand(max(1, n - 1), generator=gen, dtype=torch.float64) * 0.1 + 1e-3).tolist()
        tokens, makespan = int(torch.randint(n, 50 * n, (1,), generator=gen)), float(sum(ttft))
        got = bench_serve._latency_stats(list(ttft), list(tpot), tokens, makespan)
        want = {"ttft_ms_p50": 1e3 * _nearest_rank(ttft, 0.5), "ttft_ms_p99": 1e3 * _nearest_rank(ttft, 0.99),
                "tpot_ms_p50": 1e3 * _nearest_rank(tpot, 0.5), "tpot_ms_p99": 1e3 * _nearest_rank(tpot, 0.99),
                "throughput_tok_s": tokens / makespan, "requests": n}
        for key, w in want.items():
            g = got.get(key)
            ctx.check(g is not None and math.isclose(g, w, rel_tol=1e-12), f"{key} is {g}, from the samples {w:.6g}",
                      file=SERVE, symbol="_pct" if "_p" in key else "_latency_stats",
                      condition=f"{n} requests, {len(tpot)} TPOT samples, {tokens} tokens in {makespan:.3f} s")


def _recording_clusters():
    """A context manager: while it is open, ``run_disagg`` builds its clusters from a subclass of
    ``DisaggCluster`` that records every ``run`` (the cluster's ``decode`` flag, the run's ``transfer``, its
    requests, result and wall time) and changes nothing else; yields the list of records."""
    import contextlib
    import inspect
    import time

    import target_stack.engine.disagg as disagg

    @contextlib.contextmanager
    def recording():
        base, records = disagg.DisaggCluster, []
        init_sig, run_sig = inspect.signature(base.__init__), inspect.signature(base.run)

        class Recorded(base):
            def __init__(self, *args, **kwargs):
                bound = init_sig.bind(self, *args, **kwargs)
                bound.apply_defaults()
                self._decode = bound.arguments["decode"]
                super().__init__(*args, **kwargs)

            def run(self, *args, **kwargs):
                bound = run_sig.bind(self, *args, **kwargs)
                bound.apply_defaults()
                t0 = time.monotonic()
                result = super().run(*args, **kwargs)
                records.append({"decode": self._decode, "transfer": bound.arguments["transfer"],
                                "prompts": [q[0] for q in bound.arguments["requests"]], "result": result,
                                "seconds": time.monotonic() - t0})
                return result

        disagg.DisaggCluster = Recorded
        try:
            yield records
        finally:
            disagg.DisaggCluster = base

    return recording()


def _check_serve_run(ctx: ProbeContext, r: dict, records: list[dict], prompts: list[list[int]]) -> None:
    """Every figure ``run_disagg`` reports equals an independent computation from the per-request timings of the
    same run (its clusters' ``run`` results, recorded): per its docstring, over the workload's runs (the warm-ups
    left out), the prefill-only baseline (``decode=False`` cluster, ``transfer=False``), prefill + transfer (the
    same cluster, transfer on) and the full cluster; sums are medians over the repeats; TTFT = first token -
    arrival and TPOT = (done - first token) / (tokens - 1) of the full runs, exposed transfer = transfer done -
    prefill done of the transfer runs, their p50/p99 by ``_nearest_rank``; throughput = one repeat's output tokens
    / the median wall time of the full runs (recorded inside the call: at most a little shorter)."""
    runs = {"prefill": [], "transfer": [], "full": []}
    for rec in records:
        if rec["prompts"] != prompts:
            continue  # a warm-up
        kind = "full" if rec["decode"] else "transfer" if rec["transfer"] else "prefill"
        runs[kind].append(rec)
    where = dict(file=SERVE, symbol="run_disagg", condition=f"the e2e workload {ctx.params['workload']}")
    missing = [k for k, v in runs.items() if not v]
    if not ctx.check(not missing, f"no {', '.join(missing)} run of the workload was seen (the benchmark's runs: "
                     f"{len(records)} recorded)", **where):
        return

    def total(kind: str, end: str) -> float:
        return statistics.median(sum(getattr(t, end) - t.prefill_start for t in rec["result"].timings)
                                 for rec in runs[kind])

    prefill_only = total("prefill", "prefill_done")
    exposed = [t.transfer_done - t.prefill_done for rec in runs["transfer"] for t in rec["result"].timings]
    timings = [t for rec in runs["full"] for t in rec["result"].timings]
    outs = [o for rec in runs["full"] for o in rec["result"].outputs]
    ttft = [t.first_token - t.arrival for t in timings]
    tpot = [(t.done - t.first_token) / (len(o.tokens) - 1) for t, o in zip(timings, outs, strict=True)
            if len(o.tokens) > 1]
    want = {"kv_transfer_overhead": total("transfer", "transfer_done") / prefill_only - 1,
            "overhead_with_decode": total("full", "transfer_done") / prefill_only - 1,
            "exposed_transfer_ms_p50": 1e3 * _nearest_rank(exposed, 0.5),
            "exposed_transfer_ms_p99": 1e3 * _nearest_rank(exposed, 0.99), "exposed_transfer_samples": len(exposed),
            "ttft_ms_p50": 1e3 * _nearest_rank(ttft, 0.5), "ttft_ms_p99": 1e3 * _nearest_rank(ttft, 0.99),
            "tpot_ms_p50": 1e3 * _nearest_rank(tpot, 0.5), "tpot_ms_p99": 1e3 * _nearest_rank(tpot, 0.99),
            "ttft_samples": len(ttft), "requests": len(prompts)}
    for key, w in want.items():
        g, pct = r.get(key), key.endswith(("_p50", "_p99"))
        n = {"exposed": len(exposed), "ttft": len(ttft), "tpot": len(tpot)}[key.split("_")[0]] if pct else None
        ctx.check(g is not None and math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12),
                  f"{key} is {g}; from the run's per-request timings {w:.6g}", file=SERVE,
                  symbol="_pct" if pct else "run_disagg",
                  condition=f"{n} samples ({'odd' if n % 2 else 'even'} count) of the e2e run, "
                  f"{ctx.params['workload']}" if pct else where["condition"])
    tokens = sum(len(o.tokens) for o in runs["full"][0]["result"].outputs)
    inner = statistics.median(rec["seconds"] for rec in runs["full"])
    implied = tokens / r["throughput_tok_s"] if r.get("throughput_tok_s") else math.inf
    ctx.check(inner * (1 - 1e-9) <= implied <= inner * 1.01 + 0.02,
              f"throughput {r.get('throughput_tok_s')} tok/s implies {implied:.4f} s for the {tokens} output tokens "
              f"of one repeat; the full runs took {inner:.4f} s (median)", file=SERVE, symbol="_latency_stats",
              condition=where["condition"])


@probe(kind="e2e")
def serve_e2e(ctx: ProbeContext) -> None:
    """The serving benchmark's disaggregated part on a small workload: TTFT, TPOT, throughput and
    the KV-transfer overhead (prefill + transfer against prefill alone, same workload).  Every figure it
    reports is recomputed from the per-request timings of the same run (``_check_serve_run``), and its
    statistics are checked on fresh samples against their definitions (``_check_serve_statistics``)."""
    from target_stack.bench.serve import Workload, run_disagg
    from target_stack.model.model import PRESETS

    _check_serve_statistics(ctx, fresh_generator())  # a few ms
    workload = Workload.parse(ctx.params["workload"])
    with _recording_clusters() as records:
        r = run_disagg("tiny", workload, ctx.params.get("stages", 2))
    prompts = [q for q, _, _ in workload.build(PRESETS["tiny"].vocab, PRESETS["tiny"].patch)[0]]
    _check_serve_run(ctx, r, records, prompts)
    samples = {"ttft_ms_p99": r["ttft_samples"], "exposed_transfer_ms_p99": r["exposed_transfer_samples"]}
    for key, unit in (("ttft_ms_p50", "ms"), ("ttft_ms_p99", "ms"), ("tpot_ms_p50", "ms"),
                      ("throughput_tok_s", "tok/s"), ("exposed_transfer_ms_p99", "ms")):
        # a p99 of fewer than TAIL_SAMPLES values is the largest of a few: reported, and judged by no verdict
        tail = samples.get(key, TAIL_SAMPLES) < TAIL_SAMPLES
        ctx.metric(key, r[key], unit, better=None if tail else "higher" if key.startswith("throughput") else "lower")
    ctx.metric("kv_transfer_overhead", r["kv_transfer_overhead"], better="lower")
    ctx.metric("overhead_with_decode", r["overhead_with_decode"], better="lower")
    leaked = {w: s for w, s in r["pools"].items() if any(s.values())}
    ctx.check(not leaked, f"pages or slots leaked by the workers: {leaked}", file=DISAGG_WORKERS)
