"""target_stack's KDA probes (declared in infra-agent.yaml; protected from patches).

Each is local (bound to the files, kernels and parameters in the manifest), cheap (seconds in
the interpreter) and objective (a float64 reference, a threshold).
"""

from __future__ import annotations

import contextlib
import functools

import torch

import target_stack.ops  # noqa: F401  (runtime choice before triton loads)
from feedback.correctness import compare_sweep, error_growth, fresh_generator, partitioned_vs_whole, rel_err
from feedback.probe import ProbeContext, probe
from target_stack.ops.kda import chunk_kda, chunk_kda_cp, fused_recurrent_kda, naive_recurrent_kda
from target_stack.ops.kda.testing import make_inputs
from target_stack.ops.utils import alloc, poisoning, resolve_dot_precision, set_poison
from target_stack.probes.reference import extreme_gate_inputs, finite, isolated_all, kda_gate64, magnitudes

set_poison(True)  # every buffer a wrapper allocates for a kernel starts as NaN
# small tensors: an OpenMP team costs more than it saves, worst on shared cores (the float64 token loop of a
# 2-head, 24-wide case took 2 s with the default threads on a busy 2-core machine, 0.02 s with one)
torch.set_num_threads(1)

CHUNK = "target_stack/ops/kda/chunk.py"
RECURRENT = "target_stack/ops/kda/fused_recurrent.py"
CP = "target_stack/ops/kda/cp.py"
UTILS = "target_stack/ops/utils.py"


def _ref(q, k, v, g, beta, h0=None):
    return naive_recurrent_kda(*(t.double() for t in (q, k, v, g, beta)),
                               initial_state=None if h0 is None else h0.double(), output_final_state=True)


def _case_inputs(case: dict, gen: torch.Generator):
    """Inputs of one sweep case: make_inputs' shapes, or the input conditions a case names.

    ``seqlens``: one packed varlen batch (``cu_seqlens``) of these lengths; ``g``: "zero" (no decay),
    "saturated" (the state forgets everything each token) or "extreme" (per channel and token, log decays
    of every size from 1e-7 to ``g_max``, default 20: no decay beside a complete reset); ``beta``: "low"
    (~0) or "high" (~1); ``l2norm``: raw q, k that the kernel normalises; ``beta_sigmoid``: beta logits the
    kernel squashes; ``h0``: an initial state per sequence; ``magnitude``: q, v and the initial state (and
    with ``l2norm`` the raw k) scaled by it (near-zero or large activations; the output scales with them);
    ``gate_in_kernel``: g is the raw gate input, and ``A_log`` and ``dt_bias`` follow h0 in the inputs (the
    kernel computes the decay, the reference the float64 formula); ``raw_gate``: "extreme" (raw gate inputs
    of both signs and every size, and softplus's edges up to 1e30: ``raw_gate``);
    ``dtype``: q, k, v, g and beta in that dtype (``bfloat16``, ``float16``; the initial state stays fp32),
    the path a server's 16-bit activations take, held to the float64 model of the same rounded inputs.
    """
    dev = gen.device
    lengths = case.get("seqlens")
    B, T = (1, sum(lengths)) if lengths else (case["B"], case["T"])
    H, K, V = case["H"], case["K"], case["V"]
    q, k, v, g, beta = make_inputs(B, T, H, K, V, generator=gen, device=dev, decay_shift=case.get("decay_shift", 0.0))
    rand = lambda *shape: torch.rand(*shape, generator=gen, device=dev)  # noqa: E731
    if case.get("g") == "zero":
        g = -1e-6 * rand(B, T, H, K)
    elif case.get("g") == "saturated":
        g = -20.0 - 20.0 * rand(B, T, H, K)
    elif case.get("g") == "extreme":
        g = -magnitudes((B, T, H, K), gen, 1e-7, float(case.get("g_max", 20.0)))
    elif case.get("g") is not None:
        raise ValueError(f"g must be 'zero', 'saturated' or 'extreme', got {case['g']!r}")
    if case.get("beta") == "low":
        beta = 1e-4 * rand(B, T, H) + 1e-6
    elif case.get("beta") == "high":
        beta = 1.0 - 1e-4 * rand(B, T, H)
    if case.get("l2norm"):
        q, k = (3 * torch.randn(B, T, H, K, generator=gen, device=dev) for _ in range(2))
    if case.get("beta_sigmoid"):
        beta = 3 * torch.randn(B, T, H, generator=gen, device=dev)
    m = float(case.get("magnitude", 1.0))
    q, v = q * m, v * m
    if case.get("l2norm"):
        k = k * m
    if case.get("dtype"):
        low = getattr(torch, case["dtype"])
        q, k, v, g, beta = (x.to(low) for x in (q, k, v, g, beta))
    n = len(lengths) if lengths else B
    h0 = m * torch.randn(n, H, K, V, generator=gen, device=dev) if case.get("h0") else None
    if case.get("gate_in_kernel"):
        raw, a_log, dt_bias = raw_gate(B, T, H, K, gen, extreme=case.get("raw_gate") == "extreme")
        return q, k, v, raw, beta, h0, a_log, dt_bias
    return q, k, v, g, beta, h0


