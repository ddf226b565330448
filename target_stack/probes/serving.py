"""target_stack's serving-path probes against independent references (protected from patches):
the sampler against the exact distribution, the engine's logits against the float64 model,
ReplaySSM against the KDA recurrence, tensor parallelism and the disaggregated cluster.

The engine is observed, never changed: its runner's ``prefill_from`` and ``decode`` are wrapped
to record the logits of every step, which the float64 composition of the layer definitions
(:mod:`target_stack.probes.reference`) recomputes from each sequence's tokens.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time

import torch

import target_stack.ops  # noqa: F401  (runtime choice before triton loads)
from feedback.correctness import rel_err
from feedback.probe import ProbeContext, probe
from target_stack.probes import reference as ref
from target_stack.probes.reference import Checker, Draw, f64, isolated, raised_message

SAMPLER = "target_stack/engine/sampler.py"
RUNNER = "target_stack/engine/runner.py"
PREFIX = "target_stack/engine/prefix.py"
REPLAY = "target_stack/engine/replay_ssm.py"
ENGINE = "target_stack/engine/engine.py"
SEQUENCE = "target_stack/engine/sequence.py"
TP = "target_stack/engine/tp.py"
DISAGG_TRANSFER = "target_stack/engine/disagg/transfer.py"
DISAGG_WORKERS = "target_stack/engine/disagg/workers.py"
DISAGG_MESSAGES = "target_stack/engine/disagg/messages.py"
DISAGG_CLUSTER = "target_stack/engine/disagg/cluster.py"
MARGIN = 1e-4  # as in the model probes: discrete choices closer than this are drawn again

torch.set_num_threads(1)  # small tensors: an OpenMP team costs more than it saves, worst on shared cores


# -- the sampler ------------------------------------------------------------------------------------


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches top_p, renormalised (float64)."""
    if top_p >= 1.0:
        return probs / probs.sum()
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[before < top_p]] = True
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def _case_distribution(logits: torch.Tensor, temperature: float, mass: float) -> tuple[torch.Tensor, float, float]:
    """(exact distribution, top_p, smallest kept probability, or 0 for a nucleus of one token): top_p
    lies midway into the mass of the token that completes ``mass``, so float rounding cannot move
    the nucleus boundary."""
    probs = ref.softmax(f64(logits) / temperature)
    if mass >= 1.0:
        return probs, 1.0, math.inf  # no nucleus boundary to count
    s = probs.sort(descending=True).values
    m = int((s.cumsum(0) < mass).sum()) + 1  # tokens needed to reach the mass
    top_p = (s[:m - 1].sum() + 0.5 * s[m - 1]).item()
    want = nucleus(probs, top_p)
    return want, top_p, (want[want > 0].min()).item() if m > 1 else 0.0


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probabilities (bins of expected count < 5 merged)."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = max(1, len(exp) - 1)
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


@probe(kind="correctness")
def sampler(ctx: ProbeContext) -> None:
    """Temperature and top-p sampling against the exact softmax(logits / T) restricted to the
    nucleus (a chi-square test over thousands of draws, no draw outside the nucleus), the filter's
    renormalised probabilities exactly, greedy rows, and seeded reproducibility.

    All cases share one batch: one sequence (own logits, parameters and seeded generator) per row,
    one ``sample`` call per draw, so a row mixed up with another, or a generator reseeded per step,
    shows too.  The p-value threshold makes a false alarm a one-in-a-million event.  Unseeded
    requests draw from fresh entropy: no two of them return the same completion, in one batch or two,
    through ``sample`` or two engines (a false alarm: < 1e-18).
    """
    from target_stack.engine.sampler import sample, top_p_filter
    from target_stack.engine.sequence import SamplingParams, Sequence

    p = ctx.params
    draw = Draw(ctx.device)
    V, n = p.get("vocab", 24), p.get("draws", 3000)
    cases = p["cases"]  # {temperature, mass}: top_p set so the nucleus is the tokens reaching that mass
    for _ in range(20):  # logits whose smallest kept token is likely enough to be counted
        logits = draw.randn(len(cases) + 1, V) * p.get("logit_scale", 2.0)
        dists = [_case_distribution(logits[i], c["temperature"], c["mass"]) for i, c in enumerate(cases)]
        if min(d[2] for d in dists) * n >= p.get("min_expected", 40):
            break
    chk = Checker(ctx, p.get("tolerance", 1e-6))
    where = dict(file=SAMPLER, symbol="top_p_filter")
    with chk.guard(**where):
        for (want, top_p, _), c, row in zip(dists, cases, logits):
            probs = ref.softmax(f64(row) / c["temperature"]).float().to(ctx.device)
            chk.compare(top_p_filter(probs[None], top_p)[0], want, f"nucleus of top_p={top_p:.3f}",
                        **where, condition=f"top_p={top_p:.3f}")
    seeds = [int(s) for s in draw.randint(2**31 - 1, (len(cases),))]
    seqs = [Sequence(prompt=[0], params=SamplingParams(temperature=c["temperature"], top_p=top, seed=s))
            for c, (_, top, _), s in zip(cases, dists, seeds)]
    seqs.append(Sequence(prompt=[0], params=SamplingParams()))  # greedy
    counts = torch.zeros(len(cases), V, dtype=torch.float64)
    first: list[list[int]] = []
    greedy_ok = True
    where = dict(file=SAMPLER, symbol="sample")
    with chk.guard(**where):
        for _ in range(n):
            tokens = sample(logits, seqs)
            first.append(tokens)
            for i, t in enumerate(tokens[:-1]):
                counts[i, t] += 1
            greedy_ok &= tokens[-1] == int(logits[-1].argmax())
        ctx.check(greedy_ok, "a temperature-0 row did not take the argmax", **where, condition="temperature=0")
        worst_p, outside = 1.0, 0
        for i, ((want, top_p, _), c) in enumerate(zip(dists, cases)):
            cond = f"temperature={c['temperature']}, top_p={top_p:.3f}, {n} draws"
            out = int(counts[i][want == 0].sum())
            outside += out
            ctx.check(out == 0, f"{out} draws outside the top-p nucleus", **where, condition=cond)
            pv = chi_square_p_value(counts[i], want)
            worst_p = min(worst_p, pv)
            tv = 0.5 * (counts[i] / n - want).abs().sum().item()
            ctx.check(pv >= p.get("min_p_value", 1e-6), f"draws do not follow softmax(logits / T) on the nucleus: "
                      f"chi-square p = {pv:.1e}, total variation {tv:.3f}", **where, condition=cond)
        ctx.metric("min_p_value", worst_p, better="higher")
        ctx.metric("draws_outside_nucleus", outside, better="lower")
        again = [Sequence(prompt=[0], params=s.params) for s in seqs[:-1]]
        replay = [sample(logits[:-1], again) for _ in range(p.get("replay", 50))]
        ctx.check(replay == [t[:-1] for t in first[:len(replay)]], "the same seed did not give the same draws",
                  **where, condition="seeded sequences")
    with chk.guard(**where):
        _check_unseeded(ctx, p)
    with chk.guard(file=ENGINE, symbol="LLMEngine.generate (sampled requests)"):
        _check_unseeded_engine(ctx, p)
    chk.report()


