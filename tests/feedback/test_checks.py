"""Built-in static checks (feedback/checks.py) and pytest probes (feedback/junit.py), through the runner.

A small external-looking package, written here, with real Triton kernels and real pytest tests:
the checks find each site and bind it to its file, line and kernel; the pytest probe runs the
tree's own tests in a subprocess and binds a failure to the code under test, not the test.
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from feedback.checks import CHECKS, run_check
from feedback.manifest import ManifestError, load_manifest, parse_manifest
from feedback.models import Status
from feedback.runner import Runner

KERNELS = '''
import ctypes
import triton
import triton.language as tl


@triton.jit
def merge(a_ptr, b_ptr, o_ptr, N: tl.constexpr):
    a = tl.load(a_ptr + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :])
    b = tl.load(b_ptr + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :])
    low = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))  # bf16 operands: exact products, not counted
    state = tl.zeros([N, N], dtype=tl.float32) + low
    h = tl.dot(state, b)
    h = tl.dot(h, b, input_precision="ieee")
    for i in range(4):
        h = h / 2.0
    tl.store(o_ptr + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :], h)


def host_scale(x):
    return x / 2.0  # a division outside any kernel: not a finding


LIB = ctypes.PyDLL(None)
'''

CORE = '''
def add(a, b):
    return a + b + (1 if a > 100 else 0)  # wrong past 100


def mean(xs):
    return sum(xs) / len(xs)  # raises on an empty list
'''

TESTS = '''
from pkg.core import add, mean


def test_mean_of_nothing_is_zero():
    assert mean([]) == 0


def test_small():
    assert add(1, 2) == 3


def test_large():
    assert add(200, 1) == 201
'''

MANIFEST = '''
schema_version: 1
name: external
probes:
  - {id: x.dots, kind: static, check: dot_precision, params: {paths: [pkg]}, covers: {files: ["pkg/*.py"]}}
  - {id: x.gil, kind: static, check: gil_native, covers: {files: ["pkg/*.py"]}}
  - {id: x.div, kind: static, check: kernel_loop_division, params: {paths: [pkg/kernels.py]},
     covers: {files: ["pkg/*.py"]}}
  - {id: x.tests, kind: correctness, pytest: ["tests/test_core.py"], covers: {files: ["pkg/*.py"]}}
  - {id: x.small, kind: correctness, pytest: ["tests/test_core.py::test_small"], covers: {files: ["pkg/*.py"]}}
  - {id: x.none, kind: correctness, pytest: ["tests/test_core.py::test_missing"], covers: {files: ["pkg/*.py"]}}
'''


def _line(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


@pytest.fixture
def ext(tmp_path) -> pathlib.Path:
    root = tmp_path / "ext"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "kernels.py").write_text(KERNELS)
    (root / "pkg" / "core.py").write_text(CORE)
    (root / "pkg" / "broken.py").write_text("def f(:\n    return tl.dot(a, b)\n")  # a file that can hold a dot
    (root / "tests" / "test_core.py").write_text(TESTS)
    (root / "infra-agent.yaml").write_text(textwrap.dedent(MANIFEST))
    return root


def test_each_check_finds_its_sites_and_binds_them(ext):
    metric, n, sites = run_check("dot_precision", ext, ["pkg"])
    assert metric == "implicit_precision" and n == 1
    dot = _line(KERNELS, "h = tl.dot(state, b)")
    assert (sites[0].file, sites[0].line, sites[0].symbol) == ("pkg/kernels.py", dot, "merge")
    assert any(s.file == "pkg/broken.py" and "does not parse" in s.message for s in sites)  # a finding, no crash
    # an expression nested past the parser's depth (a generated file) is a finding too, not a crash
    (ext / "pkg" / "generated.py").write_text("y = tl.dot(a, b)" + " + a" * 20000 + "\n")
    deep = run_check("dot_precision", ext, ["pkg"])[2]
    assert any(s.file == "pkg/generated.py" and "nested too deeply" in s.message for s in deep)
    # a file whose text cannot hold a site of the check is not parsed for it (feedback.checks.NEEDLES)
    assert not any(s.file == "pkg/broken.py" for s in run_check("tf32_switch", ext, ["pkg"])[2])
    _, n, sites = run_check("gil_native", ext)
    assert n == 1 and sites[0].line == _line(KERNELS, "PyDLL") and "PyDLL" in sites[0].message
    _, n, sites = run_check("kernel_loop_division", ext, ["pkg/kernels.py"])
    # host_scale's division is not in a kernel: not counted
    assert n == 1 and sites[0].line == _line(KERNELS, "h = h / 2.0") and sites[0].symbol == "merge"
    # a division inside nested loops is one site, not one per loop around it
    nested = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef norm(x, D: tl.constexpr):\n"
              "    for i in range(4):\n        for j in tl.static_range(2):\n            x = tl.sum(x * x) / D\n"
              "    return x\n")
    (ext / "pkg" / "nested.py").write_text(nested)
    _, n, sites = run_check("kernel_loop_division", ext, ["pkg/nested.py"])
    assert n == 1 and [s.line for s in sites] == [9], sites
    assert run_check("dot_precision", ext, ["pkg"], every=True)[1] == 2  # every dot without a precision
    with pytest.raises(ValueError, match="leaves the tree"):
        run_check("dot_precision", ext, ["../elsewhere"])
    assert set(CHECKS) == {"dot_precision", "gil_native", "kernel_loop_division", "argument_order", "tf32_switch",
                           "tf32_dot"}


def test_checks_and_pytest_probes_through_the_runner(ext):
    manifest = load_manifest(ext)
    results = {r.probe: r for r in Runner(ext, manifest, use_cache=False, cache_dir=str(ext.parent / "c"))
               .run(manifest.probes)}
    dots = results["x.dots"]
    assert dots.status == Status.failed and dots.metrics["implicit_precision"].value == 1
    assert dots.findings[0].location.symbol == "merge"
    assert dots.findings[0].location.condition == f"line {_line(KERNELS, 'h = tl.dot(state, b)')}"
    assert results["x.gil"].status == Status.failed and results["x.div"].metrics["loop_divisions"].value == 1

    tests = results["x.tests"]
    assert tests.status == Status.failed, (tests.reason, tests.stderr[-2000:])
    assert {k: tests.metrics[k].value for k in ("tests", "passed", "failed")} == {"tests": 3, "passed": 1,
                                                                                  "failed": 2}
    where = {f.message.split(" failed")[0].rsplit("::", 1)[1]: f.location for f in tests.findings}
    # an exception raised in the code under test is bound to that code, not to the test that noticed
    assert (where["test_mean_of_nothing_is_zero"].file, where["test_mean_of_nothing_is_zero"].symbol) == (
        "pkg/core.py", "mean")
    assert where["test_mean_of_nothing_is_zero"].condition.startswith(f"line {_line(CORE, 'sum(xs)')}")
    # a wrong value seen by an assert is bound to the assert
    assert (where["test_large"].file, where["test_large"].symbol) == ("tests/test_core.py", "test_large")
    assert any("ZeroDivisionError" in f.message for f in tests.findings)
    assert results["x.small"].status == Status.passed
    none = results["x.none"]
    assert none.status == Status.error and "test_missing" in none.reason
    assert not (ext / ".pytest_cache").exists()  # nothing of pytest's own left in the user's tree


def test_the_manifest_says_what_a_probe_needs(tmp_path):
    bad = "schema_version: 1\nname: x\nprobes:\n  - {id: a, kind: static, check: %s}\n"
    with pytest.raises(ManifestError, match="unknown check 'nope'; built in: argument_order, dot_precision"):
        parse_manifest(bad % "nope")
    two = "schema_version: 1\nname: x\nprobes:\n  - {id: a, kind: static, check: gil_native, command: 'true'}\n"
    with pytest.raises(ManifestError, match="exactly one of entry"):
        parse_manifest(two)
    empty = "schema_version: 1\nname: x\nprobes:\n  - {id: a, kind: correctness, pytest: []}\n"
    with pytest.raises(ManifestError, match="at least one node id"):
        parse_manifest(empty)


def _wheel(tmp: pathlib.Path, spec: str) -> pathlib.Path:
    """A published wheel's tree (from the package registry; never copied into this project)."""
    import subprocess
    import sys
    import zipfile

    dl = tmp / f"dl-{spec}"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(dl)],
                          capture_output=True, text=True, timeout=300)
    wheels = sorted(dl.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        pytest.skip(f"the package registry has no {spec} here: {proc.stderr.strip()[-200:]}")
    out = tmp / spec
    zipfile.ZipFile(wheels[0]).extractall(out)
    return out


def test_the_fp32_dots_of_flash_linear_attention_before_and_after_its_cp_fix(tmp_path):
    """fla 0.5.2 left the context-parallel pre-process and merge dots at the default precision;
    0.6.0 states tf32x3 (ieee on NPUs) for them.  The check finds exactly those, and none after."""
    before = _wheel(tmp_path, "fla-core==0.5.2")
    _, n, sites = run_check("dot_precision", before, ["fla/ops/cp"])
    assert n >= 4, sites
    assert {s.file for s in sites} == {"fla/ops/cp/chunk_delta_h.py"}
    assert {s.symbol for s in sites} == {"merge_fwd_bwd_kernel", "pre_process_fwd_kernel_merged",
                                         "pre_process_bwd_kernel_merged"}
    after = _wheel(tmp_path, "fla-core==0.6.0")
    assert run_check("dot_precision", after, ["fla/ops/cp"])[1] == 0


def test_checks_run_from_many_threads_at_once(tmp_path):
    """The runner runs static checks in its own threads; CPython 3.11's AST constructor is not safe for
    concurrent parses interrupted by a collection ("AST constructor recursion depth mismatch"), which
    once made a check error at random: parses are serialised (feedback.checks.parse)."""
    import concurrent.futures as cf

    for i in range(40):
        (tmp_path / f"k{i}.py").write_text(KERNELS)
    with cf.ThreadPoolExecutor(max_workers=8) as pool:
        counts = list(pool.map(lambda _: run_check("dot_precision", tmp_path)[1], range(24)))
    assert counts == [40] * 24


def test_a_pytest_probe_records_what_it_imported_so_its_cache_and_selection_follow_those_files(ext):
    """The tests import pkg/core.py; a probe whose covers name only the test file still sees a change to
    core.py: its cached result no longer holds, and a failing one is selected again for that change.
    A top-level package of the harness's own name in the target does not stop the probe or the recording.
    """
    from feedback.select import select

    (ext / "feedback").mkdir()  # the target's own `feedback` package, first on the probe's path
    (ext / "feedback" / "__init__.py").write_text("raise ImportError('the target's own feedback package')\n")
    (ext / "infra-agent.yaml").write_text("schema_version: 1\nname: x\nprobes:\n"
                                          "  - {id: t, kind: correctness, pytest: [tests/test_core.py], "
                                          "covers: {files: [tests/test_core.py]}}\n")
    manifest = load_manifest(ext)
    runner = Runner(ext, manifest, cache_dir=str(ext.parent / "cache"))
    first = runner.run(manifest.probes)[0]
    assert first.status == Status.failed and {"pkg/core.py", "tests/test_core.py"} <= set(first.imports)
    assert not first.cached and runner.run(manifest.probes)[0].cached
    assert [p.id for p in select(manifest, ["pkg/core.py"], [first])] == ["t"]
    (ext / "pkg" / "core.py").write_text(CORE.replace("sum(xs) / len(xs)", "sum(xs) / max(len(xs), 1)"))
    again = Runner(ext, manifest, cache_dir=str(ext.parent / "cache")).run(manifest.probes)[0]
    assert not again.cached  # core.py changed, though the covers do not name it
    assert again.metrics["failed"].value < first.metrics["failed"].value


def test_a_static_check_over_its_threshold_is_localised_at_every_site_it_counted(ext):
    """A threshold decides a static check's verdict; when the count breaks it, the sites it counted are what
    failed, each at its file and line, beside the bound's own line. Within the bound, nothing is headlined."""
    from feedback.harness import judge

    manifest = ext / "infra-agent.yaml"
    for name, bound in (("x.div_none", 0), ("x.div_one", 1)):  # items of the probes list, as MANIFEST's
        manifest.write_text(manifest.read_text() + (
            f"  - {{id: {name}, kind: static, check: kernel_loop_division, params: {{paths: [pkg/kernels.py]}},\n"
            f"     covers: {{files: ['pkg/*.py']}}, thresholds: {{loop_divisions: {{max: {bound}}}}}}}\n"))
    report = judge(ext, probe_ids=["x.div_none", "x.div_one"], use_cache=False, run_all=True)
    res = {r.probe: r for r in report.results}
    over, within = res["x.div_none"], res["x.div_one"]
    assert over.status == Status.failed and within.status == Status.passed
    assert [f.failed for f in over.findings] == [True, True]  # the site, then the bound
    assert not any(f.failed for f in within.findings) and within.findings  # observed, not failed
    lines = {c.probe: c.localisation for c in report.comparisons}
    site = f"at pkg/kernels.py:{_line(KERNELS, 'h = h / 2.0')} merge"
    assert len(lines["x.div_none"]) == 2 and site in lines["x.div_none"][0], lines
    assert "loop_divisions = 1 violates <= 0" in lines["x.div_none"][1]
    assert lines["x.div_one"] == []


def test_a_virtual_environment_in_the_tree_is_walked_only_when_a_path_names_it(tmp_path):
    # uv and venv keep .venv in the project: thousands of installed files, none of them the target's own
    from feedback.checks import python_files

    for rel in ("pkg/a.py", ".venv/lib/python3.12/site-packages/dep/b.py", "web/node_modules/x/c.py",
                "tools/venv/d.py", ".git/hooks/e.py", "pkg/__pycache__/f.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")

    def rels(paths):
        return [p.relative_to(tmp_path.resolve()).as_posix() for p in python_files(tmp_path, paths)]

    assert rels(None) == ["pkg/a.py"]
    assert rels([".venv/lib/python3.12/site-packages/dep"]) == [".venv/lib/python3.12/site-packages/dep/b.py"]
    assert rels(["tools/venv/d.py", "pkg"]) == ["pkg/a.py", "tools/venv/d.py"]
    assert rels([".git"]) == []  # version control and bytecode never, named or not


def test_a_site_the_baseline_had_too_is_not_headlined_only_the_new_one(ext, tmp_path):
    """A ratchet bound (max: the baseline's count) broken by one new site: beside the baseline's results, the
    sites the baseline had are marked known and the headline names the new one, though every line moved."""
    import shutil

    from feedback.harness import judge

    manifest = ext / "infra-agent.yaml"
    manifest.write_text(manifest.read_text() + (
        "  - {id: x.div_ratchet, kind: static, check: kernel_loop_division, params: {paths: [pkg/kernels.py]},\n"
        "     covers: {files: ['pkg/*.py']}, thresholds: {loop_divisions: {max: 1}}}\n"))
    base = tmp_path / "base"
    shutil.copytree(ext, base)
    # the candidate: two lines above the known site, and a second division in the same loop after it
    loop = "        h = h / 2.0\n"
    (ext / "pkg" / "kernels.py").write_text(KERNELS.replace("import ctypes\n", "import ctypes\nimport os\n\n")
                                            .replace(loop, loop + "        h = h / 3.0\n"))
    report = judge(ext, probe_ids=["x.div_ratchet"], baseline_tree=base, use_cache=False, run_all=True)
    (cand,) = report.results
    (before,) = report.baseline_results
    assert before.status == Status.passed and cand.status == Status.failed
    failed = [f for f in cand.findings if f.failed]
    new_line = _line(KERNELS, "h = h / 2.0") + 3
    assert [f.location.condition for f in failed if f.location.condition] == [f"line {new_line}"], cand.findings
    assert any("violates" in f.message for f in failed)  # the bound's own finding stays failed
    (known,) = [f for f in cand.findings if f.message.endswith("(on the baseline too)")]
    assert known.location.condition == f"line {new_line - 1}" and not known.failed
    (lines,) = [c.localisation for c in report.comparisons if c.probe == "x.div_ratchet"]
    assert f"pkg/kernels.py:{new_line}" in lines[0] and not any(f":{new_line - 1}" in ln for ln in lines), lines
    # without a baseline every counted site is what failed, as before
    alone = judge(ext, probe_ids=["x.div_ratchet"], use_cache=False, run_all=True).results[0]
    assert sum(f.failed for f in alone.findings) == 3


def test_gil_native_follows_the_file_s_import_aliases():
    # every way a module reaches ctypes' GIL-holding loaders is one site; CDLL and cdll release the GIL, and
    # pythonapi (the interpreter's own C API, which must hold it) is no defect
    import ast

    from feedback.checks import gil_native

    src = textwrap.dedent('''
        import ctypes
        import ctypes as C
        from ctypes import CDLL, pydll, pythonapi as api, PyDLL as Loader
        from .compat import PyDLL

        a = ctypes.PyDLL("liba.so")
        b = C.pydll.LoadLibrary("libb.so")
        c = pydll.libc
        d = api.PyCapsule_GetPointer
        e = Loader("libe.so")
        f = CDLL("libf.so")
        g = ctypes.cdll.LoadLibrary("libg.so")
        h = PyDLL("libh.so")


        def run(x):
            return C.CDLL("x").go(x) + ctypes.pydll.LoadLibrary("y").go(x)
    ''')
    sites = list(gil_native(ast.parse(src), "m.py"))
    lines = src.splitlines()
    assert [lines[s.line - 1].split(" = ")[0].strip() for s in sites[:-1]] == list("abceh")
    assert sites[-1].symbol == "run" and sites[-1].message.startswith("ctypes.pydll.LoadLibrary")
    assert all("hold the GIL" in s.message for s in sites) and len(sites) == 6


def test_kernels_are_triton_s_however_imported_and_another_dsl_s_jit_is_not(tmp_path):
    # vLLM re-exports Triton (`from vllm.triton_utils import tl, triton`); CuTe, numba and TorchScript have a
    # `jit` of their own, whose loops and products are not a Triton kernel's
    body = "def {n}(a, b):\n    acc = tl.zeros([16, 16], dtype=tl.float32)\n    for i in range(4):\n" \
           "        acc += tl.dot(acc, b) / 2.0\n    return acc\n"
    files = {
        "reexport.py": "from vllm.triton_utils import tl, triton\n\n\n@triton.jit\n" + body.format(n="k1"),
        "bare.py": "import triton.language as tl\nfrom .jit_utils import jit\n\n\n@jit\n" + body.format(n="k2"),
        "cute.py": "import cutlass.cute as cute\nimport triton.language as tl\n\n\n@cute.jit\n" + body.format(n="h1"),
        "numba.py": "import numba\nimport triton.language as tl\n\n\n@numba.jit\n" + body.format(n="h2"),
        "script.py": "import torch\nimport triton.language as tl\n\n\n@torch.jit.script\n" + body.format(n="h3"),
    }
    for rel, src in files.items():
        (tmp_path / rel).write_text(src)
    for check in ("dot_precision", "kernel_loop_division"):
        _, n, sites = run_check(check, tmp_path)
        found = [(s.file, s.symbol) for s in sites]
        assert sorted({s.symbol for s in sites}) == ["k1", "k2"] and n == 2, (check, found)


def test_the_language_s_name_in_a_module():
    import ast

    from feedback.checks import import_aliases, language_name

    def name(src: str):
        return language_name(import_aliases(ast.parse(src)))

    assert name("import triton.language as tl\n") == "tl"
    assert name("import triton\nimport triton.language as T\n") == "T"
    assert name("from vllm.triton_utils import tl, triton\n") == "tl"
    assert name("import triton\n") == "triton.language"
    assert name("from triton.language import dot\n") is None


def test_tf32_switch_finds_each_statement_that_puts_fp32_matmuls_on_tf32(tmp_path):
    # a torch-level state merge after one of these loses what a kernel's input_precision keeps; the values that
    # keep fp32 are not counted, a value the source does not state is
    (tmp_path / "m.py").write_text(textwrap.dedent("""\
        import torch
        import torch.backends.cuda as cb
        from torch.backends.cuda import matmul

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = False
        matmul.allow_tf32 = args.tf32
        cb.matmul.fp32_precision = "tf32"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.set_float32_matmul_precision("high")
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = True  # convolutions: not a matmul


        def serve(precision):
            torch.set_float32_matmul_precision(precision)
        """))
    metric, n, sites = run_check("tf32_switch", tmp_path)
    assert metric == "tf32_switches" and n == 5
    assert [(s.line, s.symbol) for s in sites] == [(5, None), (7, None), (8, None), (10, None), (16, "serve")]
    assert "torch.backends.cuda.matmul.allow_tf32 = args.tf32" in sites[1].message
    assert all("tf32 tensor cores" in s.message for s in sites)


def test_a_whole_tree_check_keeps_each_files_digest_and_parses_only_what_changed(tmp_path, monkeypatch):
    """argument_order reads every file together; with a store (the runner's state folder) a second run parses
    nothing that is unchanged, and a changed file alone, with the same sites as a run without the store."""
    import feedback.checks as checks

    tree = tmp_path / "t"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "attn.py").write_text("def attend(q, k, v):\n    return q @ k @ v\n")
    (tree / "pkg" / "use.py").write_text("from pkg.attn import attend\n\n\ndef run(q, k, v):\n"
                                         "    return attend(k, q, v)\n")
    for i in range(20):
        (tree / "pkg" / f"other{i}.py").write_text(f"def g{i}(a, b):\n    return a + b\n")
    store = checks.DigestStore(tmp_path / "state" / "digests")
    plain = run_check("argument_order", tree)
    assert plain[1] >= 1 and run_check("argument_order", tree, store=store) == plain
    parsed: list[str] = []
    real = checks.parse
    monkeypatch.setattr(checks, "parse", lambda source, rel: parsed.append(rel) or real(source, rel))
    assert run_check("argument_order", tree, store=store) == plain and parsed == []
    (tree / "pkg" / "use.py").write_text((tree / "pkg" / "use.py").read_text().replace("attend(k, q, v)",
                                                                                       "attend(q, k, v)"))
    assert run_check("argument_order", tree, store=store)[1] == 0 and parsed == ["pkg/use.py"]
    # a digest cut short by a kill is made again, not trusted
    for kept in (tmp_path / "state" / "digests").rglob("*.pickle"):
        kept.write_bytes(kept.read_bytes()[:10])
    parsed.clear()
    assert run_check("argument_order", tree, store=store)[1] == 0 and len(parsed) == 22


