"""Runtime events as Chrome / Perfetto trace JSON: open them in ui.perfetto.dev or chrome://tracing.

A probe's events (``feedback/events.py``: one JSON object a line, ``t`` in ``time.monotonic()``
seconds, ``pid``, ``thread``) become the trace-event format's objects: ``X.start``/``X.done`` and
``X.enter``/``X.exit`` pairs (within one thread of one process, matched by ``id`` where they carry
one) are complete events (``ph: X``) with their fields as ``args``; unpaired events are instants
(``ph: i``); the GIL sampler's ticks are a counter of how late each tick came (``ph: C``); every
process and thread is named (``ph: M``), so the KV-transfer thread waiting for the GIL is a row of
its own.  With ``infra-agent feedback --trace-dir DIR`` (``INFRA_AGENT_TRACE_DIR``), every probe that
reads its events writes ``DIR/<probe>.<pid>.events.json``; :func:`problems` checks a trace against
the format.
"""

from __future__ import annotations

import json
import os
import pathlib

PAIRS = ((".start", ".done"), (".enter", ".exit"))
_REQUIRED = {"X": ("name", "ts", "dur", "pid", "tid"), "i": ("name", "ts", "pid", "tid", "s"),
             "C": ("name", "ts", "pid", "args"), "M": ("name", "pid", "args")}


def trace_events(events: list[dict], name: str = "infra-agent") -> dict:
    """The trace-event JSON object of ``events`` (timestamps in microseconds from the earliest moment they
    name: the first event, or a GIL tick its sampler took before any event was written)."""
    events = sorted((e for e in events if "t" in e and "event" in e), key=lambda e: e["t"])
    ticks = [t for e in events if e["event"] == "gil.ticks" for t in (e.get("ticks") or [])]
    t0 = min([events[0]["t"], *ticks]) if events else 0.0
    us = lambda t: round((t - t0) * 1e6, 3)  # noqa: E731
    tids: dict[tuple[int, str], int] = {}

    def tid(e: dict) -> int:
        key = (int(e.get("pid", 0)), str(e.get("thread", "main")))
        return tids.setdefault(key, len(tids) + 1)

    out: list[dict] = []
    open_: dict[tuple, dict] = {}
    for e in events:
        ev, pid = e["event"], int(e.get("pid", 0))
        args = {k: v for k, v in e.items() if k not in ("t", "event", "pid", "thread", "ticks")}
        if ev == "gil.ticks":
            ticks = sorted(e.get("ticks") or [])
            for a, b in zip(ticks, ticks[1:]):
                out.append({"name": "gil tick gap ms", "ph": "C", "ts": us(b), "pid": pid,
                            "args": {"gap_ms": round((b - a) * 1e3, 3)}})
            continue
        for start, end in PAIRS:
            if ev.endswith(start):
                open_[(ev[: -len(start)], end, pid, tid(e), e.get("id"))] = e
                break
            if ev.endswith(end):
                begin = open_.pop((ev[: -len(end)], end, pid, tid(e), e.get("id")), None)
                if begin is not None:
                    both = {**{k: v for k, v in begin.items() if k not in ("t", "event", "pid", "thread")}, **args}
                    out.append({"name": ev[: -len(end)], "ph": "X", "ts": us(begin["t"]),
                                "dur": round((e["t"] - begin["t"]) * 1e6, 3), "pid": pid, "tid": tid(e),
                                "args": both})
                    break
        else:
            out.append({"name": ev, "ph": "i", "s": "t", "ts": us(e["t"]), "pid": pid, "tid": tid(e),
                        "args": args})
    for (base, _end, pid, t, _id), begin in open_.items():  # never ended: an instant where it began
        out.append({"name": f"{base} (no end)", "ph": "i", "s": "t", "ts": us(begin["t"]), "pid": pid, "tid": t,
                    "args": {}})
    for pid in sorted({p for p, _ in tids}):
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{name} pid {pid}"}})
    for (pid, thread), t in tids.items():
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": thread}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"source": name}}


def problems(trace: dict) -> list[str]:
    """What in ``trace`` the trace-event format does not allow (empty: a valid trace)."""
    out = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    for i, e in enumerate(trace["traceEvents"]):
        ph = e.get("ph") if isinstance(e, dict) else None
        if ph not in _REQUIRED:
            out.append(f"event {i}: unknown phase {ph!r}")
            continue
        missing = [k for k in _REQUIRED[ph] if k not in e]
        if missing:
            out.append(f"event {i} ({ph}): missing {missing}")
        for k in ("ts", "dur"):
            if k in e and not (isinstance(e[k], (int, float)) and e[k] >= 0):
                out.append(f"event {i} ({ph}): {k} must be a non-negative number, got {e[k]!r}")
        if ph == "i" and e.get("s") not in ("g", "p", "t"):
            out.append(f"event {i} (i): scope must be g, p or t")
    return out


def export(events: list[dict], source: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Write ``events`` as a trace into ``INFRA_AGENT_TRACE_DIR``, if set: one file per probe run."""
    folder = os.environ.get("INFRA_AGENT_TRACE_DIR")
    if not folder or not events:
        return None
    probe = os.environ.get("INFRA_AGENT_PROBE_ID", "events")
    path = pathlib.Path(folder) / f"{probe}.{os.getpid()}.events.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(list(path.parent.glob(f"{probe}.{os.getpid()}.events*.json")))
    if n:  # a probe that reads several event files: one trace each
        path = path.with_name(f"{probe}.{os.getpid()}.events-{n}.json")
    path.write_text(json.dumps(trace_events(events, name=f"{probe}" + (f" ({source})" if source else ""))))
    return path
