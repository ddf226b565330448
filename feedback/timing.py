"""Timing a candidate cannot steer: the harness owns the loop, the inputs, the clock and the re-check.

A performance probe hands over what to time, not a loop of its own::

    t = ctx.time("step", make=lambda i: fresh_inputs(seed=i), call=step,
                 check=lambda before, after, out: rel_err(out, reference(*before)),
                 bytes_moved=state_bytes)

and :func:`measure` does the rest, so no probe can forget a defence:

* **Fresh inputs for every timed call** (``make`` is called outside the timer, with an index the
  candidate never sees twice): a result cached on a pointer, a shape or a call counter is wrong
  for the next inputs.  On a GPU the L2 cache is flushed before each call, and the call's start
  event waits behind a device-side sleep longer than the host's launch, so the time is the
  device's (the Python wrapper's latency is ``wall_median_s``, measured apart).
* **Outputs re-checked after timing**: a random handful of the timed calls (drawn from
  ``os.urandom``, so no seed predicts them) and the last one are checked
  against the probe's reference, from copies of their inputs taken before the call.  Work skipped
  once warm, or done for one seed only, fails here.
* **Work outside the timer**: right after a timed call returns (on a GPU: right after its end
  event, on its stream) a copy of its outputs is taken; if they change afterwards, some of the work
  ran on another stream or thread that the timer did not wait for.  Outputs must be materialised
  ``torch.Tensor`` objects, not subclasses or lazy wrappers.
* **A roofline floor**: with ``bytes_moved`` (or ``flops`` and a peak) a time faster than the
  bytes allow at the copy bandwidth measured in the same process is flagged, not celebrated (on a
  CPU, a copy as large as the call's bytes: the cache level its inputs sit in, :func:`copy_bandwidth`;
  one copy is timed right after each call, so a shared machine's drifting bandwidth cannot raise it).
* **Clocks the candidate cannot reach**: :func:`arm` runs before the tree under test is imported
  and keeps its own references to the clock, the CUDA event methods and ``synchronize``; after the
  probe :func:`tampered` names any of them that were replaced.  Each timed loop is also stamped
  by the harness process itself (``INFRA_AGENT_WITNESS_FD``, a pipe read by the runner), whose
  clock no code in the probe process can touch; the runner fails a probe whose own clock disagrees.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, Field

WITNESS_FD = "INFRA_AGENT_WITNESS_FD"

_clock = time.perf_counter  # bound at import, which the worker does before the tree under test loads
_pristine: dict[str, object] = {}
_torch: dict[str, Any] = {}


def _watched() -> dict[str, object]:
    """The timing machinery a candidate might replace, by dotted name (only what is imported)."""
    out: dict[str, object] = {f"time.{n}": getattr(time, n) for n in
                              ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns")}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch.cuda.synchronize"] = torch.cuda.synchronize
        out["torch.cuda.Event"] = torch.cuda.Event
        for n in ("record", "elapsed_time", "synchronize"):
            out[f"torch.cuda.Event.{n}"] = getattr(torch.cuda.Event, n)
    testing = sys.modules.get("triton.testing")
    if testing is not None:
        out["triton.testing.do_bench"] = testing.do_bench
    out["feedback.timing._clock"] = globals()["_clock"]
    for mod in ("feedback.timing", "feedback.microbench"):
        m = sys.modules.get(mod)
        for n in ("measure", "copy_bandwidth", "device_kind", "time_fn", "time_once", "ab_compare", "roofline_check",
                  "witness"):
            if m is not None and hasattr(m, n):
                out[f"{mod}.{n}"] = getattr(m, n)
    return out


def arm() -> None:
    """Keep the harness's own references to the clocks, before any candidate code is imported."""
    try:
        import torch
    except ImportError:  # a target without torch: the stdlib clocks are still watched
        torch = None
    if torch is not None:
        _torch.update(sync=torch.cuda.synchronize, event=torch.cuda.Event, elapsed=torch.cuda.Event.elapsed_time,
                      record=torch.cuda.Event.record, stream=torch.cuda.current_stream)
    _pristine.clear()
    _pristine.update(_watched())


