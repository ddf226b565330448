"""The review queue: durable, settled once across processes, approval merges and re-validates."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import git
import pytest

from feedback.state import StateDir
from infra_agent.agent import Agent, Limits
from infra_agent.backends.openai_backend import OpenAIBackend
from infra_agent.review import AlreadySettled, ReviewQueue, apply_approved
from infra_agent.workspace import GitWorkspace
from tests.support.chat import ScriptedServer, ok, tool_call
from tests.support.toy_agent import ACTOR, FIX, env_without_keys, make_toy, proposed_session

# an epsilon floor: numerics by the gate's rules (its code, not a comment's words)
RISKY_FIX = FIX.replace("+    return 1.0", "+    return max(1.0, 1e-12)")


def _item(q: ReviewQueue, **kw) -> int:
    base = dict(target="t", repo="/nowhere", session="s", session_branch="infra-agent/s", candidate_branch="c",
                hypothesis="h", diff=FIX, findings=[{"category": "numerics", "rule": "r", "file": "f", "line": 1,
                                                     "text": "x"}], evidence=[], validation=[])
    return q.add(**{**base, **kw})


def test_settled_once_and_the_second_reviewer_is_told_who_and_when(tmp_path):
    q = ReviewQueue(tmp_path / "review.db")
    i = _item(q)
    q.settle(i, "approved", "alice", comment="ok")
    with pytest.raises(AlreadySettled, match=r"item 1 is being approved by alice \(since \d{4}-"):
        q.settle(i, "rejected", "bob", reason="no")
    q.settle(j := _item(q), "rejected", "alice", reason="no")
    with pytest.raises(AlreadySettled, match=rf"item {j} was already rejected by alice at \d{{4}}-"):
        q.settle(j, "approved", "bob")
    with pytest.raises(ValueError, match="needs a reason"):
        q.settle(_item(q), "rejected", "bob", reason=" ")


def test_the_interactive_queue_shows_its_choices_and_records_a_rejection(tmp_path):
    """A person at the terminal: open the item, read the prompt (its brackets are text, not markup),
    reject with a reason; the queue has the decision and the reviewer."""
    q = ReviewQueue(StateDir.for_target(tmp_path).review_db)
    _item(q, hypothesis="loosen the merge tolerance")
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "review", "--target", str(tmp_path), "--reviewer",
                          "carol"], input="1\nr\nthe tolerance hides the tf32 error\nq\n", capture_output=True,
                         text=True, timeout=120, env={**env_without_keys(), "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    assert "[a]pprove, [r]eject, [s]kip" in out.stdout, out.stdout
    item = q.get(1)
    assert item.state == "rejected" and item.settled_by == "carol"
    assert item.reason == "the tolerance hides the tf32 error"
    assert "no pending items" in out.stdout


def test_inside_a_repository_the_queue_is_that_repository_s_without_target(tmp_path):
    """`infra-agent run --target .` keeps a repository's state outside it; `review list` typed inside the
    repository (any folder of it) shows that queue and says whose it is. A folder that holds a session of
    the bundled target keeps its own."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    git.Repo.init(repo)
    _item(ReviewQueue(StateDir.for_target(repo).review_db), hypothesis="state the dot's precision")

    def listed(cwd):
        # a narrow terminal: the note's path must stay whole on its line
        out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "review", "list", "--json"], cwd=cwd,
                             capture_output=True, text=True, timeout=120, env={**env_without_keys(), "COLUMNS": "60"})
        assert out.returncode == 0, out.stderr
        return [i["hypothesis"] for i in json.loads(out.stdout)], out.stderr

    items, note = listed(repo / "pkg")
    assert items == ["state the dot's precision"] and f"target {repo.resolve()}" in note
    (repo / "pkg" / ".infra-agent").mkdir()  # a state folder with no session (an earlier `review list` made it)
    assert listed(repo / "pkg")[0] == ["state the dot's precision"]
    session = repo / "pkg" / ".infra-agent" / "workspaces" / "s1"
    session.mkdir(parents=True)
    (session / "session.json").write_text("{}")  # a session of the bundled target here: its queue, empty
    assert listed(repo / "pkg") == ([], "")
    assert listed(tmp_path)[0] == []  # outside any repository


