"""infra-agent: agent-assisted performance and correctness work on LLM inference stacks.

The loop (:mod:`infra_agent.agent`) depends on two interfaces, listed here with exactly what it uses:
a :class:`Backend` proposes the next action, a :class:`Workspace` holds the trees it is judged on.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from feedback.manifest import Manifest
    from feedback.state import StateDir
    from infra_agent.agent import AgentState
    from infra_agent.tools import Action

__version__ = "0.1.0"


class Backend(Protocol):
    """Chooses the next action from the session's state (a model, a playbook policy, a recording)."""

    name: str
    model: str | None

    def next_action(self, state: AgentState) -> Action: ...


class Tree(Protocol):
    """A checked-out tree of the target: the baseline or a candidate."""

    name: str
    path: pathlib.Path
    base: str  # the commit it started from


class Workspace(Protocol):
    """Where a session works: the baseline, candidate trees, the session branch, the state folder."""

    session: str
    branch: str
    target_label: str
    scenario: str | None
    root: pathlib.Path  # the repository the session branch lives in
    state: StateDir  # the place's state folder (cache, review queue, experiments)
    state_dir: pathlib.Path  # this session's own folder inside it

    def baseline(self) -> Tree: ...
    def new_candidate(self) -> Tree: ...
    def apply(self, cand: Tree, diff: str) -> None: ...
    def accept(self, cand: Tree, message: str) -> str: ...
    def keep_for_review(self, cand: Tree, message: str) -> str: ...
    def discard(self, cand: Tree) -> None: ...
    def head(self) -> str: ...
    def manifest(self) -> Manifest: ...
    def judges(self) -> Manifest | None: ...  # the manifest kept outside the trees, if the session has one
    def base_spec(self, commit: str) -> dict: ...
    def meta(self) -> dict: ...
    def tree_at(self, commit: str, name: str) -> pathlib.Path: ...
    def drop_tree(self, path: pathlib.Path) -> None: ...
