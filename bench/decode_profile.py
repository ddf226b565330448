"""Where one engine decode step spends its GPU time: device time per kernel, measured (issue 18).

    python bench/decode_profile.py [--preset bench] [--batch 1 16] [--steps 20] [--top 25]

``bench/decode_ops.py`` counts what a step launches on any machine; this times it on a GPU.  The bench
preset in bf16 with the engine's default kernels (the fused kernels, and on a GPU the small-batch MoE
experts) prefills ``--batch`` random prompts, then runs the decode step a CUDA graph captures
(``ModelRunner.decode_step(static=True)``) under ``torch.profiler`` for ``--steps`` steps after warm-up,
eagerly, so that every kernel is recorded with its own name.  The same step replayed from a CUDA graph is
timed beside it: the graph removes the host's gaps between kernels, not their device time.  Kernels are
grouped by name and by kind (matmul, Triton by function name, elementwise, copies and conversions,
reductions); the table gives each one's device time per step, its launches per step and its share.
Then the whole ``LLMEngine.step`` with its CUDA graphs: its median wall time beside the graph's replay,
and where the host's share goes (``cProfile``, the functions with the most time of their own; the wait
for the GPU lands in the call that reads the sampled tokens back).
Prints a table; writes JSON to $OUT/decode_profile.json (or bench/out/).
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

MATMUL = re.compile(r"gemm|gemv|cutlass|nvjet|splitK|cublas", re.I)  # cuBLAS / CUTLASS kernel names
#: aten's kernels by the words in their template names, first match wins
KINDS = (("copy/convert", re.compile(r"copy|convert|cast", re.I)),
         ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
         ("reduce", re.compile(r"reduce|softmax|norm|topk|sort|scan|argmax", re.I)))


def kind(name: str) -> str:
    """A kernel's kind from its name.  A Triton kernel is named after its function: no template, namespace
    or argument list (and no "Memcpy"/"Memset", the copy engine's own records)."""
    if MATMUL.search(name):
        return "matmul"
    if re.match(r"Mem(cpy|set)\b", name):
        return "copy/convert"
    if not any(c in name for c in "<:( "):
        return "triton"
    for label, pattern in KINDS:
        if pattern.search(name):
            return label
    return "other"


def bench_model(preset: str):
    """The preset in bf16 on the GPU with the engine's defaults there (the fused kernels): built once and
    shared by every engine below, as the engine benchmark does (a build of the bench preset takes ~22 s)."""
    import torch

    from target_stack.model.model import HybridModel

    model = HybridModel(preset).to(device="cuda", dtype=torch.bfloat16).eval()
    model.set_fused_kernels(True)
    return model


def profile(model, preset: str, batch: int, steps: int, prompt_len: int = 256) -> dict:
    import torch

    from bench.decode_ops import static_step_inputs
    from target_stack.bench.timing import graph_time, kernel_times
    from target_stack.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, cuda_graphs=False, num_pages=2048, num_slots=batch + 1, max_batch=batch,
                       max_model_len=prompt_len + 64)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(torch.randint(0, model.cfg.vocab, (prompt_len,), generator=gen).tolist(),
                           SamplingParams(max_tokens=8))
    while any(not s.output for s in engine.seqs.values()):  # prefill every sequence
        engine.step()
    inputs = static_step_inputs(engine)

    def step():
        return engine.runner.decode_step(*inputs, static=True)  # the step a CUDA graph captures

    with torch.no_grad():
        for _ in range(3):  # compile and warm every kernel outside the profile
            step()
        torch.cuda.synchronize()
        graph_us = graph_time([step]) * 1e6
        t0 = time.perf_counter()
        per_kernel = kernel_times(step, steps)
        eager = (time.perf_counter() - t0) / steps
    rows = sorted(({"kernel": name, "kind": kind(name), "us_per_step": us, "launches_per_step": n}
                   for name, (us, n) in per_kernel.items()), key=lambda r: -r["us_per_step"])
    busy = sum(r["us_per_step"] for r in rows)
    by_kind: dict[str, float] = collections.Counter()
    for r in rows:
        by_kind[r["kind"]] += r["us_per_step"]
        r["share"] = r["us_per_step"] / busy if busy else 0.0
    return {"preset": preset, "batch": batch, "steps": steps, "device_busy_us": busy, "graph_us": graph_us,
            "eager_wall_us": eager * 1e6, "launches_per_step": sum(r["launches_per_step"] for r in rows),
            "by_kind_us": dict(by_kind), "kernels": rows}


