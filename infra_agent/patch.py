"""A proposed patch: a unified diff, validated before anything touches a tree."""

from __future__ import annotations

import fnmatch
import pathlib
import re
from dataclasses import dataclass, field

from feedback.manifest import Manifest

_HUNK_FULL = re.compile(r"^@@ -(?P<old>\d+)(?:,(?P<oc>\d+))? \+(?P<new>\d+)(?:,(?P<nc>\d+))? @@")


class PatchError(ValueError):
    """A diff that cannot be used; the message says why, for the model to correct."""


class PatchRefused(PatchError):
    """A diff that touches what judges it (probes, references, tests, the manifest)."""


@dataclass
class FileChange:
    path: str
    # each run of changed lines between context lines: (its removed lines, its added lines), each line
    # (its line number in the old or the new file, text)
    blocks: list[tuple[list[tuple[int, str]], list[tuple[int, str]]]] = field(default_factory=list)

    @property
    def added(self) -> list[tuple[int, str]]:
        """(new line number, text) of every added line, in order."""
        return [line for _, added in self.blocks for line in added]

    @property
    def removed(self) -> list[tuple[int, str]]:
        """(old line number, text) of every removed line, in order."""
        return [line for removed, _ in self.blocks for line in removed]


@dataclass
class Patch:
    diff: str
    files: list[FileChange]

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    @classmethod
    def parse(cls, diff: str, manifest: Manifest | None = None) -> Patch:
        if not isinstance(diff, str) or not diff.strip():
            raise PatchError("the diff is empty")
        if len(diff) > 400_000:
            raise PatchError(f"the diff is {len(diff)} characters; keep a patch under 400000")
        files: list[FileChange] = []
        old_path: str | None = None
        old_left = new_left = 0  # lines the current hunk still owes, from its header
        old_no = new_no = 0
        in_block = False  # inside a run of changed lines
        for line in diff.splitlines():
            if old_left > 0 or new_left > 0:  # inside a hunk: the header's counts say what is what
                tag, text = (line[:1], line[1:]) if line else (" ", "")
                if tag in "+-" and not in_block:
                    files[-1].blocks.append(([], []))
                    in_block = True
                if tag == "+":
                    files[-1].blocks[-1][1].append((new_no, text))
                    new_no, new_left = new_no + 1, new_left - 1
                elif tag == "-":
                    files[-1].blocks[-1][0].append((old_no, text))
                    old_no, old_left = old_no + 1, old_left - 1
                elif tag == " ":
                    old_no, new_no, old_left, new_left = old_no + 1, new_no + 1, old_left - 1, new_left - 1
                    in_block = False
                elif tag == "\\":
                    pass  # "\ No newline at end of file"
                else:
                    raise PatchError(f"malformed hunk line {line[:60]!r} (the hunk header promised more lines)")
                continue
            if line.startswith("--- "):
                old_path = line[4:].split("\t")[0].strip()
            elif line.startswith("+++ "):
                new_path = line[4:].split("\t")[0].strip()
                path = old_path if new_path == "/dev/null" else new_path
                if path is None or path == "/dev/null":
                    raise PatchError("a '+++' header without a usable path")
                files.append(FileChange(_clean_path(path)))
            elif (h := _HUNK_FULL.match(line)) is not None:
                if not files:
                    raise PatchError("a hunk comes before any '+++ b/<path>' header")
                old_no, new_no = int(h["old"]), int(h["new"])
                in_block = False
                old_left = int(h["oc"]) if h["oc"] is not None else 1
                new_left = int(h["nc"]) if h["nc"] is not None else 1
        if old_left > 0 or new_left > 0:
            raise PatchError("the diff ends inside a hunk (truncated?)")
        if not files or not any(f.added or f.removed for f in files):
            raise PatchError("not a unified diff: expected '--- a/<path>', '+++ b/<path>' and '@@' hunks")
        patch = cls(diff if diff.endswith("\n") else diff + "\n", files)
        if manifest is not None:
            for f in files:
                pat = manifest.is_protected(f.path)
                if pat:
                    raise PatchRefused(f"refused: {f.path} is protected ({pat}): probes, references, tests and "
                                       "the manifest judge the change and may not be changed by it")
        return patch


def _clean_path(path: str) -> str:
    if path.startswith(("a/", "b/")):
        path = path[2:]
    p = pathlib.PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or path.startswith("~"):
        raise PatchError(f"path {path!r} is outside the target (absolute or with '..')")
    if any(fnmatch.fnmatchcase(part, ".git") for part in p.parts):
        raise PatchError(f"path {path!r} is inside .git")
    return str(p)
