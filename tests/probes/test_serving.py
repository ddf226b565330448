"""The serving probes' own parts: the disaggregated cluster's second opinion on a token."""

from __future__ import annotations

import dataclasses

import torch

from target_stack.engine import SamplingParams
from target_stack.engine.disagg import DisaggCluster
from target_stack.model.model import PRESETS
from target_stack.probes.serving import _colocated_tokens


def test_the_colocated_engine_gives_the_clusters_tokens_on_a_clean_tree():
    # the disagg probe's decode second opinion (used on a GPU, where bf16 can flip a near tie): on a clean
    # tree, with no transfer in between, one engine in this process gives every token the cluster gives
    seed = int(torch.randint(2**31 - 1, (1,)))
    cfg = dataclasses.replace(PRESETS["tiny"], seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(cfg.vocab, (n,), generator=g).tolist() for n in (5, 23, 40)]
    image = torch.rand(3, 2 * cfg.patch, 2 * cfg.patch, generator=g)
    requests = [(q, SamplingParams(max_tokens=4), img) for q, img in zip(prompts + prompts[:1], [None] * 3 + [image])]
    sizes = dict(stages=2, page_size=16, num_pages=64, max_model_len=256)
    with DisaggCluster({"preset": "tiny", "seed": seed, "device": "cpu"}, **sizes) as workers:
        result = workers.run(requests, timeout_s=60)
    mine = _colocated_tokens(seed, "cpu", requests, sizes)
    assert [len(t) for t in mine] == [4] * len(requests)
    assert mine == [out.tokens for out in result.outputs]


# -- sampling entropy (engine.sampler) ----------------------------------------------------------------


def _shared_seed(real):
    """``sample`` with the defect under test: every unseeded request's generator on one fixed seed."""

    def sample(logits, seqs):
        for s in seqs:
            if s.generator is None and s.params.temperature > 0 and s.params.seed is None:
                s.generator = torch.Generator(device=logits.device).manual_seed(1234)
        return real(logits, seqs)

    return sample


def test_unseeded_requests_draw_distinct_completions_and_a_shared_seed_is_located(monkeypatch):
    import target_stack.engine.engine as engine_mod
    import target_stack.engine.sampler as sampler_mod
    from feedback.probe import ProbeContext
    from target_stack.probes.serving import _check_unseeded, _check_unseeded_engine

    clean = ProbeContext("engine.sampler", {}, ".")
    _check_unseeded(clean, clean.params)  # sample() directly
    _check_unseeded_engine(clean, clean.params)  # two engines
    assert not clean.failed, [f.message for f in clean.findings]
    assert clean.metrics["unseeded_equal_pairs"].value == 0

    monkeypatch.setattr(sampler_mod, "sample", _shared_seed(sampler_mod.sample))
    broken = ProbeContext("engine.sampler", {}, ".")
    _check_unseeded(broken, broken.params)
    files = {f.location.file for f in broken.findings}
    assert broken.failed and "target_stack/engine/sampler.py" in files

    # the same defect on the engine's path only: located at the engine
    monkeypatch.undo()
    monkeypatch.setattr(engine_mod, "sample", _shared_seed(engine_mod.sample))
    engine_only = ProbeContext("engine.sampler", {}, ".")
    _check_unseeded_engine(engine_only, engine_only.params)
    assert engine_only.failed
    assert {f.location.file for f in engine_only.findings} == {"target_stack/engine/engine.py"}


# -- the disaggregated cluster: refusals, a failed prefill, a dead worker, close (engine.disagg.correctness)


def test_disagg_load_run_refuses_then_a_killed_worker_fails_promptly_and_close_accounts_for_all():
    import time

    from feedback.probe import ProbeContext
    from target_stack.probes.serving import _check_dead_worker, _check_shutdown, _load_run

    params = {"num_slots": 7, "load_requests": 12, "load_max_tokens": 32, "dead_worker_bound_s": 5,
              "dead_worker_timeout_s": 20}
    ctx = ProbeContext("engine.disagg.correctness", params, ".")
    cfg = PRESETS["tiny"]
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(cfg.vocab, (5,), generator=g).tolist()
    image = torch.rand(3, 2 * cfg.patch, 2 * cfg.patch, generator=g)
    sizes = dict(stages=2, page_size=16, num_pages=64, max_model_len=256, num_slots=7)
    with DisaggCluster({"preset": "tiny", "seed": 7, "device": "cpu"}, **sizes) as workers:
        served = _load_run(ctx, workers, prompt, cfg.vocab, params, 60)
        # more requests than decode slots: some refused (the path whose leaks close() counts), the rest served
        assert served and ctx.metrics["refused_requests"].value > 0
        assert all(len(out.tokens) == 32 for _, out in served)
        killed = _check_dead_worker(ctx, workers, (prompt, SamplingParams(max_tokens=2), None), image, params)
        assert killed == "encode" and ctx.metrics["dead_worker_s"].value <= 5
        t = time.monotonic()
        stats = workers.close()
        _check_shutdown(ctx, workers, stats, frozenset({killed}), time.monotonic() - t, 15)
    assert not ctx.failed, [f.message for f in ctx.findings]
    assert stats["prefill"] == stats["decode"] == {"leaked_pages": 0, "leaked_slots": 0}

    # the accounting of a leaking worker and a slow close: each reported, at the code that broke
    leaky = ProbeContext("engine.disagg.correctness", params, ".")
    _check_shutdown(leaky, workers, {"prefill": {"leaked_pages": 2, "leaked_slots": 1},
                                     "decode": {"leaked_pages": 0, "leaked_slots": 0}}, frozenset({killed}), 20.0, 15)
    files = [f.location.file for f in leaky.findings]
    assert files.count("target_stack/engine/disagg/workers.py") == 1
    assert files.count("target_stack/engine/disagg/cluster.py") == 1


