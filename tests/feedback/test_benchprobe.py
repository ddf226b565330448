"""A ``bench`` probe (feedback/benchprobe.py): a callable of the tree, timed by the harness from the
manifest alone, through the real runner; a call that caches its result fails it."""

from __future__ import annotations

import pathlib

import pytest

from feedback.manifest import ManifestError, load_manifest, parse_manifest
from feedback.models import Status
from feedback.runner import Runner

OPS = '''
import torch


def axpy(a, x, y):
    return a * x + y


def inputs(i, device, n=1 << 16):
    return 2.5, torch.randn(n, device=device), torch.randn(n, device=device)


def check(before, after, out):
    a, x, y = before
    ref = a * x.double() + y.double()
    return float((out.double() - ref).norm() / ref.norm())


def traffic(a, x, y):
    return 3 * x.numel() * x.element_size()
'''

MEMO = '''
_last = {}


def axpy(a, x, y):
    key = (x.shape, y.shape)
    if key not in _last:
        _last[key] = a * x + y
    return _last[key]
'''

MANIFEST = '''
schema_version: 1
name: bench-toy
probes:
  - id: ops.axpy.bench
    kind: microbench
    bench: {call: "pkg.ops:axpy", make: "pkg.ops:inputs", check: "pkg.ops:check", bytes: "pkg.ops:traffic", reps: 10}
    # 0.8 MB a call, in cache on a CPU: the roofline's floor there is a copy of the call's size (a 64 MB
    # copy's floor was beaten by this honest call on a loaded 2-core machine, bench/RESULTS.md 2026-12-06d)
    params: {n: 65536}
    repeats: 1
    covers: {files: ["pkg/*.py"]}
'''


def _tree(root: pathlib.Path, ops: str = OPS) -> pathlib.Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "ops.py").write_text(ops)
    (root / "infra-agent.yaml").write_text(MANIFEST)
    return root


def _run(root: pathlib.Path):
    m = load_manifest(root)
    (r,) = Runner(root, m, use_cache=False, cache_dir=str(root.parent / "cache")).run(m.probes)
    return r


def test_a_bench_probe_times_the_trees_callable_with_the_harness_defences(tmp_path):
    r = _run(_tree(tmp_path / "t"))
    assert r.status == Status.passed, (r.reason, [f.message for f in r.findings], r.stderr[-2000:])
    assert r.metrics["call_us"].value > 0 and r.metrics["call_rel_err_after_timing"].value < 1e-6
    assert r.metrics["bandwidth_vs_copy"].value > 0 and r.metrics["bytes_per_s"].value > 0
    assert r.spans["call"] > 0  # witnessed by the harness's clock


def test_a_bench_call_that_caches_its_result_fails(tmp_path):
    root = _tree(tmp_path / "t", OPS.replace("def axpy(a, x, y):\n    return a * x + y\n", MEMO))
    r = _run(root)
    assert r.status == Status.failed
    assert any("wrong when re-checked after timing" in f.message and f.location.symbol == "axpy" for f in r.findings)


def test_a_bench_probe_is_a_microbenchmark():
    text = MANIFEST.replace("kind: microbench", "kind: correctness")
    with pytest.raises(ManifestError, match="a bench probe is kind microbench"):
        parse_manifest(text)
