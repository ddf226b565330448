"""Float64 references of target_stack's layers, written from their definitions (protected).

The component probes compare the serving code with these.  Nothing here calls a layer's own
``forward`` or ``reference``: only the weights are read from the modules (as float64 CPU copies)
and the maths is written out again from the docstrings.  The KDA recurrence itself is the
protected ``target_stack.ops.kda.naive.naive_recurrent_kda``.

Discrete choices (top-k experts, top-k key blocks) come with their float64 ``margin``, the gap
between the last chosen and the first left-out score: a probe compares a choice made in fp32 only
where that gap is far above the fp32 rounding of the scores.
"""

from __future__ import annotations

import contextlib
import math

import torch

F64 = torch.float64
EPS = 1e-6  # the RMSNorm epsilon of every norm in the model (layers, KDA output norm, image encoder)
CONV = 4  # the KDA layer's short convolution width
LAYERS = "target_stack/model/layers.py"  # the files diagnose() names
KDA_LAYER = "target_stack/model/kda_layer.py"
MODEL = "target_stack/model/model.py"
NATIVE_C = "target_stack/ops/moe/native/moe_dispatch.c"


def f64(t: torch.Tensor) -> torch.Tensor:
    """A float64 CPU copy (weights and inputs of the references)."""
    return t.detach().to("cpu", F64)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 30, x, torch.log1p(torch.exp(x.clamp(max=30))))


