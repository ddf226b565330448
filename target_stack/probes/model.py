"""target_stack's model-layer probes: every layer on its serving paths against the float64
definitions in :mod:`target_stack.probes.reference` (protected from patches).

Inputs are fresh random on every run and never zeros; norm weights and router biases are random
too, so a weight or bias left out shows.  Discrete choices (top-k experts, top-k key blocks) are
compared only where their float64 margin is far above fp32 rounding.
"""

from __future__ import annotations

import torch

import target_stack.ops  # noqa: F401  (runtime choice before triton loads)
from feedback.correctness import rel_err
from feedback.probe import ProbeContext, probe
from target_stack.probes import reference as ref
from target_stack.probes.reference import Checker, Draw, f64, isolated

LAYERS = "target_stack/model/layers.py"
QUANT = "target_stack/model/quant.py"
CACHE = "target_stack/engine/cache.py"
KDA_LAYER = "target_stack/model/kda_layer.py"
CHUNK = "target_stack/ops/kda/chunk.py"
RECURRENT = "target_stack/ops/kda/fused_recurrent.py"
DECODE_INPUTS = "target_stack/ops/kda/decode_inputs.py"
SPARSE_DECODE = "target_stack/ops/sparse_decode.py"
ROUTE = "target_stack/ops/moe/route.py"
NORM = "target_stack/ops/norm.py"
NAIVE = "target_stack/ops/kda/naive.py"
SMALL_BATCH = "target_stack/ops/moe/small_batch.py"
MODEL = "target_stack/model/model.py"
IMAGE = "target_stack/model/image.py"
NATIVE_C = "target_stack/ops/moe/native/moe_dispatch.c"
NATIVE_PY = "target_stack/ops/moe/native/__init__.py"
MOE_GROUPED = "target_stack/ops/moe/grouped.py"
MOE_REFERENCE = "target_stack/ops/moe/reference.py"
DERIVED = "target_stack/model/derived.py"
MARGIN = 1e-4  # a discrete choice is compared only where the float64 scores are this far apart

torch.set_num_threads(1)  # small tensors: an OpenMP team costs more than it saves, worst on shared cores


def _seed(draw: Draw) -> int:
    return int(draw.randint(2**31 - 1, (1,)))


# -- norms, MLP, MoE, sparse attention ---------------------------------------------------------------


def _check_norm(ctx: ProbeContext, chk: Checker, draw: Draw) -> None:
    from target_stack.model.layers import RMSNorm

    p = ctx.params
    dim = p.get("dim", 64)
    eps = float(p.get("eps", ref.EPS))
    norm = RMSNorm(dim)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=draw.cpu) + 0.5)
    norm.to(ctx.device)
    # the torch form and the one-launch kernel (ops/norm.py), each alone and as the residual stream's add-and-norm
    for fused, file, form in ((False, LAYERS, ""), (True, NORM, " (rms_norm)")):
        norm.fused = fused
        for scale in p.get("norm_scales", [1e-3, 1.0, 50.0]):  # 1e-3: mean(x^2) ~ eps, where eps placement shows
            x = draw.randn(3, 5, dim) * scale
            where = dict(file=file, symbol="RMSNorm.forward" + form, condition=f"|x| ~ {scale:g}, eps={eps:g}")
            with chk.guard(**where), torch.no_grad():
                chk.compare(norm(x), ref.rmsnorm(f64(x), f64(norm.weight), eps), "RMSNorm" + form, **where)
            h, delta = draw.randn(3, 5, dim) * scale, draw.randn(3, 5, dim) * scale
            where = dict(file=file, symbol="RMSNorm.add_forward" + form,
                         condition=f"h + delta, |h| ~ {scale:g}, eps={eps:g}")
            with chk.guard(**where), torch.no_grad():
                total, y = norm.add_forward(h, delta)
                chk.compare(total, f64(h) + f64(delta), "residual sum" + form, **where)
                # the norm of the stored sum, as this form's norm alone gives it: a defect of the norm itself is
                # judged (and named) above, not blamed on the add
                chk.compare(y, f64(norm(total)), "norm of the sum" + form, **where)


def _check_mlp(ctx: ProbeContext, chk: Checker, draw: Draw) -> None:
    from target_stack.model.layers import SwiGLU

    dim, hidden = ctx.params.get("dim", 64), ctx.params.get("mlp_hidden", 96)
    mlp = SwiGLU(dim, hidden, draw.cpu).to(ctx.device)
    x = draw.randn(2, 7, dim)
    where = dict(file=LAYERS, symbol="SwiGLU.forward")
    with chk.guard(**where), torch.no_grad():
        chk.compare(mlp(x), ref.swiglu(f64(x), mlp), "SwiGLU", **where)


def _check_moe_ops(ctx: ProbeContext, chk: Checker, draw: Draw) -> None:
    """The MoE op's forms on float64-chosen experts and weights (no routing margin involved): the expert
    groups, the masked dense form, the op's own reference, every form of the small-batch experts, and on
    a GPU in bf16 the grouped GEMMs.  Each against the float64 definition.  The small-batch experts run
    over their own token sweep too: from one token up to the most the layer sends them, past their tiles."""
    from target_stack.model.layers import MoE

    c = ctx.params["moe"]
    sb = c.get("small_batch", {})
    forms = sb.get("forms", {"token": []})  # form -> the token counts of its own sweep
    for top_k in c.get("top_k", [2]):
        for T in c["tokens"]:
            moe = MoE(c["dim"], c["hidden"], c["experts"], top_k, draw.cpu).to(ctx.device)
            _check_moe_forms(ctx, chk, moe, draw.randn(T, c["dim"]), list(forms))
        dim = sb.get("dim", c["dim"])
        moe = MoE(dim, sb.get("hidden", c["hidden"]), c["experts"], top_k, draw.cpu).to(ctx.device)
        for T in sorted({T for counts in forms.values() for T in counts}):
            _check_moe_forms(ctx, chk, moe, draw.randn(T, dim), [f for f, counts in forms.items() if T in counts],
                             only_small=True)


def _check_moe_forms(ctx: ProbeContext, chk: Checker, moe, x: torch.Tensor, small_forms: list[str],
                     only_small: bool = False) -> None:
    """Every combine form of the MoE op on ``moe``'s float64-chosen experts for the tokens x [T, dim]
    (the router bias steers the choice), against the float64 definition; the small-batch experts (with
    the shared expert) in each of ``small_forms`` where the layer would send them the batch."""
    from target_stack.ops.moe import (
        device_layout,
        expert_groups,
        grouped_gemm,
        grouped_gemm_weights,
        masked_dense,
        moe_reference,
        sort_pairs,
    )
    from target_stack.ops.moe.small_batch import MAX_TOKENS as SMALL_BATCH_TOKENS
    from target_stack.ops.moe.small_batch import small_batch_experts, stack_with_shared

    c = ctx.params["moe"]
    T, E, top_k = x.shape[0], len(moe.experts), moe.top_k
    w64, idx, _ = ref.moe_route(f64(x), moe)
    full = ref.moe(f64(x), moe)[0]
    want = full - ref.swiglu(f64(x), moe.shared)
    w, idx = w64.float().to(x.device), idx.to(x.device)
    cond = f"T={T}, experts={E}, top_k={top_k}, float64-chosen experts"
    if not only_small:
        stacked = moe.stacked_weights()
        forms = {(MOE_GROUPED, "expert_groups"): lambda: expert_groups(x, w, *sort_pairs(idx, E), moe.experts, top_k),
                 (MOE_GROUPED, "masked_dense"): lambda: masked_dense(x, w, idx, *stacked),
                 (MOE_REFERENCE, "moe_reference"): lambda: moe_reference(x, w, idx, moe.experts)}
        tol = None
        if ctx.device == "cuda" and hasattr(torch, "_grouped_mm"):
            xb = x.to(torch.bfloat16)
            if moe._grouped_ok(xb):  # the module stays fp32: the fp32 forms above run on it too
                weights = grouped_gemm_weights(*moe.stacked_weights(), torch.bfloat16)
                forms[(MOE_GROUPED, "grouped_gemm")] = lambda: grouped_gemm(xb, w, *device_layout(idx, E), *weights,
                                                                            top_k)
            tol = float(c.get("bf16_tolerance", 3e-2))
        for (file, symbol), fn in forms.items():
            where = dict(file=file, symbol=symbol, condition=cond)
            bf16 = symbol == "grouped_gemm"
            with chk.guard(**where), torch.no_grad():
                chk.compare(fn(), want, "MoE combine", tolerance=tol if bf16 else None,
                            metric="max_rel_err_bf16" if bf16 else None, **where)
    if T > SMALL_BATCH_TOKENS:
        return
    for form in small_forms:  # the two-launch kernel (or the expert form's three), shared expert included
        where = dict(file=SMALL_BATCH, symbol=f"small_batch_experts (form='{form}')",
                     condition=cond + ", shared expert")
        with chk.guard(**where), torch.no_grad():
            mods = [*moe.experts, moe.shared]
            gu, down = stack_with_shared([m.w_gate for m in mods], [m.w_up for m in mods],
                                         [m.w_down for m in mods], x.dtype)
            chk.compare(small_batch_experts(x, w, idx, gu, down, form=form), full,
                        f"small-batch experts ({form} form)", **where)


