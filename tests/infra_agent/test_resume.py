"""``kill -9`` of ``infra-agent run`` mid-probe, then ``infra-agent run --resume SESSION``.

The real CLI drives the real ``openai`` client against a 127.0.0.1 server; the session is killed
while its candidate's probe runs.  Afterwards: no probe process is left, the user's branch never
moved, every step that was acknowledged is in the trajectory, and the resumed session answers the
interrupted call, goes on from the same conversation and step count, and fixes the target.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import git
import pytest

from feedback.state import StateDir
from infra_agent.resume import ResumeError, read_trajectory, restore_messages
from tests.support.chat import ScriptedServer, ok, tool_call
from tests.support.processes import alive
from tests.support.toy_agent import FIX, clean_and_on_main, env_without_keys, make_toy

HANG = """--- a/toy/core.py
+++ b/toy/core.py
@@ -1,2 +1,4 @@
 def compute():
-    return 1.5
+    import os, pathlib, time
+    pathlib.Path({marker!r}).write_text(str(os.getpid()))
+    time.sleep(600)
"""


def _cli(*args: str, cwd: pathlib.Path, key: str = "sk-test-resume-0123456789") -> list[str]:
    return [sys.executable, "-m", "infra_agent.cli", *args]




@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe-death signal is Linux's")
def test_a_session_killed_mid_probe_resumes_from_its_trajectory(tmp_path):
    root = make_toy(tmp_path / "toy_target")
    marker = tmp_path / "probe.pid"
    env = {**env_without_keys(), "OPENAI_API_KEY": "sk-test-resume-0123456789", "COLUMNS": "120"}
    first = [ok(tool_call("read_file", path="toy/core.py")),
             ok(tool_call("propose_patch", hypothesis="sleep on it", diff=HANG.format(marker=str(marker))))]
    with ScriptedServer(first) as server:
        proc = subprocess.Popen(_cli("run", "--target", str(root), "--backend", "openai", "--model", "m",
                                     "--base-url", server.url, "--max-steps", "6", cwd=tmp_path),
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t0 = time.time()
        while not marker.exists() and time.time() - t0 < 180 and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), proc.communicate()[0][-3000:]
        os.kill(proc.pid, signal.SIGKILL)  # while the candidate's probe runs
        proc.communicate()
    probe_pid = int(marker.read_text())
    t0 = time.time()
    while alive(probe_pid) and time.time() - t0 < 10:
        time.sleep(0.1)
    assert not alive(probe_pid), "the candidate's probe outlived the killed session"
    clean_and_on_main(root)  # the user's branch and working tree never moved

    (session_dir,) = StateDir.for_target(root).workspaces.iterdir()
    session = session_dir.name
    records = read_trajectory(session_dir / "trajectory.jsonl")
    messages, step, pending = restore_messages(records)
    assert step == 2 and pending["tool_calls"][0]["function"]["name"] == "propose_patch"
    assert any(m["role"] == "tool" and "def compute" in (m["content"] or "") for m in messages)  # step 1 kept

    second = [ok(tool_call("propose_patch", hypothesis="compute is off by 0.5", diff=FIX)),
              ok(tool_call("finish", summary="fixed"))]
    with ScriptedServer(second) as server:
        out = subprocess.run(_cli("run", "--resume", session, "--target", str(root), "--base-url", server.url,
                                  "--json", cwd=tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        sent = server.requests
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["session"] == session and summary["outcome"] == "finished"
    assert [(a["step"], a["decision"]) for a in summary["attempts"]] == [(3, "accepted")]
    assert summary["failing_before"] == ["toy.value"] and summary["failing_after"] == []
    # the model saw the same conversation, the interrupted call answered, and then where it stands
    conversation = sent[0]["body"]["messages"]
    assert [m["role"] for m in conversation[:2]] == ["system", "user"]
    answered = [m for m in conversation if m["role"] == "tool"]
    assert "def compute" in answered[0]["content"]
    assert "stopped before this propose_patch call completed" in answered[1]["content"]
    assert answered[1]["tool_call_id"] == pending["tool_calls"][0]["id"]
    assert "resumed at step 2" in conversation[-1]["content"]
    repo = git.Repo(root)
    assert repo.git.show(f"infra-agent/{session}:toy/core.py") == "def compute():\n    return 1.0"
    clean_and_on_main(root)
    again = subprocess.run(_cli("run", "--resume", session, "--target", str(root), cwd=tmp_path), cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already finished" in again.stderr


def test_a_torn_last_line_is_dropped_and_a_torn_middle_is_an_error(tmp_path):
    path = tmp_path / "trajectory.jsonl"
    lines = [json.dumps({"step": 0, "role": "system", "content": "s"}), json.dumps({"step": 0, "role": "user",
                                                                                    "content": "u"})]
    path.write_text("\n".join(lines) + '\n{"step": 1, "role": "assis')
    assert [r["role"] for r in read_trajectory(path)] == ["system", "user"]
    path.write_text(lines[0] + '\n{"step": 1, "ro\n' + lines[1] + "\n")
    with pytest.raises(ResumeError, match=r"trajectory.jsonl:2 is not JSON"):
        read_trajectory(path)
    with pytest.raises(ResumeError, match="no trajectory"):
        read_trajectory(tmp_path / "missing.jsonl")


def test_resuming_an_unknown_session_is_a_clear_error(tmp_path):
    root = make_toy(tmp_path / "toy_target")
    out = subprocess.run(_cli("run", "--resume", "nope", "--target", str(root), cwd=tmp_path), cwd=tmp_path,
                         env=env_without_keys(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no session 'nope'" in out.stderr
