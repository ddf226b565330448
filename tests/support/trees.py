"""A target tree of one package and a manifest, written in a line: the probe trees tests make up."""

from __future__ import annotations

import pathlib
import shutil


def probe_tree(root: pathlib.Path, package: str, source: str, probes: str) -> pathlib.Path:
    """``root/package/probes.py`` holding ``source`` and a manifest whose ``probes:`` list is ``probes``
    (YAML lines, indented by two), the package importable from the tree's root."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    (root / package / "probes.py").write_text(source)
    (root / "infra-agent.yaml").write_text(f"schema_version: 1\nname: {package}\npython_path: ['.']\nprobes:\n{probes}")
    return root


def mutant(clean: pathlib.Path, at: pathlib.Path, file: str, edit: tuple[str, str]) -> pathlib.Path:
    """A copy of the tree ``clean`` at ``at`` with one edit made in ``file`` (its old text there exactly once)."""
    shutil.copytree(clean, at)
    path = at / file
    source = path.read_text()
    assert source.count(edit[0]) == 1, f"{edit[0]!r} is in {file} {source.count(edit[0])} times"
    path.write_text(source.replace(*edit))
    return at
