"""The agent loop with real backends: a scripted OpenAI-protocol server on 127.0.0.1 driving the
real ``openai`` client, the offline playbook policy, replay; real git repositories and worktrees."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import git
import pytest

from feedback.state import StateDir
from feedback.targets import materialize_bundled
from infra_agent.agent import Agent, Limits
from infra_agent.backends.offline import OfflineBackend
from infra_agent.backends.openai_backend import OpenAIBackend
from infra_agent.backends.replay import ReplayBackend
from infra_agent.patch import Patch, PatchError, PatchRefused
from infra_agent.workspace import GitWorkspace
from tests.support.chat import ScriptedServer, completion, ok, tool_call
from tests.support.toy_agent import ACTOR, FIX, MERGE, TOY_MANIFEST, clean_and_on_main, env_without_keys, make_toy


def test_patch_parse_refuses_protected_and_outside_paths(tmp_path):
    from feedback.manifest import parse_manifest

    m = parse_manifest(TOY_MANIFEST)
    assert Patch.parse(FIX, m).paths == ["toy/core.py"]
    with pytest.raises(PatchRefused, match="toy/probes.py is protected"):
        Patch.parse(FIX.replace("toy/core.py", "toy/probes.py"), m)
    with pytest.raises(PatchRefused, match="infra-agent.yaml is protected"):
        Patch.parse(FIX.replace("toy/core.py", "infra-agent.yaml"), m)
    with pytest.raises(PatchError, match="outside the target"):
        Patch.parse(FIX.replace("toy/core.py", "../evil.py"), m)
    with pytest.raises(PatchError, match="not a unified diff"):
        Patch.parse("please change line 2", m)


def test_openai_backend_survives_malformed_output_and_writes_nothing_outside_worktrees(tmp_path, monkeypatch):
    root = make_toy(tmp_path / "toy_target")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-abcdefghijklmnop123456")
    monkeypatch.delenv("ZAI_API_KEY", raising=False)
    script = [
        ok(tool_call("read_file", path="toy/core.py")),
        ok(tool_call("read_file", raw_args='{"path": "toy/core.py"')),                      # invalid JSON
        ok(tool_call("rm_rf", path="/")),                                                    # unknown tool
        ok(tool_call("propose_patch", hypothesis="h", diff=FIX.replace("return 1.5", "return 9.5"))),  # does not apply
        ok(tool_call("propose_patch", hypothesis="h", diff=FIX.replace("toy/core.py", "../core.py"))),  # ..
        ok(tool_call("propose_patch", hypothesis="h", diff=FIX.replace("toy/core.py", "toy/probes.py"))),  # protected
        ok(completion({"role": "assistant", "content": "x" * 250_000})),                 # enormous, no tool call
        (500, {"error": {"message": "overloaded", "type": "server_error"}}),              # a 500, then ...
        ok(tool_call("propose_patch", hypothesis="compute returns 1.5; the probe wants 1.0", diff=FIX)),  # ... success
        ok(tool_call("finish", summary="fixed compute")),
    ]
    with ScriptedServer(script) as server:
        ws = GitWorkspace.external(root, "s1")
        be = OpenAIBackend(model="glm-test", base_url=server.url, max_retries=2)
        agent = Agent(be, ws, "make the probe pass", Limits(max_steps=20, max_format_errors=5))
        assert agent.run() == "finished"
        ws.close()
    obs = [m["content"] for m in agent.messages if m["role"] in ("tool", "user")]
    text = "\n".join(o for o in obs if o)
    assert "1  def compute():" in text.replace("    1  ", "1  ")
    assert "format error: the arguments of read_file are not valid JSON" in text
    assert "format error: unknown tool 'rm_rf'" in text
    assert "patch invalid: the diff does not apply" in text
    assert "outside the target" in text
    assert "patch refused: refused: toy/probes.py is protected" in text
    assert "format error: the reply is 250000 characters" in text
    decisions = [(a.verdict, a.decision) for a in agent.attempts]
    assert decisions[-1] == ("better", "accepted")
    # the request after the 500 was retried by the real client and succeeded
    assert server.requests[-3]["body"]["model"] == "glm-test" and "tools" in server.requests[0]["body"]
    assert server.requests[0]["auth"] == "Bearer sk-test-abcdefghijklmnop123456"
    # the user's branch and working tree are untouched; the fix is a commit on the session branch
    clean_and_on_main(root)
    repo = git.Repo(root)
    assert repo.git.show(f"{ws.branch}:toy/core.py") == "def compute():\n    return 1.0"
    # the trajectory is JSONL with the key redacted
    traj = (ws.state_dir / "trajectory.jsonl").read_text()
    assert "sk-test-abcdefghijklmnop123456" not in traj and all(json.loads(ln) for ln in traj.splitlines())
    assert agent.usage["prompt_tokens"] >= 800


def test_openai_backend_drives_the_bundled_target(tmp_path, monkeypatch):
    """Read a file, run probes, propose a patch the real harness judges on the bundled stack."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-0123456789abcdef")
    monkeypatch.chdir(tmp_path)
    cp = "target_stack/ops/kda/cp.py"
    ws = GitWorkspace.bundled("s2", state=StateDir(tmp_path / "ws"))
    lines = (ws.root / cp).read_text().splitlines()
    no = next(i for i, ln in enumerate(lines, 1) if MERGE in ln)
    diff = (f"--- a/{cp}\n+++ b/{cp}\n@@ -{no},1 +{no},1 @@\n-{lines[no - 1]}\n"
            f"+{lines[no - 1]}  # the chain is an fp32 affine recurrence\n")
    script = [ok(tool_call("read_file", path=cp, start=no - 2, end=no + 2)),
              ok(tool_call("run_probes", ids=["kda.static.dot_precision"])),
              ok(tool_call("propose_patch", hypothesis="document the merge chain", diff=diff)),
              ok(tool_call("finish", summary="ok"))]
    with ScriptedServer(script) as server:
        agent = Agent(OpenAIBackend(model="glm-test", base_url=server.url), ws, "look around",
                      Limits(max_steps=6))
        assert agent.run() == "finished"
        ws.close()
    tool_obs = [m["content"] for m in agent.messages if m["role"] == "tool"]
    assert MERGE in tool_obs[0]
    assert "kda.static.dot_precision: pass" in tool_obs[1]
    (attempt,) = agent.attempts
    judged = {r.probe for r in attempt.report.results}
    assert {"kda.static.dot_precision", "kda.cp.correctness", "kda.cp.merge"} <= judged
    # a comment changes no number: unchanged, discarded; but the gate saw a numerics line
    assert attempt.verdict == "unchanged" and attempt.decision == "discarded"
    assert any("numerics" in r for r in attempt.risk)


