"""The looking tools on hostile arguments: an observation the model can act on, never a crash, never a byte
from outside the target (a path that leaves it, a glob with ``..``, a symlink out, NUL bytes, names too long)."""

from __future__ import annotations

import itertools
import os
import pathlib

import git
import pytest

from infra_agent.agent import Agent, Limits
from infra_agent.backends.openai_backend import OpenAIBackend
from infra_agent.exceptions import FormatError
from infra_agent.tools import grep, list_files, read_file
from infra_agent.workspace import GitWorkspace
from tests.support.chat import ScriptedServer, ok, tool_call
from tests.support.toy_agent import ACTOR, make_toy

SECRET = "root-secret-0123456789"
PATHS = ["../outside/passwd", "../../etc/passwd", "/etc/passwd", "toy/escape/passwd", "toy/core.py\x00.txt",
         "x" * 300, "", ".", "..", "~/.ssh/id_rsa", "toy/../../outside/passwd", "\ud800", "toy/escape"]
GLOBS = ["", ".", "..", "../*", "**/../../*", "/etc/*", "~/*", "x" * 300, "toy/escape/*", "**/passwd", "\x00", "[",
         "**/*"]


@pytest.fixture
def target(tmp_path) -> pathlib.Path:
    """The toy target, with a secret beside it and a committed symlink out of it to the secret's folder."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_text(SECRET + "\n")
    root = make_toy(tmp_path / "toy_target")
    os.symlink(outside, root / "toy" / "escape")
    repo = git.Repo(root)
    repo.git.add(A=True)
    repo.index.commit("a symlink out", author=ACTOR, committer=ACTOR)
    return root


def _answer(fn, *args) -> str:
    try:
        return fn(*args)
    except FormatError as exc:  # the model is told what was wrong with its call
        return f"error: {exc}"


def test_every_hostile_argument_gets_an_answer_and_nothing_from_outside(target):
    answers = [_answer(read_file, target, p) for p in PATHS] + [_answer(list_files, target, p) for p in PATHS]
    answers += [_answer(grep, target, pat, g) for pat, g in itertools.product(["root", "(", "a" * 5000], GLOBS)]
    assert all(isinstance(a, str) and a for a in answers)
    assert not [a for a in answers if SECRET in a]
    assert "toy/core.py" in list_files(target) and "escape" not in list_files(target)  # the symlink out is not listed
    assert grep(target, "return 1.5") == "toy/core.py:2: return 1.5"


def test_the_loop_answers_every_hostile_call_and_goes_on(target):
    calls = [("read_file", {"path": p}) for p in PATHS] + [("list_files", {"dir": p}) for p in PATHS]
    calls += [("grep", {"pattern": "root", "glob": g}) for g in GLOBS]
    script = [ok(tool_call(name, **args)) for name, args in calls] + [ok(tool_call("finish", summary="looked"))]
    os.environ.setdefault("OPENAI_API_KEY", "sk-test-tools-0123456789")
    with ScriptedServer(script) as server:
        ws = GitWorkspace.external(target, "tools")
        agent = Agent(OpenAIBackend(model="m", base_url=server.url, max_retries=0), ws, "look around",
                      Limits(max_steps=len(script) + 2, max_format_errors=len(script) + 2))
        assert agent.run() == "finished", agent.summary_text
        ws.close()
    answers = [m["content"] for m in agent.messages if m["role"] == "tool"]
    assert len(answers) == len(calls) and all(answers)  # one observation per call: none ended the session
    assert not [a for a in answers if SECRET in a]
