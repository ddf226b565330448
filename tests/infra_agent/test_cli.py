"""The ``infra-agent`` command line in real subprocesses: run, sessions, feedback, manifest."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import git
import pytest

from feedback.targets import materialize_bundled
from tests.support.toy_agent import env_without_keys, make_toy
from tests.support.toy_harness import TOY_MANIFEST

# the installed console script of the interpreter running the tests (found even when its venv is not activated)
INFRA_AGENT = shutil.which("infra-agent", path=str(pathlib.Path(sys.executable).parent)) or "infra-agent"


def test_run_cli_offline_on_a_clean_target_and_sessions(tmp_path):
    root = make_toy(tmp_path / "toy_target")
    (root / "toy" / "core.py").write_text("def compute():\n    return 1.0\n")
    git.Repo(root).git.commit("-qam", "correct", author="t <t@t>")
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "run", "--target", str(root), "--backend",
                          "offline", "--json"], capture_output=True, text=True, env=env_without_keys())
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["outcome"] == "finished" and summary["failing_after"] == [] and summary["backend"] == "offline"
    # the JSON is stdout; the progress, one line per probe as it ends, is stderr
    assert "judging baseline" in out.stderr and "step 1 finish" in out.stderr, out.stderr
    assert any(line.split("] ", 1)[-1].startswith("  baseline ") and "pass" in line for line in out.stderr.splitlines())
    listed = subprocess.run([sys.executable, "-m", "infra_agent.cli", "sessions", "list", "--target", str(root),
                             "--json"], capture_output=True, text=True, env=env_without_keys())
    (session,) = json.loads(listed.stdout)
    assert session["session"] == summary["session"] and session["summary"]["outcome"] == "finished"
    bad = subprocess.run([sys.executable, "-m", "infra_agent.cli", "run", "--target", str(tmp_path),
                          "--backend", "offline"], capture_output=True, text=True, env=env_without_keys())
    assert bad.returncode == 2 and "infra-agent.yaml" in bad.stderr
    clean = subprocess.run([sys.executable, "-m", "infra_agent.cli", "sessions", "clean", "--target", str(root)],
                           capture_output=True, text=True, env=env_without_keys())
    assert "removed 1 session" in clean.stdout
    assert [h.name for h in git.Repo(root).heads] == ["main"]


def test_manifest_cli_schema_and_check(toy, tmp_path):
    out = subprocess.run([INFRA_AGENT, "manifest", "schema"], capture_output=True, text=True, check=True)
    schema = json.loads(out.stdout)
    assert "probes" in schema["properties"] and "ProbeSpec" in schema["$defs"]
    ok = subprocess.run([INFRA_AGENT, "manifest", "check", str(toy)], capture_output=True, text=True)
    assert ok.returncode == 0 and "11 probes" in ok.stdout
    (toy / "infra-agent.yaml").write_text(TOY_MANIFEST.replace("budget_s: 2,", "budget_s: zero,"))
    bad = subprocess.run([INFRA_AGENT, "manifest", "check", str(toy)], capture_output=True, text=True)
    assert bad.returncode == 2 and "toy.hangs" not in bad.stderr and "budget_s" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1  # one clear line


def test_feedback_cli_exit_codes_and_json(toy, tmp_path):
    ok = subprocess.run([INFRA_AGENT, "feedback", "--target", str(toy), "--probe", "toy.ok", "--json"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["results"][0]["status"] == "pass" and data["schema_version"] == 1
    assert "toy/probes.py" in data["hashes"] and "infra-agent.yaml" in data["hashes"]
    # not a terminal: one plain line per probe on stderr as it ends (a log cut short says how far it got)
    lines = ok.stderr.splitlines()
    assert lines[0] == "running 1 probes: toy.ok", ok.stderr
    assert re.fullmatch(r"\[ *\d+\.\ds\] candidate toy\.ok: pass \(\d+\.\d s\)", lines[1]), ok.stderr
    failing = subprocess.run([INFRA_AGENT, "feedback", "--target", str(toy), "--probe", "toy.located"],
                             capture_output=True, text=True)
    assert failing.returncode == 1 and "error grows 41x" in failing.stdout
    unknown = subprocess.run([INFRA_AGENT, "feedback", "--target", str(toy), "--probe", "nope"],
                             capture_output=True, text=True)
    assert unknown.returncode == 2 and "known: toy.static" in unknown.stderr
    broken = tmp_path / "broken.diff"
    broken.write_text("not a diff")
    bad_diff = subprocess.run([INFRA_AGENT, "feedback", "--target", str(toy), "--diff", str(broken)],
                              capture_output=True, text=True)
    assert bad_diff.returncode == 2 and "not a unified diff" in bad_diff.stderr
    bad_rev = subprocess.run([INFRA_AGENT, "feedback", "--target", str(toy), "--changed-from", "nope~3"],
                             capture_output=True, text=True)
    assert bad_rev.returncode == 2 and "unknown revision" in bad_rev.stderr


def test_feedback_cli_changed_from_catches_an_implicit_tf32_merge(tmp_path):
    """The real bundled target in a git repo: one line changed in the CP merge kernel."""
    tree = materialize_bundled(tmp_path / "ts")
    repo = git.Repo.init(tree)
    repo.git.add(A=True)
    repo.index.commit("base", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    cp = tree / "target_stack" / "ops" / "kda" / "cp.py"
    cp.write_text(cp.read_text().replace("tl.dot(b_M, b_h, input_precision=MERGE_PRECISION)", "tl.dot(b_M, b_h)"))
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "feedback", "--target", str(tree),
                          "--changed-from", "HEAD", "--json"], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    data = json.loads(out.stdout)
    assert data["stopped_at"] == "static" and data["baseline"] == "HEAD"
    assert data["comparisons"][0]["baseline"] == "pass" and data["comparisons"][0]["candidate"] == "fail"
    assert any("target_stack/ops/kda/cp.py:" in line and "_kda_cp_merge_kernel" in line
               for c in data["comparisons"] for line in c["localisation"])


# a whole scenario, then its re-validation on the merged tree: on an H100 with the GPU probes compiling their
# kernels, longer than `.ci/gpu`'s per-test limit (300 s; 2026-12-07); its subprocesses have limits of their own
@pytest.mark.timeout(1500)
def test_run_a_scenario_offline_then_approve_its_held_fix(tmp_path):
    """The founding GIL case from a clean checkout: the offline session finds the starved transfer
    thread through the events probe, the fix is held as concurrency, the summary says the scenario's
    acceptance holds on the held candidate, and approving it merges and re-validates on the merged tree."""
    env = env_without_keys()
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "run", "--scenario", "gil-kv-transfer", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=1200, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    sc = summary["scenario"]
    assert sc["name"] == "gil-kv-transfer" and sc["solved"].startswith("held for review"), sc
    # the start fails on the cause, read directly (the GIL sampler sat out the native calls); the stall
    # ratio is its symptom, which a loaded 2-core machine can hide on the start (0.10 once), so only the
    # acceptance as a whole must fail there. On the held fix every criterion holds.
    branch = {c["expr"].split(" ")[0]: c["branch_holds"] for c in sc["acceptance"]}
    assert branch["engine.kv_transfer.events.gil_blocked_fraction"] is False, sc
    assert all(c["held_holds"] for c in sc["acceptance"]), sc
    assert [a["playbook"] for a in summary["attempts"]] == ["release-gil-native-calls"]
    (item,) = sc["review_items"]
    approve = subprocess.run([sys.executable, "-m", "infra_agent.cli", "review", "approve", str(item), "--reviewer",
                              "dana", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=1200, env=env)
    assert approve.returncode == 0, approve.stdout[-2000:] + approve.stderr[-2000:]
    settled = json.loads(approve.stdout[approve.stdout.index("{"):])
    assert settled["state"] == "applied" and settled["settled_by"] == "dana", settled
