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
])
def test_malformed_manifest_errors_name_file_line_and_field(mutation, expect):
    with pytest.raises(ManifestError) as err:
        parse_manifest(mutation(TOY_MANIFEST), "infra-agent.yaml")
    assert expect in str(err.value) and str(err.value).startswith("infra-agent.yaml")
