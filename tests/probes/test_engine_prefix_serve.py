"""engine.prefix_reuse's mixed image / text-only traffic and prefix-benchmark accounting, and engine.serve.e2e's
statistics checks: each passes on the clean tree and fails, bound to the right file and function, when the contract
is broken (a defect planted in a copy of the function, for the test only).  The tiny model on the CPU; the serving
run goes through a stand-in cluster (no worker processes) so that the probe's own code is driven in milliseconds."""

from __future__ import annotations

import inspect
import pathlib
import textwrap
import time

import pytest
import torch
import yaml

from feedback.correctness import fresh_generator
from feedback.probe import ProbeContext
from target_stack.engine import LLMEngine
from target_stack.probes import engine as probes

ENGINE = "target_stack/engine/engine.py"
BENCH_PREFIX = "target_stack/bench/prefix.py"
BENCH_SERVE = "target_stack/bench/serve.py"


def _params(probe_id: str) -> dict:
    manifest = yaml.safe_load((pathlib.Path(__file__).parents[2] / "target_stack/infra-agent.yaml").read_text())
    return next(p for p in manifest["probes"] if p["id"] == probe_id)["params"]


def _plant(monkeypatch, owner, name: str, old: str, new: str) -> None:
    """Replace ``owner.name`` by a copy of its source with ``old`` replaced by ``new`` (for this test only)."""
    fn = getattr(owner, name)
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, f"{old!r} not found once in {name}"
    ns: dict = {}
    exec(compile(src.replace(old, new), inspect.getsourcefile(fn), "exec"), fn.__globals__, ns)
    monkeypatch.setattr(owner, name, ns[name])


def _failures(ctx: ProbeContext) -> list[tuple[str, str]]:
    return [(f.location.file, f.location.symbol) for f in ctx.findings if f.failed]


# -- engine.prefix_reuse ------------------------------------------------------------------------------------------
def test_prefix_reuse_passes_on_the_clean_tree_with_the_mixed_sequence_and_the_benchmark_check():
    ctx = ProbeContext("engine.prefix_reuse", _params("engine.prefix_reuse"), ".")
    probes.prefix_reuse(ctx)
    assert not ctx.failed, [f.message for f in ctx.findings]
    assert ctx.metrics["mixed_mismatches"].value == 0


def test_mixed_traffic_catches_an_engine_that_caches_image_prompts(monkeypatch):
    _plant(monkeypatch, LLMEngine, "step", "record = self.prefix is not None and seq.prompt_embeds is None",
           "record = self.prefix is not None")
    ctx = ProbeContext("engine.prefix_reuse", _params("engine.prefix_reuse"), ".")
    probes._check_mixed_traffic(ctx, probes.HybridModel("tiny"), fresh_generator(), 16, 64)
    assert ctx.failed and ctx.metrics["mixed_mismatches"].value >= 1
    assert (ENGINE, "LLMEngine.step (what enters the prefix cache)") in _failures(ctx), ctx.findings
    assert all("text-only" in f.location.condition for f in ctx.findings if f.location.file == ENGINE)


def test_mixed_traffic_binds_an_image_prompt_matched_against_text_entries_to_the_scheduler(monkeypatch):
    from target_stack.engine.scheduler import Scheduler

    _plant(monkeypatch, Scheduler, "schedule", "not resuming and seq.prompt_embeds is None:", "not resuming:")
    ctx = ProbeContext("engine.prefix_reuse", _params("engine.prefix_reuse"), ".")
    probes._check_mixed_traffic(ctx, probes.HybridModel("tiny"), fresh_generator(), 16, 64)
    assert ("target_stack/engine/scheduler.py", "Scheduler.schedule (prefix match)") in _failures(ctx), ctx.findings


def test_prefix_bench_check_catches_a_cumulative_per_turn_reuse(monkeypatch):
    from target_stack.bench import prefix as bench_prefix

    _plant(monkeypatch, bench_prefix, "run", 'reused = engine.prefix.stats["reused_tokens"] - before',
           'reused = engine.prefix.stats["reused_tokens"]')
    ctx = ProbeContext("engine.prefix_reuse", _params("engine.prefix_reuse"), ".")
    probes._check_prefix_bench(ctx, fresh_generator())
    assert ctx.failed and set(_failures(ctx)) == {(BENCH_PREFIX, "run")}, ctx.findings
    assert any("turn 3 of 3" in f.location.condition for f in ctx.findings)  # turns 1 and 2 are unaffected


def test_a_benchmark_whose_requests_fail_is_a_finding_at_the_benchmark_not_the_end_of_the_probe(monkeypatch):
    """A prefill that fails (here: every prefill from a cached prefix) leaves requests without a first token; the
    benchmark says which, and the probe reports it bound to where it was raised instead of dying mid-check."""
    from target_stack.engine.runner import ModelRunner

    def broken(self, *args, **kwargs):
        raise IndexError("ring position out of range")

    monkeypatch.setattr(ModelRunner, "prefill_from", broken)
    ctx = ProbeContext("engine.prefix_reuse", _params("engine.prefix_reuse"), ".")
    probes._check_prefix_bench(ctx, fresh_generator())
    assert ctx.failed and {f for f, _ in _failures(ctx)} == {BENCH_PREFIX}, ctx.findings
    assert any("before its first token" in f.message and "IndexError" in f.message for f in ctx.findings)


