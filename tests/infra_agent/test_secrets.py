"""A planted API key never reaches anything a session writes: trajectory, experiment records, the
review queue, summaries, commit messages, replay's JUnit file, the console, error messages."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import git

from feedback.state import StateDir
from tests.support.chat import ScriptedServer, ok, tool_call
from tests.support.toy_agent import FIX, env_without_keys, make_toy

# not shaped like an sk- key: only the environment says that it is one
KEY = "zq-planted-7f3a9c1e5b2d40681a"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cli(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(env_without_keys(), OPENAI_API_KEY=KEY, PYTHONPATH=str(ROOT), COLUMNS="100")
    return subprocess.run([sys.executable, "-m", "infra_agent.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_planted_key_appears_in_nothing_the_session_writes(tmp_path):
    root = make_toy(tmp_path / "toy_target")
    echoed = f"Incorrect API key provided: {KEY} (Bearer {KEY})"
    script = [
        (500, {"error": {"message": echoed, "type": "server_error"}}),  # the provider echoes the key
        ok(tool_call("read_file", path="toy/core.py")),
        ok(tool_call("propose_patch", hypothesis=f"compute returns 1.5; my key is {KEY}", diff=FIX)),
        ok(tool_call("read_file", path=f"toy/{KEY}.py")),  # an error observation that quotes it back
        ok(tool_call("finish", summary=f"fixed; the key was {KEY}")),
    ]
    with ScriptedServer(script) as server:
        run = _cli(["run", "--target", str(root), "--backend", "openai", "--base-url", server.url, "--model", "m",
                    "--goal", "make the probe pass", "--json"], tmp_path)
    assert run.returncode in (0, 1), run.stderr[-3000:]
    assert server.requests[0]["auth"] == f"Bearer {KEY}"  # the key did reach the provider, and only it
    summary = json.loads(run.stdout)
    assert summary["attempts"], summary
    state = StateDir.for_target(root).root  # the repository's state lives in the state home, not in it
    assert not (root / ".infra-agent").exists()
    records = sorted(state.rglob("exp-*.yaml"))
    assert records, list(state.rglob("*"))[:20]
    replay = _cli(["replay", *map(str, records), "--junit", str(tmp_path / "replay.xml")], tmp_path)
    review = _cli(["review", "list", "--target", str(root), "--json"], tmp_path)
    texts = {"run stdout": run.stdout, "run stderr": run.stderr, "replay": replay.stdout + replay.stderr,
             "review": review.stdout + review.stderr}
    for base in (tmp_path, state):  # the test's folder and the repository's state folder in the state home
        for path in base.rglob("*"):
            if path.is_file() and ".git" not in path.parts:
                texts[str(path)] = path.read_bytes().decode("utf-8", "replace")
    repo = git.Repo(root)
    texts["commit messages"] = repo.git.log("--all", "--format=%B")
    assert (tmp_path / "replay.xml").is_file() and any("trajectory" in k for k in texts)
    leaks = sorted(k for k, v in texts.items() if KEY in v)
    assert not leaks, f"the planted key appears in: {leaks}"
    assert os.environ.get("OPENAI_API_KEY") != KEY
