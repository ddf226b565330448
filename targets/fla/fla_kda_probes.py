"""flash-linear-attention's KDA kernels: microbenchmarks at the shapes a server runs (GPU only), and the
decode kernel's correctness on any machine.

``decode_bench``: one pooled decode step (``fused_recurrent_kda_fwd``, the state updated in place in a
pool of slots, q/k normalised in the kernel) for ``batch`` sequences, H=32, K=V=128; ``prefill_bench``:
``chunk_kda`` over ``T`` tokens.  Both are timed by the harness (``ctx.timed``: fresh inputs for every
timed call, outputs re-checked after timing against the float64 KDA recurrence of this project's
reference, a roofline floor at the copy bandwidth measured beside them), and report the bandwidth of
their compulsory bytes against that copy.  The kernels come from the tree under test; the float64
reference from ``target_stack`` (the bundled target's, whose conventions fla's kernels were checked
against side by side on the H200, bench/RESULTS.md).
"""

from __future__ import annotations

import contextlib

import torch
from fla_tree import from_tree

from feedback.probe import ProbeContext, probe


def _inputs(batch: int, T: int, H: int, K: int, V: int):
    from target_stack.ops.kda.testing import make_inputs

    q, k, v, g, beta = make_inputs(batch, T, H, K, V, dtype=torch.bfloat16, device="cuda", decay_shift=3.0)
    return q, k, v, g.float(), beta.float()


def decode_errors(inputs, state, out) -> tuple[float, float]:
    """(state, output) relative errors of one decode step against the float64 recurrence: ``inputs`` are
    (q, k, v, g, beta, the states before the step), q and k normalised here as the kernel does."""
    from target_stack.ops.kda import naive_recurrent_kda
    from target_stack.ops.kda.testing import rel_err

    q, k, v, g, beta, before = inputs
    qn, kn = (torch.nn.functional.normalize(t.double(), dim=-1) for t in (q, k))
    ro, rs = naive_recurrent_kda(qn, kn, v.double(), g.double(), beta.double(), initial_state=before.double(),
                                 output_final_state=True)
    return rel_err(state, rs), rel_err(out, ro)


@probe(kind="microbench")
def decode_bench(ctx: ProbeContext) -> None:
    if not torch.cuda.is_available():
        ctx.skip("timings need a GPU")
    fused_recurrent_kda_fwd = from_tree("fla.ops.kda.fused_recurrent", ctx.tree).fused_recurrent_kda_fwd

    p = ctx.params
    B, H, K, V = p["batch"], p.get("H", 32), p.get("K", 128), p.get("V", 128)
    slots = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")

    def make(i: int):
        return (*_inputs(B, 1, H, K, V), torch.randn(B + 1, H, K, V, device="cuda") * 0.1)

    def step(q, k, v, g, beta, pool):
        return fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                                       ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)

    def check(before, after, out) -> float:
        state_err, out_err = decode_errors((*before[:5], before[5][1:]), after[-1][1:],
                                           out[0] if isinstance(out, tuple) else out)
        return max(state_err, out_err / 30)  # the state fp32, the output bf16

    nbytes = 2 * B * H * K * V * 4 + B * H * (3 * K * 2 + K * 2 + 2 * V * 2)
    t = ctx.timed("step", make=make, call=step, check=check, bytes_moved=nbytes,
                  file="fla/ops/kda/fused_recurrent.py", symbol="fused_recurrent_kda_fwd", condition=f"batch {B}")
    ctx.metric("bandwidth_vs_copy", nbytes / t.median_s / t.copy_bytes_per_s, better="higher")


@probe(kind="correctness")
def decode_correctness(ctx: ProbeContext) -> None:
    """One pooled decode step of fla's kernel (``fused_recurrent_kda_fwd``, q/k normalised in the kernel) against
    the float64 recurrence, on the probe's device: Triton's interpreter on a CPU (fp32 inputs there, whose dots
    the interpreter computes reliably), natively elsewhere.  Fresh inputs per call, the output poisoned
    first, the null slot (0) poisoned too and checked untouched; ``batches`` sequences of H heads at K = V =
    128, where a launch change (the V tile, the warps) takes effect.  What keeps a change to the decode launch
    honest where the GPU benchmarks cannot run."""
    from feedback.correctness import fresh_generator

    gen = fresh_generator(device=ctx.device)
    worst = max(_checked_step(ctx, B, gen) for B in ctx.params.get("batches", [3]))
    ctx.metric("max_rel_err", worst, better="lower")


@probe(kind="trace")
def decode_work(ctx: ProbeContext) -> None:
    """What one pooled decode step of fla's kernel does, counted under Triton's interpreter
    (``feedback.workcount``), kernel by kernel: bytes loaded and stored, divisions, special functions and dot
    products per (sequence, head), launches.  Counted metrics: the verdict judges them against the base
    exactly, so a launch change that makes every V tile reload q and k (or stops it) shows on a CPU.  The
    counted step is checked against float64 as ``decode_correctness`` checks it."""
    from feedback.correctness import fresh_generator
    from feedback.workcount import WorkCount, report

    B, H = ctx.params.get("batch", 3), ctx.params.get("H", 2)
    with WorkCount() as wc:  # counts Triton launches only: the inputs and the float64 reference are torch's
        err = _checked_step(ctx, B, fresh_generator(device=ctx.device))
    ctx.metric("max_rel_err", err, better="lower")
    report(ctx, wc, per=B * H, unit="head", kernel_location=lambda kernel: dict(
        file=DECODE_FILE, condition=f"one pooled decode step, batch {B}, H={H}"))


