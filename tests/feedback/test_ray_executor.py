"""Probes on a real local Ray instance (two CPU workers, 127.0.0.1): the same results as local
subprocesses, budgets enforced on the worker, the tree shipped by content, the cache kept by the
driver, results stamped with where they ran."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ray = pytest.importorskip("ray", reason="Ray is the optional [cluster] extra")

from feedback.harness import judge  # noqa: E402
from feedback.manifest import load_manifest  # noqa: E402
from feedback.models import Status  # noqa: E402
from feedback.ray_executor import RayExecutor, pack, unpack  # noqa: E402
from feedback.runner import Runner  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    with RayExecutor(num_cpus=2) as ex:
        yield ex
    assert not ray.is_initialized()  # the instance started for the executor is shut down with it


def test_every_probe_ends_as_it_does_locally_and_says_where_it_ran(toy, cluster, tmp_path):
    manifest = load_manifest(toy)
    local = {r.probe: r for r in Runner(toy, manifest, use_cache=False, cache_dir=str(tmp_path / "a"))
             .run(manifest.probes)}
    remote = {r.probe: r for r in Runner(toy, manifest, use_cache=False, cache_dir=str(tmp_path / "b"),
                                         executor=cluster).run(manifest.probes)}
    assert {p: r.status for p, r in remote.items()} == {p: r.status for p, r in local.items()}
    assert remote["toy.hangs"].status == Status.timeout and "process group killed" in remote["toy.hangs"].reason
    assert remote["toy.ok"].metrics["marker"].value == 1.0  # the tree's own file, shipped by content
    assert [f.location.file for f in remote["toy.located"].findings] == ["toy/merge.py"]
    assert all(r.ran_on and r.ran_on.startswith("ray node ") for r in remote.values())
    assert all(r.ran_on is None for r in local.values())


def test_the_driver_keeps_the_cache_and_a_changed_tree_travels_again(toy, cluster, tmp_path):
    manifest = load_manifest(toy)
    specs = [manifest.probe("toy.ok")]
    runner = Runner(toy, manifest, cache_dir=str(tmp_path / "cache"), executor=cluster)
    first, = runner.run(specs)
    again, = Runner(toy, manifest, cache_dir=str(tmp_path / "cache"), executor=cluster).run(specs)
    assert not first.cached and again.cached and again.ran_on == first.ran_on
    (toy / "toy" / "value.txt").write_text("2")  # another candidate: another tree, another pack
    changed, = Runner(toy, manifest, cache_dir=str(tmp_path / "cache"), executor=cluster).run(specs)
    assert not changed.cached and changed.metrics["marker"].value == 2.0


def test_the_clusters_results_and_the_drivers_own_are_cached_apart(toy, cluster, tmp_path):
    """One state folder, two places to run: a result from the cluster's machines is not served to a run on the
    driver (another device, perhaps), nor the other way round; each is served to its own kind of run."""
    manifest = load_manifest(toy)
    specs, cache = [manifest.probe("toy.ok")], str(tmp_path / "cache")
    remote, = Runner(toy, manifest, cache_dir=cache, executor=cluster).run(specs)
    local, = Runner(toy, manifest, cache_dir=cache).run(specs)
    assert not remote.cached and remote.ran_on.startswith("ray node ")
    assert not local.cached and local.ran_on is None
    again, = Runner(toy, manifest, cache_dir=cache, executor=cluster).run(specs)
    assert again.cached and again.ran_on == remote.ran_on
    assert Runner(toy, manifest, cache_dir=cache).run(specs)[0].cached
    # a CPU-only instance: its machines, their interpreter and the emulation they run, in the Fingerprint's fields
    assert cluster.environment_key(True).endswith("|ray:cpu|interpreter|truncate")
    assert cluster.environment_key(False).endswith("|ray:cpu|interpreter|None")


def test_a_verdict_on_the_cluster_is_the_local_verdict(toy, cluster, tmp_path):
    base = tmp_path / "base"
    import shutil

    shutil.copytree(toy, base, ignore=shutil.ignore_patterns(".git"))
    (toy / "toy" / "probes.py").write_text((toy / "toy" / "probes.py").read_text().replace(
        'ctx.metric("err", 0.5, better="lower")', 'ctx.metric("err", 1e-9, better="lower")'))
    ids = ["toy.ok", "toy.bad"]
    local = judge(toy, baseline_tree=base, probe_ids=ids, run_all=True, use_cache=False)
    remote = judge(toy, baseline_tree=base, probe_ids=ids, run_all=True, use_cache=False, executor=cluster)
    assert remote.verdict.name == local.verdict.name
    assert [c.candidate for c in remote.comparisons] == [c.candidate for c in local.comparisons]


def test_pack_leaves_out_our_state_and_unpack_is_idempotent(tmp_path):
    tree = tmp_path / "t"
    (tree / "pkg" / "__pycache__").mkdir(parents=True)
    (tree / ".infra-agent").mkdir()
    (tree / "pkg" / "a.py").write_text("x = 1\n")
    (tree / "pkg" / "__pycache__" / "a.pyc").write_bytes(b"junk")
    (tree / ".infra-agent" / "cache.json").write_text("{}")
    digest, data = pack(tree)
    assert pack(tree)[0] == digest  # by content: the same tree, the same key
    out = unpack(digest, data)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == ["pkg/a.py"]
    assert unpack(digest, data) == out
    (tree / "pkg" / "a.py").write_text("x = 2\n")
    assert pack(tree)[0] != digest
    assert isinstance(out, pathlib.Path)


def test_the_cli_judges_on_a_ray_instance_it_starts_and_stops(toy, tmp_path):
    import json
    import os
    import subprocess
    import sys

    ids = ["--probe", "toy.ok", "--probe", "toy.bad", "--probe", "toy.located"]

    def feedback(*extra):
        out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "feedback", "--target", str(toy), *ids,
                              "--all", "--json", "--no-cache", *extra], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "COLUMNS": "160"}, cwd=tmp_path)
        return out, {r["probe"]: r for r in json.loads(out.stdout)["results"]}

    out, remote = feedback("--executor", "ray")
    assert out.returncode == 1, out.stderr[-2000:]  # toy.bad and toy.located fail, on the cluster as here
    _, local = feedback()
    assert {p: r["status"] for p, r in remote.items()} == {p: r["status"] for p, r in local.items()}
    assert all(r["ran_on"].startswith("ray node") for r in remote.values())
    bad = subprocess.run([sys.executable, "-m", "infra_agent.cli", "feedback", "--target", str(toy), "--address",
                          "127.0.0.1:1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "--address names a Ray cluster" in bad.stderr


def test_a_manifest_kept_outside_the_tree_travels_with_its_probe_modules(tmp_path, cluster):
    judges = tmp_path / "judges"
    judges.mkdir()
    (judges / "outside_probes.py").write_text(
        "import os\nfrom feedback.probe import probe\n\n@probe\ndef here(ctx):\n"
        "    ctx.metric('from_tree', float(open(os.path.join(ctx.tree, 'v.txt')).read()))\n"
        "    ctx.metric('probe_file_len', float(len(open(__file__).read())))\n")
    (judges / "m.yaml").write_text("schema_version: 1\nname: outside\nprobe_path: ['.']\nprobes:\n"
                                   "  - {id: o.here, kind: correctness, entry: 'outside_probes:here', "
                                   "covers: {files: ['v.txt']}}\n")
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "v.txt").write_text("7")
    manifest = load_manifest(tree, judges / "m.yaml")
    (r,) = Runner(tree, manifest, use_cache=False, cache_dir=str(tmp_path / "c"), executor=cluster).run(
        manifest.probes)
    assert r.status == Status.passed, (r.reason, r.stderr[-1500:])
    assert r.metrics["from_tree"].value == 7.0 and r.ran_on.startswith("ray node")
    assert r.metrics["probe_file_len"].value == len((judges / "outside_probes.py").read_text())


def test_a_started_instance_offers_the_cores_this_process_may_use_not_the_hosts(tmp_path):
    """A process limited to one core (``taskset``, a container's cpuset) starts a Ray instance of one CPU: one
    sized by the host's count would run more probes at once than the cores can."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    code = textwrap.dedent("""
        import os
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        import ray
        from feedback.ray_executor import RayExecutor
        with RayExecutor():
            print("CPU", int(ray.cluster_resources()["CPU"]))
    """)
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CPU 1" in out.stdout.splitlines(), (out.stdout, out.stderr[-1000:])