def host_profile(model, batch: int, steps: int, top: int, prompt_len: int = 256) -> dict:
    """The engine's whole step with CUDA graphs: median wall per step, and cProfile's top functions."""
    import cProfile
    import pstats
    import statistics

    import torch

    from target_stack.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, cuda_graphs=True, num_pages=2048, num_slots=batch + 1, max_batch=batch,
                       max_model_len=prompt_len + 2 * steps + 32)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        engine.add_request(torch.randint(0, model.cfg.vocab, (prompt_len,), generator=gen).tolist(),
                           SamplingParams(max_tokens=2 * steps + 16))
    while any(not s.output for s in engine.seqs.values()):
        engine.step()
    for _ in range(5):  # capture the graph, warm everything
        engine.step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, calls, own, cum, _callers) in stats.stats.items():
        rows.append({"function": f"{pathlib.Path(file).name}:{line}:{fn}", "calls_per_step": calls / steps,
                     "own_us_per_step": own / steps * 1e6, "cum_us_per_step": cum / steps * 1e6})
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return {"batch": batch, "step_wall_us": statistics.median(walls) * 1e6,
            "step_wall_noise": (max(walls) - min(walls)) / statistics.median(walls), "functions": rows[:top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--moe-form", choices=("token", "expert"), default="token",
                    help="the small-batch MoE experts' form (ops/moe/small_batch.py) in every MoE layer")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("decode_profile: needs a CUDA GPU (the profile times device kernels)", file=sys.stderr)
        return 2
    from target_stack.bench.timing import copy_bandwidth

    copy_bw = copy_bandwidth()
    result = {"date": _dt.datetime.now(_dt.UTC).isoformat(timespec="minutes"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "copy_TBps": copy_bw / 1e12, "runs": []}
    model = bench_model(args.preset)
    for module in model.modules():
        if hasattr(module, "small_batch_form"):
            module.small_batch_form = args.moe_form
    result["moe_form"] = args.moe_form
    print(f"the small-batch MoE experts' form: {args.moe_form}")
    for batch in args.batch:
        run = profile(model, args.preset, batch, args.steps)
        result["runs"].append(run)
        print(f"\n{args.preset} bf16, batch {batch}: graph-replayed step {run['graph_us']:.0f} us; its kernels "
              f"{run['device_busy_us']:.0f} us of device time in {run['launches_per_step']:.0f} launches (eager wall "
              f"{run['eager_wall_us']:.0f} us)")
        print("  by kind: " + ", ".join(f"{k} {v:.0f} us" for k, v in sorted(run["by_kind_us"].items(),
                                                                             key=lambda kv: -kv[1])))
        print(f"  {'us/step':>8} {'share':>6} {'launches':>8}  kernel")
        for r in run["kernels"][:args.top]:
            print(f"  {r['us_per_step']:8.1f} {r['share']:6.1%} {r['launches_per_step']:8.1f}  {r['kernel'][:110]}")
    for batch in args.batch:
        host = host_profile(model, batch, args.steps, args.top)
        result.setdefault("host", []).append(host)
        graph = next(r["graph_us"] for r in result["runs"] if r["batch"] == batch)
        print(f"\n{args.preset} bf16, batch {batch}: LLMEngine.step {host['step_wall_us']:.0f} us (median of "
              f"{args.steps}), its graph's replay {graph:.0f} us; host functions by own time (cProfile's own cost "
              "inflates them):")
        print(f"  {'own us':>8} {'cum us':>8} {'calls':>6}  function")
        for r in host["functions"]:
            print(f"  {r['own_us_per_step']:8.1f} {r['cum_us_per_step']:8.1f} {r['calls_per_step']:6.1f}  "
                  f"{r['function'][:100]}")
    out = pathlib.Path(os.environ.get("OUT", pathlib.Path(__file__).parent / "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_profile.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
