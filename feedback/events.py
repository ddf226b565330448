"""Runtime events, the harness's side: the format a target writes, and what a probe reads from it.

The target writes its own events (a few lines of code; ``target_stack.events`` is one): to
the file named by ``INFRA_AGENT_EVENTS`` (set by the probe that wants them), one JSON object a line,

    {"t": <time.monotonic()>, "event": "kv_transfer.start", "pid": <pid>, "thread": "<thread name>", ...}

appending, nothing written when the variable is unset.  Spans are ``X.start``/``X.done`` or
``X.enter``/``X.exit`` pairs (see :func:`spans`).  With ``INFRA_AGENT_GIL_SAMPLE_S`` also set, each
writing process runs a sampler thread that wakes every that many seconds and notes
``time.monotonic()``, which it can only read holding the GIL, writing its ticks in batches as
``{"event": "gil.ticks", "ticks": [...]}``; :func:`gil_blocked` tells from them which native calls
kept every other Python thread out.

:class:`Heartbeat` runs a Python thread that wakes every ``interval_s`` and records how late it
woke: a thread kept from running by another holding the GIL shows as long gaps.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import threading
import time

from pydantic import BaseModel

ENV_VAR = "INFRA_AGENT_EVENTS"
#: seconds between the GIL sampler's ticks; set (with ``ENV_VAR``) to start one in every process that writes
SAMPLE_VAR = "INFRA_AGENT_GIL_SAMPLE_S"


def gil_blocked(events: list[dict], start: str = "dispatch.enter", end: str = "dispatch.exit") -> list[float]:
    """For every ``start``/``end`` span (paired within one thread of one process), the fraction of it
    that the process's GIL sampler could not run: its longest stretch without a tick over its length.
    Near 1 for a call that keeps the GIL, near 0 for one that releases it (with a sampler interval well
    below the span).  Spans in processes without a sampler, or after its last batch, are left out."""
    ticks: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "gil.ticks":
            ticks.setdefault(e["pid"], []).extend(e["ticks"])
    for ts in ticks.values():
        ts.sort()
    out, open_ = [], {}
    for e in sorted(events, key=lambda e: e["t"]):
        key = (e.get("pid"), e.get("thread"))
        if e["event"] == start:
            open_[key] = e["t"]
        elif e["event"] == end and key in open_ and e.get("pid") in ticks:
            t0, t1 = open_.pop(key), e["t"]
            ts = ticks[e["pid"]]
            if t1 <= t0 or t1 > ts[-1]:  # after the last batch the sampler wrote: not observed
                continue
            lo, hi = bisect.bisect_right(ts, t0), bisect.bisect_left(ts, t1)
            edges = [t0, *ts[lo:hi], t1]
            out.append(max(b - a for a, b in zip(edges, edges[1:], strict=False)) / (t1 - t0))
    return out



def sampler_faults(events: list[dict]) -> list[str]:
    """What breaks the GIL sampler's contract in ``events``, one line per process at fault: every batch a
    sampler writes holds the ticks since its previous batch, each once, increasing, none later than the
    batch's own event time.  A sampler that writes a tick twice (a batch repeating earlier ones) hides
    nothing from :func:`gil_blocked`, which is why this is checked apart: empty for a sound stream."""
    batches: dict[int, list[dict]] = {}
    for e in events:
        if e.get("event") == "gil.ticks":
            batches.setdefault(e.get("pid"), []).append(e)
    out = []
    for pid, ours in batches.items():
        last, repeated, unordered, late, total = float("-inf"), 0, 0, 0, 0
        for e in sorted(ours, key=lambda e: e["t"]):
            ticks = [float(t) for t in e.get("ticks", [])]
            total += len(ticks)
            repeated += sum(t <= last for t in ticks)  # at or before the previous batch's last tick
            unordered += sum(b <= a for a, b in zip(ticks, ticks[1:], strict=False))
            late += sum(t > e["t"] for t in ticks)
            last = max([last, *ticks])
        if repeated or unordered or late:
            out.append(f"pid {pid}: of {total} ticks in {len(ours)} batches, {repeated} repeat an earlier "
                       f"batch's, {unordered} do not increase within a batch, {late} are later than their batch")
    return out

#: spans of the events a probe read that its result keeps (the longest, where there are more)
TIMELINE_SPANS = 400
_timeline: list[dict] = []  # of the last events this process read


def timeline(events: list[dict], limit: int = TIMELINE_SPANS) -> list[dict]:
    """The spans of ``events`` as ``{thread, name, start_ms, dur_ms, depth}``: start/done and enter/exit pairs;
    ``X.submit`` to ``X.start`` of the same ``id`` as ``X (queued)`` on the thread that starts it (work handed
    to a thread that could not run yet: a transfer thread waiting for the GIL); an unpaired event as a span
    of no length.  ``depth`` nests a span inside the one around it on its thread; a thread is named
    ``pid N: name`` where several processes wrote.  At most ``limit`` spans, the longest kept."""
    from feedback import perfetto

    trace = perfetto.trace_events(events)["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    several = len({pid for pid, _ in names}) > 1

    def label(pid, thread) -> str:
        return (f"pid {pid}: " if several else "") + str(thread)

    out = [{"thread": label(e["pid"], names.get((e["pid"], e["tid"]), "?")), "name": e["name"],
            "start_ms": e["ts"] / 1e3, "dur_ms": e.get("dur", 0.0) / 1e3}
           for e in trace if e["ph"] in ("X", "i") and not e["name"].endswith(".submit")]
    t0 = min((e["t"] for e in events if "t" in e and "event" in e), default=0.0)
    submitted = {}
    for e in sorted((e for e in events if "t" in e and "event" in e), key=lambda e: e["t"]):
        name = e["event"]
        if name.endswith(".submit"):
            submitted[(name[:-7], e.get("id"), e.get("pid"))] = e
        elif name.endswith(".start") and (sub := submitted.pop((name[:-6], e.get("id"), e.get("pid")), None)):
            out.append({"thread": label(e.get("pid", 0), e.get("thread", "main")), "name": f"{name[:-6]} (queued)",
                        "start_ms": (sub["t"] - t0) * 1e3, "dur_ms": (e["t"] - sub["t"]) * 1e3})
    if len(out) > limit:
        out = sorted(out, key=lambda s: -s["dur_ms"])[:limit]
    out.sort(key=lambda s: (s["thread"], s["start_ms"], -s["dur_ms"]))
    open_: list[tuple[str, float]] = []  # (thread, end) of the spans around the current one
    for s in out:
        open_ = [(t, end) for t, end in open_ if t == s["thread"] and end > s["start_ms"] + 1e-3]  # 1 us: rounding
        s["depth"] = len(open_)
        open_.append((s["thread"], s["start_ms"] + s["dur_ms"]))
        s["start_ms"], s["dur_ms"] = round(s["start_ms"], 4), round(s["dur_ms"], 4)
    return out


def captured_timeline() -> list[dict]:
    """The timeline of the last events this process read (what the probe worker puts in its result)."""
    return list(_timeline)


def load_events(path: str | os.PathLike) -> list[dict]:
    """Events from a JSONL file as they stand (a file still being written may be read again); a torn line
    (a killed writer, or one mid-write) is skipped, not an error."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def read_events(path: str | os.PathLike) -> list[dict]:
    """Events from a JSONL file (``load_events``), read once a run is over.

    With ``--trace-dir`` (``INFRA_AGENT_TRACE_DIR``) they are also written there as a Chrome/Perfetto
    trace, threads named (``feedback/perfetto.py``): whatever a probe reads, a person can look at."""
    out = load_events(path)
    from feedback import perfetto

    perfetto.export(out, source=os.path.basename(path))
    _timeline[:] = timeline(out)
    return out


