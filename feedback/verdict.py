"""The judgement of a candidate against its baseline: one module, one noise rule, one kind table.

Everything that says "better", "worse", "regressed" or "holds" comes from here: the per-metric
comparison the report shows, the acceptance criteria, the candidate's verdict (with the evidence a
reviewer sees) and the replay of a committed experiment record.

The kind table.  Probes of the *status* kinds (static, correctness, trace, events) are judged by
their status and thresholds: their numbers (errors on fresh random inputs, a trace's totals) move
from run to run and are shown, never judged.  Probes of the *performance* kinds (microbench, e2e)
are judged by their metrics.

The noise rule.  A performance metric changes only when the evidence says so:

* it needs repeats: a metric measured once on either side is "unchanged" (one run is not
  evidence); the runner repeats performance probes (``repeats`` in the manifest, 3 by default)
  and keeps every run's value in ``Metric.samples``;
* the noise floor is measured by the harness itself from the baseline's repeats against each
  other (an A/A comparison: the largest ratio between two runs of the same tree), never below
  :data:`MIN_NOISE`;
* and the whole interval of the change (a bootstrap 95% interval of median(candidate) /
  median(baseline), or the probes' own intervals when they measured one) must lie beyond that
  floor, not only its middle: three repeats of a tree can fall close together by chance on a busy
  machine, and a median ratio just past such a floor, with an interval reaching back to 1, is not
  evidence (a 2-core CI runner's serving TPOT: x1.14 against a 14% floor, interval [1.02, 1.83]).

Verdicts, in the order they win: ``incorrect`` (the judges were changed: see ``harness.judge``; or
a probe or acceptance criterion that held on the baseline fails on the candidate, errors or times
out there, or passes fewer of its tests because more of them cannot run on this machine, or fails
on both sides with a test that did not fail on the baseline), ``inconclusive`` (a probe errors or
times out on both sides, or the environment failed: the probe is broken, not the candidate),
``better`` (a failing probe or criterion now holds, or tests of a probe failing on both sides now
pass), ``worse`` (a performance metric regressed beyond the noise), ``better`` (improved beyond the
noise), ``unchanged``.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

from feedback.manifest import Criterion, Manifest
from feedback.models import (
    CriterionResult,
    FeedbackReport,
    Metric,
    MetricDelta,
    ProbeComparison,
    ProbeResult,
    Status,
    Verdict,
    failures,
)

PERFORMANCE_KINDS = ("microbench", "e2e")
STATUS_KINDS = ("static", "correctness", "trace", "events")
DEFAULT_REPEATS = {kind: 3 for kind in PERFORMANCE_KINDS}
MIN_NOISE = 0.02  # a change below 2% is never called a change, however tight the repeats were
# A counted metric (``Metric.counted``: work counted under the interpreter) is exact for a given tree and
# shapes; a count moved by less than this is still called the same work (a data-dependent branch, such as
# which experts a router picks from fresh random inputs, may move it a little)
COUNT_TOLERANCE = 0.005
# A counted metric without a direction (``better=None``) is a part of a judged total (one kernel's bytes, one
# function's launches): work moved between parts (two kernels fused, a helper extracted) is no regression, so a
# part is shown with its move, not judged; the moves localise a total that regressed
COUNT_MORE, COUNT_LESS = "counted: more (a part, not judged)", "counted: less (a part, not judged)"
COUNT_SAME = "counted: the same (a part, not judged)"
BOOTSTRAP = 2000
_BAD = (Status.failed, Status.error, Status.timeout)
_BROKEN = (Status.error, Status.timeout)


def judged_by_performance(kind: str) -> bool:
    return kind in PERFORMANCE_KINDS


def repeats_for(kind: str, declared: int | None) -> int:
    """How many times the runner runs a probe: the manifest's ``repeats``, else the kind's default."""
    return declared if declared is not None else DEFAULT_REPEATS.get(kind, 1)


# --- statistics -------------------------------------------------------------------------------------


def median_interval(samples: Sequence[float], seed: int = 0) -> tuple[float, float] | None:
    """Bootstrap 95% interval of the median of ``samples`` (None below two samples)."""
    if len(samples) < 2:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(samples, k=len(samples))) for _ in range(BOOTSTRAP))
    return meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP) - 1]


def noise_floor(samples: Sequence[float]) -> float | None:
    """The A/A noise of repeated runs of one tree: the largest ratio between two of them, minus 1."""
    xs = [x for x in samples if math.isfinite(x)]
    if len(xs) < 2 or min(xs) <= 0:
        return None
    return max(xs) / min(xs) - 1.0


def ratio_interval(base: Metric, cand: Metric, seed: int = 0) -> tuple[float, float] | None:
    """95% interval of median(candidate) / median(baseline): bootstrap over both sides' repeats,
    or the probes' own intervals when a side was measured once."""
    if len(base.samples) >= 2 and len(cand.samples) >= 2 and min(base.samples) > 0:
        rng = random.Random(seed)
        ratios = sorted(statistics.median(rng.choices(cand.samples, k=len(cand.samples)))
                        / statistics.median(rng.choices(base.samples, k=len(base.samples))) for _ in range(BOOTSTRAP))
        return ratios[int(0.025 * BOOTSTRAP)], ratios[int(0.975 * BOOTSTRAP) - 1]
    if base.ci and cand.ci and base.ci[0] > 0 and base.ci[1] > 0:
        return cand.ci[0] / base.ci[1], cand.ci[1] / base.ci[0]
    return None


