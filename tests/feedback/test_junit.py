"""A pytest probe on a tree's own tests (feedback/junit.py, feedback/needs.py), through the runner.

The tests run in a real pytest subprocess.  Tests that cannot run on this machine (a third-party
package the tree imports is missing; no GPU is visible: ``interpret: true`` hides the GPUs, and torch
says so on a CPU build and on a CUDA build alike) are counted apart from failures and named by what they need;
failures of the code are bound to the code, grouped where many tests fail the same way at the same
place; a broken import of the tree's own code is a failure, never the machine's.
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from feedback.junit import read_junit
from feedback.manifest import load_manifest
from feedback.models import Status
from feedback.needs import lacks
from feedback.runner import Runner

FILES = {
    "pkg/__init__.py": "",
    "pkg/core.py": """
        def add(a, b):
            return a + b


        def scale(x, k):
            if not k:
                raise ValueError("a zero scale")
            return x * k
        """,
    "pkg/serve.py": "import a_serving_dependency_not_installed_here  # noqa: F401\n",
    "pkg/wiring.py": "from pkg.renamed_away import handler  # noqa: F401\n",
    "tests/test_core.py": """
        import pytest

        from pkg.core import add, scale


        def test_add():
            assert add(1, 2) == 3


        @pytest.mark.parametrize("k", [0, 0.0, False])
        def test_scale(k):
            assert scale(2.0, k) == 0
        """,
    "tests/test_serve.py": """
        from pkg.serve import a_serving_dependency_not_installed_here


        def test_serve():
            assert a_serving_dependency_not_installed_here
        """,
    "tests/test_gpu.py": """
        import torch


        def test_on_the_gpu():
            assert torch.ones(4, device="cuda").sum().item() == 4
        """,
    "tests/test_wiring.py": """
        from pkg.wiring import handler


        def test_handler():
            assert handler
        """,
    "pkg/rotary.py": """
        def apply(x, cos, sin):
            return launch(x, cos, sin,, 4)
        """,
    "pkg/layers.py": "from pkg.rotary import apply  # noqa: F401\n",
    "tests/test_layers.py": """
        from pkg.layers import apply


        def test_apply():
            assert apply
        """,
    "tests/test_big.py": """
        import pytest

        pytest.skip("needs the 70B checkpoint", allow_module_level=True)
        """,
}

MANIFEST = """
schema_version: 1
name: own-tests
probes:
  - {id: mixed, kind: correctness, pytest: [tests/test_core.py, tests/test_serve.py, tests/test_gpu.py],
     interpret: true}
  - {id: machine, kind: correctness, pytest: [tests/test_serve.py, tests/test_gpu.py], interpret: true}
  - {id: wiring, kind: correctness, pytest: [tests/test_wiring.py]}
  - {id: big, kind: correctness, pytest: [tests/test_big.py]}
  - {id: syntax, kind: correctness, pytest: [tests/test_layers.py]}
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tree = tmp_path_factory.mktemp("own-tests")
    for rel, text in FILES.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(textwrap.dedent(text).lstrip())
    (tree / "infra-agent.yaml").write_text(MANIFEST)
    manifest = load_manifest(tree)
    runner = Runner(tree, manifest, use_cache=False, cache_dir=str(tree.parent / "cache"))
    return {r.probe: r for r in runner.run(manifest.probes)}


def test_tests_this_machine_cannot_run_are_counted_apart_and_named_by_what_they_need(results):
    mixed = results["mixed"]
    counts = {k: m.value for k, m in mixed.metrics.items()}
    assert counts == {"tests": 6, "passed": 1, "failed": 3, "errors": 0, "skipped": 0, "unrunnable": 2}, (
        mixed.reason, mixed.stderr[-2000:])
    assert mixed.status == Status.failed  # the code's own failure still fails the probe
    note = [f.message for f in mixed.findings if not f.failed]
    assert len(note) == 1 and "the package 'a_serving_dependency_not_installed_here'" in note[0]
    assert "a CUDA GPU" in note[0]
    machine = results["machine"]
    assert machine.status == Status.skipped and machine.reason.startswith("cannot run on this machine")
    assert "a CUDA GPU" in machine.reason and "a_serving_dependency_not_installed_here" in machine.reason
    # a file that cannot even be imported is said to be one, not counted as if it were one test
    assert "1 test needs a CUDA GPU" in machine.reason, machine.reason
    assert "the import of 1 test file needs the package 'a_serving_dependency_not_installed_here'" in machine.reason


def test_tests_that_fail_the_same_way_at_the_same_place_are_one_finding_at_the_code(results):
    failed = [f for f in results["mixed"].findings if f.failed]
    assert len(failed) == 1, [f.message for f in failed]
    f = failed[0]
    assert "ValueError: a zero scale" in f.message and "and 2 more tests" in f.message
    assert (f.location.file, f.location.symbol) == ("pkg/core.py", "scale")
    # every failing test is kept by its id, for the judgement test by test (feedback.verdict)
    assert sorted(results["mixed"].failing) == [f"tests.test_core::test_scale[{k}]" for k in ("0.0", "0", "False")]


