"""target_stack's KDA probes (declared in infra-agent.yaml; protected from patches).

Each is local (bound to the files, kernels and parameters in the manifest), cheap (seconds in
the interpreter) and objective (a float64 reference, a threshold).
"""

from __future__ import annotations

import torch

from feedback.correctness import compare_sweep, error_growth, fresh_generator, partitioned_vs_whole, rel_err
from feedback.probe import ProbeContext, probe

import target_stack.ops  # noqa: F401  (runtime choice before triton loads)
from target_stack.ops.kda import chunk_kda, chunk_kda_cp, fused_recurrent_kda, naive_recurrent_kda
from target_stack.ops.kda.testing import make_inputs
from target_stack.ops.utils import resolve_dot_precision, set_poison

set_poison(True)  # every buffer a wrapper allocates for a kernel starts as NaN

CHUNK = "target_stack/ops/kda/chunk.py"
RECURRENT = "target_stack/ops/kda/fused_recurrent.py"
CP = "target_stack/ops/kda/cp.py"


def _ref(q, k, v, g, beta, h0=None):
    return naive_recurrent_kda(*(t.double() for t in (q, k, v, g, beta)),
                               initial_state=None if h0 is None else h0.double(), output_final_state=True)


def _case_inputs(case: dict, gen: torch.Generator):
    x = make_inputs(case["B"], case["T"], case["H"], case["K"], case["V"], generator=gen,
                    decay_shift=case.get("decay_shift", 0.0))
    h0 = torch.randn(case["B"], case["H"], case["K"], case["V"], generator=gen) if case.get("h0") else None
    return (*x, h0)


def _sweep(ctx: ProbeContext, fn, file: str, kernel: str) -> None:
    tol = float(ctx.params.get("tolerance", 1e-5))
    worst = 0.0
    for case, err in compare_sweep(lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True),
                                   lambda *a: _ref(*a), _case_inputs, ctx.params["cases"]):
        worst = max(worst, err)
        shape = ", ".join(f"{k}={v}" for k, v in case.items())
        ctx.check(err < tol, f"rel. error {err:.2e} > {tol:g} against the float64 reference",
                  file=file, kernel=kernel, condition=shape)
    ctx.metric("max_rel_err", worst, better="lower")


@probe(kind="correctness")
def chunk_correctness(ctx: ProbeContext) -> None:
    _sweep(ctx, chunk_kda, CHUNK, "_kda_intra_block_kernel/_kda_solve_kernel/_kda_state_kernel/_kda_output_kernel")


@probe(kind="correctness")
def recurrent_correctness(ctx: ProbeContext) -> None:
    _sweep(ctx, fused_recurrent_kda, RECURRENT, "_kda_fused_recurrent_kernel")


@probe(kind="correctness")
def cp_correctness(ctx: ProbeContext) -> None:
    """Partitioned prefill equals the unpartitioned one, and both equal float64."""
    c = ctx.params
    gen = fresh_generator()
    x = make_inputs(c["B"], c["T"], c["H"], c["K"], c["V"], decay_shift=c.get("decay_shift", 0.0), generator=gen)
    tol = float(c.get("tolerance", 1e-5))
    ref = _ref(*x)
    outs = {P: chunk_kda_cp(*x, P, output_final_state=True) for P in c["partitions"]}
    worst = 0.0
    for P, err in partitioned_vs_whole(outs.__getitem__, lambda: chunk_kda(*x, output_final_state=True),
                                       c["partitions"]):
        err = max(err, rel_err(outs[P], ref))
        worst = max(worst, err)
        ctx.check(err < tol, f"P={P}: rel. error {err:.2e} > {tol:g} against the unpartitioned prefill "
                  "or float64", file=CP, kernel="chunk_kda_cp", condition=f"num_partitions={P}")
    ctx.metric("max_rel_err", worst, better="lower")


@probe(kind="correctness")
def cp_merge_error_growth(ctx: ProbeContext) -> None:
    """Output error of CP prefill at the default merge precision, along the number of partitions."""
    c = ctx.params
    x = make_inputs(c["B"], c["T"], c["H"], c["K"], c["V"], decay_shift=c["decay_shift"], generator=fresh_generator())
    ref_o = _ref(*x)[0]
    precision = c.get("merge_precision")
    resolved = resolve_dot_precision(precision, x[0].device)
    sizes = c["partitions"]
    errs, growth = error_growth(lambda p: rel_err(chunk_kda_cp(*x, p, merge_precision=precision)[0], ref_o), sizes)
    for p, e in zip(sizes, errs):
        ctx.metric(f"err_p{p}", e, better="lower")
    ctx.metric("error_growth", growth, unit="x", better="lower")
    where = dict(file=CP, kernel="_kda_cp_merge_kernel", param=f"merge_precision={resolved!r}",
                 condition=f"T={c['T']}, decay_shift={c['decay_shift']}")
    max_growth, tol = float(c.get("max_growth", 3.0)), float(c.get("tolerance", 1e-5))
    ctx.check(growth <= max_growth, f"error grows {growth:.0f}x from P={sizes[0]} to P={sizes[-1]}", **where)
    ctx.check(max(errs) < tol, f"rel. error {max(errs):.1e} at P={sizes[errs.index(max(errs))]} > {tol:g}", **where)


