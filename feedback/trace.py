"""Trace capture for probes: torch.profiler around a callable, a Chrome/Perfetto JSON, a summary.

The summary ranks ops (CPU) and kernels (CUDA) by their own time, which is what localises a
regression to a kernel rather than to "the step got slower".
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

from pydantic import BaseModel


class OpTime(BaseModel):
    name: str
    device: str  # "cpu" or "cuda"
    calls: int
    self_us: float
    share: float  # of the total self time on that device


class TraceSummary(BaseModel):
    trace_file: str | None
    top: list[OpTime]
    total_cpu_us: float
    total_cuda_us: float


def trace_dir(default: str | pathlib.Path | None = None) -> pathlib.Path | None:
    """Where traces go: ``INFRA_AGENT_TRACE_DIR`` (set by ``infra-agent feedback --trace-dir``) or ``default``."""
    d = os.environ.get("INFRA_AGENT_TRACE_DIR") or default
    return pathlib.Path(d) if d else None


def capture(fn: Callable[[], object], name: str, out_dir: str | pathlib.Path | None = None, top: int = 10,
            warmup: int = 1) -> TraceSummary:
    """Profile one call of ``fn`` (after ``warmup`` calls); export a Chrome trace if ``out_dir``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    # the GPU is traced only where the work uses it: work that never touched CUDA would otherwise have the
    # context's creation (a synchronisation's first call: hundreds of ms of cudaDeviceSynchronize) ranked
    # above its own ops.  Without a warmup call nothing says yet, so an available GPU is traced.
    on_gpu = torch.cuda.is_available() and (torch.cuda.is_initialized() or warmup == 0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, record_shapes=False) as prof:
        fn()
        if on_gpu:
            torch.cuda.synchronize()
    path = None
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{name}.trace.json"
        prof.export_chrome_trace(str(path))
    rows: list[OpTime] = []
    events = prof.key_averages()
    tot_cpu = sum(e.self_cpu_time_total for e in events) or 1.0
    dev_attr = "self_device_time_total" if hasattr(events[0] if len(events) else None, "self_device_time_total") \
        else "self_cuda_time_total"
    tot_cuda = sum(getattr(e, dev_attr, 0.0) for e in events) or 0.0
    for e in events:
        rows.append(OpTime(name=e.key, device="cpu", calls=e.count, self_us=e.self_cpu_time_total,
                           share=e.self_cpu_time_total / tot_cpu))
        cuda_t = getattr(e, dev_attr, 0.0)
        if cuda_t > 0:
            rows.append(OpTime(name=e.key, device="cuda", calls=e.count, self_us=cuda_t, share=cuda_t / tot_cuda))
    rows.sort(key=lambda r: (r.device != "cuda", -r.self_us))
    return TraceSummary(trace_file=str(path) if path else None, top=rows[:top], total_cpu_us=tot_cpu,
                        total_cuda_us=tot_cuda)
