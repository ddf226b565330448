"""Probes per minute on the Ray executor against local subprocesses, and its overhead for one verdict.

    python bench/ray_executor.py [--probes 12] [--work 0.5] [--workers 1,2] [--out bench/out]

A synthetic target of N probes, each a real process doing ``--work`` seconds of torch matmuls
(fresh inputs), is judged without the cache by the local runner with ``jobs`` = W and by a local
Ray instance with W CPU workers, for each W: the instance's first judgement (its workers start and
import the harness) and a second one on the same warm workers, timed apart; then one probe alone,
local against Ray (the latency a single verdict pays).  Where there is a GPU, ``--gpu-probes``
probes that declare ``needs_gpu`` too (each gets the GPU through Ray's ``num_gpus=1``; each must
report its work ran there).  One table, also written as JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE = '''
import time, torch
from feedback.probe import probe

@probe
def work(ctx):
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < ctx.params["seconds"]:
        a = torch.randn(256, 256)
        (a @ a).sum().item()
        n += 1
    ctx.metric("iterations", n)


@probe
def gpu_work(ctx):
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < ctx.params["seconds"]:
        a = torch.randn(2048, 2048, device=ctx.device)
        (a @ a).sum().item()
        n += 1
    ctx.metric("iterations", n)
    ctx.metric("on_gpu", float(torch.device(ctx.device).type == "cuda"))
'''


def _target(root: pathlib.Path, probes: int, work: float, gpu: bool = False) -> pathlib.Path:
    (root / "synth").mkdir(parents=True)
    (root / "synth" / "__init__.py").write_text("")
    (root / "synth" / "probes.py").write_text(PROBE)
    lines = ["schema_version: 1", "name: synthetic", "probes:"]
    entry, extra = ("gpu_work", ", needs_gpu: true") if gpu else ("work", "")
    lines += [f"  - {{id: p{i:02d}, kind: correctness, entry: 'synth.probes:{entry}', params: {{seconds: {work}}}, "
              f"covers: {{files: ['synth/probes.py']}}{extra}}}" for i in range(probes)]
    (root / "infra-agent.yaml").write_text("\n".join(lines) + "\n")
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", type=int, default=12)
    ap.add_argument("--work", type=float, default=0.5, help="seconds of work per probe")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--repeats", type=int, default=3, help="single-probe latencies per side")
    ap.add_argument("--gpu-probes", type=int, default=4, help="GPU probes judged local and on Ray, where a GPU is")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = ap.parse_args()
    from feedback.manifest import load_manifest
    from feedback.ray_executor import RayExecutor
    from feedback.runner import Runner

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = _target(pathlib.Path(tmp) / "t", args.probes, args.work)
        manifest = load_manifest(tree)
        for w in [int(x) for x in args.workers.split(",")]:
            t0 = time.perf_counter()
            local = Runner(tree, manifest, jobs=w, use_cache=False, cache_dir=f"{tmp}/c").run(manifest.probes)
            t_local = time.perf_counter() - t0
            with RayExecutor(num_cpus=w) as ex:
                # the first judgement on a fresh instance starts its W worker processes (each imports the
                # harness) and ships the tree: timed apart, then the same probes again on the warm workers
                t0 = time.perf_counter()
                remote = Runner(tree, manifest, jobs=args.probes, use_cache=False, cache_dir=f"{tmp}/c",
                                executor=ex).run(manifest.probes)
                t_cold = time.perf_counter() - t0
                t0 = time.perf_counter()
                warm = Runner(tree, manifest, jobs=args.probes, use_cache=False, cache_dir=f"{tmp}/c",
                              executor=ex).run(manifest.probes)
                t_ray = time.perf_counter() - t0
                one = manifest.probes[:1]
                lat_ray = [_timed(lambda: Runner(tree, manifest, use_cache=False, cache_dir=f"{tmp}/c",
                                                 executor=ex).run(one)) for _ in range(args.repeats)]
            lat_local = [_timed(lambda: Runner(tree, manifest, use_cache=False, cache_dir=f"{tmp}/c").run(
                manifest.probes[:1])) for _ in range(args.repeats)]
            same = [a.status for a in local] == [b.status for b in remote] == [b.status for b in warm]
            rows.append(dict(workers=w, probes=args.probes, local_s=round(t_local, 2), ray_s=round(t_ray, 2),
                             ray_cold_s=round(t_cold, 2), local_per_min=round(60 * args.probes / t_local, 1),
                             ray_per_min=round(60 * args.probes / t_ray, 1),
                             ray_cold_per_min=round(60 * args.probes / t_cold, 1),
                             one_probe_local_s=round(statistics.median(lat_local), 2),
                             one_probe_ray_s=round(statistics.median(lat_ray), 2), same_statuses=same))
    gpu_row = _gpu(args) if args.gpu_probes and _has_gpu() else None
    print(f"\nprobes of {args.work:g}s work each, {platform.node()} ({os.cpu_count()} CPUs)")
    print(f"{'workers':>7} {'local /min':>10} {'ray /min':>9} {'ray first /min':>15} {'one probe local':>16} "
          f"{'one probe ray':>14} same")
    for r in rows:
        print(f"{r['workers']:>7} {r['local_per_min']:>10} {r['ray_per_min']:>9} {r['ray_cold_per_min']:>15} "
              f"{r['one_probe_local_s']:>15}s {r['one_probe_ray_s']:>13}s {r['same_statuses']}")
    if gpu_row:
        print(f"{gpu_row['probes']} GPU probes (needs_gpu, {gpu_row['device']}): local {gpu_row['local_per_min']}/min, "
              f"ray {gpu_row['ray_per_min']}/min; all on the GPU: {gpu_row['all_on_gpu']}; ran on {gpu_row['ran_on']}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_executor.json").write_text(json.dumps(dict(
        date=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), machine=platform.node(),
        cpus=os.cpu_count(), work_s=args.work, rows=rows, gpu=gpu_row), indent=1))
    print(f"written: {out / 'ray_executor.json'}")
    ok = all(r["same_statuses"] for r in rows) and (gpu_row is None or (gpu_row["same_statuses"]
                                                                        and gpu_row["all_on_gpu"]))
    return 0 if ok else 1


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu(args) -> dict:
    """The GPU probes (``needs_gpu``: one GPU each, so one at a time on a one-GPU machine), local against Ray."""
    import torch

    from feedback.manifest import load_manifest
    from feedback.ray_executor import RayExecutor
    from feedback.runner import Runner

    with tempfile.TemporaryDirectory() as tmp:
        tree = _target(pathlib.Path(tmp) / "g", args.gpu_probes, args.work, gpu=True)
        manifest = load_manifest(tree)
        t0 = time.perf_counter()
        local = Runner(tree, manifest, jobs=1, use_cache=False, cache_dir=f"{tmp}/c").run(manifest.probes)
        t_local = time.perf_counter() - t0
        with RayExecutor() as ex:
            t0 = time.perf_counter()
            remote = Runner(tree, manifest, jobs=args.gpu_probes, use_cache=False, cache_dir=f"{tmp}/c",
                            executor=ex).run(manifest.probes)
            t_ray = time.perf_counter() - t0
    on_gpu = [r.metrics.get("on_gpu") for r in local + remote]
    return dict(probes=args.gpu_probes, device=torch.cuda.get_device_name(0),
                local_per_min=round(60 * args.gpu_probes / t_local, 1),
                ray_per_min=round(60 * args.gpu_probes / t_ray, 1),
                same_statuses=[a.status for a in local] == [b.status for b in remote],
                all_on_gpu=all(m is not None and m.value == 1.0 for m in on_gpu),
                ran_on=sorted({r.ran_on or "" for r in remote}))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
