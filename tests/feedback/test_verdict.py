"""The one judgement (feedback/verdict.py): every verdict, the noise rule, the A/A floor, replay.

Unit cases on constructed results, then the real harness on a toy target whose probes are real
subprocesses: a candidate is judged against a baseline tree exactly as the agent judges one.
"""

from __future__ import annotations

import pathlib
import random

import pytest

from feedback.harness import judge
from feedback.manifest import parse_manifest
from feedback.models import CriterionResult, FeedbackReport, Finding, Metric, ProbeComparison, ProbeResult, Status
from feedback.verdict import (
    COUNT_TOLERANCE,
    MIN_NOISE,
    combine_runs,
    compare,
    compare_metric,
    noise_floor,
    replay_regressions,
    verdict,
)

MANIFEST = parse_manifest("""
schema_version: 1
name: unit
probes:
  - {id: c, kind: correctness, entry: "m:f"}
  - {id: d, kind: correctness, entry: "m:f"}
  - {id: t, kind: microbench, entry: "m:f"}
""", "unit.yaml")


def result(probe: str, status: Status = Status.passed, reason: str | None = None, env: bool = False,
           **metrics: Metric) -> ProbeResult:
    return ProbeResult(probe=probe, status=status, reason=reason, environment_failure=env, metrics=metrics)


def timed(*values: float) -> Metric:
    return combine_runs([result("t", **{"ms": Metric(value=v, better="lower")}) for v in values]).metrics["ms"]


def report(cand: list[ProbeResult], base: list[ProbeResult], acc=(), base_acc=()) -> FeedbackReport:
    return FeedbackReport(target="unit", candidate="c", baseline="b", results=cand, baseline_results=base,
                          comparisons=compare(MANIFEST, cand, base), acceptance=list(acc),
                          baseline_acceptance=list(base_acc))


def crit(holds: bool | None, value: float | None = 1.0) -> CriterionResult:
    return CriterionResult(name="precise", expression="c.err <= 1e-6", value=value, holds=holds)


# --- every verdict -----------------------------------------------------------------------------------


def test_a_check_that_held_and_now_fails_is_incorrect():
    v = verdict(report([result("c", Status.failed)], [result("c")]))
    assert v.name == "incorrect" and v.broke == ["c fail: fail"]


def test_a_probe_that_errors_only_on_the_candidate_is_the_candidates_fault():
    v = verdict(report([result("c", Status.error, "IndexError: out of bounds (at k.py:3)")], [result("c")]))
    assert v.name == "incorrect" and "IndexError" in v.reason
    v = verdict(report([result("c", Status.timeout, "no result within budget_s=2")], [result("c")]))
    assert v.name == "incorrect"


def test_a_probe_that_errors_on_both_sides_is_inconclusive_and_says_the_probe_is_broken():
    gpu = "ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"
    v = verdict(report([result("c", Status.error, gpu), result("d")], [result("c", Status.error, gpu), result("d")]))
    assert v.name == "inconclusive" and "the probe is broken, not the candidate" in v.reason and gpu in v.reason
    assert v.broken_probes and not v.broke


def test_an_environment_failure_is_never_blamed_on_the_candidate():
    v = verdict(report([result("c", Status.error, "harness: disk full", env=True)], [result("c")]))
    assert v.name == "inconclusive" and "environment" in v.reason


def test_tests_that_can_no_longer_run_here_are_the_candidates_fault_and_the_same_machine_limits_are_not():
    """A pytest probe counts the tests this machine cannot run (feedback.needs) apart from failures: the
    same limits on both sides judge nothing, but a candidate that loses tests to them broke those tests."""
    def tests(passed: int, unrunnable: int, status: Status = Status.passed, reason: str | None = None):
        counts = dict(tests=passed + unrunnable, passed=passed, failed=0, unrunnable=unrunnable)
        return result("c", status, reason, **{k: Metric(value=v) for k, v in counts.items()})

    cpu_only = "cannot run on this machine: 3 tests need a CUDA GPU (Torch not compiled with CUDA enabled)"
    same = verdict(report([tests(2, 3, reason=cpu_only)], [tests(2, 3, reason=cpu_only)]))
    assert same.name == "unchanged" and not same.broke
    lost = verdict(report([tests(0, 5, Status.skipped, "cannot run on this machine: 5 tests need the package "
                                                         "'tqdm'")], [tests(2, 3)]))
    assert lost.name == "incorrect" and "2 more test(s)" in lost.reason and "'tqdm'" in lost.reason
    # more tests collected by a fix of a broken import, each needing the GPU: nothing that ran before is lost
    assert verdict(report([tests(2, 9)], [tests(2, 3)])).name == "unchanged"