def combine_runs(runs: list[ProbeResult]) -> ProbeResult:
    """One result from repeated runs of a probe: the median of each metric, every run's value kept
    as its samples, with a bootstrap interval.  A run that did not complete decides the result."""
    if len(runs) == 1:
        return runs[0]
    for i, r in enumerate(runs):
        if r.status not in (Status.passed, Status.failed):
            reason = f"run {i + 1} of {len(runs)}: {r.reason}" if r.reason else f"run {i + 1} of {len(runs)}"
            return r.model_copy(update={"reason": reason})
    metrics = {}
    for name, first in runs[0].metrics.items():
        values = [r.metrics[name].value for r in runs if name in r.metrics]
        metrics[name] = first.model_copy(update={"value": statistics.median(values), "samples": values,
                                                 "ci": median_interval(values) or first.ci})
    findings, seen = [], set()
    for r in runs:
        for f in r.findings:
            if f.message not in seen:
                seen.add(f.message)
                findings.append(f)
    status = Status.failed if any(r.status == Status.failed for r in runs) else Status.passed
    imports = {path: digest for r in runs for path, digest in r.imports.items()}
    return runs[-1].model_copy(update={"status": status, "metrics": metrics, "findings": findings,
                                       "duration_s": sum(r.duration_s for r in runs), "imports": imports})


# --- comparison -------------------------------------------------------------------------------------


def compare_metric(name: str, base: Metric | None, cand: Metric | None, kind: str) -> MetricDelta:
    """The change of one metric from baseline to candidate, under the noise rule."""
    if base is None or cand is None:
        m = base or cand
        delta = MetricDelta(name=name, baseline=base.value if base else None, candidate=cand.value if cand else None,
                            unit=m.unit, verdict="new" if base is None else "gone")
        if m.counted and m.better is None and m.value:  # a part's count that appeared or went: shown as moved
            delta.note = COUNT_MORE if base is None else COUNT_LESS
        return delta
    change = cand.value / base.value if base.value != 0 and math.isfinite(base.value) else None
    delta = MetricDelta(name=name, baseline=base.value, candidate=cand.value, unit=cand.unit, change=change,
                        samples=min(len(base.samples), len(cand.samples)))
    better = cand.better or base.better
    if (cand.counted or base.counted) and better in ("lower", "higher"):
        return _compare_count(delta, better)
    if (cand.counted or base.counted) and better is None:  # a part of a judged total: shown, with its move
        delta.note = (COUNT_SAME if not _count_moved(delta) else COUNT_MORE if cand.value > base.value
                      else COUNT_LESS)
        return delta
    if not judged_by_performance(kind) or better not in ("lower", "higher"):
        return delta  # shown, not judged
    noise = noise_floor(base.samples)
    delta.noise = max(noise, MIN_NOISE) if noise is not None else None
    delta.ci = ratio_interval(base, cand)
    if change is None or delta.ci is None:
        delta.verdict, delta.note = "unchanged", "one run is not evidence"
        return delta
    floor = delta.noise if delta.noise is not None else MIN_NOISE
    if 1 - floor <= delta.ci[1] and delta.ci[0] <= 1 + floor:  # some of the interval is inside the noise
        delta.verdict, delta.note = "unchanged", f"within the noise (A/A {floor:.1%})"
        return delta
    worse = change > 1 if better == "lower" else change < 1
    delta.verdict = "regressed" if worse else "improved"
    return delta


