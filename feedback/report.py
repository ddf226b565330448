"""Presenting a FeedbackReport: localisation lines, the judges' content hashes, the terminal table.

The judgement itself (deltas, acceptance, the verdict) lives in :mod:`feedback.verdict`."""

from __future__ import annotations

import hashlib
import math
import pathlib
import re
from typing import TYPE_CHECKING

from feedback.manifest import Manifest, ProbeSpec
from feedback.models import FeedbackReport, ProbeResult, Status, failures

if TYPE_CHECKING:
    from rich.console import Console

#: a metric measured at a size: ``err_p32`` (32 partitions), ``ttft_T4096``, ``step_us_batch64``
SIZED = re.compile(r"^(?P<base>.*?)_?(?P<dim>p|P|T|t|batch|ranks|len|n)(?P<n>\d+)$")
#: ``..._p99`` is a percentile, not 99 partitions
PERCENTILES = frozenset({"50", "75", "90", "95", "99", "999"})
_BLOCKS = "▁▂▃▄▅▆▇█"


def size_series(result: ProbeResult | None) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """A result's metrics that vary with a size parameter: (base name, dimension) -> sorted (size, value)."""
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for name, m in (result.metrics.items() if result else []):
        hit = SIZED.match(name)
        if not hit or not hit["base"] or (hit["dim"].lower() == "p" and hit["n"] in PERCENTILES):
            continue
        if m.value == m.value and abs(m.value) < float("inf"):
            out.setdefault((hit["base"], hit["dim"]), []).append((float(hit["n"]), m.value))
    return {k: sorted(v) for k, v in out.items()}


def sparkline(points: list[tuple[float, float]]) -> str:
    """``▁▂▅█``: the values in order of size, log-scaled where all are positive (errors span decades)."""
    ys = [y for _, y in points]
    log = all(y > 0 for y in ys)
    vs = [math.log10(y) for y in ys] if log else ys
    lo, hi = min(vs), max(vs)
    return "".join(_BLOCKS[0 if hi == lo else round((v - lo) / (hi - lo) * (len(_BLOCKS) - 1))] for v in vs)


def curves(result: ProbeResult | None) -> list[str]:
    """One line per size series of three points or more: ``err vs p ▁▃█ 2.0e-07 .. 1.2e-02 (p 2..32)``."""
    out = []
    for (base, dim), pts in size_series(result).items():
        if len(pts) >= 3:
            out.append(f"{base} vs {dim} {sparkline(pts)} {_fmt(pts[0][1])} .. {_fmt(pts[-1][1])} "
                       f"({dim} {pts[0][0]:g}..{pts[-1][0]:g})")
    return out


_STATUS_STYLE = {Status.passed: "green", Status.failed: "red", Status.error: "red", Status.timeout: "red",
                 Status.skipped: "yellow"}


def localise(spec: ProbeSpec, result: ProbeResult) -> list[str]:
    """One actionable line per problem: what failed, where (file, kernel), under which params/inputs."""
    if result.status == Status.passed or result.status == Status.skipped:
        return []
    cover = ", ".join(spec.covers.files[:3])
    if result.status in (Status.error, Status.timeout):
        return [f"probe `{spec.id}` {result.status.value}: {result.reason}; covers {cover}"]
    lines = []
    for f in failures(result.findings):  # what failed, not what the probe observed on the way
        where = f.location.render() or (f"covers {cover}" if cover else "")
        lines.append(f"probe `{spec.id}` failed: {f.message}" + (f"; {where}" if where else ""))
    return lines or [f"probe `{spec.id}` failed; covers {cover}"]


def content_hashes(tree: pathlib.Path, manifest: Manifest, specs: list[ProbeSpec]) -> dict[str, str]:
    """sha256 of the manifest, the protected files (probes, references, tests) and probe modules."""
    files: set[pathlib.Path] = {tree / "infra-agent.yaml"}
    outside = manifest.source is not None and not manifest.source.is_relative_to(tree.resolve())
    if outside:  # a manifest kept outside the tree, and its probe modules: the judges, wherever they live
        files.add(manifest.source)
        for root in manifest.probe_roots():
            files.update(p for p in root.rglob("*.py"))
    for pat in manifest.protected:
        files.update(p for p in tree.glob(pat) if p.is_file())
    for s in specs:
        if s.entry:
            mod = s.entry.split(":")[0].replace(".", "/")
            for root in manifest.python_path:
                cand = tree / root / f"{mod}.py"
                if cand.is_file():
                    files.add(cand)
    def name(p: pathlib.Path) -> str:  # tree files by their path in the tree; the manifest's by theirs beside it
        if p.is_relative_to(tree):
            return p.relative_to(tree).as_posix()
        home = manifest.source.parent
        return "@manifest/" + (p.relative_to(home).as_posix() if p.is_relative_to(home) else str(p))

    return {name(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(files) if p.is_file() and "__pycache__" not in p.parts}


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.2e}{unit and ' ' + unit}"
    return f"{v:.4g}{unit and ' ' + unit}"