def test_a_probe_failing_on_both_sides_is_judged_test_by_test():
    """A user's suite often fails somewhere already: one more failing test is the candidate's, fewer is
    progress, and tests that stop failing by skipping are not counted as passing."""
    def tests(failing: list[str], passed: int) -> ProbeResult:
        r = result("c", Status.failed, passed=Metric(value=passed), failed=Metric(value=len(failing)))
        return r.model_copy(update={"failing": failing})

    base = tests(["t.test_a::test_x", "t.test_b"], passed=5)  # test_b: a file that failed to import
    broke = verdict(report([tests(["t.test_a::test_x", "t.test_a::test_y"], 4)], [base]))
    assert broke.name == "incorrect" and "t.test_a::test_y" in broke.reason and "1 test(s)" in broke.reason
    # the tests of a file the baseline could not import are not new failures: the baseline never ran them
    opened = verdict(report([tests(["t.test_a::test_x", "t.test_b::test_z", "t.test_b.TestK::test_w"], 7)], [base]))
    assert opened.name == "better" and opened.fixed == ["c (1 of its 2 failing tests now pass)"]
    assert verdict(report([tests(["t.test_a::test_x"], 5)], [base])).name == "unchanged"  # test_b now skips
    assert verdict(report([tests(list(base.failing), 5)], [base])).name == "unchanged"


def test_a_fix_is_better_and_a_probe_failing_on_both_sides_is_unchanged():
    assert verdict(report([result("c")], [result("c", Status.failed)])).name == "better"
    v = verdict(report([result("c", Status.failed)], [result("c", Status.failed)]))
    assert v.name == "unchanged" and v.still_failing == ["c"] and "still failing" in v.reason


def test_acceptance_counts_against_the_baseline_not_in_absolute_terms():
    # held before, fails now: incorrect; failed before and still: not the candidate's doing
    assert verdict(report([result("c")], [result("c")], [crit(False)], [crit(True)])).name == "incorrect"
    assert verdict(report([result("c")], [result("c")], [crit(False)], [crit(False)])).name == "unchanged"
    v = verdict(report([result("c")], [result("c")], [crit(True)], [crit(False)]))
    assert v.name == "better" and v.fixed == ["acceptance precise"]


def test_performance_worse_better_and_unchanged_by_the_noise_rule():
    slow = verdict(report([result("t", ms=timed(20.0, 20.4, 19.8))], [result("t", ms=timed(10.0, 10.2, 9.9))]))
    assert slow.name == "worse" and slow.regressed[0].startswith("t.ms x2.0")
    fast = verdict(report([result("t", ms=timed(5.0, 5.1, 4.9))], [result("t", ms=timed(10.0, 10.2, 9.9))]))
    assert fast.name == "better" and fast.improved
    same = verdict(report([result("t", ms=timed(10.1, 9.9, 10.0))], [result("t", ms=timed(10.0, 10.2, 9.9))]))
    assert same.name == "unchanged"


def test_times_from_different_devices_are_never_compared():
    on = lambda r, where: r.model_copy(update={"ran_on": where})  # noqa: E731
    cand = on(result("t", ms=timed(5.0, 5.1, 4.9)), "ray node 1a2b (gpu-a, NVIDIA H200)")
    base = on(result("t", ms=timed(10.0, 10.2, 9.9)), "ray node 3c4d (gpu-b, NVIDIA A100-SXM4-80GB)")
    v = verdict(report([cand], [base]))
    assert v.name == "inconclusive" and "timed on NVIDIA H200 against a baseline timed on NVIDIA A100" in v.reason
    same = on(base, "ray node 5e6f (gpu-c, NVIDIA H200)")
    assert verdict(report([cand], [same])).name == "better"  # another node, the same device model: compared
    # a correctness probe's numbers are not times: where it ran does not matter
    assert verdict(report([on(result("c"), "ray node 1 (a, cpu)")], [result("c")])).name == "unchanged"


def test_one_run_of_a_performance_metric_is_not_evidence():
    d = compare_metric("ttft_ms", Metric(value=83.8, better="lower"), Metric(value=116.7, better="lower"), "e2e")
    assert d.verdict == "unchanged" and d.note == "one run is not evidence"


