"""Change-impact selection: from a diff or a git revision to the probes bound to what changed."""

from __future__ import annotations

import pathlib
import re

from feedback.manifest import STAGE_ORDER, Manifest, ProbeSpec
from feedback.models import ProbeResult, Status
from feedback.state import SKIP_PARTS
from feedback.targets import commit_of, git, repo_root

#: the statuses of a baseline result that a change may fix (a skip is not one: the machine decides it)
FAILING = (Status.failed, Status.error, Status.timeout)

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
    tree = pathlib.Path(tree).resolve()
    root = repo_root(tree)
    if root is None:
        raise ValueError(f"--changed-from needs a git repository, and {tree} is not in one")
    if commit_of(root, rev) is None:
        raise ValueError(f"unknown revision {rev!r}")
    sub = tree.relative_to(root)
    where = str(sub) if str(sub) != "." else "."
    names = []
    for args in (("diff", "--name-only", rev), ("ls-files", "--others", "--exclude-standard")):
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
    return out


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

def order(specs: list[ProbeSpec]) -> list[ProbeSpec]:
    """Cheapest first: by cascade stage, then by time budget."""
    return sorted(specs, key=lambda s: (STAGE_ORDER[s.kind], s.budget_s, s.id))


def select(manifest: Manifest, changed: list[str], failing: list[ProbeResult] | None = None) -> list[ProbeSpec]:
    """The probes whose ``covers`` match any changed file, and those :func:`rechecked`, cheapest first."""
    again = rechecked(manifest, changed, failing)
    return order([p for p in manifest.probes if p.id in again or any(p.covers.matches(f) for f in changed)])


def rechecked(manifest: Manifest, changed: list[str], failing: list[ProbeResult] | None) -> set[str]:
    """Of ``failing`` (the baseline's results; those with a :data:`FAILING` status count), the probes
    that imported a changed file their covers do not name.  A manifest's covers can miss a dependency
    (a merge probe whose local states come from another kernel's file); a fix in that file must still be
    seen to fix the probe.  Only failing probes are asked again so: they are few, where selecting every
    importer of a changed file would run most probes of a package after any one-line change."""
    touched = set(changed)
    ids = {r.probe for r in failing or [] if r.status in FAILING and touched.intersection(r.imports)}
    return {p.id for p in manifest.probes
            if p.id in ids and not any(p.covers.matches(f) for f in changed)}


def stages(specs: list[ProbeSpec]) -> list[tuple[str, list[ProbeSpec]]]:
    """Group probes into the cascade's stages: static, correctness, microbench, trace, events, e2e."""
    groups: dict[str, list[ProbeSpec]] = {}
    for s in order(specs):
        groups.setdefault(s.kind, []).append(s)
    return sorted(groups.items(), key=lambda kv: STAGE_ORDER[kv[0]])
