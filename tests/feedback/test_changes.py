"""What a change touched: a unified diff's files, and git's answer for a revision."""

from __future__ import annotations

import pytest

from feedback.changes import DiffError, files_in_diff


def test_files_in_diff_and_broken_diffs():
    diff = ("diff --git a/toy/core.py b/toy/core.py\n--- a/toy/core.py\n+++ b/toy/core.py\n@@ -1 +1 @@\n-x\n+y\n"
            "--- /dev/null\n+++ b/toy/new.py\n@@ -0,0 +1 @@\n+z\n")
    assert files_in_diff(diff) == ["toy/core.py", "toy/new.py"]
    with pytest.raises(DiffError):
        files_in_diff("just some text\nwithout headers\n")
    with pytest.raises(DiffError):
        files_in_diff("--- a/x.py\n+++ b/x.py\n")  # no hunk