def test_prefix_bench_check_catches_a_share_over_the_wrong_prompts(monkeypatch):
    from target_stack.bench import prefix as bench_prefix

    _plant(monkeypatch, bench_prefix, "run", '"reused_share": reused / sum(len(p) for p in prompts)',
           '"reused_share": reused / (len(prompts) * max(len(p) for p in prompts))')
    ctx = ProbeContext("engine.prefix_reuse", _params("engine.prefix_reuse"), ".")
    probes._check_prefix_bench(ctx, fresh_generator())
    assert ctx.failed and set(_failures(ctx)) == {(BENCH_PREFIX, "run")}, ctx.findings


# -- engine.serve.e2e ---------------------------------------------------------------------------------------------
def _floor_pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1)))] if xs else float("nan")


def _interpolated_pct(xs, q):  # numpy's default: between samples, not one of them
    import numpy as np

    return float(np.percentile(xs, 100 * q)) if xs else float("nan")


def test_serve_statistics_pass_on_the_clean_benchmark():
    ctx = ProbeContext("engine.serve.e2e", _params("engine.serve.e2e"), ".")
    probes._check_serve_statistics(ctx, fresh_generator())
    assert not ctx.failed, [f.message for f in ctx.findings]


@pytest.mark.parametrize("pct", [_floor_pct, _interpolated_pct])
def test_serve_statistics_catch_a_percentile_off_its_definition(monkeypatch, pct):
    from target_stack.bench import serve as bench_serve

    monkeypatch.setattr(bench_serve, "_pct", pct)
    ctx = ProbeContext("engine.serve.e2e", _params("engine.serve.e2e"), ".")
    probes._check_serve_statistics(ctx, fresh_generator())
    assert ctx.failed and ctx.metrics["pct_mismatches"].value > 0
    assert set(_failures(ctx)) == {(BENCH_SERVE, "_pct")}, ctx.findings
    if pct is _floor_pct:  # an even count's p50 and a short run's p99
        conds = [f.location.condition for f in ctx.findings]
        assert any("even count" in c and "q=0.5" in c for c in conds), conds


def test_serve_statistics_catch_a_throughput_over_the_wrong_time(monkeypatch):
    from target_stack.bench import serve as bench_serve

    _plant(monkeypatch, bench_serve, "_latency_stats", "tokens / makespan if", "tokens / (makespan + 1) if")
    ctx = ProbeContext("engine.serve.e2e", _params("engine.serve.e2e"), ".")
    probes._check_serve_statistics(ctx, fresh_generator())
    assert set(_failures(ctx)) == {(BENCH_SERVE, "_latency_stats")}, ctx.findings


class _StandInCluster:
    """DisaggCluster's interface without processes: every request's timings drawn at random (a monotonic
    sequence of stages), outputs of max_tokens tokens; a run takes a few milliseconds."""

    def __init__(self, cfg=None, *, stages=2, transfer=True, decode=True, copy="gather", num_pages=512, page_size=16,
                 num_slots=65, max_batch=32, max_model_len=2048):
        self.gen = fresh_generator()

    def run(self, requests, arrivals=None, timeout_s=600.0, transfer=True):
        from target_stack.engine.disagg import DisaggResult, Timing
        from target_stack.engine.sequence import RequestOutput

        outs, timings = [], []
        for i, (prompt, params, _) in enumerate(requests):
            steps = (torch.rand(5, generator=self.gen, dtype=torch.float64) * 0.01 + 1e-4).cumsum(0).tolist()
            t = time.monotonic()
            timings.append(Timing(arrival=t, prefill_start=t + steps[0], prefill_done=t + steps[1],
                                  transfer_done=t + steps[2], first_token=t + steps[3], done=t + steps[4]))
            outs.append(RequestOutput(id=i, prompt=prompt, tokens=[1] * params.max_tokens, finish_reason="length",
                                      ttft_s=steps[3], latency_s=steps[4]))
        time.sleep(0.005)
        return DisaggResult(outs, timings, {})

    def close(self, timeout_s=30.0):
        return {"prefill": {"pages": 0}, "decode": {"pages": 0}}


@pytest.fixture
def stand_in(monkeypatch):
    import target_stack.engine.disagg as disagg

    monkeypatch.setattr(disagg, "DisaggCluster", _StandInCluster)


def test_serve_e2e_recomputes_the_run_and_passes_on_the_clean_benchmark(stand_in):
    ctx = ProbeContext("engine.serve.e2e", _params("engine.serve.e2e"), ".")
    probes.serve_e2e(ctx)
    assert not ctx.failed, [f.message for f in ctx.findings]
    assert "ttft_ms_p99" in ctx.metrics


@pytest.mark.parametrize("plant", ["floor", "tpot_over_all_tokens"])
def test_serve_e2e_catches_a_figure_off_the_runs_timings(stand_in, monkeypatch, plant):
    from target_stack.bench import serve as bench_serve

    if plant == "floor":
        monkeypatch.setattr(bench_serve, "_pct", _floor_pct)
        want = (BENCH_SERVE, "_pct")
    else:
        _plant(monkeypatch, bench_serve, "run_disagg", "(t.done - t.first_token) / (len(o.tokens) - 1)",
               "(t.done - t.first_token) / len(o.tokens)")
        want = (BENCH_SERVE, "_pct")  # the TPOT percentiles differ from the timings'
    ctx = ProbeContext("engine.serve.e2e", _params("engine.serve.e2e"), ".")
    run_checks = []
    monkeypatch.setattr(probes, "_check_serve_statistics", lambda *a: None)  # only the run's own figures
    check_run = probes._check_serve_run
    monkeypatch.setattr(probes, "_check_serve_run", lambda *a: run_checks.append(1) or check_run(*a))
    probes.serve_e2e(ctx)
    assert run_checks and ctx.failed and want in _failures(ctx), ctx.findings
    assert any("of the e2e run" in f.location.condition for f in ctx.findings)