def test_a_change_inside_the_measured_a_a_noise_is_unchanged():
    # the H200's e2e repeats of one tree: TTFT 83.8 and 116.7 ms; a candidate 20% slower is inside that
    base, cand = timed(83.8, 116.7, 95.0), timed(110.0, 120.0, 118.0)
    d = compare_metric("ttft_ms", base, cand, "e2e")
    assert d.noise == pytest.approx(116.7 / 83.8 - 1) and d.verdict == "unchanged" and "A/A" in d.note
    # the same change against a quiet baseline is a regression, and shows the floor it beat
    quiet = compare_metric("ttft_ms", timed(95.0, 96.0, 95.5), cand, "e2e")
    assert quiet.verdict == "regressed" and quiet.noise == pytest.approx(max(96.0 / 95.0 - 1, MIN_NOISE))
    assert quiet.ci[0] > 1


def test_noise_floor_and_the_minimum():
    assert noise_floor([1.0, 1.1, 1.05]) == pytest.approx(0.1)
    assert noise_floor([3.0]) is None
    d = compare_metric("ms", timed(10.0, 10.0, 10.0), timed(10.1, 10.1, 10.1), "microbench")
    assert d.verdict == "unchanged" and d.noise == MIN_NOISE  # 1% is never a change


def test_status_kinds_show_their_numbers_but_never_judge_them():
    d = compare_metric("err", Metric(value=1e-7, better="lower"), Metric(value=9e-6, better="lower"), "correctness")
    assert d.verdict == "n/a" and d.change == pytest.approx(90)


def counted(value: float) -> Metric:
    return Metric(value=value, unit="B/token", better="lower", counted=True)


def test_counted_work_is_judged_exactly_in_any_probe_kind():
    """A count is not a measurement: one run is evidence, there is no noise floor, and a status kind's
    counted metric is judged as a time would be in a performance kind."""
    more = compare_metric("k.loaded_bytes", counted(1000.0), counted(1010.0), "trace")
    assert more.verdict == "regressed" and more.change == pytest.approx(1.01) and more.noise is None
    assert "counted" in more.note
    less = compare_metric("k.loaded_bytes", counted(1000.0), counted(900.0), "correctness")
    assert less.verdict == "improved"
    same = compare_metric("k.loaded_bytes", counted(1000.0), counted(1000.0 * (1 + COUNT_TOLERANCE / 2)), "trace")
    assert same.verdict == "unchanged"
    # from none to some: no ratio, still a change (a division where there was none)
    first = compare_metric("k.fdiv", counted(0.0), counted(0.5), "trace")
    assert first.verdict == "regressed" and first.change is None
    assert compare_metric("k.fdiv", counted(0.0), counted(0.0), "trace").verdict == "unchanged"
    # the same numbers, not counted, in a status kind: shown, not judged
    plain = compare_metric("k.loaded_bytes", Metric(value=1000.0, better="lower"), Metric(value=2000.0, better="lower"),
                           "trace")
    assert plain.verdict == "n/a"


def test_more_counted_work_makes_the_verdict_worse_and_a_fix_still_wins():
    base = [result("c", **{"k.loaded_bytes": counted(1000.0)})]
    v = verdict(report([result("c", **{"k.loaded_bytes": counted(2000.0)})], base))
    assert v.name == "worse" and v.regressed[0].startswith("c.k.loaded_bytes x2.000")
    assert verdict(report([result("c", **{"k.loaded_bytes": counted(500.0)})], base)).name == "better"
    # a check that failed and now holds outranks the extra work it costs
    failing = [result("c", Status.failed, **{"k.loaded_bytes": counted(1000.0)})]
    assert verdict(report([result("c", **{"k.loaded_bytes": counted(2000.0)})], failing)).name == "better"


def part(value: float) -> Metric:
    return Metric(value=value, unit="B/token", counted=True)  # no direction: a part of a judged total


