"""What one engine decode step launches, counted on any machine: the aten ops it dispatches, by name.

    python bench/decode_ops.py [--preset tiny|bench] [--dtype bf16|fp32] [--batch 1] [--json FILE]

The graph-captured decode step of the bench preset takes 4.6 ms of GPU time at batch 1 against a
~0.35 ms bandwidth floor (bench/RESULTS.md): it is bound by the number of small kernels, not by
bytes.  Each aten op that is not a view launches at least one kernel, so their count is a device-free
proxy for the step's launches; Triton kernels are counted as one launch each.  The table splits them
into matmuls, dtype conversions (``_to_copy``, ``copy_``), the rest and Triton launches, per
target_stack function that issues them, so a change that removes launches shows it here, and where,
before a GPU measures the time.  A table and JSON; no goal.

The step is ``ModelRunner.decode_step(static=True)`` (the form a CUDA graph captures) after one
prefill of a random prompt and one uncounted step, in the forms a GPU runs (Triton KDA kernels and
norms; under the interpreter without a GPU, whose own numpy work is not counted; on a GPU where there is one, where
the MoE takes its GPU form), with the fused kernels (``ModelConfig.fused_kernels``: the one-launch
decode inputs, norms and MoE router, and the two-launch decode attention)
and without them, and with the two-launch small-batch MoE experts besides (on a GPU part of the fused
kernels), side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SUMMARY = ("total", "matmuls", "conversions", "triton_launches", "host_syncs")  # what a side-by-side form reports


def count_step(preset: str, dtype: str, batch: int, prompt: int = 24, fused: bool = True,
               small_batch: bool = False) -> dict:
    """One static decode step of ``batch`` sequences of ``prompt`` tokens, counted (feedback.launchcount)."""
    import torch

    import target_stack.ops  # noqa: F401  (the interpreter's choice before triton loads)
    from feedback.launchcount import LaunchCount
    from target_stack.model.model import HybridModel
    from target_stack.ops.utils import CachedLaunch, poisoning
    from target_stack.probes.step import PLUMBING, WITHIN, cpu_forms, gpu_forms, prefilled, static_step_inputs

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])  # built in it: no fp32 copy
    try:
        model = HybridModel(preset).eval()
    finally:
        torch.set_default_dtype(default)
    if torch.cuda.is_available():  # where there is a GPU the kernels take its tensors (and the MoE its GPU form)
        model = model.cuda()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.cfg.vocab, (prompt,), generator=gen).tolist() for _ in range(batch)]
    with torch.no_grad():
        if not torch.cuda.is_available():
            cpu_forms(model)  # a prefill that is not counted, in the CPU's fast forms
        engine = prefilled(model, prompts)
        gpu_forms(model, fused=fused, small_batch=small_batch)
        runner = engine.runner
        args = static_step_inputs(engine)
        runner.decode_step(*args, static=True)  # a first step builds what later steps reuse
        # a compiled kernel's own launcher (CachedLaunch, where a GPU has compiled it) bypasses Triton's run
        # what a server launches: no poison fills of the kernels' outputs (a probe's, where one turned them on)
        with poisoning(False), LaunchCount(ROOT, within=WITHIN, plumbing=PLUMBING,
                                           launchers=[(CachedLaunch, "__call__")]) as lc:
            runner.decode_step(*args, static=True)
    kinds = lc.kind_totals()
    by_name = lc.by_name()
    return {"preset": preset, "dtype": dtype, "batch": batch, "layers": len(model.blocks), "fused": fused,
            "small_batch_experts": small_batch, "total": lc.total - kinds["triton"],
            "conversions": kinds["conversion"], "matmuls": kinds["matmul"], "triton_launches": kinds["triton"],
            "host_syncs": kinds["host_sync"], "by_name": dict(by_name.most_common()),
            "by_site": {str(site): counts for site, counts in lc.by_site().items()}}


def main() -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", type=pathlib.Path, default=ROOT / "bench" / "out" / "decode_ops.json")
    args = ap.parse_args()
    import concurrent.futures
    import multiprocessing

    from rich.console import Console
    from rich.table import Table

    # each count in a process of its own: the bench preset's model takes most of a 24 GiB machine
    counts = []
    # without the fused kernels, and with the small-batch MoE experts besides (a GPU's default), side by side
    for fused, small in ((True, False), (False, False), (True, True)):
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            counts.append(pool.submit(count_step, args.preset, args.dtype, args.batch, fused=fused,
                                      small_batch=small).result())
    r, plain, small = counts
    r["without_fused_kernels"] = {k: plain[k] for k in SUMMARY}
    r["with_small_batch_experts"] = {k: small[k] for k in SUMMARY}
    console = Console()
    console.print(f"one decode step, preset {r['preset']} ({r['layers']} layers), {r['dtype']}, batch {r['batch']}: "
                  f"{r['total']} aten ops that launch ({r['matmuls']} matmuls, {r['conversions']} conversions) "
                  f"and {r['triton_launches']} Triton kernels; {r['host_syncs']} host syncs")
    console.print(f"without the fused kernels: {plain['total']} aten ops ({plain['conversions']} conversions) "
                  f"and {plain['triton_launches']} Triton kernels")
    console.print(f"with the small-batch MoE experts too (a GPU's default): {small['total']} aten ops "
                  f"({small['conversions']} conversions) and {small['triton_launches']} Triton kernels")
    kinds = Table(title="where they come from")
    kinds.add_column("target_stack function", overflow="fold")
    for k in ("matmul", "conversion", "host_sync", "other", "triton"):
        kinds.add_column(k.replace("_", " "), justify="right")
    for site, c in list(r["by_site"].items())[:15]:
        kinds.add_row(site, *(str(c.get(k, 0)) for k in ("matmul", "conversion", "host_sync", "other", "triton")))
    console.print(kinds)
    names = Table("aten op", "count", title="most dispatched")
    for name, n in list(r["by_name"].items())[:15]:
        names.add_row(name, str(n))
    console.print(names)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=2))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