def test_a_broken_import_of_the_trees_own_code_is_a_failure_bound_to_the_import(results):
    wiring = results["wiring"]
    assert wiring.status == Status.failed and "unrunnable" not in wiring.metrics
    f = wiring.findings[0]
    # pytest prints an import error as "path:line: in <module>" lines, not as a native traceback
    assert "No module named 'pkg.renamed_away'" in f.message
    assert (f.location.file, f.location.symbol) == ("pkg/wiring.py", "<module>")


def test_a_file_that_does_not_parse_is_the_fault_not_the_import_that_reached_it(results):
    # flash-attention: a stray comma in a kernel's launch was blamed on the layer module's line importing it
    f = results["syntax"].findings[0]
    assert results["syntax"].status == Status.failed and "SyntaxError" in f.message, f.message
    assert (f.location.file, f.location.condition.split(",")[0]) == ("pkg/rotary.py", "line 2"), f.location


def test_tests_that_all_skip_themselves_judge_nothing(results):
    big = results["big"]
    assert big.status == Status.skipped and "needs the 70B checkpoint" in big.reason


def test_what_a_failure_says_the_machine_lacks(tmp_path):
    (tmp_path / "mine").mkdir()
    roots = [tmp_path]
    assert lacks("E   ModuleNotFoundError: No module named 'tqdm'", roots) == "the package 'tqdm'"
    assert lacks("ModuleNotFoundError: No module named 'mine.gone'", roots) is None  # the tree's own
    assert "another version of 'triton'" in lacks("ImportError: cannot import name 'knobs' from 'triton' (x)", roots)
    assert lacks("RuntimeError: No CUDA GPUs are available", roots).startswith("a CUDA GPU")
    assert lacks("ImportError: libcudart.so.12: cannot open shared object file: No such file or directory",
                 roots) == "the shared library libcudart.so.12"
    assert lacks("RuntimeError: 0 active drivers ([]). There should only be one.", roots).startswith("a CUDA GPU")
    # a CUDA error while a kernel runs is the code's, and so is an innermost exception after a lacking one
    assert lacks("RuntimeError: CUDA error: an illegal memory access was encountered", roots) is None
    chained = "ModuleNotFoundError: No module named 'tqdm'\n\nDuring handling...\n\nValueError: bad shape"
    assert lacks(chained, roots) is None


def test_a_file_that_is_not_junit_is_an_error(tmp_path):
    bad = tmp_path / "junit.xml"
    bad.write_text("<testsuite><testcase")
    with pytest.raises(ValueError, match="not JUnit XML"):
        read_junit(bad, tmp_path)


