"""Counted work of the decode step's small Triton ops (protected from patches).

Each op (the norm both gated and as the residual stream's add-and-norm) runs once at a decode-sized shape
under Triton's interpreter with ``feedback.workcount`` counting, kernel by kernel, the bytes loaded and
stored, the divisions, special functions and dot products, and the launches (``workcount.report``: counted
metrics, which the verdict judges against the base exactly, on any machine). A change that keeps every
result right but reloads a row in every tile, repeats a reduction, or adds a launch shows as that op's
count.

Inputs are fresh random on every run; what each op's count depends on is fixed (shapes, lengths, and the
experts each token uses), so the same tree counts the same work.  Each result is held to a float64 formula
as well (a kernel that skips work must not count less and pass); the full sweeps of their input conditions
are the ``model.layers`` probe's.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import target_stack.ops  # noqa: F401  (runtime choice before triton loads)
from feedback.correctness import rel_err
from feedback.probe import ProbeContext, probe
from target_stack.probes import reference as ref
from target_stack.probes.reference import f64, finite, isolated

NORM = "target_stack/ops/norm.py"
ROUTE = "target_stack/ops/moe/route.py"
SMALL_BATCH = "target_stack/ops/moe/small_batch.py"
SPARSE_DECODE = "target_stack/ops/sparse_decode.py"
DECODE_INPUTS = "target_stack/ops/kda/decode_inputs.py"

torch.set_num_threads(1)  # small tensors


@probe(kind="trace")
def decode_ops_work(ctx: ProbeContext) -> None:
    """Each op counted once (module docstring); an op that raises or crashes fails at its own file."""
    from feedback.correctness import fresh_generator

    c = ctx.params
    gen = fresh_generator(device=ctx.device)
    tol = float(c.get("tolerance", 1e-5))
    worst = 0.0
    for name, file, run in (("rms_norm", NORM, _norm), ("rms_norm.residual", NORM, _add_norm),
                            ("moe_route", ROUTE, _route),
                            ("small_batch.token", SMALL_BATCH, lambda c, g: _experts(c, g, "token")),
                            ("small_batch.expert", SMALL_BATCH, lambda c, g: _experts(c, g, "expert")),
                            ("sparse_decode", SPARSE_DECODE, _sparse_decode),
                            ("decode_inputs", DECODE_INPUTS, _decode_inputs)):
        done, result = isolated(ctx, lambda name=name, file=file, run=run: _counted(ctx, name, file,
                                                                                     lambda: run(c, gen)),
                                file=file, condition=f"{name}, counted under the interpreter")
        if not done:
            worst = float("inf")
            continue
        err, cond = result
        worst = max(worst, err)
        ctx.check(err < tol, f"{name}: the counted call's result is wrong (rel. error {err:.1e} against float64)",
                  file=file, condition=cond)
    ctx.metric("max_rel_err", finite(worst), better="lower")


def _counted(ctx: ProbeContext, name: str, file: str, run) -> tuple[float, str]:
    """Run one op under the counter; report its counts as ``<name>.<kernel>.*`` per token."""
    from feedback.workcount import WorkCount, report

    wc = WorkCount()
    with torch.no_grad():
        call, check, tokens, cond = run()
        with wc:
            out = call()
        err = check(out)
    report(ctx, wc, per=tokens, unit="token", prefix=f"{name}.",
           kernel_location=lambda kernel: dict(file=file, condition=cond))
    return err, cond


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device)


def _norm(c: dict, gen: torch.Generator):
    from target_stack.ops.norm import rms_norm

    T, D = c["tokens"], c["dim"]
    x, gate = _randn(gen, T, D), _randn(gen, T, D)
    w = torch.rand(D, generator=gen, device=gen.device) + 0.5
    want = ref.rmsnorm(f64(x), f64(w)) * ref.sigmoid(f64(gate))
    return (lambda: rms_norm(x, w, ref.EPS, gate=gate)), (lambda y: rel_err(y, want)), T, \
        f"gated RMSNorm, T={T}, dim={D}"


def _add_norm(c: dict, gen: torch.Generator):
    """The residual stream's add-and-norm (``RMSNorm.add_forward`` on a GPU): (norm(x + res), x + res)."""
    from target_stack.ops.norm import rms_norm

    T, D = c["tokens"], c["dim"]
    x, res = _randn(gen, T, D), _randn(gen, T, D)
    w = torch.rand(D, generator=gen, device=gen.device) + 0.5
    total = f64(x) + f64(res)
    want = ref.rmsnorm(total, f64(w))
    return (lambda: rms_norm(x, w, ref.EPS, residual=res)), \
        (lambda out: max(rel_err(out[0], want), rel_err(out[1], total))), T, f"add-and-norm, T={T}, dim={D}"


