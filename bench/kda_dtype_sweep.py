"""chunk_kda over head sizes, varlen batches and dtypes on a GPU, output and state against float64.

The reproducer of the 16-bit V = 32 fault and of the fp16 one (bench/RESULTS.md, 2026-12-05c and d); run
with CUDA_LAUNCH_BLOCKING=1 so a fault is reported at its own launch:
``CUDA_LAUNCH_BLOCKING=1 python bench/kda_dtype_sweep.py [bfloat16 float16 float32]`` (default: all three).
"""

from __future__ import annotations

import itertools
import sys

import torch

from target_stack.ops.kda import chunk_kda, naive_chunk_kda
from target_stack.ops.kda.testing import make_inputs, rel_err

HEADS = ((64, 32), (64, 64), (32, 32), (128, 128), (64, 128), (128, 32), (128, 48), (16, 16), (256, 128),
         (256, 32), (128, 16), (32, 64))


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        print(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}")
        return 2
    dtypes = [DTYPES[n] for n in names] or list(DTYPES.values())
    if not torch.cuda.is_available():
        print("needs a GPU: the interpreter runs the fp32 path for 16-bit inputs too")
        return 2
    bad = 0
    for (K, V), n, T, dt in itertools.product(HEADS, (1, 3), (300, 64), dtypes):
        x = make_inputs(1, T, 5, K, V, dtype=dt, device="cuda", decay_shift=3.0)
        cuts = sorted(torch.randperm(T - 1)[: n - 1].add(1).tolist())
        cu = torch.tensor([0, *cuts, T], dtype=torch.int32, device="cuda")
        try:
            o, s = chunk_kda(*x, output_final_state=True, cu_seqlens=cu if n > 1 else None)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001  (a launch that fails is a row of the table)
            print(f"K={K:3d} V={V:3d} n={n} T={T} {str(dt)[6:]:8s}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
            bad += 1
            continue
        bounds = cu.tolist()
        refs = [naive_chunk_kda(*(t[:, a:b].double() for t in x), output_final_state=True)
                for a, b in zip(bounds, bounds[1:])]
        eo = rel_err(o, torch.cat([r[0] for r in refs], 1))
        es = rel_err(s, torch.cat([r[1] for r in refs], 0))
        wrong = max(eo, es) > (2e-2 if dt != torch.float32 else 1e-4)
        bad += wrong
        print(f"K={K:3d} V={V:3d} n={n} T={T} {str(dt)[6:]:8s}: o {eo:.1e} state {es:.1e}"
              + ("  <-- wrong" if wrong else ""), flush=True)
    print(f"{bad} wrong or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