def test_work_moved_between_parts_is_no_regression_and_a_grown_total_is_localised_by_its_parts():
    """Two kernels fused (one's bytes move to the other, the total falls) is better, not worse; a total that
    grew is worse, and the part whose own count grew (or appeared) names the kernel and its file."""
    from feedback.models import Location

    base = [result("c", **{"loaded_bytes": counted(1000.0), "k1.loaded_bytes": part(600.0),
                           "k2.loaded_bytes": part(400.0)})]
    fused = result("c", **{"loaded_bytes": counted(800.0), "k1.loaded_bytes": part(800.0)})
    r = report([fused], base)
    v = verdict(r)
    assert v.name == "better" and v.regressed == [], v
    moves = {d.name: (d.verdict, d.note) for c in r.comparisons for d in c.deltas}
    assert moves["k1.loaded_bytes"][1].startswith("counted: more") and moves["k1.loaded_bytes"][0] == "n/a"
    assert moves["k2.loaded_bytes"] == ("gone", moves["k2.loaded_bytes"][1])
    assert moves["k2.loaded_bytes"][1].startswith("counted: less")
    assert r.comparisons[0].localisation == []  # nothing regressed: nothing to localise

    grown = result("c", **{"loaded_bytes": counted(1300.0), "k1.loaded_bytes": part(600.0),
                           "k2.loaded_bytes": part(400.0), "k3.loaded_bytes": part(300.0)})
    grown.findings = [Finding(message="per token: 300 B", location=Location(file="ops/k3.py", kernel="k3")),
                      Finding(message="per token: 600 B", location=Location(file="ops/k1.py", kernel="k1"))]
    r = report([grown], base)
    assert verdict(r).name == "worse"
    (line,) = r.comparisons[0].localisation
    assert "k3.loaded_bytes none -> 300" in line and "ops/k3.py" in line, line

    # one kernel counted in two calls (the second's metrics prefixed): the grown part is bound to the finding
    # of the call that grew, the one naming that part exactly, not to the first finding of the same kernel
    two = [result("c", **{"loaded_bytes": counted(1000.0), "k1.loaded_bytes": part(500.0),
                          "tokens.loaded_bytes": counted(900.0), "tokens.k1.loaded_bytes": part(900.0)})]
    more = result("c", **{"loaded_bytes": counted(1000.0), "k1.loaded_bytes": part(500.0),
                          "tokens.loaded_bytes": counted(950.0), "tokens.k1.loaded_bytes": part(950.0)})
    more.findings = [Finding(message="per head", location=Location(file="ops/k1.py", kernel="k1", part="k1",
                                                                   condition="one step")),
                     Finding(message="per token", location=Location(file="ops/k1.py", kernel="k1", part="tokens.k1",
                                                                    condition="3 tokens a call"))]
    (line,) = report([more], two).comparisons[0].localisation
    assert "tokens.k1.loaded_bytes 900 -> 950" in line and "input 3 tokens a call" in line, line


def test_replay_holds_counted_work_to_the_record_under_the_same_triton():
    def at(r: ProbeResult, triton: str) -> ProbeResult:
        return r.model_copy(update={"environment": r.environment.model_copy(update={"triton": triton})})

    then = [("trace", at(result("c", **{"k.loaded_bytes": counted(1000.0), "err": Metric(value=1e-7)}), "3.6.0"))]
    regressed, details = replay_regressions(then, [at(result("c", **{"k.loaded_bytes": counted(1300.0)}), "3.6.0")], [])
    assert regressed == ["c: more counted work than recorded: k.loaded_bytes x1.300"]
    ok, details = replay_regressions(then, [at(result("c", **{"k.loaded_bytes": counted(1000.0)}), "3.6.0")], [])
    assert ok == [] and details[0].endswith("counted work as recorded")
    gone, _ = replay_regressions(then, [at(result("c"), "3.6.0")], [])
    assert gone and "k.loaded_bytes 1e+03 -> none" in gone[0]
    other, details = replay_regressions(then, [at(result("c", **{"k.loaded_bytes": counted(1300.0)}), "3.9.0")], [])
    assert other == [] and "recorded under Triton 3.6.0: not compared" in details[0]
    # a part (one kernel's count) moved or gone with the total held: as recorded
    with_parts = [("trace", at(result("c", **{"loaded_bytes": counted(1000.0), "k1.loaded_bytes": part(1000.0)}),
                               "3.6.0"))]
    moved, _ = replay_regressions(with_parts, [at(result("c", **{"loaded_bytes": counted(1000.0),
                                                                 "k2.loaded_bytes": part(1000.0)}), "3.6.0")], [])
    assert moved == []


