"""Runtime events as Chrome/Perfetto traces (feedback/perfetto.py): the format, and the real thing, the
bundled target's KV-transfer events exported by ``infra-agent feedback --trace-dir``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from feedback.perfetto import problems, trace_events


def test_spans_instants_ticks_and_names_in_the_trace_event_format():
    events = [
        {"t": 10.000, "event": "prefill.layer.enter", "pid": 7, "thread": "MainThread", "layer": 0},
        {"t": 10.004, "event": "kv_transfer.start", "pid": 7, "thread": "kv-transfer", "id": "r1:3"},
        {"t": 10.002, "event": "dispatch.enter", "pid": 7, "thread": "MainThread"},
        {"t": 10.010, "event": "dispatch.exit", "pid": 7, "thread": "MainThread"},
        {"t": 10.012, "event": "prefill.layer.exit", "pid": 7, "thread": "MainThread", "layer": 0},
        {"t": 10.020, "event": "kv_transfer.done", "pid": 7, "thread": "kv-transfer", "id": "r1:3", "bytes": 4096},
        {"t": 10.021, "event": "decode.adopt", "pid": 9, "thread": "MainThread", "rid": 1},
        {"t": 10.030, "event": "gil.ticks", "pid": 7, "thread": "gil-sampler", "ticks": [10.0, 10.001, 10.009]},
        {"t": 10.040, "event": "kv_transfer.start", "pid": 7, "thread": "kv-transfer", "id": "r2:3"},
    ]
    trace = trace_events(events, name="unit")
    assert problems(trace) == []
    xs = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert set(xs) == {"prefill.layer", "dispatch", "kv_transfer"}
    assert abs(xs["kv_transfer"]["dur"] - 16000) < 1 and xs["kv_transfer"]["args"]["bytes"] == 4096
    assert abs(xs["dispatch"]["ts"] - 2000) < 1  # microseconds from the first event
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {(7, "MainThread"), (7, "kv-transfer"), (9, "MainThread")} <= names
    assert [e["args"]["gap_ms"] for e in trace["traceEvents"] if e["ph"] == "C"] == [1.0, 8.0]
    assert any(e["name"] == "kv_transfer (no end)" for e in trace["traceEvents"])  # never ended: still shown
    assert any(e["name"] == "decode.adopt" and e["ph"] == "i" for e in trace["traceEvents"])
    assert problems({"traceEvents": [{"ph": "X", "name": "x", "ts": -1, "dur": 1, "pid": 1, "tid": 1}]})
    # a sampler's ticks taken before the first event written (a worker's, on a GPU) start the time axis
    early = trace_events([{"t": 5.0, "event": "dispatch.enter", "pid": 3},
                          {"t": 5.2, "event": "gil.ticks", "pid": 3, "ticks": [4.997, 4.998, 5.1]}])
    assert problems(early) == [] and min(e["ts"] for e in early["traceEvents"] if "ts" in e) == 1000.0
    assert problems({"events": []}) == ["not a JSON object with a traceEvents list"]


def test_the_kv_transfer_probe_writes_a_trace_with_the_transfer_thread_named(tmp_path):
    out = tmp_path / "traces"
    run = subprocess.run([sys.executable, "-m", "infra_agent.cli", "feedback", "--probe", "engine.kv_transfer.events",
                          "--trace-dir", str(out), "--no-cache", "--json"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "COLUMNS": "160"})
    assert run.returncode in (0, 1), run.stderr[-2000:]
    files = sorted(out.glob("engine.kv_transfer.events.*.events*.json"))
    assert files, (list(out.rglob("*")), run.stdout[-1500:])
    trace = json.loads(files[0].read_text())
    assert problems(trace) == []
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert any("transfer" in t for t in threads), threads
    assert any(e["ph"] == "X" and e["name"].startswith("kv_transfer") for e in trace["traceEvents"])
