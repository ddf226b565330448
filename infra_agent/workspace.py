"""Where the agent works: a git repository, one worktree per candidate, a session branch.

* Bundled target: the installed ``target_stack`` is materialised as a scratch repository under
  ``.infra-agent/workspaces/<session>/repo`` (works from a checkout and from a wheel).
* External target (``--target DIR``, a git repository with an infra-agent.yaml, or one named with
  ``--manifest``): worktrees off its HEAD.  The user's checked-out branch and working tree are never
  touched, and nothing is written inside them: the session only creates the branch
  ``infra-agent/<session>``, and its worktrees and state live in the state home
  (:meth:`feedback.state.StateDir.for_target`).

Accepted patches are commits on the session branch, which is the next baseline.
"""

from __future__ import annotations

import datetime as _dt
import json
import pathlib
import secrets
import shutil
import subprocess
from dataclasses import dataclass

import git

from feedback.manifest import MANIFEST_NAME, Manifest, load_manifest
from feedback.state import NAME as STATE_NAME
from feedback.state import StateDir
from feedback.submodules import fill_submodules
from feedback.targets import materialize_bundled

ACTOR = git.Actor("infra-agent", "infra-agent@localhost")


def new_session_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def commit_message(text: str, *, trailers: dict[str, str] | None = None, width: int = 72) -> str:
    """A commit message for ``text`` (a hypothesis: often one long paragraph with its evidence): its first
    sentence as a subject of at most ``width`` characters, the whole text wrapped below it, then the
    ``trailers`` (``playbook: ...``), so that ``git log --oneline`` reads as a list of changes."""
    import re
    import textwrap

    text = " ".join(text.split()) or "(no hypothesis given)"
    first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")
    subject = first if len(first) <= width else first[:width - 1].rsplit(" ", 1)[0].rstrip(" ,;:") + "\u2026"
    body = [] if subject == text.rstrip(".") else [textwrap.fill(text, width, break_long_words=False,
                                                                  break_on_hyphens=False)]
    tail = [f"{k}: {v}" for k, v in (trailers or {}).items()]
    return "\n\n".join([subject, *body, *(["\n".join(tail)] if tail else [])]) + "\n"


@dataclass
class Candidate:
    name: str
    path: pathlib.Path
    base: str  # the commit the candidate started from


def _committed(repo: git.Repo, rel: str) -> bytes | None:
    """The bytes of ``rel`` as HEAD has it, or None where HEAD has no such file."""
    try:
        return (repo.head.commit.tree / rel).data_stream.read()
    except KeyError:
        return None


