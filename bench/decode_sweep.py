"""The decode kernel's launch space on a GPU: V tile x warps x cache hints, per batch size and state dtype.

    python bench/decode_sweep.py --out DIR [--batches 1,16,64,256] [--dtypes fp32,bf16]

One pooled decode step of ``target_stack/ops/kda/fused_recurrent.py`` (H=32, K=V=128, bf16 q/k/v,
q/k normalised in the kernel), launched directly with every BV in 16..128 and the warp counts that
fit it (``LAUNCHES``), for the kernel as it is and for variants (``VARIANTS``): the state's load and
store with an ``evict_first`` hint or with ``.cg`` / ``.cs`` cache modifiers (the state is streamed
once per step), or the programs ordered head by head across the slots (the order before 2026-12-05).
Kernel time from CUDA-graph replays over input sets larger than L2; three rounds interleaved
across the configurations (median; the rounds' spread is the noise); state bandwidth against a
device copy measured in the same run; every configuration's output and state checked against
float64 before it is timed.  Prints the best configuration per batch and dtype next to the one the
kernel's host code picks today; writes decode_sweep.json with every row.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import itertools
import json
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, K, V = 32, 128, 128
ROUNDS = 3
# {BV: the warp counts tried}: a [128, BV] fp32 tile needs BV/2 registers a thread at 2 warps, so
# one warp for BV=128 spills and 8 warps for BV=16 leave threads without a column
LAUNCHES = {16: (1, 2), 32: (1, 2, 4), 64: (1, 2, 4), 128: (2, 4, 8)}
SRC = ROOT / "target_stack" / "ops" / "kda" / "fused_recurrent.py"
# the variant's edits: (text in the kernel, replacement); a variant whose text is absent is skipped
VARIANTS = {
    "as is": [],
    "evict_first": [
        ("mask=m_state, other=0.0)", 'mask=m_state, other=0.0, eviction_policy="evict_first")'),
        ("b_h.to(ht.dtype.element_ty), mask=m_state)", 'b_h.to(ht.dtype.element_ty), mask=m_state, '
                                                       'eviction_policy="evict_first")'),
    ],
    # the state load bypasses L1 (.cg) and the store streams (.cs): a state byte is touched once a step
    "cg/cs": [
        ("mask=m_state, other=0.0)", 'mask=m_state, other=0.0, cache_modifier=".cg")'),
        ("b_h.to(ht.dtype.element_ty), mask=m_state)", 'b_h.to(ht.dtype.element_ty), mask=m_state, '
                                                       'cache_modifier=".cs")'),
    ],
    # the launch order before 2026-12-05: programs walk one head across every slot (grid (V tiles, N, H)),
    # where the kernel walks one slot's [H, K, V] state front to back (grid (V tiles, H, N))
    "head-major": [
        ("i_h = tl.program_id(1)", "i_h = tl.program_id(2)"),
        ("i_n = tl.program_id(2).to(tl.int64)", "i_n = tl.program_id(1).to(tl.int64)"),
        ("_launch = CachedLaunch(", "HEAD_MAJOR = True\n_launch = CachedLaunch("),
    ],
}


def load_variants(scratch: pathlib.Path) -> dict:
    out = {}
    for name, edits in VARIANTS.items():
        text = SRC.read_text()
        if any(old not in text for old, _ in edits):
            print(f"  variant {name!r}: its anchor text is not in the kernel; skipped", flush=True)
            continue
        for old, new in edits:
            text = text.replace(old, new)
        path = scratch / f"decode_sweep_{len(out)}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out[name] = mod
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for decode_sweep.json")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("decode_sweep: needs a GPU (kernel times under the interpreter mean nothing)", file=sys.stderr)
        return 2
    import target_stack.ops  # noqa: F401
    from target_stack.bench.timing import copy_bandwidth, graph_time, rotations
    from target_stack.ops.kda import naive_recurrent_kda
    from target_stack.ops.kda.fused_recurrent import _plan
    from target_stack.ops.kda.testing import make_inputs, rel_err

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    batches = [int(b) for b in args.batches.split(",")]
    mods = load_variants(pathlib.Path(tempfile.mkdtemp(prefix="decode_sweep_")))  # kept: Triton reads the source
    copy_bw = copy_bandwidth()
    rows = []
    for dname, batch in itertools.product(args.dtypes.split(","), batches):
        sdt = dtypes[dname]
        esize = torch.finfo(sdt).bits // 8
        state_bytes = batch * H * K * V * esize
        nbytes = 2 * state_bytes + batch * H * (3 * K * 2 + K * 4 + 2 * V * 2)
        sets = []
        for _ in range(rotations(state_bytes, cap=128)):
            q, k, v, g, beta = make_inputs(batch, 1, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
            q, k = (3 * torch.randn_like(t) for t in (q, k))
            pool = (torch.randn(batch + 1, H, K, V, device="cuda") * 0.1).to(sdt)
            o = torch.full((batch, 1, H, V), float("nan"), dtype=torch.bfloat16, device="cuda")
            sets.append(dict(q=q, k=k, v=v, g=g.float(), beta=beta.float(), pool=pool, o=o,
                             slots=torch.arange(1, batch + 1, dtype=torch.int32, device="cuda")))
        # the host code's own choice today, read from its plan
        s0 = sets[0]
        plan = _plan(s0["q"], s0["k"], s0["v"], s0["g"], s0["beta"], s0["pool"], False, s0["slots"], True, False)
        today = (plan[6]["BV"], plan[6]["num_warps"])

        configs = [(name, bv, w) for name in args.variants.split(",") if name in mods
                   for bv, ws in LAUNCHES.items() for w in ws]
        precompile(mods, configs, sets[0])
        errs, ok = {}, []
        qn, kn = (torch.nn.functional.normalize(s0[n].double(), dim=-1) for n in ("q", "k"))
        ro, rs = naive_recurrent_kda(qn, kn, s0["v"].double(), s0["g"].double(), s0["beta"].double(),
                                     initial_state=s0["pool"][1:].double(), output_final_state=True)
        for cfg in configs:
            check = dict(s0, pool=s0["pool"].clone(), o=torch.full_like(s0["o"], float("nan")))
            check["pool"][0] = float("nan")
            try:
                launch(mods[cfg[0]], cfg[1], cfg[2], check)()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a row, not a crash
                print(f"  {dname} batch {batch} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            errs[cfg] = (rel_err(check["o"], ro), rel_err(check["pool"][1:], rs), bool(check["pool"][0].isnan().all()))
            ok.append(cfg)
        times: dict = {cfg: [] for cfg in ok}
        for _ in range(ROUNDS):
            for cfg in ok:
                times[cfg].append(graph_time([launch(mods[cfg[0]], cfg[1], cfg[2], s) for s in sets]))
        for cfg in ok:
            t = statistics.median(times[cfg])
            rows.append(dict(dtype=dname, batch=batch, variant=cfg[0], BV=cfg[1], num_warps=cfg[2],
                             today=(cfg[0] == "as is" and (cfg[1], cfg[2]) == today), kernel_us=t * 1e6,
                             noise=(max(times[cfg]) - min(times[cfg])) / t, bandwidth_vs_copy=nbytes / t / copy_bw,
                             rel_err_o=errs[cfg][0], rel_err_state=errs[cfg][1], null_slot_kept=errs[cfg][2]))
        mine = [r for r in rows if r["dtype"] == dname and r["batch"] == batch]
        best = min(mine, key=lambda r: r["kernel_us"])
        cur = next((r for r in mine if r["today"]), None)
        for r in sorted(mine, key=lambda r: r["kernel_us"])[:6]:
            print(f"    {r['variant']:>11} BV={r['BV']:<3} w={r['num_warps']} {r['kernel_us']:7.1f} us "
                  f"{r['bandwidth_vs_copy']:4.0%} noise {r['noise']:.1%}", flush=True)
        write(args.out, torch, copy_bw, rows)
        print(f"  {dname} batch {batch}: best {best['variant']} BV={best['BV']} w={best['num_warps']} "
              f"{best['kernel_us']:.1f} us ({best['bandwidth_vs_copy']:.0%} of copy); today BV={today[0]} "
              f"w={today[1]} {cur['kernel_us'] if cur else float('nan'):.1f} us", flush=True)
    print(f"\ndecode launch sweep on {torch.cuda.get_device_name(0)}, copy {copy_bw / 1e12:.2f} TB/s, H={H}, K=V={K}")
    print(f"{'state':>5} | {'batch':>5} | {'today':>14} | {'best':>30} | {'best/today':>10} | {'bw':>4} | "
          "noise | max err")
    for dname, batch in itertools.product(args.dtypes.split(","), batches):
        mine = [r for r in rows if r["dtype"] == dname and r["batch"] == batch]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["kernel_us"])
        cur = next((r for r in mine if r["today"]), best)
        err = max(max(r["rel_err_o"], r["rel_err_state"]) for r in mine)
        print(f"{dname:>5} | {batch:>5} | {cur['kernel_us']:>6.1f} us {cur['BV']:>3}/{cur['num_warps']} | "
              f"{best['kernel_us']:>6.1f} us {best['variant']:>11} {best['BV']:>3}/{best['num_warps']} | "
              f"{cur['kernel_us'] / best['kernel_us']:>9.2f}x | {best['bandwidth_vs_copy']:>4.0%} | "
              f"{max(r['noise'] for r in mine):>5.1%} | {err:.1e}")
    write(args.out, torch, copy_bw, rows)
    # the output is bf16 (rounded once: ~2e-3); an fp32 state must match to 1e-5, a bf16 one to its rounding
    bad = [r for r in rows if r["rel_err_o"] > 1e-2 or r["rel_err_state"] > (1e-5 if r["dtype"] == "fp32" else 1e-2)
           or not r["null_slot_kept"]]
    for r in bad:
        print(f"  WRONG: {r['dtype']} batch {r['batch']} {r['variant']} BV={r['BV']} w={r['num_warps']}: "
              f"errors {r['rel_err_o']:.1e}/{r['rel_err_state']:.1e}, null slot kept {r['null_slot_kept']}")
    return 1 if bad else 0


def launch(mod, bv: int, warps: int, s: dict, warmup: bool = False):
    """A call that launches variant ``mod``'s kernel on one input set ``s`` (q, k, v, g, beta, o, pool,
    slots: one pooled decode step, q/k normalised in the kernel) with V tile ``bv`` and ``warps``."""
    import triton

    kern = mod._kda_fused_recurrent_kernel
    batch, _, h, kk = s["q"].shape
    vv = s["v"].shape[-1]
    nv = triton.cdiv(vv, bv)
    grid = (nv, batch, h) if getattr(mod, "HEAD_MAJOR", False) else (nv, h, batch)
    a = (s["q"], s["k"], s["v"], s["g"], s["beta"], s["o"], s["pool"], s["pool"], s["slots"], None, None,
         kk**-0.5, 1)
    kw = dict(H=h, K=kk, V=vv, BK=triton.next_power_of_2(kk), BV=bv, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True,
              USE_SLOTS=True, L2NORM_QK=True, BETA_SIGMOID=False, GATE_IN_KERNEL=False, HAS_DT_BIAS=False,
              num_warps=warps)
    if warmup:
        return lambda: kern.warmup(*a, grid=grid, **kw)
    return lambda: kern[grid](*a, **kw)


def precompile(mods, configs, s) -> None:
    """Compile every configuration at once (Triton's compiler spends most of its time in ptxas, a
    subprocess): the sweep's wall time is then its measurements."""
    import concurrent.futures

    def one(cfg):
        try:
            launch(mods[cfg[0]], cfg[1], cfg[2], s, warmup=True)()
        except Exception:  # noqa: BLE001 - reported when the configuration is run
            pass

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, configs))


def write(out: str, torch, copy_bw: float, rows: list[dict]) -> None:
    """decode_sweep.json, rewritten after every batch: a run cut short keeps what it measured."""
    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "decode_sweep.json").write_text(json.dumps(dict(
        date=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(0),
        torch=torch.__version__, copy_TBps=copy_bw / 1e12, rows=rows), indent=1))


if __name__ == "__main__":
    sys.exit(main())
