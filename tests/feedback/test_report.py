"""Reports as a person reads them: on an 80-column terminal every probe and metric name is whole."""

from __future__ import annotations

import shutil

from rich.console import Console

from feedback.harness import judge
from feedback.report import render
from infra_agent.session import render_summary
from tests.support.trees import probe_tree


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
               "failing_after": [], "unaddressed": [], "summary": "", "scenario": None,
               "trajectory": "/tmp/tmp.UfEdWGObO9/.infra-agent/workspaces/20261207-082553-88491b/trajectory.jsonl",
               "attempts": [{"step": 1, "playbook": "release-gil-native-calls", "verdict": "better",
                             "decision": "held", "reason": "now passing: engine.kv_transfer.events",
                             "deltas": deltas}]}
    console = Console(width=80, record=True, color_system=None)
    render_summary(summary, console)
    text = console.export_text()
    assert "…" not in text and "release-gil-native-calls" in text
    assert all(d in text for d in deltas), text
    assert summary["trajectory"] in text, text  # whole on its line: a path broken in two cannot be pasted back


def test_a_curve_of_three_sizes_or_more_gets_a_sparkline_and_a_percentile_does_not(tmp_path):
    from feedback.report import curves, sparkline

    tree = probe_tree(tmp_path / "t", "cv", "def chain(ctx):\n"
                      "    for ranks, err in ((2, 2e-7), (8, 3e-5), (32, 4e-3)):\n"
                      "        ctx.metric(f'err_p{ranks}', err, better='lower')\n"
                      "    for q, ms in ((50, 1.0), (90, 2.0), (99, 9.0)):\n"
                      "        ctx.metric(f'ttft_ms_p{q}', ms, better='lower')\n",
                      "  - {id: cv.chain, kind: correctness, entry: 'cv.probes:chain'}\n")
    report = judge(tree, use_cache=False)
    (line,) = curves(report.results[0])  # the ranks, not the latency percentiles
    assert line.startswith("err vs p ▁") and "█ " in line and "(p 2..32)" in line, line
    console = Console(width=80, record=True, color_system=None)
    render(report, console)
    assert line in console.export_text()
    assert sparkline([(1, 5.0), (2, 1.0), (4, 5.0)]) == "█▁█" and sparkline([(1, 0.0), (2, -1.0), (3, 0.0)]) == "█▁█"


def test_a_failure_is_headlined_and_localised_by_its_failed_check_not_by_what_the_probe_observed(tmp_path):
    """A probe that reports its observations (a kernel's counts, one finding per function) and fails one
    check: the verdict's reason and the localisation lines are that check's, at its file."""
    tree = probe_tree(tmp_path / "t", "ob", "def step(ctx):\n"
                      "    ctx.finding('12 launches per step', file='ob/norm.py', symbol='rms_norm')\n"
                      "    ctx.finding('6 launches per step', file='ob/route.py', symbol='route')\n"
                      "    ctx.check(ctx.params['ok'], 'reads a tensor on the host', file='ob/moe.py', symbol='moe')\n",
                      "  - {id: ob.step, kind: trace, entry: 'ob.probes:step', params: {ok: true}}\n")
    base = tmp_path / "base"
    shutil.copytree(tree, base)
    manifest = tree / "infra-agent.yaml"
    manifest.write_text(manifest.read_text().replace("ok: true", "ok: false"))
    report = judge(tree, baseline_tree=base, use_cache=False)
    (res,) = report.results
    assert res.status.value == "fail" and [f.failed for f in res.findings] == [False, False, True]
    assert report.verdict.name == "incorrect" and "reads a tensor on the host" in report.verdict.reason
    assert "12 launches" not in report.verdict.reason
    (lines,) = [c.localisation for c in report.comparisons]
    assert len(lines) == 1 and "reads a tensor on the host" in lines[0] and "ob/moe.py" in lines[0], lines


def test_a_location_on_a_source_line_reads_as_file_colon_line():
    from feedback.models import Location

    assert Location(file="pkg/k.py", symbol="merge", condition="line 7").render() == "at pkg/k.py:7 merge"
    assert (Location(file="tests/t.py", symbol="t_big", condition="line 12, in test t_big").render()
            == "at tests/t.py:12 t_big; in test t_big")
    # any other condition is an input condition; a line without a file stays one too
    assert (Location(file="m.py", kernel="k", param="p=1", condition="T=256").render()
            == "at m.py k; param p=1; input T=256")
    assert Location(symbol="f", condition="line 7").render() == "in f; input line 7"
