"""The state folder: everything infra-agent writes for one place lives under ``.infra-agent/``.

For the bundled target that place is the current directory.  A user's own repository is never
written into: its state folder lives under the state home (``$INFRA_AGENT_HOME``, else
``$XDG_STATE_HOME/infra-agent``, else ``~/.local/state/infra-agent``), in ``targets/<name>-<hash of
its path>`` (:meth:`StateDir.for_target`), so ``--target DIR`` finds the same one every time.

One object spells out the layout; the harness, the workspaces, the review queue and the CLI take
it (or a path it gives) as an argument instead of joining folder names themselves::

    .infra-agent/
      cache/                 probe results keyed by content (shared by sessions and the feedback command)
      memos/                 whole reports of the feedback command, served while nothing they read changed
      workspaces/<session>/  a session: session.json, trajectory.jsonl, summary.json, worktrees/, repo/
      review.db              the review queue
      experiments/           the experiment records the sessions wrote
      bundled/               scratch copies of the bundled target
      baselines/<commit>/    committed trees exported as baselines (a commit never changes: kept, the
                             few most recently used)
"""

from __future__ import annotations

import os
import pathlib

NAME = ".infra-agent"
#: path parts that walks over a target tree leave out (version control, our state, bytecode)
SKIP_PARTS = frozenset({".git", NAME, "__pycache__"})
#: folders of installed third-party code that a target may keep in its tree (a virtual environment): no
#: walk for the target's own sources goes into one, unless it is asked for by path
ENV_PARTS = frozenset({".venv", "venv", "site-packages", "node_modules", ".tox", ".nox"})


def state_home() -> pathlib.Path:
    """Where the state of users' own repositories lives (never inside them)."""
    if os.environ.get("INFRA_AGENT_HOME"):
        return pathlib.Path(os.environ["INFRA_AGENT_HOME"]).expanduser().resolve()
    base = os.environ.get("XDG_STATE_HOME") or pathlib.Path.home() / ".local" / "state"
    return pathlib.Path(base).expanduser().resolve() / "infra-agent"


class StateDir:
    """One place's state folder.  A plain class rather than a dataclass: the console script's memo lookup
    (feedback/memo.py) imports this module, and ``dataclasses`` costs it ``inspect``'s import."""

    __slots__ = ("root",)

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", pathlib.Path(root))

    def __setattr__(self, name, value):
        raise AttributeError("a StateDir does not change: make another")

    def __eq__(self, other) -> bool:
        return isinstance(other, StateDir) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def __repr__(self) -> str:
        return f"StateDir({str(self.root)!r})"

    @classmethod
    def of(cls, base: str | os.PathLike | None = None) -> StateDir:
        """The state folder inside ``base`` (default: the current directory): the bundled target's."""
        return cls(pathlib.Path(base if base is not None else pathlib.Path.cwd()).resolve() / NAME)

    @classmethod
    def for_target(cls, target: str | os.PathLike) -> StateDir:
        """The state folder of a user's repository ``target``: outside it, under the state home."""
        import hashlib

        root = pathlib.Path(target).resolve()
        key = hashlib.sha256(str(root).encode()).hexdigest()[:12]
        return cls(state_home() / "targets" / f"{root.name or 'root'}-{key}" / NAME)

    @property
    def cache(self) -> pathlib.Path:
        return self.root / "cache"

    @property
    def memos(self) -> pathlib.Path:
        return self.root / "memos"

    @property
    def workspaces(self) -> pathlib.Path:
        return self.root / "workspaces"

    def session(self, session: str) -> pathlib.Path:
        return self.workspaces / session

    @property
    def review_db(self) -> pathlib.Path:
        return self.root / "review.db"

    @property
    def experiments(self) -> pathlib.Path:
        return self.root / "experiments"

    @property
    def bundled(self) -> pathlib.Path:
        return self.root / "bundled"

    @property
    def baselines(self) -> pathlib.Path:
        return self.root / "baselines"

    def relative(self, path: str | os.PathLike) -> str:
        """``path`` relative to the state folder when it is inside (portable across machines), else as is."""
        p = pathlib.Path(path)
        try:
            return p.resolve().relative_to(self.root).as_posix()
        except ValueError:
            return str(p)