def _count_moved(delta: MetricDelta) -> bool:
    """A count moved beyond ``COUNT_TOLERANCE`` (from a base of 0 (no divisions, say): any count at all)."""
    if delta.change is not None:
        return abs(delta.change - 1) > COUNT_TOLERANCE
    return delta.candidate != delta.baseline


def _compare_count(delta: MetricDelta, better: str) -> MetricDelta:
    """A counted metric: no repeats and no noise floor, any change beyond ``COUNT_TOLERANCE`` is one."""
    base, cand = delta.baseline, delta.candidate
    if not _count_moved(delta):
        delta.verdict, delta.note = "unchanged", "counted: the same work"
        return delta
    worse = cand > base if better == "lower" else cand < base
    delta.verdict, delta.note = ("regressed" if worse else "improved"), "counted: exact, no noise"
    return delta


def compare(manifest: Manifest, candidate: list[ProbeResult], baseline: list[ProbeResult],
            localise=None) -> list[ProbeComparison]:
    """Per probe: both statuses and every metric's delta; ``localise(spec, result)`` adds the lines."""
    base = {r.probe: r for r in baseline}
    out = []
    for r in candidate:
        spec = manifest.probe(r.probe)
        b = base.get(r.probe)
        names = list(r.metrics) + [n for n in (b.metrics if b else {}) if n not in r.metrics]
        if b:
            deltas = [compare_metric(n, b.metrics.get(n), r.metrics.get(n), spec.kind) for n in names]
        else:
            deltas = [MetricDelta(name=n, baseline=None, candidate=m.value, unit=m.unit) for n, m in r.metrics.items()]
        lines = (localise(spec, r) if localise else []) + grown_parts(r, deltas)
        out.append(ProbeComparison(probe=r.probe, kind=spec.kind, baseline=b.status if b else None,
                                   candidate=r.status, deltas=deltas, localisation=lines))
    return out


def grown_parts(result: ProbeResult, deltas: list[MetricDelta], most: int = 6) -> list[str]:
    """Where a judged count regressed: one line per part (a kernel, a function) whose own count grew or appeared,
    bound to the probe's finding for that part (its kernel, or its ``file:function``) where it has one."""
    if not any(d.verdict == "regressed" and d.note.startswith("counted") for d in deltas):
        return []
    lines = []
    for d in deltas:
        if d.note != COUNT_MORE:
            continue
        where = max(((_states(f.location, d.name), -i, f.location.render()) for i, f in enumerate(result.findings)),
                    default=(0, 0, ""))
        where = where[2] if where[0] else ""
        before = "none" if d.baseline is None else f"{d.baseline:.4g}"
        lines.append(f"probe `{result.probe}` does more counted work in a part: {d.name} {before} -> "
                     f"{d.candidate:.4g}{d.unit and ' ' + d.unit}" + (f"; {where}" if where else ""))
    return lines[:most]


def _states(location, metric: str) -> int:
    """How surely a finding at ``location`` states the counted part of ``metric``: 2 when the location names the
    part exactly (``Location.part``, the metric's stem), 1 by its kernel or ``file:function`` within the name, 0 not."""
    if location.part and metric.startswith(location.part + "."):
        return 2
    return int(any(f".{n}." in f".{metric}." for n in part_names(location)))


def part_names(location) -> list[str]:
    """The names a counted part's metrics carry for a finding's location: its part (``Location.part``) where it
    names one, else its kernel and its ``file:function``."""
    if getattr(location, "part", None):
        return [location.part]
    names = [location.kernel] if location.kernel else []
    if location.file and location.symbol:
        names.append(f"{location.file}:{location.symbol}")
    return names