def test_a_held_item_s_findings_read_one_line_of_code_each():
    from infra_agent.gate import by_line

    def f(cat, rule, line, file="k.py"):
        return {"category": cat, "rule": rule, "file": file, "line": line, "text": f"  code {line}  "}

    lines = by_line([f("numerics", "ast.kernel-body", 9), f("numerics", "ast.call:tl.dot", 9),
                               f("concurrency", "ast.kernel-writes", 9), f("numerics", "ast.kernel-body", 9),
                               f("production", "ast.default-changed", 2), f("numerics", "r", 1, file="a.py")])
    assert lines == ["a.py:1 numerics (r): code 1", "k.py:2 production (ast.default-changed): code 2",
                     "k.py:9 numerics/concurrency (ast.kernel-body, ast.call:tl.dot, ast.kernel-writes): code 9"]
    # a rewritten kernel body: consecutive lines alike are one range (torchao's 158-line gate output), a line of
    # other rules between them ends it, and the removed side keeps its own range
    body = [f("numerics", "ast.kernel-body", n) for n in (20, 21, 22, 24, 25)] + \
        [f("numerics", "ast.kernel-body", 23) | {"rule": "ast.kernel-writes", "category": "concurrency"}] + \
        [f("numerics", "ast.kernel-body", n) | {"removed": True} for n in (20, 21)]
    assert by_line(body) == [
        "k.py:20-22 numerics (ast.kernel-body): code 20 (and 2 more line(s))",
        "k.py:20-21 (removed) numerics (ast.kernel-body): code 20 (and 1 more line(s))",
        "k.py:23 concurrency (ast.kernel-writes): code 23",
        "k.py:24-25 numerics (ast.kernel-body): code 24 (and 1 more line(s))"]


RACE = textwrap.dedent("""
    import sys, time
    from infra_agent.review import ReviewQueue, AlreadySettled
    q = ReviewQueue(sys.argv[1])
    while time.time() < float(sys.argv[3]):
        pass
    try:
        q.settle(1, "approved", sys.argv[2])
        print("WON")
    except AlreadySettled as e:
        print("LOST", e)
""")


def test_two_processes_approving_one_item_at_once_exactly_one_wins(tmp_path):
    db = tmp_path / "review.db"
    q = ReviewQueue(db)
    _item(q)
    start = str(time.time() + 1.5)
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(db), name, start], stdout=subprocess.PIPE, text=True)
             for name in ("alice", "bob")]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(o.split()[0] for o in outs) == ["LOST", "WON"], outs
    winner = "alice" if outs[0] == "WON" else "bob"
    loser_msg = next(o for o in outs if o.startswith("LOST"))
    assert f"is being approved by {winner}" in loser_msg
    assert q.get(1).settled_by == winner


WRITER = textwrap.dedent("""
    import sys
    from infra_agent.review import ReviewQueue
    q = ReviewQueue(sys.argv[1])
    big = "x" * 200_000
    while True:
        i = q.add(target="t", repo="r", session="s", session_branch="b", candidate_branch="c", hypothesis="h",
                  diff=big, findings=[], evidence=[], validation=[])
        print(i, flush=True)
""")


def test_a_process_killed_while_writing_the_queue_corrupts_and_loses_nothing(tmp_path):
    db = tmp_path / "review.db"
    ReviewQueue(db)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True)
    acknowledged = []
    t0 = time.time()
    while len(acknowledged) < 30 and time.time() - t0 < 60:
        acknowledged.append(int(proc.stdout.readline()))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    q = ReviewQueue(db)
    ids = {i.id for i in q.list()}
    assert set(acknowledged) <= ids  # every acknowledged write survived the kill
    assert all(len(i.diff) == 200_000 for i in q.list())  # and no row is half written


def _held_session(tmp_path, monkeypatch):
    root = make_toy(tmp_path / "toy_target")
    ws, agent = proposed_session(root, "sess", "compute is off by 0.5", RISKY_FIX, monkeypatch)
    (attempt,) = agent.attempts
    assert (attempt.verdict, attempt.decision) == ("better", "held") and attempt.review_id == 1
    return root, ws


def test_approval_merges_revalidates_and_applies(tmp_path, monkeypatch):
    root, ws = _held_session(tmp_path, monkeypatch)
    repo = git.Repo(root)
    before = repo.heads[ws.branch].commit.hexsha
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "review", "approve", "1", "--target", str(root),
                          "--reviewer", "carol", "--comment", "numerically fine", "--json"],
                         capture_output=True, text=True, env=env_without_keys())
    assert out.returncode == 0, out.stderr
    item = json.loads(out.stdout)
    assert item["state"] == "applied" and item["settled_by"] == "carol"
    head = repo.heads[ws.branch].commit
    assert head.hexsha == item["applied_commit"] != before and len(head.parents) == 2
    # the history reads as a list of changes: the merge and the held candidate each say what they are
    assert head.message.splitlines()[0] == "Merge review item 1, approved by carol: compute is off by 0.5"
    (candidate,) = [c for c in head.parents if c.hexsha != before]
    assert candidate.message == "compute is off by 0.5\n\nplaybook: -\nheld for review: numerics\n", candidate.message
    assert repo.git.show(f"{ws.branch}:toy/core.py").splitlines()[1] == "    return max(1.0, 1e-12)"
    assert repo.active_branch.name == "main" and not repo.is_dirty(untracked_files=True)
    from infra_agent.experiments import load_record

    rec = load_record(item["experiment"])
    assert (rec.decision.status, rec.decision.by, rec.decision.reason) == ("approved", "carol", "numerically fine")
    assert rec.decision.commit == item["applied_commit"] and rec.verdict == "better"
    again = subprocess.run([sys.executable, "-m", "infra_agent.cli", "review", "reject", "1", "--target", str(root),
                            "--reason", "late"], capture_output=True, text=True, env=env_without_keys())
    assert again.returncode == 2 and "item 1 was already applied by carol at" in again.stderr


