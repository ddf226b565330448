"""Whole reports remembered (feedback/memo.py): served to an unchanged re-run, never to a changed one.

The command line runs in real subprocesses on a real git repository; the state home is the test
session's (``INFRA_AGENT_HOME``), so every tree has its own state folder.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import git
import pytest

from feedback import memo
from feedback.state import StateDir
from infra_agent.entry import parse_feedback

NOTE = "unchanged since"


def feedback(tree: pathlib.Path, *args: str, env: dict | None = None, json_out: bool = True):
    cmd = [sys.executable, "-m", "infra_agent", "feedback", "--target", str(tree), *(["--json"] if json_out else []),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


def served(out) -> bool:
    return NOTE in out.stderr


def report(out) -> dict:
    data = json.loads(out.stdout)
    data.pop("duration_s")
    return data


def committed(toy: pathlib.Path) -> pathlib.Path:
    """The toy target with one covered change since HEAD (the probes that cover it run on both sides)."""
    (toy / "toy" / "core.py").write_text("def core():\n    return 2\n")
    return toy


def test_an_unchanged_rerun_is_served_and_prints_what_the_full_path_prints(toy):
    tree = committed(toy)
    first = feedback(tree, "--changed-from", "HEAD")
    assert first.returncode == 1 and not served(first), first.stderr  # toy.bad fails: exit code 1
    assert not all(r["cached"] for r in json.loads(first.stdout)["results"])
    again = feedback(tree, "--changed-from", "HEAD")  # the very next run: the memo written after the first
    assert served(again) and again.returncode == 1, again.stderr
    assert "running" not in again.stderr  # no probe was even looked up
    shutil.rmtree(StateDir.for_target(tree).memos)
    full = feedback(tree, "--changed-from", "HEAD")  # the full path, every result from the cache
    assert not served(full) and full.returncode == 1
    assert report(again) == report(full)
    assert all(r["cached"] for r in report(full)["results"] + report(full)["baseline_results"])
    # the terminal's rendering of the same memo, from the command line itself
    table = feedback(tree, "--changed-from", "HEAD", json_out=False)
    assert served(table) and table.returncode == 1 and "toy.bad" in table.stdout


def test_fail_on_new_tells_a_change_that_broke_nothing_from_one_that_did(toy):
    # FlagGems: a check failing on the repository before any change made every `--changed-from` exit 1, so CI
    # could not tell a new problem from the old one; `--fail-on new` exits 1 only for what the change broke
    tree = committed(toy)  # toy.bad fails on both sides; the change breaks nothing
    for attempt in range(2):  # the full path, then the memo it wrote
        out = feedback(tree, "--changed-from", "HEAD", "--fail-on", "new")
        assert out.returncode == 0 and served(out) == bool(attempt), out.stderr
        assert json.loads(out.stdout)["verdict"]["name"] == "unchanged"
    assert feedback(tree, "--changed-from", "HEAD").returncode == 1  # the default: any failing probe
    (tree / "toy" / "value.txt").write_text("oops")  # toy.ok's input: a check that held on the baseline fails
    out = feedback(tree, "--changed-from", "HEAD", "--fail-on", "new")
    assert out.returncode == 1 and json.loads(out.stdout)["verdict"]["name"] == "incorrect", out.stdout[-2000:]
    bad = feedback(tree, "--fail-on", "new")
    assert bad.returncode == 2 and "--changed-from REV or --baseline REV" in bad.stderr


def _rewrite_keeping_size_and_times(path: pathlib.Path, text: str) -> None:
    st = path.stat()
    assert len(text) == st.st_size
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _edit_a_changed_file(tree: pathlib.Path) -> None:
    """core.py differs from HEAD already: git's list of changed files stays the same."""
    _rewrite_keeping_size_and_times(tree / "toy" / "core.py", "def core():\n    return 3\n")


def _edit_a_read_file(tree: pathlib.Path) -> None:
    _rewrite_keeping_size_and_times(tree / "toy" / "value.txt", "7")  # "1" before