def test_replay_of_a_pass_the_machine_cannot_run_is_not_judged_and_a_failure_still_counts():
    # flash-attention: a record whose test passed where its compiled extension was importable, replayed where it
    # is not, had read "regressed: was pass, now skipped"; the code is the same, the machine is not
    then = [("correctness", result("t"))]
    lost = result("t", Status.skipped, "needs the package 'flash_attn_2_cuda'")
    regressed, details = replay_regressions(then, [lost], [])
    assert regressed == [] and details == ["t: recorded pass, now skipped (not judged on this machine: needs the "
                                           "package 'flash_attn_2_cuda')"]
    regressed, _ = replay_regressions(then, [result("t", Status.failed, "1 test failed")], [])
    assert regressed and regressed[0].startswith("t was pass, now fail")


def test_combine_runs_keeps_samples_and_stops_at_a_broken_run():
    runs = [result("t", ms=Metric(value=v, better="lower")) for v in (3.0, 1.0, 2.0)]
    runs[1].findings.append(Finding(message="slow"))
    merged = combine_runs(runs)
    assert merged.metrics["ms"].value == 2.0 and merged.metrics["ms"].samples == [3.0, 1.0, 2.0]
    assert merged.metrics["ms"].ci is not None and [f.message for f in merged.findings] == ["slow"]
    broken = combine_runs([runs[0], result("t", Status.error, "boom")])
    assert broken.status == Status.error and broken.reason == "run 2 of 2: boom"


def test_replay_uses_the_same_noise_rule():
    then = [("microbench", result("t", ms=timed(10.0, 10.1, 9.9))), ("correctness", result("c"))]
    same_env_slower = [result("t", ms=timed(15.0, 15.2, 14.9)), result("c")]
    regressed, details = replay_regressions(then, same_env_slower, [])
    assert regressed and regressed[0].startswith("t: ms x1.5") and len(details) == 2
    within, _ = replay_regressions(then, [result("t", ms=timed(10.05, 9.95, 10.1)), result("c")], [])
    assert within == []
    broke, _ = replay_regressions(then, [result("t", ms=timed(10.0, 10.1, 9.9)), result("c", Status.failed)],
                                  [crit(False)])
    assert len(broke) == 2 and broke[0].startswith("c was pass, now fail")


def _side_by_side(base, cand) -> ProbeComparison:
    return ProbeComparison(probe=cand.probe, kind="microbench", baseline=base.status, candidate=cand.status,
                           deltas=[compare_metric("ms", base.metrics["ms"], cand.metrics["ms"], "microbench")])


def test_replay_judges_performance_against_the_base_rebuilt_beside_it():
    """A busier machine makes both sides slower: the recorded numbers would say 'regressed', the
    side-by-side comparison with the base does not; a candidate slower than its base still regresses."""
    then = [("microbench", result("t", ms=timed(10.0, 10.1, 9.9))), ("correctness", result("c"))]
    busy_candidate = result("t", ms=timed(15.0, 15.2, 14.9))
    busy_base = result("t", ms=timed(15.1, 14.9, 15.0))
    side_by_side = _side_by_side(busy_base, busy_candidate)
    regressed, details = replay_regressions(then, [busy_candidate, result("c")], [], against_base=[side_by_side])
    assert regressed == [] and "against its base, side by side" in details[0]
    faster_base = result("t", ms=timed(10.0, 10.1, 9.9))
    slower = _side_by_side(faster_base, busy_candidate)
    regressed, _ = replay_regressions(then, [busy_candidate, result("c")], [], against_base=[slower])
    assert regressed and regressed[0].startswith("t: worse than its base, side by side: ms x1.5")


# --- the real harness ----------------------------------------------------------------------------------

TOY = '''
import os, random, time
from feedback.probe import probe

def _read(ctx, name):
    return open(os.path.join(ctx.tree, "toy", name)).read().strip()

@probe
def correct(ctx):
    ctx.check(_read(ctx, "answer.txt") == "42", "wrong answer", file="toy/answer.txt", symbol="answer")
    ctx.metric("err", 1e-7 * random.random(), better="lower")

@probe
def broken(ctx):
    raise RuntimeError("this probe cannot run on this machine")

@probe
def nan_output(ctx):
    ctx.metric("max_rel_err", float("nan"), better="lower")  # a kernel that wrote NaN: an infinite error
    ctx.fail("output is NaN", file="toy/answer.txt", symbol="answer")

@probe
def timing(ctx):
    # a stand-in for a microbenchmark: the tree says how long the work takes, with 1% jitter
    ms = float(_read(ctx, "cost.txt")) * (1 + 0.01 * random.random())
    ctx.metric("step_ms", ms, "ms", better="lower")
'''