DECODE_FILE = "fla/ops/kda/fused_recurrent.py"


@probe(kind="trace")
def decode_launches(ctx: ProbeContext) -> None:
    """What one pooled decode call of fla launches from the host, counted on any machine
    (``feedback.launchcount``): aten ops (copies, conversions, allocations that fill), Triton launches and host
    syncs, per fla function.  The totals are counted metrics, judged against the base exactly, so a wrapper
    change that adds a copy or a sync before the kernel shows on a CPU, at its function; the counted step is
    checked against float64 as ``decode_correctness`` checks it."""
    from feedback.correctness import fresh_generator
    from feedback.launchcount import LaunchCount, report

    B = ctx.params.get("batch", 3)
    lc = LaunchCount(ctx.tree, within=["fla/"])
    err = _checked_step(ctx, B, fresh_generator(device=ctx.device), counter=lc)
    ctx.metric("max_rel_err", err, better="lower")
    report(ctx, lc, per=1, unit="step")


def _checked_step(ctx: ProbeContext, B: int, gen: torch.Generator, counter=None) -> float:
    """One pooled decode step of ``B`` sequences against float64 (the state and the output, the null slot
    untouched); its relative error.  ``counter``: a context the call alone runs in (a launch count)."""
    fused_recurrent_kda_fwd = from_tree("fla.ops.kda.fused_recurrent", ctx.tree).fused_recurrent_kda_fwd
    from target_stack.ops.kda.testing import make_inputs

    p = ctx.params
    H, K, V, tol = p.get("H", 2), p.get("K", 128), p.get("V", 128), float(p.get("tolerance", 1e-5))
    dtype = torch.float32 if ctx.device == "cpu" else torch.bfloat16
    q, k, v, g, beta = make_inputs(B, 1, H, K, V, dtype=dtype, decay_shift=3.0, generator=gen, device=ctx.device)
    g, beta = g.float(), beta.float()
    pool = torch.randn(B + 1, H, K, V, generator=gen, device=ctx.device) * 0.1
    pool[0] = float("nan")  # the null slot: never read, never written
    before = pool[1:].clone()
    slots = torch.arange(1, B + 1, dtype=torch.int32, device=ctx.device)
    out = torch.full_like(v, float("nan"))
    with counter if counter is not None else contextlib.nullcontext():
        o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                                       ssm_state_indices=slots, use_qk_l2norm_in_kernel=True, out=out)
    state_err, out_err = decode_errors((q, k, v, g, beta, before), pool[1:], o)
    err = max(state_err, out_err / (1.0 if dtype == torch.float32 else 30.0))  # a bf16 output's rounding
    where = dict(file=DECODE_FILE, symbol="fused_recurrent_kda_fwd",
                 condition=f"one pooled decode step, batch {B}, H={H}, K={K}, V={V}, {str(dtype)[6:]} inputs")
    ctx.check(err < tol, f"rel. error {err:.2e} > {tol:g} against the float64 recurrence", **where)
    ctx.check(bool(pool[0].isnan().all()), "the null slot (0) was written", **where)
    return err


@probe(kind="microbench")
def prefill_bench(ctx: ProbeContext) -> None:
    if not torch.cuda.is_available():
        ctx.skip("timings need a GPU")
    chunk_kda = from_tree("fla.ops.kda.chunk", ctx.tree).chunk_kda

    from target_stack.ops.kda import naive_chunk_kda
    from target_stack.ops.kda.testing import rel_err

    p = ctx.params
    T, H, K, V = p["T"], p.get("H", 16), p.get("K", 128), p.get("V", 128)

    def check(before, after, out) -> float:
        ro, rs = naive_chunk_kda(*(x.double() for x in before), output_final_state=True)
        return max(rel_err(out[0], ro) / 30, rel_err(out[1], rs))

    nbytes = T * H * (2 * K * 2 + K * 4 + 2 * V * 2 + 4)
    # bf16 inputs: fla's chunked form (its intermediates in bf16) ends 3e-3 off the float64 state at 4k
    # tokens on an H200 (bench/RESULTS.md), as target_stack's does; a skipped or stale result is off by O(1)
    t = ctx.timed("prefill", make=lambda i: _inputs(1, T, H, K, V), reps=10, check=check, tol=2e-2, bytes_moved=nbytes,
                  call=lambda *x: chunk_kda(*x, output_final_state=True), file="fla/ops/kda/chunk.py",
                  symbol="chunk_kda", condition=f"T={T}")
    ctx.metric("tokens_per_s", T / t.median_s, unit="tok/s", better="higher")
    ctx.metric("bandwidth_vs_copy", nbytes / t.median_s / t.copy_bytes_per_s, better="higher")