def evaluate_acceptance(manifest: Manifest, results: list[ProbeResult]) -> list[CriterionResult]:
    by_id = {r.probe: r for r in results}
    out = []
    for c in manifest.acceptance:
        metric, op, bound = c.parts()
        pid, name = manifest.split_metric(metric)
        r = by_id.get(pid)
        if r is None or name not in r.metrics:
            why = "probe not run" if r is None else f"probe {r.status.value}, no metric {name}"
            out.append(CriterionResult(name=c.name, expression=c.expr, value=None, holds=None, reason=why))
            continue
        value = r.metrics[name].value
        out.append(CriterionResult(name=c.name, expression=c.expr, value=value,
                                   holds=Criterion.compare(value, op, bound)))
    return out


# --- the verdict ------------------------------------------------------------------------------------


def _why(r: ProbeResult) -> str:
    if r.reason:
        return r.reason
    return failures(r.findings)[0].message if r.findings else r.status.value


def _device(r: ProbeResult) -> str:
    """The device a result was measured on: the executor's stamp when it ran elsewhere, else the fingerprint."""
    if r.ran_on and "(" in r.ran_on:
        return r.ran_on.rsplit(",", 1)[-1].strip(" )")
    return f"{r.environment.device} ({r.environment.mode})"


def _count(r: ProbeResult, name: str) -> float:
    """A pytest probe's count of tests (``passed``, ``unrunnable``): 0 where it reported none."""
    return r.metrics[name].value if name in r.metrics else 0


def _lost_to_the_machine(b: ProbeResult, r: ProbeResult) -> str | None:
    """A candidate that passes fewer tests than its baseline because more of them cannot run here (a new
    third-party import, a CPU path that now asks for CUDA: ``feedback.needs``) broke them on this machine."""
    more = _count(r, "unrunnable") - _count(b, "unrunnable")
    if more > 0 and _count(r, "passed") < _count(b, "passed"):
        why = r.reason or next((f.message for f in r.findings if f.message.startswith("not run")), "")
        return f"{r.probe}: {more:g} more test(s) than on the baseline cannot run on this machine ({why})"
    return None


def _newly_failing(b: ProbeResult, r: ProbeResult) -> list[str]:
    """The tests that fail on the candidate and did not on the baseline (both sides failing, test by test).
    A test of a file whose import failed on the baseline (its id the file's module) is not new: the
    baseline never ran it."""
    if not r.failing or not b.failing:
        return []
    before = set(b.failing)
    modules = tuple(f"{t}{sep}" for t in before if "::" not in t for sep in (".", "::"))
    return [t for t in r.failing if t not in before and not t.startswith(modules)]


def _now_passing(b: ProbeResult, r: ProbeResult) -> int:
    """How many tests that failed on the baseline pass on the candidate (not merely stopped failing: a test
    that now skips, or cannot run here, is not counted)."""
    gone = len(set(b.failing) - set(r.failing)) if b.failing and r.failing else 0
    return int(max(0, min(gone, _count(r, "passed") - _count(b, "passed"))))