def test_the_sites_a_manifest_tolerates_are_reported_not_counted_and_a_new_copy_still_counts(ext):
    # `init` lists each site the tree has as tolerated (file: symbol: message): a site added later is told apart
    # by name, though an edit above moves every line; a tolerated entry that matches nothing any more is named
    from feedback.sites import tolerated_key

    _, _, sites = run_check("kernel_loop_division", ext, ["pkg/kernels.py"])
    (site,) = sites
    keys = [tolerated_key(site.file, site.symbol, site.message), "pkg/kernels.py: gone: division in the kernel's "
                                                                 "loop: a / b"]
    manifest_text = textwrap.dedent(MANIFEST).replace(
        "params: {paths: [pkg/kernels.py]},", f"params: {{paths: [pkg/kernels.py], tolerated: {keys!r}}},")
    (ext / "infra-agent.yaml").write_text(manifest_text)

    def judged():
        manifest = load_manifest(ext)
        return Runner(ext, manifest, use_cache=False).run([manifest.probe("x.div")])[0]

    first = judged()
    assert first.status == Status.passed and first.metrics["loop_divisions"].value == 0
    assert [f.failed for f in first.findings] == [False, False]
    assert first.findings[0].message.endswith("(tolerated in the manifest)")
    assert first.findings[1].message.startswith("1 site(s) the manifest tolerates are no longer found")
    # lines moved down by an edit above, and a second copy of the same division: the copy is new
    kernels = (ext / "pkg" / "kernels.py").read_text()
    (ext / "pkg" / "kernels.py").write_text("# a comment\n" + kernels.replace(
        "        h = h / 2.0\n", "        h = h / 2.0\n        h = h / 2.0\n", 1))
    second = judged()
    assert second.status == Status.failed and second.metrics["loop_divisions"].value == 1
    assert [f.failed for f in second.findings][:2] == [True, False], second.findings
    with pytest.raises(ManifestError, match="params.tolerated must be a list"):
        (ext / "infra-agent.yaml").write_text(manifest_text.replace(f"tolerated: {keys!r}", "tolerated: 3"))
        load_manifest(ext)


