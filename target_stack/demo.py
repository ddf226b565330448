"""``python -m target_stack.demo``: the KDA kernels against their float64 references, then the tf32
context-parallel merge case (on a CPU under infra-agent's numerics emulation, where Triton's
interpreter would otherwise compute every dot exactly).

    python -m target_stack.demo [--tokens 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

import target_stack.ops  # noqa: F401 - chooses the interpreter on a CPU before triton loads
from feedback.emulation import dot_precision
from target_stack.ops.kda import chunk_kda, chunk_kda_cp, fused_recurrent_kda, naive_recurrent_kda
from target_stack.ops.kda.testing import make_inputs, rel_err
from target_stack.ops.utils import interpreting


def run_demo(console: Console, tokens: int = 256, seed: int = 0) -> int:

    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = "Triton interpreter on the CPU" if interpreting() else torch.cuda.get_device_name(0)
    console.print(f"[bold]target_stack KDA kernels[/] on {where}")
    gen = torch.Generator(device=device).manual_seed(seed)
    ok = True

    table = Table("kernel", "shape", "rel. error vs float64", "time", "verdict")
    x = make_inputs(2, 100, 2, 32, 16, device=device, decay_shift=3.0, generator=gen)
    ref_o, ref_s = naive_recurrent_kda(*(t.double() for t in x), output_final_state=True)
    runs = [
        ("chunk_kda", lambda: chunk_kda(*x, output_final_state=True)),
        ("fused_recurrent_kda", lambda: fused_recurrent_kda(*x, output_final_state=True)),
        ("chunk_kda_cp P=4", lambda: chunk_kda_cp(*x, 4, output_final_state=True)),
    ]
    for name, fn in runs:
        t0 = time.perf_counter()
        o, s = fn()
        dt = time.perf_counter() - t0
        err = max(rel_err(o, ref_o), rel_err(s, ref_s))
        good = err < 1e-5
        ok &= good
        table.add_row(name, "B=2 T=100 H=2 K=32 V=16", f"{err:.1e}", f"{dt:.2f}s",
                      "[green]pass[/]" if good else "[red]FAIL[/]")
    console.print(table)

    console.print(f"\n[bold]Context-parallel merge precision[/] (T={tokens}, error of the output vs float64)")
    x = make_inputs(1, tokens, 1, 32, 16, device=device, decay_shift=3.0, generator=gen)
    ref_o, _ = naive_recurrent_kda(*(t.double() for t in x), output_final_state=True)
    parts = [p for p in (2, 8, 32) if p <= tokens]
    cp = Table("merge_precision", *[f"P={p}" for p in parts], "growth")
    with dot_precision():
        for precision in ("tf32", "tf32x3", "ieee"):
            errs = [rel_err(chunk_kda_cp(*x, p, merge_precision=precision)[0], ref_o) for p in parts]
            cp.add_row(precision, *[f"{e:.1e}" for e in errs], f"{errs[-1] / errs[0]:.1f}x")
    console.print(cp)
    if interpreting():
        console.print("[dim]tf32 rounding emulated on the CPU by truncating 13 mantissa bits (feedback.emulation);"
                      " without the emulation every row would look exact.[/]")
    console.print("[green]all kernels match their references[/]" if ok else "[red]a kernel failed[/]")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m target_stack.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", "-t", type=int, default=256, help="sequence length of the CP demo (>= 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = ap.parse_args(argv)
    if args.tokens < 16:
        ap.error("--tokens must be at least 16")
    return run_demo(Console(), tokens=args.tokens, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
