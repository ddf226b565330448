"""A tree the harness builds from a commit (a baseline export, a session's worktree) with its submodules in it.

``git archive`` and ``git worktree add`` leave each submodule an empty folder.  A repository that keeps a
dependency as a submodule (native-sparse-attention's ``fla`` and ``flame``, a kernel library's
``cutlass``) then cannot even import in the trees that are judged, while it does in the user's checkout:
every candidate would be "judged" by import errors.  :func:`fill_submodules` writes into such a tree the
files of each submodule the user's checkout has, at the commit the tree records for it (``git archive``
of the submodule's own repository, nested submodules too).  Git leaves the files of an unpopulated
submodule folder alone: a worktree's status and diff do not see them.

A submodule the checkout does not have (never initialised) stays empty, and a missing package that lives
there is named as such where a test fails to import it (:func:`not_checked_out`).
"""

from __future__ import annotations

import io
import pathlib
import tarfile

from feedback.changes import git


def gitlinks(root: pathlib.Path, commit: str) -> list[tuple[str, str]]:
    """(path, commit) of every submodule that ``commit`` of the repository at ``root`` records."""
    out = git(root, "ls-tree", "-r", "-z", commit)
    if out.returncode != 0:
        return []
    links = []
    for entry in out.stdout.decode(errors="replace").split("\0"):
        meta, _, path = entry.partition("\t")
        parts = meta.split()
        if len(parts) == 3 and parts[1] == "commit":
            links.append((path, parts[2]))
    return links


def fill_submodules(root: pathlib.Path, commit: str, tree: pathlib.Path) -> list[str]:
    """Write into ``tree`` (a tree of ``commit`` of the repository at ``root``) each submodule that ``root``'s
    checkout has, at its recorded commit; returns the paths written.  A submodule that is not checked out
    there, or that lacks the recorded commit, is left as it is (best effort: the tree is judged without it)."""
    filled = []
    for path, sha in gitlinks(root, commit):
        source, dest = root / path, tree / path
        if not (source / ".git").exists() or any(dest.iterdir() if dest.is_dir() else ()):
            continue
        archive = git(source, "archive", "--format=tar", sha)
        if archive.returncode != 0:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(dest, filter="data")
        filled.append(path)
        filled += [f"{path}/{p}" for p in fill_submodules(source, sha, dest)]
    return filled


def not_checked_out(tree: pathlib.Path, package: str) -> str | None:
    """Where ``package`` would be in ``tree`` if the submodule holding it were checked out: the submodule's
    path, when ``tree/package`` (or a link of that name) points into an empty submodule folder."""
    modules = tree / ".gitmodules"
    if not modules.is_file():
        return None
    try:
        text = modules.read_text(errors="replace")
    except OSError:
        return None
    paths = [line.split("=", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("path")
             and "=" in line]
    candidates = [tree / package]
    if candidates[0].is_symlink():  # native-sparse-attention's `fla -> 3rdparty/flash-linear-attention/fla`
        try:
            candidates.append(candidates[0].parent / candidates[0].readlink())
        except OSError:
            pass
    for sub in paths:
        folder = tree / sub
        if folder.is_dir() and not any(folder.iterdir()) and any(c == folder or folder in c.parents
                                                                 for c in candidates):
            return sub
    return None
