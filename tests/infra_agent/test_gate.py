"""The risk gate on real diffs: every category's rules with true and false positives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from feedback.manifest import parse_manifest
from feedback.targets import materialize_bundled
from infra_agent.gate import assess, assess_text
from infra_agent.patch import Patch

MANIFEST = parse_manifest("""
schema_version: 1
name: m
probes: [{id: p, kind: static, entry: "m.p:f"}]
risk: [{id: m.kv, category: concurrency, paths: ["engine/*"], pattern: "kv_transfer"}]
protected: [m/p.py, tests/**]
""")


def diff(path: str, old: str, new: str) -> str:
    return f"--- a/{path}\n+++ b/{path}\n@@ -1,1 +1,1 @@\n-{old}\n+{new}\n"


TRUE_POSITIVES = [
    ("numerics", "k.py", "y = x", "y = x.to(torch.bfloat16)"),
    ("numerics", "k.py", "acc = tl.dot(a, b)", "acc = tl.dot(a, b, input_precision='tf32')"),
    ("numerics", "norm.py", "eps = 1e-6", "eps = 1e-5"),
    ("numerics", "q.py", "w = w_q", "w = w_q * scales[:, None]"),
    ("numerics", "r.py", "s = a + b + c", "s = (a + b).sum() + c"),
    ("numerics", "t.py", "x = 1", "torch.backends.cuda.matmul.allow_tf32 = True"),
    ("concurrency", "s.py", "run()", "threading.Thread(target=run).start()"),
    ("concurrency", "s.py", "x += 1", "with self.lock.acquire():"),
    ("concurrency", "native.c", "compute(buf);", "Py_BEGIN_ALLOW_THREADS compute(buf); Py_END_ALLOW_THREADS"),
    ("concurrency", "ext.py", "lib = ctypes.CDLL(p)", "lib = ctypes.PyDLL(p)"),
    ("concurrency", "a.py", "def f():", "async def f():"),
    ("concurrency", "g.py", "y = f(x)", "torch.cuda.synchronize()"),
    ("concurrency", "engine/transfer.py", "pass", "kv_transfer.submit(req)"),
    ("production", "serve.py", "    pass", "    max_num_seqs = 512"),
    ("production", "server.py", "x = 1", "timeout_s: float = 5.0"),
    ("production", "Dockerfile", "FROM python:3.11", "FROM python:3.12"),
]
FALSE_POSITIVES = [
    ("k.py", "# the sum of parts", "# the total of parts"),
    ("doc.md", "we scale out", "we grow"),
    ("names.py", "x_float = 1", "x_float = 2"),
    ("util.py", "def area(r):", "def area(radius):"),
    ("log.py", 'print("done")', 'print("finished")'),
]


@pytest.mark.parametrize("category,path,old,new", TRUE_POSITIVES)
def test_each_category_flags_real_risky_changes(category, path, old, new):
    result = assess(Patch.parse(diff(path, old, new)), MANIFEST)
    assert category in result.categories, (result.findings, category)
    assert result.decision == "held"
    f = next(f for f in result.findings if f.category == category)
    assert f.file == path and f.line == 1


@pytest.mark.parametrize("path,old,new", FALSE_POSITIVES)
def test_harmless_changes_are_clean(path, old, new):
    result = assess(Patch.parse(diff(path, old, new)), MANIFEST)
    assert result.decision == "clean", result.findings


def test_protected_paths_are_refused_outright():
    result = assess(Patch.parse(diff("m/p.py", "a", "b")), MANIFEST)
    assert result.decision == "refused" and "m/p.py is protected (m/p.py)" in result.refused
    assert assess(Patch.parse(diff("tests/test_x.py", "a", "b")), MANIFEST).decision == "refused"


def test_a_classifier_error_counts_as_high_risk(tmp_path):
    # the AST step needs the diff to apply to the tree; here it cannot (the file is absent)
    result = assess(Patch.parse(diff("k.py", "acc = 1", "acc = 2")), MANIFEST, tree=tmp_path)
    assert result.decision == "error" and result.held and "does not apply" in result.error
    assert assess_text("not a diff", MANIFEST).decision == "error"


def test_ast_checks_find_multiline_calls_on_added_lines(tmp_path):
    (tmp_path / "k.py").write_text("def f(a, b):\n    return a\n")
    d = ("--- a/k.py\n+++ b/k.py\n@@ -1,2 +1,4 @@\n def f(a, b):\n-    return a\n"
         "+    return tl.dot(a,\n+                  b,\n+                  out_dtype=o)\n")
    result = assess(Patch.parse(d), MANIFEST, tree=tmp_path)
    rules = {f.rule for f in result.findings}
    assert "ast.call:tl.dot" in rules and "ast.kwarg:out_dtype" in rules


def test_gate_cli_exit_codes_on_the_bundled_target(tmp_path):
    tree = materialize_bundled(tmp_path / "ts")
    cp = "target_stack/ops/kda/cp.py"
    line = next(ln for ln in (tree / cp).read_text().splitlines() if "tl.dot(b_M" in ln)
    no = (tree / cp).read_text().splitlines().index(line) + 1
    held = tmp_path / "held.diff"
    tf32 = line.replace("MERGE_PRECISION", "'tf32'")
    held.write_text(f"--- a/{cp}\n+++ b/{cp}\n@@ -{no},1 +{no},1 @@\n-{line}\n+{tf32}\n")
    clean = tmp_path / "clean.diff"
    readme_line = (tree / cp).read_text().splitlines()[0]
    clean.write_text(f"--- a/{cp}\n+++ b/{cp}\n@@ -1,1 +1,1 @@\n-{readme_line}\n+{readme_line} \n")
    refused = tmp_path / "refused.diff"
    refused.write_text("--- a/target_stack/ops/kda/naive.py\n+++ b/target_stack/ops/kda/naive.py\n"
                       "@@ -1,1 +1,1 @@\n-x\n+y\n")
    run = lambda f: subprocess.run([sys.executable, "-m", "infra_agent.cli", "gate", str(f), "--target", str(tree),  # noqa: E731
                                    "--json"], capture_output=True, text=True)
    h = run(held)
    assert h.returncode == 1 and "numerics" in {f["category"] for f in json.loads(h.stdout)["findings"]}
    c = run(clean)
    assert c.returncode == 0, c.stdout
    r = run(refused)
    assert r.returncode == 2 and "protected" in json.loads(r.stdout)["refused"]


def test_gate_cli_on_a_repository_without_a_manifest_and_with_one_kept_outside(tmp_path):
    import git

    repo = tmp_path / "fork"
    (repo / "engine").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "engine" / "step.py").write_text("def step(x):\n    return x\n")
    (repo / "tests" / "test_step.py").write_text("def test_step():\n    assert True\n")
    g = git.Repo.init(repo)
    g.git.add(A=True)
    g.git.commit("-qm", "start", author="t <t@t>")
    (repo / "engine" / "step.py").write_text("import threading\n\n\ndef step(x):\n    return x\n")
    held = tmp_path / "held.diff"
    held.write_text(g.git.diff() + "\n")
    g.git.checkout("--", ".")
    (repo / "tests" / "test_step.py").write_text("def test_step():\n    assert 1\n")
    tests_diff = tmp_path / "tests.diff"
    tests_diff.write_text(g.git.diff() + "\n")
    g.git.checkout("--", ".")
    outside = tmp_path / "judges" / "infra-agent.yaml"
    outside.parent.mkdir()
    outside.write_text("schema_version: 1\nname: fork\nprobes: []\nprotected: [tests/**]\n")

    def run(f, *extra):
        return subprocess.run([sys.executable, "-m", "infra_agent.cli", "gate", str(f), "--target", str(repo),
                               "--json", *extra], capture_output=True, text=True)

    h = run(held)  # no manifest anywhere: the built-in rules, and a note that says so
    assert h.returncode == 1 and "concurrency" in {f["category"] for f in json.loads(h.stdout)["findings"]}
    assert "no infra-agent.yaml" in h.stderr and "built-in rules only" in h.stderr
    assert run(tests_diff).returncode == 0  # nothing protects the tests without a manifest
    r = run(tests_diff, "--manifest", str(outside))
    assert r.returncode == 2 and "protected" in json.loads(r.stdout)["refused"] and "note" not in r.stderr
    missing = run(held, "--manifest", str(tmp_path / "nowhere.yaml"))
    assert missing.returncode == 2 and "no such manifest file" in missing.stderr