def spans(events: list[dict], start_suffix: str = ".start", end_suffix: str = ".done",
          key: str = "id") -> list[tuple[str, float]]:
    """Pair ``X<start_suffix>``/``X<end_suffix>`` events (by ``key`` within one process) into
    (name, seconds) spans: a trace written by several processes pairs each one's own events."""
    open_: dict[tuple, float] = {}
    out = []
    for e in sorted(events, key=lambda e: e["t"]):
        name = e["event"]
        if name.endswith(start_suffix):
            open_[(name[: -len(start_suffix)], e.get(key), e.get("pid"))] = e["t"]
        elif name.endswith(end_suffix):
            base = name[: -len(end_suffix)]
            t0 = open_.pop((base, e.get(key), e.get("pid")), None)
            if t0 is not None:
                out.append((base, e["t"] - t0))
    return out


class HeartbeatReport(BaseModel):
    beats: int
    interval_s: float
    wall_s: float
    max_gap_s: float
    p99_gap_s: float
    mean_gap_s: float
    starved_s: float  # total time beyond the interval: how long the thread was kept from running


class Heartbeat:
    """A Python thread that measures how long it is kept from running (GIL starvation shows here)."""

    def __init__(self, interval_s: float = 0.001, name: str = "heartbeat"):
        self.interval_s = interval_s
        self.name = name
        self._stop = threading.Event()
        self._gaps: list[float] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._t0 = 0.0
        self._t1 = 0.0

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(self.interval_s)
            now = time.perf_counter()
            self._gaps.append(now - last)
            last = now

    def __enter__(self) -> Heartbeat:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._t1 = time.perf_counter()

    def report(self) -> HeartbeatReport:
        gaps = sorted(self._gaps) or [0.0]
        return HeartbeatReport(
            beats=len(self._gaps), interval_s=self.interval_s, wall_s=self._t1 - self._t0,
            max_gap_s=gaps[-1], p99_gap_s=gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            mean_gap_s=statistics.fmean(gaps), starved_s=sum(max(0.0, g - self.interval_s) for g in self._gaps))
