"""The harness's building blocks: A/B statistics, roofline, traces, events and GIL starvation, e2e."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from feedback.correctness import compare_sweep, error_growth, partitioned_vs_whole, rel_err
from feedback.e2e import metrics_from_records, parse_output, run_benchmark
from feedback.events import ENV_VAR, SAMPLE_VAR, Heartbeat, gil_blocked, read_events, spans
from feedback.microbench import ab_compare, roofline_check
from feedback.trace import capture
from target_stack.events import emit

ROOT = pathlib.Path(__file__).resolve().parents[1]

# --- correctness helpers ------------------------------------------------------------------------


def test_rel_err_flags_non_finite_and_shape_mismatch():
    ref = torch.ones(4, dtype=torch.float64)
    assert rel_err(ref * (1 + 1e-6), ref) == pytest.approx(1e-6, rel=1e-6)
    assert rel_err(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == float("inf")
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_err(torch.ones(3), ref)


def test_compare_sweep_partitioned_and_growth_on_a_real_reduction():
    # fp32 sequential sum against float64: error grows with the length, the helpers must see it
    def f32_sum(x):
        acc = torch.zeros((), dtype=torch.float32)
        for chunk in x.float().split(256):
            acc = acc + chunk.sum()
        return acc.reshape(1)

    def f64_sum(x):
        return x.double().sum().reshape(1)

    sweep = compare_sweep(f32_sum, f64_sum, lambda c, g: (torch.rand(c["n"], generator=g, dtype=torch.float64),),
                          [{"n": 1000}, {"n": 100000}])
    assert all(0 <= e < 1e-5 for _, e in sweep)
    x = torch.rand(4096, dtype=torch.float64)
    parts = partitioned_vs_whole(lambda p: torch.stack([c.sum() for c in x.split(4096 // p)]).sum().reshape(1),
                                 lambda: x.sum().reshape(1), [1, 4, 16])
    assert [p for p, _ in parts] == [1, 4, 16] and all(e < 1e-12 for _, e in parts)
    errs, growth = error_growth(lambda n: 10.0 * n, [1, 8])
    assert errs == [10.0, 80.0] and growth == 8.0


# --- microbench statistics (deterministic timers: the statistics are under test, not the CPU) ---


def _scripted_timer(samples_a, samples_b):
    """A timer that returns scripted samples for the callables tagged 'a' and 'b'."""
    it = {"a": iter(samples_a), "b": iter(samples_b)}
    return lambda fn: next(it[fn.tag])


def _tagged(tag):
    def fn():
        return None

    fn.tag = tag
    return fn


def test_ab_compare_verdicts_from_the_bootstrap_interval():
    a, b = _tagged("a"), _tagged("b")
    base = [1.0 + 0.01 * (i % 5) for i in range(33)]
    faster = ab_compare(a, b, reps=30, warmup=0, timer=_scripted_timer(base, [0.5 * x for x in base]))
    assert faster.verdict == "faster" and faster.ci_high < 1 and faster.ratio == pytest.approx(0.5)
    slower = ab_compare(a, b, reps=30, warmup=0, timer=_scripted_timer(base, [1.3 * x for x in base]))
    assert slower.verdict == "slower" and slower.ci_low > 1
    same = ab_compare(a, b, reps=30, warmup=0, timer=_scripted_timer(base, list(reversed(base))))
    assert same.verdict == "no difference" and same.ci_low <= 1 <= same.ci_high and not same.noisy
    noisy = ab_compare(a, b, reps=30, warmup=0,
                       timer=_scripted_timer([1.0, 3.0] * 17, [1.0, 3.1] * 17))
    assert noisy.noisy


def test_ab_compare_interleaves_a_and_b():
    order = []
    a, b = _tagged("a"), _tagged("b")

    def timer(fn):
        order.append(fn.tag)
        return 1.0

    ab_compare(a, b, reps=4, warmup=0, timer=timer)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_ab_compare_on_real_cpu_work_sees_a_4x_difference():
    x = torch.rand(256, 256)
    small = lambda: x @ x  # noqa: E731
    big = lambda: [x @ x for _ in range(4)]  # noqa: E731
    res = ab_compare(small, big, reps=15)
    assert res.verdict == "slower" and res.ratio > 2


def test_roofline_flags_results_faster_than_physics():
    # 1 GB moved in 0.1 ms on a 4 TB/s device: impossible
    bad = roofline_check(1e-4, bytes_moved=1e9, peak_bytes_per_s=4e12)
    assert bad.suspicious and "faster than" in bad.reason and bad.bandwidth_fraction > 1
    ok = roofline_check(5e-4, bytes_moved=1e9, peak_bytes_per_s=4e12)
    assert not ok.suspicious and ok.bandwidth_fraction == pytest.approx(0.5)
    flops = roofline_check(1e-6, flops=1e12, peak_flops=1e15, peak_bytes_per_s=4e12)
    assert flops.suspicious


# --- traces ---------------------------------------------------------------------------------------


def test_trace_capture_exports_a_chrome_trace_and_ranks_ops(tmp_path):
    x = torch.rand(128, 128)

    def work():
        for _ in range(20):
            torch.matmul(x, x)
        torch.sigmoid(x)

    summary = capture(work, "unit", out_dir=tmp_path)
    data = json.loads((tmp_path / "unit.trace.json").read_text())
    assert "traceEvents" in data and any("matmul" in e.get("name", "") or "mm" in e.get("name", "")
                                         for e in data["traceEvents"])
    names = [op.name for op in summary.top]
    assert any("mm" in n or "matmul" in n for n in names[:3])
    assert summary.total_cpu_us > 0 and abs(sum(o.share for o in summary.top if o.device == "cpu") - 1) < 0.5


# --- events and GIL starvation -------------------------------------------------------------------


def test_events_are_jsonl_with_spans_and_survive_a_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("INFRA_AGENT_EVENTS", str(path))
    emit("kv_transfer.start", id=1, bytes=4096)
    emit("kv_transfer.done", id=1)
    t = threading.Thread(target=lambda: emit("prefill.start", id=7), name="prefill-thread")
    t.start()
    t.join()
    with open(path, "a") as f:
        f.write('{"t": 1.0, "event": "torn')  # a writer killed mid-line
    events = read_events(path)
    assert [e["event"] for e in events] == ["kv_transfer.start", "kv_transfer.done", "prefill.start"]
    assert events[2]["thread"] == "prefill-thread" and events[0]["bytes"] == 4096
    ((name, secs),) = spans(events)
    assert name == "kv_transfer" and secs >= 0


def test_emit_is_a_no_op_without_a_destination(monkeypatch, tmp_path):
    monkeypatch.delenv("INFRA_AGENT_EVENTS", raising=False)
    emit("anything", x=1)  # must not raise or write


def _native_sleep(lib_type):
    libc = lib_type(ctypes.util.find_library("c"))
    libc.usleep.argtypes = [ctypes.c_uint]
    return libc.usleep


def test_heartbeat_shows_a_native_call_that_holds_the_gil():
    """ctypes.PyDLL keeps the GIL during the call, ctypes.CDLL releases it: a real GIL effect."""
    results = {}
    for name, lib in (("holds", ctypes.PyDLL), ("releases", ctypes.CDLL)):
        usleep = _native_sleep(lib)
        with Heartbeat(interval_s=0.001) as hb:
            for _ in range(10):
                usleep(20_000)  # 20 ms of blocking native work
        results[name] = hb.report()
    holds, releases = results["holds"], results["releases"]
    assert holds.max_gap_s >= 0.015, holds
    assert releases.max_gap_s < holds.max_gap_s / 2, (releases, holds)
    assert releases.beats > 3 * holds.beats


_SAMPLED = """
import ctypes, ctypes.util, sys, time
from target_stack.events import emit
lib = (ctypes.PyDLL if sys.argv[1] == "holds" else ctypes.CDLL)(ctypes.util.find_library("c"))
lib.usleep.argtypes = [ctypes.c_uint]
for _ in range(6):
    emit("dispatch.enter")
    lib.usleep(20_000)
    emit("dispatch.exit")
    time.sleep(0.005)
