"""Change-impact selection from a diff and from a git revision."""

from __future__ import annotations

import pytest

from feedback.manifest import load_manifest
from feedback.models import Status
from feedback.select import DiffError, changed_since, files_in_diff, select


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
    # what the harness itself leaves in a target that does not ignore it is never a change
    for junk in (".infra-agent/cache/ab.json", "toy/__pycache__/core.cpython-311.pyc"):
        (toy / junk).parent.mkdir(parents=True, exist_ok=True)
        (toy / junk).write_text("x")
    changed = changed_since(toy, "HEAD")
    assert changed == ["toy/core.py"]
    ids = [p.id for p in select(load_manifest(toy), changed)]
    assert ids == ["toy.ok", "toy.bad", "toy.skips"]  # cheapest stage first


_MERGE_PROBE = '''
from feedback.probe import probe


@probe(kind="correctness")
def merged(ctx):
    from dep.merge import merge

    ctx.metric("value", float(merge()))
    ctx.check(merge() == 3, f"merge() = {merge()}, expected 3", file="dep/merge.py")
'''


def test_a_failing_probe_is_judged_again_when_a_file_it_imports_changes_whatever_its_covers_say(tmp_path):
    """A merge probe whose covers name only the merge, while its inputs come from another file: a fix in
    that file is judged on the probe (it failed, and it imported the file); a passing probe that imports
    the file is not selected (covers decide there), nor is a failing one that never imported it."""
    from feedback.harness import judge

    def tree(root, local):
        (root / "dep").mkdir(parents=True)
        (root / "dep" / "__init__.py").write_text("")
        (root / "dep" / "local.py").write_text(f"def local():\n    return {local}\n")
        (root / "dep" / "merge.py").write_text("from dep.local import local\n\n\n"
                                               "def merge():\n    return local() + 1\n")
        (root / "dep" / "other.py").write_text("X = 1\n")
        (root / "dep" / "probes.py").write_text(_MERGE_PROBE + '''

@probe(kind="correctness")
def alone(ctx):
    from dep.other import X

    ctx.check(X == 2, "X is not 2", file="dep/other.py")


@probe(kind="correctness")
def fine(ctx):
    from dep.merge import merge

    ctx.metric("value", float(merge()))
''')
        (root / "infra-agent.yaml").write_text(
            "schema_version: 1\nname: dep\nprobes:\n"
            "  - {id: merge, kind: correctness, entry: 'dep.probes:merged', covers: {files: ['dep/merge.py']}}\n"
            "  - {id: alone, kind: correctness, entry: 'dep.probes:alone', covers: {files: ['dep/other.py']}}\n"
            "  - {id: fine, kind: correctness, entry: 'dep.probes:fine', covers: {files: ['dep/merge.py']}}\n")
        return root

    base = tree(tmp_path / "base", 1)  # local() is wrong: merge fails
    cand = tree(tmp_path / "cand", 2)  # the fix, in a file merge's covers do not name
    before = judge(base, run_all=True, use_cache=False)
    assert {r.probe: r.status for r in before.results} == {"merge": Status.failed, "alone": Status.failed,
                                                            "fine": Status.passed}
    assert "dep/local.py" in next(r for r in before.results if r.probe == "merge").imports
    manifest = load_manifest(cand)
    assert select(manifest, ["dep/local.py"]) == []  # by covers alone the fix is judged by nothing
    assert [p.id for p in select(manifest, ["dep/local.py"], before.results)] == ["merge"]
    report = judge(cand, changed=["dep/local.py"], baseline_tree=base, failing=before.results, use_cache=False)
    assert [r.probe for r in report.results] == ["merge"] and report.results[0].status == Status.passed
    assert "1 of them (merge) because they failed on the baseline and import a changed file" in report.selection
    assert report.verdict.name == "better"
