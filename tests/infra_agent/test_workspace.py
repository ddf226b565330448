"""A session's workspace on a user's repository (infra_agent/workspace.py): which manifest judges it.

The session works on commits (worktrees of HEAD); `infra-agent init` writes the manifest into the working
tree.  A manifest that HEAD does not have as the working tree has it judges the session from where it is,
as ``--manifest`` would, so that `init` and then `run` works without a commit in between, and an edit of
the manifest made since the last commit is the one that judges.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import git
import pytest

from infra_agent.workspace import GitWorkspace

ACTOR = git.Actor("t", "t@t")
MANIFEST = ("schema_version: 1\nname: mine\nprobes:\n"
            "  - {id: dots, kind: static, check: dot_precision, params: {paths: [pkg]}}\n")


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("INFRA_AGENT_HOME", str(tmp_path / "state"))
    root = tmp_path / "mine"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    r = git.Repo.init(root, initial_branch="main")
    r.git.add(A=True)
    r.index.commit("base", author=ACTOR, committer=ACTOR)
    return r


def test_a_manifest_not_committed_judges_from_the_working_tree(repo):
    root = pathlib.Path(repo.working_tree_dir)
    (root / "infra-agent.yaml").write_text(MANIFEST)
    ws = GitWorkspace.external(root, "fresh")
    assert ws.manifest_file == root / "infra-agent.yaml" and "not committed" in ws.manifest_note
    assert [p.id for p in ws.manifest().probes] == ["dots"]
    assert ws.meta()["manifest"] == str(root / "infra-agent.yaml")  # what --resume and the replay read
    assert not (ws.baseline().path / "infra-agent.yaml").exists()  # nothing was written into the session's tree
    assert repo.git.status("--porcelain") == "?? infra-agent.yaml"  # nor committed for the user


def test_a_committed_manifest_judges_from_the_commits_and_an_edit_since_from_the_working_tree(repo):
    root = pathlib.Path(repo.working_tree_dir)
    (root / "infra-agent.yaml").write_text(MANIFEST)
    repo.git.add(A=True)
    repo.index.commit("manifest", author=ACTOR, committer=ACTOR)
    ws = GitWorkspace.external(root, "committed")
    assert ws.manifest_file is None and ws.manifest_note is None
    (root / "infra-agent.yaml").write_text(MANIFEST.replace("name: mine", "name: edited"))
    edited = GitWorkspace.external(root, "edited")
    assert edited.manifest_file == root / "infra-agent.yaml" and edited.manifest().name == "edited"


def test_init_then_run_without_a_commit_through_the_cli(repo, tmp_path):
    """The README's order on a repository of one's own: `init`, then `run`; the session says which manifest
    judges it and ends normally (no probe fails here, so no attempt is made)."""
    root = repo.working_tree_dir
    cli = [sys.executable, "-m", "infra_agent"]
    subprocess.run([*cli, "init", root], check=True, capture_output=True, timeout=120)
    run = subprocess.run([*cli, "run", "--target", root, "--backend", "offline"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "is not committed as it is in the working tree" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr


def test_a_commit_message_has_a_short_subject_and_the_whole_hypothesis_below():
    from infra_agent.workspace import commit_message

    long = ("Pass positional arguments in the order the callee declares. Evidence: static.argument_order: "
            "`_silu_and_mul_kernel` (lmdeploy/pytorch/kernels/cuda/activation.py:18) declares (gateup_ptr, out_ptr, "
            "N, M); its one call passes `M` as parameter 3")
    msg = commit_message(long, trailers={"playbook": "restore-argument-order"})
    subject, blank, *rest = msg.splitlines()
    assert subject == "Pass positional arguments in the order the callee declares" and blank == ""
    assert all(len(line) <= 72 for line in rest if " " in line)
    assert " ".join(rest[:-2]).split() == long.split() and rest[-1] == "playbook: restore-argument-order"
    one = "State the precision of the fp32 dot chains of the merge kernels, with tf32x3 where tf32 exists"
    cut = commit_message(one).splitlines()
    assert len(cut[0]) <= 72 and cut[0].endswith("\u2026") and " ".join(cut[2:]) == one
    assert commit_message("fix the merge") == "fix the merge\n" and commit_message("  ") == "(no hypothesis given)\n"
