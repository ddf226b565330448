"""From probe results to a FeedbackReport: deltas against the baseline, localisation, acceptance."""

from __future__ import annotations

import hashlib
import math
import pathlib

from rich.console import Console
from rich.table import Table

from feedback.manifest import Criterion, Manifest, ProbeSpec
from feedback.models import CriterionResult, FeedbackReport, MetricDelta, ProbeComparison, ProbeResult, Status

REL_NOISE = 0.10  # metric changes smaller than this (without CIs) are "unchanged"
JUDGED_BY_STATUS = ("static", "correctness", "trace", "events")

_STATUS_STYLE = {Status.passed: "green", Status.failed: "red", Status.error: "red", Status.timeout: "red",
                 Status.skipped: "yellow"}


def localise(spec: ProbeSpec, result: ProbeResult) -> list[str]:
    """One actionable line per problem: what failed, where (file, kernel), under which params/inputs."""
    if result.status == Status.passed or result.status == Status.skipped:
        return []
    cover = ", ".join(spec.covers.files[:3])
    if result.status in (Status.error, Status.timeout):
        return [f"probe `{spec.id}` {result.status.value}: {result.reason}; cover {cover}"]
    lines = []
    for f in result.findings:
        where = f.location.render() or (f"cover {cover}" if cover else "")
        lines.append(f"probe `{spec.id}` failed: {f.message}" + (f"; {where}" if where else ""))
    return lines or [f"probe `{spec.id}` failed; cover {cover}"]


def _delta(name: str, base, cand) -> MetricDelta:
    if base is None or cand is None:
        m = base or cand
        return MetricDelta(name=name, baseline=base.value if base else None, candidate=cand.value if cand else None,
                           unit=m.unit, verdict="new" if base is None else "gone")
    change = cand.value / base.value if base.value not in (0.0,) and math.isfinite(base.value) else None
    verdict = "unchanged"
    better = cand.better or base.better
    if better in ("lower", "higher"):
        if cand.ci and base.ci:
            overlap = not (cand.ci[1] < base.ci[0] or cand.ci[0] > base.ci[1])
            worse = cand.value > base.value if better == "lower" else cand.value < base.value
            verdict = "unchanged" if overlap else ("regressed" if worse else "improved")
        elif change is not None and abs(change - 1) > REL_NOISE:
            worse = change > 1 if better == "lower" else change < 1
            verdict = "regressed" if worse else "improved"
        elif change is None and cand.value != base.value:
            worse = cand.value > base.value if better == "lower" else cand.value < base.value
            verdict = "regressed" if worse else "improved"
    return MetricDelta(name=name, baseline=base.value, candidate=cand.value, unit=cand.unit, change=change,
                       verdict=verdict)


def compare(manifest: Manifest, candidate: list[ProbeResult], baseline: list[ProbeResult]) -> list[ProbeComparison]:
    base = {r.probe: r for r in baseline}
    out = []
    for r in candidate:
        spec = manifest.probe(r.probe)
        b = base.get(r.probe)
        names = list(r.metrics) + [n for n in (b.metrics if b else {}) if n not in r.metrics]
        deltas = [_delta(n, b.metrics.get(n) if b else None, r.metrics.get(n)) for n in names] if b else [
            MetricDelta(name=n, baseline=None, candidate=m.value, unit=m.unit) for n, m in r.metrics.items()]
        if spec.kind in JUDGED_BY_STATUS:
            # errors measured on fresh random inputs move from run to run: the probe's status and its
            # thresholds carry the verdict, the numbers are shown, not judged
            deltas = [d.model_copy(update={"verdict": "n/a"}) for d in deltas]
        out.append(ProbeComparison(probe=r.probe, kind=spec.kind, baseline=b.status if b else None,
                                   candidate=r.status, deltas=deltas, localisation=localise(spec, r)))
    return out


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


def content_hashes(tree: pathlib.Path, manifest: Manifest, specs: list[ProbeSpec]) -> dict[str, str]:
    """sha256 of the manifest, the protected files (probes, references, tests) and probe modules."""
    files: set[pathlib.Path] = {tree / "infra-agent.yaml"}
    for pat in manifest.protected:
        files.update(p for p in tree.glob(pat) if p.is_file())
    for s in specs:
        if s.entry:
            mod = s.entry.split(":")[0].replace(".", "/")
            for root in manifest.python_path:
                cand = tree / root / f"{mod}.py"
                if cand.is_file():
                    files.add(cand)
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(files) if p.is_file() and "__pycache__" not in p.parts}


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.2e}{unit and ' ' + unit}"
    return f"{v:.4g}{unit and ' ' + unit}"


def render(report: FeedbackReport, console: Console) -> None:
    title = f"feedback on {report.target} ({report.selection})"
    if report.baseline:
        title += f" vs baseline {report.baseline}"
    table = Table(title=title, title_justify="left")
    table.add_column("probe")
    table.add_column("kind")
    if report.baseline:
        table.add_column("baseline")
    table.add_column("status")
    table.add_column("metrics")
    table.add_column("time", justify="right")
    results = {r.probe: r for r in report.results}
    for c in report.comparisons:
        r = results[c.probe]
        metrics = []
        for d in c.deltas[:4]:
            if d.baseline is not None and d.candidate is not None and report.baseline:
                style = {"regressed": "red", "improved": "green"}.get(d.verdict, "")
                arrow = f"{_fmt(d.baseline)} -> {_fmt(d.candidate, d.unit)}"
                metrics.append(f"[{style}]{d.name} {arrow}[/]" if style else f"{d.name} {arrow}")
            else:
                metrics.append(f"{d.name} {_fmt(d.candidate, d.unit)}")
        status = f"[{_STATUS_STYLE[r.status]}]{r.status.value}[/]" + (" (cached)" if r.cached else "")
        row = [c.probe, c.kind]
        if report.baseline:
            row.append(c.baseline.value if c.baseline else "-")
        row += [status, "\n".join(metrics) or (r.reason or ""), f"{r.duration_s:.1f}s"]
        table.add_row(*row)
    console.print(table)
    for line in report.localisations():
        console.print(f"[red]x[/] {line}", highlight=False, soft_wrap=True)
    for a in report.acceptance:
        mark = {True: "[green]ok[/]", False: "[red]FAILED[/]", None: "[yellow]not measured[/]"}[a.holds]
        extra = f" (value {_fmt(a.value)})" if a.value is not None else f" ({a.reason})"
        console.print(f"acceptance {a.name}: {a.expression} {mark}{extra}", highlight=False)
    if report.stopped_at:
        console.print(f"[yellow]cascade stopped at stage '{report.stopped_at}' (use --all to run every stage)[/]")
    verdict = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    console.print(f"verdict: {verdict} in {report.duration_s:.1f}s")