def test_frames_of_no_file_are_never_bound_to_the_tree(tmp_path: pathlib.Path):
    from feedback.junit import localise

    text = ('  File "<frozen importlib._bootstrap>", line 690, in _load_unlocked\n'
            f'  File "{tmp_path}/pkg/a.py", line 3, in f\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    assert localise(text, tmp_path) == ("pkg/a.py", 3, "f")
    assert localise('  File "<frozen importlib._bootstrap>", line 690, in _load_unlocked\n', tmp_path) is None


def test_a_result_that_lacked_a_package_is_not_served_from_the_cache_once_the_package_is_there(tmp_path):
    # the package is outside the cache's key (not in the tree's covers, not installed): the result keeps its
    # name, and a cached copy holds only while it still cannot be imported (installed since, a submodule
    # checked out, here: written into the tree)
    tree = tmp_path / "tree"
    for rel in ("pkg/__init__.py", "pkg/serve.py", "tests/test_serve.py"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(textwrap.dedent(FILES[rel]).lstrip())
    (tree / "infra-agent.yaml").write_text("schema_version: 1\nname: t\nprobes:\n"
                                           "  - {id: serve, kind: correctness, pytest: [tests/test_serve.py]}\n")
    manifest = load_manifest(tree)

    def run():
        runner = Runner(tree, manifest, use_cache=True, cache_dir=str(tmp_path / "cache"))
        return runner.run(manifest.probes)[0]

    first = run()
    assert first.status == Status.skipped and first.absent == ["a_serving_dependency_not_installed_here"]
    assert run().cached  # nothing changed: served
    dep = tree / "a_serving_dependency_not_installed_here"
    dep.mkdir()
    (dep / "__init__.py").write_text("a_serving_dependency_not_installed_here = True\n")
    now = run()
    assert not now.cached and now.status == Status.passed and now.absent == [], now.reason


def test_a_failure_to_import_a_file_is_not_served_from_the_cache_once_the_file_is_mended(tmp_path):
    # FlagAttention: a module with a stray bracket failed the tests that imported it; the tree mended, the cached
    # failure was served again, because the module whose import raised was gone from sys.modules and was not
    # among the files the result depended on (the probe covers only its test file)
    tree = tmp_path / "tree"
    files = {"pkg/__init__.py": "", "pkg/flash.py": "def attn(x):\n    return [x]]\n",
             "pkg/layer.py": "from pkg.flash import attn\n", "tests/test_layer.py": "from pkg.layer import attn\n\n\n"
                                                                                      "def test_attn():\n"
                                                                                      "    assert attn(1) == [1]\n"}
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    (tree / "infra-agent.yaml").write_text("schema_version: 1\nname: t\nprobes:\n  - {id: layer, kind: correctness, "
                                           "pytest: [tests/test_layer.py], covers: {files: [tests/test_layer.py]}}\n")
    manifest = load_manifest(tree)

    def run():
        return Runner(tree, manifest, use_cache=True, cache_dir=str(tmp_path / "cache")).run(manifest.probes)[0]

    first = run()
    assert first.status == Status.failed and "pkg/flash.py" in first.imports, first.imports
    assert run().cached
    (tree / "pkg" / "flash.py").write_text("def attn(x):\n    return [x]\n")
    now = run()
    assert not now.cached and now.status == Status.passed, now.reason


def test_a_conftest_that_imports_a_missing_package_is_the_machines_and_a_candidate_that_adds_it_broke(tmp_path):
    # pytest stops before collecting (exit 4, no JUnit file) when a conftest cannot be imported: that is not the
    # tree's test failing, it is a package this machine lacks, named as such; a candidate whose conftest newly
    # needs it passes fewer tests than its baseline, which ran them
    from feedback.models import FeedbackReport
    from feedback.verdict import verdict

    def tree(name: str, conftest: str | None) -> tuple[pathlib.Path, object]:
        root = tmp_path / name
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        (root / "pkg" / "device.py").write_text("def _probe():\n    raise RuntimeError('No device were detected on "
                                                "your machine !\\nPlease check that your driver is complete.')\n\n"
                                                "\n_probe()\n")
        for rel in ("pkg/__init__.py", "pkg/core.py", "tests/test_core.py"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(textwrap.dedent(FILES[rel]).lstrip())
        if conftest is not None:
            (root / "tests" / "conftest.py").write_text(conftest)
        (root / "infra-agent.yaml").write_text("schema_version: 1\nname: t\nprobes:\n"
                                               "  - {id: core, kind: correctness, pytest: [tests/test_core.py]}\n")
        manifest = load_manifest(root)
        return root, Runner(root, manifest).run(manifest.probes)[0]

    _, base = tree("base", None)
    assert base.status == Status.failed and base.metrics["passed"].value == 1  # the zero scales fail: the code's
    # where the tests ran, as the pytest process saw it (a record says it of a pytest probe too)
    import importlib.metadata
    import platform

    assert base.environment.python == platform.python_version()
    assert base.environment.torch == importlib.metadata.version("torch")
    _, cand = tree("cand", "import a_fixture_library_not_installed_here  # noqa: F401\n")
    assert cand.status == Status.skipped, cand.reason
    assert cand.absent == ["a_fixture_library_not_installed_here"]
    assert "conftest needs the package 'a_fixture_library_not_installed_here'" in cand.reason
    judged = verdict(FeedbackReport(target="t", candidate="c", results=[cand], baseline_results=[base]))
    assert judged.name == "incorrect" and any("cannot run on this machine" in b for b in judged.broke), judged
    # a conftest broken by the tree's own code is the code's: an error, never excused as the machine's, saying
    # its exception and where (FlagGems: a message's second line had been all the reason said)
    _, own = tree("own", "import pkg.device  # noqa: F401\n")
    assert own.status == Status.error and own.absent == [], own.reason
    assert "RuntimeError: No device were detected" in own.reason and "(at pkg/device.py:2)" in own.reason, own.reason
    (where,) = own.findings
    assert (where.location.file, where.location.condition, where.failed) == ("pkg/device.py", "line 2", True)


def test_a_test_that_asserts_a_gpu_is_there_needs_one_and_is_not_the_codes_failure(tmp_path):
    # torchao's kernel tests begin with `assert torch.cuda.is_available()`: on a machine without a GPU that is
    # the machine's lack, not 42 failures of the code; an assertion about the code's results stays a failure
    import torch

    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "test_fp8.py").write_text(textwrap.dedent("""
        import torch


        def test_cast():
            assert torch.cuda.is_available()
            assert torch.ones(2).sum() == 2


        def test_values():
            assert torch.ones(2).sum() == 3
        """))
    (tree / "infra-agent.yaml").write_text("schema_version: 1\nname: t\nprobes:\n"
                                           "  - {id: fp8, kind: correctness, pytest: [tests/test_fp8.py]}\n")
    manifest = load_manifest(tree)
    result = Runner(tree, manifest).run(manifest.probes)[0]
    assert result.status == Status.failed and result.metrics["failed"].value == 1  # test_values: the code's
    if torch.cuda.is_available():
        assert result.metrics["passed"].value == 1
    else:
        assert result.metrics["unrunnable"].value == 1, result.metrics
        assert "the test asserts that torch.cuda.is_available()" in " ".join(f.message for f in result.findings)