def tampered() -> list[str]:
    """The watched names that no longer hold what :func:`arm` saw."""
    now = _watched()
    return sorted(n for n, obj in _pristine.items() if now.get(n) is not obj)


def witness(tag: str, edge: str) -> None:
    """Tell the harness process (which stamps it with its own clock) that a timed span begins or ends."""
    fd = os.environ.get(WITNESS_FD)
    if fd:
        try:
            os.write(int(fd), f"{tag} {edge}\n".encode())
        except OSError:
            pass  # no harness listening (a probe run by hand)


class Timing(BaseModel):
    """One measured callable: per-call times, what the re-check saw, and what looked wrong."""

    device: str
    median_s: float
    p10_s: float
    p90_s: float
    wall_median_s: float  # host clock around a call and a device-wide synchronize (the warm-up calls)
    samples: list[float] = Field(default_factory=list)
    loop_s: float = 0.0  # the whole timed loop, by the probe process's clock (the witness checks it)
    rechecked: int = 0
    max_rel_err: float = 0.0
    floor_s: float = 0.0  # the fastest the declared bytes allow at the measured copy bandwidth
    copy_bytes_per_s: float = 0.0
    problems: list[str] = Field(default_factory=list)


def _tensors(obj: Any) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _clone(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_clone(o) for o in obj)
    return obj


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _not_materialised(outputs: Any) -> str | None:
    import torch

    if outputs is None:
        return None
    items = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    for o in items:
        if isinstance(o, (tuple, list)):
            if (bad := _not_materialised(o)) is not None:
                return bad
        elif o is not None and type(o) is not torch.Tensor:
            return f"the call returned a {type(o).__module__}.{type(o).__qualname__}, not a materialised torch.Tensor"
    return None


def device_kind(device: Any) -> str:
    """``"cuda"`` or ``"cpu"``: the clock a timing on ``device`` (a name or a ``torch.device``) needs.

    A GPU is timed with events on its current stream, so a numbered one must be the current device;
    any other kind (``mps``, ``xpu``, ``meta``) would be timed by a host clock that does not wait for
    it, and is refused rather than timed wrong."""
    import torch

    d = torch.device(device)
    if d.type == "cuda":
        if d.index is not None and torch.cuda.is_available() and d.index != torch.cuda.current_device():
            raise ValueError(f"cannot time on {device!r}: the current CUDA device is "
                             f"{torch.cuda.current_device()} (select it first: torch.cuda.set_device({d.index}))")
        return "cuda"
    if d.type == "cpu":
        return "cpu"
    raise ValueError(f"cannot time on {device!r}: the harness times a CUDA GPU (events) or the CPU (its clock)")


def copy_bandwidth(device: str, nbytes: int | None = None) -> float:
    """Bytes per second (read + write) of a plain copy of ``nbytes`` on ``device``, by the harness's clock.

    On a GPU the copy is 256 MiB, past any L2, as the timed calls find their inputs (flushed). On a
    CPU nothing is flushed: a call's fresh inputs sit in whatever cache level holds them, so the copy
    is sized like the call (``nbytes``, the bytes it moves; 64 KiB to 64 MiB) and the fixed cost of
    a copy call is timed apart and left out: the floor is the data's time at that level, a true lower
    bound for a call whose own dispatch costs less than torch's.
    """
    return _Copy(device, nbytes).bandwidth()


