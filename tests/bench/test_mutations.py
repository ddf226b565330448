"""bench/mutations.py: every corpus entry applies to exactly one place of the clean target, entries that
do not apply are refused as "not applicable", and an end-to-end run catches and localises two cheap defects."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from feedback.models import (
    FeedbackReport,
    Finding,
    Location,
    MetricDelta,
    ProbeComparison,
    ProbeResult,
    Status,
)
from feedback.targets import materialize_bundled

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_mutations", ROOT / "bench" / "mutations.py")
mutations = sys.modules.setdefault("bench_mutations", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(mutations)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> pathlib.Path:
    return materialize_bundled(tmp_path_factory.mktemp("mutations") / "clean")


def test_every_corpus_entry_applies_to_exactly_one_place(clean):
    corpus = mutations.load_corpus()
    assert len(corpus) >= 30
    assert {m.area for m in corpus} == set(mutations.AREAS)
    problems = []
    for m in corpus:
        try:
            text, at = mutations.locate(m, clean)
        except mutations.NotApplicable as exc:
            problems.append(f"{m.id}: {exc}")
            continue
        mutated = text[:at] + m.new + text[at + len(m.old):]
        assert mutated != text
        if m.file.endswith(".py"):  # a realistic defect still compiles; a syntax error is no test of a probe
            try:
                compile(mutated, m.file, "exec")
            except SyntaxError as exc:
                problems.append(f"{m.id}: the mutated {m.file} does not compile: {exc}")
        if not (clean / m.expect).is_file():
            problems.append(f"{m.id}: expected localisation file {m.expect} is not in the tree")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("corpus", ["blind3.yaml", "blind4.yaml", "perf_defects.yaml"])
def test_every_entry_of_the_other_corpora_applies_once_and_compiles(clean, corpus):
    problems = []
    for m in mutations.load_corpus(ROOT / "bench" / corpus):
        try:
            text, at = mutations.locate(m, clean)
        except mutations.NotApplicable as exc:
            problems.append(f"{m.id}: {exc}")
            continue
        if m.file.endswith(".py"):
            try:
                compile(text[:at] + m.new + text[at + len(m.old):], m.file, "exec")
            except SyntaxError as exc:
                problems.append(f"{m.id}: the mutated {m.file} does not compile: {exc}")
    assert not problems, "\n".join(problems)


def test_absent_or_ambiguous_text_is_not_applicable(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\nx = 1\ny = 2\n")
    entry = {"area": "engine", "file": "a.py", "new": "z = 3", "description": "d", "expect": "a.py"}
    with pytest.raises(mutations.NotApplicable, match=r"ambiguous: 2 places in a\.py \(lines 1, 2\)"):
        mutations.apply(mutations.Mutation(id="twice", old="x = 1", **entry), tmp_path)
    with pytest.raises(mutations.NotApplicable, match="does not occur"):
        mutations.apply(mutations.Mutation(id="absent", old="w = 0", **entry), tmp_path)
    with pytest.raises(mutations.NotApplicable, match="not in the tree"):
        mutations.apply(mutations.Mutation(id="nofile", old="x", **{**entry, "file": "b.py"}), tmp_path)
    assert (tmp_path / "a.py").read_text() == "x = 1\nx = 1\ny = 2\n"
    assert mutations.apply(mutations.Mutation(id="once", old="y = 2", **entry), tmp_path) == 3
    assert (tmp_path / "a.py").read_text() == "x = 1\nx = 1\nz = 3\n"


def test_the_tool_reports_entries_that_do_not_apply_instead_of_crashing(tmp_path):
    corpus = tmp_path / "corpus.yaml"
    corpus.write_text(
        "- {id: gone, area: sampler, file: target_stack/engine/sampler.py, old: 'no such text', new: x,"
        " description: absent}\n"
        "- {id: many, area: kernel, file: target_stack/ops/kda/chunk.py, old: 'tl.store(', new: 'tl.store (',"
        " description: ambiguous}\n")
    out = tmp_path / "out.json"
    assert mutations.main(["--corpus", str(corpus), "--json", str(out)]) == 0
    results = {r["id"]: r for r in json.loads(out.read_text())["results"]}
    assert results["gone"]["status"] == "not applicable" and "does not occur" in results["gone"]["reason"]
    assert results["many"]["status"] == "not applicable" and "ambiguous" in results["many"]["reason"]


@pytest.mark.slow
def test_end_to_end_on_two_cheap_defects(tmp_path):
    """A real harness run: the CP merge's dot losing its precision (the static probe), and the merge storing
    each partition's incoming state one partition late (the CP correctness probe)."""
    out = tmp_path / "mutations.json"
    ids = "kda-cp-merge-implicit-tf32,kda-cp-h-in-after-update"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "mutations.py"), "--only", ids, "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    results = {r["id"]: r for r in data["results"]}
    assert set(results) == set(ids.split(","))
    static = results["kda-cp-merge-implicit-tf32"]
    assert static["caught"] and static["localised"], static
    assert static["caught_by"] == ["kda.static.dot_precision"]
    assert "kda.cp.correctness" in static["selected"]
    assert "target_stack/ops/kda/cp.py" in static["first_localisation"]
    late = results["kda-cp-h-in-after-update"]
    assert late["caught"] and late["localised"], late
    assert "kda.cp.correctness" in late["caught_by"]
    assert data["totals"]["caught"] == 2 and data["totals"]["localised"] == 2
    assert "[1/2]" in proc.stdout and "[2/2]" in proc.stdout