def _check_moe_shapes(ctx: ProbeContext, chk: Checker, draw: Draw) -> None:
    """Expert counts that are not powers of two (the kernels pad their expert lanes), top_k = 1 and
    top_k = experts: the routing of both forms against the float64 choice, and every combine form on
    the float64-chosen experts."""
    from target_stack.model.layers import MoE

    c = ctx.params["moe"]
    shapes = c.get("shapes", {})
    forms = shapes.get("small_batch", {"token": [1]})  # form -> the token counts it runs at
    dim = shapes.get("dim", c["dim"])
    for E, top_k in shapes.get("cases", []):
        moe = MoE(dim, shapes.get("hidden", c["hidden"]), E, top_k, draw.cpu)
        with torch.no_grad():
            moe.router_bias.copy_(torch.randn(E, generator=draw.cpu) * c.get("bias_scale", 0.2))
        moe.to(ctx.device)
        for T in shapes.get("tokens", [1]):
            x = draw.randn(T, dim)
            _check_route(chk, moe, x, ref.moe(f64(x), moe)[1] > MARGIN,
                         f"T={T}, experts={E}, top_k={top_k}, float32")
            _check_moe_forms(ctx, chk, moe, x, [f for f, counts in forms.items() if T in counts])


def _moe_paths(moe, bf16: bool) -> dict:
    """The MoE forms that run here: the grouped forward, the per-expert loop, the graph-safe form."""

    def ungrouped(x):
        moe.grouped = False
        try:
            return moe(x)
        finally:
            moe.grouped = True

    def static(small_batch: bool, form: str = "token"):
        def run(x):  # the graph-safe form with the small-batch experts (ops/moe/small_batch.py, either form) or without
            before = moe.small_batch, moe.small_batch_form
            moe.small_batch, moe.small_batch_form = small_batch, form
            try:
                return moe.forward_static(x)
            finally:
                moe.small_batch, moe.small_batch_form = before
        return run

    paths = {"MoE.forward": moe, "MoE.forward (grouped=False)": ungrouped, "MoE.forward_static": static(False),
             "MoE.forward_static (small_batch_experts)": static(True),
             "MoE.forward_static (small_batch_experts, form='expert')": static(True, "expert")}
    return {f"{name} bf16" if bf16 else name: fn for name, fn in paths.items()}


def check_moe(ctx: ProbeContext, chk: Checker, draw: Draw, paths, file: str, backend: str = "torch",
              blame: dict[str, str] | None = None) -> None:
    """Routing (against the float64 choice) and the output of every path on tokens whose top-k margin is clear.

    ``paths(moe, bf16)`` gives {symbol: callable} for a module; bf16 runs only on a GPU.  A path's failure is
    blamed on ``file``, or on ``blame[symbol]`` where given (an op already found wrong on its own).
    """
    from target_stack.model.layers import MoE

    c = ctx.params["moe"]
    dtypes = [torch.float32] + ([torch.bfloat16] if ctx.device == "cuda" else [])
    for top_k in c.get("top_k", [2]):
        for dtype in dtypes:
            moe = MoE(c["dim"], c["hidden"], c["experts"], top_k, draw.cpu, backend=backend)
            with torch.no_grad():
                moe.router_bias.copy_(torch.randn(c["experts"], generator=draw.cpu) * c.get("bias_scale", 0.2))
            moe.to(ctx.device, dtype)
            tol, metric = (None, None) if dtype == torch.float32 else (float(c.get("bf16_tolerance", 3e-2)),
                                                                       "max_rel_err_bf16")
            for T in c["tokens"]:
                x = draw.randn(T, c["dim"]).to(dtype)
                out_ref, margin = ref.moe(f64(x), moe)
                clear = margin > MARGIN
                cond = f"T={T}, experts={c['experts']}, top_k={top_k}, {str(dtype).removeprefix('torch.')}"
                if dtype == torch.float32:
                    _check_route(chk, moe, x, clear, cond)
                for symbol, fn in paths(moe, dtype == torch.bfloat16).items():
                    where = dict(file=(blame or {}).get(symbol.removesuffix(" bf16"), file), symbol=symbol,
                                 condition=cond)
                    with chk.guard(**where), torch.no_grad():
                        out = fn(x)
                        chk.compare(out[clear.to(out.device)], out_ref[clear], "MoE output", tolerance=tol,
                                    metric=metric, **where)
        if c.get("route_dim"):  # a router wide enough that the kernel splits its product into several slices
            wide = MoE(c["route_dim"], 8, c["experts"], top_k, draw.cpu, backend=backend)
            with torch.no_grad():
                wide.router_bias.copy_(torch.randn(c["experts"], generator=draw.cpu) * c.get("bias_scale", 0.2))
            wide.to(ctx.device)
            x = draw.randn(5, c["route_dim"])
            _check_route(chk, wide, x, ref.moe(f64(x), wide)[1] > MARGIN,
                         f"T=5, dim={c['route_dim']}, experts={c['experts']}, top_k={top_k}, float32")


def _check_route(chk: Checker, moe, x: torch.Tensor, clear: torch.Tensor, cond: str) -> None:
    """The chosen experts (as a set) and their normalised weights, token by token: the torch form and the
    one-launch router kernel (``ops/moe/route.py``)."""
    for fused, file in ((False, LAYERS), (True, ROUTE)):
        moe.fused = fused
        try:
            symbol = "MoE.route (moe_route)" if fused else "MoE.route"
            _check_route_form(chk, moe, x, clear, dict(file=file, symbol=symbol, condition=cond))
        finally:
            moe.fused = False


def _check_route_form(chk: Checker, moe, x: torch.Tensor, clear: torch.Tensor, where: dict) -> None:
    w_ref, idx_ref, _ = ref.moe_route(f64(x), moe)
    with chk.guard(**where), torch.no_grad():
        w, idx = moe.route(x)
        w, idx = f64(w)[clear], idx.cpu()[clear]
        idx_sorted, o = idx.sort(-1)
        ref_sorted, o_ref = idx_ref[clear].sort(-1)
        wrong = (idx_sorted != ref_sorted).any(-1)
        chk.ctx.check(not wrong.any(), f"{int(wrong.sum())} of {len(wrong)} tokens route to other experts than the "
                      "top-k of sigmoid(router x) + bias", **where)
        if not wrong.any():
            chk.compare(w.gather(-1, o), w_ref[clear].gather(-1, o_ref), "routing weights (sigmoid scores "
                        "of the chosen experts, normalised)", **where)


