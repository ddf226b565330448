"""A real Triton kernel that repeats per-row work in every tile, and a counter that runs it under the
interpreter in a subprocess (TRITON_INTERPRET=1 must be set before triton is imported, on a GPU
machine too): shared by the work-count and the tile-widening tests."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

KERNEL = '''
import torch
import triton
import triton.language as tl


@triton.jit
def rownorm_scale(x, w, out, N: tl.constexpr, BN: tl.constexpr):
    i_n = tl.program_id(0)
    row = tl.program_id(1)
    o = tl.arange(0, N)
    b_x = tl.load(x + row * N + o)
    norm = tl.sqrt(tl.sum(b_x * b_x) + 1e-6)  # per-row work: every tile of the row repeats it
    cols = i_n * BN + tl.arange(0, BN)
    b_w = tl.load(w + row * N + cols)
    tl.store(out + row * N + cols, b_w / norm * tl.exp(b_w))


def run(x, w):
    rows, N = x.shape
    out = torch.empty_like(w)
    BN = 4
    grid = (triton.cdiv(N, BN), rows)
    rownorm_scale[grid](x, w, out, N=N, BN=BN)
    return out
'''

# the same work on a flattened grid (one program axis decomposed in the kernel, as fla's decode launches it)
FLAT_KERNEL = KERNEL.replace(
    "    i_n = tl.program_id(0)\n    row = tl.program_id(1)\n",
    "    pid = tl.program_id(0).to(tl.int64)\n    NT = tl.cdiv(N, BN)\n    i_n, row = pid % NT, pid // NT\n",
).replace("grid = (triton.cdiv(N, BN), rows)", "grid = (triton.cdiv(N, BN) * rows, )")

COUNT = '''
import importlib.util, json, sys
import torch
from feedback.workcount import WorkCount

spec = importlib.util.spec_from_file_location("k", sys.argv[1])
k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k)
g = torch.Generator().manual_seed(int(sys.argv[2]))
x, w = (torch.randn(3, 32, generator=g) for _ in range(2))
with WorkCount(x=x, w=w) as wc:
    out = k.run(x, w)
want = (w.double() / (x.double().square().sum(-1, keepdim=True) + 1e-6).sqrt() * w.double().exp())
err = ((out.double() - want).abs().max() / want.abs().max()).item()
print(json.dumps(dict(reads_x=wc.reads("x"), reads_w=wc.reads("w"), ops=dict(wc.ops), err=err,
                      grids=[list(l.grid) for l in wc.launches], kernels=[l.kernel for l in wc.launches],
                      out_bytes=wc.stored["x"] + wc.stored["w"], kernel_loaded=dict(wc.kernel_loaded),
                      kernel_stored=dict(wc.kernel_stored),
                      kernel_ops={f"{k}.{kind}": n for (k, kind), n in wc.kernel_ops.items()})))
'''


def count(tmp_path: pathlib.Path, kernel_file: pathlib.Path) -> dict:
    script = tmp_path / "count.py"
    script.write_text(COUNT)
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]  # a shadowing triton stays
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(paths))
    seed = int.from_bytes(os.urandom(4), "little")
    proc = subprocess.run([sys.executable, str(script), str(kernel_file), str(seed)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])