def _distinct(completions: list[tuple[int, ...]]) -> tuple[int, int]:
    """(pairs of equal completions, pairs in all)."""
    n = len(completions)
    same = sum(completions[i] == completions[j] for i in range(n) for j in range(i + 1, n))
    return same, n * (n - 1) // 2


def _check_unseeded(ctx: ProbeContext, p: dict) -> None:
    """Unseeded sampled requests draw from fresh entropy: no two of them (in one batch, in two batches, in
    two engines) return the same completion of the same prompt; seeded ones repeat theirs.

    ``sample`` itself: ``unseeded_requests`` fresh sequences per batch, two batches, ``unseeded_steps``
    draws each from uniform logits over ``vocab`` tokens (temperature 1).  Two independent completions
    are equal with probability V**-L = 24**-16 = 8e-23; some pair of the 8 with at most 28 times that,
    2.3e-21: a false alarm never happens.  The engine: two engines on one tiny model, three requests each
    of one prompt at temperature ``unseeded_engine_temperature`` (1000): with the model's logits within
    +-10 every token of its 256 has probability at most e**0.02 / 256 < 1/250 at each step, so two 8-token
    completions agree with probability < 250**-8 = 6.6e-20, some pair of the 6 with < 1e-18."""
    from target_stack.engine.sampler import sample
    from target_stack.engine.sequence import SamplingParams, Sequence

    V, L, K = p.get("vocab", 24), p.get("unseeded_steps", 16), p.get("unseeded_requests", 4)
    logits = torch.zeros(K, V, device=ctx.device)
    completions = []
    for _ in range(2):  # two batches of fresh requests: two runs of a server
        seqs = [Sequence(prompt=[0], params=SamplingParams(temperature=1.0)) for _ in range(K)]
        steps = [sample(logits, seqs) for _ in range(L)]
        completions += [tuple(col) for col in zip(*steps)]
    same, pairs = _distinct(completions)
    ctx.metric("unseeded_equal_pairs", same, better="lower")
    ctx.check(same == 0, f"{same} of {pairs} pairs of unseeded sampled requests drew the same {L} tokens from "
              f"a uniform distribution over {V} (chance {pairs} * {V}**-{L}): unseeded generators are not "
              "seeded from fresh entropy", file=SAMPLER, symbol="sample (an unseeded request's generator)",
              condition=f"{K} requests per batch, two batches, temperature 1, seed None")


def _check_unseeded_engine(ctx: ProbeContext, p: dict) -> None:
    """The same through the engine: each request its own entropy when unseeded, its seed when seeded."""
    from target_stack.engine import LLMEngine, SamplingParams
    from target_stack.model.model import HybridModel, ModelConfig

    draw = Draw(ctx.device)
    model = HybridModel(ModelConfig(seed=int(draw.randint(2**31 - 1, (1,))), layers=p.get("engine_layers", 2)))
    prompt = draw.randint(model.cfg.vocab, (5,)).tolist()
    T, n, k = p.get("unseeded_engine_temperature", 1000.0), p.get("unseeded_engine_tokens", 8), 3
    seed = int(draw.randint(2**31 - 1, (1,)))
    unseeded, seeded = [], []
    for _ in range(2):
        engine = LLMEngine(model, device=ctx.device, num_pages=16, max_model_len=64, cuda_graphs=False)
        outs = engine.generate([prompt] * (2 * k), [SamplingParams(max_tokens=n, temperature=T)] * k
                               + [SamplingParams(max_tokens=n, temperature=T, seed=seed)] * k)
        unseeded += [tuple(o.tokens) for o in outs[:k]]
        seeded += [tuple(o.tokens) for o in outs[k:]]
    default_seed = SamplingParams().seed
    where = (dict(file=SEQUENCE, symbol="SamplingParams.seed") if default_seed is not None
             else dict(file=ENGINE, symbol="LLMEngine.add_request / step (the requests' sampling)"))
    same, pairs = _distinct(unseeded)
    ctx.check(same == 0, f"{same} of {pairs} pairs of unseeded requests of one prompt returned the same {n} tokens "
              f"at temperature {T:g} (chance < 1e-18)" + (f"; SamplingParams' default seed is {default_seed}"
                                                         if default_seed is not None else ""),
              **where, condition=f"{k} requests in each of two engines, seed None")
    ctx.check(len(set(seeded)) == 1, f"requests of one prompt and one seed returned different tokens: {seeded}",
              **where, condition=f"{k} requests in each of two engines, seed {seed}")


# -- the engine against the float64 model ----------------------------------------------------------


def _blame(model, tokens: list[int], at: list[int], got: torch.Tensor, want: torch.Tensor, bound: float,
           tolerance: float, diagnosed: set) -> list[tuple[str, str, float]]:
    """The model components off on the input of an engine step that is off: the sequence up to the
    first such step's position (a carried state is judged at the length the engine carried it), then
    the whole sequence.  ``at``: each step's position among ``tokens``.  A prefix diagnosed before
    (``diagnosed``, updated) is not diagnosed again: what was clean there stays clean; at most
    ``DIAGNOSES`` per configuration (a runner defect makes every step off, on clean components)."""
    first = next((q for q, g, w in zip(at, got, want) if not rel_err(g, w) <= bound), None)
    for end in dict.fromkeys(([first + 1] if first is not None and first >= 1 else []) + [len(tokens)]):
        key = tuple(tokens[:end])
        if key in diagnosed or len(diagnosed) >= DIAGNOSES:
            continue
        diagnosed.add(key)
        found = _components_off(model, list(key), tolerance)
        if found:
            return found
    return []


def _components_off(model, tokens: list[int], tolerance: float) -> list[tuple[str, str, float]]:
    """The model components the runner uses (norms, mixers, FFNs, embedding) that depart from their
    definitions; the runner wires the blocks itself, so Block.forward and HybridModel.forward are not
    among them."""
    return [(f, s, e) for f, s, e in ref.diagnose(model, tokens, tolerance, MARGIN, carried=True)
            if not s.startswith(("Block.forward", "HybridModel.forward"))]


def _positions(seq) -> int:
    """A sequence's prompt positions counted here, from what the request carried: its tokens and the image
    patches spliced in front of them."""
    return len(seq.prompt) + (0 if seq.prompt_embeds is None else int(seq.prompt_embeds.shape[0]))