def raw_gate(B: int, T: int, H: int, K: int, gen: torch.Generator, extreme: bool = False):
    """(raw gate input ``[B, T, H, K]``, A_log ``[H]``, dt_bias ``[H * K]``) on the generator's device, drawn
    so that the decay spans slow to fast and some inputs take softplus's linear branch (above 20).  With
    ``extreme``: raw inputs of both signs log-uniform over 1e-7 .. 1e4 in magnitude, and among them
    softplus's inputs (raw + dt_bias) at every ``reference.GATE_EDGES`` value with both signs (decays from exactly
    1 to exactly 0)."""
    dev = gen.device
    shape = (B, T, H, K)
    a_log = 0.3 * torch.randn(H, generator=gen, device=dev) - 1.0
    dt_bias = torch.randn(H * K, generator=gen, device=dev) - 1.0
    if extreme:
        return extreme_gate_inputs(shape, dt_bias, gen), a_log, dt_bias
    raw = 3 * torch.randn(*shape, generator=gen, device=dev)
    raw.view(-1)[:: 97] += 25.0
    return raw, a_log, dt_bias


def _case_kernel(fn, case: dict):
    """The kernel call of a case: its flags and, for a varlen case, its ``cu_seqlens``."""
    kw = {}
    if case.get("seqlens"):
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(case["seqlens"]).cumsum(0).tolist()], dtype=torch.int32)
    if case.get("l2norm"):
        kw["use_qk_l2norm_in_kernel"] = True
    if case.get("beta_sigmoid"):
        kw["use_beta_sigmoid_in_kernel"] = True

    def call(q, k, v, g, beta, h0, *gate):
        extra = {n: t.to(q.device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        if gate:
            extra.update(A_log=gate[0], dt_bias=gate[1], use_gate_in_kernel=True)
        with _diag_form(case.get("diag")):
            return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **extra)

    return call


@contextlib.contextmanager
def _diag_form(form: str | None):
    """A case's ``diag: token | block``: the prefill's diagonal blocks in that form whatever the device (by
    default a GPU runs the token form and the interpreter the block form, so each would be judged on one
    kind of machine only)."""
    if form is None:
        yield
        return
    if form not in ("token", "block"):
        raise ValueError(f"diag must be 'token' or 'block', got {form!r}")
    from target_stack.ops.kda import chunk

    before, chunk.DIAG_BY_TOKEN = chunk.DIAG_BY_TOKEN, form == "token"
    try:
        yield
    finally:
        chunk.DIAG_BY_TOKEN = before


def _case_ref(case: dict):
    """The float64 reference of a case: normalisation and sigmoid as the flags say, sequence by sequence."""

    def run(q, k, v, g, beta, h0, *gate):
        q, k, g, beta = _in_kernel64(q, k, g, beta, *(gate or (None, None)), l2norm=case.get("l2norm"),
                                     beta_sigmoid=case.get("beta_sigmoid"), gate=bool(gate))
        if not case.get("seqlens"):
            return _ref(q, k, v, g, beta, h0)
        outs, states, start = [], [], 0
        for i, n in enumerate(case["seqlens"]):
            part = (x[:, start:start + n] for x in (q, k, v, g, beta))
            o, s = _ref(*part, None if h0 is None else h0[i:i + 1])
            outs.append(o)
            states.append(s)
            start += n
        return torch.cat(outs, 1), torch.cat(states)

    return run


def _in_kernel64(q, k, g, beta, a_log, dt_bias, *, l2norm, beta_sigmoid, gate):
    """q, k, g, beta in float64 with what a kernel call does itself done here: the q/k L2 norms, the beta
    sigmoid, the gate activation (``gate64``), as its flags say."""
    q, k, g, beta = q.double(), k.double(), g.double(), beta.double()
    if l2norm:
        q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    if gate:
        g = gate64(g, a_log, dt_bias)
    return q, k, g, beta


def gate64(raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """KDA's log decay -exp(A_log[h]) * softplus(raw + dt_bias[h, :]) in float64, written out here (not
    ``kda_gate``, the serving code's own): exact softplus for every finite input (linear above 30, where
    log1p(exp(x)) - x < 1e-13)."""
    H, K = raw.shape[-2:]
    return kda_gate64(raw.double() + (0.0 if dt_bias is None else dt_bias.double().reshape(H, K)), a_log)


def _poison_contract(ctx: ProbeContext) -> None:
    """What the sweeps and the timed probes rely on: while poisoning is on every buffer ``alloc`` gives starts
    as NaN, and ``poisoning(x)`` sets x inside its block and then puts back the setting it found, whichever
    it was (a timed block must not leave the sweeps that follow unpoisoned, nor poison the timings after)."""
    def setting() -> bool:
        now = set_poison(True)
        set_poison(now)
        return now

    wrong = []
    try:
        for outer in (False, True):
            for inner in (False, True):
                set_poison(outer)
                with poisoning(inner):
                    if setting() != inner:
                        wrong.append(f"inside poisoning({inner}) after {outer}: {setting()}")
                    if inner and not bool(torch.isnan(alloc(64, dtype=torch.float32, device=ctx.device)).all()):
                        wrong.append(f"inside poisoning({inner}): a buffer that is not NaN")
                if setting() != outer:
                    wrong.append(f"poisoning({inner}) after {outer} left {setting()}")
    finally:
        set_poison(True)
    ctx.check(not wrong, f"output poisoning does not keep its contract: {'; '.join(wrong)}",
              file=UTILS, condition="poisoning() and alloc()")


#: keys of a sweep case that say how to judge it, not what it computes
_JUDGING = ("tolerance", "metric", "devices")


def _sweep(ctx: ProbeContext, fn, file: str, kernel: str) -> None:
    """Every case against the float64 reference; a case that raises or crashes (an out-of-bounds
    access in the interpreter) fails at its own condition.  A case may carry its own ``tolerance`` and
    ``metric`` (16-bit inputs: the output's own rounding is ~4e-3), and ``devices`` it runs on."""
    _poison_contract(ctx)
    tol = float(ctx.params.get("tolerance", 1e-5))
    worst: dict[str, float] = {"max_rel_err": 0.0}
    runs = []  # (case, where, the call)
    for i, case in enumerate(ctx.params["cases"]):
        if case.get("devices") and ctx.device not in case["devices"]:
            continue
        shape = ", ".join(f"{k}={v}" for k, v in case.items() if k not in _JUDGING)
        # the first case also runs again on its tensors refilled in place: a cached result fails there
        runs.append((case, dict(file=file, kernel=kernel, condition=shape),
                     lambda case=case, i=i: compare_sweep(_case_kernel(fn, case), _case_ref(case), _case_inputs,
                                                          [case], device=ctx.device, recheck=i == 0)))
    # the cases are independent: more than one at once where the harness lends idle cores
    for (case, where, _), (done, result) in zip(runs, isolated_all(ctx, [(call, where) for _, where, call in runs])):
        bound, metric = float(case.get("tolerance", tol)), case.get("metric", "max_rel_err")
        worst.setdefault(metric, 0.0)
        if not done:
            worst[metric] = float("inf")
            continue
        (_, err), = result
        worst[metric] = max(worst[metric], err)
        ctx.check(err < bound, f"rel. error {err:.2e} > {bound:g} against the float64 reference", **where)
    for metric, value in worst.items():
        ctx.metric(metric, finite(value), better="lower")


@probe(kind="correctness")
def chunk_correctness(ctx: ProbeContext) -> None:
    _sweep(ctx, chunk_kda, CHUNK,
           "_kda_diag_token_kernel/_kda_diag_block_kernel/_kda_solve_kernel/_kda_state_kernel/_kda_output_kernel")


@probe(kind="correctness")
def recurrent_correctness(ctx: ProbeContext) -> None:
    _sweep(ctx, fused_recurrent_kda, RECURRENT, "_kda_fused_recurrent_kernel")


@probe(kind="correctness")
def cp_correctness(ctx: ProbeContext) -> None:
    """Partitioned prefill equals the unpartitioned one, and both equal float64, for each case of
    ``cases`` (the top-level parameters when there are none): shape, initial state, partition counts."""
    c = ctx.params
    gen = fresh_generator(device=ctx.device)
    tol = float(c.get("tolerance", 1e-5))
    runs = []  # (shape, the call)
    for case in c.get("cases", [c]):
        B, H, K, V = case["B"], case["H"], case["K"], case["V"]
        x = make_inputs(B, case["T"], H, K, V, decay_shift=case.get("decay_shift", 0.0), generator=gen,
                        device=ctx.device)
        h0 = torch.randn(B, H, K, V, generator=gen, device=ctx.device) if case.get("h0") else None
        shape = f"B={B}, T={case['T']}, H={H}, K={K}, V={V}, h0={h0 is not None}"

        def errors(x=x, h0=h0, partitions=case["partitions"]):
            ref = _ref(*x, h0)
            outs = {P: chunk_kda_cp(*x, P, initial_state=h0, output_final_state=True) for P in partitions}
            whole = functools.partial(chunk_kda, *x, initial_state=h0, output_final_state=True)
            return [(P, max(err, rel_err(outs[P], ref))) for P, err in partitioned_vs_whole(outs.__getitem__,
                                                                                             whole, partitions)]

        runs.append((shape, errors))
    worst = 0.0
    # the cases are independent: more than one at once where the harness lends idle cores
    results = isolated_all(ctx, [(errors, dict(file=CP, kernel="chunk_kda_cp", condition=shape))
                                 for shape, errors in runs])
    for (shape, _), (done, errs) in zip(runs, results):
        if not done:
            worst = float("inf")
            continue
        for P, err in errs:
            worst = max(worst, err)
            ctx.check(err < tol, f"P={P}: rel. error {err:.2e} > {tol:g} against the unpartitioned prefill "
                      "or float64", file=CP, kernel="chunk_kda_cp", condition=f"num_partitions={P}, {shape}")
    ctx.metric("max_rel_err", finite(worst), better="lower")


@probe(kind="correctness")
def cp_merge_error_growth(ctx: ProbeContext) -> None:
    """Output error of CP prefill at the default merge precision, along the number of partitions."""
    c = ctx.params
    x = make_inputs(c["B"], c["T"], c["H"], c["K"], c["V"], decay_shift=c["decay_shift"],
                    generator=fresh_generator(device=ctx.device), device=ctx.device)
    ref_o = _ref(*x)[0]
    precision = c.get("merge_precision")
    resolved = resolve_dot_precision(precision, x[0].device)
    sizes = c["partitions"]
    errs, growth = error_growth(lambda p: rel_err(chunk_kda_cp(*x, p, merge_precision=precision)[0], ref_o), sizes)
    for p, e in zip(sizes, errs):
        ctx.metric(f"err_p{p}", finite(e), better="lower")
    ctx.metric("error_growth", finite(growth), unit="x", better="lower")
    where = dict(file=CP, kernel="_kda_cp_merge_kernel", param=f"merge_precision={resolved!r}",
                 condition=f"T={c['T']}, decay_shift={c['decay_shift']}")
    max_growth, tol = float(c.get("max_growth", 3.0)), float(c.get("tolerance", 1e-5))
    ctx.check(growth <= max_growth, f"error grows {growth:.0f}x from P={sizes[0]} to P={sizes[-1]}", **where)
    ctx.check(max(errs) < tol, f"rel. error {max(errs):.1e} at P={sizes[errs.index(max(errs))]} > {tol:g}", **where)


def _step_flags(c: dict) -> dict:
    """The decode call's flags, as the probe's params say what the kernel does itself: ``l2norm`` (raw q, k),
    ``beta_sigmoid`` (beta logits), ``gate_in_kernel`` (a raw gate input with A_log and dt_bias)."""
    return dict(use_qk_l2norm_in_kernel=bool(c.get("l2norm")), use_beta_sigmoid_in_kernel=bool(c.get("beta_sigmoid")),
                use_gate_in_kernel=bool(c.get("gate_in_kernel")))


def _step_inputs(c: dict, N: int, H: int, K: int, V: int, gen: torch.Generator, dtype=torch.float32, T: int = 1):
    """One decode step's inputs ``(q, k, v, g, beta, A_log, dt_bias)`` (``T`` tokens per sequence: a multi-token
    call, as a speculative verify makes) and the call's flags (``_step_flags``); A_log and dt_bias are None
    without the in-kernel gate."""
    dev = gen.device
    q, k, v, g, beta = make_inputs(N, T, H, K, V, generator=gen, device=dev)
    flags = _step_flags(c)
    if flags["use_qk_l2norm_in_kernel"]:
        q, k = (3 * torch.randn(N, T, H, K, generator=gen, device=dev) for _ in range(2))
    if flags["use_beta_sigmoid_in_kernel"]:
        beta = 3 * torch.randn(N, T, H, generator=gen, device=dev)
    a_log = dt_bias = None
    if flags["use_gate_in_kernel"]:
        g, a_log, dt_bias = raw_gate(N, T, H, K, gen)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return (q, k, v, g, beta, a_log, dt_bias), flags


def _step_call(x: tuple, flags: dict, pool: torch.Tensor, slots: torch.Tensor):
    q, k, v, g, beta, a_log, dt_bias = x
    return fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=slots, A_log=a_log,
                               dt_bias=dt_bias, **flags)


def _step_ref(x: tuple, flags: dict, h0: torch.Tensor):
    """The float64 reference of one decode step from its kernel inputs (what the kernel does itself done here)."""
    q, k, v, g, beta, a_log, dt_bias = x
    q, k, g, beta = _in_kernel64(q, k, g, beta, a_log, dt_bias, l2norm=flags["use_qk_l2norm_in_kernel"],
                                 beta_sigmoid=flags["use_beta_sigmoid_in_kernel"], gate=flags["use_gate_in_kernel"])
    return _ref(q, k, v, g, beta, h0)


def _step_condition(flags: dict) -> str:
    done = [name for name, key in (("q/k normalisation", "use_qk_l2norm_in_kernel"), ("gate", "use_gate_in_kernel"),
                                   ("beta sigmoid", "use_beta_sigmoid_in_kernel")) if flags[key]]
    return f"in the kernel: {', '.join(done)}" if done else "inputs prepared outside the kernel"


def _counted_call(ctx: ProbeContext, c: dict, N: int, H: int, K: int, V: int, gen: torch.Generator, T: int):
    """One pooled call of ``T`` tokens per sequence (slot 0, the null slot, poisoned and never read) counted
    under Triton's interpreter: (the WorkCount, the worst error of its outputs and states against float64, the
    call's flags)."""
    from feedback.workcount import WorkCount

    x, flags = _step_inputs(dict(c, l2norm=c.get("l2norm", True)), N, H, K, V, gen, T=T)
    q, k, v, g, beta = x[:5]
    pool = torch.randn(N + 1, H, K, V, generator=gen, device=ctx.device)
    pool[0] = float("nan")  # the null slot: never read
    slots = torch.arange(1, N + 1, dtype=torch.int32, device=ctx.device)
    before = pool[1:].clone()
    with WorkCount(q=q, k=k, v=v, g=g, beta=beta, state=pool[1:]) as wc:
        o, _ = _step_call(x, flags, pool, slots)
    ro, rs = _step_ref(x, flags, before)
    return wc, max(rel_err(o, ro), rel_err(pool[1:], rs)), flags


@probe(kind="trace")
def decode_work(ctx: ProbeContext) -> None:
    """What one pooled decode step does, counted under Triton's interpreter (feedback/workcount.py):
    how many times each input is fetched, the divisions and special functions executed per output,
    the programs the grid runs per (sequence, head).  Device-independent: the manifest runs it in
    the interpreter on every machine.  The counted call's outputs and states are checked against
    float64 too, so a kernel that skips work cannot show less of it."""
    from feedback.workcount import report

    c = ctx.params
    N, H, K, V = c["batch"], c["H"], c["K"], c["V"]
    gen = fresh_generator(device=ctx.device)
    wc, err, flags = _counted_call(ctx, c, N, H, K, V, gen, T=1)
    ctx.metric("max_rel_err", finite(err), better="lower")
    cond = f"one pooled decode step, N={N}, H={H}, K={K}, V={V}, {_step_condition(flags)}"
    kernel = dict(file=RECURRENT, kernel="_kda_fused_recurrent_kernel", condition=cond)
    ctx.check(err < float(c.get("tolerance", 1e-5)), f"the counted step's outputs are wrong (rel. error {err:.1e})",
              **kernel)
    inputs = ("q", "k", "v", "g", "beta")
    reads = {name: wc.reads(name) for name in inputs}
    worst = max(reads, key=reads.get)
    outputs = N * H * V
    divisions = wc.ops["fdiv"] / outputs
    special = sum(wc.ops[kind] for kind in ("sqrt", "rsqrt", "exp", "log", "trig", "erf")) / outputs
    programs = sum(launch.programs for launch in wc.launches)
    # counted: judged against the base exactly (programs per head is a launch choice, shown and not judged)
    ctx.metric("max_input_reads", reads[worst], unit="x", better="lower", counted=True)
    ctx.metric("state_reads", wc.reads("state"), unit="x", better="lower", counted=True)
    ctx.metric("state_writes", wc.writes("state"), unit="x", better="lower", counted=True)
    ctx.metric("divisions_per_output", divisions, better="lower", counted=True)
    ctx.metric("special_ops_per_output", special, better="lower", counted=True)
    ctx.metric("programs_per_head", programs / (N * H))
    # and every kernel's own counts (bytes, special functions, launches) per (sequence, head), bound to it
    report(ctx, wc, per=N * H, unit="head", kernel_location=lambda name: dict(file=RECURRENT, condition=cond))
    grids = ", ".join(f"{launch.kernel}{launch.grid}" for launch in wc.launches)
    if reads[worst] > 1:
        ctx.finding(f"{', '.join(n for n in inputs if reads[n] > 1)} fetched {reads[worst]:.0f}x per step: "
                    f"{programs // (N * H)} programs per (sequence, head) each reload them and repeat their "
                    "normalisation and gating", param=f"grid {grids}", **kernel)
    if divisions:
        ctx.finding(f"{divisions:.3g} divisions per output element ({wc.ops['fdiv']} in the step)",
                    param=f"grid {grids}", **kernel)
    if wc.reads("state") > 1 or wc.writes("state") > 1:
        ctx.finding(f"the state is read {wc.reads('state'):.2f}x and written {wc.writes('state'):.2f}x per step "
                    "(once each is the minimum)", param=f"grid {grids}", **kernel)
    if int(c.get("tokens", 0)) > 1:
        _token_loop_work(ctx, c, N, H, K, V, gen)


def _token_loop_work(ctx: ProbeContext, c: dict, N: int, H: int, K: int, V: int, gen: torch.Generator) -> None:
    """The same kernel over ``tokens`` tokens per sequence in one call (a speculative verify, a short tail):
    work per token, prefixed ``tokens.``.  What a kernel does once per call but is moved into its token loop
    (a per-head constant, a bias row, a special function) is invisible in a one-token step and shows here,
    growing with the tokens; the call's outputs and states are checked against float64 too."""
    from feedback.workcount import report

    T = int(c["tokens"])
    wc, err, flags = _counted_call(ctx, c, N, H, K, V, gen, T=T)
    cond = f"one pooled call of {T} tokens per sequence, N={N}, H={H}, K={K}, V={V}, {_step_condition(flags)}"
    ctx.metric("tokens.max_rel_err", finite(err), better="lower")
    ctx.check(err < float(c.get("tolerance", 1e-5)), f"a call of {T} tokens per sequence is wrong (rel. error "
              f"{err:.1e})", file=RECURRENT, kernel="_kda_fused_recurrent_kernel", condition=cond)
    report(ctx, wc, per=N * T * H, unit="token-head", prefix="tokens.",
           kernel_location=lambda name: dict(file=RECURRENT, condition=cond))


@probe(kind="trace")
def chunk_work(ctx: ProbeContext) -> None:
    """What one chunked prefill does, counted under Triton's interpreter, kernel by kernel: the bytes each
    loads and stores per token (its scratch buffers too), its divisions, special functions and dot
    multiply-accumulates per token, its launches.  Counted metrics: the verdict judges them against the base
    exactly (a change that makes a kernel fetch a tile again or repeat a product shows as that kernel's
    count, with no noise to hide in).  The counted call's output and final states are checked against
    float64, so a kernel that skips work cannot count less."""
    from feedback.workcount import WorkCount, report

    c = ctx.params
    case = dict(seqlens=list(c["seqlens"]), H=c["H"], K=c["K"], V=c["V"], h0=True, diag=c.get("diag"))
    gen = fresh_generator(device=ctx.device)
    x = _case_inputs(case, gen)
    q, k, v, g, beta, h0 = x
    with WorkCount(q=q, k=k, v=v, g=g, beta=beta, h0=h0) as wc:
        o, ht = _case_kernel(chunk_kda, case)(*x)
    ro, rs = _case_ref(case)(*x)
    err = max(rel_err(o, ro), rel_err(ht, rs))
    ctx.metric("max_rel_err", finite(err), better="lower")
    shape = ", ".join(f"{n}={case[n]}" for n in ("seqlens", "H", "K", "V"))
    ctx.check(err < float(c.get("tolerance", 1e-5)),
              f"the counted prefill's outputs are wrong (rel. error {err:.1e})", file=CHUNK, condition=shape)
    report(ctx, wc, per=sum(case["seqlens"]), unit="token",
           kernel_location=lambda kernel: dict(file=CHUNK, condition=f"one chunked prefill, {shape}"))


@probe(kind="correctness")
def null_slot(ctx: ProbeContext) -> None:
    """A pooled decode step leaves the null slot (0) bit-identical and reads it as zeros."""
    c = ctx.params
    dev = ctx.device
    gen = fresh_generator(device=dev)
    H, K, V = c["H"], c["K"], c["V"]
    pool = torch.randn(5, H, K, V, generator=gen, device=dev)
    pool[0] = 1e30
    before = pool.clone()
    slots = torch.tensor([3, 0, 1, 0], dtype=torch.int32, device=dev)
    x = make_inputs(4, 1, H, K, V, generator=gen, device=dev)
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
    if not torch.cuda.is_available():
        ctx.skip("timings need a GPU (the interpreter's times mean nothing)")
    c = ctx.params
    H, K, V, B = c["H"], c["K"], c["V"], c["batch"]
    slots = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
    gen = fresh_generator(device="cuda")
    flags = _step_flags(c)

    def make(i: int):  # fresh inputs and a fresh state pool for every timed step
        x, _ = _step_inputs(c, B, H, K, V, gen, dtype=torch.bfloat16)
        return (*x, torch.randn(B + 1, H, K, V, generator=gen, device="cuda") * 0.1)

    def step(*x):
        return _step_call(x[:-1], flags, x[-1], slots)

    def check(before, after, out) -> float:
        ro, rs = _step_ref(before[:-1], flags, before[-1][1:])
        # the state is fp32, the output bf16: the output's bound is 30x the state's
        return max(rel_err(after[-1][1:], rs), rel_err(out[0], ro) / 30)

    state_bytes = 2 * B * H * K * V * 4
    where = dict(file=RECURRENT, kernel="_kda_fused_recurrent_kernel",
                 condition=f"batch {B}, {_step_condition(flags)}")
    with poisoning(False):  # the timed step is the kernel, not a NaN fill of its output besides
        t = ctx.timed("step", make=make, call=step, check=check, tol=1e-3, bytes_moved=state_bytes, **where)
    state_bw = state_bytes / t.median_s
    ctx.metric("state_TBps", state_bw / 1e12, unit="TB/s", better="higher")
    ctx.metric("bandwidth_vs_copy", state_bw / t.copy_bytes_per_s, better="higher")
    ctx.metric("host_overhead_ratio", t.wall_median_s / t.median_s, better="lower")


@probe(kind="microbench")
def decode_bench(ctx: ProbeContext) -> None:
    _decode_bench(ctx)


@probe(kind="microbench")
def prefill_bench(ctx: ProbeContext) -> None:
    if not torch.cuda.is_available():
        ctx.skip("timings need a GPU (the interpreter's times mean nothing)")
    c = ctx.params
    shape = (1, c["T"], c["H"], c["K"], c["V"])
    with poisoning(False):  # the timed call is the kernels, not NaN fills of their buffers besides
        t = ctx.timed("prefill", make=lambda i: make_inputs(*shape, dtype=torch.bfloat16, device="cuda"),
                      call=lambda *x: chunk_kda(*x, output_final_state=True), reps=10,
                      file=CHUNK, condition=f"T={c['T']}")
    ctx.metric("tokens_per_s", c["T"] / t.median_s, unit="tok/s", better="higher")


@probe(kind="trace")
def chunk_trace(ctx: ProbeContext) -> None:
    """torch.profiler over one chunked prefill; the top ops by own time (kernels on a GPU)."""
    from feedback.trace import capture, trace_dir

    c = ctx.params
    x = make_inputs(1, c["T"], c["H"], c["K"], c["V"], device=ctx.device)
    summary = capture(lambda: chunk_kda(*x, output_final_state=True), "kda.chunk", out_dir=trace_dir())
    ctx.metric("total_cpu_us", summary.total_cpu_us, unit="us", better="lower")
    if summary.total_cuda_us:
        ctx.metric("total_cuda_us", summary.total_cuda_us, unit="us", better="lower")
    for i, op in enumerate(summary.top[:3]):
        ctx.finding(f"top {i + 1}: {op.name} ({op.device}) {op.self_us:.0f} us, {op.share:.0%} of {op.device} time",
                    file=CHUNK, symbol=op.name)
