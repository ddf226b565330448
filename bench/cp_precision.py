"""Validate the CPU tf32 emulation against real tensor cores on one set of inputs.

    python bench/cp_precision.py --out DIR

On a GPU machine this runs ``chunk_kda_cp`` natively at merge precision tf32 / tf32x3 / ieee for
P = 2, 8, 32, then re-runs the very same inputs in a subprocess under ``TRITON_INTERPRET=1`` with
the emulation of ``feedback.emulation`` (truncation model, and round-to-nearest for contrast),
and prints both error curves against float64 with their ratio.  It also times the bare merge
chain (the 64x64 fp32 affine chain of DESIGN.md) natively and emulated.  Writes
``cp_precision.json`` into DIR.  Without a GPU it runs only the emulated side.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(B=1, T=256, H=2, K=64, V=64)
DECAY_SHIFT = 5.0  # slow forgetting: every partition boundary carries state the merge must get right
PARTS = (2, 8, 32)
PRECISIONS = ("tf32", "tf32x3", "ieee")
CHAIN_LINKS = (2, 8, 32, 128)


def make_case(path: pathlib.Path) -> None:
    import torch

    from target_stack.ops.kda.naive import naive_recurrent_kda
    from target_stack.ops.kda.testing import make_inputs

    gen = torch.Generator().manual_seed(20261130)
    x = make_inputs(**SHAPE, decay_shift=DECAY_SHIFT, generator=gen)
    ro, rs = naive_recurrent_kda(*(t.double() for t in x), output_final_state=True)
    n = 64
    M = torch.linalg.qr(torch.randn(max(CHAIN_LINKS), n, n, dtype=torch.float64, generator=gen))[0]
    M = (M * 0.999).float().contiguous()
    h_local = (torch.randn(max(CHAIN_LINKS), n, n, generator=gen) * 0.05).contiguous()
    torch.save(dict(x=x, ref_o=ro, ref_s=rs, M=M, h_local=h_local), path)


def measure(path: pathlib.Path, device: str, rounding: str | None) -> dict:
    import torch

    import target_stack.ops  # noqa: F401
    from feedback.emulation import dot_precision
    from target_stack.ops.kda import chunk_kda_cp
    from target_stack.ops.kda.cp import merge_states
    from target_stack.ops.kda.testing import rel_err

    case = torch.load(path)
    x = [t.to(device) for t in case["x"]]
    res: dict = {"cp": {}, "chain": {}}
    ctx = dot_precision(rounding) if rounding else _null()
    with ctx:
        for prec in PRECISIONS:
            for P in PARTS:
                o, s = chunk_kda_cp(*x, P, output_final_state=True, merge_precision=prec)
                res["cp"][f"{prec}/{P}"] = {"o": rel_err(o, case["ref_o"]), "state": rel_err(s, case["ref_s"])}
            for L in CHAIN_LINKS:
                M = case["M"][:L].to(device)[None, :, None]  # [N=1, P=L, H=1, K, K]
                hl = case["h_local"][:L].to(device)[None, :, None]
                _, ht = merge_states(M, hl, None, prec)
                ref = torch.zeros(64, 64, dtype=torch.float64)
                for i in range(L):
                    ref = case["M"][i].double() @ ref + case["h_local"][i].double()
                res["chain"][f"{prec}/{L}"] = rel_err(ht[0, 0], ref)
    return res


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/out"))
    ap.add_argument("--worker", choices=["truncate", "nearest"], help=argparse.SUPPRESS)
    ap.add_argument("--case", type=pathlib.Path, help="reuse this input case (e.g. the one a GPU run wrote)")
    ap.add_argument("--native-json", type=pathlib.Path, help="merge the native results of an earlier GPU run")
    ap.add_argument("--skip-emulated", action="store_true", help="GPU side only (emulate later on a CPU)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.case, "cpu", args.worker)))
        return 0

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    case = args.case or args.out / "cp_case.pt"
    if args.case is None:
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                        f"import target_stack.ops; from bench.cp_precision import make_case; "
                        f"import pathlib; make_case(pathlib.Path({str(case)!r}))"], env=env, check=True)
    results: dict = {"shape": SHAPE, "decay_shift": DECAY_SHIFT}
    if args.native_json:
        earlier = json.loads(args.native_json.read_text())
        results.update(device=earlier["device"], native=earlier["native"])
    elif torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name(0)
        results["native"] = measure(case, "cuda", None)
    for rounding in () if args.skip_emulated else ("truncate", "nearest"):
        out = subprocess.run([sys.executable, __file__, "--worker", rounding, "--case", str(case)],
                             env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        results[f"emulated_{rounding}"] = json.loads(out.stdout.strip().splitlines()[-1])
    (args.out / "cp_precision.json").write_text(json.dumps(results, indent=2))

    sides = [k for k in ("native", "emulated_truncate", "emulated_nearest") if k in results]
    print("chunk_kda_cp output error vs float64   (" + ", ".join(sides) + ")")
    for prec in PRECISIONS:
        for P in PARTS:
            vals = [results[s]["cp"][f"{prec}/{P}"]["o"] for s in sides]
            ratio = f"  emulated/native {vals[1] / vals[0]:.2f}" if "native" in results and len(vals) > 1 else ""
            print(f"  {prec:7s} P={P:<3d} " + "  ".join(f"{v:.2e}" for v in vals) + ratio)
    print("merge chain (64x64) error vs float64")
    for prec in PRECISIONS:
        for L in CHAIN_LINKS:
            vals = [results[s]["chain"][f"{prec}/{L}"] for s in sides]
            print(f"  {prec:7s} L={L:<3d} " + "  ".join(f"{v:.2e}" for v in vals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