def _record(runner, faults: dict[str, str]) -> list[tuple[int, int, str, torch.Tensor, int | None]]:
    """Wrap the runner's prefill and decode to record (sequence id, position, phase, logits, the first
    position of the sequence computed from KV the engine had stored: None for a prefill from scratch).

    Positions are counted here (prompt tokens, image patches, outputs), not read from the sequence's own
    bookkeeping, which is under test too: where ``Sequence.num_prompt`` or ``Sequence.length`` disagree
    with the count, the first disagreement of each lands in ``faults`` (symbol -> message)."""
    records: list[tuple[int, int, str, torch.Tensor, int | None]] = []
    prefill_from, decode = runner.prefill_from, runner.decode
    first_decode: dict[int, int] = {}

    def audit(seq, symbol: str, got: int, want: int) -> None:
        if got != want and symbol not in faults:
            patches = _positions(seq) - len(seq.prompt)
            faults[symbol] = (f"{symbol} is {got} for a sequence of {len(seq.prompt)} prompt tokens, {patches} "
                              f"image patches and {len(seq.output)} outputs: {want} positions are in the cache "
                              "(the engine places its keys and reads its pages by this count)")

    def recording_prefill(seq, tail=0):
        logits, tails = prefill_from(seq, tail)
        audit(seq, "Sequence.num_prompt", seq.num_prompt, _positions(seq))
        records.append((seq.id, _positions(seq) - 1, "prefix" if seq.reused else "prefill", logits.detach().clone(),
                        seq.reused or None))
        return logits, tails

    def recording_decode(seqs):
        logits = decode(seqs)
        for row, s in enumerate(seqs):
            at = _positions(s) + len(s.output) - 1  # the last output token, fed at the next position
            audit(s, "Sequence.length", s.length, at + 1)
            first = first_decode.setdefault(s.id, at)
            records.append((s.id, at, "decode", logits[row].detach().clone(), first))
        return logits

    runner.prefill_from, runner.decode = recording_prefill, recording_decode
    return records


DIAGNOSES = 6  # float64 recomputes of the model's components per engine configuration, at most

_WHERE = {"prefill": dict(file=RUNNER, symbol="ModelRunner.prefill_from"),
          "prefix": dict(file=PREFIX, symbol="PrefixCache.match / PrefixEntry.restore (ModelRunner.prefill_from)"),
          "decode": dict(file=RUNNER, symbol="ModelRunner.decode / decode_step")}


def _engine_attempt(ctx: ProbeContext, draw: Draw, config: dict, options: dict,
                    name: str = "") -> tuple[list, float, object, int]:
    """One run of the engine (``options``: LLMEngine arguments) on fresh weights and prompts: the
    recorded steps per sequence and phase as [(phase, condition, logits, float64 logits, (position,
    token, its logit, the argmax, its logit) of each token that is not its step's argmax, tokens,
    logits of the model's own forward, per step the smallest margin of the float64 model's choices
    at the positions computed from stored KV up to the step's own (inf for a prefill from scratch),
    each step's position among the tokens)],
    the smallest margin of the float64 model's discrete choices, the model, and the engine's
    preemptions."""
    from target_stack.engine import LLMEngine, SamplingParams
    from target_stack.model.model import HybridModel, ModelConfig

    p = ctx.params
    model = HybridModel(ModelConfig(seed=int(draw.randint(2**31 - 1, (1,))), **config))
    ref.randomize_norms(model, draw.cpu)
    engine = LLMEngine(model, device=ctx.device, **{"page_size": p.get("page_size", 16), "prefix_cache": True,
                                                     "prefix_ring": p.get("prefix_ring", 64), **options})
    faults: dict[str, str] = {}
    records = _record(engine.runner, faults)
    vocab, n = model.cfg.vocab, p.get("max_tokens", 4)
    prompts = [draw.randint(vocab, (L,)).tolist() for L in p["prompt_lengths"]]
    side = 2 * model.cfg.patch
    image = draw.rand(3, side, side)
    first = engine.generate(prompts + [prompts[0][:5]], SamplingParams(max_tokens=n),
                            images=[None] * len(prompts) + [image])
    # prompts that extend a prefix of the longest one: prefills from the cache (shared pages, ReplaySSM)
    base = max(prompts, key=len)
    later = [base[:keep] + draw.randint(vocab, (extra,)).tolist() for keep, extra in p["reuse"]]
    second = engine.generate(later, SamplingParams(max_tokens=n))
    for symbol, message in faults.items():
        ctx.fail(message, file=SEQUENCE, symbol=symbol, condition=name or None)
    embeds = ref.image_encoder(model.image_encoder, f64(image))
    own_embeds = model.image_encoder(image)  # what the engine spliced in: for its own-forward comparison
    rows, margin = [], math.inf
    for out, prefix in [(o, None) for o in first[:-1]] + [(first[-1], embeds)] + [(o, None) for o in second]:
        tokens = out.prompt + out.tokens[:-1]
        want, margins = ref.hybrid_logits_by_position(model, tokens, prefix=prefix)
        m = margins.min().item()
        with torch.no_grad():
            own = model(torch.tensor([tokens], device=ctx.device), prefix=None if prefix is None else own_embeds[None])
        own = own[0]
        margin = min(margin, m)
        offset = 0 if prefix is None else prefix.shape[0]
        by_phase: dict[str, list] = {}
        for sid, pos, phase, logits, first in records:
            if sid == out.id:
                stored = math.inf if first is None else margins[first:pos + 1].min().item()
                by_phase.setdefault(phase, []).append((pos, logits, stored))
        chosen = {offset + len(out.prompt) - 1 + i: t for i, t in enumerate(out.tokens)}
        for phase, got in by_phase.items():
            pos = [q for q, _, _ in got]
            cond = (f"prompt of {len(out.prompt)} tokens" + (" after an image" if prefix is not None else "")
                    + f", positions {pos[0]}..{pos[-1]}")
            logits = torch.stack([g for _, g, _ in got])
            # the sampler's contract is the argmax of finite logits: a row with a NaN or an inf is the
            # logits' failure (the comparison below names it), whatever token was drawn from it
            greedy = [(q, int(t), float(row[t]), int(row.argmax()), float(row.max()))
                      for q, t, row in zip(pos, (chosen[q] for q in pos), logits)
                      if bool(torch.isfinite(row).all()) and row[t] != row.max()]
            rows.append((phase, cond, logits, want[pos], greedy, tokens, own[pos],
                         torch.tensor([m for _, _, m in got], dtype=torch.float64), [q - offset for q in pos]))
    return rows, margin, model, engine.preemptions