time.sleep(0.2)  # the sampler's last batch
"""


def test_the_gil_sampler_tells_a_call_that_keeps_the_gil_from_one_that_releases_it(tmp_path):
    """Each emitting process (here a fresh subprocess, as the engine's workers are) starts its own
    sampler thread from the two variables; ``gil_blocked`` reads the share of every native span that
    the sampler could not run."""
    fractions = {}
    for name in ("holds", "releases"):
        path = tmp_path / f"{name}.jsonl"
        env = {**os.environ, ENV_VAR: str(path), SAMPLE_VAR: "0.0005", "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-c", _SAMPLED, name], env=env, check=True, timeout=60)
        events = read_events(path)
        assert any(e["event"] == "gil.ticks" and e["thread"] == "gil-sampler" for e in events)
        fractions[name] = gil_blocked(events)
    assert len(fractions["holds"]) == len(fractions["releases"]) == 6, fractions
    assert min(fractions["holds"]) > 0.9, fractions  # the sampler sat out (nearly) the whole call
    assert max(fractions["releases"]) < 0.5, fractions


def test_gil_blocked_leaves_out_spans_the_sampler_did_not_see():
    events = [{"t": 1.0, "event": "dispatch.enter", "pid": 1, "thread": "main"},
              {"t": 2.0, "event": "dispatch.exit", "pid": 1, "thread": "main"},
              {"t": 3.0, "event": "dispatch.enter", "pid": 1, "thread": "main"},
              {"t": 4.0, "event": "dispatch.exit", "pid": 1, "thread": "main"},
              {"t": 9.0, "event": "dispatch.enter", "pid": 2, "thread": "main"},  # no sampler in pid 2
              {"t": 9.5, "event": "dispatch.exit", "pid": 2, "thread": "main"},
              {"t": 2.5, "event": "gil.ticks", "pid": 1, "thread": "gil-sampler", "ticks": [1.2, 1.3, 1.9, 2.5]}]
    # the first span's longest tick-free stretch is 1.3 -> 1.9; the second ends after the last tick
    assert gil_blocked(events) == pytest.approx([0.6])


# --- end-to-end serving metrics ------------------------------------------------------------------

FAKE_SERVER_BENCH = textwrap.dedent('''
    import json, random, sys
    rng = random.Random(int(sys.argv[1]))
    reqs, t = [], 0.0
    for i in range(40):
        t += rng.expovariate(20.0)                  # Poisson arrivals
        ttft = 0.05 + 0.01 * rng.random()
        n = rng.randint(8, 64)
        tpot = 0.010 + 0.002 * rng.random()
        reqs.append({"arrival": t, "first_token": t + ttft, "done": t + ttft + tpot * (n - 1), "output_tokens": n})
    print("warming up...")
    print(json.dumps({"requests": reqs, "overheads": {"kv_transfer": 0.004}}))
''')


def test_e2e_reads_ttft_tpot_throughput_from_a_fake_workload(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(FAKE_SERVER_BENCH)
    m = run_benchmark([sys.executable, str(script), "3"])
    out = subprocess.run([sys.executable, str(script), "3"], capture_output=True, text=True, check=True)
    records = json.loads(out.stdout.splitlines()[-1])["requests"]
    assert m.requests == 40 and m.overheads == {"kv_transfer": 0.004}
    assert 50 <= m.ttft_ms_p50 <= 60 and 10 <= m.tpot_ms_p50 <= 12
    tokens = sum(r["output_tokens"] for r in records)
    span = max(r["done"] for r in records) - min(r["arrival"] for r in records)
    assert m.throughput_tok_s == pytest.approx(tokens / span)
    assert m == metrics_from_records(records, {"kv_transfer": 0.004})


def test_e2e_bad_output_is_a_clear_error():
    with pytest.raises(ValueError, match="not JSON"):
        parse_output("hello\nworld")
    with pytest.raises(ValueError, match="lacks"):
        parse_output('{"ttft_ms": 1}')
    with pytest.raises(ValueError, match="no requests"):
        parse_output('{"requests": []}')
    with pytest.raises(RuntimeError, match="exited with 3"):
        run_benchmark([sys.executable, "-c", "import sys; sys.exit(3)"])
