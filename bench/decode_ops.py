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
import collections
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONVERSIONS = {"_to_copy", "copy_", "to"}
# ops that launch no kernel: allocations, and the reshape of a matmul's output
NO_LAUNCH = {"empty", "empty_strided", "new_empty", "empty_like", "new_empty_strided", "_unsafe_view"}
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm"}
SUMMARY = ("total", "matmuls", "conversions", "triton_launches")  # what a side-by-side form reports


def count_step(preset: str, dtype: str, batch: int, prompt: int = 24, fused: bool = True,
               small_batch: bool = False) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import target_stack.ops  # noqa: F401  (the interpreter's choice before triton loads)
    from target_stack.engine import LLMEngine, SamplingParams
    from target_stack.model.model import HybridModel

    stack_root = str(ROOT / "target_stack") + os.sep

    class Count(TorchDispatchMode):
        """Counts every aten op that is not a view, by name and by the target_stack function that called it;
        what a Triton kernel's launch does inside (the interpreter's own tensor work) counts as one launch."""

        def __init__(self) -> None:
            super().__init__()
            self.paused = 0
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.paused and not func.is_view and func.overloadpacket.__name__ not in NO_LAUNCH:
                self.ops[(func.overloadpacket.__name__, _site(stack_root))] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])  # built in it: no fp32 copy
    try:
        model = HybridModel(preset).eval()
    finally:
        torch.set_default_dtype(default)
    if torch.cuda.is_available():  # where there is a GPU the kernels take its tensors (and the MoE its GPU form)
        model = model.cuda()
    from target_stack.model.kda_layer import KDALayer
    from target_stack.model.layers import MoE, RMSNorm
    from target_stack.model.model import SparseAttentionLayer

    for block in model.blocks:  # the GPU's forms: Triton KDA kernels and norms
        if not block.is_attn:
            block.mixer.backend = "triton"
    for module in model.modules():  # the fused kernels (ModelConfig.fused_kernels), or not
        if isinstance(module, RMSNorm | KDALayer | MoE | SparseAttentionLayer):
            module.fused = fused
        if isinstance(module, MoE):  # the two-launch small-batch experts (a GPU takes them with the fused kernels)
            module.small_batch = small_batch
    engine = LLMEngine(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(batch):
        engine.add_request(torch.randint(0, model.cfg.vocab, (prompt,), generator=gen).tolist(),
                           SamplingParams(max_tokens=4))
    while any(not s.output for s in engine.seqs.values()):  # prefill every sequence
        engine.step()
    runner = engine.runner
    args = static_step_inputs(engine)
    with torch.no_grad():  # a first step builds what later steps reuse (stacked expert weights, compiled kernels)
        runner.decode_step(*args, static=True)
    counter = Count()
    launches = collections.Counter()
    restore = []
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    from target_stack.ops.utils import CachedLaunch

    # a launch: Triton's generic path, the interpreter's, or a compiled kernel's own launcher (CachedLaunch,
    # where a GPU has compiled it: it bypasses Triton's run); what one of them calls inside is the same launch
    for owner, attr in ((jit.JITFunction, "run"), (getattr(interp, "InterpretedFunction", None), "run"),
                        (CachedLaunch, "__call__")):
        if owner is None or attr not in vars(owner):
            continue
        original = getattr(owner, attr)

        def run(self, *a, _original=original, **kw):
            if not counter.paused:
                launches[_site(stack_root)] += 1
            counter.paused += 1
            try:
                return _original(self, *a, **kw)
            finally:
                counter.paused -= 1
        setattr(owner, attr, run)
        restore.append((owner, attr, original))
    try:
        with torch.no_grad(), counter:
            runner.decode_step(*args, static=True)
    finally:
        for owner, attr, original in restore:
            setattr(owner, attr, original)
    by_name: collections.Counter = collections.Counter()
    by_site: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (name, site), n in counter.ops.items():
        by_name[name] += n
        kind = "matmul" if name in MATMULS else "conversion" if name in CONVERSIONS else "other"
        by_site[site][kind] += n
    for site, n in launches.items():
        by_site[site]["triton"] += n
    sites = sorted(by_site.items(), key=lambda kv: -sum(kv[1].values()))
    return {"preset": preset, "dtype": dtype, "batch": batch, "layers": len(model.blocks), "fused": fused,
            "small_batch_experts": small_batch,
            "total": sum(by_name.values()), "conversions": sum(by_name[n] for n in CONVERSIONS),
            "matmuls": sum(by_name[n] for n in MATMULS), "triton_launches": sum(launches.values()),
            "by_name": dict(by_name.most_common()), "by_site": {s: dict(c) for s, c in sites}}


def static_step_inputs(engine) -> tuple:
    """(tokens, lengths, slots, block table) of the next decode step of every sequence ``engine`` holds, for
    ``engine.runner.decode_step(*inputs, static=True)``: the form a CUDA graph captures."""
    import torch

    runner = engine.runner
    seqs = list(engine.seqs.values())
    dev = runner.model.embed.device
    return (torch.tensor([s.output[-1] for s in seqs], device=dev), torch.tensor([s.length for s in seqs], device=dev),
            torch.tensor([s.slot for s in seqs], device=dev),
            runner.block_table(seqs, max(-(-s.length // runner.page_size) for s in seqs)))


def _site(root: str) -> str:
    """The innermost target_stack function on the stack (``engine/runner.py:decode_step``), past the
    launch plumbing of ``ops/utils.py`` (a kernel's launch belongs to the op that asked for it)."""
    f = sys._getframe(2)
    plumbing = root + "ops" + os.sep + "utils.py"
    while f is not None:
        if f.f_code.co_filename.startswith(root) and f.f_code.co_filename != plumbing:
            return f"{f.f_code.co_filename[len(root):]}:{f.f_code.co_name}"
        f = f.f_back
    return "?"


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
                  f"and {r['triton_launches']} Triton kernels")
    console.print(f"without the fused kernels: {plain['total']} aten ops ({plain['conversions']} conversions) "
                  f"and {plain['triton_launches']} Triton kernels")
    console.print(f"with the small-batch MoE experts too (a GPU's default): {small['total']} aten ops "
                  f"({small['conversions']} conversions) and {small['triton_launches']} Triton kernels")
    kinds = Table("target_stack function", "matmul", "conversion", "other", "triton", title="where they come from")
    for site, c in list(r["by_site"].items())[:15]:
        kinds.add_row(site, *(str(c.get(k, 0)) for k in ("matmul", "conversion", "other", "triton")))
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