def test_a_failing_validation_undoes_the_merge(tmp_path, monkeypatch):
    root, ws = _held_session(tmp_path, monkeypatch)
    repo = git.Repo(root)
    q = ReviewQueue(StateDir.for_target(root).review_db)
    item = q.get(1)
    # sabotage the candidate branch: its tip now breaks the probe
    wt = tmp_path / "wt"
    repo.git.worktree("add", str(wt), item.candidate_branch)
    (wt / "toy" / "core.py").write_text("def compute():\n    return 7.0  # tolerance\n")
    git.Repo(wt).git.commit("-qam", "break", author="t <t@t>")
    repo.git.worktree("remove", "--force", str(wt))
    before = repo.heads[ws.branch].commit.hexsha
    item = apply_approved(q, q.settle(1, "approved", "dave"))
    assert item.state == "pending" and "validation failed" in item.note and "merge undone" in item.note
    assert item.settled_by is None and "approval by dave" in item.note
    assert repo.heads[ws.branch].commit.hexsha == before


OTHER_PROBE = """

@probe
def other(ctx):
    import pathlib
    ctx.metric("other_error", float(pathlib.Path(ctx.tree, "toy", "other.txt").read_text()), better="lower")

@probe
def third(ctx):
    import pathlib
    ctx.metric("third_error", float(pathlib.Path(ctx.tree, "toy", "third.txt").read_text()), better="lower")
"""


def test_a_check_failing_on_the_branch_already_does_not_block_an_approval_and_a_new_failure_does(tmp_path,
                                                                                                 monkeypatch):
    # FlagGems: a fp32 dot check failed on the repository before the session; its argument-order fix was held,
    # and approving it re-ran that check on the merged tree, which failed as before: no item could ever apply
    root = make_toy(tmp_path / "toy_target")
    repo = git.Repo(root)
    (root / "toy" / "probes.py").write_text((root / "toy" / "probes.py").read_text() + OTHER_PROBE)
    (root / "toy" / "other.txt").write_text("0.5\n")
    (root / "toy" / "third.txt").write_text("0.0\n")
    manifest = (root / "infra-agent.yaml").read_text().replace("risk:", """  - id: toy.other
    kind: correctness
    entry: "toy.probes:other"
    covers: {files: ["toy/*.py"]}
    thresholds: {other_error: {max: 0.01}}
  - id: toy.third
    kind: correctness
    entry: "toy.probes:third"
    covers: {files: ["toy/*.py"]}
    thresholds: {third_error: {max: 0.01}}
risk:""")
    (root / "infra-agent.yaml").write_text(manifest)
    repo.git.add(A=True)
    repo.index.commit("a second check, failing today", author=ACTOR, committer=ACTOR)
    ws, agent = proposed_session(root, "sess", "compute is off by 0.5", RISKY_FIX, monkeypatch)
    (attempt,) = agent.attempts
    assert (attempt.verdict, attempt.decision) == ("better", "held"), attempt
    q = ReviewQueue(StateDir.for_target(root).review_db)
    assert set(q.get(1).validation) == {"toy.value", "toy.other", "toy.third"}
    before = repo.heads[ws.branch].commit.hexsha

    # the candidate branch also breaks the third check: a failure the branch does not have
    wt = tmp_path / "wt"
    repo.git.worktree("add", str(wt), q.get(1).candidate_branch)
    (wt / "toy" / "third.txt").write_text("0.5\n")
    git.Repo(wt).git.commit("-qam", "worse", author="t <t@t>")
    item = apply_approved(q, q.settle(1, "approved", "dave"))
    assert item.state == "pending" and "validation failed on the merged tree (toy.third fail" in item.note, item.note
    assert repo.heads[ws.branch].commit.hexsha == before

    # as held: the other check fails on the merged tree exactly as on the branch; the item applies and says so
    git.Repo(wt).git.reset("--hard", "HEAD~1")
    repo.git.worktree("remove", "--force", str(wt))
    item = apply_approved(q, q.settle(1, "approved", "dave"))
    assert item.state == "applied", item.note
    assert item.note == "merged and validated (3 probes; failing as on the branch before the merge: toy.other)"
    assert repo.git.show(f"{ws.branch}:toy/core.py").splitlines()[1] == "    return max(1.0, 1e-12)"


