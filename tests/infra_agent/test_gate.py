"""The risk gate on real diffs: every category's rules with true and false positives."""

from __future__ import annotations

import json
import os
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
    # what the words of a line rarely say: attention metadata, launch shapes, device code, sampling, paths
    ("numerics", "runner.py", "kv_len = seqlen", "kv_len = seqlen - cached"),
    ("numerics", "k.py", "NUM_STAGES = (2, 3)", "NUM_STAGES = (2,)"),
    ("numerics", "kern.cuh", "acc = a * b;", "acc = a * b + c;"),
    ("numerics", "s.py", "logits.div_(t)", "logits.div_(t.unsqueeze(-1))"),
    ("numerics", "fi.py", "x = Wrapper(ws)", "x = Wrapper(ws, use_tensor_cores=True)"),
    ("concurrency", "r.py", "n = t.shape[0]", "n = int(t.sum().item())"),
    ("concurrency", "m.py", "x = 1", "dist.all_reduce(t, op=dist.ReduceOp.MIN)"),
    ("concurrency", "epi.cuh", "store(tile);", "store(tile); cute::tma_store_wait<0>();"),
    ("concurrency", "jit.cpp", "compile(k);", "FileLock guard(path); compile(k);"),
    ("concurrency", "b.py", "if page.full:", "if page.full and page.is_ready:"),
    ("concurrency", "w.py", "group = None", "group = new_expert_group(n)"),
    ("production", "utils.py", "SIZE = 1", "SIZE = int(os.getenv('CACHE_SIZE', '4'))"),
    ("production", "heur.hpp", "return true;", 'return get_env<int>("MIN_SMS", 1) != 0;'),
    ("production", "metrics.py", "self.q = queue.Queue(maxsize=1024)", "self.q = queue.Queue(maxsize=4096)"),
    ("concurrency", "gen.py", "x = 0", "time.sleep(0)"),
    ("concurrency", "rpc.h", "Status start(int port);", "Status start(int port, size_t threads = 1);"),
    ("concurrency", "pod.yaml", "mountPath: /data", "mountPath: /dev/shm"),
    ("numerics", "store.py", "chunks = split(kv_tensors, n)", "chunks = split(kv_tensors[:, :, 1:], n)"),
    ("production", "requirements.txt", "httpx==0.27.0", "httpx==0.28.1"),
    # masking sentinels and non-finite values, on the host as much as in a kernel
    ("numerics", "attn.py", "mask = torch.full((n, n), float('-inf'))", "mask = torch.full((n, n), -1e4)"),
    ("numerics", "attn.py", "bias = torch.zeros(n)", "bias = torch.full((n,), -1e30)"),
    ("numerics", "attn.py", "s = s.masked_fill(~m, 0)", "s = s.masked_fill(~m, torch.finfo(s.dtype).min)"),
    ("numerics", "sample.py", "p = probs", "p = torch.where(torch.isnan(probs), 0, probs)"),
    ("numerics", "k.cuh", "float m = -1e30f;", "float m = -INFINITY;"),
    # a softmax scale named as attention code names it (FlagAttention's host code)
    ("numerics", "flash.py", "sm_scale = 1. / math.sqrt(D)", "sm_scale = 1. / D"),
    ("numerics", "attn.py", "o = attn(q, k, v)", "o = attn(q, k, v, softmax_scale=0.1)"),
]
FALSE_POSITIVES = [
    ("k.py", "# the sum of parts", "# the total of parts"),
    ("doc.md", "we scale out", "we grow"),
    ("names.py", "x_float = 1", "x_float = 2"),
    ("util.py", "def area(r):", "def area(radius):"),
    ("log.py", 'print("done")', 'print("finished")'),
    # comments and layout: the code is the same
    ("kern.cuh", "// accumulate in fp32", "// accumulate in fp32 registers, then scale"),
    ("k.py", "x = f(a)  # the eps", "x = f(a)  # the epsilon, 1e-6"),
    ("gemm.cu", "\tfoo(a, b);", "    foo(a,  b);"),
    ("guard.cuh", "", "#pragma once"),
    ("run.py", "if use_tqdm:", "if use_tqdm and verbose:"),
    ("requirements.txt", "# pinned for CI", "# pinned for the CI job"),
    ("pyproject.toml", "line-length = 100", "line-length = 120"),
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
    # an upstream commit that changes a kernel and its tests: refused for the tests, and what the rest would
    # need a reviewer for is still said (the protected files' own lines are not classified)
    both = assess(Patch.parse(diff("k.py", "y = x", "y = x.to(torch.bfloat16)")
                              + diff("tests/test_x.py", "y = x", "y = x.to(torch.float16)")
                              + diff("tests/test_y.py", "a", "b")), MANIFEST)
    assert both.decision == "refused" and both.categories == ["numerics"]
    assert {f.file for f in both.findings} == {"k.py"}
    assert "tests/test_x.py is protected (tests/**); tests/test_y.py is protected (tests/**)" in both.refused


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


def test_ast_calls_are_named_through_the_file_s_imports():
    # `from threading import Thread`, `import ctypes as C`, `import triton.language as T`: the calls they make
    # are the same risky calls as threading.Thread, ctypes.PyDLL and tl.dot; a local `Thread` is not
    from infra_agent.gate import ast_findings

    src = ("from threading import Thread\nimport ctypes as C\nimport triton.language as T\n\n\n"
           "def go(a, b, f):\n    Thread(target=f).start()\n    lib = C.PyDLL('x.so')\n    return T.dot(a, b)\n")
    rules = {(f.rule, f.category) for f in ast_findings("m.py", src, {7, 8, 9})}
    assert rules == {("ast.call:threading.Thread", "concurrency"), ("ast.call:ctypes.PyDLL", "concurrency"),
                     ("ast.call:tl.dot", "numerics")}, rules
    local = "class Thread:\n    pass\n\n\ndef go(f):\n    return Thread()\n"
    assert ast_findings("m.py", local, {6}) == []


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
    # a patch that is refused and does not apply (already applied): the text names both, not only the refusal
    (repo / "tests" / "test_step.py").write_text("def test_step():\n    assert 1\n")
    plain = subprocess.run([sys.executable, "-m", "infra_agent.cli", "gate", str(tests_diff), "--target", str(repo),
                            "--manifest", str(outside)], capture_output=True, text=True, env={**os.environ,
                                                                                             "COLUMNS": "200"})
    assert plain.returncode == 2 and "refused (and the rest could not be classified)" in plain.stdout, plain.stdout
    assert "is protected" in plain.stdout and "does not apply" in plain.stdout, plain.stdout


KERNEL_FILE = """import triton
import triton.language as tl
from ops import kernels as ops
from ops.kernels import _mul


@triton.jit
def _add(x, y, out, N: tl.constexpr):
    \"\"\"out = x + y; eps is 1e-6 nowhere.\"\"\"
    o = tl.arange(0, N)
    z = tl.load(x + o) + tl.load(y + o)
    tl.store(out + o, z)


def host(a, b):
    z = a + b
    return z


def launch(a, b, out, n):
    _add[(1,)](a, b, out, n)
    _mul[(n // 64,)](a, b, out, 64)
    ops.scale[(n,)](out, 2.0)
    handlers = {"copy": host}
    return handlers["copy"](a, b)


class Pool:
    window = 4

    def take(self, n, spill: bool = True):
        with self._lock:
            got = self._free[:n]
            del self._free[:n]
        return got


CHUNK = 64
"""


def _judge_edit(tmp_path, old: str, new: str):
    """The gate's findings on one edit of KERNEL_FILE, made by git, with the tree for the AST checks."""
    import git as gitpython

    repo = tmp_path / "t"
    repo.mkdir()
    (repo / "k.py").write_text(KERNEL_FILE)
    g = gitpython.Repo.init(repo)
    g.git.add(A=True)
    g.git.commit("-qm", "k", author="t <t@t>")
    assert KERNEL_FILE.count(old) == 1, old
    (repo / "k.py").write_text(KERNEL_FILE.replace(old, new))
    d = g.git.diff() + "\n"
    g.git.checkout("--", ".")
    return assess(Patch.parse(d), MANIFEST, tree=repo)


@pytest.mark.parametrize("old,new,rule,category", [
    # inside a kernel every code line is numerics, its stores concurrency too; the same edit outside is not
    ("z = tl.load(x + o) + tl.load(y + o)", "z = tl.load(x + o) - tl.load(y + o)", "ast.kernel-body", "numerics"),
    ("tl.store(out + o, z)", "tl.store(out + o, z, mask=o < N - 1)", "ast.kernel-writes", "concurrency"),
    ("tl.store(out + o, z)", "tl.atomic_add(out + o, z)", "ast.kernel-writes", "concurrency"),
    ("tl.store(out + o, z)", "language.store(out + o, z)", "ast.kernel-writes", "concurrency"),
    # a kernel's launch: its arguments' order, its grid and compile-time constants, a kernel defined here,
    # imported, or reached through an imported module
    ("_add[(1,)](a, b, out, n)", "_add[(1,)](b, a, out, n)", "ast.kernel-launch", "numerics"),
    # torchao's launches through torch.library: wrap_triton(kernel)[grid](...)
    ("_add[(1,)](a, b, out, n)", "torch.library.wrap_triton(_add)[(1,)](b, a, out, n)", "ast.kernel-launch",
     "numerics"),
    ("_mul[(n // 64,)](a, b, out, 64)", "_mul[(n // 32,)](a, b, out, 32)", "ast.kernel-launch", "numerics"),
    ("ops.scale[(n,)](out, 2.0)", "ops.scale[(n,)](out,\n                    0.5)", "ast.kernel-launch",
     "numerics"),
    # a line moved out of a lock's block
    ("            del self._free[:n]\n        return got", "            del self._free[:n]\n            return got",
     "ast.locked-region", "concurrency"),
    # a setting's value changed, whatever its name: a parameter default, a class field, a module constant
    ("spill: bool = True", "spill: bool = False", "ast.default-changed", "production"),
    ("    window = 4", "    window = 8", "ast.default-changed", "production"),
    ("CHUNK = 64", "CHUNK = 128", "ast.default-changed", "production"),
])
def test_where_a_line_lies_is_a_risk_whatever_its_words(tmp_path, old, new, rule, category):
    result = _judge_edit(tmp_path, old, new)
    assert any(f.rule == rule and f.category == category for f in result.findings), result.findings


@pytest.mark.parametrize("old,new", [
    ("    z = a + b\n    return z", "    z = a - b\n    return z"),  # the same arithmetic edit, on the host
    ("out = x + y; eps is 1e-6 nowhere.", "out = x + y; eps is 1e-5 nowhere."),  # a kernel's docstring
    ("def take(self, n, spill: bool = True):", "def take(self, n, spill: bool = True, note=None):"),  # a new knob
    ('return handlers["copy"](a, b)', 'return handlers["copy"](b, a)'),  # a subscripted local is no kernel
])
def test_edits_outside_kernels_locks_and_settings_are_clean(tmp_path, old, new):
    result = _judge_edit(tmp_path, old, new)
    assert result.decision == "clean", [f.render() for f in result.findings]


def test_a_moved_launch_argument_is_shown_on_both_sides_each_numbered_and_marked_as_its_side(tmp_path):
    # lightllm's planted swap, fixed by moving one argument line: the removed line is numbered as the file was
    # and says so, the added one as the file is now; a reviewer sees both texts, never one twice unmarked
    from infra_agent.gate import by_line

    moved = _judge_edit(tmp_path, "_add[(1,)](a, b, out, n)", "_add[(1,)](b, a, out, n)")
    launch = [f for f in moved.findings if f.rule == "ast.kernel-launch"]
    assert [(f.removed, f.text.strip()) for f in launch] == [(False, "_add[(1,)](b, a, out, n)"),
                                                             (True, "_add[(1,)](a, b, out, n)")], launch
    at = KERNEL_FILE.splitlines().index("    _add[(1,)](a, b, out, n)") + 1
    assert by_line(moved.findings) == [f"k.py:{at} numerics (ast.kernel-launch): _add[(1,)](b, a, out, n)",
                                       f"k.py:{at} (removed) numerics (ast.kernel-launch): _add[(1,)](a, b, out, n)"]
    assert launch[1].render().startswith(f"numerics: ast.kernel-launch at k.py:{at} (removed): ")


def test_a_rename_or_a_mode_change_is_refused_for_what_it_is_not_an_error_about_a_missing_file(tmp_path):
    # flash-attention: moving a protected test into the package with a one-line edit was an error ("does not
    # apply: ... No such file"), not a refusal; a pure rename or a mode change was "not a unified diff"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import pytest\n")
    moved = ("diff --git a/tests/test_x.py b/pkg/_x.py\nsimilarity index 90%\nrename from tests/test_x.py\n"
             "rename to pkg/_x.py\n--- a/tests/test_x.py\n+++ b/pkg/_x.py\n@@ -1 +1 @@\n-import pytest\n"
             "+import pytest  # moved\n")
    result = assess_text(moved, MANIFEST, tree=tmp_path)
    assert result.decision == "refused" and not result.error
    assert "tests/test_x.py is protected (tests/**) and the patch removes or moves it" in result.refused
    renamed = "diff --git a/pkg/a.py b/pkg/b.py\nsimilarity index 100%\nrename from pkg/a.py\nrename to pkg/b.py\n"
    mode = "diff --git a/pkg/a.py b/pkg/a.py\nold mode 100644\nnew mode 100755\n"
    for diff, header in ((renamed, "'rename from'"), (mode, "'old mode'")):
        result = assess_text(diff, MANIFEST, tree=tmp_path)
        assert result.decision == "refused" and header in result.refused and not result.error
