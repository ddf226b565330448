"""Probes on a Ray cluster: ``--executor ray [--address ADDR]``.

Each probe run is a Ray task with the resources its manifest entry declares (one CPU; one GPU for a
``needs_gpu`` probe; ``gpus: N`` GPUs of one node reserved together as a placement group, strict pack,
or a skip that says the cluster has no node that large).  On the worker it runs exactly as it does
locally (``Runner.execute``: a subprocess in its own process group, killed at its budget, the
interpreter and the emulation where there is no GPU), so the verdicts are the same; the result cache
stays with the driver, keyed by content as before, and only misses travel.

* The tree travels by content: packed once per tree (a tar of its files, keyed by their hash), put
  in Ray's object store, unpacked once per node into ``$TMPDIR/infra-agent-ray/<hash>``.  A probe
  never sees another candidate's tree.
* Performance probes (microbench, e2e) of one run are pinned to the driver's node, and those that need
  a GPU run in one placement-group bundle of one GPU held for the executor's life (the timing
  bundle), so both sides of every A/B pair are timed on the same device even on a node of several
  GPUs.  Where the cluster has no other GPU, the other GPU probes run in that bundle too (they would
  wait for ever for another); a probe that needs every GPU of a node gets the bundle's back first.
  Every result is stamped with the node, host and device it ran on (``ran_on``; the GPU's index
  among the node's where Ray gave it one), and a run refuses to compare timings of two devices.
* A worker or node that dies mid-probe: Ray retries the task once elsewhere; if that dies too the
  result is an ``error`` naming the node, marked as the machine's failure (never blamed on the
  candidate, never cached), and the run goes on.  A task that outlives its budget is cancelled.
* Each worker process has its own Triton cache (``TRITON_CACHE_DIR``), so candidates compiled in
  parallel do not trample each other's builds.

With no ``address`` a local Ray instance is started for the executor and shut down with it; with one
(``ray start --head``, ``ray up``, KubeRay's head service, or ``auto``) the cluster is joined and left
running.  Every node needs this project installed (``pip install -e ".[cluster]"``) and the same
Python, torch and Triton.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import pathlib
import socket
import tarfile
import tempfile
import threading

from feedback.machine import cpu_cores, driver_gpu_model
from feedback.manifest import Manifest, ProbeSpec
from feedback.models import ProbeResult, Status
from feedback.state import SKIP_PARTS
from feedback.verdict import repeats_for

PERF_KINDS = ("microbench", "e2e")


def pack(tree: pathlib.Path) -> tuple[str, bytes]:
    """(content hash, tar bytes) of the files of ``tree`` (version control, our state and bytecode left out)."""
    tree = pathlib.Path(tree).resolve()
    files = sorted(p for p in tree.rglob("*") if (p.is_file() or p.is_symlink())
                   and SKIP_PARTS.isdisjoint(p.relative_to(tree).parts))
    h = hashlib.sha256()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in files:
            rel = p.relative_to(tree).as_posix()
            h.update(rel.encode() + b"\0")
            h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            tar.add(p, arcname=rel, recursive=False)
    return h.hexdigest()[:20], buf.getvalue()


def unpack(digest: str, data: bytes) -> pathlib.Path:
    """The tree ``digest`` on this node (unpacked once; concurrent tasks wait for the same copy)."""
    home = pathlib.Path(tempfile.gettempdir()) / "infra-agent-ray"
    dest = home / digest / "tree"
    if dest.is_dir():
        return dest
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f"{digest}-", dir=home if home.is_dir() else None))
    home.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(staging, filter="tar") if hasattr(tarfile, "data_filter") else tar.extractall(staging)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(staging, dest)
    except OSError:  # another task on this node got there first: its copy is the same content
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return dest


def where() -> str:
    """This worker's node, host and device, as results are stamped: the GPU's index on its node where Ray
    gave the task one (``NVIDIA H200 #3``), so that timings of two GPUs of one model are not compared."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    gpus = [str(g) for g in ray.get_gpu_ids()]
    model = device_model()
    if gpus and model == "cpu":
        model = "gpu"  # a GPU Ray schedules by that the driver does not list (a logical one, say)
    device = model if not gpus else f"{model} #{'+'.join(gpus)}"
    return f"ray node {node[:12]} ({socket.gethostname()}, {device})"


@functools.cache
def device_model() -> str:
    """This node's GPU model (its first GPU), "cpu" where it has none.  From the NVIDIA driver's own
    record where it is there: a worker that imported torch for this alone would pay seconds of import
    and a CUDA initialisation on its first task, while the probe process imports torch anyway."""
    model = driver_gpu_model()
    if model:
        return model
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no torch on this node: the CPU it is
        pass
    return "cpu"


def probe_task(digest: str, data: bytes, manifest: dict, roots: list[tuple[str, bytes]], spec: dict, emulate: bool,
               extra_env: dict[str, str]) -> tuple[str, bool]:
    """On a Ray worker: one probe, as the local runner would run it.  (result JSON, reported)

    ``roots``: the manifest's ``probe_path`` folders, packed like the tree (a manifest kept outside the
    target travels with its probe modules)."""
    import ray

    from feedback.runner import Runner

    tree = unpack(digest, data)
    nested = [(d, ray.get(b) if isinstance(b, ray.ObjectRef) else b) for d, b in roots]  # not resolved by Ray
    manifest = {**manifest, "probe_path": [str(unpack(d, b)) for d, b in nested]}  # absolute: resolved as given
    m = Manifest.model_validate(manifest)
    cache = pathlib.Path(tempfile.gettempdir()) / "infra-agent-ray" / "triton" / str(os.getpid())
    env = {"TRITON_CACHE_DIR": str(cache), **extra_env}
    result, reported = Runner(tree, m, jobs=1, use_cache=False, emulate=emulate, extra_env=env).execute(
        ProbeSpec.model_validate(spec))
    return result.model_copy(update={"ran_on": where()}).model_dump_json(), reported


class RayExecutor:
    """Runs a runner's probes as Ray tasks (module docstring); use as a context manager, or ``close()``."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None, grace_s: float = 120.0,
                 num_gpus: int | None = None):
        """``num_cpus``, ``num_gpus``: the local instance's (started where there is no ``address``).  Its CPUs are
        by default the cores this process may run on (a container's or ``taskset``'s share, not the host's:
        more would start probes the cores cannot run); Ray finds the GPUs itself by default, and a count it is
        given is logical (tests on a CPU machine)."""
        try:
            import ray
        except ImportError as exc:
            raise RuntimeError("--executor ray needs Ray: pip install -e '.[cluster]'") from exc
        self.ray = ray
        self.connected = not ray.is_initialized()  # this executor connected the driver (and disconnects it)
        self.started = self.connected and address is None  # ... and started the instance (which stops with it)
        if self.connected:
            kwargs = dict(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
            if address is None:
                kwargs.update(num_cpus=num_cpus or cpu_cores())  # the cores this process may use, not the host's
                if num_gpus is not None:
                    kwargs.update(num_gpus=num_gpus)
            ray.init(**kwargs)
        self.grace_s = grace_s
        self._task = ray.remote(probe_task)
        self._trees: dict[str, object] = {}  # content hash -> object ref
        self._lock = threading.Lock()
        self.perf_node = ray.get_runtime_context().get_node_id()  # the driver's node times every A/B pair
        self._timing = None  # the timing bundle's placement group, made when a GPU timing first needs it
        self._timing_lock = threading.Lock()

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Disconnect what this executor connected; a local instance it started stops, a cluster stays up."""
        self._release_timing()
        if self.connected and self.ray.is_initialized():
            self.ray.shutdown()

    def environment_key(self, emulate: bool) -> str:
        """Where this executor's probes run, for the driver's cache: the cluster's machines, not the
        driver's.  A result from the cluster's GPUs is not served to a run on the driver's CPU, nor to a
        cluster whose GPU models changed.  GPU models come from Ray's ``accelerator_type:`` resources
        (``gpu`` where Ray names none); package versions are the driver's (a cluster runs one environment)."""
        from feedback.runner import local_fingerprint

        kinds = set()
        for node in self.ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources", {})
            if res.get("GPU", 0) >= 1:
                kinds.update([k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")] or ["gpu"])
            else:
                kinds.add("cpu")
        gpus = kinds - {"cpu"}
        # the driver's python, torch and triton (a cluster runs one environment); the cluster's machines
        cluster = local_fingerprint(emulate).model_copy(update=dict(
            device="ray:" + "+".join(sorted(kinds)),
            mode="native" if gpus and "cpu" not in kinds else "interpreter" if not gpus else "mixed",
            emulation="truncate" if emulate and "cpu" in kinds else None))
        return cluster.key()

    def _timing_bundle(self, limit: float):
        """The timing bundle: one GPU and one CPU of the driver's node (of the first node with a GPU where
        the driver's has none), made on first use; None where no GPU came free within ``limit`` seconds."""
        with self._timing_lock:
            if self._timing is None:
                alive = [n for n in self.ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1]
                node = next((n for n in alive if n.get("NodeID") == self.perf_node), alive[0] if alive else None)
                if node is None:
                    return None
                self._timing = self._placed({"GPU": 1, "CPU": 1, f"node:{node['NodeManagerAddress']}": 0.001},
                                            max(30.0, limit))
            return self._timing

    def _placed(self, bundle: dict, wait_s: float):
        """A placement group of one ``bundle`` (strict pack) once Ray has reserved it; None (the request
        withdrawn) where it was not free within ``wait_s`` seconds."""
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([bundle], strategy="STRICT_PACK")
        if not group.wait(timeout_seconds=wait_s):
            remove_placement_group(group)
            return None
        return group

    def _release_timing(self) -> None:
        with self._timing_lock:
            if self._timing is not None:
                from ray.util.placement_group import remove_placement_group

                with contextlib.suppress(Exception):  # the cluster may be gone already
                    remove_placement_group(self._timing)
                self._timing = None

    def options(self, spec: ProbeSpec, limit: float = 60.0) -> tuple[dict, object | None]:
        """Ray task options for ``spec`` and the placement group made for it alone (None: none made, or
        the shared timing bundle): resources, the timing bundle for a timed GPU probe, node affinity for
        the other timed probes, the bundle too for a GPU probe where no other GPU exists."""
        opts: dict = {"num_cpus": 1, "num_gpus": 1 if spec.needs_gpu else 0, "max_retries": 1}
        gpus = self.ray.cluster_resources().get("GPU", 0) if spec.needs_gpu else 0
        if spec.needs_gpu and not spec.gpus and gpus < 1:
            return {"skip": "needs a GPU; the cluster has none"}, None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        if spec.gpus:  # N GPUs of one node together: a placement group, strict pack, the task in its bundle
            group, why = self._reserve(spec)
            if group is None:
                return {"skip": why}, None
            opts.update(num_gpus=spec.gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_capture_child_tasks=True))
            return opts, group
        timed = spec.kind in PERF_KINDS
        # with one GPU in the whole cluster, every GPU probe goes to the bundle: a task asking for that GPU
        # outside it would wait for ever once the bundle holds it
        if spec.needs_gpu and (timed or gpus < 2):
            bundle = self._timing_bundle(limit)
            if bundle is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=bundle,
                                                                               placement_group_bundle_index=0)
                return opts, None
        if timed:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.perf_node, soft=False)
        return opts, None

    def _put(self, folder: pathlib.Path) -> tuple[str, object]:
        digest, data = pack(folder)
        if digest not in self._trees:
            self._trees[digest] = self.ray.put(data)
        return digest, self._trees[digest]

    def _tree(self, runner) -> tuple[str, object, list]:
        """The runner's tree and the manifest's probe_path folders in the object store: packed once per
        runner (a judgement's tree does not change while its probes run; the next candidate at the same
        path is another runner), put once per content."""
        with self._lock:
            packed = getattr(runner, "_ray_pack", None)
            if packed is None:
                packed = runner._ray_pack = (*self._put(runner.tree),
                                             [self._put(r) for r in runner.manifest.probe_roots() if r.is_dir()])
            return packed

    def run(self, runner, spec: ProbeSpec) -> tuple[ProbeResult, bool]:
        """One probe on the cluster: (result, whether the probe itself reported it)."""
        digest, ref, roots = self._tree(runner)
        limit = spec.budget_s * repeats_for(spec.kind, spec.repeats) + self.grace_s
        opts, group = self.options(spec, limit)
        if "skip" in opts:
            return ProbeResult(probe=spec.id, status=Status.skipped, reason=opts["skip"]), True
        fut = self._task.options(**opts).remote(digest, ref, runner.manifest.model_dump(), roots,
                                               spec.model_dump(), runner.emulate, runner.extra_env)
        try:
            return self._wait(fut, spec, limit)
        finally:
            if group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group)

    def _reserve(self, spec: ProbeSpec):
        """(placement group of ``spec.gpus`` GPUs on one node, None) or (None, why it cannot be had)."""
        largest = max((n.get("Resources", {}).get("GPU", 0) for n in self.ray.nodes() if n.get("Alive")), default=0)
        if largest < spec.gpus:
            return None, f"needs {spec.gpus} GPUs on one node; the cluster's largest node has {largest:g}"
        if self._timing is not None and spec.gpus > largest - 1:
            self._release_timing()  # it holds one of the GPUs this probe needs together; made again on next use
        group = self._placed({"GPU": spec.gpus, "CPU": 1}, max(30.0, spec.budget_s))
        if group is None:
            return None, f"{spec.gpus} GPUs of one node were not free within {max(30.0, spec.budget_s):g}s"
        return group, ""

    def _wait(self, fut, spec: ProbeSpec, limit: float) -> tuple[ProbeResult, bool]:
        from ray.exceptions import GetTimeoutError, RayError, RayTaskError

        try:
            text, reported = self.ray.get(fut, timeout=limit)
            return ProbeResult.model_validate_json(text), reported
        except GetTimeoutError:
            self.ray.cancel(fut, force=True)
            return ProbeResult(probe=spec.id, status=Status.timeout, environment_failure=True,
                               reason=f"no result from the cluster within {limit:g}s; the task was cancelled"), False
        except RayTaskError as exc:  # the harness's own code raised on the worker
            first = str(exc).strip().splitlines()[-1][:300]
            return ProbeResult(probe=spec.id, status=Status.error, environment_failure=True,
                               reason=f"the probe's task failed on the cluster: {first}"), False
        except RayError as exc:  # a worker or a node died (after Ray's one retry elsewhere)
            return ProbeResult(probe=spec.id, status=Status.error, environment_failure=True,
                               reason=f"the worker running it died: {type(exc).__name__}: "
                                      f"{str(exc).strip().splitlines()[0][:300]}"), False
