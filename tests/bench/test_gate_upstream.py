"""bench/gate_upstream.py on a real git repository laid out as the mirrors are: each commit is judged
against its parent's files, outcomes are counted per label, and an absent repository is listed."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import git
import yaml

from tests.support.toy_agent import env_without_keys


def _commit(repo: git.Repo, path: str, text: str, message: str) -> str:
    pathlib.Path(repo.working_dir, path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(repo.working_dir, path).write_text(text)
    repo.git.add(A=True)
    repo.git.commit("-qm", message, author="t <t@t>")
    return repo.head.commit.hexsha


def test_commits_are_judged_against_their_parents_and_counted(tmp_path):
    work = git.Repo.init(tmp_path / "mirrors" / "acme+engine")
    _commit(work, "engine/step.py", "import threading\n\n\ndef step(x):\n    return x\n", "start")
    risky = _commit(work, "engine/step.py", "import threading\n\n\ndef step(x):\n    return x.float()\n", "cast")
    missed = _commit(work, "engine/step.py", "import threading\n\n\ndef step(x):\n    return x.float()\n\n\n"
                                             "def bump(y):\n    return y + 1\n", "off")
    clean = _commit(work, "README.md", "# engine\n", "docs")
    corpus = [dict(repo="acme/engine", sha=risky, categories=["numerics"]),
              dict(repo="acme/engine", sha=missed, categories=["numerics"], hard=True),
              dict(repo="acme/engine", sha=clean, categories=[]),
              dict(repo="nobody/absent", sha="0" * 40, categories=[])]
    (tmp_path / "corpus.yaml").write_text(yaml.safe_dump(corpus))
    out = subprocess.run([sys.executable, "bench/gate_upstream.py", "--corpus", str(tmp_path / "corpus.yaml"),
                          "--mirrors", str(tmp_path / "mirrors"), "--json", str(tmp_path / "g.json")],
                         capture_output=True, text=True, env=env_without_keys())
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "g.json").read_text())
    rows = {r["sha"]: r for r in got["rows"]}
    assert rows[risky]["outcome"] == "held right" and "numerics" in rows[risky]["categories"]
    assert rows[missed]["outcome"] == "MISSED" and rows[missed]["hard"]  # `+ 1` names no risk: the gate's blind spot
    assert rows[clean]["outcome"] == "clean"
    t = got["totals"]
    assert (t["risky"], t["held"], t["clean"], t["clean_passed"]) == (2, 1, 1, 1)
    assert t["missed"] == [f"acme/engine@{missed[:10]}"] and t["unreachable"] == ["nobody/absent"]
    assert "risky commits held: 1 of 2" in out.stdout
