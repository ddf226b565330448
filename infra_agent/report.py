"""``infra-agent report``: one self-contained HTML page for a session, or for a folder of records.

What a reviewer needs before approving, as pictures where pictures say it better: the goal and the
baseline's feedback (its localisation lines as the agent saw them); then each attempt with its
hypothesis, playbook, diff, gate findings, verdict and why, and the plots that apply to its probes:

* error against a size parameter (metrics named ``..._p<N>``, ``..._T<N>``, ``..._batch<N>``: ranks,
  context length, batch), baseline against candidate;
* A/B distributions (every repeat of a timed metric on both sides, the medians, the bootstrap
  interval of their ratio);
* roofline position (``*bandwidth_vs_copy``: achieved bandwidth over the copy bandwidth measured in
  the same run);
* the runtime-event timeline of probes that read events (prefill layers, native calls, KV-transfer
  stages), per thread, baseline above candidate on one time axis.

Inline SVG only (``infra_agent/svg.py``): no script, no stylesheet or font from elsewhere, so the page
opens anywhere, offline.
"""

from __future__ import annotations

import html
import json
import pathlib
from collections import defaultdict

from feedback.report import size_series as sized
from feedback.verdict import judged_by_performance, ratio_interval
from infra_agent import svg
from infra_agent.experiments import ExperimentRecord, RecordError, load_record

STYLE = """body{font:14px/1.45 system-ui,sans-serif;color:#24292f;max-width:1100px;margin:2em auto;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #d0d7de}
pre{background:#f6f8fa;padding:.8em;overflow:auto;font-size:12px}.plots{display:flex;flex-wrap:wrap;gap:12px}
.verdict{font-weight:bold}.better{color:#1a7f37}.incorrect,.worse{color:#cf222e}.held{color:#9a6700}
table{border-collapse:collapse}td,th{border:1px solid #d0d7de;padding:2px 8px;font-size:12px;text-align:left}"""


def _e(text: object) -> str:
    return html.escape(str(text))


def size_series(results: dict[str, tuple]) -> list[str]:
    """Plots of metrics that vary with a size parameter, baseline against candidate, per probe."""
    out = []
    for probe, (cand, base) in results.items():
        groups: dict[tuple[str, str], dict[str, list]] = defaultdict(lambda: {"baseline": [], "candidate": []})
        for side, r in (("candidate", cand), ("baseline", base)):
            for key, pts in sized(r).items():
                groups[key][side] = pts
        for (base_name, dim), series in groups.items():
            if len(series["candidate"]) + len(series["baseline"]) >= 3:
                out.append(svg.lines(f"{probe}: {base_name} against {dim}", dim, base_name,
                                     {k: v for k, v in series.items() if v}))
    return [p for p in out if p]


def ab_plots(results: dict[str, tuple], kinds: dict[str, str]) -> list[str]:
    out = []
    for probe, (cand, base) in results.items():
        if not (cand and base and judged_by_performance(kinds.get(probe, ""))):
            continue
        for name, m in cand.metrics.items():
            b = base.metrics.get(name)
            if b is None or len(m.samples) < 2 or len(b.samples) < 2 or name.endswith("bandwidth_vs_copy"):
                continue
            ci = ratio_interval(b, m)
            note = f"candidate / baseline: 95% interval {ci[0]:.3f} to {ci[1]:.3f}" if ci else ""
            out.append(svg.strips(f"{probe}.{name}", m.unit, {"baseline": b.samples, "candidate": m.samples}, note))
    return [p for p in out if p]


def roofline(results: dict[str, tuple]) -> list[str]:
    out = []
    for probe, (cand, base) in results.items():
        for name, m in (cand.metrics.items() if cand else []):
            if name.endswith("bandwidth_vs_copy"):
                values = {"baseline": base.metrics[name].value} if base and name in base.metrics else {}
                out.append(svg.bars(f"{probe}.{name}", {**values, "candidate": m.value}))
    return [p for p in out if p]


