"""The harness: localisation lines, acceptance criteria, the cascade, the baseline comparison."""

from __future__ import annotations

import json
import pathlib

import pytest

from feedback.changes import changed_since
from feedback.harness import UnknownProbe, judge
from feedback.models import Status


def test_localisation_line_names_probe_message_file_kernel_param_and_input(toy):
    report = judge(toy, probe_ids=["toy.located"], use_cache=False)
    (line,) = report.localisations()
    assert line == ("probe `toy.located` failed: error grows 41x from P=2 to P=64; at toy/merge.py merge_kernel; "
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


JUDGED = '''
schema_version: 1
name: judged
probes:
  - {id: j.check, kind: correctness, entry: "pkg.probes:check", covers: {files: ["pkg/core.py"]}}
protected: [pkg/probes.py]
'''
JUDGE = '''
from feedback.probe import probe

@probe
def check(ctx):
    from pkg import core
    ctx.check(core.f() == 1, "f() is not 1")
'''
HONEST = "def f():\n    return 1\n"
# right answer, and on import it rewrites the probe that judges it (a later run would always pass)
TAMPERING = '''import pathlib

_judge = pathlib.Path(__file__).resolve().parent / "probes.py"
_judge.write_text(_judge.read_text().replace("core.f() == 1", "True"))


def f():
    return 1
'''


def _judged_tree(root: pathlib.Path, core: str, judge_src: str = JUDGE) -> pathlib.Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "probes.py").write_text(judge_src)
    (root / "pkg" / "core.py").write_text(core)
    (root / "infra-agent.yaml").write_text(JUDGED)
    return root


def test_a_candidate_that_rewrites_its_judge_while_probed_is_incorrect(tmp_path):
    base = _judged_tree(tmp_path / "base", HONEST)
    cand = _judged_tree(tmp_path / "cand", TAMPERING)
    report = judge(cand, baseline_tree=base, run_all=True, use_cache=False)
    assert report.results[0].status == Status.passed  # the probe itself saw nothing wrong
    assert report.verdict.name == "incorrect", report.verdict
    assert report.verdict.reason == "the judges were tampered with: pkg/probes.py changed while the candidate's " \
                                    "probes ran"
    honest = judge(_judged_tree(tmp_path / "honest", HONEST), baseline_tree=base, run_all=True, use_cache=False)
    assert honest.verdict.name == "unchanged" and honest.judges_changed == []


def test_a_candidate_judged_by_other_judges_than_its_baseline_is_incorrect_where_they_must_agree(tmp_path):
    base = _judged_tree(tmp_path / "base", HONEST)
    lenient = _judged_tree(tmp_path / "cand", "def f():\n    return 2\n", JUDGE.replace("core.f() == 1", "True"))
    patch_like = judge(lenient, baseline_tree=base, run_all=True, use_cache=False, same_judges=True)
    assert patch_like.verdict.name == "incorrect"
    assert "pkg/probes.py differs from the baseline's" in patch_like.verdict.reason
    # two revisions compared by a person (feedback --changed-from): a changed probe is allowed there
    revisions = judge(lenient, baseline_tree=base, run_all=True, use_cache=False)
    assert revisions.judges_changed == [] and revisions.verdict.name != "incorrect"


_PAIR_PROBES = '''
import json, os, time
from feedback.probe import probe


@probe(kind="microbench")
def bench(ctx):
    t0 = time.time()
    time.sleep(0.15)
    with open(ctx.params["log"], "a") as f:
        f.write(json.dumps({"probe": ctx.probe_id, "tree": os.path.basename(os.getcwd()), "t0": t0,
                            "t1": time.time()}) + "\\n")
    ctx.metric("t_us", 100.0 + (1.0 if "cand" in os.getcwd() else 0.0), unit="us", better="lower")


@probe(kind="correctness")
def check(ctx):
    ctx.metric("ok", 1.0)
'''


def _pair_tree(root: pathlib.Path, log: pathlib.Path) -> pathlib.Path:
    (root / "pp").mkdir(parents=True)
    (root / "pp" / "__init__.py").write_text("")
    (root / "pp" / "probes.py").write_text(_PAIR_PROBES)
    (root / "pp" / "code.py").write_text("X = 1\n")
    probes = "\n".join(f"  - {{id: b{i}, kind: microbench, entry: 'pp.probes:bench', repeats: 2, "
                       f"params: {{log: '{log}'}}, covers: {{files: ['pp/code.py']}}}}" for i in range(3))
    (root / "infra-agent.yaml").write_text("schema_version: 1\nname: pairs\nprobes:\n" + probes + "\n"
                                           "  - {id: c0, kind: correctness, entry: 'pp.probes:check', "
                                           "covers: {files: ['pp/code.py']}}\n")
    return root


