"""A harness killed outright (kill -9) takes its probe processes and their children with it."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.support.processes import alive

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBES = '''
import os, subprocess, sys, time
from feedback.probe import probe

@probe
def sleeper(ctx):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(ctx.tree, "pids.python"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
'''

MANIFEST = '''
schema_version: 1
name: sleepers
probes:
  - {id: s.python, kind: correctness, entry: "sl.probes:sleeper", budget_s: 600, covers: {files: ["sl/probes.py"]}}
  - id: s.command
    kind: correctness
    command: "sleep 600 & echo $$ $! > pids.command; wait"
    budget_s: 600
    covers: {files: ["sl/probes.py"]}
'''




@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_kill_9_of_the_harness_leaves_no_probe_process_behind(tmp_path):
    target = tmp_path / "t"
    (target / "sl").mkdir(parents=True)
    (target / "sl" / "__init__.py").write_text("")
    (target / "sl" / "probes.py").write_text(PROBES)
    (target / "infra-agent.yaml").write_text(MANIFEST)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    harness = subprocess.Popen([sys.executable, "-m", "infra_agent.cli", "feedback", "--target", str(target), "--all",
                                "--no-cache", "-j", "2"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.monotonic() + 60
        files = [target / "pids.python", target / "pids.command"]
        while time.monotonic() < deadline and not all(f.is_file() and f.read_text().strip() for f in files):
            assert harness.poll() is None, "the harness ended before its probes started"
            time.sleep(0.2)
        pids = [int(p) for f in files for p in f.read_text().split()]
        assert len(pids) == 4 and all(alive(p) for p in pids), pids
        harness.send_signal(signal.SIGKILL)
        harness.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], "probe processes outlived the harness"
    finally:
        harness.kill()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