def timelines(results: dict[str, tuple]) -> list[str]:
    """The runtime events a probe read, per thread, baseline above candidate on one time axis."""
    out = []
    for probe, (cand, base) in results.items():
        sides = {"baseline": base.timeline if base else [], "candidate": cand.timeline if cand else []}
        if any(sides.values()):
            out.append(svg.timeline(f"{probe}: runtime events per thread", sides))
    return [p for p in out if p]


def attempt_html(rec: ExperimentRecord) -> str:
    results = {p.id: (p.result, p.baseline) for p in rec.probes}
    kinds = {p.id: p.kind for p in rec.probes}
    plots = size_series(results) + ab_plots(results, kinds) + roofline(results) + timelines(results)
    rows = "".join(f"<tr><td>{_e(p.id)}</td><td>{_e(p.baseline.status.value if p.baseline else '-')}</td>"
                   f"<td>{_e(p.result.status.value)}</td><td>{_e((p.result.reason or '')[:160])}</td></tr>"
                   for p in rec.probes)
    decision = rec.decision
    return (f'<section class="attempt" id="{_e(rec.id)}"><h2>{_e(rec.id)}: {_e(rec.playbook or "patch")}</h2>'
            f"<p><b>hypothesis</b> {_e(rec.hypothesis)}</p>"
            f'<p class="verdict {_e(rec.verdict)} {_e(decision.status)}">verdict {_e(rec.verdict)}, decision '
            f"{_e(decision.status)}" + (f" (review item {decision.review_item})" if decision.review_item else "")
            + f": {_e(decision.reason)}</p>"
            + ("<p><b>gate</b></p><ul>" + "".join(f"<li>{_e(r)}</li>" for r in rec.risk) + "</ul>" if rec.risk else "")
            + f'<div class="plots">{"".join(plots)}</div>'
            + (f"<table><tr><th>probe</th><th>baseline</th><th>candidate</th><th>why</th></tr>{rows}</table>"
               if rows else "")
            + f"<details><summary>diff</summary><pre>{_e(rec.diff)}</pre></details></section>")


def page(title: str, intro: str, records: list[ExperimentRecord]) -> str:
    body = "".join(attempt_html(r) for r in records) or "<p>No attempts were recorded.</p>"
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{STYLE}</style></head><body><h1>{_e(title)}</h1>{intro}{body}</body></html>")


def _records(paths: list[pathlib.Path]) -> list[ExperimentRecord]:
    out = []
    for p in sorted(paths):
        try:
            out.append(load_record(p))
        except RecordError:
            continue  # a damaged record is left out of the picture, not fatal to it
    return out


def session_report(session_dir: pathlib.Path, experiments: pathlib.Path) -> str:
    """The page for one session folder (session.json, trajectory.jsonl, summary.json) and its records."""
    meta = json.loads((session_dir / "session.json").read_text())
    summary = {}
    if (session_dir / "summary.json").is_file():
        summary = json.loads((session_dir / "summary.json").read_text())
    first = ""
    traj = session_dir / "trajectory.jsonl"
    if traj.is_file():
        for line in traj.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("role") == "user":
                first = rec.get("content") or ""
                break
    records = _records(list(experiments.glob(f"exp-{meta['session']}-*.yaml")))
    intro = (f"<p>target {_e(meta.get('target'))}, branch {_e(meta.get('branch'))}, outcome "
             f"{_e(summary.get('outcome', 'running or killed'))}; failing before: "
             f"{_e(', '.join(summary.get('failing_before', [])) or '-')}; failing after: "
             f"{_e(', '.join(summary.get('failing_after', [])) or '-')}</p>"
             f"<details open><summary>the goal and the baseline's feedback, as the agent saw them</summary>"
             f"<pre>{_e(first)}</pre></details>")
    return page(f"infra-agent session {meta['session']}", intro, records)


def records_report(folder: pathlib.Path) -> str:
    records = _records(list(folder.glob("*.yaml")))
    return page(f"infra-agent experiments in {folder}", f"<p>{len(records)} record(s).</p>", records)
