"""Timing that a candidate cannot steer (feedback/timing.py), through the real runner and worker.

A toy target times its own ``op`` with ``ctx.timed``; each cheat below is a real edit of that op
(the kind a model rewarded for "faster" writes) and must end as a failed probe with a reason that
names the cheat, never as a faster time.  The honest op passes with its times witnessed.
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest
import torch

from feedback.manifest import load_manifest
from feedback.models import ProbeResult, Status
from feedback.runner import Runner, witnessed

HONEST = '''
import torch

def op(x, w):
    return torch.tanh(x @ w)
'''

PROBE = '''
import torch
from feedback.correctness import rel_err
from feedback.probe import probe
from tm.op import op


@probe(kind="microbench")
def bench(ctx):
    ref = lambda x, w: torch.tanh(x.double() @ w.double())
    make = lambda i: (torch.randn(96, 96, device=ctx.device), torch.randn(96, 96, device=ctx.device))
    ctx.timed("op", make=make, call=op, check=lambda before, after, out: rel_err(out, ref(*before)),
              reps=int(ctx.params.get("reps", 12)), bytes_moved=float(ctx.params.get("bytes", 0)),
              file="tm/op.py", symbol="op")
'''

MANIFEST = '''
schema_version: 1
name: timed-toy
probes:
  - id: tm.bench
    kind: microbench
    entry: "tm.probes:bench"
    budget_s: 120
    repeats: 1
    covers: {files: ["tm/op.py"]}
    params: {reps: 12, bytes: %s}
'''

SIDE_STREAM = ("""
import torch
_side = torch.cuda.Stream()

def op(x, w):
    out = torch.full((x.shape[0], w.shape[1]), float("nan"), device=x.device)
    _side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_side):  # the timer's stream never waits for this one
        torch.cuda._sleep(50_000_000)
        out.copy_(torch.tanh(x @ w))
    return out