def test_a_file_that_no_longer_parses_fails_the_check_and_one_tolerated_by_the_manifest_does_not(ext):
    # flash-attention: a commit that broke a kernel file's syntax (`output,,` in a launch) passed every static
    # check, each now blind to that file; the parse error was a finding nobody saw
    from feedback.sites import tolerated_key

    manifest_text = textwrap.dedent(MANIFEST).replace("params: {paths: [pkg/kernels.py]},", "params: {paths: [pkg]},")

    def judged(text):
        (ext / "infra-agent.yaml").write_text(text)
        manifest = load_manifest(ext)
        return Runner(ext, manifest, use_cache=False).run([manifest.probe("x.div")])[0]

    (ext / "pkg" / "broken.py").unlink()
    assert judged(manifest_text).metrics["loop_divisions"].value == 1
    kernels = (ext / "pkg" / "kernels.py").read_text()
    (ext / "pkg" / "kernels.py").write_text(kernels.replace("h = tl.dot(h, b, input_precision=\"ieee\")",
                                                            "h = tl.dot(h, b,, input_precision=\"ieee\")"))
    broke = judged(manifest_text)
    assert broke.status == Status.failed and broke.metrics["loop_divisions"].value == 0  # blind to the file
    (head,) = [f for f in broke.findings if f.failed]
    assert head.location.file == "pkg/kernels.py" and head.message.startswith("does not parse")
    assert head.location.condition == f"line {_line(KERNELS, 'h = tl.dot(h, b, input')}"
    # a file that did not parse when `init` ran is tolerated by name, like any site the tree had then
    key = tolerated_key("pkg/kernels.py", None, head.message)
    held = judged(manifest_text.replace("params: {paths: [pkg]},", f"params: {{paths: [pkg], tolerated: [{key!r}]}},"))
    assert held.status == Status.passed and not any(f.failed for f in held.findings)
    assert held.findings[0].message.endswith("(tolerated in the manifest)")



