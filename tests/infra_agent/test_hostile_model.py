"""Random and adversarial model output through the real ``openai`` client and a 127.0.0.1 server:
bad JSON, wrong types, unknown tools, enormous arguments, paths with ``..``, absolute paths, a
symlink out of the target, NUL bytes, diffs of protected files, endless tool calls, 429 and 500
answers.  The loop never crashes, writes nothing outside its candidate worktrees, answers every tool
call with an observation, and keeps to its step budget."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

import git
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra_agent.agent import Agent, Limits
from infra_agent.backends.openai_backend import OpenAIBackend
from infra_agent.tools import TOOL_NAMES
from infra_agent.workspace import GitWorkspace
from tests.support.chat import ScriptedServer, completion, ok, tool_call
from tests.support.toy_agent import ACTOR, FIX, make_toy

MAX_STEPS = 6


class _Long(str):
    """An enormous argument whose repr stays short, so a falsifying example prints in a line (a CI log's tail)."""

    def __repr__(self) -> str:
        return f"<{len(self)} x {self[:1]!r}>"


HOSTILE_TEXT = st.sampled_from([
    "../../etc/passwd", "/etc/passwd", "toy/../../outside.py", "toy/escape/passwd", "toy/core.py\x00.txt",
    "~/.ssh/id_rsa", "", _Long("x" * 200_000), "toy/core.py", "toy/probes.py", "💥" * 50, "C:\\Windows\\system32",
]) | st.text(max_size=40)
DIFFS = st.sampled_from([
    FIX, FIX.replace("toy/core.py", "toy/probes.py"), FIX.replace("toy/core.py", "../core.py"),
    FIX.replace("toy/core.py", "/tmp/core.py"), FIX.replace("toy/core.py", "toy/escape/passwd"),
    FIX.replace("return 1.0", "return 1.0\x00"), FIX[: len(FIX) // 2], "not a diff", FIX.replace("\n", "\r\n"),
]) | st.text(max_size=200)
ARG_VALUES = HOSTILE_TEXT | st.integers(-10**9, 10**9) | st.none() | st.lists(HOSTILE_TEXT, max_size=3) \
    | st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)
NAMES = st.sampled_from(sorted(TOOL_NAMES) + ["rm_rf", "", "read_file\x00", "shell", "propose_patch "])


LOOKING = {"read_file": "path", "list_files": "dir", "grep": "glob"}  # each tool's path-like argument


@st.composite
def replies(draw):
    kind = draw(st.sampled_from(["tool", "tool", "tool", "look", "look", "raw", "text", "status", "patch"]))
    if kind == "look":  # a looking tool with a hostile path or glob: the arguments most likely to escape or crash
        name = draw(st.sampled_from(sorted(LOOKING)))
        args = {LOOKING[name]: draw(HOSTILE_TEXT)} | ({"pattern": draw(HOSTILE_TEXT)} if name == "grep" else {})
        return ok(tool_call(name, **args))
    if kind == "status":
        code = draw(st.sampled_from([429, 500, 400, 503]))
        return code, {"error": {"message": draw(HOSTILE_TEXT)[:200], "type": "server_error"}}
    if kind == "text":
        return ok(completion({"role": "assistant", "content": draw(HOSTILE_TEXT)}))
    if kind == "raw":
        return ok(tool_call(draw(NAMES), raw_args=draw(st.text(max_size=80) | st.just('{"path": "toy/core.py"'))))
    if kind == "patch":
        return ok(tool_call("propose_patch", hypothesis=draw(HOSTILE_TEXT)[:300], diff=draw(DIFFS)))
    keys = draw(st.lists(st.sampled_from(["path", "start", "end", "pattern", "glob", "ids", "diff", "hypothesis",
                                          "summary", "id", "playbook_id"]), max_size=4, unique=True))
    return ok(tool_call(draw(NAMES), **{k: draw(ARG_VALUES) for k in keys}))


def _snapshot(root: pathlib.Path) -> dict[str, bytes]:
    """Every file outside the state folder and .git, with its bytes (the user's tree and whatever is beside it)."""
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if {".infra-agent", ".git"} & set(rel.parts) or not path.is_file() or path.is_symlink():
            continue
        out[str(rel)] = path.read_bytes()
    return out


# 30 in CI; bench/reliability.py runs more (INFRA_AGENT_HOSTILE_EXAMPLES)
# one failure, its own exception (not a group of them) in the summary line
@settings(max_examples=int(os.environ.get("INFRA_AGENT_HOSTILE_EXAMPLES", "30")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow], report_multiple_bugs=False)
@given(script=st.lists(replies(), min_size=1, max_size=MAX_STEPS + 3))
def test_hostile_replies_never_crash_the_loop_or_write_outside_its_worktrees(script):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        outside = tmp / "outside"
        outside.mkdir()
        (outside / "passwd").write_text("root:x:0:0\n")
        root = make_toy(tmp / "toy_target")
        os.symlink(outside, root / "toy" / "escape")  # a committed symlink out of the target
        repo = git.Repo(root)
        repo.git.add(A=True)
        repo.index.commit("a symlink out", author=ACTOR, committer=ACTOR)
        before, head = _snapshot(tmp), repo.head.commit.hexsha
        os.environ.setdefault("OPENAI_API_KEY", "sk-test-hostile-0123456789")
        with ScriptedServer(script) as server:
            ws = GitWorkspace.external(root, "hostile")
            agent = Agent(OpenAIBackend(model="m", base_url=server.url, max_retries=0), ws, "make the probe pass",
                          Limits(max_steps=MAX_STEPS, max_format_errors=MAX_STEPS, time_limit_s=120))
            outcome = agent.run()
            ws.close()
        assert outcome in ("finished", "limits", "error"), outcome
        assert agent.step <= MAX_STEPS + 1
        assert _snapshot(tmp) == before, "a file outside the state folder changed"
        assert repo.head.commit.hexsha == head and repo.active_branch.name == "main"
        # every tool call the loop accepted was answered with an observation (but the finish that ended it)
        calls = [c["id"] for m in agent.messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []
                 if not (outcome == "finished" and c["function"]["name"] == "finish")]
        answered = {m.get("tool_call_id") for m in agent.messages if m.get("role") == "tool" and m.get("content")}
        assert set(calls) <= answered, (calls, answered)
        json.dumps(agent.messages)  # the conversation stays serialisable (no bytes, no NaN objects)
