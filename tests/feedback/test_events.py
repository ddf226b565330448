"""Runtime events as a target writes them, read back; GIL starvation seen by a heartbeat and by the sampler."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from feedback.events import (
    ENV_VAR,
    SAMPLE_VAR,
    Heartbeat,
    captured_timeline,
    gil_blocked,
    read_events,
    sampler_faults,
    spans,
    timeline,
)
from target_stack.events import emit

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
    # what the probe's result keeps: the span on its thread, a start never ended as a mark of no length
    line = captured_timeline()
    assert [(s["thread"], s["name"]) for s in line] == [("MainThread", "kv_transfer"),
                                                        ("prefill-thread", "prefill (no end)")]
    assert line[0]["dur_ms"] == pytest.approx(secs * 1e3, abs=1e-3) and line[1]["dur_ms"] == 0


def test_a_timeline_keeps_the_longest_spans_and_names_processes_when_several_wrote():
    events = [{"t": i * 1e-3, "event": f"s.{edge}", "pid": pid, "thread": "w", "id": i // 2}
              for pid in (10, 11) for i, edge in enumerate(["start", "done"] * 6)]
    events += [{"t": 0.0, "event": "long.start", "pid": 10, "thread": "w"}, {"t": 0.5, "event": "long.done", "pid": 10,
                                                                            "thread": "w"}]
    line = timeline(events, limit=3)
    assert len(line) == 3 and line[0]["name"] == "long" and line[0]["dur_ms"] == pytest.approx(500)
    assert {s["thread"] for s in timeline(events)} == {"pid 10: w", "pid 11: w"}


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
        assert sampler_faults(events) == []  # the real sampler writes each tick once, in order
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


def _batches(*ticks_by_batch, pid=1):
    return [{"t": max(ts) + 0.01, "event": "gil.ticks", "pid": pid, "thread": "gil-sampler", "ticks": list(ts)}
            for ts in ticks_by_batch]


def test_sampler_faults_names_ticks_written_twice_out_of_order_or_late():
    sound = _batches([1.0, 1.1], [1.2, 1.3]) + _batches([1.0, 1.5], pid=2)  # processes apart: own clocks
    assert sampler_faults(sound) == []
    # a sampler that never empties its buffer: every batch repeats the earlier ones
    growing = _batches([1.0, 1.1], [1.0, 1.1, 1.2, 1.3], [1.0, 1.1, 1.2, 1.3, 1.4])
    (fault,) = sampler_faults(growing)
    assert fault.startswith("pid 1:") and "6 repeat" in fault
    assert "do not increase" in sampler_faults(_batches([1.0, 0.9]))[0]
    late = _batches([1.0, 1.1])
    late[0]["t"] = 1.05
    assert "1 are later" in sampler_faults(late)[0]
    # the verdict on the stream is unchanged by the repeats: why the probe checks them apart
    spans_ = [{"t": 1.15, "event": "dispatch.enter", "pid": 1, "thread": "main"},
              {"t": 1.35, "event": "dispatch.exit", "pid": 1, "thread": "main"}]
    assert gil_blocked(spans_ + growing) == pytest.approx(gil_blocked(spans_ + _batches([1.0, 1.1], [1.2, 1.3], [1.4])))
