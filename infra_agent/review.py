"""The review queue: patches the gate held, waiting for a person.  Durable: SQLite in WAL mode.

An item is settled once.  The settling UPDATE only matches a pending row inside an IMMEDIATE
transaction, so two reviewers (two terminals, two processes) approving at once cannot both win:
the second gets a clear message naming who settled the item and when.

An approval is two steps: the item is claimed (``approving``, with the claiming process), the
candidate is merged and re-validated, and only then does the session branch move and the item
become ``applied``.  A merge or validation that fails puts the item back to ``pending`` with a
note; an approval whose process died (``kill -9``, a lost terminal) is put back to ``pending``
the next time the queue is opened on that host.  Either way the branch has not moved.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import os
import pathlib
import socket
import sqlite3
import tempfile
from typing import Any

import git
from pydantic import BaseModel, Field

from feedback.harness import judge
from feedback.manifest import Manifest, load_manifest
from feedback.models import Status
from feedback.submodules import fill_submodules
from infra_agent.experiments import RecordError, settle_record
from infra_agent.workspace import ACTOR, commit_message

STATES = ("pending", "approving", "approved", "rejected", "applied")

SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created TEXT NOT NULL,
    target TEXT NOT NULL,
    repo TEXT NOT NULL,
    session TEXT NOT NULL,
    session_branch TEXT NOT NULL,
    candidate_branch TEXT NOT NULL,
    hypothesis TEXT NOT NULL,
    playbook TEXT,
    diff TEXT NOT NULL,
    findings TEXT NOT NULL,
    evidence TEXT NOT NULL,
    validation TEXT NOT NULL,
    experiment TEXT,
    state TEXT NOT NULL DEFAULT 'pending',
    settled_by TEXT,
    settled_at TEXT,
    comment TEXT,
    reason TEXT,
    applied_commit TEXT,
    note TEXT,
    claimed_pid INTEGER,
    claimed_host TEXT
);
"""
_ADDED = {"claimed_pid": "INTEGER", "claimed_host": "TEXT"}  # columns newer than the first queues


class AlreadySettled(Exception):
    pass


class UnknownItem(KeyError):
    pass


class Item(BaseModel):
    id: int
    created: str
    target: str
    repo: str
    session: str
    session_branch: str
    candidate_branch: str
    hypothesis: str
    playbook: str | None = None
    diff: str
    findings: list[dict] = Field(default_factory=list)
    evidence: list[dict] = Field(default_factory=list)
    validation: list[str] = Field(default_factory=list)
    experiment: str | None = None
    state: str = "pending"
    settled_by: str | None = None
    settled_at: str | None = None
    comment: str | None = None
    reason: str | None = None
    applied_commit: str | None = None
    note: str | None = None
    claimed_pid: int | None = None
    claimed_host: str | None = None

    @property
    def categories(self) -> list[str]:
        return sorted({f.get("category", "?") for f in self.findings})


def _now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