def test_offline_backend_fixes_an_injected_tf32_merge_through_the_playbook(tmp_path):
    root = materialize_bundled(tmp_path / "target")
    (root / ".gitignore").write_text(".infra-agent/\n__pycache__/\n")
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add(A=True)
    repo.index.commit("base", author=ACTOR, committer=ACTOR)
    cp = root / "target_stack" / "ops" / "kda" / "cp.py"
    cp.write_text(cp.read_text().replace(MERGE, "tl.dot(b_M, b_h)"))  # the defect, injected by the test
    repo.git.add(A=True)
    repo.index.commit("merge at the default precision", author=ACTOR, committer=ACTOR)
    ws = GitWorkspace.external(root, "s3")
    agent = Agent(OfflineBackend(ws), ws, "fix what the feedback flags", Limits(max_steps=6))
    assert agent.run() == "finished"
    ws.close()
    assert {"kda.static.dot_precision", "kda.cp.merge"} <= {r.probe for r in agent.initial.results if not r.ok}
    (attempt,) = [a for a in agent.attempts if a.playbook == "tf32x3-fp32-dot-chains"]
    assert attempt.verdict == "better"
    assert attempt.decision == "held" and any(r.startswith("numerics") for r in attempt.risk)
    fixed = repo.git.show(f"{attempt.branch}:target_stack/ops/kda/cp.py")
    assert "tl.dot(b_M, b_h, input_precision=MERGE_PRECISION)" in fixed
    assert repo.active_branch.name == "main" and not repo.is_dirty(untracked_files=True)


