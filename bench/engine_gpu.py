"""The engine on a GPU: correctness of the graph-captured decode and its speed against a plain
torch-eager implementation of the same model, side by side in one run (issue 6).

1. tiny preset, fp32, CUDA: greedy outputs of the engine with CUDA graphs, and without, equal a
   full recompute of every sequence;
2. bench preset, bf16: decode throughput at batch 1 / 16 / 64 of
   - plain eager: the same model with KDA through its torch form, MoE as a per-expert loop, no
     graphs, no Triton (what a straightforward torch implementation does), and
   - the engine without the fused kernels: Triton KDA kernels, graph-safe MoE, decode steps
     replayed from CUDA graphs;
   - the engine with ``fused_kernels`` (one-launch norms, router and KDA decode inputs), its graphs
     captured with them, with the MoE's grouped experts;
   - and as configured by default, with the small-batch MoE experts besides (``MoE.small_batch``, set
     with the fused kernels: the chosen experts and the shared one in two launches per layer,
     ops/moe/small_batch.py), its own graphs;
   all through ``LLMEngine.step`` (sampling and scheduling included), median of 20 steps after
   warm-up, same prompts.  The tiny check runs with the fused kernels off and on, and with the
   small-batch experts.
Prints a table; writes JSON to $OUT/engine_gpu.json (or bench/out/).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from target_stack.engine import LLMEngine, SamplingParams
from target_stack.model.layers import MoE
from target_stack.model.model import HybridModel


def check_tiny() -> dict:
    model = HybridModel("tiny").cuda()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 70)]
    refs = []
    for p in prompts:
        seq = list(p)
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq], device="cuda"))[0, -1].argmax()))
        refs.append(seq[len(p):])
    out = {}
    for fused, small in ((False, False), (True, False), (True, True)):
        model.set_fused_kernels(fused)
        set_small_batch(model, small)
        for graphs in (False, True):
            outs = LLMEngine(model, cuda_graphs=graphs).generate(prompts, SamplingParams(max_tokens=6))
            name = f"graphs={graphs},fused={fused}" + (",small_batch=True" if small else "")
            out[name] = [o.tokens for o in outs] == refs
            print(f"tiny fp32 cuda, {name}: equal to recompute: {out[name]}")
    model.set_fused_kernels(False)
    set_small_batch(model, False)
    return out


def set_small_batch(model: HybridModel, on: bool) -> None:
    """The two-launch experts of a decode-sized batch in every MoE layer (``MoE.small_batch``), or not."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.small_batch = on


def set_kda_backend(model: HybridModel, backend: str) -> None:
    """'torch': the plain-eager baseline (KDA in its torch form, the MoE's per-expert loop);
    'triton': the engine's kernels (the MoE's grouped GEMMs where they work)."""
    for block in model.blocks:
        if not block.is_attn:
            block.mixer.backend = backend
        if isinstance(block.ffn, MoE):
            block.ffn.grouped = backend == "triton"


def decode_rate(engine: LLMEngine, batch: int, prompt_len: int, steps: int = 20) -> float:
    gen = torch.Generator().manual_seed(batch)
    ids = [engine.add_request(torch.randint(0, 256, (prompt_len,), generator=gen).tolist(),
                              SamplingParams(max_tokens=steps + 8)) for _ in range(batch)]
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        if rid in engine.seqs:
            engine.cancel(rid)
    engine.step()
    return statistics.median(times)


def compare(batches=(1, 16, 64), prompt_len=256) -> dict:
    t0 = time.time()
    model = HybridModel("bench").to(device="cuda", dtype=torch.bfloat16).eval()
    print(f"bench preset built in {time.time() - t0:.0f} s")
    kw = dict(num_pages=2048, num_slots=max(batches) + 1, max_batch=max(batches), max_model_len=512)
    set_kda_backend(model, "torch")
    eager = LLMEngine(model, cuda_graphs=False, **kw)
    set_kda_backend(model, "triton")
    engine = LLMEngine(model, cuda_graphs=True, **kw)
    fused = LLMEngine(model, cuda_graphs=True, **kw)  # its graphs captured with the fused kernels on
    small = LLMEngine(model, cuda_graphs=True, **kw)  # and these with the small-batch experts besides
    rows = {}
    for b in batches:
        set_kda_backend(model, "torch")
        model.set_fused_kernels(False)  # no Triton in the plain form, and none fused in the engine's first column
        e = decode_rate(eager, b, prompt_len)
        set_kda_backend(model, "triton")
        g = decode_rate(engine, b, prompt_len)
        model.set_fused_kernels(True)  # the default: with the small-batch experts on a GPU
        set_small_batch(model, False)  # the fused kernels with the grouped experts
        f = decode_rate(fused, b, prompt_len)
        set_small_batch(model, True)  # batches past its 16 tokens take the grouped GEMMs as before
        s = decode_rate(small, b, prompt_len)
        rows[b] = {"eager_step_ms": e * 1e3, "engine_step_ms": g * 1e3, "fused_step_ms": f * 1e3,
                   "small_batch_step_ms": s * 1e3, "eager_tok_s": b / e, "engine_tok_s": b / g, "fused_tok_s": b / f,
                   "speedup": e / g, "fused_speedup": e / f, "small_batch_vs_fused": s / f}
        print(f"batch {b:3d}: plain eager {e * 1e3:8.2f} ms/step ({b / e:8.0f} tok/s) | engine {g * 1e3:7.2f} ms/step "
              f"({b / g:8.0f} tok/s) | {e / g:5.2f}x | fused {f * 1e3:7.2f} ms/step ({e / f:5.2f}x) | "
              f"small-batch experts {s * 1e3:7.2f} ms/step ({s / f:5.2f}x of fused)", flush=True)
    return rows


if __name__ == "__main__":
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tiny": check_tiny(), "bench_decode": compare()}
    out = pathlib.Path(os.environ.get("OUT", "bench/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_gpu.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
