"""Change-impact selection: the probes bound to the files a change touched."""

from __future__ import annotations

import json
import pathlib

from feedback.changes import changed_since
from feedback.manifest import load_manifest
from feedback.models import Status
from feedback.select import select


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


def _dep_tree(root, local):
    """merge fails unless local() is 2 (its covers name only merge.py); alone fails; fine passes."""
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


def test_a_failing_probe_is_judged_again_when_a_file_it_imports_changes_whatever_its_covers_say(tmp_path):
    """A merge probe whose covers name only the merge, while its inputs come from another file: a fix in
    that file is judged on the probe (it failed, and it imported the file); a passing probe that imports
    the file is not selected (covers decide there), nor is a failing one that never imported it."""
    from feedback.harness import judge

    base = _dep_tree(tmp_path / "base", 1)  # local() is wrong: merge fails
    cand = _dep_tree(tmp_path / "cand", 2)  # the fix, in a file merge's covers do not name
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


def test_feedback_changed_from_asks_again_a_probe_the_cache_knows_failed_on_the_baseline(tmp_path):
    """The command line judges no whole baseline first: the baseline's results its cache already holds
    (here from `feedback --all` at that commit) say which probes failed there, and the one that imported
    the changed file is judged again, though its covers do not name it."""
    import shutil
    import subprocess
    import sys

    import git

    cli = shutil.which("infra-agent", path=str(pathlib.Path(sys.executable).parent)) or "infra-agent"
    repo_dir = _dep_tree(tmp_path / "repo", 1)
    repo = git.Repo.init(repo_dir)
    (repo_dir / ".gitignore").write_text(".infra-agent/\n__pycache__/\n")
    repo.git.add(A=True)
    repo.index.commit("base", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))

    def feedback(*args):
        out = subprocess.run([cli, "feedback", "--target", str(repo_dir), "--json", *args], capture_output=True,
                             text=True, timeout=300)
        return out.returncode, json.loads(out.stdout) if out.stdout.strip() else out.stderr

    (repo_dir / "dep" / "local.py").write_text("def local():\n    return 2\n")  # the fix, not committed
    rc, cold = feedback("--changed-from", "HEAD")  # nothing known about the baseline: covers alone
    assert rc == 0 and cold["results"] == [], cold
    repo.git.stash()
    rc, whole = feedback("--all")  # the baseline judged at its commit: its results cached
    assert rc == 1 and {r["probe"]: r["status"] for r in whole["results"]}["merge"] == "fail"
    repo.git.stash("pop")
    rc, warm = feedback("--changed-from", "HEAD")
    assert rc == 0, warm
    assert [r["probe"] for r in warm["results"]] == ["merge"] and warm["results"][0]["status"] == "pass"
    assert "(merge) because they failed on the baseline" in warm["selection"]
    assert [c["baseline"] for c in warm["comparisons"]] == ["fail"]
