"""Per-kernel timing of target_stack's KDA prefill and the decode wrapper's host overhead (GPU).

    python bench/profile_kda.py

A development tool: it times each of chunk_kda's kernels separately across launch
variants, and splits the eager decode call into validation, allocation and launch.
"""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch
import triton
from triton.testing import do_bench

import target_stack.ops.kda.chunk as C
from target_stack.ops.kda import fused_recurrent_kda
from target_stack.ops.kda.testing import make_inputs
from target_stack.ops.utils import check_kda_inputs


def prefill(T=4096, H=16, K=128, V=128):
    q, k, v, g, beta = make_inputs(1, T, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
    g, beta = g.float(), beta.float()
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    seq, pos, offs = C.prepare_chunks(cu, C.CHUNK_SIZE)
    NT = seq.numel()
    BT, BK = 64, 128
    f32 = dict(dtype=torch.float32, device="cuda")
    gc = torch.empty(1, T, H, K, **f32)
    Akk = torch.empty(1, T, H, BT, **f32)
    Pqk = torch.empty(1, T, H, BT, **f32)
    h, v_new = torch.empty(NT, H, K, V, **f32), torch.empty(1, T, H, V, **f32)
    ht = torch.empty(1, H, K, V, **f32)
    o = torch.empty_like(v)
    scale = K**-0.5
    print(f"prefill T={T} H={H} K={K} V={V}: {NT} chunks")
    def timed(name, fn):
        try:
            print(f"  {name}: {do_bench(fn) * 1e3:8.1f} us")
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__} {str(e)[:100]}")

    timed("cumsum", lambda: C._kda_cumsum_kernel[(NT, H)](g, gc, cu, seq, pos, H=H, K=K, BT=BT, BK=BK))
    for nw in (1, 2, 4, 8):
        for lowp in (True, False):
            timed(f"blocks warps={nw} lowp={lowp}", lambda: C._kda_intra_block_kernel[(NT, 10, H)](
                q, k, gc, Akk, Pqk, cu, seq, pos, scale, H=H, K=K, BT=BT, BC=16, BK=BK, NC=4,
                LOWP=lowp, DOT_PRECISION="tf32x3", num_warps=nw))
    kd = torch.empty(1, T, H, K, dtype=torch.bfloat16, device="cuda")
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    wb, ub = torch.empty(1, T, H, K, **bf16), torch.empty(1, T, H, V, **bf16)
    for nw in (4, 8):
        for lowp in (True,):
            for BV in (32, 64):
                timed(f"solve  warps={nw} lowp={lowp} BV={BV}", lambda: C._kda_solve_kernel[(NT, H)](
                    k, v, beta, gc, Akk, wb, ub, kd, cu, seq, pos, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, LOG2_BT=6,
                    LOWP=lowp, DOT_PRECISION="tf32x3", INV_PRECISION="tf32" if lowp else "tf32x3", num_warps=nw))
    for BV in (32, 64):
        for nw in (4, 8):
            for stages in (1, 2, 3):
                grid = (triton.cdiv(V, BV), 1, H)
                timed(f"state  BV={BV} warps={nw} stages={stages}", lambda: C._kda_state_kernel[grid](
                    kd, gc, wb, ub, v_new, h, None, ht, cu, offs, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                    USE_INITIAL_STATE=False, STORE_FINAL_STATE=True, LOWP=True, DOT_PRECISION="tf32x3",
                    num_warps=nw, num_stages=stages))
    for lowp in (True, False):
        for BV in (32, 64):
            for nw in (4, 8):
                t = do_bench(lambda: C._kda_output_kernel[(triton.cdiv(V, BV), NT, H)](
                    q, gc, Pqk, v_new, h, o, cu, seq, pos, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                    LOWP=lowp, DOT_PRECISION="tf32x3", num_warps=nw))
                print(f"  output lowp={lowp} BV={BV} warps={nw}: {t * 1e3:8.1f} us")


def decode_overhead(N=1, H=32, K=128, V=128):
    q, k, v, g, beta = make_inputs(N, 1, H, K, V, dtype=torch.bfloat16, device="cuda")
    g, beta = g.float(), beta.float()
    pool = torch.randn(N + 1, H, K, V, device="cuda")
    slots = torch.arange(1, N + 1, dtype=torch.int32, device="cuda")

    def per_call(fn, n=2000):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    print(f"decode wrapper, batch {N}")
    full = per_call(lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=slots,
                                                use_qk_l2norm_in_kernel=True))
    print(f"  full call        {full:6.1f} us")
    print(f"  check_kda_inputs {per_call(lambda: check_kda_inputs(q, k, v, g, beta, pool, state_batch=-1)):6.1f} us")
    print(f"  5x contiguous    {per_call(lambda: [x.contiguous() for x in (q, k, v, g, beta)]):6.1f} us")
    print(f"  empty_like       {per_call(lambda: torch.empty_like(v)):6.1f} us")
    o = torch.empty_like(v)
    from target_stack.ops.kda.fused_recurrent import _kda_fused_recurrent_kernel as kern

    def launch():
        kern[(4, N, H)](q, k, v, g, beta, o, pool, pool, slots, K**-0.5, 1, H=H, K=K, V=V, BK=128, BV=32,
                        USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, USE_SLOTS=True, L2NORM_QK=True,
                        BETA_SIGMOID=False, num_warps=4)
    print(f"  bare launch      {per_call(launch):6.1f} us")
    from target_stack.ops.kda import fused_recurrent as FR

    print(f"  cached launch on: {FR._launch.enabled}, cached keys {len(FR._launch.compiled)}")
    x = torch.ones(16, device="cuda")
    print(f"  torch x.add_(1)  {per_call(lambda: x.add_(1)):6.1f} us   (the host's floor for one launch)")
    print(f"  current_stream   {per_call(lambda: torch.cuda.current_stream().cuda_stream):6.1f} us")
    args = (q, k, v, g, beta, o, pool, pool, slots, K**-0.5, 1)
    compiled, tail, _ = next(iter(FR._launch.compiled.values()))
    flat = list(args) + list(tail)
    stream = torch.cuda.current_stream().cuda_stream
    run = per_call(lambda: compiled.run(4, N, H, stream, compiled.function, compiled.packed_metadata, None, None,
                                        None, *flat))
    print(f"  compiled.run     {run:6.1f} us")


if __name__ == "__main__":
    decode_overhead()
    if "--decode-only" not in sys.argv:
        prefill()