""", "outputs changed after the call returned on its stream")

CHEATS = {
    "a result cached on the input shape": ('''
import torch
_memo = {}

def op(x, w):
    key = (tuple(x.shape), tuple(w.shape))
    if key not in _memo:
        _memo[key] = torch.tanh(x @ w)
    return _memo[key]
''', "wrong when re-checked after timing"),
    "work skipped once warm": ('''
import torch
_calls = [0]
_last = []

def op(x, w):
    _calls[0] += 1
    if _calls[0] > 4 and _last:
        return _last[0]
    _last[:] = [torch.tanh(x @ w)]
    return _last[0]
''', "wrong when re-checked after timing"),
    "the work finished by a thread the timer does not wait for": ('''
import threading, time
import torch

def op(x, w):
    out = torch.full((x.shape[0], w.shape[1]), float("nan"), device=x.device)
    def later():
        time.sleep(0.05)
        out.copy_(torch.tanh(x @ w))
    threading.Thread(target=later, daemon=True).start()
    return out
''', "outputs changed after the call returned"),
    "the clock replaced at import": ('''
import time
import torch
_real = time.perf_counter
time.perf_counter = lambda: _real() * 0.01

def op(x, w):
    return torch.tanh(x @ w)
''', "timing machinery was replaced while the probe ran: time.perf_counter"),
    "the harness's own clock slowed down": ('''
import torch
import feedback.timing as _t
_real = _t._clock
_t._clock = lambda: _real() * 0.01

def op(x, w):
    return torch.tanh(x @ w)
''', "feedback.timing._clock"),
    "a lazily materialised output": ('''
import torch

class Lazy(torch.Tensor):
    pass

def op(x, w):
    return torch.tanh(x @ w).as_subclass(Lazy)
''', "not a materialised torch.Tensor"),
}


def _target(root: pathlib.Path, op: str, bytes_moved: float = 0) -> pathlib.Path:
    (root / "tm").mkdir(parents=True)
    (root / "tm" / "__init__.py").write_text("")
    (root / "tm" / "op.py").write_text(textwrap.dedent(op))
    (root / "tm" / "probes.py").write_text(PROBE)
    (root / "infra-agent.yaml").write_text(MANIFEST % bytes_moved)
    return root


def _run(root: pathlib.Path) -> ProbeResult:
    manifest = load_manifest(root)
    (result,) = Runner(root, manifest, use_cache=False, cache_dir=str(root / ".cache")).run(manifest.probes)
    return result


def test_an_honest_op_is_timed_rechecked_and_witnessed(tmp_path):
    r = _run(_target(tmp_path / "t", HONEST))
    assert r.status == Status.passed, (r.reason, [f.message for f in r.findings], r.stderr[-2000:])
    assert r.metrics["op_us"].value > 0 and r.metrics["op_wall_us"].value > 0
    assert r.metrics["op_rel_err_after_timing"].value < 1e-5
    # the loop's length by the probe's clock, held against the witness: it holds all 12 timed calls, at
    # least 6 of which took the median or longer (the warm-up walls are other calls, so no ratio to them)
    assert r.spans["op"] >= 6 * r.metrics["op_us"].value * 1e-6


@pytest.mark.parametrize("name", list(CHEATS))
def test_a_timing_cheat_fails_with_its_reason(tmp_path, name):
    op, expected = CHEATS[name]
    r = _run(_target(tmp_path / "t", op))
    messages = " | ".join(f.message for f in r.findings)
    assert r.status == Status.failed, (name, r.status, r.reason, messages, r.stderr[-2000:])
    assert expected in messages, (name, messages)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams are a GPU's")
def test_work_on_another_stream_fails_with_its_reason(tmp_path):
    r = _run(_target(tmp_path / "t", SIDE_STREAM[0]))
    messages = " | ".join(f.message for f in r.findings)
    assert r.status == Status.failed and SIDE_STREAM[1] in messages, (r.status, r.reason, messages)


def test_a_time_faster_than_the_bytes_allow_is_flagged(tmp_path):
    # the probe claims the op moves a terabyte: no copy on this machine goes that fast
    r = _run(_target(tmp_path / "t", HONEST, bytes_moved=1e12))
    assert r.status == Status.failed
    assert any("faster than the" in f.message and "roofline allows" in f.message for f in r.findings)


def _result(**spans: float) -> ProbeResult:
    return ProbeResult(probe="p", status=Status.passed, spans=spans)


def test_the_witness_fails_a_probe_clock_that_disagrees_with_the_harness_clock():
    stamps = [(10.0, "op B"), (12.0, "op E")]
    assert witnessed(_result(op=1.98), stamps).status == Status.passed
    slow = witnessed(_result(op=0.2), stamps)  # the probe's clock ran at a tenth of the harness's
    assert slow.status == Status.failed and "the harness's clock 2.0000 s" in slow.findings[0].message
    unseen = witnessed(_result(op=1.0), [(10.0, "op B")])  # the loop never ended where the harness could see
    assert unseen.status == Status.failed and "never saw it begin and end" in unseen.findings[0].message


@pytest.mark.parametrize("n", [16_384, 262_144, 4_194_304])  # 192 KB (in cache), 3 MB, 48 MB (past it)
def test_an_honest_call_is_never_faster_than_its_floor_at_any_cache_level(n):
    # a CPU does not flush its caches between calls: a small call's fresh inputs sit in cache and beat
    # a DRAM-sized copy, so the floor is a copy of the call's own size (bench/RESULTS.md, 2026-12-06d)
    from feedback.timing import measure

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = measure(lambda i: (torch.randn(n, device=device), torch.randn(n, device=device)), torch.add,
                lambda before, after, out: float((out - before[0] - before[1]).abs().max()), device=device,
                reps=10, bytes_moved=3 * 4 * n)
    assert not t.problems, t.problems
    assert 0 < t.floor_s <= t.median_s * 1.05 and t.copy_bytes_per_s > 0


def test_a_device_is_timed_by_its_own_clock_or_refused():
    # "cuda:0" once fell through to the host clock (no event, no synchronize): a GPU call timed by its launch
    from feedback.timing import device_kind, measure

    assert device_kind("cpu") == device_kind(torch.device("cpu")) == device_kind("cpu:0") == "cpu"
    assert device_kind("cuda") == device_kind(torch.device("cuda")) == "cuda"
    if torch.cuda.is_available():
        assert device_kind(f"cuda:{torch.cuda.current_device()}") == "cuda"
        if torch.cuda.device_count() > 1:
            other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
            with pytest.raises(ValueError, match="current CUDA device"):
                device_kind(f"cuda:{other}")
    for odd in ("meta", "mps"):
        with pytest.raises(ValueError, match="CUDA GPU .events. or the CPU"):
            measure(lambda i: (torch.randn(8),), torch.neg, None, device=odd)
    t = measure(lambda i: (torch.randn(4096),), torch.neg, None, device=torch.device("cpu"), reps=4, bytes_moved=32768)
    assert t.device == "cpu" and t.median_s > 0 and not t.problems, t.problems


def test_the_floor_is_the_fastest_copy_including_those_timed_beside_the_calls():
    # measure() hands the copies it timed between the calls to the floor: one faster than any timed later
    # (a neighbour's load arrived after the loop) sets the bandwidth, and slower ones change nothing
    from feedback.timing import _Copy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    copy = _Copy(device, 3 * 4 * 4_194_304)
    quiet = copy.bandwidth()
    assert quiet > 0
    earlier = copy.once() / 8  # as if the copies after the loop ran at an eighth of the speed they had beside it
    assert copy.bandwidth([earlier]) > 4 * quiet
    assert copy.bandwidth([copy.once() * 100]) < 4 * quiet