def toy_tree(root: pathlib.Path, answer: str = "42", cost: str = "10") -> pathlib.Path:
    (root / "toy").mkdir(parents=True)
    (root / "toy" / "__init__.py").write_text("")
    (root / "toy" / "probes.py").write_text(TOY)
    (root / "toy" / "answer.txt").write_text(answer)
    (root / "toy" / "cost.txt").write_text(cost)
    (root / "infra-agent.yaml").write_text("""
schema_version: 1
name: toy
probes:
  - {id: toy.correct, kind: correctness, entry: "toy.probes:correct", covers: {files: [toy/answer.txt]}}
  - {id: toy.broken, kind: correctness, entry: "toy.probes:broken", covers: {files: [toy/cost.txt]}}
  - {id: toy.nan, kind: correctness, entry: "toy.probes:nan_output", covers: {files: [toy/answer.txt]}}
  - {id: toy.timing, kind: microbench, entry: "toy.probes:timing", covers: {files: [toy/cost.txt]}, repeats: 3}
protected: [toy/probes.py]
""")
    return root


@pytest.mark.parametrize("answer, cost, expected", [
    ("41", "10", "incorrect"),  # a correctness probe that held now fails
    ("42", "20", "inconclusive"),  # toy.broken errors on both sides: said so, not blamed on the candidate
])
def test_the_harness_attaches_the_verdict(tmp_path, answer, cost, expected):
    base = toy_tree(tmp_path / "base")
    cand = toy_tree(tmp_path / "cand", answer, cost)
    rep = judge(cand, changed=["toy/cost.txt"] + (["toy/answer.txt"] if answer != "42" else []),
                baseline_tree=base, run_all=True, cache_dir=tmp_path / "cache")
    assert rep.verdict is not None and rep.verdict.name == expected, rep.verdict
    if expected == "inconclusive":
        assert any("toy.broken" in b for b in rep.verdict.broken_probes)
        timing = next(c for c in rep.comparisons if c.probe == "toy.timing")
        (d,) = timing.deltas
        assert d.verdict == "regressed" and d.samples == 3 and d.noise is not None and d.ci[0] > 1.5


def test_repeated_microbench_runs_give_a_verdict_with_interval_and_noise(tmp_path):
    base = toy_tree(tmp_path / "base")
    faster = toy_tree(tmp_path / "faster", cost="5")
    same = toy_tree(tmp_path / "same", cost=f"{10 * (1 + 0.001 * random.random()):.4f}")
    got = {}
    for name, tree in (("faster", faster), ("same", same)):
        rep = judge(tree, probe_ids=["toy.timing"], baseline_tree=base, cache_dir=tmp_path / "cache")
        got[name] = rep
    (d,) = got["faster"].comparisons[0].deltas
    assert got["faster"].verdict.name == "better" and d.verdict == "improved" and len(
        got["faster"].results[0].metrics["step_ms"].samples) == 3
    assert got["same"].verdict.name == "unchanged" and got["same"].comparisons[0].deltas[0].verdict == "unchanged"


def test_an_infinite_error_survives_the_result_file_and_the_cache(tmp_path):
    tree = toy_tree(tmp_path / "t")
    for cached in (False, True):
        (r,) = judge(tree, probe_ids=["toy.nan"], cache_dir=tmp_path / "cache").results
        assert r.status == Status.failed and r.cached == cached, r.reason
        assert r.metrics["max_rel_err"].value == float("inf") and r.findings[0].message == "output is NaN"


def test_replay_counts_an_acceptance_criterion_only_where_it_held_when_recorded():
    """A record of one step on the way (a second attempt fixed the rest) replays as it was: the
    criterion that failed then too is shown, not a regression; one that held then must hold now."""
    then = [("correctness", result("c"))]
    now = [result("c")]
    failing_now = crit(False)
    step, details = replay_regressions(then, now, [failing_now], recorded_acceptance=[crit(False)])
    assert step == [] and any("failed when recorded too" in d for d in details)
    broke, _ = replay_regressions(then, now, [failing_now], recorded_acceptance=[crit(True)])
    assert len(broke) == 1 and broke[0].startswith("acceptance")
    legacy, _ = replay_regressions(then, now, [failing_now])  # a record without acceptance: every criterion
    assert len(legacy) == 1