def _check_sparse_attention(ctx: ProbeContext, chk: Checker, draw: Draw) -> None:
    """Prefill (all queries, and the last Tq after a reused prefix) and batched decode with padded
    keys, against dense float64 attention over the independently chosen blocks and window."""
    from target_stack.model.layers import sparse_attention, sparse_decode_attention

    c = ctx.params["attention"]
    T, H, D, Di, blk, top_k, window = (c[n] for n in ("T", "H", "D", "Di", "block", "top_k", "window"))
    dev = ctx.device
    q, k, v = (draw.randn(T, H, D) for _ in range(3))
    iq, ik = draw.randn(T, Di), draw.randn(T, Di)
    cond = f"T={T}, block={blk}, top_k={top_k}, window={window}"
    out_ref, margin, kept = ref.sparse_attention(*(f64(t) for t in (q, k, v, iq, ik)), torch.arange(T),
                                                 blk, top_k, window)
    dropped = (~kept).tril().any(-1)
    ctx.check(bool(dropped.any()), "probe inputs too short: no query drops a causal key block",
              file=LAYERS, symbol="sparse_attention", condition=cond)
    ctx.metric("queries_with_dropped_keys", float(dropped.sum()))
    clear = margin > MARGIN
    where = dict(file=LAYERS, symbol="sparse_attention", condition=cond)
    with chk.guard(**where), torch.no_grad():
        out = sparse_attention(q, k, v, iq, ik, blk, top_k, window)
        chk.compare(out[clear.to(dev)], out_ref[clear], "sparse attention", **where)
    tq = c.get("tail", T // 3)
    where = dict(where, condition=f"{cond}, last {tq} queries of {T} keys")
    with chk.guard(**where), torch.no_grad():
        out = sparse_attention(q[-tq:], k, v, iq[-tq:], ik, blk, top_k, window)
        chk.compare(out[clear[-tq:].to(dev)], out_ref[-tq:][clear[-tq:]], "sparse attention after a prefix", **where)
    lengths = torch.tensor(c.get("lengths", [1, 9, T // 2, T]))
    B = len(lengths)
    kb, vb, ikb = draw.randn(B, T, H, D) * 30, draw.randn(B, T, H, D) * 30, draw.randn(B, T, Di) * 30  # padding
    qb, iqb = draw.randn(B, H, D), draw.randn(B, Di)
    for b, n in enumerate(lengths.tolist()):
        kb[b, :n], vb[b, :n], ikb[b, :n] = k[:n], v[:n], ik[:n]
        # the window's oldest key in a block the indexer never picks: only the window rule keeps it,
        # so a window one key short or long shows whatever the random scores choose
        edge = n - window
        if edge >= 0 and edge // blk != (n - 1) // blk:
            lo = (edge // blk) * blk
            ikb[b, lo:lo + blk] = -iqb[b] * 10
    refs = {}  # sequence -> its float64 decode output, where no block choice is a near-tie
    for b, n in enumerate(lengths.tolist()):
        o_ref, m, _ = ref.sparse_attention(f64(qb[b:b + 1]), f64(k[:n]), f64(v[:n]), f64(iqb[b:b + 1]),
                                           f64(ikb[b, :n]), torch.tensor([n - 1]), blk, top_k, window)
        if m.item() > MARGIN:
            refs[b] = o_ref
    for fused, form, file in ((False, "torch", LAYERS), (True, "two-launch Triton", SPARSE_DECODE)):
        where = dict(file=file, symbol="sparse_decode_attention", condition=f"{cond}, lengths {lengths.tolist()}, "
                     f"the window's oldest key in a block the indexer drops, {form} form")
        with chk.guard(**where), torch.no_grad():
            out = sparse_decode_attention(qb, kb, vb, iqb, ikb, lengths.to(dev), blk, top_k, window, fused=fused)
            for b, o_ref in refs.items():
                chk.compare(out[b:b + 1], o_ref, f"decode attention of a sequence of {int(lengths[b])} ({form})",
                            **where)


def _check_sparse_pads(ctx: ProbeContext, chk: Checker, draw: Draw) -> None:
    """Key lengths at, below and one past multiples of the block, and below one block: a prefill of L
    tokens, and a decode batch whose keys are padded to L (sequences of 1, about L / 2, L - 1 and L keys),
    both decode forms; against the float64 definition where no block choice is a near-tie."""
    from target_stack.model.layers import sparse_attention, sparse_decode_attention

    c = ctx.params["attention"]
    H, D, Di, blk, top_k, window = (c[n] for n in ("H", "D", "Di", "block", "top_k", "window"))
    dev = ctx.device
    for L in c.get("pads", []):
        cond = f"L={L} keys ({L / blk:g} blocks of {blk}), top_k={top_k}, window={window}"
        q, k, v = (draw.randn(L, H, D) for _ in range(3))
        iq, ik = draw.randn(L, Di), draw.randn(L, Di)
        out_ref, margin, _ = ref.sparse_attention(*(f64(t) for t in (q, k, v, iq, ik)), torch.arange(L), blk, top_k,
                                                  window)
        clear = margin > MARGIN
        where = dict(file=LAYERS, symbol="sparse_attention", condition=f"prefill of {cond}")
        with chk.guard(**where), torch.no_grad():
            out = sparse_attention(q, k, v, iq, ik, blk, top_k, window)
            chk.compare(out[clear.to(dev)], out_ref[clear], "sparse attention", **where)
        lengths = sorted({1, (L + 1) // 2, max(L - 1, 1), L})
        B = len(lengths)
        kb, vb, ikb = draw.randn(B, L, H, D) * 30, draw.randn(B, L, H, D) * 30, draw.randn(B, L, Di) * 30  # padding
        qb, iqb = draw.randn(B, H, D), draw.randn(B, Di)
        refs = {}
        for b, n in enumerate(lengths):
            kb[b, :n], vb[b, :n], ikb[b, :n] = draw.randn(n, H, D), draw.randn(n, H, D), draw.randn(n, Di)
            o_ref, m, _ = ref.sparse_attention(f64(qb[b:b + 1]), f64(kb[b, :n]), f64(vb[b, :n]), f64(iqb[b:b + 1]),
                                               f64(ikb[b, :n]), torch.tensor([n - 1]), blk, top_k, window)
            if m.item() > MARGIN:
                refs[b] = o_ref
        for fused, form, file in ((False, "torch", LAYERS), (True, "two-launch Triton", SPARSE_DECODE)):
            where = dict(file=file, symbol="sparse_decode_attention",
                         condition=f"decode over keys padded to {cond}, lengths {lengths}, {form} form")
            with chk.guard(**where), torch.no_grad():
                out = sparse_decode_attention(qb, kb, vb, iqb, ikb, torch.tensor(lengths, device=dev), blk, top_k,
                                              window, fused=fused)
                for b, o_ref in refs.items():
                    chk.compare(out[b:b + 1], o_ref, f"decode attention of a sequence of {lengths[b]} ({form})",
                                **where)


@probe(kind="correctness")
def layers(ctx: ProbeContext) -> None:
    """RMSNorm, SwiGLU, the MoE (routing, grouped / per-expert / graph-safe combine) and sparse
    attention (prefill and decode) against their float64 definitions."""
    chk = Checker(ctx, ctx.params.get("tolerance", 1e-5))
    draw = Draw(ctx.device)
    _check_norm(ctx, chk, draw)
    _check_mlp(ctx, chk, draw)
    _check_moe_ops(ctx, chk, draw)
    _check_moe_shapes(ctx, chk, draw)
    # the op's forms are right: a wrong layer output is the layer's (its routing, its choice, the shared expert)
    op_failed = any(f.location.file in (MOE_GROUPED, MOE_REFERENCE) for f in ctx.findings)
    small_failed = {f.location.symbol for f in ctx.findings if f.location.file == SMALL_BATCH}
    blame = {path: SMALL_BATCH for path, form in (("MoE.forward_static (small_batch_experts)", "token"),
                                                  ("MoE.forward_static (small_batch_experts, form='expert')", "expert"))
             if f"small_batch_experts (form='{form}')" in small_failed}
    check_moe(ctx, chk, draw, _moe_paths, MOE_GROUPED if op_failed else LAYERS, blame=blame)
    _check_sparse_attention(ctx, chk, draw)
    _check_sparse_pads(ctx, chk, draw)
    chk.report()


@probe(kind="correctness")
def moe_native(ctx: ProbeContext) -> None:
    """The native (C) MoE dispatch / experts / combine: the extension's call on float64-chosen
    experts and weights (no routing margin involved), the GPU path's host layout wait against its
    deadline (``_check_layout_wait``), then the layer on its native path."""
    from target_stack.model.layers import MoE
    from target_stack.ops.moe.native import moe_dispatch_combine

    chk = Checker(ctx, ctx.params.get("tolerance", 1e-5))
    draw = Draw(ctx.device)
    c = ctx.params["moe"]
    symbol = "ts_moe_dispatch_combine (through native.moe_dispatch_combine)"

    def extension():
        for top_k in c.get("top_k", [2]):  # every top_k: one expert per token up to all of them
            for T in c["tokens"]:
                moe = MoE(c["dim"], c["hidden"], c["experts"], top_k, draw.cpu)
                x = torch.randn(T, c["dim"], generator=draw.cpu)  # the extension takes CPU fp32 tensors
                w, idx, _ = ref.moe_route(f64(x), moe)
                want = ref.moe(f64(x), moe)[0] - ref.swiglu(f64(x), moe.shared)
                where = dict(file=NATIVE_C, symbol=symbol, condition=f"T={T}, experts={c['experts']}, top_k={top_k}, "
                             "float64-chosen experts")
                with chk.guard(**where), torch.no_grad():
                    out = moe_dispatch_combine(x, idx, w.float(), *moe.stacked_weights())
                    chk.compare(out, want, "native dispatch/combine", **where)

    failed = ctx.failed
    survived, _ = isolated(ctx, extension, chk, file=NATIVE_C, symbol=symbol)  # a crash here is the C code's
    if ctx.failed != failed and not survived:
        chk.report()
        return  # the layer's native path would crash this process too
    # the extension itself is right: a wrong native-path output is the layer's use of it
    file = LAYERS if ctx.failed == failed else NATIVE_C
    isolated(ctx, lambda: _check_layout_wait(ctx, draw), file=NATIVE_C, symbol="ts_moe_layout_wait")

    def native_paths(moe, bf16):
        return {"MoE.forward (backend='native')" + (" bf16" if bf16 else ""): moe}

    isolated(ctx, lambda: check_moe(ctx, chk, draw, native_paths, file, backend="native"), chk, file=NATIVE_C,
             symbol="MoE.forward (backend='native')")
    chk.report()


def _waited(call, flag: torch.Tensor, value: int, publish_s: float | None, give_up_s: float) -> dict:
    """``call()`` (a wait for ``flag`` to read ``value``) on a thread of its own while this one publishes ``value``
    ``publish_s`` after the start (another thread's store, as the device's copy is); with ``publish_s`` None it is
    published only to end a wait still running ``give_up_s`` after the start.  {"value" or "error", "elapsed" (the
    call's own seconds), "late" (seconds from the publication to the call's return: negative where it returned
    first), "stuck" (still running then, or ``give_up_s`` after the publication)}."""
    import threading
    import time

    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = call()
        except Exception as exc:  # noqa: BLE001 - reported by the caller, against the contract
            out["error"] = exc
        out["end"] = time.monotonic()
        out["elapsed"] = out["end"] - t0

    waiter = threading.Thread(target=run, name="layout-wait", daemon=True)
    waiter.start()
    if publish_s is not None:
        waiter.join(publish_s)
        published = time.monotonic()  # before the store: a wait that sees it cannot return earlier
        flag.fill_(value)
    waiter.join(give_up_s)
    out["stuck"] = waiter.is_alive()
    if publish_s is not None and not out["stuck"]:
        out["late"] = out["end"] - published
    if out["stuck"]:
        flag.fill_(value)  # end a wait that ignores its timeout (or its flag) rather than leave it spinning
        waiter.join(give_up_s)
    return out


def _check_layout_wait(ctx: ProbeContext, draw: Draw) -> None:
    """The GPU MoE path's host wait (``ts_moe_layout_wait``: spin until the routing flag reads the sequence
    number, then sort the pairs by expert) keeps its deadline in its own unit: a flag published late by
    another thread (a lagging device) is seen well inside a generous timeout, and a flag never published
    ends in the timeout error after about the timeout, neither much sooner nor much later.  The C function
    is called first through a signature declared here (timeout in microseconds, the C source's contract);
    only where it keeps the contract is the Python wrapper judged, with an explicit timeout and with its
    default (the one :class:`HostLayout` uses in production)."""
    import ctypes

    from target_stack.ops.moe import native

    c = {"publish_s": 0.2, "timeout_s": 0.3, "generous_s": 3.0, "slack_s": 1.5, **ctx.params.get("layout_wait", {})}
    delay, short, generous, slack = c["publish_s"], c["timeout_s"], c["generous_s"], c["slack_s"]
    E, P = 6, 53
    experts = torch.randint(0, E, (P,), generator=draw.cpu)
    want_order = torch.argsort(experts, stable=True)
    want_ends = torch.bincount(experts, minlength=E).cumsum(0)
    flag = torch.zeros(1, dtype=torch.int32)
    order, ends = torch.empty(P, dtype=torch.int64), torch.empty(E, dtype=torch.int64)

    fn = ctypes.CDLL(str(native.build())).ts_moe_layout_wait  # a handle of its own: the wrapper's setup not used
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p]

    def direct(expected: int, timeout_s: float):
        def call() -> int:
            return fn(flag.data_ptr(), expected, int(timeout_s * 1e6), experts.data_ptr(), P, E, order.data_ptr(),
                      ends.data_ptr())
        return call

    def wrapper(expected: int, timeout_s: float | None):
        def call():
            kw = {} if timeout_s is None else {"timeout_s": timeout_s}
            return native.moe_layout_wait(flag, expected, experts, E, order, ends, **kw)
        return call

    def judge(r: dict, late: bool, timeout_s: float | None, file: str, symbol: str, how: str) -> bool:
        what = (f"a flag published {delay:g} s late by another thread, timeout "
                f"{'default' if timeout_s is None else f'{timeout_s:g} s'}" if late
                else f"a flag never published, timeout {timeout_s:g} s")
        where = dict(file=file, symbol=symbol, condition=f"{how}: {what}")
        took = r.get("elapsed")
        took_s = "still waiting" if took is None else f"after {took:.3f} s"
        if r["stuck"]:
            return ctx.check(False, f"the layout wait ignored its deadline: {what}: still waiting {slack:g} s "
                             f"{'after the publication' if late else 'past the timeout'}", **where)
        if "error" in r and (late or not isinstance(r["error"], TimeoutError)):
            e = r["error"]
            timeout = isinstance(e, TimeoutError)
            return ctx.check(False, f"the layout wait raised {type(e).__name__}: {str(e)[:120]} {took_s}, for {what}"
                             + (" (a timeout in the wrong unit, or a call that keeps the GIL so the flag cannot be "
                                "published)" if timeout and late else ""), **where)
        rc = r.get("value")
        if "error" in r:
            pass  # the wrapper's timeout error: judged by its time below
        elif not isinstance(rc, tuple):  # the C function's return code
            if late and rc != 0 or not late and rc != -3:
                return ctx.check(False, f"the layout wait returned {rc} {took_s} for {what} (0: the flag seen, -3: the "
                                 "timeout)", **where)
        elif not late:
            return ctx.check(False, f"the layout wait returned {took_s} for {what} instead of raising TimeoutError",
                             **where)
        if late:
            after = r["late"]
            if not ctx.check(0 <= after <= slack, f"the layout wait returned {took_s} for {what}: "
                             f"{'before the flag was published' if after < 0 else f'{after:.3f} s after it'}", **where):
                return False
            got_order, got_ends = r["value"] if isinstance(r["value"], tuple) else (order, ends)
            return ctx.check(torch.equal(got_order.cpu(), want_order) and torch.equal(got_ends.cpu(), want_ends),
                             f"the layout after {what} is not the stable sort of the pairs by expert with its group "
                             "ends", **where)
        return ctx.check(short * 0.9 <= took <= short + slack, f"the layout wait timed out {took_s} for {what}: "
                         f"{'far sooner' if took < short * 0.9 else 'far later'} than its timeout", **where)

    seq = 0

    def case(make, late: bool, timeout_s: float | None, file: str, symbol: str, how: str) -> bool:
        nonlocal seq
        seq += 1
        flag.fill_(-seq)
        r = _waited(make(seq, timeout_s), flag, seq, delay if late else None, slack if late else timeout_s + slack)
        return judge(r, late, timeout_s, file, symbol, how)

    c_sym = "ts_moe_layout_wait (called directly, timeout in microseconds)"
    ok = case(direct, True, generous, NATIVE_C, c_sym, "the C function")
    ok = case(direct, False, short, NATIVE_C, c_sym, "the C function") and ok
    if not ok:
        return  # the wrapper can do no better than the function it calls
    py_sym = "moe_layout_wait (library / ts_moe_layout_wait)"
    if case(wrapper, True, generous, NATIVE_PY, py_sym, "moe_layout_wait"):
        case(wrapper, True, None, NATIVE_PY, py_sym, "moe_layout_wait")  # a wait that keeps the GIL would hang here
    case(wrapper, False, short, NATIVE_PY, py_sym, "moe_layout_wait")


# -- quantisation ------------------------------------------------------------------------------------


def _int8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension from the definition: (integers, scale = amax / 127)."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    return torch.round(x / scale).clamp(-127, 127), scale


def _int8_clear(draw: Draw, rows: int, cols: int, log_mag: tuple[float, float]) -> torch.Tensor:
    """Rows of random values whose int8 quantisation is unambiguous: each row's largest magnitude is
    exactly 127 steps and every other value lies at least 0.1 step from a rounding tie, far beyond
    fp32 rounding of x / scale.  Row scales span the decades ``log_mag``."""
    lo, hi = log_mag
    step = 10.0 ** (draw.rand(rows, 1) * (hi - lo) + lo) / 127
    n = draw.randint(253, (rows, cols)) - 126.0
    x = (n + (draw.rand(rows, cols) - 0.5) * 0.8) * step
    top = draw.randint(cols, (rows, 1))
    sign = torch.where(draw.rand(rows, 1) < 0.5, -1.0, 1.0)
    return x.scatter(1, top, 127.0 * step * sign)


def _kv_bound(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The largest round-trip error of one stored value of x [..., heads, head_dim] allowed by the format."""
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "fp32":
        return torch.zeros_like(x)
    if kind == "bf16":
        return x.abs() * 2.0**-8  # 8 significand bits, round to nearest
    if kind == "int8":
        return (amax / 127 / 2).expand_as(x)  # half a scale step
    scale = amax / 448  # fp8 e4m3: 4 significand bits; subnormal steps of 2^-9 below 2^-6
    return torch.maximum(x.abs() * 2.0**-4, (scale * 2.0**-10).expand_as(x))


def _kv_values(draw: Draw, T: int, H: int, D: int, special: list[float] = ()) -> tuple[torch.Tensor, dict]:
    """Per-(token, head) magnitudes over five decades, so a scale shared across tokens or heads shows; with
    ``special``, degenerate-but-legal vectors at random (token, head) places: one rescaled to each of those
    largest magnitudes (0: all zeros), and one with a single non-zero entry.  (values, {name: (token, head)})."""
    x = draw.randn(T, H, D) * 10.0 ** (draw.rand(T, H, 1) * 5 - 3)
    if not special:
        return x, {}
    at = [divmod(int(i), H) for i in draw.randperm(T * H)[:len(special) + 1]]
    names = {}
    for (t, h), mag in zip(at, special):
        x[t, h] = x[t, h] / x[t, h].abs().max() * mag
        names["an all-zero" if mag == 0 else f"a {'tiny' if mag < 1 else 'huge'} (largest |x| {mag:g})"] = (t, h)
    t, h = at[-1]
    keep = int(draw.randint(D, (1,)))
    x[t, h, :keep], x[t, h, keep + 1:] = 0.0, 0.0
    names["a one-hot"] = (t, h)
    return x, names


def _kv_ratio(got: torch.Tensor, want: torch.Tensor, kind: str) -> torch.Tensor:
    """Each stored value's round-trip error over its format's bound (inf where the value came back NaN)."""
    ratio = (f64(got) - f64(want)).abs() / (_kv_bound(f64(want), kind) * (1 + 1e-4) + 1e-30)
    return ratio.nan_to_num(nan=float("inf"))


@probe(kind="correctness")
def quant(ctx: ProbeContext) -> None:
    """W8A8 linear against the exact int8 arithmetic of its definition and the float64 linear; KV
    storage round trips (and the paged cache's write / gather) within each format's error bound."""
    from target_stack.engine.cache import PagedKV
    from target_stack.model.quant import W8A8Linear, dequantize_kv, quantize_kv

    p = ctx.params
    chk = Checker(ctx, p.get("tolerance", 1e-5))
    draw = Draw(ctx.device)
    dev = ctx.device
    special = [float(m) for m in p.get("degenerate", [])]
    n_in, n_out = p.get("in_features", 256), p.get("out_features", 96)
    lin = torch.nn.Linear(n_in, n_out).to(dev)
    with torch.no_grad():
        lin.weight.copy_(_int8_clear(draw, n_out, n_in, (-1.5, -0.5)))
        if special:  # an all-zero output channel: its scale must not divide by zero
            lin.weight[int(draw.randint(n_out, (1,)))] = 0.0
        lin.bias.copy_(draw.randn(n_out) * 0.1)
    x = _int8_clear(draw, 18, n_in, (-2, 2)).reshape(2, 9, n_in)  # per-token magnitudes 1e-2 .. 1e2
    where = dict(file=QUANT, symbol="W8A8Linear.forward / quantize_per_token_int8 / quantize_weight_int8")

    def exact(x: torch.Tensor) -> torch.Tensor:  # the int8 arithmetic of the definition, in float64
        qx, sx = _int8_per_row(f64(x))
        qw, sw = _int8_per_row(f64(lin.weight))
        return (qx @ qw.T) * sx * sw.T + f64(lin.bias)

    w8a8 = None
    with chk.guard(**where), torch.no_grad():
        w8a8 = W8A8Linear.from_linear(lin).to(dev)
        out = w8a8(x)
        chk.compare(out, exact(x), "W8A8 against its int8 arithmetic", **where)
        full = f64(x) @ f64(lin.weight).T + f64(lin.bias)
        mean_rel = ((f64(out) - full).abs().mean() / full.abs().mean()).item()
        ctx.metric("w8a8_mean_rel_diff", ref.finite(mean_rel), better="lower")
        ctx.check(mean_rel < p.get("w8a8_mean_rel", 0.05), f"W8A8 differs from the float linear by {mean_rel:.3f} "
                  "(mean relative)", **where)
    # degenerate tokens, each judged on its own row (a relative error over the batch would hide a tiny one):
    # all zeros, tiny and huge magnitudes, a single non-zero entry
    tokens = {("an all-zero" if m == 0 else f"a {'tiny' if m < 1 else 'huge'} (largest |x| {m:g})"):
              _int8_clear(draw, 1, n_in, (0, 0)) * m for m in special}  # amax 1, no rounding ties, rescaled
    if special:
        one = torch.zeros(1, n_in, device=dev)
        one[0, int(draw.randint(n_in, (1,)))] = 3.0
        tokens["a one-hot"] = one
    for name, row in tokens.items():
        at = dict(where, condition=f"{name} token")
        with chk.guard(**at), torch.no_grad():
            if w8a8 is not None:
                chk.compare(w8a8(row), exact(row), f"W8A8 on {name} token against its int8 arithmetic", **at)
    T, H, D = p.get("kv_shape", [17, 4, 32])
    worst_ratio = 0.0
    stored = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
    for kind in p.get("kv_kinds", ["fp32", "bf16", "int8", "fp8"]):
        x, degenerate = _kv_values(draw, T, H, D, special)
        where = dict(file=QUANT, symbol="quantize_kv / dequantize_kv", condition=f"kind={kind}")
        failed = ctx.failed
        with chk.guard(**where):
            values, scale = quantize_kv(x, kind)
            ctx.check(values.dtype == stored[kind], f"{kind} KV stored as {values.dtype}", **where)
            if scale is not None:
                ctx.check(tuple(scale.shape) == (T, H, 1), f"{kind} scales of shape {tuple(scale.shape)}, "
                          f"not per (token, head) {(T, H, 1)}", **where)
            ratios = _kv_ratio(dequantize_kv(values, scale), x, kind).amax(-1)  # [T, H]: each vector's worst
            ordinary = torch.ones_like(ratios, dtype=torch.bool)
            for name, (t, h) in degenerate.items():
                ordinary[t, h] = False
                r = ratios[t, h].item()
                ctx.check(r <= 1, f"{kind} round trip of {name} vector: error {r:.2f}x its format's bound",
                          **dict(where, condition=f"kind={kind}, {name} vector (token {t}, head {h})"))
            ratio = ratios[ordinary].max().item()
            worst_ratio = max(worst_ratio, ratios.max().item())
            ctx.check(ratio <= 1, f"{kind} round trip error {ratio:.2f}x its format's bound", **where)
        # a paged cache storing a broken format is off too: that is the format's fault
        where = dict(file=CACHE if ctx.failed == failed else QUANT, symbol="PagedKV.write / PagedKV.gather",
                     condition=f"kind={kind}")
        with chk.guard(**where):
            worst_ratio = max(worst_ratio, _check_paged(ctx, PagedKV, kind, draw, where, special))
    ctx.metric("kv_error_bound_ratio", ref.finite(worst_ratio), better="lower")
    chk.report()


def _check_paged(ctx: ProbeContext, PagedKV, kind: str, draw: Draw, where: dict, special: list[float] = ()) -> float:
    """Fill every slot of pages 1..n (then overwrite some), gather through a shuffled block table; the
    ``special`` magnitudes' degenerate vectors (:func:`_kv_values`) among both writes."""
    n_pages, ps, H, D, Di = 6, 4, 3, 16, 8
    dev = ctx.device
    cache = PagedKV(n_pages + 1, ps, H, D, Di, kind, torch.device(dev))
    N = n_pages * ps
    page = (torch.arange(N) // ps + 1).to(dev)
    offset = (torch.arange(N) % ps).to(dev)
    k, v = _kv_values(draw, N, H, D, special)[0], _kv_values(draw, N, H, D, special)[0]
    ik = draw.randn(N, Di)
    cache.write(page, offset, k, v, ik)
    again = draw.randperm(N)[: N // 3]  # rewritten with other magnitudes
    k[again], v[again] = _kv_values(draw, len(again), H, D, special)[0], _kv_values(draw, len(again), H, D, special)[0]
    cache.write(page[again], offset[again], k[again], v[again], ik[again])
    table = torch.stack([draw.randperm(n_pages)[:4] + 1 for _ in range(2)])
    ks, vs, iks = cache.gather(table, torch.float32)
    rows = ((table[..., None] - 1) * ps + torch.arange(ps, device=dev)).reshape(2, -1)  # token of each gathered slot
    worst = 0.0
    for name, got, want in (("keys", ks, k[rows]), ("values", vs, v[rows])):
        ratio = _kv_ratio(got, want, kind).max().item()
        worst = max(worst, ratio)
        ctx.check(ratio <= 1, f"gathered {name} off by {ratio:.2f}x the {kind} bound", **where)
    ctx.check(torch.equal(iks.cpu(), ik[rows].float().cpu()), "gathered indexer keys differ from those written",
              **where)
    return worst


# -- the KDA layer -----------------------------------------------------------------------------------


@probe(kind="correctness")
def kda_layer(ctx: ProbeContext) -> None:
    """The KDA layer (projections, short convolution, gates, KDA, gated output norm) against the
    float64 token loop of its definition, per backend: prefill, decode continuing it with the
    carried states, a prefill with a tail, and a pooled decode step with a padding row."""
    p = ctx.params
    chk = Checker(ctx, p.get("tolerance", 1e-5))
    draw = Draw(ctx.device)
    torch_ok = None  # whether the torch backend passed: then a Triton-only failure is the kernels'
    for backend in p.get("backends", ["torch", "triton"]):
        failed = ctx.failed
        triton_only = backend == "triton" and torch_ok
        files = (CHUNK, RECURRENT) if triton_only else (KDA_LAYER, KDA_LAYER)
        # a crash (an out-of-bounds kernel in the interpreter) fails at the backend's prefill
        isolated(ctx, lambda backend=backend, files=files: _check_backend(ctx, chk, draw, backend, files), chk,
                 file=files[0], symbol="KDALayer.prefill", condition=f"backend={backend}")
        if backend == "torch":
            torch_ok = ctx.failed == failed
    chk.report()


def _check_backend(ctx: ProbeContext, chk: Checker, draw: Draw, backend: str, files: tuple[str, str]) -> None:
    """One backend's prefill, decode, prefill with a tail and pooled decode; ``files`` are the files
    blamed for the prefill and the decode paths."""
    from target_stack.model.kda_layer import KDALayer

    p = ctx.params
    dev = ctx.device
    dim, H, K, V, B, T, split = (p[n] for n in ("dim", "heads", "head_k", "head_v", "batch", "T", "prefill"))
    prefill_file, decode_file = files
    kernels = prefill_file != KDA_LAYER
    if backend == "torch":
        _check_torch_chunk_form(ctx, chk, draw, H, K, V)
    layer = KDALayer(dim, H, K, V, draw.cpu, backend=backend)
    ref.randomize_norms(layer, draw.cpu)
    layer.to(dev)
    x = draw.randn(B, T, dim)
    y_ref, s_ref, full_ref, inputs_ref = ref.kda_layer(layer, f64(x))
    _, s_split, _, _ = ref.kda_layer(layer, f64(x[:, :split]))
    cond = f"backend={backend}, B={B}, T={T}"
    _check_gate(ctx, chk, draw, layer, kernels)
    where = dict(file=prefill_file, symbol="KDALayer.prefill / _inputs / _output" + (" (chunk_kda)" if kernels
                 else ""), condition=f"{cond}, prefill {split}")
    state = None
    with chk.guard(**where), torch.no_grad():
        y, state = layer.prefill(x[:, :split])
        chk.compare(y, y_ref[:, :split], "prefill output", **where)
        chk.compare(state.kda, s_split, "prefill final KDA state", **where)
        chk.compare(state.conv, full_ref[:, split:split + 3], "prefill convolution tail", **where)
    where = dict(file=decode_file, symbol="KDALayer.decode" + (" (fused_recurrent_kda)" if kernels else ""),
                 condition=f"{cond}, decode after {split}")
    with chk.guard(**where), torch.no_grad():
        outs = []
        for t in range(split, T if state is not None else split):  # none after a prefill that raised
            y, state = layer.decode(x[:, t:t + 1], state)
            outs.append(y)
        if outs:
            chk.compare(torch.cat(outs, 1), y_ref[:, split:], "decode output", **where)
            chk.compare(state.kda, s_ref, "decode final KDA state", **where)
    tail = T - split
    where = dict(file=prefill_file, symbol="KDALayer.prefill_with_tail", condition=f"{cond}, tail {tail}")
    with chk.guard(**where), torch.no_grad():
        y, state, rec = layer.prefill_with_tail(x, None, tail)
        chk.compare(y, y_ref, "output", **where)
        chk.compare(state.kda, s_ref, "final state", **where)
        ctx.check(rec.start == split, f"tail starts at {rec.start}, not {split}", **where)
        chk.compare(rec.state, s_split, "state before the tail", **where)
        chk.compare([rec.k, rec.v, rec.g, rec.beta], [t[:, split:] for t in inputs_ref[1:]],
                    "tail k, v, g, beta", **where)
        chk.compare(rec.conv, full_ref[:, split:], "tail convolution inputs", **where)
    # the pooled step as the engine runs it: the torch inputs and tail shift (kda_layer.py) around the backend's
    # recurrence; on the kernels' path then the one-launch decode inputs alone, and the whole fused step
    _check_pooled(ctx, chk, layer, x, split, cond, output=decode_file, tails=KDA_LAYER)
    if kernels:
        failed = ctx.failed
        _check_decode_inputs(ctx, chk, layer, x, split, cond)
        _check_gated_norm(ctx, chk, draw, layer, cond)
        if ctx.failed == failed:  # right inputs, recurrence and norm: what is left of the fused step is its wiring
            layer.fused = True
            try:
                _check_pooled(ctx, chk, layer, x, split, cond, output=KDA_LAYER, state=decode_file,
                              tails=DECODE_INPUTS, symbol="KDALayer.decode_pooled / _output (fused kernels)")
            finally:
                layer.fused = False


def _check_torch_chunk_form(ctx: ProbeContext, chk: Checker, draw: Draw, H: int, K: int, V: int) -> None:
    """The torch backend's chunked prefill (``naive_chunk_kda``: the CPU path of the layer) against the
    token-by-token definition in float64: two sequences of three chunks, the last one ragged, from initial
    states, so the state handed from chunk to chunk is judged, not only the first chunk's work."""
    from target_stack.ops.kda import naive_chunk_kda, naive_recurrent_kda
    from target_stack.ops.kda.testing import make_inputs

    B, T = 2, 2 * 64 + 37
    q, k, v, g, beta = make_inputs(B, T, H, K, V, device=ctx.device, generator=draw.cpu)
    h0 = torch.randn(B, H, K, V, generator=draw.cpu).to(ctx.device)
    where = dict(file=NAIVE, symbol="naive_chunk_kda",
                 condition=f"B={B}, T={T} (chunks of 64, the last one ragged), H={H}, K={K}, V={V}, initial state")
    with chk.guard(**where), torch.no_grad():
        o, s = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        o_ref, s_ref = naive_recurrent_kda(*(f64(t) for t in (q, k, v, g, beta)), initial_state=f64(h0),
                                           output_final_state=True)
        chk.compare(o, o_ref, "chunked output", **where)
        chk.compare(s, s_ref, "chunked final state", **where)


def _check_gate(ctx: ProbeContext, chk: Checker, draw: Draw, layer, kernels: bool, rows: int = 6) -> None:
    """The layer's gate -exp(A_log) softplus(f + dt_bias) (``kda_gate``, both backends; on the kernels' path
    also the one-launch decode inputs' own) over projections f of both signs, log-uniform from 1e-7 to 1e4 in
    size, and with f + dt_bias at every ``reference.GATE_EDGES`` value, against the float64 formula, element by element:
    |g - g64| <= tolerance * max(1, |g64|) (the decay exp(g)'s relative error where |g| <= 1, g's own beyond)."""
    import math

    from target_stack.ops.kda import kda_gate
    from target_stack.ops.kda.decode_inputs import kda_decode_inputs

    H, K, V = layer.H, layer.K, layer.V
    dt_bias = layer.dt_bias.detach().reshape(-1)
    f = ref.extreme_gate_inputs((rows, H, K), dt_bias, draw.gen)
    x = f64(f) + f64(dt_bias).reshape(H, K)
    want = ref.kda_gate64(x, layer.A_log)
    edges = ", ".join(f"{e:g}" for e in ref.GATE_EDGES)
    cond = f"f of both signs, |f| log-uniform in 1e-7 .. 1e4; f + dt_bias at +-({edges})"

    def check(g: torch.Tensor, what: str, **where: str) -> None:
        errs = ((f64(g) - want).abs() / want.abs().clamp(min=1.0)).nan_to_num(math.inf, math.inf).reshape(-1)
        i = int(errs.argmax())
        err = float(errs[i])
        chk.track(err)
        ctx.check(err <= chk.tolerance, f"{what}: error {err:.2e} > {chk.tolerance:g} against the float64 formula "
                  f"at f + dt_bias = {float(x.reshape(-1)[i]):.6g} ({float(g.reshape(-1)[i]):.6g}, not "
                  f"{float(want.reshape(-1)[i]):.6g})", **where)

    where = dict(file=NAIVE, symbol="kda_gate", condition=cond)
    with chk.guard(**where), torch.no_grad():
        check(kda_gate(f, layer.A_log, layer.dt_bias), "log decay g", **where)
    if kernels:
        where = dict(file=DECODE_INPUTS, symbol="kda_decode_inputs (gate)", condition=cond)
        with chk.guard(**where), torch.no_grad():
            C = layer.w_qkv.shape[0]
            got = kda_decode_inputs(draw.randn(rows, C), f.reshape(rows, H * K), draw.randn(rows, H),
                                    torch.zeros(rows + 1, 3, C, device=f.device),
                                    torch.arange(1, rows + 1, dtype=torch.int32, device=f.device), layer.conv,
                                    layer.dt_bias, layer.A_log, H, K, V)
            check(got[3].reshape(rows, H, K), "log decay g of the decode inputs", **where)


def _pooled_setup(layer, x: torch.Tensor, split: int):
    """Pools for a pooled step at token ``split``: batch rows in slots (2, 0 = padding, 1), seeded with the
    float64 run's states and convolution tails there.  (slots, rows, kda_pool, conv_pool, float64 tails)."""
    dev = x.device
    B = x.shape[0]
    C = layer.w_qkv.shape[0]
    slots = torch.tensor([2, 0, 1][:max(2, B + 1)], device=dev)
    rows = [0, 2][:B]  # batch rows at slots 2 and 1; row 1 is padding
    kda_pool = torch.zeros(4, layer.H, layer.K, layer.V, device=dev)
    conv_pool = torch.zeros(4, 3, C, device=dev)
    tails = []
    for i, r in enumerate(rows):
        _, s, full, _ = ref.kda_layer(layer, f64(x[i:i + 1, :split]))
        kda_pool[slots[r]] = s[0].to(dev, torch.float32)
        conv_pool[slots[r]] = full[0, -3:].to(dev, torch.float32)
        tails.append((s, full[:, -3:]))
    return slots, rows, kda_pool, conv_pool, tails


def _step_rows(x: torch.Tensor, t: int, slots: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """[slots, 1, dim]: token ``t`` of each batch row at its place; the padding row has its own (nonzero) input."""
    xs = torch.zeros(len(slots), 1, x.shape[-1], device=x.device)
    xs[1] = x[0, t] * 0.5 + 1.0
    for i, r in enumerate(rows):
        xs[r] = x[i, t]
    return xs


def _check_decode_inputs(ctx: ProbeContext, chk: Checker, layer, x: torch.Tensor, split: int, cond: str,
                         steps: int = 3) -> None:
    """The one-launch decode inputs (``kda_decode_inputs``: the convolution over the pooled tails, SiLU, q/k
    L2 norms, gates, the tails shifted in place) over a few consecutive steps, rows in slots (2, 0 = padding, 1),
    against the float64 definition on the same tails; the null slot reads zeros and is never written."""
    import torch.nn.functional as F

    from target_stack.ops.kda.decode_inputs import kda_decode_inputs

    slots, rows, _, conv_pool, tails = _pooled_setup(layer, x, split)
    hist = {r: conv for r, (_, conv) in zip(rows, tails)}
    for step in range(min(steps, x.shape[1] - split)):
        where = dict(file=DECODE_INPUTS, symbol="kda_decode_inputs",
                     condition=f"{cond}, slots {slots.tolist()}, decode step {step + 1} after {split}")
        xs = _step_rows(x, split + step, slots, rows)
        with chk.guard(**where), torch.no_grad():
            got = kda_decode_inputs(F.linear(xs, layer.w_qkv), F.linear(xs, layer.w_f), F.linear(xs, layer.w_b),
                                    conv_pool, slots, layer.conv, layer.dt_bias, layer.A_log, layer.H, layer.K,
                                    layer.V)
            for r in rows:
                want, full = ref.kda_inputs(layer, f64(xs[r:r + 1]), hist[r])
                hist[r] = full[:, -3:]
                slot = int(slots[r])
                chk.compare([t[r:r + 1] for t in got], list(want), f"q, k, v, g, beta of the row in slot {slot}",
                            **where)
                chk.compare(conv_pool[slot], hist[r][0], f"convolution tail of slot {slot} after the shift", **where)
            chk.compare([t[1:2] for t in got], list(ref.kda_inputs(layer, f64(xs[1:2]))[0]),
                        "inputs of the padding row (slot 0 must read zero tails)", **where)
            ctx.check(not conv_pool[0].any(), "the null slot 0 was written", **where)


def _check_gated_norm(ctx: ProbeContext, chk: Checker, draw: Draw, layer, cond: str) -> None:
    """The one-launch RMSNorm with the output gate (the fused decode step's output norm) against its definition."""
    from target_stack.ops.norm import rms_norm

    o, gate = draw.randn(2, 3, layer.H, layer.V), draw.randn(2, 3, layer.H, layer.V) * 2.0
    where = dict(file=NORM, symbol="rms_norm (gate)", condition=f"{cond}, o and gate [2, 3, {layer.H}, {layer.V}]")
    with chk.guard(**where), torch.no_grad():
        chk.compare(rms_norm(o, layer.norm_w, ref.EPS, gate=gate, out_dtype=o.dtype),
                    ref.rmsnorm(f64(o), f64(layer.norm_w), ref.EPS) * ref.sigmoid(f64(gate)), "gated RMSNorm", **where)


def _check_pooled(ctx: ProbeContext, chk: Checker, layer, x: torch.Tensor, split: int, cond: str, *, output: str,
                  tails: str, state: str | None = None, symbol: str = "KDALayer.decode_pooled") -> None:
    """One pooled decode step at token ``split``: rows in slots (2, 0 = padding, 1), states seeded
    from the float64 run; outputs and the written slots against it, the null slot left zero.  Failures
    of the outputs are blamed on ``output``, of the states on ``state`` (default: ``output``), of the
    convolution tails on ``tails``."""
    slots, rows, kda_pool, conv_pool, seeded = _pooled_setup(layer, x, split)
    xs = _step_rows(x, split, slots, rows)
    states = []
    for i, (s, conv) in enumerate(seeded):
        y, s2, full2, _ = ref.kda_layer(layer, f64(x[i:i + 1, split:split + 1]), h0=s, conv_hist=conv)
        states.append((y, s2, full2))
    pad_ref = ref.kda_layer(layer, f64(xs[1:2]))[0]
    where = dict(file=output, symbol=symbol, condition=f"{cond}, slots {slots.tolist()}")
    states_at, tails = dict(where, file=state or output), dict(where, file=tails)
    with chk.guard(**where), torch.no_grad():
        out = layer.decode_pooled(xs, conv_pool, kda_pool, slots)
        for r, (y, s2, full2) in zip(rows, states):
            chk.compare(out[r:r + 1], y, f"output of the row in slot {int(slots[r])}", **where)
            chk.compare(kda_pool[slots[r]], s2[0], f"KDA state written to slot {int(slots[r])}", **states_at)
            chk.compare(conv_pool[slots[r]], full2[0, -3:], f"convolution tail of slot {int(slots[r])}",
                        **tails)
        chk.compare(out[1:2], pad_ref, "padding row (slot 0 must read zeros)", **where)
        ctx.check(not kda_pool[0].any(), "the null slot 0's KDA state was written", **states_at)
        ctx.check(not conv_pool[0].any(), "the null slot 0's convolution tail was written", **tails)


# -- derived weights (target_stack/model/derived.py): remade after an in-place update, kept otherwise ----------

# the in-place updates a served model sees; ``.data.copy_`` is left out: a write through ``.data`` bypasses the
# version counter (torch's own contract), so no version-keyed cache can see it
DERIVED_UPDATES = ("load_state_dict of a freshly built model's state", "copy_ of fresh values into each parameter",
                   "in-place mul_ of each parameter by random factors in [0.5, 1.5)")


class _Counted:
    """A derived weight's build, counted: how often a ``DerivedWeight`` remakes its tensor (the build unchanged)."""

    def __init__(self, build):
        self.build, self.calls = build, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.build(*args, **kwargs)


def _check_derived_alone(ctx: ProbeContext, draw: Draw) -> tuple[bool, bool]:
    """``DerivedWeight`` on its own, two random matrices as parts: built once, the same tensor (no rebuild) while
    nothing changes, and after every in-place update of a part (load_state_dict, copy_ into one part, mul_, an
    indexed write), a new tensor in a part's place and a changed extra argument, exactly the build of the parts as
    they are now (one rebuild); and ``stack_rows``: the parts one under the other.  (cache holds, stack_rows holds)."""
    from target_stack.model.derived import DerivedWeight, stack_rows

    parts = [draw.randn(n, 5) for n in (3, 1, 2)]
    where = dict(file=DERIVED, symbol="stack_rows", condition=f"three random parts of 3, 1 and 2 rows on {ctx.device}")
    stacked = stack_rows(parts)
    stack_ok = stacked.shape == (6, 5) and torch.equal(stacked, torch.cat(parts))
    ctx.check(stack_ok, "stack_rows is not the parts one under the other", **where)

    mod = torch.nn.Module()
    mod.a, mod.b = torch.nn.Parameter(draw.randn(3, 5)), torch.nn.Parameter(draw.randn(2, 5))
    count = _Counted(lambda parts, dtype: torch.cat(list(parts)).to(dtype))
    dw = DerivedWeight(count)
    ok, last = True, None

    def step(what: str, dtype=torch.float32, rebuilds: int = 1) -> None:
        nonlocal ok, last
        where = dict(file=DERIVED, symbol="DerivedWeight.__call__", condition=f"{what} (alone: two random parts "
                     f"on {ctx.device})")
        before = count.calls
        try:
            got = dw((mod.a, mod.b), dtype)
        except Exception as exc:  # noqa: BLE001 - the cache's own failure, located
            ok = False
            ctx.fail(f"DerivedWeight raised {type(exc).__name__}: {exc}", **where)
            return
        want = torch.cat([mod.a.detach(), mod.b.detach()]).to(dtype)
        built = count.calls - before
        if not (got.dtype == want.dtype and torch.equal(got, want)):
            ok = False
            ctx.fail(f"the derived tensor is not the build of the parts as they are now (rebuilt {built} times): "
                     "a stale copy", **where)
        elif built != rebuilds or (rebuilds == 0 and got is not last):
            ok = False
            ctx.fail(f"rebuilt {built} times, expected {rebuilds}" + (" (nothing changed: the cached tensor must be "
                     "served again)" if rebuilds == 0 else ""), **where)
        last = got

    step("first call")
    step("second call, nothing changed", rebuilds=0)
    fresh = torch.nn.Module()
    fresh.a, fresh.b = torch.nn.Parameter(draw.randn(3, 5)), torch.nn.Parameter(draw.randn(2, 5))
    mod.load_state_dict(fresh.state_dict())
    step("after load_state_dict")
    with torch.no_grad():
        mod.b.copy_(draw.randn(2, 5))
    step("after copy_ into the second part only")
    with torch.no_grad():
        mod.a.mul_(draw.rand(3, 5) + 0.5)
    step("after mul_ of the first part")
    with torch.no_grad():
        mod.b[1] = draw.randn(5)
    step("after an indexed write into one row of the second part")
    mod.a = torch.nn.Parameter(draw.randn(3, 5))
    step("after a new tensor in the first part's place")
    step("the extra argument changed (dtype float64)", dtype=torch.float64)
    step("the extra argument unchanged", dtype=torch.float64, rebuilds=0)
    return ok, stack_ok


def _derived_paths(ctx: ProbeContext, model, draw: Draw, units: list) -> list[dict]:
    """Every path of ``model`` that reads a derived weight, each with its float64 definition on the weights the
    modules hold now: the sparse-attention layer's fused projection ([w_qkv; w_idx]), the KDA layer's stacked input
    projections (the fused decode step's one product), the MoE's graph-safe form over the stacked experts, the
    small-batch experts (with the shared expert), on the CPU the native backend (stacked experts) and on a GPU the
    grouped GEMMs of a bf16 copy (its own derived layout; added to ``units``, the modules the updates reach)."""
    import copy

    import torch.nn.functional as F

    from target_stack.model.kda_layer import KDALayer
    from target_stack.model.layers import MoE
    from target_stack.model.model import SparseAttentionLayer

    def first(kind):
        return next(m for m in model.modules() if isinstance(m, kind))

    attn, kda, moe = first(SparseAttentionLayer), first(KDALayer), first(MoE)

    def flag(module, name: str, value, fn):
        def run(x):
            before = getattr(module, name)
            setattr(module, name, value)
            try:
                return fn(x)
            finally:
                setattr(module, name, before)
        return run

    def project(x):
        q, k, v, iq, ik = attn.project(x)
        return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1), iq, ik], dim=-1)

    def stacked_product(parts):
        return lambda x: (f64(x) @ torch.cat([f64(w) for w in parts()]).T, None)

    def moe_ref(module):
        def want(x):
            out, margin = ref.moe(f64(x), module)
            return out, margin > MARGIN
        return want

    def static(small: bool):
        def run(x):  # the expert form: a tenth of the token form's time in the interpreter, the same derived weight
            before = moe.small_batch, moe.small_batch_form
            moe.small_batch, moe.small_batch_form = small, "expert"
            try:
                return moe.forward_static(x)
            finally:
                moe.small_batch, moe.small_batch_form = before
        return run

    # report: a first-call error is this probe's to name (the projections' wiring); the MoE forms are judged by
    # model.layers and model.moe.native, so one wrong on its first call is only left out of the cache's checks here
    paths = [dict(symbol="SparseAttentionLayer.project (fused: one product over [w_qkv; w_idx])", file=MODEL,
                  fn=flag(attn, "fused", True, project), want=stacked_product(lambda: (attn.w_qkv, attn.w_idx)),
                  report=True),
             dict(symbol="KDALayer.input_weight (the fused decode step's product)", file=KDA_LAYER,
                  fn=lambda x: F.linear(x, kda.input_weight()),
                  want=stacked_product(lambda: (kda.w_qkv, kda.w_f, kda.w_g, kda.w_b)), report=True),
             dict(symbol="MoE.forward_static (masked_dense over MoE.stacked_weights)", file=LAYERS, fn=static(False),
                  want=moe_ref(moe)),
             dict(symbol="MoE.forward_static (small_batch_experts, form='expert', over MoE._small_weights)",
                  file=LAYERS, fn=static(True), want=moe_ref(moe))]
    if ctx.device == "cpu":  # the native backend is a CPU fp32 path (on a GPU it reads the parameters)
        paths.append(dict(symbol="MoE.forward (backend='native', over MoE.stacked_weights)", file=LAYERS,
                          fn=flag(moe, "backend", "native", moe), want=moe_ref(moe)))
    elif hasattr(torch, "_grouped_mm"):  # the grouped GEMMs' own layout, where they run: bf16 on a GPU
        twin = copy.deepcopy(moe).to(torch.bfloat16)
        twin.fused = False  # the torch router (judged in model.layers): only the experts' layout is at stake here
        if twin._grouped_ok(draw.randn(8, model.cfg.dim).to(torch.bfloat16)):
            index = next(i for i, b in enumerate(model.blocks) if b.ffn is moe)
            units.append((twin, lambda donor: donor.blocks[index].ffn))
            tol = float(ctx.params.get("bf16_tolerance", 3e-2))
            paths.append(dict(symbol="MoE.forward bf16 (grouped GEMMs over MoE._grouped_weights)", file=LAYERS,
                              fn=lambda x: twin(x.to(torch.bfloat16)),
                              want=lambda x: moe_ref(twin)(x.to(torch.bfloat16)), tol=tol, metric="max_rel_err_bf16"))
    return paths


def _check_derived_weights(ctx: ProbeContext, chk: Checker, draw: Draw) -> None:
    """The cache contract of derived weights, both ways, on a model's own paths: each path that reads one (see
    ``_derived_paths``) runs once, runs again with nothing changed (no derived weight rebuilt), then after each of
    ``DERIVED_UPDATES`` (in place: same storage, the version counter bumped) is held to the float64 definition on
    the new weights.  A stale or needlessly rebuilt copy is ``DerivedWeight``'s where the cache on its own
    (``_check_derived_alone``) breaks the same contract, else the path's (the parts it keys on).
    About 0.7 s on the CPU (the small-batch experts in the interpreter five times, 0.1 s each; a fork)."""
    import dataclasses

    from target_stack.model.derived import DerivedWeight
    from target_stack.model.model import HybridModel, ModelConfig

    cache_ok, stack_ok = _check_derived_alone(ctx, draw)
    dev = ctx.device
    model = HybridModel(ModelConfig(seed=_seed(draw)))
    ref.randomize_norms(model, draw.cpu)
    model.to(dev).eval()
    units = [(model, lambda donor: donor)]  # (module, its counterpart in a donor model): what an update reaches
    paths = _derived_paths(ctx, model, draw, units)
    counters = [v for unit, _ in units for m in unit.modules() for v in vars(m).values()
                if isinstance(v, DerivedWeight)]
    for dw in counters:
        dw.build = _Counted(dw.build)
    T = 6  # a decode-sized batch: the small-batch experts take it
    cond = f"T={T}, {dev}"

    def builds() -> int:
        return sum(getattr(dw.build, "calls", 0) for dw in counters)

    def run(path: dict, x: torch.Tensor):
        """(output, float64 definition, derived weights built during the call), on the rows whose routing is clear."""
        before = builds()
        with torch.no_grad():
            out = path["fn"](x)
        built = builds() - before
        want, clear = path["want"](x)
        if clear is not None:
            out, want = out[clear.to(out.device)], want[clear]
        return out, want, built

    def blame(path: dict) -> dict:
        return dict(file=DERIVED, symbol="DerivedWeight.__call__") if not cache_ok else \
            dict(file=path["file"], symbol=path["symbol"])

    x = draw.randn(T, model.cfg.dim)
    live = []
    for path in paths:  # first calls: the derived weights built from the weights as loaded
        tol = path.get("tol", chk.tolerance)
        if path.get("report"):
            where = dict(file=path["file"], symbol=path["symbol"]) if stack_ok else \
                dict(file=DERIVED, symbol="stack_rows")  # the projections' stacked weights
            where["condition"] = f"{cond}; {path['symbol']}, first call"
            with chk.guard(**where):
                out, want, _ = run(path, x)
                if chk.compare(out, want, "output on the weights as loaded", **where) <= tol:
                    live.append(path)
            continue
        try:
            out, want, _ = run(path, x)
            err = rel_err(out, want)
        except Exception:  # noqa: BLE001 - judged by the probes of its own (see _derived_paths)
            continue
        if err <= tol:
            chk.track(err, path.get("metric"))
            live.append(path)
    for path in live:  # nothing changed: nothing rebuilt
        where = dict(blame(path), condition=f"{cond}; {path['symbol']} called again, no weight changed")
        with chk.guard(**where):
            _, _, built = run(path, x)
            ctx.check(built == 0, f"{built} derived weights rebuilt on a second call with no weight changed (the "
                      "cache must serve the same tensor)", **where)
    for i, kind in enumerate(DERIVED_UPDATES):
        donor = HybridModel(dataclasses.replace(model.cfg, seed=_seed(draw))) if i < 2 else None
        with torch.no_grad():
            for unit, pick in units:
                if i == 0:
                    unit.load_state_dict(pick(donor).state_dict())
                elif i == 1:
                    for p, q in zip(unit.parameters(), pick(donor).parameters(), strict=True):
                        p.copy_(q)
                else:
                    for p in unit.parameters():
                        p.mul_((torch.rand(p.shape, generator=draw.cpu) + 0.5).to(p))
        x = draw.randn(T, model.cfg.dim)
        for path in live:
            where = dict(blame(path), condition=f"{cond}; {path['symbol']} after {kind} (in place: same storage, "
                         "version counter bumped)")
            with chk.guard(**where):
                out, want, built = run(path, x)
                chk.compare(out, want, f"output after the update ({built} derived weights rebuilt in this call; "
                            "a stale derived copy keeps the old weights)", tolerance=path.get("tol"),
                            metric=path.get("metric"), against="the float64 definition on the new weights", **where)


# -- the image path and the whole model --------------------------------------------------------------


def _netpbm(pixels: torch.Tensor, maxval: int) -> bytes:
    """Binary PPM (3 channels) or PGM (1) bytes of pixels [C, H, W] (ints <= maxval), with a comment."""
    C, H, W = pixels.shape
    magic = b"P6" if C == 3 else b"P5"
    body = bytes(pixels.permute(1, 2, 0).reshape(-1).tolist())
    return magic + b"\n# probe image\n%d %d\n%d\n" % (W, H, maxval) + body


def _check_image_loading(ctx: ProbeContext, chk: Checker, draw: Draw, patch: int, side: int) -> None:
    from target_stack.model.image import load_image

    H, W = 2 * patch, 3 * patch
    for C, maxval in ((3, 255), (1, 200), (3, 100)):
        px = draw.randint(maxval + 1, (C, H, W))
        want = (f64(px) / maxval).expand(3, H, W)
        where = dict(file=IMAGE, symbol="decode_netpbm / load_image", condition=f"{'PPM' if C == 3 else 'PGM'} "
                     f"{W}x{H}, maxval {maxval}")
        with chk.guard(**where):
            chk.compare(load_image(_netpbm(px, maxval), patch, side), want, "decoded image", **where)
    px = draw.randint(256, (3, H, W)).to(torch.uint8)
    where = dict(file=IMAGE, symbol="load_image", condition="uint8 tensor")
    with chk.guard(**where):
        chk.compare(load_image(px, patch, side), f64(px) / 255, "uint8 image", **where)


@probe(kind="correctness")
def hybrid(ctx: ProbeContext) -> None:
    """The image path (netpbm decoding, normalisation, the image encoder) and the hybrid model
    (embedding, every block, final norm, LM head, an image prefix) against float64 compositions of
    the layer definitions; each component also runs on its own input from the model, to name it."""
    from target_stack.model.model import HybridModel, ModelConfig

    p = ctx.params
    chk = Checker(ctx, p.get("tolerance", 1e-4))
    draw = Draw(ctx.device)
    dev = ctx.device
    model = HybridModel(ModelConfig(seed=_seed(draw)))
    ref.randomize_norms(model, draw.cpu)
    model.to(dev).eval()
    cfg = model.cfg
    _check_image_loading(ctx, chk, draw, cfg.patch, cfg.max_image_side)
    image = draw.rand(3, 2 * cfg.patch, 3 * cfg.patch)
    where = dict(file=MODEL, symbol="ImageEncoder.forward / patches")
    embeds = None
    with chk.guard(**where):
        embeds = model.image_encoder(image)
        chk.compare(embeds, ref.image_encoder(model.image_encoder, f64(image)), "image embeddings", **where)
    lengths = p.get("T", 80)  # sequence lengths: a multiple of the key block and of no chunk, one past both
    lengths = lengths if isinstance(lengths, list) else [lengths]
    located: dict[tuple[str, str], tuple[float, list[int]]] = {}
    checks, first = [], None
    for T in lengths:
        for _ in range(3):  # inputs with a near-tie in a discrete choice are drawn again
            tokens = draw.randint(cfg.vocab, (2, T))
            refs = [ref.hybrid_logits(model, row.tolist()) for row in tokens]
            if min(m for _, m in refs) > MARGIN:
                break
        first = tokens if first is None else first
        ctx.check(cfg.block * cfg.top_k_blocks < T, "probe sequence too short to drop key blocks", file=MODEL)
        for row in tokens:  # each component on the input the model gives it: names the part that is off
            with chk.guard(file=MODEL, symbol="HybridModel.forward", condition=f"T={T}"):
                for file, symbol, err in ref.diagnose(model, row.tolist(), chk.tolerance, MARGIN):
                    worst, at = located.get((file, symbol), (0.0, []))
                    located[file, symbol] = (max(err, worst), at + [T] * (T not in at))
        checks.append(("HybridModel.forward", tokens, None, torch.stack([r for r, _ in refs]), f"T={T}"))
    for (file, symbol), (err, at) in located.items():
        ctx.fail(f"{symbol} departs from its definition on the model's own input: rel. error {err:.2e}",
                 file=file, symbol=symbol, condition=f"T={', '.join(map(str, at))}, in the hybrid model")
    if embeds is not None:
        want, margin = ref.hybrid_logits(model, first[0, :20].tolist(), prefix=f64(embeds))
        if margin > MARGIN:
            checks.append(("HybridModel.forward (prefix)", first[:1, :20], embeds[None], want[None],
                           "image embeddings in front"))
    for symbol, toks, prefix, want, cond in checks:
        where = dict(file=MODEL, symbol=symbol, condition=cond)
        with chk.guard(**where):
            out = model(toks, prefix=prefix)
            if located:  # already named; the end-to-end error still counts
                chk.track(rel_err(out, want))
            else:
                chk.compare(out, want, "logits (every component matches on its own input: the composition)",
                            **where)
    # the derived weights' cache, in a child on the CPU (the native backend and the interpreter run there)
    isolated(ctx, lambda: _check_derived_weights(ctx, chk, draw), chk, file=DERIVED, symbol="DerivedWeight.__call__")
    chk.report()
