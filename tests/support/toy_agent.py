"""A toy target for agent sessions: a git repository whose one probe fails until core.py is fixed."""

from __future__ import annotations

import pathlib

import git

ACTOR = git.Actor("t", "t@t")


MERGE = "tl.dot(b_M, b_h, input_precision=MERGE_PRECISION)"


TOY_MANIFEST = """
schema_version: 1
name: toy
probes:
  - id: toy.value
    kind: correctness
    entry: "toy.probes:value"
    covers: {files: ["toy/*.py"]}
    thresholds: {error: {max: 0.01}}
risk:
  - {id: toy.numerics, category: numerics, paths: ["toy/**"], pattern: "tolerance"}
protected: [toy/probes.py]
"""


TOY_PROBES = """
from feedback.probe import probe
from toy import core

@probe
def value(ctx):
    ctx.metric("error", abs(core.compute() - 1.0), better="lower")
"""


def make_toy(root: pathlib.Path) -> pathlib.Path:
    (root / "toy").mkdir(parents=True)
    (root / "toy" / "__init__.py").write_text("")
    (root / "toy" / "core.py").write_text("def compute():\n    return 1.5\n")
    (root / "toy" / "probes.py").write_text(TOY_PROBES)
    (root / "infra-agent.yaml").write_text(TOY_MANIFEST)
    (root / ".gitignore").write_text(".infra-agent/\n__pycache__/\n")
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add(A=True)
    repo.index.commit("toy", author=ACTOR, committer=ACTOR)
    return root


FIX = """--- a/toy/core.py
+++ b/toy/core.py
@@ -1,2 +1,2 @@
 def compute():
-    return 1.5
+    return 1.0
"""


def clean_and_on_main(root: pathlib.Path) -> None:
    repo = git.Repo(root)
    assert repo.active_branch.name == "main"
    assert not repo.is_dirty(untracked_files=True), repo.git.status()
    assert (root / "toy" / "core.py").read_text() == "def compute():\n    return 1.5\n"


def env_without_keys() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "ZAI_API_KEY")}


def proposed_session(root: pathlib.Path, session: str, hypothesis: str, diff: str, monkeypatch, max_steps: int = 4):
    """A session on ``root`` whose model (a scripted OpenAI-protocol server) proposes ``diff`` once and
    finishes: (the closed workspace, the agent)."""
    from infra_agent.agent import Agent, Limits
    from infra_agent.backends.openai_backend import OpenAIBackend
    from infra_agent.workspace import GitWorkspace
    from tests.support.chat import ScriptedServer, ok, tool_call

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-session-0123456789")
    with ScriptedServer([ok(tool_call("propose_patch", hypothesis=hypothesis, diff=diff)),
                         ok(tool_call("finish", summary="done"))]) as server:
        ws = GitWorkspace.external(root, session)
        agent = Agent(OpenAIBackend(model="m", base_url=server.url), ws, "fix it", Limits(max_steps=max_steps))
        agent.run()
        ws.close()
    return ws, agent