def test_a_division_in_place_in_a_kernel_loop_is_a_site_and_one_outside_any_loop_is_not():
    import ast

    from feedback.checks import kernel_loop_division

    src = textwrap.dedent('''
        import triton


        @triton.jit
        def k(x, N):
            acc = x
            acc /= 7.0
            for i in range(N):
                acc /= 3.0
            while N > 0:
                acc = triton.language.fdiv(acc, 2.0)
    ''')
    sites = list(kernel_loop_division(ast.parse(src), "k.py"))
    assert [s.message.split(": ", 1)[1] for s in sites] == ["acc /= 3.0", "triton.language.fdiv(acc, 2.0)"]


def test_a_parameter_added_to_a_callee_leaves_its_tolerated_calls_tolerated(tmp_path):
    # flash-attention: `num_stages: int = 1` appended to a cute helper's declaration made the calls `init` had
    # tolerated (in another order on purpose) new, and the check failed; its swaps are what identify a site
    from feedback.sites import split_tolerated, tolerated_key

    (tmp_path / "pkg").mkdir()
    calls = "\n\n\ndef f(a, b, out):\n    return gemm(a, b, out)\n\n\ndef t(a, b, out):\n    return gemm(b, a, out)\n"
    (tmp_path / "pkg" / "g.py").write_text("def gemm(a, b, out):\n    return out" + calls)
    _, n, sites = run_check("argument_order", tmp_path, ["pkg"])
    keys = [tolerated_key(s.file, s.symbol, s.message) for s in sites[:n]]
    assert n == 1 and "declares (...)" in keys[0] and "`b` as parameter 1" in keys[0]
    (tmp_path / "pkg" / "g.py").write_text("def gemm(a, b, out, num_stages=1):\n    return out" + calls)
    _, n, sites = run_check("argument_order", tmp_path, ["pkg"])
    new, kept, stale = split_tolerated(sites[:n], keys)
    assert (len(new), len(kept), stale) == (0, 1, [])
    # an entry written with the whole declaration (a manifest from before) reads the same
    old = [keys[0].replace("declares (...)", "declares (a, b, out)")]
    assert split_tolerated(sites[:n], old)[:2] == ([], sites[:n])
    # a second call swapped the same way is new
    (tmp_path / "pkg" / "g.py").write_text((tmp_path / "pkg" / "g.py").read_text() + "    gemm(b, a, out)\n")
    _, n, sites = run_check("argument_order", tmp_path, ["pkg"])
    assert len(split_tolerated(sites[:n], keys)[0]) == 1


