"""The manifest: the bundled one valid and protecting its judges; malformed ones named by file, line and field."""

from __future__ import annotations

import pytest

from feedback.manifest import ManifestError, load_manifest, parse_manifest
from feedback.targets import materialize_bundled
from tests.support.toy_harness import TOY_MANIFEST


def test_bundled_manifest_is_valid_and_protects_what_judges(tmp_path):
    tree = materialize_bundled(tmp_path / "ts")
    m = load_manifest(tree)
    assert {"kda.cp.merge", "kda.chunk.correctness", "kda.recurrent.null_slot"} <= {p.id for p in m.probes}
    assert m.is_protected("infra-agent.yaml") and m.is_protected("target_stack/probes/kda.py")
    assert m.is_protected("target_stack/ops/kda/naive.py") and not m.is_protected("target_stack/ops/kda/cp.py")
    assert m.split_metric("kda.cp.merge.error_growth") == ("kda.cp.merge", "error_growth")


@pytest.mark.parametrize("mutation,expect", [
    (lambda t: t.replace("budget_s: 30}", "budget_s: -5}", 1),
     ":5: probes[0].budget_s: Input should be greater than 0"),
    (lambda t: t.replace("kind: correctness\n    entry: \"toy.probes:ok\"", "kind: unit\n    entry: \"toy.probes:ok\""),
     ":7: probes[1].kind"),
    (lambda t: t.replace("name: toy", "name: toy\nbogus: 1"), ":4: bogus: Extra inputs are not permitted"),
    (lambda t: t.replace("probes:\n", "probes: [\n", 1), "not valid YAML"),
    (lambda t: t.replace('entry: "toy.probes:raises"', 'entry: "toy.probes"'),
     "entry must look like module.path:function"),
    (lambda t: t.replace("toy.ok.err <= 1e-6", "toy.nothing.err <= 1e-6"), "names 'toy.nothing.err'"),
    (lambda t: t.replace("id: toy.bad", "id: toy.ok"), "duplicate probe id 'toy.ok'"),
    (lambda t: t.replace("name: toy", "name: toy\nenv: {PYTHONPATH: /elsewhere}"),
     ":4: env: PYTHONPATH is set by the harness for every probe"),
    (lambda t: t.replace("budget_s: 30}", "budget_s: 30, env: {TRITON_INTERPRET: 1}}", 1),
     "probes[0].env: TRITON_INTERPRET is set by the harness for every probe (use interpret: true)"),
    (lambda t: t.replace("name: toy", "name: toy\nenv: {HF_TOKEN: abc}"), ":4: env: HF_TOKEN looks like a credential"),
    (lambda t: t.replace("name: toy", "name: toy\nenv: {1ST: x}"), "env: '1ST' is not a variable name"),
    (lambda t: t.replace("name: toy", "name: toy\nenv: {MODE: [a, b]}"),
     "env: MODE must be a string or a number, got list"),
    (lambda t: t.replace("name: toy", "name: toy\nenv: [MODE]"),
     ":4: env: a mapping of variable names to values, not a list"),
])
def test_malformed_manifest_errors_name_file_line_and_field(mutation, expect):
    with pytest.raises(ManifestError) as err:
        parse_manifest(mutation(TOY_MANIFEST), "infra-agent.yaml")
    assert expect in str(err.value) and str(err.value).startswith("infra-agent.yaml")


def test_the_manifests_env_reaches_every_probe_under_its_own():
    text = TOY_MANIFEST.replace("name: toy", "name: toy\nenv: {TOY_MODE: fast, TOY_LEVEL: 2, TOY_ON: true}")
    text = text.replace("budget_s: 30}", "budget_s: 30, env: {TOY_MODE: exact}}", 1)
    m = parse_manifest(text, "infra-agent.yaml")
    first, *rest = m.probes
    assert first.env == {"TOY_MODE": "exact", "TOY_LEVEL": "2", "TOY_ON": "1"}  # the probe's own wins
    assert all(p.env == {"TOY_MODE": "fast", "TOY_LEVEL": "2", "TOY_ON": "1"} for p in rest)
    assert parse_manifest(TOY_MANIFEST, "infra-agent.yaml").probes[0].env == {}


def test_a_manifest_glob_reads_as_a_path_glob_where_a_double_star_may_be_no_folder():
    """``pkg/**/*.py`` holds ``pkg/core.py`` (as pathlib's glob, which collects a probe's covered files, has
    it): a probe covering a package is selected when a file at the package's top changes, and a root
    ``conftest.py`` is protected by ``**/conftest.py``. fnmatch's own rules hold otherwise."""
    from feedback.manifest import Manifest, ProbeSpec, path_matches
    from feedback.select import select

    for path, glob, want in [("pkg/core.py", "pkg/**/*.py", True), ("pkg/sub/k.py", "pkg/**/*.py", True),
                             ("other/core.py", "pkg/**/*.py", False), ("conftest.py", "**/conftest.py", True),
                             ("myconftest.py", "**/conftest.py", False), ("a/x/b/c.py", "a/**/b/**/c.py", True),
                             ("pkg/sub/k.py", "pkg/*.py", True), ("pkg/k.pyc", "pkg/*.py", False),
                             ("pkg/k.py", "pkg/[!kq].py", False), ("pkg/z.py", "pkg/[!kq].py", True),
                             ("a^.py", "a[^b].py", True), ("a+b.py", "a+b.py", True)]:
        assert path_matches(path, glob) is want, (path, glob)
    probe = ProbeSpec(id="p.order", kind="static", check="argument_order", covers={"files": ["pkg/**/*.py"]})
    manifest = Manifest(schema_version=1, name="t", probes=[probe], protected=["**/conftest.py", "tests/**"])
    assert [p.id for p in select(manifest, ["pkg/core.py"])] == ["p.order"]
    assert select(manifest, ["docs/core.py"]) == []
    assert manifest.is_protected("conftest.py") == "**/conftest.py"
    assert manifest.is_protected("tests/test_core.py") == "tests/**" and manifest.is_protected("pkg/core.py") is None