class _Copy:
    """The plain copy a roofline floor is measured with (:func:`copy_bandwidth`).

    :func:`measure` on a CPU also times one copy right after each timed call (:meth:`once`) and hands
    those to :meth:`bandwidth`: a shared machine's memory bandwidth drifts as its neighbours load it,
    and a floor measured only after the loop can be slower than the calls were a moment before (a CI
    machine's 48 MB add once ran at 27 GB/s while the copies after it reached 20).  The fastest copy of
    all is the floor's, so a drift can only lower the floor, never flag an honest call.
    """

    def __init__(self, device: Any, nbytes: int | None = None):
        import torch

        self.device = device_kind(device)
        self.cuda = self.device == "cuda"
        self.size = 2**28 if self.cuda else int(min(max((nbytes or 2**27) // 2, 2**16), 2**26))  # moves 2x
        self.src = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        self.src.random_(0, 255)  # never time on zeros
        self.dst = torch.empty_like(self.src)
        if self.cuda and not _torch:
            arm()

    def once(self, n: int | None = None) -> float:
        """Seconds for one copy of the first ``n`` bytes (all of them by default)."""
        a, b = (self.src, self.dst) if n is None else (self.src[:n], self.dst[:n])
        _sync(self.device)
        if self.cuda:  # the device's own time (events), as the calls it is held against are timed
            start, end = _torch["event"](enable_timing=True), _torch["event"](enable_timing=True)
            stream = _torch["stream"]()
            if (hide := _launch_cover(20e-6)) is not None:  # the copy queued behind it: no launch latency
                hide()
            _torch["record"](start, stream)
            b.copy_(a)
            _torch["record"](end, stream)
            _torch["sync"]()
            return _torch["elapsed"](start, end) / 1e3
        t0 = _clock()
        b.copy_(a)
        return _clock() - t0

    def bandwidth(self, seen: Sequence[float] = ()) -> float:
        """Bytes per second of the fastest copy: a few timed now, with the ``seen`` ones timed earlier."""
        import torch

        # the fastest of a few: the floor is a lower bound, and on a shared machine the slower copies are the
        # ones another process preempted (an OpenMP team waiting on a descheduled thread takes milliseconds)
        best = min(self.once() for _ in range(7))
        best = min(best, *seen) if seen else best
        fixed = 0.0
        if not self.cuda:  # and on one thread too: a loaded machine can make torch's thread team slower than one core
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                best = min(best, *(self.once() for _ in range(5)))
                fixed = min(self.once(64) for _ in range(7))
            finally:
                torch.set_num_threads(threads)
        return 2 * self.size / max(best - fixed, 1e-9)


def _launch_cover(launch_s: float) -> Callable[[], None] | None:
    """A device-side wait to enqueue before each timed call's start event, longer than the host takes to
    launch the call: the device then starts the call as soon as its start event fires, as it does in a
    serving loop whose queue runs ahead, instead of idling through the Python wrapper's latency
    (which ``wall_median_s`` reports on its own).  None where torch has no such wait."""
    import torch

    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return None
    try:
        hz = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate * 1e3
    except (AttributeError, RuntimeError):
        hz = 2.0e9
    cycles = int(min(max(4 * launch_s, 50e-6) * (hz or 2.0e9), 2e9))
    return lambda: sleep(cycles)


def _sync(device: str) -> None:
    if device == "cuda":
        (_torch.get("sync") or __import__("torch").cuda.synchronize)()


def measure(make: Callable[[int], Sequence[Any]], call: Callable[..., Any],
            check: Callable[[Sequence[Any], Sequence[Any], Any], float] | None, *, device: Any, tag: str = "timed",
            reps: int = 20, warmup: int = 3, recheck: int = 3, tol: float = 1e-3, bytes_moved: float = 0.0,
            flops: float = 0.0, peak_flops: float = 0.0, slack: float = 1.05) -> Timing:
    """Time ``call(*make(i))`` for ``reps`` fresh inputs; re-check outputs after timing (module docstring).

    ``check(before, after, outputs)`` gets a copy of the inputs taken before the call, the inputs as
    the call left them (in-place kernels), and the outputs; it returns their relative error.
    """
    import torch

    device = device_kind(device)
    cuda = device == "cuda"
    if cuda and not _torch:
        arm()
    walls, launches = [], []
    for i in range(max(warmup, 2)):
        inputs = tuple(make(-1 - i))
        _sync(device)
        w0 = _clock()
        call(*inputs)
        launches.append(_clock() - w0)  # the host's time to launch the call (all of it on a CPU)
        _sync(device)
        walls.append(_clock() - w0)
    walls = walls[1:]  # the first call compiles
    hide = _launch_cover(statistics.median(launches[1:])) if cuda else None
    flush = torch.empty(2**28, dtype=torch.uint8, device=device) if cuda else None  # larger than any L2
    pending: list[tuple[int, Sequence[Any], Sequence[Any], Any, list]] = []
    samples = []
    picked = set(random.Random(os.urandom(16)).sample(range(reps), min(recheck, reps))) | {reps - 1}
    threads = set(threading.enumerate())
    copy = _Copy(device, int(bytes_moved)) if bytes_moved and not cuda else None  # the floor's, beside the calls
    copies: list[float] = []
    witness(tag, "B")
    loop0 = _clock()
    for i in range(reps):
        inputs = tuple(make(i))
        before = _clone(inputs) if i in picked else None
        if cuda:
            stream = _torch["stream"]()
            start, end = _torch["event"](enable_timing=True), _torch["event"](enable_timing=True)
            flush.zero_()  # the inputs' last writes out of L2, as a serving step finds them
            _torch["sync"]()
            if hide is not None:  # the device waits while the host launches: launch latency is not timed
                hide()
            _torch["record"](start, stream)
            outputs = call(*inputs)
            _torch["record"](end, stream)
            snap = [t.clone() for t in _tensors(outputs)] if before is not None else []  # right after, on its stream
            _torch["sync"]()
            samples.append(_torch["elapsed"](start, end) / 1e3)
        else:
            w0 = _clock()
            outputs = call(*inputs)
            samples.append(_clock() - w0)
            snap = [t.clone() for t in _tensors(outputs)] if before is not None else []
            if copy is not None:
                copies.append(copy.once())
        if before is not None:
            pending.append((i, before, inputs, outputs, snap))
        last = outputs
    loop_s = _clock() - loop0
    witness(tag, "E")

    problems = []
    stray = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
    if stray:  # wait for them, so that what they still write shows in the outputs below
        problems.append(f"the timed calls left {len(stray)} thread(s) running after they returned: "
                        "work the timer did not wait for")
        for t in stray:
            t.join(timeout=10)
    if (bad := _not_materialised(last)) is not None:
        problems.append(bad)
    worst, checked = 0.0, 0
    for i, before, after, outputs, snap in pending:
        _sync(device)
        if any(not _same(a, b) for a, b in zip(snap, _tensors(outputs))):
            problems.append(f"timed call {i}: its outputs changed after the call returned"
                            + (" on its stream" if cuda else "") + ": some work ran outside the timer"
                            + (" (another stream or thread)" if cuda else " (another thread)"))
        if check is not None:
            with torch.no_grad():
                err = float(check(before, after, outputs))
            err = err if err == err else float("inf")
            worst, checked = max(worst, err), checked + 1
            if not err <= tol:
                problems.append(f"timed call {i} is wrong when re-checked after timing: rel. error {err:.2e} "
                                f"> {tol:.0e} (work skipped once warm, a cached or seed-specific result?)")
    del pending, last, flush
    med = statistics.median(samples)
    qs = sorted(samples)
    bw = (copy or _Copy(device, int(bytes_moved))).bandwidth(copies) if bytes_moved else 0.0
    del copy
    floor = max(bytes_moved / bw if bw else 0.0, flops / peak_flops if peak_flops else 0.0)
    if floor and med * slack < floor:
        problems.append(f"{med * 1e6:.2f} us per call is faster than the {floor * 1e6:.2f} us the roofline allows "
                        f"({bytes_moved / 1e6:.1f} MB at the {bw / 1e9:.0f} GB/s copy bandwidth measured here)")
    return Timing(device=device, median_s=med, p10_s=qs[int(0.1 * (reps - 1))], p90_s=qs[int(0.9 * (reps - 1))],
                  wall_median_s=statistics.median(walls), samples=samples, loop_s=loop_s, rechecked=checked,
                  max_rel_err=worst, floor_s=floor, copy_bytes_per_s=bw, problems=problems)
