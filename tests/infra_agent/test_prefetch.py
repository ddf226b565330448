"""``infra-agent run --parallel N`` (infra_agent/prefetch.py): a target with two independent defects,
each fixed by its own playbook. Judged ahead together, the session decides exactly as a sequential one
(the same attempts, verdicts and decisions) and the second candidate's probes come from the cache."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import git

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def chain(a_ptr, o_ptr, N: tl.constexpr):
    h = tl.zeros([N, N], dtype=tl.float32)
    a = tl.load(a_ptr + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]).to(tl.float32)
    for _ in range(4):
        h = tl.dot(a, h) + a
    tl.store(o_ptr + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :], h)
'''

NATIVE = '''
import ctypes

LIB = ctypes.PyDLL(None)  # its calls keep the GIL for their whole duration
'''

SLOW_TEST = '''
import time


def test_the_package_imports():
    time.sleep(2)  # a test that takes a while: what judging ahead saves
    import pkg.native  # noqa: F401
'''

MANIFEST = '''
schema_version: 1
name: two-defects
probes:
  - {id: s.dots, kind: correctness, check: dot_precision, params: {paths: [pkg]}, covers: {files: ["pkg/*.py"]}}
  - {id: s.gil, kind: correctness, check: gil_native, params: {paths: [pkg]}, covers: {files: ["pkg/*.py"]}}
  - {id: t.imports, kind: correctness, pytest: ["tests/test_pkg.py"], covers: {files: ["pkg/*.py"]}}
protected: ["tests/**"]
'''


def _repo(root: pathlib.Path) -> pathlib.Path:
    for rel, text in {"pkg/__init__.py": "", "pkg/kernels.py": KERNEL, "pkg/native.py": NATIVE,
                      "tests/test_pkg.py": SLOW_TEST, "infra-agent.yaml": MANIFEST}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add(A=True)
    repo.index.commit("two defects", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    return root


def _run(root: pathlib.Path, cwd: pathlib.Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "ZAI_API_KEY")}
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "run", "--target", str(root), "--backend",
                          "offline", "--json", *extra], cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode in (0, 1), out.stderr[-3000:]
    return json.loads(out.stdout)


def _decisions(summary: dict) -> list[tuple]:
    return [(a["playbook"], a["verdict"], a["decision"]) for a in summary["attempts"]]


def test_judging_ahead_decides_as_a_sequential_session_does(tmp_path):
    sequential = _run(_repo(tmp_path / "one"), tmp_path)
    together = _run(_repo(tmp_path / "two"), tmp_path, "--parallel", "2")
    assert _decisions(together) == _decisions(sequential)
    assert {p for p, _, _ in _decisions(together)} == {"tf32x3-fp32-dot-chains", "release-gil-native-calls"}
    assert all(v == "better" and d == "held" for _, v, d in _decisions(together))  # numerics, concurrency
    assert together["failing_before"] == sequential["failing_before"] == ["s.dots", "s.gil"]
    # judged ahead: when the loop proposed them, every candidate's probes came from the cache
    from feedback.state import StateDir
    from infra_agent.experiments import load_record

    def cached(root: pathlib.Path) -> list[bool]:
        records = sorted(StateDir.for_target(root).experiments.glob("exp-*.yaml"))
        return [p.result.cached for r in map(load_record, records) for p in r.probes if p.id == "t.imports"]

    assert cached(tmp_path / "two") == [True, True]
    assert cached(tmp_path / "one") == [False, False]


def test_several_patches_in_one_model_reply_are_judged_together_then_taken_one_per_step(tmp_path):
    """The real ``openai`` client, one reply with two ``propose_patch`` calls (a wrong fix, then the right
    one): with ``parallel=2`` both candidates are judged together before the first is decided; the loop
    then takes them one per step (no second request), each answered by its own tool message, and the
    second's probe comes from the cache."""
    from infra_agent.agent import Agent, Limits
    from infra_agent.backends.openai_backend import OpenAIBackend
    from infra_agent.workspace import GitWorkspace
    from tests.support.chat import ScriptedServer, completion, ok
    from tests.support.toy_agent import FIX, make_toy

    root = make_toy(tmp_path / "toy_target")
    wrong = FIX.replace("return 1.0", "return 2.0")
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "propose_patch", "arguments": json.dumps({"hypothesis": h, "diff": d})}}
             for i, (h, d) in enumerate([("off by -0.5", wrong), ("off by 0.5", FIX)])]
    script = [ok(completion({"role": "assistant", "content": "two guesses", "tool_calls": calls}))]
    events = []
    os.environ.setdefault("OPENAI_API_KEY", "sk-test-prefetch-0123456789")
    with ScriptedServer(script) as server:  # then "finish" (the server's answer once its script is spent)
        ws = GitWorkspace.external(root, "together")
        agent = Agent(OpenAIBackend(model="m", base_url=server.url, max_retries=0), ws, "make the probe pass",
                      Limits(max_steps=6, parallel=2), on_event=lambda kind, data: events.append((kind, data)))
        assert agent.run() == "finished"
        ws.close()
        requests = len(server.requests)
    assert requests == 2  # the reply with both calls, then the one that finished
    ahead = [d["what"] for k, d in events if k == "judging" and "ahead" in str(d.get("what"))]
    assert ahead == ["2 candidates ahead, together"], ahead
    assert [(a.step, a.decision) for a in agent.attempts] == [(1, "discarded"), (2, "accepted")]
    said = [(m["role"], m.get("tool_call_id") or [c["id"] for c in m.get("tool_calls") or []])
            for m in agent.messages if m["role"] in ("assistant", "tool")]
    assert said[:4] == [("assistant", ["call_0"]), ("tool", "call_0"), ("assistant", ["call_1"]), ("tool", "call_1")]
    second = agent.attempts[1].report  # judged ahead: its probe's result was waiting in the cache
    assert second.results and all(r.cached for r in second.results), [(r.probe, r.cached) for r in second.results]