def _route(c: dict, gen: torch.Generator):
    from target_stack.ops.moe.route import moe_route

    T, D, E, k = c["tokens"], c["dim"], c["experts"], c["top_k"]
    x, router, bias = _randn(gen, T, D), _randn(gen, E, D) * D**-0.5, 0.1 * _randn(gen, E)
    w_ref, idx_ref, _ = ref.moe_route(f64(x), SimpleNamespace(router=router, router_bias=bias, top_k=k))

    def check(out) -> float:
        w, idx = out
        mine, order = idx.cpu().sort(-1)
        theirs, order_ref = idx_ref.cpu().sort(-1)
        if not torch.equal(mine, theirs):
            return float("inf")  # other experts than the float64 top-k (random scores: no ties to speak of)
        return rel_err(w.cpu().gather(-1, order), w_ref.cpu().gather(-1, order_ref))

    return (lambda: moe_route(x, router, bias, k)), check, T, f"T={T}, dim={D}, experts={E}, top_k={k}"


def _experts(c: dict, gen: torch.Generator, form: str):
    from target_stack.ops.moe.small_batch import small_batch_experts

    T, D, Hd, E, k = c["tokens"], c["dim"], c["hidden"], c["experts"], c["top_k"]
    gu, down = _randn(gen, E + 1, 2 * Hd, D) * D**-0.5, _randn(gen, E + 1, D, Hd) * Hd**-0.5
    x = _randn(gen, T, D)
    w = torch.rand(T, k, generator=gen, device=gen.device) + 0.1
    # each token's experts fixed (every expert used, some by two tokens): what the work depends on
    idx = ((torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % E).to(gen.device)

    def expert(x64, e):
        return ref.swiglu(x64, SimpleNamespace(w_gate=gu[e, :Hd], w_up=gu[e, Hd:], w_down=down[e]))

    x64 = f64(x)
    want = expert(x64, E) + sum(f64(w[:, j:j + 1]) * torch.stack([expert(x64[t:t + 1], int(idx[t, j]))[0]
                                                                    for t in range(T)]) for j in range(k))
    return (lambda: small_batch_experts(x, w, idx, gu, down, form=form)), (lambda y: rel_err(y, want)), T, \
        f"form={form}, T={T}, dim={D}, hidden={Hd}, experts={E}, top_k={k}, shared expert"


def _sparse_decode(c: dict, gen: torch.Generator):
    from target_stack.model.layers import sparse_decode_attention
    from target_stack.ops.sparse_decode import sparse_decode_attention_kernel

    a = c["attention"]
    B, L, H, D, Di, blk, top_k, window = (a[n] for n in ("batch", "L", "H", "D", "Di", "block", "top_k", "window"))
    q, idx_q = _randn(gen, B, H, D), _randn(gen, B, Di)
    k, v, idx_k = _randn(gen, B, L, H, D), _randn(gen, B, L, H, D), 0.01 * _randn(gen, B, L, Di)
    # the blocks each sequence keeps fixed (what the work depends on): its first top_k blocks' index keys
    # point along its query's, every other block's are small
    idx_k[:, : top_k * blk] += idx_q[:, None, :]
    lengths = torch.tensor(a["lengths"], dtype=torch.int64, device=gen.device)
    want = sparse_decode_attention(*(f64(t) for t in (q, k, v, idx_q, idx_k)), lengths, blk, top_k, window,
                                   fused=False)
    return (lambda: sparse_decode_attention_kernel(q, k, v, idx_q, idx_k, lengths, blk, top_k, window)), \
        (lambda y: rel_err(y, want)), B, \
        f"B={B}, lengths={a['lengths']}, H={H}, D={D}, block={blk}, top_k={top_k}, window={window}"


def _decode_inputs(c: dict, gen: torch.Generator):
    from target_stack.ops.kda.decode_inputs import CONV, kda_decode_inputs

    d = c["kda"]
    N, H, K, V = c["tokens"], d["H"], d["K"], d["V"]
    C = H * (2 * K + V)
    pre, f, b = _randn(gen, N, C), _randn(gen, N, H * K), _randn(gen, N, H)
    pool = _randn(gen, N + 1, CONV - 1, C)
    slots = torch.arange(1, N + 1, dtype=torch.int32, device=gen.device)
    conv_w, dt_bias, a_log = _randn(gen, C, CONV) * 0.5, _randn(gen, H * K), 0.3 * _randn(gen, H) - 1.0
    # the one quantity of the five whose formula is a line (the gate); the rest is model.layers' to judge
    want = ref.kda_gate64(f64(f).reshape(N, H, K) + f64(dt_bias).reshape(H, K), f64(a_log))
    return (lambda: kda_decode_inputs(pre, f, b, pool, slots, conv_w, dt_bias, a_log, H, K, V)), \
        (lambda out: rel_err(out[3].reshape(N, H, K), want)), N, f"N={N}, H={H}, K={K}, V={V}, conv={CONV}"