#: below this terminal width, reports and summaries switch to forms that keep every name whole
NARROW_COLUMNS = 110


def render(report: FeedbackReport, console: Console) -> None:
    from rich.markup import escape  # here: a cached ``feedback --json`` never loads rich
    from rich.table import Table

    title = f"feedback on {report.target} ({report.selection})"
    if report.baseline:
        title += f" vs baseline {report.baseline}"
    # an 80-column terminal: probe names whole (never cut into ellipses), the kind left out, metrics folded
    narrow = console.width < NARROW_COLUMNS
    table = Table(title=title, title_justify="left")
    longest = max((len(c.probe) for c in report.comparisons), default=5)
    table.add_column("probe", no_wrap=True, min_width=min(longest, 32))
    if not narrow:
        table.add_column("kind")
    if report.baseline:
        table.add_column("baseline", overflow="fold")
    table.add_column("status", overflow="fold")
    table.add_column("metrics", overflow="fold")
    table.add_column("time", justify="right", no_wrap=True)
    results = {r.probe: r for r in report.results}
    for c in report.comparisons:
        r = results[c.probe]
        metrics = []
        # the first four metrics, changes first (a probe that counts work per kernel reports dozens)
        shown = sorted(c.deltas, key=lambda d: 0 if d.verdict in ("regressed", "improved")
                       else 1 if d.note.startswith(("counted: more", "counted: less")) else 2)[:4]
        for d in shown:
            if d.baseline is not None and d.candidate is not None and report.baseline:
                style = {"regressed": "red", "improved": "green"}.get(d.verdict, "")
                arrow = f"{_fmt(d.baseline)} -> {_fmt(d.candidate, d.unit)}"
                if d.noise is not None:  # a performance metric: its A/A noise beside the change
                    arrow += f" ({d.verdict}, A/A {d.noise:.0%})"
                elif d.note.startswith("counted") and d.verdict in ("regressed", "improved"):
                    arrow += f" ({d.verdict}, {d.note})"
                elif d.note:
                    arrow += f" ({d.note})"
                metrics.append(f"[{style}]{d.name} {arrow}[/]" if style else f"{d.name} {arrow}")
            elif r.status != Status.skipped or d.candidate:  # a probe that judged nothing: its zeros say nothing
                metrics.append(f"{d.name} {_fmt(d.candidate, d.unit)}")
        metrics += curves(r)  # where a curve says more than its numbers: error against partitions
        status = f"[{_STATUS_STYLE[r.status]}]{r.status.value}[/]" + (" (cached)" if r.cached else "")
        row = [c.probe] + ([] if narrow else [c.kind])
        if report.baseline:
            row.append(c.baseline.value if c.baseline else "-")
        # why a probe judged nothing (skipped here, errored) before what it measured on the way
        cell = ([escape(r.reason)] if r.reason and r.status != Status.passed else []) + metrics
        row += [status, "\n".join(cell), f"{r.duration_s:.1f}s"]
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
    if report.verdict is not None:
        v = report.verdict
        style = {"better": "green", "unchanged": "", "inconclusive": "yellow"}.get(v.name, "red")
        name = f"[{style}]{v.name}[/]" if style else v.name
        console.print(f"candidate against the baseline: {name}: {escape(v.reason)}", highlight=False, soft_wrap=True)
    for path, why in list(report.unexercised.items())[:8]:
        console.print(f"[yellow]not exercised here:[/] {escape(path)}: {escape(why)}", highlight=False)
    verdict = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    skipped = sum(r.status == Status.skipped for r in report.results)
    note = f" ({skipped} of {len(report.results)} probes skipped: they judged nothing here)" if skipped else ""
    console.print(f"verdict: {verdict} in {report.duration_s:.1f}s{note}")
