"""Real diffs of the bundled target: materialised into a git repository, edited, diffed by git, and
reset, so a test judges the diff against the tree before it."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import git

from feedback.targets import materialize_bundled


def bundled_diff(tmp_path: pathlib.Path, edits: dict[str, Callable[[str], str]]) -> tuple[str, pathlib.Path]:
    """(the diff git makes of ``edits``, the tree before it); each edit maps a file's text ('' for a new
    file) to its new text."""
    root = materialize_bundled(tmp_path / "t")
    repo = git.Repo.init(root)
    repo.git.add(A=True)
    repo.index.commit("base", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    for rel, edit in edits.items():
        path = root / rel
        path.write_text(edit(path.read_text() if path.exists() else ""))
    repo.git.add(A=True)
    diff = repo.git.diff("--cached") + "\n"
    repo.git.reset("--hard")
    return diff, root


def replacing(old: str, new: str) -> Callable[[str], str]:
    """An edit that replaces the first ``old`` by ``new``, and fails if the file has no ``old``."""
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return edit
