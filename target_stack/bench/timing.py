"""GPU timing helpers for target_stack's benchmarks: graph replays, eager calls, device copy."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch

L2_BYTES = 60 * 2**20  # H100/H200: 50/60 MB; used only to size input rotations


def copy_bandwidth(nbytes: int = 2 * 2**30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times[3:])


def graph_time(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median seconds per call of ``calls`` captured back to back in one CUDA graph.

    Each callable should touch its own input set, so that a replay streams from HBM, not L2.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up: compile, autotune, allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


def eager_time(fn: Callable[[], object], iters: int = 200, reps: int = 7) -> float:
    """Median seconds per eager call (host overhead included): calls queued back to back.

    The garbage collector is off while timing, as in ``timeit``: a benchmark process holding
    hundreds of rotating input sets and graphs otherwise pays collection passes inside the loop.
    """
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / iters)
    finally:
        if was_enabled:
            gc.enable()
    return statistics.median(times)


def kernel_times(fn: Callable[[], object], calls: int = 20) -> dict[str, tuple[float, float]]:
    """Each CUDA kernel's device time (us) and launches per call of ``fn``: torch.profiler over ``calls``
    calls, already warm (the caller compiles and warms first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            slot = total.setdefault(ev.name, [0.0, 0])
            slot[0] += ev.device_time_total
            slot[1] += 1
    return {name: (us / calls, n / calls) for name, (us, n) in total.items()}


def rotations(bytes_per_set: int, l2_multiple: float = 4.0, cap: int = 64) -> int:
    """How many distinct input sets make one replay stream ``l2_multiple`` x L2 from memory."""
    return max(2, min(cap, -(-int(l2_multiple * L2_BYTES) // max(1, bytes_per_set))))