@probe(kind="correctness")
def engine_reference(ctx: ProbeContext) -> None:
    """The engine's logits at every prefill, decode and prefix-reusing prefill step (continuous
    batching, paged KV, state slots, an image prompt) against the float64 model recomputed from
    each sequence's tokens, per engine configuration, and every greedy token the argmax of its
    step's logits.  A model component that is off is named as such (the runner wires the blocks
    itself).  Then ReplaySSM's states against the KDA recurrence."""
    chk = Checker(ctx, ctx.params.get("tolerance", 1e-4))
    for config in ctx.params.get("configs", [{}]):
        name = ", ".join(f"{k}={v}" for k, v in config.items()
                         if k not in ("tolerance", "metric", "devices", "margin")) or "defaults"
        # each configuration apart (on a CPU): a crash, in the native MoE say, is located and the rest runs
        done, _ = isolated(ctx, lambda config=config, name=name: _check_config(ctx, chk, dict(config), name), chk,
                           file=ENGINE, symbol="LLMEngine.generate", condition=name)
        if not done:
            chk.track(math.inf, config.get("metric"))
    if not ref.device_lost(ctx):  # a device that faulted runs nothing more (named by isolated)
        _check_replay(ctx, chk, Draw(ctx.device))
    chk.report()


def _check_config(ctx: ProbeContext, chk: Checker, config: dict, name: str) -> None:
    """One engine configuration: ModelConfig fields, ``engine`` (LLMEngine arguments; with
    ``preempts`` the run must preempt), ``tolerance`` and ``metric`` for a looser bound, ``devices``
    (the device types it runs on; all when absent), ``margin`` (reduced-precision KV storage: how
    close to a tie a discrete choice downstream of the stored KV may be and still be judged)."""
    devices = config.pop("devices", None)
    if devices and ctx.device not in devices:
        return
    draw = Draw(ctx.device)  # its own draws: a forked configuration's would be its sibling's
    tol = config.pop("tolerance", None)  # a looser bound (quantised KV storage), with a metric of its own
    metric = config.pop("metric", None)
    stored_margin = float(config.pop("margin", MARGIN))
    options = dict(config.pop("engine", {}))
    preempts = options.pop("preempts", False)
    for _ in range(3):  # a near-tie in a discrete choice of the model: other weights and prompts
        rows, margin, failed = [], math.inf, ctx.failed
        with chk.guard(file=ENGINE, symbol="LLMEngine.generate", condition=name):
            rows, margin, model, preemptions = _engine_attempt(ctx, draw, config, options, name)
            if preempts:
                ctx.check(preemptions > 0, "no preemption: the probe's memory is too roomy for this configuration",
                          file="target_stack/engine/scheduler.py", symbol="Scheduler.schedule", condition=name)
        steps = [r[7] for r in rows if r[0] != "prefill"]  # the stored margins
        judged = sum(int((m > stored_margin).sum()) for m in steps)
        if ctx.failed != failed or (margin > MARGIN and judged * 2 >= sum(m.numel() for m in steps)):
            break
    # Reduced-precision storage moves every step computed from it, and with it the discrete choices
    # (experts, kept blocks) at those positions: a step is held to the float64 model only where they
    # are clear of a tie by more than the storage's ``margin``.  The rest are counted.
    near_ties = 0
    judged = []  # (phase, condition, engine logits, float64 logits, the model's own forward), steps clear of ties
    blamed: list = []  # the model's own components found off, on the input of an engine step that is off
    diagnosed: set[tuple[int, ...]] = set()  # the token prefixes already diagnosed
    bound = chk.tolerance if tol is None else tol
    for phase, cond, got, want, wrong, tokens, own, stored, at in rows:
        ctx.check(not wrong, f"greedy tokens {[t for _, t, *_ in wrong]} are not the argmax of the step's logits "
                  + "(" + "; ".join(f"position {q}: token {t} scores {lt:.6g}, token {a} {la:.6g}"
                                    for q, t, lt, a, la in wrong[:3]) + ")",
                  file=SAMPLER, symbol="sample (greedy) / LLMEngine.step", condition=f"{name}; {cond}")
        keep = stored > stored_margin
        near_ties += int((~keep).sum())
        if not keep.any():
            continue
        got, want, own = got[keep], want[keep], own[keep]
        at = [q for q, k in zip(at, keep.tolist()) if k]
        judged.append((phase, cond, got, want, own))
        if not rel_err(got, want) <= bound and not blamed:
            blamed = _blame(model, tokens, at, got, want, bound, chk.tolerance, diagnosed)
    # every step is judged once the diagnosis has seen every step that is off: which steps a component
    # that is off shows on depends on what the engine carried at which length, not on the steps' order
    for file, symbol, err in blamed:
        ctx.fail(f"the engine's logits are off, and the model's {symbol} departs from its definition "
                 f"on its own input (rel. error {err:.2e})", file=file, symbol=symbol, condition=name)
    carried = any(symbol in ref.CARRIED for _, symbol, _ in blamed)
    for phase, cond, got, want, own in judged:
        where = dict(_WHERE[phase], condition=f"{name}; {cond}")
        if not blamed:
            chk.compare(got, want, f"{phase} logits", tolerance=bound, metric=metric, **where)
            continue
        # a component is off (named above): the engine must still equal the model's own forward
        chk.track(rel_err(got, want), metric)
        if carried:
            # a KDA layer's final state or decode step: every engine step past a prefill's first chunk
            # carries them, so it cannot be held to the model's own forward, which carries nothing
            continue
        chk.compare(got, own, f"{phase} logits", tolerance=bound, against="the model's own forward",
                    metric=metric, **where)
    if stored_margin != MARGIN:
        ctx.metric(f"near_tie_steps{metric.removeprefix('max_rel_err') if metric else ''}", near_ties)


