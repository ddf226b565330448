"""The harness: localisation lines, acceptance criteria, the cascade, the baseline comparison."""

from __future__ import annotations

import pytest

from feedback.harness import UnknownProbe, judge
from feedback.select import changed_since


def test_localisation_line_names_probe_message_file_kernel_param_and_input(toy):
    report = judge(toy, probe_ids=["toy.located"], use_cache=False)
    (line,) = report.localisations()
    assert line == ("probe `toy.located` failed: error grows 41x from P=2 to P=64; cover toy/merge.py merge_kernel; "
                    "param merge_precision='tf32'; input T=256")


def test_acceptance_criteria_are_evaluated(toy):
    report = judge(toy, probe_ids=["toy.ok", "toy.bad"], use_cache=False, run_all=True)
    acc = {a.name: a for a in report.acceptance}
    assert acc["precise"].holds is True and acc["bad"].holds is False
    assert not report.passed


def test_unknown_probe_lists_the_known_ones(toy):
    with pytest.raises(UnknownProbe, match="known: toy.static, toy.ok"):
        judge(toy, probe_ids=["toy.nope"])


def test_cascade_stops_at_the_first_failing_stage_unless_all(toy):
    (toy / "toy" / "core.py").write_text("def core():\n    return 2\n")
    changed = changed_since(toy, "HEAD")
    report = judge(toy, changed=changed, use_cache=False)
    assert report.stopped_at == "correctness"
    assert {r.probe for r in report.results} == {"toy.ok", "toy.bad"}  # microbench stage not run
    everything = judge(toy, changed=changed, use_cache=False, run_all=True)
    assert {r.probe for r in everything.results} == {"toy.ok", "toy.bad", "toy.skips"}


def test_baseline_comparison_reports_deltas(toy, tmp_path):
    from feedback.harness import export_baseline

    (toy / "toy" / "value.txt").write_text("3")
    base_tree, keep = export_baseline(toy, "HEAD")
    report = judge(toy, probe_ids=["toy.ok"], baseline_tree=base_tree, baseline_label="HEAD", use_cache=False)
    keep.cleanup()
    (cmp,) = report.comparisons
    marker = next(d for d in cmp.deltas if d.name == "marker")
    assert (marker.baseline, marker.candidate, marker.change) == (1.0, 3.0, 3.0)