def test_a_load_run_that_refuses_nothing_is_lengthened_then_said_to_have_missed_the_refusal_path():
    """Refusals depend on the device's speed (a fast GPU drains its decode slots before the last prefill asks):
    a load run that refused nothing is repeated with requests twice as long up to the cap, and where even
    that refuses nothing an observation says the path was not exercised (not a failure)."""
    from feedback.probe import ProbeContext
    from target_stack.probes.serving import _load_run

    params = {"num_slots": 33, "load_requests": 3, "load_max_tokens": 3, "load_max_tokens_cap": 6}
    ctx = ProbeContext("engine.disagg.correctness", params, ".")
    cfg = PRESETS["tiny"]
    prompt = torch.randint(cfg.vocab, (5,), generator=torch.Generator().manual_seed(3)).tolist()
    sizes = dict(stages=2, page_size=16, num_pages=64, max_model_len=64, num_slots=33)
    with DisaggCluster({"preset": "tiny", "seed": 3, "device": "cpu"}, **sizes) as workers:
        served = _load_run(ctx, workers, prompt, cfg.vocab, params, 60)
    assert not ctx.failed, [f.message for f in ctx.findings]
    assert ctx.metrics["refused_requests"].value == 0 and ctx.metrics["load_max_tokens"].value == 6
    assert sorted(len(out.tokens) for _, out in served) == [3, 3, 6, 6]  # both lengths ran, request 1 failed in each
    assert any("refusal path was not exercised" in f.message for f in ctx.findings)


def test_the_next_load_run_is_sized_from_the_timings_so_the_first_sequence_still_decodes_when_slots_run_out():
    from target_stack.engine.disagg.messages import Timing
    from target_stack.probes.serving import _tokens_to_hold

    # 2 decode slots; prefills start every 100 ms from 1 s; each sequence of 10 tokens decodes in 10 ms (1 ms a token)
    timings = [Timing(arrival=1.0, prefill_start=1 + 0.1 * i, first_token=1.05 + 0.1 * i, done=1.06 + 0.1 * i)
               for i in range(4)]
    # the third prefill starts at 1.2 s, 0.15 s after the first token: 150 tokens would just reach it, 300 hold it
    assert _tokens_to_hold(timings, 10, 2) == 300
    timings[1] = None  # a request without a timing of its own takes no slot: the third start is now at 1.3 s
    assert _tokens_to_hold(timings, 10, 2) == 500
    assert _tokens_to_hold(timings, 10, 3) == 0  # no request past the slots started: nothing to size against
    assert _tokens_to_hold([Timing(arrival=0.0)] * 4, 10, 2) == 0  # nothing decoded


def test_the_dead_worker_check_flags_a_run_that_waits_out_its_deadline():
    # a client that does not act on a dead worker: run() returns only at its deadline
    import multiprocessing as mp
    import time

    from feedback.probe import ProbeContext
    from target_stack.engine.disagg import DisaggResult
    from target_stack.engine.disagg.messages import Timing
    from target_stack.engine.sequence import RequestError
    from target_stack.probes.serving import _check_dead_worker

    class Deaf:
        def __init__(self):
            self.procs = {"encode": mp.get_context("spawn").Process(target=time.sleep, args=(30,), daemon=True)}
            self.procs["encode"].start()

        def run(self, requests, arrivals, timeout_s):
            t0 = time.monotonic()
            timings = [Timing(arrival=t0 + a) for a in arrivals]
            time.sleep(timeout_s)
            return DisaggResult([RequestError(f"timed out after {timeout_s:.0f} s")] * len(requests), timings, {})

    params = {"dead_worker_bound_s": 0.5, "dead_worker_timeout_s": 2, "dead_arrival_s": 0.3}
    ctx = ProbeContext("engine.disagg.correctness", params, ".")
    assert _check_dead_worker(ctx, Deaf(), ([1, 2, 3], SamplingParams(max_tokens=2), None), None, params) == "encode"
    assert ctx.failed
    assert {f.location.file for f in ctx.findings} == {"target_stack/engine/disagg/cluster.py"}
    assert ctx.metrics["dead_worker_s"].value > 1
