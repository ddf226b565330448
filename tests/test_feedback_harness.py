"""The feedback harness on real subprocesses, real git repositories and the real bundled target."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import git
import pytest

from feedback.harness import UnknownProbe, judge
from feedback.manifest import ManifestError, load_manifest, parse_manifest
from feedback.models import Status
from feedback.select import DiffError, changed_since, files_in_diff, select
from feedback.targets import materialize_bundled

TOY_PROBES = '''
import os, subprocess, sys, time
from feedback.probe import probe

@probe
def ok(ctx):
    ctx.metric("err", 1e-7, better="lower")
    ctx.metric("marker", float(open(os.path.join(ctx.tree, "toy", "value.txt")).read()))

@probe
def bad_metric(ctx):
    ctx.metric("err", 0.5, better="lower")

@probe
def raises(ctx):
    def inner():
        raise ZeroDivisionError("deliberate")
    inner()

@probe
def hangs(ctx):
    # a child in the same process group must die with it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.path.join(ctx.tree, "child.pid"), "w").write(str(child.pid))
    time.sleep(600)

@probe
def segfault(ctx):
    import ctypes
    ctypes.string_at(0)

@probe
def eats_memory(ctx):
    blocks = []
    while True:
        blocks.append(bytearray(64 * 2**20))

@probe
def skips(ctx):
    ctx.skip("needs a widget")

@probe
def fails_with_location(ctx):
    ctx.fail("error grows 41x from P=2 to P=64", file="toy/merge.py", kernel="merge_kernel",
             param="merge_precision='tf32'", condition="T=256")
'''

TOY_MANIFEST = '''
schema_version: 1
name: toy
probes:
  - {id: toy.static, kind: static, entry: "toy.probes:ok", covers: {files: ["toy/value.txt"]}, budget_s: 30}
  - id: toy.ok
    kind: correctness
    entry: "toy.probes:ok"
    covers: {files: ["toy/value.txt", "toy/core.py"], symbols: [core]}
    budget_s: 30
    thresholds: {err: {max: 1.0e-5}}
  - id: toy.bad
    kind: correctness
    entry: "toy.probes:bad_metric"
    covers: {files: ["toy/core.py"]}
    params: {block: 64}
    thresholds: {err: {max: 1.0e-5}}
  - {id: toy.raises, kind: correctness, entry: "toy.probes:raises", covers: {files: ["toy/other.py"]}}
  - {id: toy.hangs, kind: correctness, entry: "toy.probes:hangs", budget_s: 2, covers: {files: ["toy/other.py"]}}
  - {id: toy.segfault, kind: correctness, entry: "toy.probes:segfault", covers: {files: ["toy/other.py"]}}
  - id: toy.memory
    kind: correctness
    entry: "toy.probes:eats_memory"
    memory_mb: 2000  # an address-space limit: room for numpy and its BLAS threads on a 16-core host
    budget_s: 60
    covers: {files: ["toy/other.py"]}
  - {id: toy.skips, kind: microbench, entry: "toy.probes:skips", covers: {files: ["toy/core.py"]}}
  - {id: toy.located, kind: correctness, entry: "toy.probes:fails_with_location", covers: {files: ["toy/merge.py"]}}
  - {id: toy.garbage, kind: e2e, command: "echo this is not json", covers: {files: ["toy/serve.py"]}}
  - {id: toy.cmd, kind: e2e, command: "echo '{\\"metrics\\": {\\"ttft_ms\\": 12.5}}'",
     covers: {files: ["toy/serve.py"]}}
acceptance:
  - {name: precise, expr: "toy.ok.err <= 1e-6"}
  - {name: bad, expr: "toy.bad.err <= 1e-6"}
protected: [toy/probes.py]
'''


@pytest.fixture
def toy(tmp_path) -> pathlib.Path:
    root = tmp_path / "toy_target"
    (root / "toy").mkdir(parents=True)
    (root / "toy" / "__init__.py").write_text("")
    (root / "toy" / "probes.py").write_text(TOY_PROBES)
    (root / "toy" / "value.txt").write_text("1")
    (root / "toy" / "core.py").write_text("def core():\n    return 1\n")
    (root / "infra-agent.yaml").write_text(TOY_MANIFEST)
    repo = git.Repo.init(root)
    repo.index.add(["toy/__init__.py", "toy/probes.py", "toy/value.txt", "toy/core.py", "infra-agent.yaml"])
    repo.index.commit("toy target", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    return root


def by_id(report):
    return {r.probe: r for r in report.results}


# --- manifest --------------------------------------------------------------------------------


def test_bundled_manifest_is_valid_and_protects_what_judges(tmp_path):
    tree = materialize_bundled(tmp_path / "ts")
    m = load_manifest(tree)
    assert {"kda.cp.merge", "kda.chunk.correctness", "kda.recurrent.null_slot"} <= {p.id for p in m.probes}
    assert m.is_protected("infra-agent.yaml") and m.is_protected("target_stack/probes/kda.py")
    assert m.is_protected("target_stack/ops/kda/naive.py") and not m.is_protected("target_stack/ops/kda/cp.py")
    assert m.split_metric("kda.cp.merge.error_growth") == ("kda.cp.merge", "error_growth")


@pytest.mark.parametrize("mutation,expect", [
    (lambda t: t.replace("budget_s: 30}", "budget_s: -5}", 1),
     ":5: probes[0].budget_s: Input should be greater than 0"),
    (lambda t: t.replace("kind: correctness\n    entry: \"toy.probes:ok\"", "kind: unit\n    entry: \"toy.probes:ok\""),
     ":7: probes[1].kind"),
    (lambda t: t.replace("name: toy", "name: toy\nbogus: 1"), ":4: bogus: Extra inputs are not permitted"),
    (lambda t: t.replace("probes:\n", "probes: [\n", 1), "not valid YAML"),
    (lambda t: t.replace('entry: "toy.probes:raises"', 'entry: "toy.probes"'),
     "entry must look like module.path:function"),
    (lambda t: t.replace("toy.ok.err <= 1e-6", "toy.nothing.err <= 1e-6"), "names 'toy.nothing.err'"),
    (lambda t: t.replace("id: toy.bad", "id: toy.ok"), "duplicate probe id 'toy.ok'"),
])
def test_malformed_manifest_errors_name_file_line_and_field(mutation, expect):
    with pytest.raises(ManifestError) as err:
        parse_manifest(mutation(TOY_MANIFEST), "infra-agent.yaml")
    assert expect in str(err.value) and str(err.value).startswith("infra-agent.yaml")


def test_manifest_cli_schema_and_check(toy, tmp_path):
    out = subprocess.run(["infra-agent", "manifest", "schema"], capture_output=True, text=True, check=True)
    schema = json.loads(out.stdout)
    assert "probes" in schema["properties"] and "ProbeSpec" in schema["$defs"]
    ok = subprocess.run(["infra-agent", "manifest", "check", str(toy)], capture_output=True, text=True)
    assert ok.returncode == 0 and "11 probes" in ok.stdout
    (toy / "infra-agent.yaml").write_text(TOY_MANIFEST.replace("budget_s: 2,", "budget_s: zero,"))
    bad = subprocess.run(["infra-agent", "manifest", "check", str(toy)], capture_output=True, text=True)
    assert bad.returncode == 2 and "toy.hangs" not in bad.stderr and "budget_s" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1  # one clear line


# --- runner: faults become statuses ----------------------------------------------------------


def test_every_fault_is_a_clear_status_and_the_harness_survives(toy):
    t0 = time.perf_counter()
    report = judge(toy, probe_ids=["toy.ok", "toy.bad", "toy.raises", "toy.hangs", "toy.segfault", "toy.memory",
                                   "toy.skips", "toy.garbage", "toy.cmd"], run_all=True, use_cache=False, jobs=4)
    r = by_id(report)
    assert r["toy.ok"].status == Status.passed and r["toy.ok"].metrics["err"].value == 1e-7
    assert r["toy.bad"].status == Status.failed
    assert "err = 0.5 violates <= 1e-05" in r["toy.bad"].findings[-1].message
    assert r["toy.raises"].status == Status.error
    assert "ZeroDivisionError: deliberate" in r["toy.raises"].reason and "toy/probes.py" in r["toy.raises"].reason
    assert r["toy.hangs"].status == Status.timeout and "budget_s=2" in r["toy.hangs"].reason
    assert r["toy.segfault"].status == Status.error and "SIGSEGV" in r["toy.segfault"].reason
    assert "(at toy/probes.py:" in r["toy.segfault"].reason and "in segfault)" in r["toy.segfault"].reason
    assert r["toy.memory"].status == Status.error and "MemoryError" in r["toy.memory"].reason
    assert r["toy.skips"].status == Status.skipped and r["toy.skips"].reason == "needs a widget"
    assert r["toy.garbage"].status == Status.error and "no JSON result" in r["toy.garbage"].reason
    assert r["toy.cmd"].status == Status.passed and r["toy.cmd"].metrics["ttft_ms"].value == 12.5
    assert time.perf_counter() - t0 < 60
    # the hung probe's child died with its process group
    pid = int((toy / "child.pid").read_text())
    deadline = time.time() + 5
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes, in a container, counts as dead)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


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


# --- the tree under test, not an installed copy ------------------------------------------------


def test_probe_sees_a_change_made_only_in_the_scratch_tree(tmp_path):
    """The static probe imports target_stack from the scratch copy: a tl.dot added only there fails it."""
    tree = materialize_bundled(tmp_path / "scratch")
    clean = judge(tree, probe_ids=["kda.static.dot_precision"], use_cache=False)
    assert clean.results[0].status == Status.passed
    cp = tree / "target_stack" / "ops" / "kda" / "cp.py"
    cp.write_text(cp.read_text().replace("tl.dot(b_M, b_h, input_precision=MERGE_PRECISION)", "tl.dot(b_M, b_h)"))
    dirty = judge(tree, probe_ids=["kda.static.dot_precision"], use_cache=False)
    res = dirty.results[0]
    assert res.status == Status.failed
    assert any(f.location.file.startswith("target_stack/ops/kda/cp.py:") and
               f.location.kernel == "_kda_cp_merge_kernel" for f in res.findings)
    # the installed copy is untouched: the repository's own source still passes
    import target_stack.ops.kda.cp as installed

    assert "input_precision=MERGE_PRECISION" in pathlib.Path(installed.__file__).read_text()


def test_worker_refuses_an_entry_imported_from_outside_the_tree(toy):
    # json is importable in the probe process, but not from the tree under test
    (toy / "infra-agent.yaml").write_text(
        TOY_MANIFEST.replace("probes:\n", "probes:\n  - {id: toy.outside, kind: static, entry: \"json:dumps\"}\n", 1))
    m = load_manifest(toy)
    report = judge(toy, manifest=m, probe_ids=["toy.outside"], use_cache=False)
    assert report.results[0].status == Status.error and "outside the tree under test" in report.results[0].reason


# --- cache -------------------------------------------------------------------------------------


def test_cache_serves_unchanged_probes_and_misses_after_a_covered_change(toy):
    first = judge(toy, probe_ids=["toy.ok"])
    assert not first.results[0].cached
    again = judge(toy, probe_ids=["toy.ok"])
    assert again.results[0].cached and again.results[0].metrics == first.results[0].metrics
    (toy / "toy" / "value.txt").write_text("2")
    changed = judge(toy, probe_ids=["toy.ok"])
    assert not changed.results[0].cached and changed.results[0].metrics["marker"].value == 2.0
    # the probe's own exception is what these files raise here: served from the cache like a result
    raised = judge(toy, probe_ids=["toy.raises"]).results[0]
    again = judge(toy, probe_ids=["toy.raises"]).results[0]
    assert raised.status == again.status == Status.error and again.cached and again.reason == raised.reason
    # a crashed probe process (no result written) is re-run every time
    judge(toy, probe_ids=["toy.segfault"])
    crashed = judge(toy, probe_ids=["toy.segfault"]).results[0]
    assert crashed.status == Status.error and not crashed.cached


# --- selection and the cascade ----------------------------------------------------------------


def test_files_in_diff_and_broken_diffs():
    diff = ("diff --git a/toy/core.py b/toy/core.py\n--- a/toy/core.py\n+++ b/toy/core.py\n@@ -1 +1 @@\n-x\n+y\n"
            "--- /dev/null\n+++ b/toy/new.py\n@@ -0,0 +1 @@\n+z\n")
    assert files_in_diff(diff) == ["toy/core.py", "toy/new.py"]
    with pytest.raises(DiffError):
        files_in_diff("just some text\nwithout headers\n")
    with pytest.raises(DiffError):
        files_in_diff("--- a/x.py\n+++ b/x.py\n")  # no hunk


def test_change_impact_selection_from_git(toy):
    (toy / "toy" / "core.py").write_text("def core():\n    return 2\n")
    changed = changed_since(toy, "HEAD")
    assert changed == ["toy/core.py"]
    ids = [p.id for p in select(load_manifest(toy), changed)]
    assert ids == ["toy.ok", "toy.bad", "toy.skips"]  # cheapest stage first


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


# --- the CLI ------------------------------------------------------------------------------------


def test_feedback_cli_exit_codes_and_json(toy, tmp_path):
    ok = subprocess.run(["infra-agent", "feedback", "--target", str(toy), "--probe", "toy.ok", "--json"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["results"][0]["status"] == "pass" and data["schema_version"] == 1
    assert "toy/probes.py" in data["hashes"] and "infra-agent.yaml" in data["hashes"]
    failing = subprocess.run(["infra-agent", "feedback", "--target", str(toy), "--probe", "toy.located"],
                             capture_output=True, text=True)
    assert failing.returncode == 1 and "error grows 41x" in failing.stdout
    unknown = subprocess.run(["infra-agent", "feedback", "--target", str(toy), "--probe", "nope"],
                             capture_output=True, text=True)
    assert unknown.returncode == 2 and "known: toy.static" in unknown.stderr
    broken = tmp_path / "broken.diff"
    broken.write_text("not a diff")
    bad_diff = subprocess.run(["infra-agent", "feedback", "--target", str(toy), "--diff", str(broken)],
                              capture_output=True, text=True)
    assert bad_diff.returncode == 2 and "not a unified diff" in bad_diff.stderr
    bad_rev = subprocess.run(["infra-agent", "feedback", "--target", str(toy), "--changed-from", "nope~3"],
                             capture_output=True, text=True)
    assert bad_rev.returncode == 2 and "unknown revision" in bad_rev.stderr


def test_feedback_cli_changed_from_catches_an_implicit_tf32_merge(tmp_path):
    """The real bundled target in a git repo: one line changed in the CP merge kernel."""
    tree = materialize_bundled(tmp_path / "ts")
    repo = git.Repo.init(tree)
    repo.git.add(A=True)
    repo.index.commit("base", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    cp = tree / "target_stack" / "ops" / "kda" / "cp.py"
    cp.write_text(cp.read_text().replace("tl.dot(b_M, b_h, input_precision=MERGE_PRECISION)", "tl.dot(b_M, b_h)"))
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "feedback", "--target", str(tree),
                          "--changed-from", "HEAD", "--json"], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    data = json.loads(out.stdout)
    assert data["stopped_at"] == "static" and data["baseline"] == "HEAD"
    assert data["comparisons"][0]["baseline"] == "pass" and data["comparisons"][0]["candidate"] == "fail"
    assert any("target_stack/ops/kda/cp.py:" in line and "_kda_cp_merge_kernel" in line
               for c in data["comparisons"] for line in c["localisation"])