def verdict(report: FeedbackReport) -> Verdict:
    """Correctness first, then performance; see the module docstring for the order."""
    base = {r.probe: r for r in report.baseline_results}
    timed = {c.probe for c in report.comparisons if judged_by_performance(c.kind)}
    broke, fixed, broken, still = [], [], [], []
    for r in report.results:
        b = base.get(r.probe)
        b_status = b.status if b else None
        if r.environment_failure or (b is not None and b.environment_failure):
            broken.append(f"{r.probe} (environment: {_why(r if r.environment_failure else b)})")
        elif b is not None and (lost := _lost_to_the_machine(b, r)):
            broke.append(lost)
        elif r.probe in timed and b is not None and _device(r) != _device(b):
            broken.append(f"{r.probe} (timed on {_device(r)} against a baseline timed on {_device(b)}: "
                          "times of different devices are not compared)")
        elif r.status in _BAD and b_status in _BROKEN and r.status in _BROKEN:
            broken.append(f"{r.probe} ({r.status.value} on both sides: {_why(r)})")
        elif r.status == b_status == Status.failed and (newly := _newly_failing(b, r)):
            broke.append(f"{r.probe}: {len(newly)} test(s) that did not fail on the baseline fail: "
                         + ", ".join(newly[:3]) + (", ..." if len(newly) > 3 else ""))
        elif r.status in _BAD and b_status in _BAD:
            still.append(r.probe)
            if r.status == b_status == Status.failed and (now_pass := _now_passing(b, r)):
                fixed.append(f"{r.probe} ({now_pass} of its {len(b.failing)} failing tests now pass)")
        elif r.status in _BAD:
            broke.append(f"{r.probe} {r.status.value}: {_why(r)}")
        elif b_status in _BAD and r.status == Status.passed:
            fixed.append(r.probe)
    base_acc = {a.name: a for a in report.baseline_acceptance}
    for a in report.acceptance:
        before = base_acc.get(a.name)
        held_before = before.holds if before else None
        if a.holds is False and held_before is not False:
            broke.append(f"acceptance {a.name} ({a.expression}) fails: value {a.value:.3g}")
        elif a.holds is True and held_before is False:
            fixed.append(f"acceptance {a.name}")
    regressed = [f"{c.probe}.{d.name} {_change(d)}" for c in report.comparisons for d in c.deltas
                 if d.verdict == "regressed"]
    improved = [f"{c.probe}.{d.name} {_change(d)}" for c in report.comparisons for d in c.deltas
                if d.verdict == "improved"]
    parts = dict(broke=broke, fixed=fixed, broken_probes=broken, still_failing=still, regressed=regressed,
                 improved=improved)
    if report.judges_changed:
        return Verdict(name="incorrect", reason="the judges were tampered with: "
                       + "; ".join(report.judges_changed[:4]), **parts)
    if broke:
        return Verdict(name="incorrect", reason=f"{len(broke)} check(s) that held on the baseline fail: "
                       + "; ".join(broke[:4]), **parts)
    if broken:
        return Verdict(name="inconclusive", reason="the probe is broken, not the candidate: " + "; ".join(broken[:4]),
                       **parts)
    if fixed:
        return Verdict(name="better", reason="now passing: " + ", ".join(fixed[:6]), **parts)
    if regressed:
        return Verdict(name="worse", reason="regressed beyond the noise: " + ", ".join(regressed[:4]), **parts)
    if improved:
        return Verdict(name="better", reason="improved beyond the noise: " + ", ".join(improved[:4]), **parts)
    if still:
        return Verdict(name="unchanged", reason="still failing as on the baseline: " + ", ".join(still[:6]), **parts)
    return Verdict(name="unchanged", reason="every selected probe holds as before; no change beyond the noise",
                   **parts)


def _change(d: MetricDelta) -> str:
    if d.change is None:
        fmt = lambda v: "none" if v is None else f"{v:.3g}"  # noqa: E731
        return f"{fmt(d.baseline)} -> {fmt(d.candidate)}"
    text = f"x{d.change:.3f}"
    if d.ci:
        text += f" [{d.ci[0]:.3f}, {d.ci[1]:.3f}]"
    if d.noise is not None:
        text += f", A/A noise {d.noise:.1%}"
    return text


def evidence(report: FeedbackReport) -> list[dict]:
    """Before/after metrics of a judged candidate, with their intervals, noise and verdicts."""
    results = {r.probe: r for r in report.results}
    base = {r.probe: r for r in report.baseline_results}
    out = []
    for c in report.comparisons:
        r, b = results[c.probe], base.get(c.probe)
        for d in c.deltas:
            bm, m = (b.metrics.get(d.name) if b else None), r.metrics.get(d.name)
            out.append({"probe": c.probe, "metric": d.name, "unit": d.unit,
                        "before": d.baseline, "before_ci": bm.ci if bm else None,
                        "after": d.candidate, "after_ci": m.ci if m else None,
                        "change": d.change, "change_ci": d.ci, "noise": d.noise, "verdict": d.verdict,
                        "status_before": c.baseline.value if c.baseline else None,
                        "status_after": c.candidate.value})
    return out


# --- replay -----------------------------------------------------------------------------------------


