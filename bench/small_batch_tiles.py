"""The small-batch MoE experts' launch tiles on a GPU, side by side in one run (issue 18, the engine's step).

At batch 1 the two kernels of ops/moe/small_batch.py launch few programs on the bench preset's shapes
(D=2048, H=1024, top 4 of 32 experts and the shared one): the down kernel one per 64 model dimensions of a
token, 32 programs for a GPU of 132 SMs (the first default; ``default_tiles`` now sizes the tiles from the
token count and the multiprocessors, from this sweep). Each tiling of ``small_batch_experts(tiles=...)`` is
timed here on that layer's shapes at T = 1, 2, 4, 8 and 16 tokens: graph-replayed, rotated over weight sets
larger than the L2 cache, the bytes its experts' weights take over the device's copy bandwidth measured in
the same run, its error against float64 on fresh inputs (outputs poisoned first), and the rounds' spread as
the noise floor. Prints a table; writes JSON to $OUT/small_batch_tiles.json (or bench/out/).

The expert form (``form="expert"``: each chosen expert's rows read once for all the pairs it serves) is timed
in the same rounds; the first row of each token count (the token form's default) is the ratios' base.

    python bench/small_batch_tiles.py [--tokens 1 2 4 8 16] [--rounds 5] [--forms token expert]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

D, H, E, TOP_K = 2048, 1024, 32, 4  # the bench preset's MoE layer (target_stack/model/model.py)
#: (BH, BD, warps) of the gate/up kernel and (BD, BH, warps) of the down kernel: each varied with the other
#: held at the first entry of its list; None: today's default_tiles, and 2026-12-04's first default
GATE_UP = [(16, 256, 4), (16, 512, 4), (8, 1024, 4), (8, 2048, 8), (16, 1024, 8), (32, 256, 4), (32, 512, 8),
           (64, 128, 4)]
DOWN = [(8, 256, 4), (8, 512, 4), (8, 1024, 8), (4, 1024, 4), (16, 256, 4), (16, 512, 8), (32, 128, 4),
        (64, 128, 4)]
TILINGS = [None, (64, 128, 64, 128, 4, 4), (8, 1024, 4, 1024, 4, 4), (8, 1024, 16, 256, 4, 4),
           *[(g[0], g[1], DOWN[0][0], DOWN[0][1], g[2], DOWN[0][2]) for g in GATE_UP],
           *[(GATE_UP[0][0], GATE_UP[0][1], d[0], d[1], GATE_UP[0][2], d[2]) for d in DOWN[1:]]]
#: the expert form (one program per expert and tile over the pairs it serves; tensor-core products, tiles >= 16):
#: its first-guess default and a few neighbours
EXPERT_TILINGS = [None, (16, 256, 32, 128, 4, 4), (64, 128, 64, 128, 4, 4), (32, 256, 128, 64, 8, 4),
                  (32, 128, 32, 256, 4, 8)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--forms", nargs="+", choices=("token", "expert"), default=["token", "expert"])
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("small_batch_tiles: needs a CUDA GPU (the interpreter's timings say nothing)", file=sys.stderr)
        return 2
    from feedback.correctness import fresh_generator, rel_err
    from target_stack.bench.timing import copy_bandwidth, graph_time, rotations
    from target_stack.ops.moe.small_batch import EXPERT_TILES, default_tiles, multiprocessors, small_batch_experts
    from target_stack.ops.utils import poisoning

    gen = fresh_generator(device="cuda")
    copy_bw = copy_bandwidth()
    weight_bytes = (E + 1) * 3 * H * D * 2  # bf16, every expert: a rotation set
    n_sets = rotations(weight_bytes, cap=8)
    sets = [(torch.randn(E + 1, 2 * H, D, device="cuda", generator=gen) * D**-0.5).to(torch.bfloat16)
            for _ in range(n_sets)]
    downs = [(torch.randn(E + 1, D, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
             for _ in range(n_sets)]
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s; {n_sets} weight sets of "
          f"{weight_bytes / 2**20:.0f} MiB", flush=True)
    rows = []
    for T in args.tokens:
        x = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:TOP_K] for _ in range(T)])
        w = torch.rand(T, TOP_K, device="cuda", generator=gen) + 0.1
        # the compulsory bytes: every distinct chosen expert's rows and the shared expert's, once
        read = (torch.unique(idx).numel() + 1) * 3 * H * D * 2
        want = _reference(x, w, idx, sets[0], downs[0])
        times: dict[str, list[float]] = {}
        errs = {}
        variants = [(f, t) for f, ts in (("token", TILINGS), ("expert", EXPERT_TILINGS)) if f in args.forms for t in ts]
        for form, tiles in variants:
            default = EXPERT_TILES if form == "expert" else default_tiles(T, D, H, multiprocessors(x.device))
            name = f"{form} " + ("default " + str(default) if tiles is None else str(tiles))
            with poisoning(True):
                errs[name] = rel_err(small_batch_experts(x, w, idx, sets[0], downs[0], out_dtype=torch.float32,
                                                         tiles=tiles, form=form), want)
            times[name] = []
        with poisoning(False):
            for _ in range(args.rounds):  # the variants interleaved round by round
                for (form, tiles), name in zip(variants, times, strict=True):
                    calls = [lambda g=g, d=d, tiles=tiles, form=form: small_batch_experts(
                        x, w, idx, g, d, out_dtype=x.dtype, tiles=tiles, form=form)
                             for g, d in zip(sets, downs, strict=True)]
                    times[name].append(graph_time(calls))
        base = statistics.median(next(iter(times.values())))
        for name, ts in times.items():
            t = statistics.median(ts)
            rows.append(dict(tokens=T, tiles=name, us=t * 1e6, rounds_us=[v * 1e6 for v in ts],
                             noise=(max(ts) - min(ts)) / t, vs_default=t / base, bandwidth_vs_copy=read / t / copy_bw,
                             rel_err=errs[name]))
            r = rows[-1]
            print(f"T={T:3d} {name:40s} {r['us']:8.1f} us  x{r['vs_default']:.2f} of default  "
                  f"{r['bandwidth_vs_copy']:.2f} of copy  noise {r['noise']:.1%}  err {r['rel_err']:.1e}", flush=True)
    out = pathlib.Path(os.environ.get("OUT", pathlib.Path(__file__).parent / "out"))
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": _dt.datetime.now(_dt.UTC).isoformat(timespec="minutes"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "copy_TBps": copy_bw / 1e12, "shape": dict(D=D, H=H, E=E, top_k=TOP_K),
              "rows": rows}
    (out / "small_batch_tiles.json").write_text(json.dumps(result, indent=2))
    return 0


def _reference(x, w, idx, w_gu, w_down):
    """The layer's definition in float64: each token's chosen experts, weighted, and the shared one (the last)."""
    import torch

    x, w_gu, w_down = x.double(), w_gu.double(), w_down.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate([*idx[t].tolist(), w_gu.shape[0] - 1]):
            scale = w[t, j].double() if j < idx.shape[1] else 1.0
            gate, up = (w_gu[e, :w_gu.shape[1] // 2] @ x[t]), (w_gu[e, w_gu.shape[1] // 2:] @ x[t])
            out[t] += scale * (w_down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


if __name__ == "__main__":
    sys.exit(main())