def test_a_performance_defect_is_caught_by_counted_work_and_localised_by_its_kernel():
    """No probe fails on a performance defect: more counted work than the clean tree catches it, and the
    probe's finding for the kernel the regressed metric names localises it."""
    m = mutations.Mutation(id="p", area="kernel", file="ops/a.py", old="x", new="y", description="d", expect="ops/a.py")

    def report(verdict: str, note: str, kernel_file: str) -> FeedbackReport:
        findings = [Finding(message="per token: ...", location=Location(file=kernel_file, kernel="_k")),
                    Finding(message="per token: ...", location=Location(file="ops/b.py", kernel="_other"))]
        res = ProbeResult(probe="w", status=Status.passed, findings=findings)
        delta = MetricDelta(name="op._k.loaded_bytes", baseline=1.0, candidate=2.0, change=2.0, verdict=verdict,
                            note=note)
        return FeedbackReport(target="t", candidate="c", results=[res],
                              baseline_results=[res.model_copy(update={"findings": []})],
                              comparisons=[ProbeComparison(probe="w", kind="trace", baseline=Status.passed,
                                                           candidate=Status.passed, deltas=[delta])])

    got = mutations.classify(report("regressed", "counted: exact, no noise", "ops/a.py"), m, {"w": "trace"})
    assert got["caught"] and got["localised"] and got["caught_by"] == ["w"]
    assert got["more_work"] == ["w.op._k.loaded_bytes"]
    elsewhere = mutations.classify(report("regressed", "counted: exact, no noise", "ops/c.py"), m, {"w": "trace"})
    assert elsewhere["caught"] and not elsewhere["localised"]
    # a timed metric's regression is not counted work: the noise rule's business, not a catch here
    timed = mutations.classify(report("regressed", "", "ops/a.py"), m, {"w": "microbench"})
    assert not timed["caught"] and timed["more_work"] == []


def test_a_launch_defect_is_localised_by_its_function_and_a_failure_by_its_failed_checks_only():
    """A counted metric named for a function (``<file>:<function>.launches``) localises by the finding bound to
    that function; a failing probe localises by its failed checks, not by what it observed on the way."""
    m = mutations.Mutation(id="p", area="engine", file="e/run.py", old="x", new="y", description="d",
                           expect="e/run.py")
    observed = [Finding(message="3 launches", location=Location(file="e/run.py", symbol="Runner.step")),
                Finding(message="9 launches", location=Location(file="e/other.py", symbol="helper"))]

    def report(status: Status, findings: list, deltas: list) -> FeedbackReport:
        res = ProbeResult(probe="s", status=status, findings=findings)
        return FeedbackReport(target="t", candidate="c", results=[res],
                              baseline_results=[ProbeResult(probe="s", status=Status.passed)],
                              comparisons=[ProbeComparison(probe="s", kind="trace", baseline=Status.passed,
                                                           candidate=status, deltas=deltas)])

    def grew(name: str) -> MetricDelta:
        return MetricDelta(name=name, baseline=3.0, candidate=5.0, change=5 / 3, verdict="regressed",
                           note="counted: exact, no noise")

    got = mutations.classify(report(Status.passed, observed, [grew("e/run.py:Runner.step.launches")]), m, {})
    assert got["caught"] and got["localised"]
    other = mutations.classify(report(Status.passed, observed, [grew("e/other.py:helper.launches")]), m, {})
    assert other["caught"] and not other["localised"]  # the function that launches more is elsewhere
    # failing at another file: the observed finding at e/run.py does not localise it
    failed = [Finding(message="host read", location=Location(file="e/other.py", symbol="helper"), failed=True)]
    wrong = mutations.classify(report(Status.failed, failed + observed, []), m, {})
    assert wrong["caught"] and not wrong["localised"]
    right = mutations.classify(report(Status.failed, [failed[0].model_copy(update={"location": Location(
        file="e/run.py", symbol="Runner.step")})] + observed, []), m, {})
    assert right["caught"] and right["localised"]
