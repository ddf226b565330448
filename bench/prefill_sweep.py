"""The chunked prefill's launch knobs on a GPU, each timed as a whole prefill beside fla in the same run.

    python bench/prefill_sweep.py --out DIR [--tokens 4096,32768] [--variants default,...] [--wide]

``target_stack/ops/kda/chunk.py`` launches four kernels (diagonal blocks, solve, state recurrence,
output).  Each variant below changes one or two of their launch shapes (``chunk.LAUNCH``, the state
kernel's value tile or pipeline stages) and is checked against float64 before it is timed; every
variant is one whole prefill (B=1, H=16, K=V=128, bf16; CUDA-graph replays over input sets larger
than L2), three rounds interleaved across the variants and fla (median; the rounds' spread is the
noise).  A per-kernel device-time profile of today's prefill and of fla's follows, so a gap points
at a kernel.  Writes prefill_sweep.json with every row.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import pathlib
import statistics
import sys
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, K, V = 16, 128, 128
ROUNDS = 3
#: name -> overrides: chunk.LAUNCH keys, or "state_bv" (the state kernel's value tile, fixed) and
#: "state_stages" (its pipeline stages, fixed)
VARIANTS = {
    "default": {},
    "state BV32": {"state_bv": 32},
    "state BV64": {"state_bv": 64},
    "state BV16 w8": {"state_bv": 16, "state_warps": 8},
    "state stages 4": {"state_stages": 4},
    "output w8": {"output_warps": 8},
    "output BV128": {"output_bv": 128},
    "earlier launch: state BV32 + output w8": {"state_bv": 32, "output_warps": 8},
}
#: more of the space, with ``--wide``
WIDE = {
    "state w2": {"state_warps": 2},
    "state w8": {"state_warps": 8},
    "state stages 2": {"state_stages": 2},
    "output BV32": {"output_bv": 32},
    "diag heads 1": {"diag_heads": 1},
    "diag heads 4": {"diag_heads": 4},
    "diag warps 2": {"diag_warps": 2},
    "solve warps 8": {"solve_warps": 8},
}


@contextlib.contextmanager
def applied(overrides: dict):
    """chunk.py's launch as ``overrides`` sets it, restored afterwards (also on an error)."""
    import target_stack.ops.kda.chunk as C

    unknown = set(overrides) - set(C.LAUNCH) - {"state_bv", "state_stages"}
    if unknown:
        raise KeyError(f"unknown launch knob(s) {sorted(unknown)}: chunk.LAUNCH has {sorted(C.LAUNCH)}")
    saved = dict(C.LAUNCH), C.state_tile, C.state_stages
    try:
        C.LAUNCH.update({k: v for k, v in overrides.items() if k in C.LAUNCH})
        if "state_bv" in overrides:
            C.state_tile = lambda BV, V_, rows, device, bv=overrides["state_bv"]: bv
        if "state_stages" in overrides:
            C.state_stages = lambda *a, n=overrides["state_stages"], **kw: n
        yield
    finally:
        C.LAUNCH.clear()
        C.LAUNCH.update(saved[0])
        C.state_tile, C.state_stages = saved[1], saved[2]