def replay_regressions(recorded: list[tuple[str, ProbeResult]], now: list[ProbeResult],
                       acceptance: list[CriterionResult],
                       against_base: list[ProbeComparison] | None = None,
                       recorded_acceptance: list[CriterionResult] | None = None) -> tuple[list[str], list[str]]:
    """What a re-run of a committed record says: (regressions, one detail line per probe).

    Status kinds must end as they were recorded.  Performance kinds must not regress under the
    noise rule: with ``against_base`` (the candidate re-judged beside its rebuilt base in the same
    run), the candidate must not be worse than its base now, the only comparison that holds on
    another day or a busier machine; without it, against the recorded numbers, and only where the
    environment is the same.  An acceptance criterion must hold now where it held when recorded;
    one that failed then too (the record is a step on the way, another attempt fixed the rest) is
    shown, not counted.  Without ``recorded_acceptance`` every criterion must hold."""
    now_by_id = {r.probe: r for r in now}
    base_by_id = {c.probe: c for c in against_base or []}
    details, regressed = [], []
    for kind, then in recorded:
        cur = now_by_id[then.probe]
        line = f"{then.probe}: recorded {then.status.value}, now {cur.status.value}"
        if judged_by_performance(kind) and then.probe in base_by_id:
            if Status.skipped in (then.status, cur.status):
                details.append(line + " (performance: skipped here)")
                continue
            worse = [f"{d.name} {_change(d)}" for d in base_by_id[then.probe].deltas if d.verdict == "regressed"]
            if worse:
                regressed.append(f"{then.probe}: worse than its base, side by side: " + ", ".join(worse))
            details.append(line + (f"; worse than its base: {', '.join(worse)}" if worse
                                   else "; against its base, side by side: within the noise or better"))
            continue
        if judged_by_performance(kind):
            if then.environment.key() != cur.environment.key() or Status.skipped in (then.status, cur.status):
                details.append(line + " (performance: not comparable here, skipped)")
                continue
            worse = [f"{d.name} {_change(d)}" for n, m in then.metrics.items()
                     if (d := compare_metric(n, m, cur.metrics.get(n), kind)).verdict == "regressed"]
            if worse:
                regressed.append(f"{then.probe}: " + ", ".join(worse))
            details.append(line + (f"; regressed: {', '.join(worse)}" if worse else "; within the noise"))
            continue
        if then.status == Status.passed and cur.status == Status.skipped:
            # the same diff on the same base: what changed is the machine (no GPU, a package it lacks), which
            # cannot judge the probe; not a regression of the code, and not a pass either
            details.append(line + f" (not judged on this machine: {cur.reason or 'skipped'})")
            continue
        if then.status != cur.status:
            regressed.append(f"{then.probe} was {then.status.value}, now {cur.status.value}"
                             + (f" ({cur.reason})" if cur.reason else "")
                             + (f": {failures(cur.findings)[0].message}" if cur.findings else ""))
        elif any(m.counted for m in then.metrics.values()):
            # counted work is exact: the same tree does the same work, under the interpreter that counted it
            if then.environment.triton != cur.environment.triton:
                line += f" (counted work recorded under Triton {then.environment.triton}: not compared)"
            else:
                # the judged totals (a part, one kernel's or function's count, may move or go: no regression)
                worse = [f"{d.name} {_change(d)}" for n, m in then.metrics.items() if m.counted and m.better
                         and (d := compare_metric(n, m, cur.metrics.get(n), kind)).verdict in ("regressed", "gone")]
                if worse:
                    regressed.append(f"{then.probe}: more counted work than recorded: " + ", ".join(worse))
                line += f"; counted work: {', '.join(worse)}" if worse else "; counted work as recorded"
        details.append(line)
    then_by_name = {a.name: a for a in recorded_acceptance} if recorded_acceptance is not None else None
    for a in acceptance:
        if a.holds is not False:
            continue
        then = then_by_name.get(a.name) if then_by_name is not None else None
        if then_by_name is not None and (then is None or then.holds is not True):
            details.append(f"acceptance {a.name}: failed when recorded too (value {a.value:.3g})")
            continue
        regressed.append(f"acceptance {a.name} ({a.expression}) fails: value {a.value:.3g}")
    return regressed, details
