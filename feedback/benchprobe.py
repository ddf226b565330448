"""A ``bench`` probe: a callable of the tree timed by the harness, with no probe code written.

The manifest names the call, a maker of fresh inputs and (optionally) a check against a reference
and the bytes a call must move; :func:`run_bench` hands them to :meth:`ProbeContext.timed`, so a
bench probe gets every defence of ``feedback/timing.py`` (fresh inputs per timed call, outputs
re-checked after timing, work outside the timer, a roofline floor, clocks the candidate cannot
reach).  Metrics: ``call_us``, ``call_wall_us``, ``call_rel_err_after_timing`` (with a check),
``bytes_per_s`` and ``bandwidth_vs_copy`` (with bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from feedback.probe import ProbeContext


def run_bench(ctx: ProbeContext, bench: dict, load: Callable[[str], Callable]) -> dict | None:
    call, make = load(bench["call"]), load(bench["make"])
    check = load(bench["check"]) if bench.get("check") else None
    size = bench.get("bytes") or 0.0
    params = {**ctx.params, "device": ctx.device}
    if isinstance(size, str):
        size = float(load(size)(*make(0, **params)))
    file = bench["call"].split(":")[0].replace(".", "/") + ".py"

    def fresh(i: int) -> Any:
        inputs = make(i, **params)
        return inputs if isinstance(inputs, tuple) else (inputs,)

    t = ctx.timed("call", make=fresh, call=call, check=check, tol=float(bench.get("tol", 1e-3)),
                  reps=int(bench.get("reps", 20)), bytes_moved=float(size), file=file,
                  symbol=bench["call"].split(":")[1])
    if size and t.copy_bytes_per_s:
        ctx.metric("bytes_per_s", size / t.median_s, unit="B/s", better="higher")
        ctx.metric("bandwidth_vs_copy", size / t.median_s / t.copy_bytes_per_s, better="higher")
    return None
