"""Per-kernel timing of target_stack's KDA prefill and the decode wrapper's host overhead (GPU).

    python bench/profile_kda.py

A development tool: it times each of chunk_kda's kernels separately across launch
variants, and splits the eager decode call into validation, allocation and launch.
"""

from __future__ import annotations

import itertools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch
from triton.testing import do_bench

import target_stack.ops.kda.chunk as C
from target_stack.bench.timing import kernel_times
from target_stack.ops.kda import fused_recurrent_kda
from target_stack.ops.kda.testing import make_inputs
from target_stack.ops.utils import check_kda_inputs


def prefill(T=4096, H=16, K=128, V=128):
    """The whole prefill over the launch shapes of ``chunk.LAUNCH``, then each kernel's time at the best."""
    q, k, v, g, beta = make_inputs(1, T, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
    g, beta = g.float(), beta.float()
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    chunks = C.prepare_chunks(cu, C.CHUNK_SIZE)
    call = lambda: C.chunk_kda_fwd(q, k, v, g, beta, K**-0.5, None, True, cu, chunks, "tf32x3")  # noqa: E731
    print(f"prefill T={T} H={H} K={K} V={V}: {chunks[0].numel()} chunks")
    default, best = dict(C.LAUNCH), None
    for heads, dwarps, swarps, keys in itertools.product((1, 2, 4, 8), (1, 2, 4), (4, 8), (64, 128)):
        C.LAUNCH.update(diag_heads=heads, diag_warps=dwarps, solve_warps=swarps, solve_keys=keys)
        t = do_bench(call, return_mode="median") * 1e3
        print(f"  {C.LAUNCH}: {t:8.1f} us", flush=True)
        best = min(best or (t, dict(C.LAUNCH)), (t, dict(C.LAUNCH)), key=lambda x: x[0])
    print(f"best {best[1]}: {best[0]:.1f} us (the default {default})")
    C.LAUNCH.update(best[1])
    call()
    for name, (us, _) in sorted(kernel_times(call).items(), key=lambda x: -x[1][0]):
        print(f"  {name}: {us:8.1f} us")
    C.LAUNCH.update(default)


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
    from target_stack.ops.kda import fused_recurrent as FR

    # the launch the call above planned (grid, tiles, flags): the bare launch repeats exactly it
    *_, grid, constexprs, _ = next(iter(FR._plans.values()))
    args = (q, k, v, g, beta, o, pool, pool, slots, None, None, K**-0.5, 1)

    def launch():
        FR._kda_fused_recurrent_kernel[grid](*args, **constexprs)
    print(f"  bare launch      {per_call(launch):6.1f} us")

    print(f"  cached launch on: {FR._launch.enabled}, cached keys {len(FR._launch.compiled)}")
    x = torch.ones(16, device="cuda")
    print(f"  torch x.add_(1)  {per_call(lambda: x.add_(1)):6.1f} us   (the host's floor for one launch)")
    print(f"  current_stream   {per_call(lambda: torch.cuda.current_stream().cuda_stream):6.1f} us")
    compiled, tail, _ = next(iter(FR._launch.compiled.values()))
    flat = list(args) + list(tail)
    stream = torch.cuda.current_stream().cuda_stream
    run = per_call(lambda: compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None,
                                        None, *flat))
    print(f"  compiled.run     {run:6.1f} us")


if __name__ == "__main__":
    decode_overhead()
    if "--decode-only" not in sys.argv:
        prefill()
