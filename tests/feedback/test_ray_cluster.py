"""A two-node Ray cluster on this machine (a CPU-less head and two one-CPU workers, each its own
raylet and resource pool, on the machine's own address: Ray's ``cluster_utils``), one worker node
killed while it runs a probe: the probe is run again on the other node, the run goes on, and nothing
of the dead node's probe is left running."""

from __future__ import annotations

import os
import pathlib
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is the optional [cluster] extra")

from feedback.machine import gpu_present  # noqa: E402
from feedback.manifest import load_manifest  # noqa: E402
from feedback.models import Status  # noqa: E402
from feedback.ray_executor import RayExecutor  # noqa: E402
from feedback.runner import Runner  # noqa: E402
from tests.support.processes import alive  # noqa: E402

PROBES = '''
import os, time
from feedback.probe import probe

@probe
def slow(ctx):
    with open(ctx.params["marker"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(ctx.params["seconds"])
    ctx.metric("slept", ctx.params["seconds"])

@probe
def quick(ctx):
    ctx.metric("ok", 1.0)
'''

MANIFEST = '''
schema_version: 1
name: two-nodes
probes:
  - {{id: n.slow, kind: correctness, entry: "nodes.probes:slow", budget_s: 120,
     params: {{marker: "{marker}", seconds: 6}}, covers: {{files: ["nodes/*.py"]}}}}
  - {{id: n.quick, kind: correctness, entry: "nodes.probes:quick", covers: {{files: ["nodes/*.py"]}}}}
'''


def _parents(pid: int) -> list[int]:
    out = []
    while pid > 1 and len(out) < 8:
        try:
            pid = int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, IndexError, ValueError):
            break
        out.append(pid)
    return out


def _raylet(node) -> int:
    return next(info.process.pid for name, infos in node.all_processes.items() if name == "raylet" for info in infos)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="walks /proc to find which node runs the probe")
def test_a_node_killed_mid_probe_is_retried_on_the_other_and_the_run_goes_on(tmp_path):
    from ray.cluster_utils import Cluster

    marker = tmp_path / "slow.pids"
    tree = tmp_path / "t"
    (tree / "nodes").mkdir(parents=True)
    (tree / "nodes" / "__init__.py").write_text("")
    (tree / "nodes" / "probes.py").write_text(PROBES)
    (tree / "infra-agent.yaml").write_text(MANIFEST.format(marker=marker))
    manifest = load_manifest(tree)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the head runs no probe
    nodes = [cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=1)]
    cluster.wait_for_nodes()
    try:
        with RayExecutor(address=cluster.address, grace_s=60) as ex:
            assert ex.connected and not ex.started  # a cluster named by its address is joined, and left running
            results: list = []
            run = threading.Thread(target=lambda: results.extend(
                Runner(tree, manifest, jobs=2, use_cache=False, cache_dir=str(tmp_path / "c"), executor=ex)
                .run(manifest.probes)))
            run.start()
            t0 = time.time()
            while not marker.exists() and time.time() - t0 < 120:
                time.sleep(0.1)
            first = int(marker.read_text().split()[0])
            chain = _parents(first)
            (victim,) = [n for n in nodes if _raylet(n) in chain]
            cluster.remove_node(victim)  # the node running the slow probe dies mid-probe
            run.join(timeout=300)
            assert not run.is_alive()
            by_id = {r.probe: r for r in results}
            assert by_id["n.quick"].status == Status.passed  # the run went on
            slow = by_id["n.slow"]
            assert slow.status == Status.passed, (slow.status, slow.reason)  # run again, on the survivor
            survivor = next(n for n in nodes if n is not victim)
            assert survivor.node_id[:12] in slow.ran_on
            assert len(marker.read_text().split()) == 2  # once on each node
            deadline = time.time() + 10
            while alive(first) and time.time() < deadline:
                time.sleep(0.2)
            assert not alive(first), "the dead node's probe process outlived it"
    finally:
        ray.shutdown()
        cluster.shutdown()


GPU_MANIFEST = '''
schema_version: 1
name: ranks
probes:
  - {id: r.two, kind: correctness, entry: "nodes.probes:quick", gpus: 2, covers: {files: ["nodes/*.py"]}}
  - {id: r.three, kind: correctness, entry: "nodes.probes:quick", gpus: 3, covers: {files: ["nodes/*.py"]}}
'''


