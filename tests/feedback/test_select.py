"""Change-impact selection from a diff and from a git revision."""

from __future__ import annotations

import pytest

from feedback.manifest import load_manifest
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