class GitWorkspace:
    def __init__(self, repo_dir: pathlib.Path, session: str, state: StateDir, target_label: str):
        self.repo = git.Repo(repo_dir)
        self.session = session
        self.state = state
        self.state_dir = state.session(session)
        self.target_label = target_label
        self.branch = f"infra-agent/{session}"
        self.worktrees = self.state_dir / "worktrees"
        self.worktrees.mkdir(parents=True, exist_ok=True)
        if self.branch not in [h.name for h in self.repo.heads]:
            self.repo.create_head(self.branch, self.repo.head.commit)
        self._baseline: Candidate | None = None
        self._n = 0
        self.scenario: str | None = None
        self.manifest_file: pathlib.Path | None = None  # a manifest kept outside the tree (--manifest)
        self.manifest_note: str | None = None  # why the session is judged by a manifest outside its commits

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def bundled(cls, session: str, state: StateDir | None = None, scenario: str | None = None) -> GitWorkspace:
        """A scratch repository of the bundled target (in the state folder of the current directory
        unless ``state`` names another); a scenario's patch is committed on top."""
        state = state or StateDir.of()
        repo_dir = state.session(session) / "repo"
        if not (repo_dir / ".git").exists():
            materialize_bundled(repo_dir)
            (repo_dir / ".gitignore").write_text(f"{STATE_NAME}/\n__pycache__/\n")
            repo = git.Repo.init(repo_dir, initial_branch="main")
            repo.git.add(A=True)
            repo.index.commit("target_stack as bundled with infra-agent", author=ACTOR, committer=ACTOR)
            if scenario:
                patch = repo_dir / "target_stack" / "scenarios" / f"{scenario}.patch"
                if not patch.is_file():
                    known = sorted(p.stem for p in patch.parent.glob("*.patch"))
                    shutil.rmtree(state.session(session), ignore_errors=True)
                    raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(known)}")
                repo.git.apply("--recount", "--whitespace=nowarn", str(patch))
                repo.git.add(A=True)
                repo.index.commit(f"scenario {scenario}", author=ACTOR, committer=ACTOR)
        ws = cls(repo_dir, session, state, "bundled:target_stack")
        ws.scenario = scenario
        ws._write_meta()
        return ws

    def base_spec(self, commit: str) -> dict:
        """How to rebuild ``commit`` elsewhere (an experiment record's base)."""
        if self.target_label.startswith("bundled:"):
            root = self.repo.git.rev_list("--max-parents=0", commit).splitlines()[0]
            patch = self.repo.git.diff(root, commit)
            return {"kind": "bundled", "base_patch": patch + "\n" if patch else "", "scenario": self.scenario}
        return {"kind": "git", "repo": str(self.root), "commit": commit}

    @classmethod
    def external(cls, target: pathlib.Path, session: str, manifest_file: pathlib.Path | None = None) -> GitWorkspace:
        """A session on the user's repository ``target``, judged by its own manifest or by ``manifest_file``."""
        target = target.resolve()
        if manifest_file is not None:
            manifest_file = pathlib.Path(manifest_file).resolve()
            if not manifest_file.is_file():
                raise ValueError(f"--manifest {manifest_file}: no such file")
        elif not (target / MANIFEST_NAME).is_file():
            raise ValueError(f"{target} has no {MANIFEST_NAME} (write one with `infra-agent init {target}`, "
                             "or name one kept elsewhere with --manifest FILE)")
        try:
            repo = git.Repo(target)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError) as exc:
            raise ValueError(f"{target} is not the root of a git repository") from exc
        if not repo.head.is_valid():
            raise ValueError(f"{target} has no commits yet")
        note = None
        if manifest_file is None and _committed(repo, MANIFEST_NAME) != (target / MANIFEST_NAME).read_bytes():
            # the session works on commits: a manifest just written by `init` (or edited since) is not in them.
            # It judges from where it is, as --manifest would, and never enters what the agent edits
            manifest_file = target / MANIFEST_NAME
            note = (f"{MANIFEST_NAME} is not committed as it is in the working tree: the session is judged by the "
                    f"working tree's file, kept outside the session's worktrees (as --manifest {manifest_file})")
        ws = cls(target, session, StateDir.for_target(target), str(target))
        ws.manifest_file = manifest_file
        ws.manifest_note = note
        ws._write_meta()
        return ws

    def _write_meta(self) -> None:
        if not (self.state_dir / "session.json").exists():
            self.update_meta(session=self.session, target=self.target_label, repo=str(self.repo.working_tree_dir),
                             branch=self.branch, started=_dt.datetime.now().isoformat(timespec="seconds"),
                             base=self.head(), scenario=self.scenario,
                             manifest=str(self.manifest_file) if self.manifest_file else None)

    def meta(self) -> dict:
        """The session's ``session.json`` (what ``--resume`` rebuilds it from)."""
        return json.loads((self.state_dir / "session.json").read_text())

    def update_meta(self, **fields) -> None:
        """Merge ``fields`` into ``session.json``, atomically (a kill leaves the old file or the new)."""
        meta = self.state_dir / "session.json"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        data = {**(json.loads(meta.read_text()) if meta.exists() else {}), **fields}
        tmp = meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(meta)

    @classmethod
    def reopen(cls, state: StateDir, session: str) -> GitWorkspace:
        """An existing session's workspace, as ``session.json`` describes it; worktrees a killed run left
        are removed, and candidate numbers go on after the ones already used."""
        meta_path = state.session(session) / "session.json"
        if not meta_path.is_file():
            raise ValueError(f"no session {session!r} in {state.root} (`infra-agent sessions list` shows them)")
        meta = json.loads(meta_path.read_text())
        if meta.get("target", "").startswith("bundled:"):
            ws = cls.bundled(session, state=state, scenario=meta.get("scenario"))
        else:
            ws = cls.external(pathlib.Path(meta["repo"]), session,
                              pathlib.Path(meta["manifest"]) if meta.get("manifest") else None)
        ws.close()
        names = [h.name for h in ws.repo.heads if h.name.startswith(f"{ws.branch}-candidate-")]
        used = [int(n.rsplit("-", 1)[1]) for n in names if n.rsplit("-", 1)[1].isdigit()]
        ws._n = max(used, default=ws._n)
        return ws

    # --- trees ----------------------------------------------------------------------------------

    @property
    def root(self) -> pathlib.Path:
        return pathlib.Path(self.repo.working_tree_dir)

    def head(self) -> str:
        return self.repo.heads[self.branch].commit.hexsha

    def manifest(self) -> Manifest:
        return load_manifest(self.baseline().path, self.manifest_file)

    def judges(self) -> Manifest | None:
        """The manifest to judge every tree of the session by, when it is kept outside them (else None:
        each tree is judged by its own, which patches cannot touch)."""
        return load_manifest(self.root, self.manifest_file) if self.manifest_file else None

    def _add_worktree(self, name: str, commit: str) -> pathlib.Path:
        path = self.worktrees / name
        if path.exists():
            self.repo.git.worktree("remove", "--force", str(path))
        self.repo.git.worktree("add", "--detach", str(path), commit)
        fill_submodules(self.root, commit, path)  # a worktree leaves each submodule an empty folder
        return path

    def baseline(self) -> Candidate:
        """A worktree at the session branch head: what candidates are judged against."""
        head = self.head()
        if self._baseline is None or self._baseline.base != head:
            path = self._add_worktree("baseline", head)
            self._baseline = Candidate("baseline", path, head)
        return self._baseline

    def tree_at(self, commit: str, name: str) -> pathlib.Path:
        """A detached worktree at ``commit`` (drop it with :meth:`drop_tree`)."""
        return self._add_worktree(name, commit)

    def drop_tree(self, path: pathlib.Path) -> None:
        self.discard(Candidate(path.name, path, ""))

    def new_candidate(self) -> Candidate:
        self._n += 1
        head = self.head()
        name = f"candidate-{self._n:03d}"
        return Candidate(name, self._add_worktree(name, head), head)

    def apply(self, cand: Candidate, diff: str) -> None:
        """Apply a unified diff in the candidate; git's own message on failure."""
        # --recount: models miscount hunk lengths; --unidiff-zero: they also send hunks without context
        flags = ["--recount", "--unidiff-zero", "--whitespace=nowarn"]
        for args in (["apply", "--check", *flags, "-"], ["apply", *flags, "-"]):
            proc = subprocess.run(["git", "-C", str(cand.path), *args], input=diff, capture_output=True, text=True)
            if proc.returncode != 0:
                raise ValueError("the diff does not apply: " + (proc.stderr.strip().splitlines() or ["?"])[0])

    def diff(self, cand: Candidate) -> str:
        """Every change in the candidate's tree against its base, new files included.  Staged first and
        compared from the index: a file rewritten in the second its worktree was checked out can look
        unchanged to a stat-based ``git diff`` of the working tree."""
        wt = git.Repo(cand.path)
        wt.git.add(A=True)
        out = wt.git.diff("--cached", cand.base)
        return out + "\n" if out else ""  # GitPython strips the final newline a patch needs

    def accept(self, cand: Candidate, message: str) -> str:
        """Commit the candidate and advance the session branch to it; returns the commit."""
        wt = git.Repo(cand.path)
        wt.git.add(A=True)
        commit = wt.index.commit(message, author=ACTOR, committer=ACTOR)
        self.repo.git.update_ref(f"refs/heads/{self.branch}", commit.hexsha, cand.base)
        return commit.hexsha

    def keep_for_review(self, cand: Candidate, message: str) -> str:
        """Commit the candidate on its own branch (the review queue merges it later)."""
        wt = git.Repo(cand.path)
        wt.git.add(A=True)
        commit = wt.index.commit(message, author=ACTOR, committer=ACTOR)
        branch = f"{self.branch}-{cand.name}"
        self.repo.create_head(branch, commit.hexsha, force=True)
        return branch

    def discard(self, cand: Candidate) -> None:
        try:
            self.repo.git.worktree("remove", "--force", str(cand.path))
        except git.GitCommandError:
            shutil.rmtree(cand.path, ignore_errors=True)
            self.repo.git.worktree("prune")

    def close(self) -> None:
        for path in sorted(self.worktrees.glob("*")):
            try:
                self.repo.git.worktree("remove", "--force", str(path))
            except git.GitCommandError:
                shutil.rmtree(path, ignore_errors=True)
        self.repo.git.worktree("prune")


