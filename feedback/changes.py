"""What a change touched: the files a unified diff names, or those that differ from a git revision.

Plain ``git`` (a subprocess) rather than GitPython, and nothing heavier than the standard library: every
``feedback --changed-from`` asks what changed, and an unchanged re-run answers from its memo
(:mod:`feedback.memo`) by asking git again before anything else loads.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

from feedback.state import SKIP_PARTS

_DIFF_PATH = re.compile(r"^(?:---|\+\+\+) (?:[ab]/)?(?P<path>\S+)")


class DiffError(ValueError):
    pass


def files_in_diff(text: str) -> list[str]:
    """Paths a unified diff touches (both sides of renames); a text with no file header is an error."""
    paths: list[str] = []
    saw_hunk = False
    for line in text.splitlines():
        if line.startswith("@@"):
            saw_hunk = True
        m = _DIFF_PATH.match(line)
        if m and m["path"] != "/dev/null":
            p = m["path"]
            if p not in paths:
                paths.append(p)
        elif line.startswith("diff --git "):
            parts = line.split()
            for p in parts[2:4]:
                p = re.sub(r"^[ab]/", "", p)
                if p not in paths:
                    paths.append(p)
    if not paths or not saw_hunk:
        raise DiffError("not a unified diff: no '--- a/...' / '+++ b/...' headers with hunks")
    return paths


def changed_since(tree: str | pathlib.Path, rev: str) -> list[str]:
    """Files that differ between ``rev`` and the working tree (untracked files included)."""
    return changes_since(tree, rev)[1]


def changes_since(tree: str | pathlib.Path, rev: str) -> tuple[str, list[str]]:
    """(the commit ``rev`` names, the files that differ between it and the working tree, untracked files
    included): four git calls."""
    root, commit, sub = resolve_revision(tree, rev)
    where = str(sub) if str(sub) != "." else "."
    names = []
    for args in (("diff", "--name-only", commit), ("ls-files", "--others", "--exclude-standard")):
        out = git(root, "-c", "core.quotepath=off", *args, "--", where)
        if out.returncode != 0:
            raise ValueError(f"git {args[0]} failed: {out.stderr.decode(errors='replace').strip()}")
        names += out.stdout.decode().splitlines()
    out = []
    for n in names:
        p = pathlib.Path(n)
        rel = p.relative_to(sub) if str(sub) != "." and p.is_relative_to(sub) else p
        if SKIP_PARTS.isdisjoint(rel.parts) and str(rel) not in out:  # never our own state or bytecode
            out.append(str(rel))
    return commit, out


def changed_files(tree: str | pathlib.Path, since: str | None = None, diff: str | None = None) -> list[str] | None:
    """What a change touched: the files changed since revision ``since``, or those a unified diff's
    text touches; None when neither is given (no selection: every probe)."""
    if since and diff is not None:
        raise ValueError("a change is given by a revision or by a diff, not both")
    if since:
        return changed_since(tree, since)
    if diff is not None:
        return files_in_diff(diff)
    return None


def git(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """``git -C cwd ARGS``, its output as bytes.  Plain ``git`` rather than GitPython on the feedback path:
    every ``feedback --changed-from`` asks what changed and exports its baseline."""
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True)


def repo_root(path: pathlib.Path) -> pathlib.Path | None:
    """The top of the git repository ``path`` is in, or None."""
    try:
        top = git(path, "rev-parse", "--show-toplevel")
    except OSError:
        return None
    return pathlib.Path(top.stdout.decode().strip()).resolve() if top.returncode == 0 else None


def resolve_revision(path: str | pathlib.Path, rev: str) -> tuple[pathlib.Path, str, pathlib.Path]:
    """(the root of the git repository ``path`` is in, the commit ``rev`` names there, ``path`` relative to
    that root); a ValueError that says which is missing."""
    path = pathlib.Path(path).resolve()
    root = repo_root(path)
    if root is None:
        raise ValueError(f"{path} is not in a git repository")
    commit = commit_of(root, rev)
    if commit is None:
        raise ValueError(f"unknown revision {rev!r} in {root}")
    return root, commit, path.relative_to(root)


def commit_of(root: pathlib.Path, rev: str) -> str | None:
    """The commit ``rev`` names in the repository at ``root``, or None."""
    out = git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return out.stdout.decode().strip() if out.returncode == 0 else None