def prefill_call(s: dict, precision: str):
    """A call of the chunked prefill's launches on one input set (q, k, v, g, beta, cu, chunks)."""
    from target_stack.ops.kda.chunk import chunk_kda_fwd

    kk = s["q"].shape[-1]
    return lambda: chunk_kda_fwd(s["q"], s["k"], s["v"], s["g"], s["beta"], kk**-0.5, None, True, s["cu"],
                                 s["chunks"], precision)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for prefill_sweep.json")
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--variants", default=None, help=f"comma-separated, of {', '.join({**VARIANTS, **WIDE})}")
    ap.add_argument("--wide", action="store_true", help="also the variants of WIDE")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("prefill_sweep: needs a GPU (kernel times under the interpreter mean nothing)", file=sys.stderr)
        return 2
    import target_stack.ops  # noqa: F401
    from target_stack.bench.kda import _fla
    from target_stack.bench.timing import copy_bandwidth, graph_time, kernel_times, rotations
    from target_stack.ops.kda import naive_chunk_kda
    from target_stack.ops.kda.chunk import CHUNK_SIZE, prepare_chunks
    from target_stack.ops.kda.testing import make_inputs, rel_err
    from target_stack.ops.utils import resolve_dot_precision

    space = {**VARIANTS, **(WIDE if args.wide else {})}
    if args.variants:
        names = args.variants.split(",")
        if missing := [n for n in names if n not in {**VARIANTS, **WIDE}]:
            print(f"prefill_sweep: unknown variant(s) {missing}", file=sys.stderr)
            return 2
        space = {n: {**VARIANTS, **WIDE}[n] for n in names}
    fla = _fla()
    precision = resolve_dot_precision(None, torch.device("cuda"))
    copy_bw = copy_bandwidth()
    result = dict(date=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                  device=torch.cuda.get_device_name(0), torch=torch.__version__, copy_TBps=copy_bw / 1e12,
                  fla=bool(fla), rows=[], profiles={})
    print(f"prefill launch sweep on {result['device']}, copy {copy_bw / 1e12:.2f} TB/s, B=1, H={H}, K=V={K}, bf16")
    for T in (int(t) for t in args.tokens.split(",")):
        nbytes = T * H * (2 * K * 2 + K * 4 + 2 * V * 2 + 4)
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        chunks = prepare_chunks(cu, CHUNK_SIZE)
        sets = []
        for _ in range(rotations(nbytes, cap=16)):
            q, k, v, g, beta = make_inputs(1, T, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
            sets.append(dict(q=q, k=k, v=v, g=g.float(), beta=beta.float(), cu=cu, chunks=chunks))
        s0 = sets[0]
        ro, rs = naive_chunk_kda(*(s0[n].double() for n in ("q", "k", "v", "g", "beta")), output_final_state=True)
        entries = {name: (lambda s, over=over: prefill_call(s, precision), over) for name, over in space.items()}
        if fla:
            entries["fla"] = (lambda s: (lambda: fla[0](s["q"], s["k"], s["v"], s["g"], s["beta"],
                                                        output_final_state=True)), {})
        errs, ok = {}, []
        for name, (make, over) in entries.items():
            try:
                with applied(over):
                    o, st = make(s0)()
                errs[name] = (rel_err(o, ro), rel_err(st, rs))
            except Exception as exc:  # noqa: BLE001 - a launch that fails is a row, not a crash
                print(f"  T={T} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            if errs[name][0] > 1e-2 or errs[name][1] > 1e-2:
                print(f"  T={T} {name}: WRONG, errors {errs[name][0]:.1e} / {errs[name][1]:.1e}", flush=True)
                continue
            ok.append(name)
        times: dict = {name: [] for name in ok}
        for _ in range(ROUNDS):
            for name in ok:
                make, over = entries[name]
                with applied(over):
                    times[name].append(graph_time([make(s) for s in sets]) * 1e6)
        base = statistics.median(times["fla"]) if "fla" in times else None
        print(f"\n{T} tokens ({len(sets)} input sets)")
        print(f"  {'variant':42s} | {'us':>8} | noise | {'/ fla':>6} | err o / state")
        for name in ok:
            us = statistics.median(times[name])
            noise = (max(times[name]) - min(times[name])) / us
            result["rows"].append(dict(tokens=T, variant=name, us=us, rounds=times[name], noise=noise,
                                       vs_fla=us / base if base else None, rel_err_o=errs[name][0],
                                       rel_err_state=errs[name][1]))
            print(f"  {name:42s} | {us:8.1f} | {noise:5.1%} | {us / base if base else float('nan'):5.3f}x | "
                  f"{errs[name][0]:.1e} / {errs[name][1]:.1e}", flush=True)
        for name in [n for n in ("default", "fla") if n in ok]:
            make, over = entries[name]
            calls = [make(s) for s in sets[:4]]
            with applied(over), warnings.catch_warnings():  # torch: one profiling cycle keeps its own events
                warnings.simplefilter("ignore", UserWarning)
                per_round = kernel_times(lambda: [c() for c in calls], calls=3)  # warm: the graphs ran them
            prof = {k: us / len(calls) for k, (us, _) in sorted(per_round.items(), key=lambda kv: -kv[1][0])}
            result["profiles"][f"{name} {T}"] = prof  # device us per prefill
            print(f"  kernels of {name}: " + ", ".join(f"{k.split('(')[0][:40]} {us:.1f}" for k, us in
                                                        list(prof.items())[:6]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_sweep.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'prefill_sweep.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