def list_sessions(target: pathlib.Path | None = None) -> list[dict]:
    """The sessions of repository ``target`` (default: the bundled target's, in the current directory), oldest
    first."""
    out = []
    state = StateDir.for_target(target) if target is not None else StateDir.of()
    for meta in sorted(state.workspaces.glob("*/session.json")):
        try:
            info = json.loads(meta.read_text())
        except json.JSONDecodeError:
            continue
        summary = meta.parent / "summary.json"
        if summary.exists():
            try:
                info["summary"] = json.loads(summary.read_text())
            except json.JSONDecodeError:
                pass
        info["dir"] = str(meta.parent)
        out.append(info)
    return out


def remove_session(info: dict, keep_branches: bool = False) -> None:
    """Delete a session's folder (its worktrees and, for the bundled target, its scratch repository);
    in an external target's repository also the worktree records and, unless ``keep_branches``, the
    session branch and its candidate branches."""
    shutil.rmtree(info["dir"], ignore_errors=True)
    try:
        repo = git.Repo(info["repo"])
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return  # the bundled target's repository went with its folder
    repo.git.worktree("prune")
    if not keep_branches:
        for head in list(repo.heads):
            if head.name == info["branch"] or head.name.startswith(info["branch"] + "-"):
                repo.delete_head(head, force=True)