def test_replay_backend_replays_a_recorded_session(tmp_path, monkeypatch):
    root = make_toy(tmp_path / "toy_target")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-replay-0123456789")
    with ScriptedServer([ok(tool_call("read_file", path="toy/core.py")),
                         ok(tool_call("propose_patch", hypothesis="fix", diff=FIX)),
                         ok(tool_call("finish", summary="done"))]) as server:
        ws = GitWorkspace.external(root, "rec")
        Agent(OpenAIBackend(model="m", base_url=server.url), ws, "g").run()
        ws.close()
    ws2 = GitWorkspace.external(root, "replayed")
    agent = Agent(ReplayBackend(ws.state_dir / "trajectory.jsonl"), ws2, "g")
    assert agent.run() == "finished"
    ws2.close()
    assert [(a.verdict, a.decision) for a in agent.attempts] == [("better", "accepted")]
    assert git.Repo(root).git.show(f"{ws2.branch}:toy/core.py").endswith("return 1.0")


SLOW_PROBE = """
import os, time
from feedback.probe import probe

@probe
def slow(ctx):
    open(os.path.join(ctx.tree, "..", "..", "..", "..", "probe.pid"), "w").write(str(os.getpid()))
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_stops_cleanly_keeps_the_record_and_kills_probes(tmp_path, sig):
    """Ctrl-C, or SIGTERM as ``timeout`` and batch schedulers send it: the probe killed, the session's
    record and summary kept, the summary printed, exit code 130."""
    import signal
    import time

    root = make_toy(tmp_path / "toy_target")
    (root / "toy" / "probes.py").write_text(SLOW_PROBE)
    (root / "infra-agent.yaml").write_text(TOY_MANIFEST.replace('"toy.probes:value"', '"toy.probes:slow"')
                                           .replace("thresholds: {error: {max: 0.01}}", "budget_s: 120"))
    git.Repo(root).git.commit("-qam", "slow probe", author="t <t@t>")
    # a suite started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler: give the session the disposition a terminal gives
    proc = subprocess.Popen([sys.executable, "-m", "infra_agent.cli", "run", "--target", str(root), "--backend",
                             "offline"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_without_keys(), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pid_file = StateDir.for_target(root).root / "probe.pid"
    deadline = time.time() + 60
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert pid_file.exists(), "the probe never started"
    t0 = time.time()
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in out  # the summary printed
    assert time.time() - t0 < 15
    (session,) = list(StateDir.for_target(root).workspaces.glob("*/session.json"))
    summary = json.loads((session.parent / "summary.json").read_text())
    assert summary["outcome"] == "interrupted"
    assert "interrupted" in (session.parent / "trajectory.jsonl").read_text()
    probe_pid = int(pid_file.read_text())
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            state = pathlib.Path(f"/proc/{probe_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the probe process outlived the session")
    assert git.Repo(root).active_branch.name == "main" and not git.Repo(root).is_dirty()


def test_conversation_trimming_keeps_head_and_recent_pairs(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-trim-0123456789")
    be = OpenAIBackend(model="m", base_url="http://127.0.0.1:9/v1", context_chars=3000)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "goal"}]
    for i in range(40):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": "x" * 200})
    kept = be.trim(msgs)
    assert kept[:2] == msgs[:2] and kept[-1] == msgs[-1]
    assert "earlier messages trimmed" in kept[2]["content"] and kept[3]["role"] == "assistant"
    assert len(json.dumps(kept)) < 3600
