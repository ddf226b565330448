"""The engine's runtime events, written by the engine itself in the JSONL format infra-agent reads
(``feedback/events.py`` describes it): prefill, dispatch and KV-transfer spans for a probe that sets
``INFRA_AGENT_EVENTS``; nothing at all without it (one dictionary lookup per call).

With ``INFRA_AGENT_GIL_SAMPLE_S`` also set, each process that writes events runs a sampler thread
that notes the time every that many seconds.  Reading the clock from Python needs the GIL, so a
native call that keeps the GIL shows as a stretch with no tick.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

EVENTS_VAR = "INFRA_AGENT_EVENTS"
SAMPLE_VAR = "INFRA_AGENT_GIL_SAMPLE_S"
_lock = threading.Lock()
_files: dict[str, Any] = {}
_sampler_pid: int | None = None  # the process whose sampler runs (a forked child starts its own)


def emit(name: str, **fields: Any) -> None:
    """Record one event (a no-op unless ``INFRA_AGENT_EVENTS`` names a file)."""
    path = os.environ.get(EVENTS_VAR)
    if not path:
        return
    if _sampler_pid != os.getpid() and os.environ.get(SAMPLE_VAR):
        _start_sampler(float(os.environ[SAMPLE_VAR]))
    record = {"t": time.monotonic(), "event": name, "pid": os.getpid(),
              "thread": threading.current_thread().name, **fields}
    line = json.dumps(record, default=str) + "\n"
    with _lock:
        f = _files.get(path)
        if f is None:
            f = _files[path] = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        f.write(line)


def _start_sampler(interval_s: float) -> None:
    """The GIL sampler: a daemon thread writing its ticks as ``gil.ticks`` events, 20 batches a second."""
    global _sampler_pid
    with _lock:
        if _sampler_pid == os.getpid():
            return
        _sampler_pid = os.getpid()

    def run() -> None:
        ticks: list[float] = []
        flushed = time.monotonic()
        while True:
            time.sleep(interval_s)
            now = time.monotonic()
            ticks.append(now)
            if now - flushed > 0.05:
                emit("gil.ticks", ticks=ticks)
                ticks, flushed = [], now

    threading.Thread(target=run, name="gil-sampler", daemon=True).start()