def kda_gate64(x: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
    """KDA's log decay -exp(A_log[h]) softplus(x) for softplus's input x = raw + dt_bias [..., H, K], in float64,
    on x's device (a GPU probe's reference stays beside its inputs; a CPU reference's stays on the CPU)."""
    x = x.detach().double()
    return -torch.exp(a_log.detach().to(x.device, F64))[:, None] * softplus(x)


#: softplus inputs where the gate's arithmetic changes: torch's (and the kernels') linear branch above 20, the
#: float64 definition's above 30, fp32 exp() overflowing above ~88.7 and going subnormal below ~-87.3, and far
#: beyond; each is drawn with both signs
GATE_EDGES = (0.0, 1e-7, 19.99, 20.0, 20.01, 30.0, 87.3, 88.7, 88.8, 89.0, 100.0, 1e3, 1e4, 1e30)


def magnitudes(shape, gen: torch.Generator, lo: float, hi: float) -> torch.Tensor:
    """Positive fp32 values log-uniform over [lo, hi] (every order of magnitude alike) on the generator's device."""
    u = torch.rand(*shape, generator=gen, device=gen.device, dtype=torch.float64)
    return (math.log(lo) + (math.log(hi) - math.log(lo)) * u).exp().float()


def extreme_gate_inputs(shape, dt_bias: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Raw gate inputs ``shape`` (ending [H, K]) of both signs, log-uniform over 1e-7 .. 1e4 in magnitude, and
    among them softplus's inputs (raw + ``dt_bias`` [H * K]) at every ``GATE_EDGES`` value with both signs."""
    dev = gen.device
    sign = torch.where(torch.rand(*shape, generator=gen, device=dev) < 0.5, -1.0, 1.0)
    raw = sign * magnitudes(shape, gen, 1e-7, 1e4)
    edges = torch.tensor([s * e for e in GATE_EDGES for s in (1.0, -1.0)], device=dev)
    at = torch.randperm(raw.numel(), generator=gen, device=dev)[:edges.numel()]
    hk = shape[-2] * shape[-1]
    raw.view(-1)[at] = edges[:at.numel()] - dt_bias.reshape(-1)[at % hk].to(raw.dtype)  # raw + dt_bias: the edge
    return raw


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension; entries at -inf get probability 0."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True))


def swiglu(x: torch.Tensor, mlp) -> torch.Tensor:
    """down(silu(gate x) * up x) with the weights of a SwiGLU module."""
    return (silu(x @ f64(mlp.w_gate).T) * (x @ f64(mlp.w_up).T)) @ f64(mlp.w_down).T


def moe_route(x: torch.Tensor, moe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k] by decreasing selection score, margin [T]).

    Scores are sigmoid(router x); the k experts with the highest score + bias are chosen; their
    weights are their scores (without the bias) normalised to sum to one.
    """
    scores = sigmoid(x @ f64(moe.router).T)
    select = scores + f64(moe.router_bias)
    k = moe.top_k
    ranked, order = torch.sort(select, dim=-1, descending=True)
    idx = order[:, :k]
    margin = (ranked[:, k - 1] - ranked[:, k]) if k < select.shape[-1] else torch.full_like(ranked[:, 0], math.inf)
    w = scores.gather(-1, idx)
    return w / w.sum(-1, keepdim=True), idx, margin


def moe(x: torch.Tensor, module) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, D], routing margin [T]): sum_k w_k expert_{idx_k}(x) + shared(x)."""
    w, idx, margin = moe_route(x, module)
    out = swiglu(x, module.shared)
    for e, expert in enumerate(module.experts):
        weight = (w * (idx == e)).sum(-1, keepdim=True)  # the token's weight for expert e (0 if not chosen)
        if weight.any():
            out = out + weight * swiglu(x, expert)
    return out, margin


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                     qpos: torch.Tensor, block: int, top_k: int, window: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal block-sparse attention, one query at a time: (out [Tq, H, D], margin [Tq], kept [Tq, Tk]).

    Query i at position qpos[i] sees the keys at positions <= qpos[i].  The key blocks
    [b * block, (b + 1) * block) holding at least one of them are scored by the largest indexer
    product iq_i . ik_j over those keys; the query attends to the keys of its top_k best blocks
    (all of them if fewer) and to the last ``window`` positions up to itself, softmax(q.k / sqrt(D)).
    """
    Tq, H, D = q.shape
    Tk = k.shape[0]
    out = torch.empty(Tq, H, v.shape[-1], dtype=F64)
    margin = torch.full((Tq,), math.inf, dtype=F64)
    kept = torch.zeros(Tq, Tk, dtype=torch.bool)
    for i in range(Tq):
        p = int(qpos[i])
        s = iq[i] @ ik[:p + 1].T  # the causal keys' indexer scores
        blocks = [(s[b:b + block].max().item(), b // block) for b in range(0, p + 1, block)]
        blocks.sort(reverse=True)
        if len(blocks) > top_k:
            margin[i] = blocks[top_k - 1][0] - blocks[top_k][0]
        for _, b in blocks[:top_k]:
            kept[i, b * block:min((b + 1) * block, p + 1)] = True
        kept[i, max(0, p - window + 1):p + 1] = True
        keys = kept[i].nonzero()[:, 0]
        att = softmax(torch.einsum("hd,khd->hk", q[i], k[keys]) / math.sqrt(D))
        out[i] = torch.einsum("hk,khd->hd", att, v[keys])
    return out, margin, kept


def kda_inputs(layer, x: torch.Tensor, conv_hist: torch.Tensor | None = None):
    """The KDA layer's kernel inputs (q, k, v, g, beta) for x [B, T, dim] and the convolution inputs
    [B, CONV - 1 + T, C] (``conv_hist`` or zeros before the first token).

    q, k, v = silu(causal depthwise conv of W_qkv x, kernel CONV, conv[:, CONV - 1] on the newest
    token); q, k L2-normalised per head; g = -exp(A_log) softplus(W_f x + dt_bias); beta = sigmoid(W_b x).
    """
    B, T, _ = x.shape
    H, K, V = layer.H, layer.K, layer.V
    pre = x @ f64(layer.w_qkv).T
    hist = torch.zeros(B, CONV - 1, pre.shape[-1], dtype=F64) if conv_hist is None else conv_hist
    full = torch.cat([hist, pre], dim=1)
    w = f64(layer.conv)  # [C, CONV]
    mixed = sum(full[:, j:j + T] * w[:, j] for j in range(CONV))
    mixed = silu(mixed)
    q = l2norm(mixed[..., :H * K].reshape(B, T, H, K))
    k = l2norm(mixed[..., H * K:2 * H * K].reshape(B, T, H, K))
    v = mixed[..., 2 * H * K:].reshape(B, T, H, V)
    f = (x @ f64(layer.w_f).T).reshape(B, T, H, K) + f64(layer.dt_bias).reshape(H, K)
    g = kda_gate64(f, layer.A_log)
    beta = sigmoid(x @ f64(layer.w_b).T)
    return (q, k, v, g, beta), full


def kda_output(layer, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """W_o (rmsnorm_V(o) * norm_w * sigmoid(W_g x)) for o [B, T, H, V]."""
    B, T = x.shape[:2]
    normed = rmsnorm(o, f64(layer.norm_w)).reshape(B, T, -1)
    return (normed * sigmoid(x @ f64(layer.w_g).T)) @ f64(layer.w_o).T


def kda_layer(layer, x: torch.Tensor, h0: torch.Tensor | None = None, conv_hist: torch.Tensor | None = None):
    """(y [B, T, dim], final KDA state [B, H, K, V], convolution inputs [B, CONV - 1 + T, C], kernel inputs)."""
    from target_stack.ops.kda.naive import naive_recurrent_kda

    inputs, full = kda_inputs(layer, x, conv_hist)
    o, state = naive_recurrent_kda(*inputs, initial_state=h0, output_final_state=True)
    return kda_output(layer, o, x), state, full, inputs


def attention_layer(mixer, x: torch.Tensor, cfg, qpos: torch.Tensor | None = None):
    """(out [T, dim], margin [T], kept): a sparse-attention layer on one sequence x [T, dim]."""
    h, hd, di = cfg.attn_heads, cfg.attn_head_dim, cfg.index_dim
    qkv = x @ f64(mixer.w_qkv).T
    q, k, v = (qkv[:, i * h * hd:(i + 1) * h * hd].reshape(-1, h, hd) for i in range(3))
    idx = x @ f64(mixer.w_idx).T
    iq, ik = idx[:, :di], idx[:, di:]
    qpos = torch.arange(x.shape[0]) if qpos is None else qpos
    o, margin, kept = sparse_attention(q, k, v, iq, ik, qpos, cfg.block, cfg.top_k_blocks, cfg.window)
    return o.reshape(x.shape[0], -1) @ f64(mixer.w_o).T, margin, kept


def patches(image: torch.Tensor, p: int) -> torch.Tensor:
    """[N, 3 p p]: the p x p patches of image [3, H, W] in row-major order, each flattened (channel, row, column)."""
    _, H, W = image.shape
    return torch.stack([image[:, i:i + p, j:j + p].reshape(-1) for i in range(0, H, p) for j in range(0, W, p)])


def image_encoder(enc, image: torch.Tensor) -> torch.Tensor:
    """Patch embedding, then per layer x + attn(norm1 x), x + mlp(norm2 x) with bidirectional
    multi-head attention, then a final RMSNorm: [N, dim]."""
    cfg = enc.cfg
    h = patches(image, cfg.patch) @ f64(enc.patch_embed).T
    heads, d = cfg.attn_heads, cfg.dim
    for layer in enc.layers:
        x = rmsnorm(h, f64(layer.norm1.weight))
        qkv = x @ f64(layer.w_qkv).T
        q, k, v = (qkv[:, i * d:(i + 1) * d].reshape(-1, heads, d // heads) for i in range(3))
        att = softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d // heads))
        h = h + torch.einsum("hqk,khd->qhd", att, v).reshape(-1, d) @ f64(layer.w_o).T
        h = h + swiglu(rmsnorm(h, f64(layer.norm2.weight)), layer.mlp)
    return rmsnorm(h, f64(enc.norm.weight))


def block(blk, index: int, cfg, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + mixer(norm1 h) then + ffn(norm2 h), the smallest margin of its discrete choices at each
    position [T]: inf where a position makes none) for h [T, dim].

    Layer ``index`` (0-based) is sparse attention when (index + 1) % attn_every == 0, else KDA; its
    FFN is the dense SwiGLU in layer 0 and the MoE after it.
    """
    x = rmsnorm(h, f64(blk.norm1.weight))
    if (index + 1) % cfg.attn_every == 0:
        mix, worst, _ = attention_layer(blk.mixer, x, cfg)
    else:
        mix = kda_layer(blk.mixer, x[None])[0][0]
        worst = torch.full((h.shape[0],), math.inf, dtype=F64)
    h = h + mix
    x = rmsnorm(h, f64(blk.norm2.weight))
    if index == 0:
        out = h + swiglu(x, blk.ffn)
    else:
        out, margin = moe(x, blk.ffn)
        out, worst = h + out, torch.minimum(worst, margin)
    return out, worst


def hybrid_logits(model, tokens: list[int], prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(logits [positions, vocab], smallest decision margin) of one sequence: token embeddings
    (image embeddings ``prefix`` in front), every block, a final RMSNorm and the LM head."""
    logits, margins = hybrid_logits_by_position(model, tokens, prefix)
    return logits, margins.min().item() if margins.numel() else math.inf


def hybrid_logits_by_position(model, tokens: list[int], prefix: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [positions, vocab], margins [positions]): :func:`hybrid_logits` with the smallest margin
    of the discrete choices made at each position (every layer's block choice and expert routing of
    that position's query or token), inf where it makes none."""
    h = f64(model.embed)[torch.tensor(tokens, dtype=torch.long)]
    if prefix is not None:
        h = torch.cat([prefix, h])
    worst = torch.full((h.shape[0],), math.inf, dtype=F64)
    for i, blk in enumerate(model.blocks):
        h, margin = block(blk, i, model.cfg, h)
        worst = torch.minimum(worst, margin)
    return rmsnorm(h, f64(model.norm.weight)) @ f64(model.lm_head).T, worst


STATE_SYMBOL = "KDALayer.prefill (final state)"
DECODE_SYMBOL = "KDALayer.decode"
#: what diagnose(carried=True) judges beyond the outputs: what a server carries from step to step
CARRIED = (STATE_SYMBOL, DECODE_SYMBOL)


def diagnose(model, tokens: list[int], tolerance: float = 1e-4, margin: float = 1e-4, carried: bool = False
             ) -> list[tuple[str, str, float]]:
    """Which part of a model's serving path departs from its definition, on one sequence.

    Every component runs on the input the model itself gives it (embedding, each norm, mixer and
    FFN, each block's wiring of its own components, final norm and LM head; with ``carried``, what
    a server carries from step to step too: a KDA layer's final state and one decode step) and is
    compared with its float64 definition; returns (file, symbol, rel. error) of those beyond
    ``tolerance``.  A component whose discrete choices are within ``margin`` of a tie is not judged.
    """
    from feedback.correctness import rel_err

    cfg, dev = model.cfg, model.embed.device
    bad: dict[tuple[str, str], float] = {}

    def judge(out, want, file, symbol):
        err = rel_err(out, want)
        if not err <= tolerance:
            bad[file, symbol] = max(err, bad.get((file, symbol), 0.0))

    with torch.no_grad():
        t = torch.tensor([tokens], device=dev)
        h = model.embed_tokens(t)
        judge(h[0], f64(model.embed)[t[0].cpu()], MODEL, "HybridModel.embed_tokens")
        for i, blk in enumerate(model.blocks):
            x = blk.norm1(h)
            judge(x, rmsnorm(f64(h), f64(blk.norm1.weight)), LAYERS, "RMSNorm.forward")
            if (i + 1) % cfg.attn_every == 0:
                mix = blk.mixer(x[0])[None]
                want, m, _ = attention_layer(blk.mixer, f64(x[0]), cfg)
                if m.min() > margin:
                    judge(mix[0], want, MODEL, "SparseAttentionLayer.forward / project (sparse_attention)")
            else:
                mix = blk.mixer(x)
                want, want_state = kda_layer(blk.mixer, f64(x))[:2]
                judge(mix, want, KDA_LAYER, "KDALayer.forward")
                # what the engine hands from step to step: the final state of a prefill, and a decode
                # step from the state of all tokens but the last (outputs alone would not show either)
                if carried:
                    judge(blk.mixer.prefill(x)[1].kda, want_state, KDA_LAYER, STATE_SYMBOL)
                if carried and x.shape[1] > 1:
                    step = blk.mixer.decode(x[:, -1:], blk.mixer.prefill(x[:, :-1])[1])[0]
                    judge(step, want[:, -1:], KDA_LAYER, DECODE_SYMBOL)
            y = blk.norm2(h + mix)
            judge(y, rmsnorm(f64(h + mix), f64(blk.norm2.weight)), LAYERS, "RMSNorm.forward")
            ffn = blk.ffn(y)
            if i == 0:
                judge(ffn[0], swiglu(f64(y[0]), blk.ffn), LAYERS, "SwiGLU.forward")
            else:
                want, m = moe(f64(y[0]), blk.ffn)
                if m.min() > margin:  # a native MoE runs its experts in the C extension
                    native = blk.ffn.backend == "native"
                    judge(ffn[0], want, NATIVE_C if native else LAYERS,
                          "MoE.forward (backend='native')" if native else "MoE.forward")
            nxt = blk(h)
            judge(nxt, h + mix + ffn, MODEL, f"Block.forward (layer {i})")
            h = nxt
        normed = model.norm(h[0])
        judge(normed, rmsnorm(f64(h[0]), f64(model.norm.weight)), LAYERS, "RMSNorm.forward")
        judge(model(t)[0], normed.double().cpu() @ f64(model.lm_head).T, MODEL, "HybridModel.forward (LM head)")
    return [(file, symbol, err) for (file, symbol), err in bad.items()]


def randomize_norms(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every norm weight and router bias of a model random values (their defaults, ones and
    zeros, would hide a weight or bias left out)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight", "norm_w")):
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            elif name.endswith("router_bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


class Draw:
    """Fresh random inputs made on ``device`` (a generator there, new seed every run) and a CPU
    generator ``cpu`` for module weights, which are built on the CPU and moved."""

    def __init__(self, device: str):
        from feedback.correctness import fresh_generator

        self.device = device
        self.gen = fresh_generator(device=device)
        self.cpu = self.gen if device == "cpu" else fresh_generator()

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen, device=self.device)

    def randint(self, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen, device=self.device)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen, device=self.device)


class Checker:
    """A probe's comparisons with the references: every failure (a large error, or an exception in
    the code under test) names the file and symbol; the worst error becomes ``max_rel_err``, or the
    metric a comparison names (those held to another tolerance: bf16 paths, quantised storage)."""

    def __init__(self, ctx, tolerance: float):
        self.ctx, self.tolerance, self.worst = ctx, float(tolerance), 0.0
        self.others: dict[str, float] = {}

    def compare(self, out, ref, what: str, *, tolerance: float | None = None, against: str = "the float64 definition",
                metric: str | None = None, **where: str) -> float:
        from feedback.correctness import rel_err

        tol = self.tolerance if tolerance is None else tolerance
        try:
            err = rel_err(out, ref)
        except ValueError as exc:  # a shape the definition does not give: the code under test's, bound to it
            self.track(math.inf, metric)
            self.ctx.fail(f"{what}: {exc} ({against})", **where)
            return math.inf
        self.track(err, metric)
        self.ctx.check(err <= tol, f"{what}: rel. error {err:.2e} > {tol:g} against {against}", **where)
        return err

    def track(self, err: float, metric: str | None = None) -> None:
        if metric is None:
            self.worst = max(self.worst, err)
        else:
            self.others[metric] = max(err, self.others.get(metric, 0.0))

    @contextlib.contextmanager
    def guard(self, **where: str):
        """Run a check; an exception fails the probe, located at the innermost frame of the code
        under test that raised it (else at ``where``)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - a crash of the code under test is a located failure
            self.worst = math.inf
            oom = out_of_memory(exc, self.ctx.tree)
            if oom is not None:  # where an allocation failed says nothing of who holds the memory
                self.ctx.fail(oom, **where)
                return
            frame = culprit(exc, self.ctx.tree)
            if frame is not None:
                where = dict(where, file=frame[0], symbol=frame[1])
            self.ctx.fail(raised_message(exc), **where)

    def report(self) -> None:
        self.ctx.metric("max_rel_err", finite(self.worst), better="lower")
        for name, err in self.others.items():
            self.ctx.metric(name, finite(err), better="lower")


def _raised(ctx, exc: Exception, where: dict) -> None:
    """A failure of the code under test that raised ``exc``, located: where its allocation failed says
    nothing of who holds the memory (at ``where``); else at its innermost frame in the tree where that is
    another file than the one checked."""
    oom = out_of_memory(exc, ctx.tree)
    if oom is not None:
        ctx.fail(oom, **where)
        return
    frame = culprit(exc, ctx.tree)
    if frame is None or frame[0] == where.get("file"):
        ctx.fail(raised_message(exc), **where)
    else:  # raised in another file of the code under test than the one checked: that file and its frame
        ctx.fail(raised_message(exc), **dict({k: v for k, v in where.items() if k != "kernel"},
                                             file=frame[0], symbol=frame[1]))


def isolated(ctx, fn, checker: Checker | None = None, **where: str):
    """``fn()`` (checks that report on ``ctx``) in a forked child when the probe runs on the CPU, so
    that a crash of the code under test (a segfault in native code, a heap an out-of-bounds kernel
    corrupted in the interpreter) is a failure located at its innermost frame, or at ``where``,
    instead of the probe's death.  The child's findings, metrics and ``checker`` errors come back.
    On a GPU (no fork after CUDA) or without fork, ``fn`` runs here; a fault of the device there (a
    kernel's illegal memory access, a device-side assert: sticky, every later call fails) is one
    failure at ``where``, and every later ``isolated`` call of the probe is skipped (``device_lost``).
    Returns (completed, fn's value); an exception from ``fn`` is a failure at ``where`` too."""
    return isolated_all(ctx, [(fn, where)], checker)[0]


def isolated_all(ctx, calls: list, checker: Checker | None = None) -> list[tuple[bool, object]]:
    """:func:`isolated` for each ``(fn, where)`` of ``calls``, whose ``fn`` must not depend on one another:
    (completed, value) of each, in order, and their findings, metrics and ``checker`` errors reported in that
    order.  On the CPU one runs at a time, and more at once while the harness has slots idle that it lends
    (``feedback.jobserver``: a probe beside this one has ended and no probe waits), each in a child of its own."""
    import os

    if device_lost(ctx):
        return [(False, None)] * len(calls)
    if ctx.device != "cpu" or not hasattr(os, "fork"):
        return [_in_process(ctx, fn, checker, where) for fn, where in calls]
    return [_collect(ctx, child, checker, where) for child, (_, where) in zip(_forked(ctx, calls, checker), calls)]


def _in_process(ctx, fn, checker: Checker | None, where: dict) -> tuple[bool, object]:
    if device_lost(ctx):
        return False, None
    try:
        value = fn()
        _synchronize(ctx.device)  # a kernel's fault surfaces at a later call: here, within fn's own checks
        return True, value
    except Exception as exc:  # noqa: BLE001 - a failure of the code under test, located
        fault = _device_fault(ctx.device)
        if fault is None:
            _raised(ctx, exc, where)
            return False, None
        ctx.device_lost = fault
        ctx.fail(f"{DEVICE_FAULT} while this ran ({fault}); a kernel read or wrote out of bounds, or a device-side "
                 "assert fired: CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer names the kernel. The probe's later "
                 "checks on the device are skipped", **where)
        if checker is not None:
            checker.worst = math.inf
        return False, None


def _forked(ctx, calls: list, checker: Checker | None) -> list[tuple[bytes, int, bytes]]:
    """Each call in a forked child, one at a time and one more for each slot the harness lends; (what the
    child sent back, its wait status, faulthandler's dump of its stack) of each, in order."""
    import faulthandler
    import os
    import pickle
    import selectors
    import signal
    import tempfile

    from feedback import jobserver

    before = len(ctx.findings)
    pending, running, lent = list(range(len(calls))), {}, []
    out: list = [None] * len(calls)
    sel = selectors.DefaultSelector()

    def start(i: int) -> None:
        # the child's Python stack at a crash, from faulthandler (closed once the child has ended)
        trace = tempfile.TemporaryFile()  # noqa: SIM115
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: run, send back what it found, leave without any cleanup
            os.close(read)
            for slot in lent:  # its parent's to give back: a child's copy would keep the slot held
                os.close(slot.fd)
            faulthandler.enable(file=trace, all_threads=False)
            code, done, value = 0, True, None
            try:
                value = calls[i][0]()
            except Exception as exc:  # noqa: BLE001 - reported like any failure of the code under test
                _raised(ctx, exc, calls[i][1])
                done = False
            try:
                state = (checker.worst, checker.others) if checker is not None else None
                with os.fdopen(write, "wb") as send:
                    pickle.dump((done, value, ctx.findings[before:], ctx.failed, ctx.metrics, state), send)
            except BaseException:  # noqa: BLE001 - nothing to send: the parent reports a crash
                code = 1
            os._exit(code)
        os.close(write)
        running[read] = (i, pid, trace, [])
        sel.register(read, selectors.EVENT_READ)

    try:
        while pending or running:
            while pending:  # one case runs on the probe's own slot, one more on each lent slot
                if len(running) >= 1 + len(lent):
                    if (slot := jobserver.lend()) is None:
                        break
                    lent.append(slot)
                start(pending.pop(0))
            while lent and len(running) + len(pending) < 1 + len(lent):
                lent.pop().release()  # no case left for it: the harness has it back at once
            for key, _ in sel.select(timeout=jobserver.POLL_S if pending else None):
                i, pid, trace, chunks = running[key.fd]
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    chunks.append(chunk)
                    continue
                sel.unregister(key.fd)
                os.close(key.fd)
                del running[key.fd]
                _, status = os.waitpid(pid, 0)
                trace.seek(0)
                out[i] = (b"".join(chunks), status, trace.read())
                trace.close()
    finally:  # the probe stopped (Ctrl-C, its budget): no child outlives it, no slot stays borrowed
        for fd, (_, pid, trace, _) in running.items():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(fd)
            trace.close()
        for slot in lent:
            slot.release()
        sel.close()
    return out


def _collect(ctx, child: tuple[bytes, int, bytes], checker: Checker | None, where: dict) -> tuple[bool, object]:
    """A forked child's answer reported on ``ctx``: its findings, failure, metrics and checker state; or, where
    it died before answering, a crash located at the innermost frame of its stack dump in the tree."""
    import os
    import pickle
    import signal

    data, status, dump = child
    try:
        done, value, findings, failed, metrics, state = pickle.loads(data)
    except Exception:  # noqa: BLE001 - the child died before it could answer
        how = (signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        frame = _crash_frame(dump.decode(errors="replace"), ctx.tree)
        if frame is not None:
            where = dict(where, file=frame[0], symbol=frame[1])
        ctx.fail(f"the code under test crashed the process ({how})", **where)
        if checker is not None:
            checker.worst = math.inf
        return False, None
    ctx.findings.extend(findings)
    ctx.failed |= failed
    ctx.metrics.update(metrics)
    if checker is not None and state is not None:
        checker.track(state[0])
        for name, err in state[1].items():
            checker.track(err, name)
    return done, value


DEVICE_FAULT = "the device faulted"
OUT_OF_MEMORY = "the device ran out of memory"


def out_of_memory(exc: BaseException, tree=None) -> str | None:
    """A finding's message when ``exc`` (or an error it was raised from) is a device's out-of-memory error:
    torch's own, or a native library's (a Triton module load, a cuBLAS workspace) that says so; else None.
    Such a failure is located at the check, not at the frame whose allocation happened to fail, which the
    message names instead (with ``tree``): the memory may be held by the change under test (an allocation
    sized wrong: that frame) or by another process on the device (the free memory, measured here)."""
    frame = culprit(exc, tree) if tree is not None else None
    for link in raised_chain(exc):
        if isinstance(link, torch.OutOfMemoryError) or "out of memory" in str(link).lower():
            note = ""
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                try:
                    free, total = torch.cuda.mem_get_info()
                    held = torch.cuda.memory_reserved()
                    note = (f"; now {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the device, "
                            f"{held / 2**30:.1f} GiB held by this process")
                except Exception:  # noqa: BLE001 - the note is a courtesy; the finding stands without it
                    pass
            first = f"{type(link).__name__}: {link}".splitlines()[0][:200]
            at = f", in {frame[0]} {frame[1]}" if frame else ""
            return (f"{OUT_OF_MEMORY} while this ran ({first}{at}){note}. Other processes on the device (a "
                    "parallel test run, another job) or this change's own footprint; run it alone to tell which")
    return None


def raised_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the errors it was raised from or while handling, outermost first (a chain cut with
    ``from None`` ends there; a cycle is followed once)."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in chain):
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return chain


def culprit(exc: BaseException, tree) -> tuple[str, str] | None:
    """(file, "function (line N)") of the innermost frame of the code under test (the tree's target_stack,
    probes excluded) that raised ``exc``.  An exception raised while handling another (a Triton interpreter
    error around the one its kernel raised, a wrapper's ValueError around a KeyError) is traced to the
    first of the chain whose traceback reaches that code: where the trouble began."""
    import pathlib
    import traceback

    root = pathlib.Path(tree).resolve()
    for link in reversed(raised_chain(exc)):  # the first raised, first
        found = None
        for frame, lineno in traceback.walk_tb(link.__traceback__):
            try:
                rel = pathlib.Path(frame.f_code.co_filename).resolve().relative_to(root)
            except ValueError:
                continue
            if rel.parts[:1] == ("target_stack",) and rel.parts[1:2] != ("probes",):
                found = (str(rel), f"{frame.f_code.co_name} (line {lineno})")
        if found is not None:
            return found
    return None


def raised_message(exc: BaseException) -> str:
    """A finding's message for an exception of the code under test: its type and its first line."""
    return f"raised {type(exc).__name__}: {exc}".splitlines()[0][:300]


def device_lost(ctx) -> str | None:
    """The fault that left the probe's device unusable (recorded by ``isolated``), or None."""
    return getattr(ctx, "device_lost", None)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _device_fault(device: str) -> str | None:
    """On a CUDA device: None while it still completes work, else the error a synchronisation raises."""
    try:
        _synchronize(device)
    except Exception as exc:  # noqa: BLE001 - the device's own report of what went wrong
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return None


def _crash_frame(dump: str, tree: str) -> tuple[str, str] | None:
    """(file, symbol) of the innermost frame of the code under test in a faulthandler dump (most
    recent call first).  A crash inside a ctypes wrapper is the native code's: when the frame's
    folder holds one C source, that source is named."""
    import pathlib
    import re

    root = pathlib.Path(tree).resolve()
    for path, line, func in re.findall(r'File "([^"]+)", line (\d+) in (\S+)', dump):
        try:
            rel = pathlib.Path(path).resolve().relative_to(root)
        except ValueError:
            continue
        if rel.parts[:1] != ("target_stack",) or rel.parts[1:2] == ("probes",):
            continue
        sources = sorted((root / rel).parent.glob("*.c"))
        if len(sources) == 1:
            return str(sources[0].relative_to(root)), f"native code called from {rel.name}:{func} (line {line})"
        return str(rel), f"{func} (line {line})"
    return None


def finite(value: float) -> float:
    """A metric value the result file can carry: the harness writes inf as JSON null, which it then
    cannot read back (the probe would end as an unreadable result, its findings lost)."""
    return value if math.isfinite(value) else 1e300
