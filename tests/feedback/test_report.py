"""Reports as a person reads them: on an 80-column terminal every probe and metric name is whole."""

from __future__ import annotations

from rich.console import Console

from feedback.harness import judge
from feedback.report import render
from infra_agent.session import render_summary


def test_an_80_column_report_cuts_no_name_into_an_ellipsis(toy):
    report = judge(toy, probe_ids=["toy.ok", "toy.bad"], run_all=True, use_cache=False)
    for width in (80, 140):
        console = Console(width=width, record=True, color_system=None)
        render(report, console)
        text = console.export_text()
        assert "…" not in text, text
        for r in report.results:
            assert r.probe in text
            for name in r.metrics:
                assert name in text


def test_a_narrow_session_summary_keeps_every_delta_whole():
    deltas = ["engine.kv_transfer.events.gil_blocked_fraction: 0.998 -> 0.0486",
              "kda.static.dot_precision.implicit_precision_calls: 5 -> 0"]
    summary = {"session": "s", "outcome": "finished", "steps": 2, "branch": "infra-agent/s", "head": "0" * 40,
               "accepted": 0, "held": 1, "rejected": 0, "failing_before": ["engine.kv_transfer.events"],
               "failing_after": [], "unaddressed": [], "summary": "", "trajectory": "t.jsonl", "scenario": None,
               "attempts": [{"step": 1, "playbook": "release-gil-native-calls", "verdict": "better",
                             "decision": "held", "reason": "now passing: engine.kv_transfer.events",
                             "deltas": deltas}]}
    console = Console(width=80, record=True, color_system=None)
    render_summary(summary, console)
    text = console.export_text()
    assert "…" not in text and "release-gil-native-calls" in text
    assert all(d in text for d in deltas), text