class ReviewQueue:
    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
            have = {r["name"] for r in db.execute("PRAGMA table_info(items)")}
            for col, kind in _ADDED.items():
                if col not in have:
                    db.execute(f"ALTER TABLE items ADD COLUMN {col} {kind}")
        self.recover()

    def recover(self) -> list[int]:
        """Approvals interrupted on this host (their process is gone) back to pending; their ids."""
        host, back = socket.gethostname(), []
        with self._connect() as db:
            for row in db.execute("SELECT id, repo, claimed_pid, settled_by, settled_at FROM items "
                                  "WHERE state = 'approving' AND claimed_host = ?", (host,)).fetchall():
                if row["claimed_pid"] and _alive(row["claimed_pid"]):
                    continue
                note = (f"an approval by {row['settled_by']} at {row['settled_at']} was interrupted before it "
                        "was merged; nothing changed, the item is pending again")
                cur = db.execute("UPDATE items SET state = 'pending', settled_by = NULL, settled_at = NULL, "
                                 "claimed_pid = NULL, claimed_host = NULL, note = ? "
                                 "WHERE id = ? AND state = 'approving'", (note, row["id"]))
                if cur.rowcount:
                    back.append(row["id"])
                    _remove_merge_worktrees(row["repo"])
        return back

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA synchronous=FULL")
        return db

    @staticmethod
    def _item(row: sqlite3.Row) -> Item:
        d = dict(row)
        for k in ("findings", "evidence", "validation"):
            d[k] = json.loads(d[k])
        return Item(**d)

    def add(self, *, target: str, repo: str, session: str, session_branch: str, candidate_branch: str,
            hypothesis: str, diff: str, findings: list[dict], evidence: list[dict], validation: list[str],
            playbook: str | None = None, experiment: str | None = None) -> int:
        with self._connect() as db:
            cur = db.execute(
                "INSERT INTO items (created, target, repo, session, session_branch, candidate_branch, hypothesis, "
                "playbook, diff, findings, evidence, validation, experiment) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (_now(), target, repo, session, session_branch, candidate_branch, hypothesis, playbook, diff,
                 json.dumps(findings), json.dumps(evidence), json.dumps(validation), experiment))
            return int(cur.lastrowid)

    def pending_twin(self, repo: str, diff: str) -> Item | None:
        """A pending item of ``repo`` with this very diff (another session's proposal of the same change)."""
        with self._connect() as db:
            row = db.execute("SELECT * FROM items WHERE repo = ? AND state = 'pending' AND diff = ? ORDER BY id "
                             "LIMIT 1", (repo, diff)).fetchone()
        return self._item(row) if row is not None else None

    def get(self, item_id: int) -> Item:
        with self._connect() as db:
            row = db.execute("SELECT * FROM items WHERE id = ?", (item_id,)).fetchone()
        if row is None:
            raise UnknownItem(f"no review item {item_id}")
        return self._item(row)

    def list(self, state: str | None = None, target: str | None = None) -> list[Item]:
        q, args = "SELECT * FROM items WHERE 1=1", []
        if state:
            q, args = q + " AND state = ?", [*args, state]
        if target:
            q, args = q + " AND target = ?", [*args, target]
        with self._connect() as db:
            return [self._item(r) for r in db.execute(q + " ORDER BY id", args).fetchall()]

    def settle(self, item_id: int, decision: str, reviewer: str, *, comment: str | None = None,
               reason: str | None = None) -> Item:
        """Approve or reject a pending item, exactly once."""
        if decision not in ("approved", "rejected"):
            raise ValueError(f"decision must be approved or rejected, got {decision!r}")
        if decision == "rejected" and not (reason and reason.strip()):
            raise ValueError("a rejection needs a reason (it reaches the agent's next session)")
        state = "approving" if decision == "approved" else decision  # an approval counts once it is merged
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            cur = db.execute("UPDATE items SET state = ?, settled_by = ?, settled_at = ?, comment = ?, reason = ?, "
                             "claimed_pid = ?, claimed_host = ? WHERE id = ? AND state = 'pending'",
                             (state, reviewer, _now(), comment, reason, os.getpid(), socket.gethostname(), item_id))
            if cur.rowcount == 0:
                row = db.execute("SELECT * FROM items WHERE id = ?", (item_id,)).fetchone()
                db.execute("ROLLBACK")
                if row is None:
                    raise UnknownItem(f"no review item {item_id}")
                if row["state"] == "approving":
                    raise AlreadySettled(f"item {item_id} is being approved by {row['settled_by']} "
                                         f"(since {row['settled_at']})")
                raise AlreadySettled(f"item {item_id} was already {row['state']} by {row['settled_by']} "
                                     f"at {row['settled_at']}")
            db.execute("COMMIT")
        finally:
            db.close()
        return self.get(item_id)

    def update(self, item_id: int, **fields: Any) -> Item:
        allowed = {"state", "applied_commit", "note", "experiment", "settled_by", "settled_at", "claimed_pid",
                   "claimed_host"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update {sorted(bad)}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._connect() as db:
            db.execute(f"UPDATE items SET {sets} WHERE id = ?", (*fields.values(), item_id))
        return self.get(item_id)

    def rejections(self, target: str) -> list[Item]:
        return self.list(state="rejected", target=target)


MERGE_PREFIX = "infra-agent-merge-"


def _remove_merge_worktrees(repo_dir: str) -> None:
    """The scratch worktrees of approvals killed mid-merge, unregistered and deleted (best effort)."""
    try:
        repo = git.Repo(repo_dir)
        listing = repo.git.worktree("list", "--porcelain")
    except (git.GitCommandError, git.InvalidGitRepositoryError, git.NoSuchPathError):
        return
    for line in listing.splitlines():
        path = line.removeprefix("worktree ")
        if line.startswith("worktree ") and pathlib.Path(path).parent.name.startswith(MERGE_PREFIX):
            try:
                repo.git.worktree("remove", "--force", path)
                pathlib.Path(path).parent.rmdir()
            except (git.GitCommandError, OSError):
                pass
    repo.git.worktree("prune")


def _session_manifest(queue: ReviewQueue, item: Item) -> str | None:
    """The manifest kept outside the target that the item's session was judged by (its session.json), if any."""
    from feedback.state import StateDir

    meta = StateDir(queue.path.parent).session(item.session) / "session.json"
    try:
        return json.loads(meta.read_text()).get("manifest")
    except (OSError, json.JSONDecodeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reviewer_name(explicit: str | None = None) -> str:
    if explicit:
        return explicit
    try:
        name = git.GitConfigParser(read_only=True).get_value("user", "name", "")
        if name:
            return str(name)
    except Exception:  # noqa: BLE001 - no readable git configuration: the login name
        pass
    return getpass.getuser()


def apply_approved(queue: ReviewQueue, item: Item, jobs: int = 2) -> Item:
    """Merge a candidate being approved into its session branch, re-run its validation probes on the
    merged tree, and only then advance the branch (state ``applied``).  A merge or validation that
    fails is undone and reported, and the item is pending again: the branch does not move."""
    if item.state != "approving":
        raise ValueError(f"item {item.id} is {item.state}, not being approved")
    who = item.settled_by

    def back_to_pending(why: str) -> Item:
        return queue.update(item.id, state="pending", settled_by=None, settled_at=None, claimed_pid=None,
                            claimed_host=None, note=f"approval by {who} not applied: {why}; the item is pending")

    repo = git.Repo(item.repo)
    old = repo.heads[item.session_branch].commit.hexsha
    with tempfile.TemporaryDirectory(prefix=MERGE_PREFIX) as tmp:
        wt = pathlib.Path(tmp) / "merge"
        repo.git.worktree("prune")  # the records of merges a killed approval left behind
        repo.git.worktree("add", "--detach", str(wt), old)
        fill_submodules(pathlib.Path(item.repo), old, wt)
        try:
            w = git.Repo(wt)
            try:
                message = commit_message(f"Merge review item {item.id}, approved by {who}: {item.hypothesis}",
                                         trailers={"candidate branch": item.candidate_branch,
                                                   "playbook": item.playbook or "-"})
                w.git.merge("--no-ff", "-m", message, item.candidate_branch,
                            env={"GIT_AUTHOR_NAME": ACTOR.name, "GIT_AUTHOR_EMAIL": ACTOR.email,
                                 "GIT_COMMITTER_NAME": ACTOR.name, "GIT_COMMITTER_EMAIL": ACTOR.email})
            except git.GitCommandError as exc:
                return back_to_pending(f"merge failed, nothing changed: {str(exc).splitlines()[-1]}")
            external = _session_manifest(queue, item)
            manifest = load_manifest(wt, external)
            known = {p.id for p in manifest.probes}
            probes = [p for p in item.validation if p in known]
            still = ""
            if probes:
                report = judge(wt, manifest=manifest, probe_ids=probes, run_all=True, jobs=jobs)
                if not report.passed:
                    failing = sorted(r.probe for r in report.results if not r.ok)
                    lost = [p for p in failing if p in fixed_by(item)]
                    if lost:
                        return back_to_pending(f"validation failed on the merged tree: it fails what the candidate "
                                               f"fixed ({', '.join(lost)}); merge undone")
                    # the rest failed before the merge too, perhaps: judged beside the branch as it is, only a
                    # failure the branch does not have (or one more failing test) stops the approval
                    broke = _worse_than_branch(repo, old, wt, manifest, external, failing, jobs, tmp)
                    if broke:
                        return back_to_pending(f"validation failed on the merged tree ({broke}); merge undone")
                    still = f"; failing as on the branch before the merge: {', '.join(failing)}"
            merged = w.head.commit.hexsha
            repo.git.update_ref(f"refs/heads/{item.session_branch}", merged, old)
            return queue.update(item.id, state="applied", applied_commit=merged, claimed_pid=None, claimed_host=None,
                                note=f"merged and validated ({len(probes)} probes{still})")
        finally:
            repo.git.worktree("remove", "--force", str(wt))


def fixed_by(item: Item) -> set[str]:
    """The probes the candidate made pass: failing on its baseline, passing on it (its evidence)."""
    ok = (Status.passed.value, Status.skipped.value)
    return {e["probe"] for e in item.evidence
            if e.get("status_before") not in (None, *ok) and e.get("status_after") in ok}


def _worse_than_branch(repo: git.Repo, old: str, merged: pathlib.Path, manifest: Manifest, external: str | None,
                       probes: list[str], jobs: int, tmp: str) -> str:
    """The merged tree judged beside the session branch's tip on ``probes`` (which fail on the merged tree):
    what fails there that did not fail before, or "" when every failure was the branch's already (a check
    that failed on the repository before the session, or one another pending item is there to fix)."""
    base = pathlib.Path(tmp) / "branch"
    repo.git.worktree("add", "--detach", str(base), old)
    fill_submodules(pathlib.Path(repo.working_tree_dir), old, base)
    try:
        report = judge(merged, manifest=manifest, probe_ids=probes, run_all=True, baseline_tree=base,
                       baseline_manifest=load_manifest(base, external), jobs=jobs)
    finally:
        repo.git.worktree("remove", "--force", str(base))
    v = report.verdict
    if v is None or v.name not in ("incorrect", "worse"):
        return ""
    return "; ".join([*v.broke, *v.regressed]) or v.reason


def settle(queue: ReviewQueue, item_id: int, decision: str, reviewer: str | None = None, *,
           comment: str | None = None, reason: str | None = None, jobs: int = 2) -> tuple[Item, list[str]]:
    """A reviewer's decision, carried everywhere it belongs: the queue; for an approval the merge into
    the session branch and its re-validation (``apply_approved``); the attempt's experiment record.
    Returns the item and warnings (a record that could not be updated does not undo the decision).
    Raises :class:`UnknownItem`, :class:`AlreadySettled` or ``ValueError`` for a decision that cannot be made."""
    item = queue.settle(item_id, decision, reviewer_name(reviewer), comment=comment, reason=reason)
    if decision == "approved":
        item = apply_approved(queue, item, jobs=jobs)
    warnings = []
    if item.experiment and item.state in ("applied", "rejected"):
        why = (item.comment or "") if decision == "approved" else (item.reason or "")
        try:
            settle_record(pathlib.Path(item.experiment), decision, item.settled_by, why, commit=item.applied_commit)
        except (RecordError, OSError) as exc:
            warnings.append(f"the experiment record was not updated: {exc}")
    return item, warnings
