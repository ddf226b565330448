"""Trees built from a commit (a baseline export, a session's worktree) hold the submodules the user's checkout
has, at the commits the tree records; a package in a submodule that is not checked out is named as such."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import git

from feedback.needs import lacks
from feedback.submodules import fill_submodules, gitlinks
from feedback.targets import export_revision

ACTOR = git.Actor("t", "t@t")
ALLOW = ["-c", "protocol.file.allow=always"]


def _commit(repo: git.Repo, message: str) -> str:
    repo.git.add(A=True)
    return repo.index.commit(message, author=ACTOR, committer=ACTOR).hexsha


def _super(tmp_path: pathlib.Path) -> tuple[pathlib.Path, str, str]:
    """A repository that keeps the package `kern` in the submodule third_party/kern (linked as `kern`, as
    native-sparse-attention links `fla`), itself with a nested submodule; the submodule's checkout then moves
    past the commit the superproject records."""
    nested = tmp_path / "nested"
    (nested / "data.txt").parent.mkdir(parents=True)
    (nested / "data.txt").write_text("nested v1\n")
    _commit(git.Repo.init(nested, initial_branch="main"), "nested")
    lib = tmp_path / "kern-src"
    (lib / "kern").mkdir(parents=True)
    (lib / "kern" / "__init__.py").write_text("VERSION = 1\n")
    lib_repo = git.Repo.init(lib, initial_branch="main")
    subprocess.run(["git", *ALLOW, "-C", str(lib), "submodule", "-q", "add", str(nested), "vendor/nested"], check=True)
    recorded = _commit(lib_repo, "kern v1")
    root = tmp_path / "engine"
    (root / "engine").mkdir(parents=True)
    (root / "engine" / "run.py").write_text("import kern\n\nprint(kern.VERSION)\n")
    repo = git.Repo.init(root, initial_branch="main")
    subprocess.run(["git", *ALLOW, "-C", str(root), "submodule", "-q", "add", str(lib), "third_party/kern"], check=True)
    subprocess.run(["git", *ALLOW, "-C", str(root), "submodule", "-q", "update", "--init", "--recursive"], check=True)
    (root / "kern").symlink_to("third_party/kern/kern")
    commit = _commit(repo, "engine")
    # the user's checkout of the submodule moves on; the superproject still records v1
    sub = git.Repo(root / "third_party" / "kern")
    (root / "third_party" / "kern" / "kern" / "__init__.py").write_text("VERSION = 2\n")
    _commit(sub, "kern v2")
    return root, commit, recorded


def test_an_export_holds_each_submodule_at_the_commit_the_tree_records(tmp_path):
    root, commit, recorded = _super(tmp_path)
    assert gitlinks(root, commit) == [("third_party/kern", recorded)]
    tree = export_revision(root, commit, tmp_path / "export")
    assert (tree / "third_party" / "kern" / "kern" / "__init__.py").read_text() == "VERSION = 1\n"
    assert (tree / "third_party" / "kern" / "vendor" / "nested" / "data.txt").read_text() == "nested v1\n"
    run = subprocess.run([sys.executable, "engine/run.py"], cwd=tree, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tree)})
    assert run.stdout.strip() == "1", run.stderr  # the link into the submodule resolves in the export


def test_a_session_worktree_holds_the_submodules_and_its_diff_sees_only_the_change(tmp_path):
    from infra_agent.workspace import GitWorkspace

    root, _, _ = _super(tmp_path)
    (root / "infra-agent.yaml").write_text("schema_version: 1\nname: engine\nprobes: []\n")
    repo = git.Repo(root)
    repo.index.add(["infra-agent.yaml"])  # the submodule's newer checkout is not committed
    repo.index.commit("manifest", author=ACTOR, committer=ACTOR)
    ws = GitWorkspace.external(root, "sub")
    try:
        cand = ws.new_candidate()
        assert (cand.path / "third_party" / "kern" / "kern" / "__init__.py").read_text() == "VERSION = 1\n"
        (cand.path / "engine" / "run.py").write_text("import kern\n\nprint(kern.VERSION + 1)\n")
        diff = ws.diff(cand)
        assert "engine/run.py" in diff and "third_party" not in diff, diff
    finally:
        ws.close()


def test_a_package_in_a_submodule_not_checked_out_is_named_with_the_command_that_brings_it(tmp_path):
    root, commit, _ = _super(tmp_path)
    fresh = tmp_path / "fresh"
    git.Repo.clone_from(root, fresh)  # no `submodule update`: third_party/kern is an empty folder
    assert not any((fresh / "third_party" / "kern").iterdir())
    assert fill_submodules(fresh, commit, fresh) == []  # nothing checked out there to fill from
    need = lacks("E   ModuleNotFoundError: No module named 'kern'", [fresh])
    assert need == ("the package 'kern' (in the git submodule third_party/kern, not checked out: "
                    "`git submodule update --init third_party/kern`)")
    assert lacks("E   ModuleNotFoundError: No module named 'tqdm'", [fresh]) == "the package 'tqdm'"