def test_a_copy_of_a_tolerated_site_added_above_it_fails_where_it_was_added(ext, tmp_path):
    # flash-attention: a third `dx / (1.0 - dropout_p)` added at layer_norm.py:606 failed the check at the
    # untouched copy at :619 (the manifest tolerates two, by name; the runner fails whichever comes last)
    import shutil

    from feedback.harness import judge
    from feedback.sites import tolerated_key

    _, _, (site,) = run_check("kernel_loop_division", ext, ["pkg/kernels.py"])
    key = tolerated_key(site.file, site.symbol, site.message)
    manifest = ext / "infra-agent.yaml"
    manifest.write_text(manifest.read_text().replace(
        "params: {paths: [pkg/kernels.py]},", f"params: {{paths: [pkg/kernels.py], tolerated: [{key!r}]}},"))
    base = tmp_path / "base"
    shutil.copytree(ext, base)
    above = "    state = tl.zeros"
    (ext / "pkg" / "kernels.py").write_text(KERNELS.replace(above, "    h = low\n    for j in range(2):\n"
                                                                   "        h = h / 2.0\n" + above))
    added = _line(KERNELS, above.strip()) + 2
    old = _line(KERNELS, "h = h / 2.0") + 3
    alone = judge(ext, probe_ids=["x.div"], use_cache=False).results[0]
    assert [f.location.condition for f in alone.findings if f.failed] == [f"line {old}"]  # by count: the last
    report = judge(ext, probe_ids=["x.div"], baseline_tree=base, use_cache=False)
    (cand,) = report.results
    assert cand.status == Status.failed
    assert [f.location.condition for f in cand.findings if f.failed] == [f"line {added}"], cand.findings
    (kept,) = [f for f in cand.findings if not f.failed]
    assert kept.location.condition == f"line {old}" and kept.message.endswith("(tolerated in the manifest)")


def test_tf32_dot_finds_a_dot_that_states_tf32_and_not_one_that_keeps_fp32_or_is_narrower():
    # FlagGems (`allow_tf32=False` turned True in its matmul) and FlagAttention (`input_precision="tf32"` on an
    # fp32 dot) passed every static check: a dot that states its precision was taken as a dot that keeps fp32
    import ast

    from feedback.checks import tf32_dot

    src = textwrap.dedent('''
        import triton
        import triton.language as tl


        @triton.jit
        def mm(a_ptr, b_ptr, N: tl.constexpr):
            a = tl.load(a_ptr)
            b = tl.load(b_ptr)
            x = tl.dot(a, b, allow_tf32=True)
            y = tl.dot(a, b, allow_tf32=False)
            z = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
            w = tl.dot(a, b, input_precision="tf32x3")
            v = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), input_precision="tf32")
    ''')
    sites = list(tf32_dot(ast.parse(src), "k.py"))
    lines = src.splitlines()
    assert [lines[s.line - 1].split(" = ")[0].strip() for s in sites] == ["x", "z"], sites
    assert all(s.symbol == "mm" and "tf32 tensor cores, as stated" in s.message for s in sites)
