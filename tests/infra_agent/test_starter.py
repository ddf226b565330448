"""``infra-agent init`` on a repository nobody here wrote: the starter manifest validates, names the
kernels' own tests as pytest probes, protects tests and references, and ``feedback`` runs it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import git
import yaml

from infra_agent.starter import inspect, starter_manifest

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, o_ptr, s, N: tl.constexpr):
    offs = tl.arange(0, N)
    acc = tl.zeros([N], dtype=tl.float32)
    for _ in range(2):
        acc += tl.load(x_ptr + offs).to(tl.float32) / s
    tl.store(o_ptr + offs, acc)


def scale(x, s):
    return x * (2.0 / s)
'''

NAIVE = ("def scale_ref(x, s):\n    return x * (2.0 / s)\n\n\n"
         "def scale_back(x, s):\n    return scale_ref(s, x)  # today's code, as the starter finds it\n")
TEST_KERNEL = '''
from mylib.ops.scale import scale
from mylib.ops.naive import scale_ref


def test_scale():
    assert scale(3.0, 2.0) == scale_ref(3.0, 2.0)
'''
TEST_BROAD = "import mylib\n\n\ndef test_import():\n    assert mylib\n"


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _repo(root: pathlib.Path) -> pathlib.Path:
    files = {"src/mylib/__init__.py": "", "src/mylib/ops/__init__.py": "", "src/mylib/ops/scale.py": KERNEL,
             "src/mylib/ops/naive.py": NAIVE, "tests/test_scale.py": TEST_KERNEL, "tests/test_pkg.py": TEST_BROAD,
             "benchmarks/__init__.py": "", "benchmarks/bench_scale.py": "print('{}')\n",
             "pyproject.toml": "[project]\nname = 'mylib'\n",
             "src/mylib/serve.py": "import torch\n\n\ndef start():\n    torch.set_float32_matmul_precision('high')\n"}
    _write(root, files)
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add(A=True)
    repo.index.commit("mylib", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    return root


def _cli(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra_agent.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "COLUMNS": "160"})


def test_inspect_finds_the_layout_the_kernels_and_their_tests(tmp_path):
    inv = inspect(_repo(tmp_path / "mylib"))
    assert inv.import_root == "src" and inv.packages == ["src/mylib"]
    assert inv.kernels == {"src/mylib/ops/scale.py": ["scale_kernel"]}
    assert inv.kernel_tests == {"tests/test_scale.py": ["src/mylib/ops/scale.py"]}  # `import mylib` says nothing
    assert inv.references == ["src/mylib/ops/naive.py"] and inv.bench_files == ["benchmarks/bench_scale.py"]


def test_init_writes_a_manifest_that_checks_and_runs(tmp_path):
    root = _repo(tmp_path / "mylib")
    out = _cli("init", str(root), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pytest probe" in out.stdout and "infra-agent manifest check" in out.stdout
    text = (root / "infra-agent.yaml").read_text()
    data = yaml.safe_load(text)
    assert data["python_path"] == ["src"]
    probes = {p["id"]: p for p in data["probes"]}
    assert probes["tests.scale"]["pytest"] == ["tests/test_scale.py"]
    assert probes["tests.scale"]["covers"]["files"] == ["src/mylib/ops/scale.py"]
    assert {"tests/**", "src/mylib/ops/naive.py", "infra-agent.yaml"} <= set(data["protected"])
    assert "benchmarks/bench_scale.py" in text and "tests/test_pkg.py" in text  # listed for the user, as comments
    assert "git ignores" not in out.stdout
    again = _cli("init", str(root), cwd=tmp_path)
    assert again.returncode == 2 and "--force overwrites it" in again.stderr
    # a repository that ignores every .yaml (native-sparse-attention's .gitignore): the user is told
    (root / ".gitignore").write_text("# configs\n*.yaml\n")
    ignored = _cli("init", str(root), "--force", cwd=tmp_path)
    assert "note: git ignores" in ignored.stdout and ".gitignore:2: *.yaml" in ignored.stdout, ignored.stdout
    (root / ".gitignore").unlink()
    check = _cli("manifest", "check", str(root), cwd=tmp_path)
    assert check.returncode == 0 and "warning" not in check.stderr, check.stderr
    fb = _cli("feedback", "--target", str(root), "--all", "--json", "--no-cache", cwd=tmp_path)
    report = json.loads(fb.stdout)
    results = {r["probe"]: r for r in report["results"]}
    assert results["tests.scale"]["status"] == "pass", results["tests.scale"]
    assert results["static.dot_precision"]["status"] == "pass"  # no tl.dot at all
    # today's sites (the division in the kernel's loop, the call and definition of the swapped names, the tf32
    # switch) are listed as tolerated: reported, not counted; the starter holds the line, it does not fail
    for probe, metric, n in (("static.kernel_loop_division", "loop_divisions", 1),
                             ("static.argument_order", "misplaced_arguments", 2),
                             ("static.tf32_switch", "tf32_switches", 1)):
        assert len(probes[probe]["params"]["tolerated"]) == n and "thresholds" not in probes[probe]
        assert results[probe]["status"] == "pass" and results[probe]["metrics"][metric]["value"] == 0
        assert [f["message"].endswith("(tolerated in the manifest)") for f in results[probe]["findings"]] == [True] * n
    assert "src/mylib/ops/naive.py: scale_back: call of `scale_ref`" in probes["static.argument_order"]["params"][
        "tolerated"][1], probes["static.argument_order"]["params"]["tolerated"]


def test_manifest_check_names_what_the_manifest_points_at_that_is_missing(tmp_path):
    root = _repo(tmp_path / "mylib")
    (root / "infra-agent.yaml").write_text(
        "schema_version: 1\nname: m\nprobes:\n"
        "  - {id: a, kind: correctness, pytest: [tests/test_gone.py], covers: {files: ['src/nothing/*.py']}}\n"
        "  - {id: b, kind: static, check: gil_native, params: {paths: [lib]}}\n")
    out = _cli("manifest", "check", str(root), cwd=tmp_path)
    assert out.returncode == 0 and "2 probes" in out.stdout
    for expected in ("a: covers.files 'src/nothing/*.py' matches no file", "a: pytest 'tests/test_gone.py': no such",
                     "b: check path 'lib' does not exist"):
        assert expected in out.stderr, out.stderr
    outside = tmp_path / "judges" / "m.yaml"
    outside.parent.mkdir()
    outside.write_text("schema_version: 1\nname: outside\nprobes: []\n")
    out = _cli("manifest", "check", str(root), "--manifest", str(outside), cwd=tmp_path)
    assert out.returncode == 0 and "outside, 0 probes" in out.stdout


def test_a_manifest_outside_the_tree_judges_it_and_nothing_is_written_in_it(tmp_path):
    root = _repo(tmp_path / "mylib")
    judges = tmp_path / "judges" / "mylib.yaml"
    out = _cli("init", str(root), "--manifest", str(judges), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert judges.is_file() and not (root / "infra-agent.yaml").exists()
    assert f"--manifest {judges}" in out.stdout.replace("\n", "")
    (root / "src" / "mylib" / "ops" / "naive.py").write_text("def scale_ref(x, s):\n    return x * (3.0 / s)\n")
    fb = _cli("feedback", "--target", str(root), "--manifest", str(judges), "--probe", "tests.scale", "--json",
              cwd=tmp_path)
    report = json.loads(fb.stdout)
    (res,) = report["results"]
    assert fb.returncode == 1 and res["status"] == "fail"  # the reference changed: the test fails, localised
    assert "test_scale failed" in res["findings"][0]["message"]
    assert git.Repo(root).git.status("--porcelain", "--ignored") == " M src/mylib/ops/naive.py"  # nothing of ours
    missing = _cli("feedback", "--target", str(root), "--manifest", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_inspect_finds_packages_where_the_packaging_puts_them(tmp_path):
    # SGLang's layout: the package under python/, declared in pyproject.toml, a namespace package (no
    # __init__.py); and the same folder undeclared, where the one folder holding packages is taken
    declared = tmp_path / "declared"
    files = {"pyproject.toml": "[project]\nname = 'eng'\n[tool.setuptools.packages.find]\nwhere = ['python']\n",
             "python/eng/ops/scale.py": KERNEL, "python/eng/serve.py": "x = 1\n", "tests/test_scale.py":
             "from eng.ops.scale import scale\n\n\ndef test_scale():\n    assert scale(2.0, 2.0) == 2.0\n",
             "benchmark/run.py": "print('{}')\n"}
    _write(declared, files)
    inv = inspect(declared)
    assert inv.import_root == "python" and inv.packages == ["python/eng"]
    assert inv.kernels == {"python/eng/ops/scale.py": ["scale_kernel"]}
    assert inv.kernel_tests == {"tests/test_scale.py": ["python/eng/ops/scale.py"]}
    undeclared = tmp_path / "undeclared"
    for rel in ("python/eng/__init__.py", "python/eng/core.py", "docs/conf.py"):
        (undeclared / rel).parent.mkdir(parents=True, exist_ok=True)
        (undeclared / rel).write_text("x = 1\n")
    assert (inspect(undeclared).import_root, inspect(undeclared).packages) == ("python", ["python/eng"])


def test_a_test_of_a_wrapper_covers_the_kernel_files_the_wrapper_imports(tmp_path):
    # mamba's layout: the test imports a module with no kernel (`combined`), which imports the forward and
    # backward kernel files, one relatively and one absolutely, and a layer two hops away imports them all
    kernel = KERNEL.replace("scale_kernel", "{name}_kernel")
    files = {"pkg/__init__.py": "", "pkg/ops/__init__.py": "",
             **{f"pkg/ops/k{i}.py": kernel.format(name=f"k{i}") for i in range(8)},
             "pkg/ops/combined.py": "import torch\nfrom .k0 import scale as _k0\n"
                                    "from pkg.ops.k1 import (\n    scale as bwd,  # the backward\n)\n\n\n"
                                    "def fwd(x):\n    return _k0(x)\n",
             "pkg/layer.py": "from pkg.ops import combined\n" + "".join(f"from pkg.ops.k{i} import scale\n"
                                                                        for i in range(2, 8)),
             "tests/test_combined.py": "from pkg.ops.combined import fwd\n\n\ndef test_fwd():\n    assert fwd\n",
             "tests/test_layer.py": "import pkg.layer\n\n\ndef test_layer():\n    assert pkg.layer\n",
             "tests/test_other.py": "import os\n\n\ndef test_os():\n    assert os\n",
             "tests/test_k5.py": "from pkg.ops.k5 import scale\n\n\ndef test_k5():\n    assert scale\n"}
    _write(tmp_path, files)
    inv = inspect(tmp_path)
    assert len(inv.kernel_files) == 8
    assert inv.kernel_tests["tests/test_combined.py"] == ["pkg/ops/k0.py", "pkg/ops/k1.py"]
    # the layer reaches all eight kernel files in one hop: more than a test of a few kernels names
    assert "tests/test_layer.py" not in inv.kernel_tests and "tests/test_other.py" not in inv.kernel_tests
    # a kernel's own test comes before a test that reaches kernels through another module
    assert inv.direct_tests == {"tests/test_k5.py": ["pkg/ops/k5.py"]}
    one = yaml.safe_load(starter_manifest(inv, max_tests=1))
    assert [p["pytest"] for p in one["probes"] if "pytest" in p] == [["tests/test_k5.py"]]
    both = yaml.safe_load(starter_manifest(inv, max_tests=2))
    combined = next(p for p in both["probes"] if p.get("pytest") == ["tests/test_combined.py"])
    assert combined["covers"]["files"] == ["pkg/ops/k0.py", "pkg/ops/k1.py"]


def test_imports_are_read_from_the_text_with_relative_names_resolved():
    from infra_agent.starter import _source_imports

    source = ("import a.b as ab, c\nfrom . import sib\nfrom ..up import (x,\n    y)  # two\n"
              "    from .deep.er import z; w = 1\nfrom .... import too_far\n")
    assert _source_imports(source, "pkg.sub.mod", is_package=False) == {
        "a.b", "c", "pkg.sub", "pkg.sub.sib", "pkg.up", "pkg.up.x", "pkg.up.y", "pkg.sub.deep.er",
        "pkg.sub.deep.er.z"}
    # in a package's __init__, `.` is the package itself
    assert _source_imports("from .k import f\n", "pkg.ops", is_package=True) == {"pkg.ops.k", "pkg.ops.k.f"}
    # a name re-exported under another name (FlagAttention: `attention as flash_attention`) is followed
    renamed: dict[str, str] = {}
    _source_imports("from .flash import attention as flash_attention, x\n", "fa", True, renamed)
    assert renamed == {"flash_attention": "fa.flash.attention"}


def test_a_name_the_package_re_exports_reaches_its_own_kernel_and_the_main_suite_wins_ties(tmp_path):
    # Liger-Kernel's layout: `from pkg.ops import NormFn`, where pkg/ops/__init__.py re-exports every kernel
    # module's function (the package itself names all of them: too broad); a backend's parity test of the same
    # kernel beside the main suite; a test that imports a package this machine lacks
    kernel = KERNEL.replace("scale_kernel", "{name}_kernel")
    files = {"pkg/__init__.py": "",
             "pkg/ops/__init__.py": "".join(f"from .k{i} import scale as s{i}\n" for i in range(7))
             + "from pkg.ops.norm import NormFn\nfrom .act import (\n    ActFn,\n)\n",
             **{f"pkg/ops/k{i}.py": kernel.format(name=f"k{i}") for i in range(7)},
             "pkg/ops/norm.py": kernel.format(name="norm") + "\n\nclass NormFn:\n    pass\n",
             "pkg/ops/act.py": kernel.format(name="act") + "\n\nclass ActFn:\n    pass\n",
             "tests/main/__init__.py": "",
             "tests/main/test_norm.py": "from pkg.ops import NormFn\n\n\ndef test_norm():\n    assert NormFn\n",
             "tests/main/test_act.py": "import a_package_absent_here\nfrom pkg.ops import ActFn\n\n\n"
                                       "def test_act():\n    assert ActFn and a_package_absent_here\n",
             "tests/main/test_k0.py": "from pkg.ops.k0 import scale\n\n\ndef test_k0():\n    assert scale\n",
             "tests/backend/test_norm.py": "from pkg.ops import NormFn\n\n\ndef test_parity():\n    assert NormFn\n",
             "tests/backend/test_act.py": "from pkg.ops import ActFn\n\n\ndef test_parity():\n    assert ActFn\n"}
    _write(tmp_path, files)
    inv = inspect(tmp_path)
    assert inv.kernel_tests["tests/main/test_norm.py"] == ["pkg/ops/norm.py"]
    assert inv.direct_tests["tests/main/test_norm.py"] == ["pkg/ops/norm.py"]  # through the re-export: its own
    assert inv.kernel_tests["tests/backend/test_act.py"] == ["pkg/ops/act.py"]  # a parenthesised re-export
    assert inv.test_needs["tests/main/test_act.py"] == ["a_package_absent_here"]
    chosen = [p["pytest"][0] for p in yaml.safe_load(starter_manifest(inv))["probes"] if "pytest" in p]
    # one test per kernel: the main suite's where both can run here, the one this machine can import otherwise
    assert sorted(chosen) == ["tests/backend/test_act.py", "tests/main/test_k0.py", "tests/main/test_norm.py"]


def test_a_file_named_like_a_reference_is_protected_only_where_the_kernels_or_their_tests_use_it(tmp_path):
    # lightllm's server/embed_cache/impl/naive_memory_cache.py is the server's only cache, not a reference: a
    # patch to it must not be refused; a reference model a kernel's test imports, or a naive.py beside the
    # kernels, is one
    files = {"pkg/__init__.py": "", "pkg/ops/__init__.py": "", "pkg/ops/scale.py": KERNEL,
             "pkg/ops/naive.py": NAIVE.replace("mylib", "pkg"), "pkg/server/__init__.py": "",
             "pkg/server/naive_memory_cache.py": "class Cache:\n    pass\n",
             "pkg/models/__init__.py": "", "pkg/models/ref_model.py": "def forward(x):\n    return x\n",
             "tests/test_model.py": "from pkg.models.ref_model import forward\nfrom pkg.ops.scale import scale\n\n\n"
                                    "def test_f():\n    assert forward(1) and scale\n",
             # a production module with tests of its own (torchao's reference_representation_rewrite), which
             # also reach a kernel
             "pkg/models/reference_rewrite.py": "def rewrite(g):\n    return g\n",
             "tests/test_reference_rewrite.py": "from pkg.models.reference_rewrite import rewrite\n"
                                                "from pkg.ops.scale import scale\n\n\n"
                                                "def test_r():\n    assert rewrite(1) and scale\n"}
    _write(tmp_path, files)
    inv = inspect(tmp_path)
    assert inv.references == ["pkg/models/ref_model.py", "pkg/ops/naive.py"]
    protected = yaml.safe_load(starter_manifest(inv))["protected"]
    assert "pkg/server/naive_memory_cache.py" not in protected and "pkg/ops/naive.py" in protected


def test_init_names_what_a_conftest_needs_and_the_probes_say_skipped_not_failed(tmp_path):
    # Liger-Kernel: test/conftest.py imports test.utils, which imports transformers; pytest stops before collecting
    # anything.  init says so up front; the feedback skips (not fails) with the package named
    root = _repo(tmp_path / "mylib")
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "helpers.py").write_text("import os\nimport a_model_hub_not_installed_here\n")
    (root / "tests" / "conftest.py").write_text(
        "import pytest\n\nfrom tests.helpers import os\n\ntry:\n    import an_optional_extra_not_installed\n"
        "except ImportError:\n    pass\n")
    out = _cli("init", str(root), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    said = " ".join(out.stdout.split())
    assert "tests/conftest.py needs a_model_hub_not_installed_here" in said, out.stdout
    assert "an_optional_extra" not in said  # imported under try: optional
    assert "# not installed here: a_model_hub_not_installed_here, which tests/conftest.py needs" in \
        (root / "infra-agent.yaml").read_text()
    fb = _cli("feedback", "--target", str(root), "--probe", "tests.scale", "--json", "--no-cache", cwd=tmp_path)
    result = json.loads(fb.stdout)["results"][0]
    assert result["status"] == "skipped" and result["absent"] == ["a_model_hub_not_installed_here"], result


def test_tests_inside_the_package_are_protected_by_name_not_by_protecting_the_package(tmp_path):
    # torchao keeps torchao/prototype/.../fp8_dynamic_tensorwise_test.py inside its package: `torchao/**` would
    # refuse every patch to the code under test
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/ops.py": "def f():\n    return 1\n",
                      "pkg/sub/__init__.py": "", "pkg/sub/fp8_test.py": "def test_f():\n    pass\n",
                      "tests/test_a.py": "def test_a():\n    pass\n", "tests/helpers.py": "",
                      "scripts/test_tool.py": "def test_t():\n    pass\n", "test_root.py": "def test_r():\n    pass\n"})
    protected = yaml.safe_load(starter_manifest(inspect(tmp_path)))["protected"]
    assert [p for p in protected if p not in ("**/conftest.py", "infra-agent.yaml")] == [
        "pkg/**/*_test.py", "scripts/**/test_*.py", "test_root.py", "tests/**"]
    from feedback.manifest import parse_manifest

    manifest = parse_manifest(starter_manifest(inspect(tmp_path)))
    assert manifest.is_protected("pkg/sub/fp8_test.py") and manifest.is_protected("tests/helpers.py")
    assert not manifest.is_protected("pkg/ops.py")


def test_the_pytest_probes_cover_as_many_kernel_files_as_their_number_allows(tmp_path):
    # torchao: five tests of one kernel file took five of the twelve slots; the kernels' own test of six files
    # got none.  Now the test that covers the most kernel files still uncovered comes first
    kernel = KERNEL.replace("scale_kernel", "{name}_kernel")
    files = {"pkg/__init__.py": "", "pkg/ops/__init__.py": "",
             **{f"pkg/ops/k{i}.py": kernel.format(name=f"k{i}") for i in range(12)}}
    for name in ("a", "b", "c"):
        files[f"tests/test_k0_{name}.py"] = f"from pkg.ops.k0 import scale\n\n\ndef test_{name}():\n    assert scale\n"
    files["tests/test_kernels.py"] = "".join(f"from pkg.ops.k{i} import scale as s{i}\n" for i in (1, 2, 3)) + \
        "\n\ndef test_all():\n    assert s1 and s2 and s3\n"
    _write(tmp_path, files)
    chosen = [p["pytest"][0] for p in yaml.safe_load(starter_manifest(inspect(tmp_path), max_tests=2))["probes"]
              if "pytest" in p]
    assert chosen == ["tests/test_k0_a.py", "tests/test_kernels.py"], chosen
    every = [p["pytest"][0] for p in yaml.safe_load(starter_manifest(inspect(tmp_path)))["probes"] if "pytest" in p]
    assert len(every) == 2  # a test that covers nothing new and no other set of kernel files: left as a comment


def test_init_tolerates_a_file_that_does_not_parse_today_in_every_check(tmp_path):
    from tests.feedback.test_checks import KERNELS  # a kernel file with a fp32 dot, a loop division and a PyDLL

    root = tmp_path / "r"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "kernels.py").write_text(KERNELS)
    (root / "pkg" / "py2.py").write_text("import ctypes\nimport triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                                         "def k(x):\n    print tl.dot(x, x) / 2\n\n\nLIB = ctypes.PyDLL(None)\n")
    probes = {p["id"]: p for p in yaml.safe_load(starter_manifest(inspect(root)))["probes"]}
    for pid in ("static.dot_precision", "static.kernel_loop_division", "static.gil_native"):
        assert any(t.startswith("pkg/py2.py: -: does not parse") for t in probes[pid]["params"]["tolerated"]), pid
    assert probes["static.dot_precision"]["params"]["tolerated"] == [
        t for t in probes["static.dot_precision"]["params"]["tolerated"] if "py2.py" in t]  # its sites are reported


def test_a_test_file_that_asserts_nothing_is_no_correctness_probe_and_a_package_does_not_reach_its_neighbours(
        tmp_path):
    # FlagGems: benchmark/test_fused_perf.py (timing loops, no assert) was the one probe of its fused kernels;
    # flash-attention: `from flash_attn import x` made its interface tests "tests of" two Triton files in that
    # package that nothing imports
    root = tmp_path / "r"
    _write(root, {"mylib/__init__.py": "from mylib.ops.scale import scale  # noqa: F401\n",
                  "mylib/ops/__init__.py": "", "mylib/ops/scale.py": KERNEL,
                  "mylib/attn_triton.py": KERNEL.replace("scale_kernel", "attn_kernel"),
                  "mylib/interface.py": "def run(x):\n    return x\n",
                  "tests/test_scale.py": TEST_KERNEL.replace("from mylib.ops.naive import scale_ref\n", "").replace(
                      "scale_ref(3.0, 2.0)", "3.0"),
                  "tests/test_interface.py": "from mylib import interface\n\n\ndef test_run():\n"
                                             "    assert interface.run(1) == 1\n",
                  "benchmark/test_scale_perf.py": "import time\nfrom mylib.ops.scale import scale\n\n\n"
                                                  "def test_time():\n    t = time.perf_counter()\n    scale(3.0, 2.0)\n"
                                                  "    print(time.perf_counter() - t)\n"})
    inv = inspect(root)
    assert inv.assert_nothing == ["benchmark/test_scale_perf.py"]
    # `mylib` names the package: what its __init__ imports, not the attn_triton.py beside it
    assert inv.kernel_tests["tests/test_interface.py"] == ["mylib/ops/scale.py"]
    text = starter_manifest(inv)
    chosen = [p["pytest"][0] for p in yaml.safe_load(text)["probes"] if "pytest" in p]
    assert chosen == ["tests/test_scale.py"]
    assert "assert nothing (timing loops?), not written as probes: benchmark/test_scale_perf.py" in text


def test_the_helpers_a_chosen_test_imports_from_outside_the_package_are_protected(tmp_path):
    # FlagGems: benchmark/performance_utils.py, which its chosen test imports, was open to any patch
    root = tmp_path / "r"
    _write(root, {"mylib/__init__.py": "", "mylib/ops/__init__.py": "", "mylib/ops/scale.py": KERNEL,
                  "mylib/ops/util.py": "def helper():\n    return 1\n",
                  "checks/accuracy_utils.py": "def close(a, b):\n    return abs(a - b) < 1e-6\n",
                  "checks/test_scale.py": "from accuracy_utils import close\nfrom mylib.ops.scale import scale\n"
                                          "from mylib.ops.util import helper\n\n\n"
                                          "def test_scale():\n    assert close(scale(3.0, 2.0), 3.0) and helper()\n"})
    _write(root, {"mylib/utils/benchmark.py": "def timeit(f):\n    return f()\n",  # a library's timing helper
                  "mylib/bench_scale.py": "if __name__ == '__main__':\n    print('{}')\n"})
    inv = inspect(root)
    assert inv.bench_files == ["mylib/bench_scale.py"]
    protected = yaml.safe_load(starter_manifest(inv))["protected"]
    assert "checks/accuracy_utils.py" in protected and "checks/**/test_*.py" in protected
    assert not any(p.startswith("mylib") for p in protected)  # the package's own modules stay patchable
    # FlagAttention keeps its references in the package, as flag_attn.testing: that subpackage judges too
    _write(root, {"mylib/testing/__init__.py": "from mylib.testing.ref import scale_ref  # noqa: F401\n",
                  "mylib/testing/ref.py": "def scale_ref(x, s):\n    return x\n",
                  "checks/test_ref.py": "import mylib.testing\nfrom mylib.ops.scale import scale\n\n\n"
                                        "def test_ref():\n    assert scale(3.0, 2.0) == mylib.testing.scale_ref(3, 2)"
                                        "\n"})
    protected = yaml.safe_load(starter_manifest(inspect(root)))["protected"]
    assert "mylib/testing/**" in protected and "mylib/ops/util.py" not in protected


def test_the_manifest_says_which_chosen_tests_cannot_be_imported_here(tmp_path):
    # flash-attention: every chosen test needed a package this machine lacks, and the first feedback said only
    # "PASS (9 of 14 probes skipped)"; the manifest now says so up front
    root = tmp_path / "r"
    _write(root, {"mylib/__init__.py": "", "mylib/ops/__init__.py": "", "mylib/ops/scale.py": KERNEL,
                  "tests/test_scale.py": "import a_model_zoo_not_installed_here\nfrom mylib.ops.scale import scale\n"
                                         "\n\ndef test_scale():\n    assert scale(3.0, 2.0) == 3.0\n"})
    text = starter_manifest(inspect(root))
    assert ("# not importable here (1 of the 1 test probes skip on this machine until installed):\n"
            "#   tests/test_scale.py imports a_model_zoo_not_installed_here") in text


def test_init_tolerates_the_dots_a_tree_states_as_tf32_today(tmp_path):
    root = tmp_path / "r"
    mm = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef mm(a, b):\n"
          "    return tl.dot(tl.load(a), tl.load(b), allow_tf32=True)\n")
    _write(root, {"mylib/__init__.py": "", "mylib/mm.py": mm})
    probes = {p["id"]: p for p in yaml.safe_load(starter_manifest(inspect(root)))["probes"]}
    (kept,) = probes["static.tf32_dot"]["params"]["tolerated"]
    assert kept.startswith("mylib/mm.py: mm: tl.dot(tl.load(a), tl.load(b), allow_tf32=True): fp32 operands on tf32")


def test_a_test_that_uses_a_package_by_attribute_reaches_what_it_uses(tmp_path):
    # FlagAttention: `import flag_attn` then `flag_attn.paged_attention(...)`, a name its __init__ re-exports
    # under another name; the test was read as one of the whole package, and the paged kernel's own test left out
    kernel = KERNEL.replace("scale_kernel", "{name}_kernel")
    _write(tmp_path, {"fa/__init__.py": "from fa.flash import scale as flash_attention\n"
                                        "from fa.paged import scale as paged_attention\n",
                      **{f"fa/{n}.py": kernel.format(name=n) for n in ("flash", "paged", "piecewise", "total")},
                      "tests/test_paged.py": "import fa\n\n\ndef test_paged():\n"
                                             "    assert fa.paged_attention(2.0, 2.0) == 2.0\n"})
    assert inspect(tmp_path).kernel_tests == {"tests/test_paged.py": ["fa/paged.py"]}
