"""Microbenchmark statistics (deterministic timers: the statistics are under test) and the roofline floor."""

from __future__ import annotations

import pytest
import torch

from feedback.microbench import ab_compare, roofline_check


def _scripted_timer(samples_a, samples_b):
    """A timer that returns scripted samples for the callables tagged 'a' and 'b'."""
    it = {"a": iter(samples_a), "b": iter(samples_b)}
    return lambda fn: next(it[fn.tag])


def _tagged(tag):
    def fn():
        return None

    fn.tag = tag
    return fn


def test_ab_compare_verdicts_from_the_bootstrap_interval():
    a, b = _tagged("a"), _tagged("b")
    base = [1.0 + 0.01 * (i % 5) for i in range(33)]
    faster = ab_compare(a, b, reps=30, warmup=0, timer=_scripted_timer(base, [0.5 * x for x in base]))
    assert faster.verdict == "faster" and faster.ci_high < 1 and faster.ratio == pytest.approx(0.5)
    slower = ab_compare(a, b, reps=30, warmup=0, timer=_scripted_timer(base, [1.3 * x for x in base]))
    assert slower.verdict == "slower" and slower.ci_low > 1
    same = ab_compare(a, b, reps=30, warmup=0, timer=_scripted_timer(base, list(reversed(base))))
    assert same.verdict == "no difference" and same.ci_low <= 1 <= same.ci_high and not same.noisy
    noisy = ab_compare(a, b, reps=30, warmup=0,
                       timer=_scripted_timer([1.0, 3.0] * 17, [1.0, 3.1] * 17))
    assert noisy.noisy


def test_ab_compare_interleaves_a_and_b():
    order = []
    a, b = _tagged("a"), _tagged("b")

    def timer(fn):
        order.append(fn.tag)
        return 1.0

    ab_compare(a, b, reps=4, warmup=0, timer=timer)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_ab_compare_on_real_cpu_work_sees_a_4x_difference():
    x = torch.rand(256, 256)
    small = lambda: x @ x  # noqa: E731
    big = lambda: [x @ x for _ in range(4)]  # noqa: E731
    res = ab_compare(small, big, reps=15)
    assert res.verdict == "slower" and res.ratio > 2


def test_roofline_flags_results_faster_than_physics():
    # 1 GB moved in 0.1 ms on a 4 TB/s device: impossible
    bad = roofline_check(1e-4, bytes_moved=1e9, peak_bytes_per_s=4e12)
    assert bad.suspicious and "faster than" in bad.reason and bad.bandwidth_fraction > 1
    ok = roofline_check(5e-4, bytes_moved=1e9, peak_bytes_per_s=4e12)
    assert not ok.suspicious and ok.bandwidth_fraction == pytest.approx(0.5)
    flops = roofline_check(1e-6, flops=1e12, peak_flops=1e15, peak_bytes_per_s=4e12)
    assert flops.suspicious
