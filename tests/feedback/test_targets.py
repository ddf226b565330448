"""Target trees: a revision exported to a folder, once per commit when a store keeps it."""

from __future__ import annotations

import pathlib

import git
import pytest

from feedback.targets import export_revision, stored_revision


def _commit(repo: git.Repo, path: str, text: str) -> str:
    (pathlib.Path(repo.working_tree_dir) / path).write_text(text)
    repo.index.add([path])
    actor = git.Actor("t", "t@t")
    return repo.index.commit(f"{path} = {text}", author=actor, committer=actor).hexsha


def test_a_revision_is_exported_as_committed_not_as_the_working_tree(toy, tmp_path):
    (toy / "toy" / "value.txt").write_text("uncommitted")
    tree = export_revision(toy, "HEAD", tmp_path / "out")
    assert (tree / "toy" / "value.txt").read_text() == "1"
    assert not (tree / ".git").exists()


def test_a_stored_revision_is_exported_once_per_commit_and_reused(toy, tmp_path):
    store = tmp_path / "store"
    first = stored_revision(toy, "HEAD", store)
    assert (first / "toy" / "value.txt").read_text() == "1"
    (first / "toy" / "seen.txt").write_text("left by the first use")  # a second export would drop it
    again = stored_revision(toy, "HEAD", store)
    assert again == first and (again / "toy" / "seen.txt").is_file()

    repo = git.Repo(toy)
    second = _commit(repo, "toy/value.txt", "2")
    assert first.name != second
    newer = stored_revision(toy, "HEAD", store)
    assert newer.name == second and (newer / "toy" / "value.txt").read_text() == "2"
    assert stored_revision(toy, "HEAD~1", store) == first  # the older commit's export, still there


def test_the_store_keeps_only_the_most_recently_used_exports(toy, tmp_path):
    store, repo = tmp_path / "store", git.Repo(toy)
    commits = [_commit(repo, "toy/value.txt", str(i)) for i in range(4)]
    for c in commits:
        stored_revision(toy, c, store, keep=2)
    stored_revision(toy, commits[2], store, keep=2)  # used again: the most recent
    stored_revision(toy, commits[0], store, keep=2)
    assert sorted(d.name for d in store.iterdir()) == sorted([commits[0], commits[2]])


def test_a_folder_that_is_not_a_whole_export_is_replaced_and_bad_revisions_are_refused(toy, tmp_path):
    store = tmp_path / "store"
    head = git.Repo(toy).head.commit.hexsha
    (store / head / "toy").mkdir(parents=True)
    (store / head / "toy" / "value.txt").write_text("half-written")  # no completion mark
    tree = stored_revision(toy, "HEAD", store)
    assert (tree / "toy" / "value.txt").read_text() == "1" and (tree / "toy" / "core.py").is_file()
    with pytest.raises(ValueError, match="unknown revision 'nope'"):
        stored_revision(toy, "nope", store)
    with pytest.raises(ValueError, match="not in a git repository"):
        stored_revision(tmp_path / "store", "HEAD", tmp_path / "other")
    assert not [p for p in store.iterdir() if p.name.startswith(".partial-")]