def test_timings_of_a_comparison_run_alone_side_by_side_and_never_against_a_stale_baseline(tmp_path):
    """Microbenchmarks with a baseline: one probe at a time on the machine (jobs=4 notwithstanding), each
    probe's candidate and baseline repeats interleaved (ABBA), the side going first alternating; and a
    candidate is re-timed with its baseline when the cache holds only one of the two."""
    log = tmp_path / "runs.jsonl"
    base = _pair_tree(tmp_path / "base", log)
    cand = _pair_tree(tmp_path / "cand", log)
    (cand / "pp" / "code.py").write_text("X = 2\n")
    cache = tmp_path / "cache"
    judge(cand, changed=["pp/code.py"], jobs=4, cache_dir=cache)  # the candidate alone: its results cached
    log.write_text("")
    report = judge(cand, changed=["pp/code.py"], baseline_tree=base, jobs=4, cache_dir=cache)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    spans = sorted((r["t0"], r["t1"]) for r in runs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two timings overlapped"
    order = [(r["probe"], r["tree"]) for r in sorted(runs, key=lambda r: r["t0"])]
    abba = lambda p, a, b: [(p, a), (p, b), (p, b), (p, a)]  # noqa: E731
    assert order == abba("b0", "cand", "base") + abba("b1", "base", "cand") + abba("b2", "cand", "base")
    timed = [r for r in report.results if r.probe.startswith("b")]
    assert len(timed) == 3 and not any(r.cached for r in timed)  # cached alone, re-timed beside its baseline
    assert next(r for r in report.results if r.probe == "c0").cached  # a correctness probe keeps its cache
    again = judge(cand, changed=["pp/code.py"], baseline_tree=base, jobs=4, cache_dir=cache)
    assert all(r.cached for r in again.results + again.baseline_results)  # a whole pair: from the cache


_STAGE_PROBES = '''
import os, time
from feedback.probe import probe

def _stamp(ctx, what):
    with open(ctx.params["log"], "a") as f:
        f.write(f"{what} {time.time()} {os.getpid()}\\n")

@probe
def source_check(ctx):
    time.sleep(ctx.params["sleep"])
    _stamp(ctx, "static-end")
    if ctx.params["fail"]:
        ctx.fail("a tl.dot without its input_precision", file="st/code.py")

@probe
def long_check(ctx):
    _stamp(ctx, "correctness-start")
    time.sleep(ctx.params["sleep"])
    _stamp(ctx, "correctness-end")
'''


def _stage_tree(root: pathlib.Path, log: pathlib.Path, static_fails: bool, correctness_s: float,
                kind: str = "correctness") -> pathlib.Path:
    (root / "st").mkdir(parents=True)
    (root / "st" / "__init__.py").write_text("")
    (root / "st" / "probes.py").write_text(_STAGE_PROBES)
    (root / "st" / "code.py").write_text("X = 1\n")
    (root / "infra-agent.yaml").write_text(
        "schema_version: 1\nname: stages\nprobes:\n"
        f"  - {{id: s0, kind: static, entry: 'st.probes:source_check', params: {{log: '{log}', sleep: 1.5, "
        f"fail: {str(static_fails).lower()}}}, covers: {{files: ['st/code.py']}}}}\n"
        f"  - {{id: c0, kind: {kind}, entry: 'st.probes:long_check', params: {{log: '{log}', "
        f"sleep: {correctness_s}}}, budget_s: 300, covers: {{files: ['st/code.py']}}}}\n")
    return root


def _stamps(log: pathlib.Path) -> dict[str, tuple[float, int]]:
    return {what: (float(t), int(pid)) for what, t, pid in (line.split() for line in log.read_text().splitlines())}


@pytest.mark.parametrize("kind", ["correctness", "events"])
def test_a_correctness_stage_starts_beside_the_static_one_and_is_reported_once_it_passed(tmp_path, kind):
    log = tmp_path / "stamps.txt"
    tree = _stage_tree(tmp_path / "t", log, static_fails=False, correctness_s=2.0, kind=kind)
    seen = []
    report = judge(tree, changed=["st/code.py"], use_cache=False, on_result=lambda side, r: seen.append(r.probe))
    stamps = _stamps(log)
    if kind == "correctness":
        assert stamps["correctness-start"][0] < stamps["static-end"][0]  # it did not wait for the static stage
    else:  # a stage that times anything waits for a quiet machine
        assert stamps["correctness-start"][0] > stamps["static-end"][0]
    assert [r.probe for r in report.results] == ["s0", "c0"] and report.passed and report.stopped_at is None
    assert seen == ["s0", "c0"]  # reported in the cascade's order all the same


def test_a_failing_static_stage_stops_the_stage_started_beside_it(tmp_path):
    import time

    from feedback.manifest import load_manifest
    from feedback.runner import Runner
    from tests.support.processes import alive

    log = tmp_path / "stamps.txt"
    tree = _stage_tree(tmp_path / "t", log, static_fails=True, correctness_s=120.0)
    cache = tmp_path / "cache"
    t0 = time.monotonic()
    report = judge(tree, changed=["st/code.py"], cache_dir=cache)
    elapsed = time.monotonic() - t0
    assert report.stopped_at == "static" and [r.probe for r in report.results] == ["s0"]
    assert report.results[0].status == Status.failed
    assert elapsed < 60, f"the verdict waited for the stopped probe ({elapsed:.0f} s)"
    stamps = _stamps(log)
    assert "correctness-start" in stamps and "correctness-end" not in stamps
    pid = stamps["correctness-start"][1]
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:  # killed with its process group
        time.sleep(0.05)
    assert not alive(pid), f"the stopped probe (pid {pid}) still runs"
    manifest = load_manifest(tree)
    runner = Runner(tree, manifest, cache_dir=str(cache))
    assert runner.cached(manifest.probe("s0")) is not None and runner.cached(manifest.probe("c0")) is None
    # with every stage asked for, nothing is stopped: the correctness stage's own verdict comes back
    quick = _stage_tree(tmp_path / "q", tmp_path / "q.txt", static_fails=True, correctness_s=0.5)
    everything = judge(quick, changed=["st/code.py"], use_cache=False, run_all=True)
    assert [(r.probe, r.status) for r in everything.results] == [("s0", Status.failed), ("c0", Status.passed)]


def test_a_static_failure_the_baseline_shares_does_not_stop_the_cascade_a_new_one_does(tmp_path):
    # a tree whose static check already fails (a starter manifest on a repository with a real finding) must still
    # get its tests run on every change; a candidate that brings the failure stops at the static stage
    failing_base = _stage_tree(tmp_path / "b1", tmp_path / "b1.txt", static_fails=True, correctness_s=0.3)
    cand = _stage_tree(tmp_path / "c1", tmp_path / "c1.txt", static_fails=True, correctness_s=0.3)
    report = judge(cand, changed=["st/code.py"], baseline_tree=failing_base, use_cache=False)
    assert report.stopped_at is None, report.stopped_at
    assert [(r.probe, r.status) for r in report.results] == [("s0", Status.failed), ("c0", Status.passed)]
    assert [(r.probe, r.status) for r in report.baseline_results] == [("s0", Status.failed), ("c0", Status.passed)]
    assert "correctness-end" in _stamps(tmp_path / "c1.txt")
    passing_base = _stage_tree(tmp_path / "b2", tmp_path / "b2.txt", static_fails=False, correctness_s=0.3)
    cand = _stage_tree(tmp_path / "c2", tmp_path / "c2.txt", static_fails=True, correctness_s=30.0)
    report = judge(cand, changed=["st/code.py"], baseline_tree=passing_base, use_cache=False)
    assert report.stopped_at == "static" and [r.probe for r in report.results] == ["s0"]
    assert report.verdict.name == "incorrect" and report.verdict.broke, report.verdict


def test_a_changed_file_whose_code_no_probe_ran_here_is_named(toy):
    # FlagAttention: a causal-mask change in a kernel every test of which needs CUDA read "PASS (1 of 6 probes
    # skipped)"; a kernel file covered by static checks alone read "PASS in 0.2s". Neither said what went unjudged
    from feedback.manifest import parse_manifest

    manifest = parse_manifest("""
schema_version: 1
name: toy
probes:
  - {id: s.static, kind: static, entry: "toy.probes:ok", covers: {files: ["toy/*.py"]}}
  - {id: t.gpu_only, kind: correctness, entry: "toy.probes:skips", covers: {files: ["toy/a.py"]}}
  - {id: t.runs, kind: correctness, entry: "toy.probes:ok", covers: {files: ["toy/c.py"]}}
""")
    changed = ["toy/a.py", "toy/b.py", "toy/c.py", "tests/test_a.py", "README.md"]
    report = judge(toy, manifest=manifest, changed=changed, use_cache=False)
    assert report.passed
    assert report.unexercised == {"toy/a.py": "every probe that runs it skipped here (t.gpu_only)",
                                  "toy/b.py": "only static checks cover it: no probe runs its code"}
    from feedback.report import render
    from infra_agent.tools import render_report

    assert "not exercised here: toy/a.py: every probe that runs it skipped here (t.gpu_only)" in render_report(report)
    import io

    from rich.console import Console

    out = io.StringIO()
    render(report, Console(file=out, width=200))
    assert "not exercised here: toy/b.py: only static checks cover it" in out.getvalue()
