"""Timing for probes: single-callable timing, interleaved A/B with a bootstrap CI, roofline check.

On a GPU times come from ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs);
on a CPU from ``time.perf_counter``.  A/B runs interleave A B A B so drift hits both sides, and
report the ratio of medians with a bootstrap 95% confidence interval and a verdict.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from pydantic import BaseModel


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def time_once(fn: Callable[[], object]) -> float:
    """Seconds for one call (GPU: CUDA events with an L2 flush; CPU: perf_counter)."""
    if _cuda():
        from triton.testing import do_bench

        return do_bench(fn, warmup=1, rep=1, return_mode="median") / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_fn(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20) -> float:
    """Median seconds per call."""
    if _cuda():
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median") / 1e3
    for _ in range(warmup):
        fn()
    return statistics.median(time_once(fn) for _ in range(reps))


class ABResult(BaseModel):
    median_a_s: float
    median_b_s: float
    ratio: float  # median(B) / median(A): below 1 means B is faster
    ci_low: float
    ci_high: float
    verdict: str  # "faster", "slower", "no difference"
    noisy: bool
    spread_a: float  # (p90 - p10) / median
    spread_b: float
    samples: int


def _spread(xs: list[float]) -> float:
    xs = sorted(xs)
    med = statistics.median(xs)
    lo, hi = xs[int(0.1 * (len(xs) - 1))], xs[int(0.9 * (len(xs) - 1))]
    return (hi - lo) / med if med > 0 else float("inf")


def ab_compare(fn_a: Callable[[], object], fn_b: Callable[[], object], *, reps: int = 30, warmup: int = 3,
               boot: int = 2000, seed: int = 0, noise_limit: float = 0.25,
               timer: Callable[[Callable[[], object]], float] = time_once) -> ABResult:
    """Interleaved A/B timing: is B faster than A, and how sure are we?

    The verdict is "faster"/"slower" only when the bootstrap 95% CI of median(B)/median(A)
    excludes 1; a spread (p90 - p10) / median above ``noise_limit`` on either side flags noise.
    """
    for _ in range(warmup):
        fn_a()
        fn_b()
    a, b = [], []
    for i in range(reps):
        first, second = (fn_a, fn_b) if i % 2 == 0 else (fn_b, fn_a)
        t1, t2 = timer(first), timer(second)
        (a.append(t1), b.append(t2)) if i % 2 == 0 else (b.append(t1), a.append(t2))
    rng = random.Random(seed)
    ratios = []
    for _ in range(boot):
        ra = statistics.median(rng.choices(a, k=len(a)))
        rb = statistics.median(rng.choices(b, k=len(b)))
        ratios.append(rb / ra)
    ratios.sort()
    lo, hi = ratios[int(0.025 * boot)], ratios[int(0.975 * boot) - 1]
    ma, mb = statistics.median(a), statistics.median(b)
    verdict = "faster" if hi < 1 else "slower" if lo > 1 else "no difference"
    sa, sb = _spread(a), _spread(b)
    return ABResult(median_a_s=ma, median_b_s=mb, ratio=mb / ma, ci_low=lo, ci_high=hi, verdict=verdict,
                    noisy=max(sa, sb) > noise_limit, spread_a=sa, spread_b=sb, samples=reps)


class Roofline(BaseModel):
    seconds: float
    min_seconds: float  # the fastest the bytes and FLOPs allow on this device
    bandwidth_fraction: float  # achieved bytes/s over peak
    flops_fraction: float
    suspicious: bool  # faster than physics allows: a broken kernel or a broken measurement
    reason: str = ""


def roofline_check(seconds: float, *, bytes_moved: float = 0.0, flops: float = 0.0, peak_bytes_per_s: float,
                   peak_flops: float = float("inf"), slack: float = 1.05) -> Roofline:
    """Flag a time below what the compulsory bytes or FLOPs allow (with ``slack`` for jitter)."""
    t_mem = bytes_moved / peak_bytes_per_s if peak_bytes_per_s else 0.0
    t_fl = flops / peak_flops if peak_flops and peak_flops != float("inf") else 0.0
    floor = max(t_mem, t_fl)
    suspicious = seconds * slack < floor
    reason = (f"{seconds * 1e6:.2f} us is faster than the {floor * 1e6:.2f} us the roofline allows"
              if suspicious else "")
    return Roofline(seconds=seconds, min_seconds=floor,
                    bandwidth_fraction=(bytes_moved / seconds) / peak_bytes_per_s if seconds > 0 else float("inf"),
                    flops_fraction=(flops / seconds) / peak_flops if seconds > 0 and peak_flops else 0.0,
                    suspicious=suspicious, reason=reason)