def _ignored_file(tree: pathlib.Path) -> None:
    """A file git does not list (ignored), which a probe could still read."""
    (tree / ".git" / "info" / "exclude").write_text("scratch/\n")
    (tree / "scratch").mkdir()
    (tree / "scratch" / "x.py").write_text("X = 1\n")


def _untracked_file(tree: pathlib.Path) -> None:
    (tree / "toy" / "notes.txt").write_text("a file the last run did not see\n")


def _commit(tree: pathlib.Path) -> None:
    repo = git.Repo(tree)
    repo.git.add("-A")
    repo.index.commit("move HEAD", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))


def _clear_cache(tree: pathlib.Path) -> None:
    shutil.rmtree(StateDir.for_target(tree).cache)


def _damage_memo(tree: pathlib.Path) -> None:
    for m in StateDir.for_target(tree).memos.glob("*.json"):
        m.write_text(m.read_text()[:100])


CHANGED = ("--changed-from", "HEAD")
ONE = ("--probe", "toy.ok")


@pytest.mark.parametrize(("change", "args"), [(_edit_a_changed_file, CHANGED), (_edit_a_read_file, ONE),
                                              (_ignored_file, ONE), (_untracked_file, CHANGED), (_commit, CHANGED),
                                              (_clear_cache, CHANGED), (_damage_memo, CHANGED)])
def test_a_memo_is_never_served_once_anything_it_read_changed(toy, change, args):
    tree = committed(toy)
    feedback(tree, *args)
    assert served(feedback(tree, *args))
    change(tree)
    after = feedback(tree, *args)
    assert not served(after), after.stderr
    if change in (_edit_a_changed_file, _edit_a_read_file):  # judged again: the probe read the new file
        ok = next(r for r in json.loads(after.stdout)["results"] if r["probe"] == "toy.ok")
        assert not ok["cached"]
        if change is _edit_a_read_file:
            assert ok["metrics"]["marker"]["value"] == 7.0
    assert served(feedback(tree, *args))  # and remembered anew


def test_another_request_or_environment_is_another_memo(toy):
    tree = committed(toy)
    feedback(tree, "--changed-from", "HEAD")
    assert served(feedback(tree, "--changed-from", "HEAD"))
    assert not served(feedback(tree, "--changed-from", "HEAD", "--probe", "toy.ok"))
    assert not served(feedback(tree, "--changed-from", "HEAD", env={"CUDA_VISIBLE_DEVICES": ""}))
    assert not served(feedback(tree, "--changed-from", "HEAD", "--no-cache"))
    other = tree.parent / "copy"
    shutil.copytree(tree, other)
    assert not served(feedback(other, "--changed-from", "HEAD"))  # another tree: another state folder


def test_no_memo_while_a_result_is_not_cached(toy):
    """A timeout is never cached: its report is not what a re-run prints, so it is not remembered."""
    first = feedback(toy, "--probe", "toy.hangs")
    assert json.loads(first.stdout)["results"][0]["status"] == "timeout"
    assert not list(StateDir.for_target(toy).memos.glob("*.json"))
    assert not served(feedback(toy, "--probe", "toy.hangs"))


def test_a_memo_written_on_one_gpu_model_is_not_served_on_another(tmp_path, monkeypatch):
    """A state folder on a shared file system: the driver's GPU model is in the observation, as in the cache's key."""
    from feedback import machine

    request = memo.Request(tmp_path)
    monkeypatch.setattr(machine, "gpu_present", lambda: True)
    seen = set()
    for model in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", None):
        monkeypatch.setattr(machine, "driver_gpu_model", lambda model=model: model)
        seen.add(json.dumps(memo.observe(request, [str(tmp_path)], tmp_path / "cache")["environment"]))
    assert len(seen) == 3


def test_a_served_memo_loads_neither_typer_nor_the_harness(toy):
    feedback(toy, "--probe", "toy.ok")
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "infra_agent", "feedback", "--target", str(toy),
                          "--probe", "toy.ok", "--json"], capture_output=True, text=True)
    assert served(out), out.stderr
    loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "feedback.memo" in loaded
    assert not loaded & {"typer", "pydantic", "yaml", "rich", "feedback.harness", "feedback.manifest", "torch"}