@probe(kind="correctness")
def null_slot(ctx: ProbeContext) -> None:
    """A pooled decode step leaves the null slot (0) bit-identical and reads it as zeros."""
    c = ctx.params
    gen = fresh_generator()
    H, K, V = c["H"], c["K"], c["V"]
    pool = torch.randn(5, H, K, V, generator=gen)
    pool[0] = 1e30
    before = pool.clone()
    slots = torch.tensor([3, 0, 1, 0], dtype=torch.int32)
    x = make_inputs(4, 1, H, K, V, generator=gen)
    o, _ = fused_recurrent_kda(*x, initial_state=pool, ssm_state_indices=slots)
    where = dict(file=RECURRENT, kernel="_kda_fused_recurrent_kernel", condition="ssm_state_indices with 0 (padding)")
    changed = not torch.equal(pool[0], before[0])
    ctx.metric("null_slot_changed", float(changed), better="lower")
    ctx.check(not changed, "the null slot 0 was written by a pooled decode step", **where)
    pad_err = rel_err(o[1:2], _ref(*(t[1:2] for t in x))[0])
    ctx.check(pad_err < 1e-5, f"a padded row did not read a zero state (rel. error {pad_err:.1e})", **where)
    untouched = all(torch.equal(pool[i], before[i]) for i in (2, 4))
    ctx.check(untouched, "a slot no row points at was modified", **where)


def _decode_bench(ctx: ProbeContext) -> None:
    import time

    from feedback.microbench import time_fn

    if not torch.cuda.is_available():
        ctx.skip("timings need a GPU (the interpreter's times mean nothing)")
    c = ctx.params
    H, K, V, B = c["H"], c["K"], c["V"], c["batch"]
    x = [t.cuda() for t in make_inputs(B, 1, H, K, V, dtype=torch.bfloat16, device="cpu")]
    pool = torch.randn(B + 1, H, K, V, device="cuda") * 0.1
    slots = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
    step = lambda: fused_recurrent_kda(*x, initial_state=pool, ssm_state_indices=slots)  # noqa: E731
    seconds = time_fn(step)
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / time_fn(lambda: dst.copy_(src))
    state_bw = 2 * pool[1:].numel() * 4 / seconds
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        step()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / 100
    ctx.metric("step_us", seconds * 1e6, unit="us", better="lower")
    ctx.metric("state_TBps", state_bw / 1e12, unit="TB/s", better="higher")
    ctx.metric("bandwidth_vs_copy", state_bw / copy_bw, better="higher")
    ctx.metric("host_overhead_ratio", eager / seconds, better="lower")


@probe(kind="microbench")
def decode_bench(ctx: ProbeContext) -> None:
    _decode_bench(ctx)


@probe(kind="microbench")
def prefill_bench(ctx: ProbeContext) -> None:
    from feedback.microbench import time_fn

    if not torch.cuda.is_available():
        ctx.skip("timings need a GPU (the interpreter's times mean nothing)")
    c = ctx.params
    x = [t.cuda() for t in make_inputs(1, c["T"], c["H"], c["K"], c["V"], dtype=torch.bfloat16)]
    seconds = time_fn(lambda: chunk_kda(*x, output_final_state=True))
    ctx.metric("prefill_us", seconds * 1e6, unit="us", better="lower")
    ctx.metric("tokens_per_s", c["T"] / seconds, unit="tok/s", better="higher")


@probe(kind="trace")
def chunk_trace(ctx: ProbeContext) -> None:
    """torch.profiler over one chunked prefill; the top ops by own time (kernels on a GPU)."""
    from feedback.trace import capture, trace_dir

    c = ctx.params
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = make_inputs(1, c["T"], c["H"], c["K"], c["V"], device=dev)
    summary = capture(lambda: chunk_kda(*x, output_final_state=True), "kda.chunk", out_dir=trace_dir())
    ctx.metric("total_cpu_us", summary.total_cpu_us, unit="us", better="lower")
    if summary.total_cuda_us:
        ctx.metric("total_cuda_us", summary.total_cuda_us, unit="us", better="lower")
    for i, op in enumerate(summary.top[:3]):
        ctx.finding(f"top {i + 1}: {op.name} ({op.device}) {op.self_us:.0f} us, {op.share:.0%} of {op.device} time",
                    file=CHUNK, symbol=op.name)
