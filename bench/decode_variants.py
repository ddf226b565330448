"""Can a pooled decode step move its fp32 state faster than today's kernel?  (GPU; table + JSON)

    python bench/decode_variants.py            # OUT=DIR for decode_variants.json, BATCHES=16,64,256
    TRITON_INTERPRET=1 python bench/decode_variants.py   # every variant checked against float64 on a CPU

Kernel time from CUDA-graph replays over input sets larger than L2, three rounds interleaved over every
configuration (median; noise = the rounds' spread); every configuration's output and state checked
against float64 first.  Measured on an H200 on 2026-12-03 (bench/RESULTS.md): none beats today's
kernel by more than 1-4.5%, and none passes 85% of copy at batch 64.

Variants (one step, H=32, K=V=128, fp32 pool, bf16 q/k/v, norms + gate in kernel):
  base      today's kernel through fused_recurrent_kda (host picks BV/warps)
  onepass   grid like today; one reduction pass gives h^T k and h^T q (o = h^T q + u (k.q))
  persist   persistent grid (P programs per SM), onepass, next item's state prefetched in registers
  pipe      persistent grid, onepass, tl.range(num_stages=2) (compiler pipelining), no manual prefetch
"""
from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import pathlib
import statistics
import sys

import torch
import triton
import triton.language as tl

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _item(q, k, g, v, beta, pool, slots, dt_bias, it, n_items, H: tl.constexpr, K: tl.constexpr,
          V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr):
    o_k = tl.arange(0, K)
    ok = (tl.zeros([K], dtype=tl.int32) + it) < n_items
    i_v = it % NV
    nh = it // NV
    i_h = nh % H
    i_n = (nh // H).to(tl.int64)
    o_v = i_v * BV + tl.arange(0, BV)
    row = tl.load(slots + i_n + o_k * 0, mask=(o_k == 0) & ok, other=0).to(tl.int64)
    row = tl.max(row)
    m = (tl.zeros([K, BV], dtype=tl.int64) + row) > 0
    ptr = pool + row * H * K * V + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(ptr, mask=m, other=0.0)
    base = (i_n * H + i_h)
    m_k = (o_k < K) & ok
    m_v = (o_v < V) & ((tl.zeros([BV], dtype=tl.int32) + it) < n_items)
    b_q = tl.load(q + base * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + base * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = tl.load(g + base * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + base * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_b = tl.sum(tl.load(beta + base + o_k * 0, mask=m_k & (o_k == 0), other=0.0).to(tl.float32))
    b_bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    return b_h, ptr, m, b_q, b_k, b_g, b_v, b_b, b_bias, base, o_v, i_h


@triton.jit
def _math(b_h, b_q, b_k, b_g, b_v, b_b, b_bias, b_a, scale, ONEPASS: tl.constexpr):
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_g += b_bias
    b_g = b_a * tl.where(b_g > 20.0, b_g, tl.log(1.0 + tl.exp(b_g)))
    b_h *= tl.exp(b_g)[:, None]
    if ONEPASS:
        b_hk, b_hq = tl.reduce((b_h * b_k[:, None], b_h * b_q[:, None]), 0, _add2)
        b_u = b_b * (b_v - b_hk)
        b_h += b_k[:, None] * b_u[None, :]
        b_o = (b_hq + b_u * tl.sum(b_k * b_q)) * scale
    else:
        b_u = b_b * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
    return b_h, b_o


@triton.jit
def _finish(b_h, ptr, m, b_q, b_k, b_g, b_v, b_b, b_bias, base, o_v, i_h, o, a_log, scale, V: tl.constexpr,
            ONEPASS: tl.constexpr):
    """One work item's step once its loads are in: the gate, the update, the output and the state stored."""
    b_a = -tl.exp(tl.load(a_log + i_h).to(tl.float32))
    b_h, b_o = _math(b_h, b_q, b_k, b_g, b_v, b_b, b_bias, b_a, scale, ONEPASS)
    tl.store(o + base * V + o_v, b_o.to(o.dtype.element_ty))
    tl.store(ptr, b_h, mask=m)


@triton.jit
def grid_kernel(q, k, g, v, beta, o, pool, slots, a_log, dt_bias, scale, N,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                ONEPASS: tl.constexpr):
    it = tl.program_id(0)
    n_items = N * H * NV
    b_h, ptr, m, b_q, b_k, b_g, b_v, b_b, b_bias, base, o_v, i_h = _item(
        q, k, g, v, beta, pool, slots, dt_bias, it, n_items, H, K, V, BV, NV)
    _finish(b_h, ptr, m, b_q, b_k, b_g, b_v, b_b, b_bias, base, o_v, i_h, o, a_log, scale, V, ONEPASS)


@triton.jit
def persist_kernel(q, k, g, v, beta, o, pool, slots, a_log, dt_bias, scale, N,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                   ONEPASS: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_items = N * H * NV
    n_h, n_ptr, n_m, n_q, n_k, n_g, n_v, n_b, n_bias, n_base, n_ov, n_ih = _item(
        q, k, g, v, beta, pool, slots, dt_bias, pid, n_items, H, K, V, BV, NV)
    for it in range(pid, n_items, nprog):
        b_h, ptr, m, b_q, b_k, b_g, b_v, b_b, b_bias, base, o_v, i_h = (
            n_h, n_ptr, n_m, n_q, n_k, n_g, n_v, n_b, n_bias, n_base, n_ov, n_ih)
        n_h, n_ptr, n_m, n_q, n_k, n_g, n_v, n_b, n_bias, n_base, n_ov, n_ih = _item(
            q, k, g, v, beta, pool, slots, dt_bias, it + nprog, n_items, H, K, V, BV, NV)
        _finish(b_h, ptr, m, b_q, b_k, b_g, b_v, b_b, b_bias, base, o_v, i_h, o, a_log, scale, V, ONEPASS)


@triton.jit
def pipe_kernel(q, k, g, v, beta, o, pool, slots, a_log, dt_bias, scale, N,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                ONEPASS: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_items = N * H * NV
    for it in tl.range(pid, n_items, nprog, num_stages=STAGES):
        b_h, ptr, m, b_q, b_k, b_g, b_v, b_b, b_bias, base, o_v, i_h = _item(
            q, k, g, v, beta, pool, slots, dt_bias, it, n_items, H, K, V, BV, NV)
        _finish(b_h, ptr, m, b_q, b_k, b_g, b_v, b_b, b_bias, base, o_v, i_h, o, a_log, scale, V, ONEPASS)


def configs(interp: bool):
    if interp:
        return [("base", None, None, None), ("onepass", 32, 1, None), ("grid2", 32, 1, None),
                ("persist", 32, 1, 2), ("pipe", 32, 1, 2)]
    out = [("base", None, None, None)]
    for bv, w in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4)):
        out.append(("onepass", bv, w, None))
    for (bv, w), p in itertools.product(((16, 1), (32, 1), (32, 2), (64, 2), (64, 4)), (4, 8, 16)):
        out.append(("persist", bv, w, p))
    for (bv, w), p in itertools.product(((32, 1), (32, 2), (64, 2)), (4, 8)):
        out.append(("pipe", bv, w, p))
    return out


def launcher(cfg, s, batch, sms, warmup=False):
    from target_stack.ops.kda import fused_recurrent_kda

    name, bv, w, p = cfg
    if name == "base":
        return lambda: fused_recurrent_kda(s["q"], s["k"], s["v"], s["g"], s["beta"], initial_state=s["pool"],
                                           ssm_state_indices=s["slots"], A_log=s["a_log"], dt_bias=s["dt_bias"],
                                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    nv = triton.cdiv(128, bv)
    items = batch * 32 * nv
    a = (s["q"], s["k"], s["g"], s["v"], s["beta"], s["o"], s["pool"], s["slots"], s["a_log"], s["dt_bias"],
         128**-0.5, batch)
    kw = dict(H=32, K=128, V=128, BV=bv, NV=nv, ONEPASS=name != "grid2", num_warps=w)
    if name in ("onepass", "grid2"):
        kern, grid = grid_kernel, (items,)
    elif name == "persist":
        kern, grid = persist_kernel, (min(items, p * sms),)
    else:
        kern, grid = pipe_kernel, (min(items, p * sms),)
        kw["STAGES"] = 2
    if warmup:
        return lambda: kern.warmup(*a, grid=grid, **kw)
    return lambda: kern[grid](*a, **kw)


def main():
    from feedback.correctness import fresh_generator
    from target_stack.ops.kda import kda_gate, naive_recurrent_kda
    from target_stack.ops.kda.testing import make_inputs, rel_err
    from target_stack.probes.kda import raw_gate

    interp = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cpu" if interp else "cuda"
    batches = [2] if interp else [int(b) for b in os.environ.get("BATCHES", "16,64,256").split(",")]
    out = pathlib.Path(os.environ.get("OUT", "."))
    gen = fresh_generator(device=dev)
    sms = 4 if interp else torch.cuda.get_device_properties(0).multi_processor_count
    if not interp:
        from target_stack.bench.timing import copy_bandwidth, graph_time, rotations
        copy_bw = copy_bandwidth()
    cfgs = configs(interp)
    rows = []
    for batch in batches:
        state_bytes = batch * 32 * 128 * 128 * 4
        nbytes = 2 * state_bytes + batch * 32 * (3 * 128 * 2 + 128 * 4 + 2 * 128 * 2)
        n_sets = 1 if interp else rotations(state_bytes, cap=128)
        sets = []
        for _ in range(n_sets):
            q, k, v, _, _ = make_inputs(batch, 1, 32, 128, 128, dtype=torch.float32 if interp else torch.bfloat16,
                                        device=dev)
            q, k = (3 * torch.randn_like(t) for t in (q, k))
            raw, a_log, dt_bias = raw_gate(batch, 1, 32, 128, gen)
            sets.append(dict(q=q, k=k, v=v, g=raw, beta=torch.rand(batch, 1, 32, device=dev),
                             pool=torch.randn(batch + 1, 32, 128, 128, device=dev) * 0.1,
                             slots=torch.arange(1, batch + 1, dtype=torch.int32, device=dev), a_log=a_log,
                             dt_bias=dt_bias, o=torch.full((batch, 1, 32, 128), float("nan"), dtype=q.dtype,
                                                           device=dev)))
        s0 = sets[0]
        if not interp:
            with concurrent.futures.ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda c, s0=s0, batch=batch: (launcher(c, s0, batch, sms, warmup=True)()
                                                           if c[0] != "base" else None), cfgs))
        ok, errs = [], {}
        for cfg in cfgs:
            check = {key: t.float() if t.is_floating_point() else t for key, t in s0.items()}
            check["pool"] = s0["pool"].clone()
            check["pool"][0] = float("nan")
            check["o"] = torch.full_like(s0["o"], float("nan"))
            qn, kn = (torch.nn.functional.normalize(t.double(), dim=-1) for t in (check["q"], check["k"]))
            g64 = kda_gate(check["g"].double(), check["a_log"], check["dt_bias"])
            ro, rs = naive_recurrent_kda(qn, kn, check["v"].double(), g64, check["beta"].double(),
                                         initial_state=check["pool"][1:].double(), output_final_state=True)
            try:
                res = launcher(cfg, check, batch, sms)()
                o = res[0] if cfg[0] == "base" else check["o"]
                if not interp:
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            errs[cfg] = (rel_err(o, ro), rel_err(check["pool"][1:], rs), bool(check["pool"][0].isnan().all()))
            print(f"  batch {batch} {cfg}: err o {errs[cfg][0]:.1e} state {errs[cfg][1]:.1e} null kept {errs[cfg][2]}",
                  flush=True) if interp or errs[cfg][1] > 1e-5 else None
            ok.append(cfg)
        if interp:
            continue
        times = {c: [] for c in ok}
        for _ in range(3):
            for c in ok:
                times[c].append(graph_time([launcher(c, s, batch, sms) for s in sets]))
        for c in ok:
            t = statistics.median(times[c])
            rows.append(dict(batch=batch, cfg=list(map(str, c)), us=t * 1e6, bw=nbytes / t / copy_bw,
                             noise=(max(times[c]) - min(times[c])) / t, err_o=errs[c][0], err_s=errs[c][1],
                             null_kept=errs[c][2]))
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["us"])
        base = next(r for r in mine if r["cfg"][0] == "base")
        print(f"batch {batch}: copy {copy_bw / 1e12:.2f} TB/s; base {base['us']:.1f} us {base['bw']:.0%}", flush=True)
        for r in mine[:10]:
            print(f"   {'/'.join(r['cfg']):>22} {r['us']:7.1f} us {r['bw']:4.0%} x{base['us'] / r['us']:.3f} "
                  f"noise {r['noise']:.1%} err {r['err_s']:.1e}", flush=True)
        for name in ("onepass", "persist", "pipe"):
            best = next((r for r in mine if r["cfg"][0] == name), None)
            if best:
                print(f"   best {name}: {'/'.join(best['cfg'])} {best['us']:.1f} us {best['bw']:.0%}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_variants.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(0),
                                                             copy_TBps=copy_bw / 1e12, rows=rows), indent=1))


if __name__ == "__main__":
    main()