def test_observe_hashes_a_file_written_within_the_racy_window(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    request = memo.Request(tmp_path)
    seen = memo.observe(request, [str(tmp_path)], tmp_path / "cache")
    assert list(seen["racy"]) == [str(tmp_path / "a.txt")]
    again = memo.observe(request, [str(tmp_path)], tmp_path / "cache", racy=list(seen["racy"]))
    assert again == seen
    (tmp_path / "a.txt").write_text("y")
    assert memo.observe(request, [str(tmp_path)], tmp_path / "cache", racy=list(seen["racy"]))["racy"] != seen["racy"]


def test_a_rewrite_that_restores_size_and_mtime_still_shows_in_its_ctime(tmp_path, monkeypatch):
    monkeypatch.setattr(memo, "RACY_NS", 0)  # no hashing: the time stamps alone
    f = tmp_path / "a.txt"
    f.write_text("x")
    request = memo.Request(tmp_path)
    seen = memo.observe(request, [str(tmp_path)], tmp_path / "cache")
    assert seen["racy"] == {} and memo.observe(request, [str(tmp_path)], tmp_path / "cache") == seen
    _rewrite_keeping_size_and_times(f, "y")
    assert memo.observe(request, [str(tmp_path)], tmp_path / "cache")["files"] != seen["files"]


def test_a_virtual_environment_kept_in_the_tree_is_not_walked(tmp_path, monkeypatch):
    """uv keeps ``.venv`` in the project: tens of thousands of installed files, covered by no probe."""
    monkeypatch.setattr(memo, "MAX_FILES", 2)
    (tmp_path / "pkg.py").write_text("x = 1\n")
    for i in range(5):
        (tmp_path / ".venv" / "lib" / "site-packages" / f"m{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / ".venv" / "lib" / "site-packages" / f"m{i}.py").write_text("y = 2\n")
    request = memo.Request(tmp_path)
    seen = memo.observe(request, [str(tmp_path)], tmp_path / "cache")
    assert seen["files"][str(tmp_path)][1] == 1 and list(seen["racy"]) == [str(tmp_path / "pkg.py")]


def test_a_folder_link_or_a_huge_tree_is_not_memoised(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "linked").symlink_to(tmp_path / "real")
    recorder = memo.Recorder(tmp_path / "memos", memo.Request(tmp_path / "tree"), tmp_path / "cache")
    assert recorder.before is None and recorder.keep("{}", 0) is None
    (tmp_path / "tree" / "linked").unlink()
    monkeypatch.setattr(memo, "MAX_FILES", 0)
    (tmp_path / "tree" / "f").write_text("x")
    assert memo.Recorder(tmp_path / "memos", memo.Request(tmp_path / "tree"), tmp_path / "cache").before is None


def test_the_fast_parser_knows_exactly_the_feedback_options():
    """Every option of the ``feedback`` command is either parsed by the console script's fast path or
    sends the command line to typer: a new option cannot be silently ignored by a memo lookup."""
    import typer.main

    from infra_agent.cli import app
    from infra_agent.entry import _FLAG, _VALUE

    command = typer.main.get_command(app).commands["feedback"]
    options = {o for p in command.params for o in p.opts}
    assert set(_VALUE) | set(_FLAG) <= options
    # --fail-on new's exit code is the verdict's: judged by the full command line, which serves the memo too
    assert options - set(_VALUE) - set(_FLAG) == {"--no-cache", "--trace-dir", "--address", "--fail-on"}
    assert parse_feedback(["feedback", "--target", "t", "--json", "--probe", "a", "--probe=b", "-j", "3"]) == \
        {"target": "t", "as_json": True, "probe": ["a", "b"], "jobs": "3"}
    for argv in (["run"], ["feedback", "--no-cache"], ["feedback", "--help"], ["feedback", "-j", "0"],
                 ["feedback", "--executor", "ray"], ["feedback", "--target"], ["feedback", "--target", "a", "--target",
                                                                              "b"],
                 ["feedback", "--changed-from", "HEAD", "--diff", "d"], ["feedback", "extra"]):
        assert parse_feedback(argv) is None, argv