def _check_replay(ctx: ProbeContext, chk: Checker, draw: Draw) -> None:
    """ReplaySSM built from a sequence (prefix folded into the checkpoint), replayed at positions of
    its ring, stepped past a full ring, truncated: states and outputs against the recurrence."""
    from target_stack.engine.replay_ssm import ReplaySSM
    from target_stack.ops.kda.naive import naive_recurrent_kda
    from target_stack.ops.kda.testing import make_inputs

    c = ctx.params.get("replay", {"T": 40, "steps": 25, "H": 2, "K": 16, "V": 16, "capacity": 16})
    T, steps, H, K, V, cap = (c[n] for n in ("T", "steps", "H", "K", "V", "capacity"))
    q, k, v, g, beta = make_inputs(1, T + steps, H, K, V, generator=draw.gen, device=ctx.device)
    h0 = draw.randn(H, K, V)
    states, outs = [f64(h0)], []
    for t in range(T + steps):  # the state after every token, one step of the recurrence at a time
        o, s = naive_recurrent_kda(*(f64(x[:, t:t + 1]) for x in (q, k, v, g, beta)),
                                   initial_state=states[-1][None], output_final_state=True)
        states.append(s[0])
        outs.append(o[0, 0])
    where = dict(file=REPLAY, symbol="ReplaySSM.from_sequence / state", condition=f"T={T}, capacity={cap}")
    ssm = None
    with chk.guard(**where):
        ssm = ReplaySSM.from_sequence(k[0, :T], v[0, :T], g[0, :T], beta[0, :T], cap, initial_state=h0)
        ctx.check(ssm.checkpoint_position == T - cap, f"checkpoint at {ssm.checkpoint_position}, not {T - cap}",
                  **where)
        for pos in (T - cap, T - cap // 2 - 1, T):
            chk.compare(ssm.state(pos), states[pos], f"state after {pos} tokens", **where)
    if ssm is None:
        return
    where = dict(file=REPLAY, symbol="ReplaySSM.step / record / truncate", condition=f"{steps} steps past {T}")
    with chk.guard(**where):
        got = torch.stack([ssm.step(q[0, t], k[0, t], v[0, t], g[0, t], beta[0, t]) for t in range(T, T + steps)])
        chk.compare(got, torch.stack(outs[T:]), "step outputs", **where)
        chk.compare(ssm.state(), states[-1], "state after the steps", **where)
        back = T + steps - cap // 2
        ssm.truncate(back)
        chk.compare(ssm.state(), states[back], f"state after truncating to {back}", **where)


# -- tensor parallelism -----------------------------------------------------------------------------


def _tp_rank(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of the two-process check (gloo): the sharded layer and LM head on the saved inputs."""
    import torch.distributed as dist

    from target_stack.engine.tp import TensorParallelKDA, VocabParallelHead
    from target_stack.model.kda_layer import KDALayer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        data = torch.load(os.path.join(folder, "inputs.pt"))
        layer = KDALayer(*data["dims"], backend="torch")
        layer.load_state_dict(data["layer"])
        x, split = data["x"], data["split"]
        with torch.no_grad():
            tp = TensorParallelKDA(layer)
            y, state = tp.prefill(x[:, :split])
            steps = []
            for t in range(split, x.shape[1]):
                step, state = tp.decode(x[:, t:t + 1], state)
                steps.append(step)
            logits = VocabParallelHead(data["lm_head"])(data["h"])
        torch.save({"prefill": y, "decode": torch.cat(steps, 1), "state": state.kda, "logits": logits,
                    "heads": tp.shard.H}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@probe(kind="correctness")
def tensor_parallel(ctx: ProbeContext) -> None:
    """Two real ranks over gloo: the head-sharded KDA layer (prefill, decode with the local states)
    and the vocabulary-parallel LM head against the float64 layer definition and h . W^T.
    (gloo runs on the CPU; the sharding logic is the same on NCCL.)"""
    import torch.multiprocessing as mp

    from target_stack.engine.tp import free_port
    from target_stack.model.kda_layer import KDALayer

    p = ctx.params
    draw = Draw("cpu")
    chk = Checker(ctx, p.get("tolerance", 1e-5))
    dim, H, K, V, T, split, world = (p[n] for n in ("dim", "heads", "head_k", "head_v", "T", "prefill", "world"))
    layer = KDALayer(dim, H, K, V, draw.cpu, backend="torch")
    ref.randomize_norms(layer, draw.cpu)
    x = draw.randn(2, T, dim)
    vocab = p.get("vocab", 37)  # not a multiple of the world size: the last rank is padded
    lm_head, h = draw.randn(vocab, dim), draw.randn(2, 3, dim)
    with tempfile.TemporaryDirectory(prefix="tp-probe-") as folder:
        torch.save({"dims": (dim, H, K, V), "layer": layer.state_dict(), "x": x, "split": split,
                    "lm_head": lm_head, "h": h}, os.path.join(folder, "inputs.pt"))
        with chk.guard(file=TP, symbol="TensorParallelKDA / VocabParallelHead", condition=f"world={world}"):
            # fork: the ranks start in milliseconds (this process is single-threaded and has no CUDA state)
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            mp.start_processes(_tp_rank, args=(world, free_port(), folder), nprocs=world, start_method=method)
        results = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)
                   if os.path.exists(os.path.join(folder, f"rank{r}.pt"))]
    ctx.check(len(results) == world, f"{world - len(results)} of {world} ranks wrote no result", file=TP)
    y_ref, s_ref, _, _ = ref.kda_layer(layer, f64(x))
    logits_ref = f64(h) @ f64(lm_head).T
    h_local = H // world
    for r, res in enumerate(results):
        cond = f"rank {r} of {world}"
        where = dict(file=TP, symbol="shard_kda_layer / TensorParallelKDA.prefill", condition=cond)
        ctx.check(res["heads"] == h_local, f"rank holds {res['heads']} heads, not {h_local}", **where)
        chk.compare(res["prefill"], y_ref[:, :split], "all-reduced prefill output", **where)
        where = dict(where, symbol="shard_kda_layer / TensorParallelKDA.decode")
        chk.compare(res["decode"], y_ref[:, split:], "all-reduced decode output", **where)
        chk.compare(res["state"], s_ref[:, r * h_local:(r + 1) * h_local], "the rank's KDA state (its heads)", **where)
        chk.compare(res["logits"], logits_ref, "all-gathered logits", **dict(where, symbol="VocabParallelHead"))
    chk.report()


# -- the disaggregated cluster -----------------------------------------------------------------------


def _check_transfer(ctx: ProbeContext, draw: Draw, stages: int) -> None:
    """The transfer thread's copy of a sequence's KV pages (values and int8 scales) and state slots
    into the reserved ones, stage by stage, in every copy mode, against its definition: reserved page
    i holds the sequence's page i, the reserved slot its slot, and nothing else is written."""
    from target_stack.engine.disagg import COPY_MODES, TransferEngine
    from target_stack.engine.runner import ModelRunner
    from target_stack.engine.sequence import SamplingParams, Sequence
    from target_stack.model.model import HybridModel, ModelConfig

    model = HybridModel(ModelConfig(kv_dtype="int8")).to(ctx.device)
    src, dst = (ModelRunner(model, num_pages=8, page_size=4, num_slots=4) for _ in range(2))
    remote = {}  # the decode worker's pools as the prefill worker sees them
    for runner, pools in ((src, {}), (dst, remote)):
        for layer, cache in runner.kv.items():
            pools.update({f"kv.{layer}.{name}": t for name, t in cache.tensors().items()})
        for layer, pool in runner.states.items():
            pools.update({f"state.{layer}.kda": pool.kda, f"state.{layer}.conv": pool.conv})
        for t in pools.values():
            t.copy_(draw.randn(*t.shape) * 50)  # every page and slot distinct (int8 values too)
    seq = Sequence(prompt=[0], params=SamplingParams())
    seq.pages, seq.slot = [5, 2, 7], 3
    dst_pages, dst_slot = [1, 6, 4], 2
    layers = list(range(len(model.blocks)))
    bounds = [round(len(layers) * (s + 1) / stages) for s in range(stages)]
    source = {**{f"kv.{i}.{n}": t for i, c in src.kv.items() for n, t in c.tensors().items()},
              **{f"state.{i}.{n}": getattr(p, n) for i, p in src.states.items() for n in ("kda", "conv")}}
    clean = {k: t.clone() for k, t in remote.items()}
    for mode in COPY_MODES:
        where = dict(file=DISAGG_TRANSFER, symbol=f"TransferEngine._copy_stage (copy={mode!r})",
                     condition=f"pages {seq.pages} -> {dst_pages}, slot {seq.slot} -> {dst_slot}, {stages} stages")
        with Checker(ctx, 0).guard(**where):
            for k, t in remote.items():
                t.copy_(clean[k])
            engine = TransferEngine(src, remote, None, None, lambda item, error: None, mode)
            try:
                for a, b in zip([0, *bounds], bounds, strict=False):
                    engine._copy_stage(seq, layers[a:b], dst_pages, dst_slot)
                if engine.stream is not None:
                    engine.stream.synchronize()
            finally:
                engine.close()
            wrong = []
            for key, t in remote.items():
                want = clean[key].clone()
                if key.startswith("kv."):
                    want[dst_pages] = source[key][seq.pages]
                else:
                    want[dst_slot] = source[key][seq.slot]
                if not torch.equal(t, want):
                    wrong.append(key)
            ctx.check(not wrong, f"the copied pools differ from the sequence's pages and slot: {wrong[:4]}"
                      + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""), **where)


def _colocated_tokens(seed: int, device: str, requests: list, sizes: dict) -> list[list[int]]:
    """The greedy tokens of each request from one colocated engine in the workers' precision (the decode
    worker's model), each request alone: what the engine's own prefill and decode give, no transfer."""
    from target_stack.engine import LLMEngine
    from target_stack.engine.disagg.workers import _model

    engine = LLMEngine(_model({"preset": "tiny", "seed": seed, "device": device}), device=device,
                       page_size=sizes["page_size"], num_pages=sizes["num_pages"],
                       max_model_len=sizes["max_model_len"])
    return [engine.generate([prompt], params, images=[img])[0].tokens for prompt, params, img in requests]


def _check_messages(ctx: ProbeContext) -> None:
    """The wire protocol survives the process boundary: every message record of ``disagg.messages`` comes
    back from a multiprocessing queue equal and of its type, and ``STOP`` comes back as itself (the workers
    test it by identity)."""
    import dataclasses
    import multiprocessing as mp
    import pickle
    import queue as queue_mod

    from target_stack.engine.disagg import messages

    samples = {"int": 3, "float": 1.5, "str": "x", "bool": True, "list[int]": [4, 5], "str | None": "why",
               "Timing": messages.Timing(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)}
    q = mp.get_context("spawn").Queue()
    where = dict(file=DISAGG_MESSAGES, symbol="the disaggregated wire protocol")
    try:
        records = [c for c in vars(messages).values()
                   if dataclasses.is_dataclass(c) and isinstance(c, type) and c.__module__ == messages.__name__]
        for cls in records:
            kwargs = {f.name: samples.get(str(f.type), {"field": f.name}) for f in dataclasses.fields(cls)}
            msg = cls(**kwargs)
            pickle.dumps(msg)  # what the queue's feeder thread does, here where its error can be caught
            q.put(msg)
            got = q.get(timeout=10)
            ctx.check(type(got) is cls and got == msg, f"{cls.__name__} comes back from a queue as {got!r}",
                      **where, condition=f"{cls.__name__} through a multiprocessing queue")
        q.put(messages.STOP)
        got = q.get(timeout=10)
        ctx.check(got is messages.STOP, f"STOP comes back from a queue as {got!r}, which is not STOP: a worker "
                  "testing `is STOP` never stops", **where, condition="STOP through a multiprocessing queue")
    except (queue_mod.Empty, pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
        ctx.fail(f"the messages cannot make the trip through a queue: {raised_message(exc)}", **where)
    finally:
        q.close()
        q.join_thread()


def _check_shutdown(ctx: ProbeContext, workers, stats: dict, killed: frozenset = frozenset(),
                    close_s: float = 0.0, close_bound: float = math.inf) -> None:
    """``close`` stops every worker cleanly and promptly: each reports its pool accounting (nothing leaked:
    pages, slots) and exits 0, but for those the probe killed (``killed``); ``close_s`` within ``close_bound``."""
    where = dict(file=DISAGG_WORKERS, symbol="the workers' shutdown (STOP, Stats) / DisaggCluster.close",
                 condition="after the runs (a failed prefill, refused reservations, a killed "
                           f"{'/'.join(sorted(killed)) or 'no'} worker among them)")
    want = {"prefill"} | ({"decode"} if workers.transfer else set())
    ctx.check(want <= set(stats), f"close() got no accounting from {sorted(want - set(stats))}", **where)
    for name, acct in stats.items():
        # a leak names the code that holds it: the worker's own release paths
        ctx.check(not acct.get("leaked_pages") and not acct.get("leaked_slots"),
                  f"the {name} worker stopped holding {acct}: pages or slots of finished, refused or failed "
                  "requests were never given back", **where)
    codes = {n: proc.exitcode for n, proc in workers.procs.items() if n not in killed}
    ctx.check(all(c == 0 for c in codes.values()), f"workers did not exit cleanly: exit codes {codes}", **where)
    ctx.metric("close_s", close_s, "s", better="lower")
    ctx.check(close_s <= close_bound, f"close() took {close_s:.1f} s (bound {close_bound:g} s)",
              file=DISAGG_CLUSTER, symbol="DisaggCluster.close", condition=where["condition"])


def _load_run(ctx: ProbeContext, workers, prompt: list[int], vocab: int, p: dict, timeout: float) -> list:
    """More requests at once than the decode worker has state slots (its reservations are refused), one of
    them invalid (a token outside the vocabulary: its prefill fails after its reservation): the invalid
    one and only refused ones fail, each with its own error; the others run to their max_tokens.

    Whether reservations are refused depends on the device's speed: the decode worker must still hold its
    slots when the last prefills ask.  Where nothing was refused (a fast GPU drains its slots first), the run
    is repeated with longer requests, sized from its own timings (:func:`_tokens_to_hold`), at least twice
    as long, up to ``load_max_tokens_cap`` (kept within the decode worker's positions and pages), so that the
    refusal path, whose leaks close() counts, runs on every device; where even that refuses nothing, an
    observation says so.  Returns the requests that came back, as (request, output)."""
    from target_stack.engine import SamplingParams

    k, m = p.get("load_requests", 12), p.get("load_max_tokens", 32)
    slots = _decode_slots(p)
    per_seq = p.get("num_pages", 64) // slots * p.get("page_size", 16)  # positions each slot's pages can hold
    cap = max(m, min(p.get("load_max_tokens_cap", 128), min(p.get("max_model_len", 256), per_seq) - len(prompt) - 1))
    bad = prompt[:2] + [vocab + 3] + prompt[2:]
    served: list = []
    while True:
        params = SamplingParams(max_tokens=m)
        requests = [(prompt, params, None)] * k
        requests[1] = (bad, params, None)  # early: its reservation is granted, then its prefill fails
        res = workers.run(requests, timeout_s=timeout)
        where = dict(file=DISAGG_WORKERS, symbol="prefill_worker / decode_worker (refusals, failed prefills)",
                     condition=f"{k} requests of {m} tokens at once, {_decode_slots(p)} decode slots, request 1 "
                               "invalid")
        ctx.check(isinstance(res.outputs[1], Exception), f"a request with token {vocab + 3} (vocabulary {vocab}) "
                  f"came back as {res.outputs[1]!r}, not an error", **where)
        refused, ok = 0, []
        for r, out in enumerate(res.outputs):
            if r == 1:
                continue
            if isinstance(out, Exception):
                refused += 1
                continue
            if ctx.check(len(out.tokens) == m, f"request {r} came back with {len(out.tokens)} of {m} tokens "
                         f"({out.finish_reason!r})", **where):
                ok.append((r, out))
        ctx.check(bool(ok), "every valid request of the load run failed: "
                  + "; ".join(sorted({str(o) for o in res.outputs if isinstance(o, Exception)})[:3]), **where)
        served += ok
        if refused or m >= cap or ctx.failed:
            break
        m = min(max(2 * m, _tokens_to_hold(res.timings, m, slots)), cap)
    ctx.metric("refused_requests", refused)
    ctx.metric("load_max_tokens", m)
    if not refused and not ctx.failed:
        ctx.finding(f"no reservation was refused even with {k} requests of {m} tokens for {_decode_slots(p)} decode "
                    "slots: the refusal path was not exercised on this device", **where)
    return served


def _tokens_to_hold(timings: list, m: int, slots: int) -> int:
    """From a load run's timings (requests of ``m`` tokens, none refused): the max_tokens with which the
    first sequence would still be decoding, with a factor of two to spare, when the request past the
    decode slots starts its prefill and asks for a slot.  0 when the timings cannot tell."""
    done = [t for t in timings if t is not None and t.done > t.first_token > 0]
    starts = sorted(t.prefill_start for t in timings if t is not None and t.prefill_start > 0)
    if not done or len(starts) <= slots:
        return 0
    per_token = statistics.median((t.done - t.first_token) / m for t in done)
    wait = starts[slots] - min(t.first_token for t in done)
    return math.ceil(2 * wait / per_token) if per_token > 0 and wait > 0 else 0


def _decode_slots(p: dict) -> int:
    return p.get("num_slots", 65) - 1  # slot 0 is the null slot


def _check_dead_worker(ctx: ProbeContext, workers, request: tuple, image, p: dict) -> str | None:
    """A worker that dies mid-run fails the requests pending on it promptly, with an error that names it:
    the encode worker (whose death no other worker reports) is killed while ``run`` waits, before an image
    request arrives for it.  Returns the killed worker's name (None if it could not be killed in time)."""
    import threading

    from target_stack.engine import SamplingParams

    victim, arrive = "encode", p.get("dead_arrival_s", 0.25)
    bound, timeout = p.get("dead_worker_bound_s", 5.0), p.get("dead_worker_timeout_s", 20.0)
    proc, killed = workers.procs[victim], []

    def kill() -> None:
        proc.kill()
        proc.join(5)
        killed.append(time.monotonic())

    prompt, params, _ = request
    timer = threading.Timer(0.02, kill)
    timer.start()
    res = workers.run([(prompt, params, None), (prompt, SamplingParams(max_tokens=2), image)],
                      arrivals=[0.0, arrive], timeout_s=timeout)
    back = time.monotonic()
    timer.join()
    timing = res.timings[1]
    if not killed or timing is None or killed[0] > timing.arrival:
        ctx.finding(f"the {victim} worker was not dead before its request arrived: the dead-worker check "
                    "did not run", file=DISAGG_CLUSTER, symbol="DisaggCluster.run")
        return victim if killed else None
    waited = back - timing.arrival
    where = dict(file=DISAGG_CLUSTER, symbol="DisaggCluster.run (a worker process died)",
                 condition=f"the {victim} worker killed mid-run, an image request pending on it, "
                           f"timeout_s={timeout:g}")
    ctx.metric("dead_worker_s", waited, "s", better="lower")
    out = res.outputs[1]
    ctx.check(waited <= bound, f"run() returned {waited:.1f} s after the request for the dead {victim} worker "
              f"(bound {bound:g} s): it waited for its deadline instead of acting on the death", **where)
    ctx.check(isinstance(out, Exception) and victim in str(out),
              f"the request pending on the dead {victim} worker came back as {out!r}, not an error naming the "
              "worker", **where)
    return victim


@probe(kind="correctness")
def disagg(ctx: ProbeContext) -> None:
    """The KV transfer's copy in every mode against its definition, then greedy outputs of the
    disaggregated cluster (encode, prefill with the native MoE and the layer-split KV transfer,
    decode) against the float64 model on the same tokens: every token is the float64 argmax, or
    within the margin of a tie.  Wrong tokens are traced to the model's components where they are
    the cause.  The same workers then take more requests than the decode worker has slots, one of
    them invalid (refusals and a failed prefill: the others still right), and lose their encode
    worker mid-run (its pending request must fail at once, naming it); at close both pools hold
    nothing and close returns in bounded time."""
    import dataclasses

    from target_stack.engine import SamplingParams
    from target_stack.engine.disagg import DisaggCluster
    from target_stack.engine.disagg.workers import _model
    from target_stack.model.model import PRESETS, HybridModel

    p = ctx.params
    draw = Draw(ctx.device)
    _check_transfer(ctx, draw, p.get("stages", 2))
    _check_messages(ctx)
    seed = int(draw.randint(2**31 - 1, (1,)))
    cfg = dataclasses.replace(PRESETS["tiny"], seed=seed)
    model = HybridModel(cfg)  # the workers build the same weights from the same config
    n = p.get("max_tokens", 3)
    prompts = [draw.randint(cfg.vocab, (L,)).tolist() for L in p["prompt_lengths"]]
    # the last requests: the first prompt after an image of each size, in patches per side (one page of
    # patches or more makes the block table and the decode positions depend on them)
    images = [draw.rand(3, g * cfg.patch, g * cfg.patch).cpu() for g in p.get("image_grids", [2])]
    requests = [(q, SamplingParams(max_tokens=n), None) for q in prompts]
    requests += [(prompts[0], SamplingParams(max_tokens=n), img) for img in images]
    device = "cuda" if ctx.device == "cuda" else "cpu"
    # wrong outputs with a right transfer copy (checked above): the workers' handling of the sequences
    where = dict(file=DISAGG_WORKERS, symbol="prefill_worker / decode_worker")
    result = None
    sizes = dict(stages=p.get("stages", 2), page_size=p.get("page_size", 16), num_pages=p.get("num_pages", 64),
                 max_model_len=p.get("max_model_len", 256), num_slots=p.get("num_slots", 65))
    timeout = p.get("timeout_s", 60)
    short = None
    # every judged request: (request, its output, a label for the condition); load: the load run's
    load: list = []
    with Checker(ctx, 0).guard(**where), DisaggCluster({"preset": "tiny", "seed": seed, "device": device},
                                                       **sizes) as workers:
        result = workers.run(requests, timeout_s=timeout)
        # the same workers, this run stopped at the prefill: each request's first token and nothing more
        short = workers.run(requests[:2], timeout_s=timeout, transfer=False)
        # the same workers under load (refused reservations, a failed prefill), then a worker killed mid-run;
        # at close, both pools' accounting covers every path
        load_prompt = prompts[0][:p.get("load_prompt", 5)]
        load = _load_run(ctx, workers, load_prompt, cfg.vocab, p, timeout)
        killed = _check_dead_worker(ctx, workers, requests[0], images[0], p)
        t = time.monotonic()
        stats = workers.close(timeout_s=p.get("close_timeout_s", 30))
        _check_shutdown(ctx, workers, stats, frozenset({killed} - {None}), time.monotonic() - t,
                        p.get("close_bound_s", 15))
    if result is None:
        return
    # how far below the float64 maximum (in standard deviations of the logits) a token may be: the
    # workers run fp32 on a CPU, bf16 on a GPU; a token after a broken transfer is unrelated, ~2-3 below
    margin = float(p.get("token_margin", {}).get(device, 1e-3))
    embeds = {id(img): ref.image_encoder(model.image_encoder, f64(img)) for img in images}
    # the prefill-only run's tokens, judged as every first token is: against float64, within the margin
    for r, first in enumerate(short.outputs if short is not None else []):
        where_short = dict(file=DISAGG_CLUSTER, symbol="DisaggCluster.run(transfer=False) / prefill_worker",
                           condition=f"request {r} again, prefill only, on a transferring cluster")
        if not ctx.check(not isinstance(first, Exception), f"the prefill-only request failed: {first}", **where_short):
            continue
        if not ctx.check(first.finish_reason == "prefill" and len(first.tokens) == 1,
                         f"a prefill-only request ended {first.finish_reason!r} with {len(first.tokens)} tokens, not "
                         "'prefill' with its first token", **where_short):
            continue
        w = ref.hybrid_logits(model, requests[r][0])[0][-1]
        gap = (w.max() - w[first.tokens[0]]).item() / w.std().item()
        ctx.check(gap <= margin, f"the prefill-only first token {first.tokens[0]} is not the float64 argmax "
                  f"{int(w.argmax())} (gap {gap:.2f} std)", **where_short)
    same = None  # the workers' own model in their precision, in this process: the second opinion below
    colocated = None  # the tokens of the same engine in one process: the decode's second opinion
    checked = wrong = failures = flips = 0
    judged = [(req, out, "") for req, out in zip(requests, result.outputs)]
    # the load run's served requests (one prompt): each distinct output, its first load_judged tokens
    mj = p.get("load_judged", 16)
    for out in {tuple(o.tokens[:mj]): o for _, o in load}.values():
        judged.append(((load_prompt, SamplingParams(max_tokens=len(out.tokens[:mj])), None),
                       dataclasses.replace(out, tokens=out.tokens[:mj]), ", under load (refusals, a failed prefill)"))
    requests = [req for req, _, _ in judged]
    for r, ((prompt, _, img), out, label) in enumerate(judged):
        if isinstance(out, Exception):
            failures += 1
            ctx.fail(f"request failed: {out}", **where)
            continue
        prefix = embeds[id(img)] if img is not None else None
        want, _ = ref.hybrid_logits(model, prompt + out.tokens[:-1], prefix=prefix)
        start = len(prompt) - 1 + (0 if prefix is None else prefix.shape[0])
        mine = None
        for i, t in enumerate(out.tokens):
            w = want[start + i]
            checked += 1
            gap = (w.max() - w[t]).item() / w.std().item()
            if gap > margin and device != "cpu":
                # Reduced precision can flip a discrete choice (an expert's routing, a near tie) far from
                # the float64 model.  If the plain model in the workers' precision picks the same token,
                # the disaggregated path gave what the model gives: a precision flip, not a wrong token.
                if mine is None:
                    same = same or _model({"preset": "tiny", "seed": seed, "device": device}, moe_backend="native")
                    with torch.no_grad():
                        pre = None if prefix is None else prefix.to(device=device, dtype=torch.bfloat16)[None]
                        mine = same(torch.tensor([prompt + out.tokens[:-1]], device=device), prefix=pre)[0].float()
                m = mine[start + i]
                if (m.max() - m[t]).item() / m.std().item() <= 1e-3:
                    flips += 1
                    continue
                # The plain forward is the prefill's arithmetic; a decode step's (the recurrent and the
                # sparse decode kernels) differs in its last bits, enough to flip a near tie at bf16.  The
                # same engine in one process (no transfer) is the decode's second opinion: the same
                # tokens up to this one, this one included, is what the engine itself gives.
                if colocated is None:
                    colocated = _colocated_tokens(seed, device, requests, sizes)
                if colocated[r][:i + 1] == out.tokens[:i + 1]:
                    flips += 1
                    continue
            if gap > margin:
                wrong += 1
                step = "first token (prefill)" if i == 0 else f"decode step {i}"
                after = "" if img is None else f" after an image of {embeds[id(img)].shape[0]} patches"
                ctx.fail(f"token {i} is {t}, not the float64 argmax {int(w.argmax())} (gap {gap:.2f} std)", **where,
                         condition=f"prompt of {len(prompt)}{after}{label}, {step}")
    ctx.metric("tokens_checked", checked)
    ctx.metric("wrong_tokens", wrong, better="lower")
    if device != "cpu":
        ctx.metric("precision_flips", flips)
    if wrong or failures:  # the model itself, component by component, with the prefill worker's native MoE
        native = HybridModel(dataclasses.replace(cfg, moe_backend="native"))

        def components():
            for file, symbol, err in _components_off(native, requests[1][0], 1e-4):
                ctx.fail(f"the model's {symbol} departs from its definition on its own input (rel. error "
                         f"{err:.2e})", file=file, symbol=symbol)

        isolated(ctx, components, file=DISAGG_WORKERS, symbol="the model of the workers (native MoE)")
