"""Target trees: the bundled target_stack materialised as a scratch tree, and git revisions."""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import shutil
import tarfile
import tempfile

from feedback.changes import git, resolve_revision
from feedback.manifest import MANIFEST_NAME
from feedback.state import NAME as STATE_NAME
from feedback.state import StateDir
from feedback.submodules import fill_submodules

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", STATE_NAME)


def bundled_package_dir() -> pathlib.Path:
    """Where the installed (or checked-out) ``target_stack`` package lives."""
    import importlib.util

    spec = importlib.util.find_spec("target_stack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled target_stack package is not importable")
    return pathlib.Path(list(spec.submodule_search_locations)[0]).resolve()


def _digest(pkg: pathlib.Path) -> str:
    h = hashlib.sha256()
    for p in sorted(pkg.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so"):
            h.update(str(p.relative_to(pkg)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def materialize_bundled(dest: str | pathlib.Path) -> pathlib.Path:
    """Copy the bundled target into ``dest``: ``dest/target_stack/...`` and ``dest/infra-agent.yaml``."""
    pkg = bundled_package_dir()
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(pkg, dest / "target_stack", ignore=_IGNORE, dirs_exist_ok=True)
    shutil.copyfile(pkg / MANIFEST_NAME, dest / MANIFEST_NAME)
    return dest


def bundled_tree(base: str | pathlib.Path | None = None) -> pathlib.Path:
    """A scratch copy of the bundled target for judging, reused while its sources are unchanged."""
    pkg = bundled_package_dir()
    base = pathlib.Path(base) if base else StateDir.of().bundled
    dest = base / _digest(pkg)
    if not (dest / MANIFEST_NAME).is_file():
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".partial-", dir=base.mkdir(parents=True, exist_ok=True) or base))
        materialize_bundled(tmp)
        try:
            os.replace(tmp, dest)  # atomic: a killed copy never looks complete
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def export_revision(repo_dir: str | pathlib.Path, rev: str, dest: str | pathlib.Path) -> pathlib.Path:
    """Write the tree of ``rev`` of the git repository at ``repo_dir`` into ``dest`` (no checkout)."""
    root, commit, rel = resolve_revision(repo_dir, rev)
    _export(root, commit, rev, pathlib.Path(dest))
    # a target that is a subfolder of its repository: keep the same relative root
    return pathlib.Path(dest) / rel


def stored_revision(repo_dir: str | pathlib.Path, rev: str, store: str | pathlib.Path, keep: int = 4) -> pathlib.Path:
    """The tree of ``rev`` exported once into ``store/<commit>`` and reused while it is among the ``keep``
    most recently used there (a commit's tree never changes; a repeated ``feedback --changed-from``
    then pays no export).  Written atomically: a killed export never looks complete."""
    root, commit, rel = resolve_revision(repo_dir, rev)
    store = pathlib.Path(store)
    dest = store / commit
    if (dest / _COMPLETE).is_file():
        os.utime(dest)  # most recently used
        return dest / rel
    store.mkdir(parents=True, exist_ok=True)
    if dest.exists():  # not ours (ours appear whole): made by hand, or an older layout
        shutil.rmtree(dest)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".partial-", dir=store))
    try:
        _export(root, commit, rev, tmp)
        (tmp / _COMPLETE).write_text(f"{commit}\n")
        os.replace(tmp, dest)
    except OSError:  # another process stored it first (a non-empty dest), or the disk refused
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / _COMPLETE).is_file():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = sorted((d for d in store.iterdir() if d.is_dir() and d != dest and (d / _COMPLETE).is_file()),
                 key=lambda d: d.stat().st_mtime, reverse=True)
    for d in old[max(keep - 1, 0):]:
        shutil.rmtree(d, ignore_errors=True)
    return dest / rel


_COMPLETE = ".infra-agent-export"  # written last into a stored export


def _export(root: pathlib.Path, commit: str, rev: str, dest: pathlib.Path) -> None:
    archive = git(root, "archive", "--format=tar", commit)
    if archive.returncode != 0:
        raise ValueError(f"git archive of {rev!r} failed: {archive.stderr.decode(errors='replace').strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    fill_submodules(root, commit, dest)  # git archive leaves each submodule an empty folder