HANGING = """import pathlib, time
def compute():
    pathlib.Path({marker!r}).write_text("validating")
    time.sleep(600)
    return 1.0
"""


def test_an_approval_killed_mid_validation_leaves_the_item_pending_and_the_branch_unmoved(tmp_path, monkeypatch):
    root, ws = _held_session(tmp_path, monkeypatch)
    repo = git.Repo(root)
    item = ReviewQueue(StateDir.for_target(root).review_db).get(1)
    wt, marker = tmp_path / "wt", tmp_path / "validating"
    repo.git.worktree("add", str(wt), item.candidate_branch)
    (wt / "toy" / "core.py").write_text(HANGING.format(marker=str(marker)))  # the validation probe hangs
    git.Repo(wt).git.commit("-qam", "hang", author="t <t@t>")
    repo.git.worktree("remove", "--force", str(wt))
    before = repo.heads[ws.branch].commit.hexsha
    proc = subprocess.Popen([sys.executable, "-m", "infra_agent.cli", "review", "approve", "1", "--target", str(root),
                             "--reviewer", "frank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env_without_keys())
    t0 = time.time()
    while not marker.exists() and time.time() - t0 < 120 and proc.poll() is None:
        time.sleep(0.1)
    assert marker.exists(), "the validation probe never started"
    os.kill(proc.pid, signal.SIGKILL)  # mid-validation: merged in a scratch worktree, branch not yet moved
    proc.wait()
    q = ReviewQueue(StateDir.for_target(root).review_db)  # opening the queue recovers the dead approval
    item = q.get(1)
    assert item.state == "pending" and item.settled_by is None, item
    assert "approval by frank" in item.note and "interrupted" in item.note
    assert repo.heads[ws.branch].commit.hexsha == before
    assert repo.active_branch.name == "main" and not repo.is_dirty(untracked_files=True)
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "review", "reject", "1", "--target", str(root),
                          "--reason", "hangs in validation", "--reviewer", "gina"], capture_output=True, text=True,
                         env=env_without_keys())
    assert out.returncode == 0, out.stderr
    assert q.get(1).state == "rejected"
    repo.git.worktree("prune")
    assert len(repo.git.worktree("list").splitlines()) == 1  # no merge worktree left registered


def test_a_rejection_reason_reaches_the_next_session(tmp_path, monkeypatch):
    root, ws = _held_session(tmp_path, monkeypatch)
    # the group's options are the subcommands' defaults: `review --target DIR list` is `review list --target DIR`
    listed = subprocess.run([sys.executable, "-m", "infra_agent.cli", "review", "--target", str(root), "list",
                             "--json"], capture_output=True, text=True, env=env_without_keys(), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [(i["id"], i["state"]) for i in json.loads(listed.stdout)] == [(1, "pending")]
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "review", "--target", str(root), "--reviewer",
                          "erin", "reject", "1", "--reason", "changes the tolerance semantics"],
                         capture_output=True, text=True, env=env_without_keys(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    from infra_agent.experiments import load_record

    rec = load_record(ReviewQueue(StateDir.for_target(root).review_db).get(1).experiment)
    assert (rec.decision.status, rec.decision.by, rec.decision.reason) == ("rejected", "erin",
                                                                           "changes the tolerance semantics")
    with ScriptedServer([ok(tool_call("finish", summary="ok"))]) as server:
        ws2 = GitWorkspace.external(root, "next")
        agent = Agent(OpenAIBackend(model="m", base_url=server.url), ws2, "again", Limits(max_steps=2))
        agent.run()
        ws2.close()
        first_user = server.requests[0]["body"]["messages"][1]["content"]
    assert "rejected by erin: changes the tolerance semantics" in first_user


def test_a_second_session_proposing_a_pending_change_adds_no_second_item(tmp_path, monkeypatch):
    root, _ = _held_session(tmp_path, monkeypatch)
    _, agent = proposed_session(root, "sess2", "compute is off by 0.5, again", RISKY_FIX, monkeypatch)
    (attempt,) = agent.attempts
    assert (attempt.decision, attempt.review_id, attempt.branch) == ("held", 1, None), attempt
    q = ReviewQueue(StateDir.for_target(root).review_db)
    assert [i.id for i in q.list()] == [1] and q.get(1).session == "sess"
    assert not [b for b in git.Repo(root).branches if b.name.startswith("infra-agent/sess2-")]  # no candidate kept