def _nodes_tree(tmp_path: pathlib.Path, manifest_text: str):
    """A target of the ``nodes`` probes judged by ``manifest_text``: (tree, its manifest)."""
    tree = tmp_path / "t"
    (tree / "nodes").mkdir(parents=True)
    (tree / "nodes" / "__init__.py").write_text("")
    (tree / "nodes" / "probes.py").write_text(PROBES)
    (tree / "infra-agent.yaml").write_text(manifest_text)
    return tree, load_manifest(tree)


def _ran_as_the_host_allows(result) -> bool:
    """A probe given a logical GPU by Ray: on a host without an NVIDIA device the worker finds none and skips,
    saying so; on a GPU machine (where ``.ci/gpu ray`` runs these tests) the device is there and it runs."""
    if gpu_present():
        return result.status == Status.passed
    return result.status == Status.skipped and "none on this machine" in (result.reason or "")


def test_probes_that_need_several_gpus_of_one_node_reserve_them_together(tmp_path):
    """A node with two (logical) GPUs: a probe needing 2 gets them as one placement group (strict pack), run
    on that node, the group released after; one needing 3 is skipped with the reason, never left waiting."""
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    tree, manifest = _nodes_tree(tmp_path, GPU_MANIFEST)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    node = cluster.add_node(num_cpus=1, num_gpus=2)
    cluster.wait_for_nodes()
    try:
        with RayExecutor(address=cluster.address) as ex:
            results = {r.probe: r for r in Runner(tree, manifest, use_cache=False, cache_dir=str(tmp_path / "c"),
                                                  executor=ex).run(manifest.probes)}
            two, three = results["r.two"], results["r.three"]
            assert two.ran_on and node.node_id[:12] in two.ran_on  # it ran, on the node with the GPUs
            assert _ran_as_the_host_allows(two), (two.status, two.reason)
            assert three.status == Status.skipped and three.ran_on is None
            assert "needs 3 GPUs on one node; the cluster's largest node has 2" in three.reason
            assert all(g["state"] == "REMOVED" for g in placement_group_table().values())
    finally:
        ray.shutdown()
        cluster.shutdown()


TIMING_MANIFEST = '''
schema_version: 1
name: timings
probes:
  - {id: t.a, kind: microbench, entry: "nodes.probes:quick", needs_gpu: true, covers: {files: ["nodes/*.py"]}}
  - {id: t.b, kind: microbench, entry: "nodes.probes:quick", needs_gpu: true, covers: {files: ["nodes/*.py"]}}
  - {id: t.c, kind: e2e, entry: "nodes.probes:quick", needs_gpu: true, covers: {files: ["nodes/*.py"]}}
  - {id: t.check, kind: correctness, entry: "nodes.probes:quick", needs_gpu: true, covers: {files: ["nodes/*.py"]}}
  - {id: t.cpu, kind: correctness, entry: "nodes.probes:quick", covers: {files: ["nodes/*.py"]}}
'''


@pytest.mark.parametrize("gpus", [2, 1])
def test_timed_gpu_probes_share_one_gpu_and_a_lone_gpu_is_never_waited_for(tmp_path, gpus):
    """A node with (logical) GPUs: every timed GPU probe, over three judgements, runs on the same GPU, the
    timing bundle's, so an A/B pair never compares two devices; with a single GPU in the cluster, the
    other GPU probe runs too (in the bundle, never waiting for a GPU the bundle holds); the bundle is
    released with the executor."""
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    tree, manifest = _nodes_tree(tmp_path, TIMING_MANIFEST)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": gpus})
    try:
        with RayExecutor(address=cluster.address, grace_s=60) as ex:
            stamps = []
            for _ in range(3):
                results = {r.probe: r for r in Runner(tree, manifest, jobs=4, use_cache=False,
                                                      cache_dir=str(tmp_path / "c"), executor=ex).run(manifest.probes)}
                # each ran (or, without a real device, skipped) after Ray gave the task its GPU
                assert all(_ran_as_the_host_allows(results[p]) for p in ("t.a", "t.b", "t.c", "t.check")), \
                    {p: (r.status, r.reason) for p, r in results.items()}
                assert results["t.cpu"].status == Status.passed and "#" not in results["t.cpu"].ran_on
                stamps += [results[p].ran_on for p in ("t.a", "t.b", "t.c")]
                assert "#" in results["t.check"].ran_on
            assert len(set(stamps)) == 1 and " #" in stamps[0], stamps  # one GPU for every timing
            assert any(g["state"] == "CREATED" for g in placement_group_table().values())
        ray.init(address=cluster.address)  # the executor disconnected: look again from outside
        assert all(g["state"] == "REMOVED" for g in placement_group_table().values())
    finally:
        ray.shutdown()
        cluster.shutdown()
