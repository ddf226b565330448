"""Fused recurrent KDA in Triton: the decode kernel (and a token-loop prefill for short inputs).

One program per (V tile, sequence, head) keeps its [K, BV] slice of the state in registers and
walks the tokens: decay, delta-rule correction, rank-one update, readout.  Every V tile of a
head loads the same q, k, g and beta and repeats their normalisation and gating; on a
memory-bound step that is free, where the step is issue-bound it is not (DESIGN.md).  The
``kda.decode.work`` probe counts that repetition under the interpreter (``feedback/workcount.py``).

With ``ssm_state_indices`` the ``initial_state`` is a pool of state slots ``[num_slots, H, K, V]``
read and updated in place, one slot per sequence.  Slot 0 is the null slot: rows that point at
it (padding) read a zero state and are never written back.

With ``use_gate_in_kernel`` (fla's option of the same name) ``g`` is the raw gate input and the kernel
computes the log decay itself, per key: ``-exp(A_log[h]) * softplus(g + dt_bias[h, key])``, the same
activation ``decode_inputs.py`` applies; with q/k normalisation and the beta sigmoid in the kernel too,
one launch does all of a decode step's per-head work after the projections.

The pool may be bfloat16 (a reduced-byte decode state): the kernel still computes in fp32 and rounds
the state once per step when it writes it back, so a decode step moves about half the bytes.  How
much that rounding costs over a long decode, ``python -m target_stack.bench kda --only state``
measures: a numerics change a person approves, never the default (``ModelConfig.kda_state_dtype``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_stack.ops.utils import CachedLaunch, alloc, block_size, check_kda_inputs, interpreting


@triton.jit
def _kda_fused_recurrent_kernel(
    q, k, v, g, beta, o, h0, ht, slots, a_log, dt_bias,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, USE_SLOTS: tl.constexpr,
    L2NORM_QK: tl.constexpr, BETA_SIGMOID: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
):
    # programs in launch order walk one sequence's heads, then the next sequence: with a pool, one slot's
    # [H, K, V] state front to back (the state streams through DRAM in address order)
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.program_id(2).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    off_kv = i_h * K * V + o_k[:, None] * V + o_v[None, :]

    if USE_SLOTS:
        state_row = tl.load(slots + i_n).to(tl.int64)
        # the null slot (0) is neither read nor written
        m_state = (m_k[:, None] & m_v[None, :]) & (tl.zeros([BK, BV], dtype=tl.int64) + state_row > 0)
    else:
        state_row = i_n
        m_state = m_k[:, None] & m_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + state_row * H * K * V + off_kv, mask=m_state, other=0.0).to(tl.float32)
    if GATE_IN_KERNEL:
        b_a = -tl.exp(tl.load(a_log + i_h).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)

    for t in range(0, T):
        tok = i_n * T + t
        b_q = tl.load(q + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (tok * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_b = tl.load(beta + tok * H + i_h).to(tl.float32)
        if L2NORM_QK:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        if BETA_SIGMOID:
            b_b = tl.sigmoid(b_b)
        if GATE_IN_KERNEL:
            if HAS_DT_BIAS:
                b_g += b_bias
            b_g = b_a * tl.where(b_g > 20.0, b_g, tl.log(1.0 + tl.exp(b_g)))  # softplus, torch's threshold
        b_h *= tl.exp(b_g)[:, None]
        b_u = b_b * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
        tl.store(o + (tok * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    if STORE_FINAL_STATE:
        tl.store(ht + state_row * H * K * V + off_kv, b_h.to(ht.dtype.element_ty), mask=m_state)


_launch = CachedLaunch(_kda_fused_recurrent_kernel)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA over ``[N, T, H, *]`` inputs (T = 1 for a decode step).

    Without ``ssm_state_indices``: ``initial_state`` is ``[N, H, K, V]`` and the final state is
    returned as a new fp32 tensor when ``output_final_state``.  With ``ssm_state_indices``
    (int ``[N]``): ``initial_state`` is the slot pool (fp32, or bf16 for a reduced-byte state), updated in
    place (and returned) except for slot 0, the null slot.  With ``use_gate_in_kernel``, ``g`` is the raw
    gate input, ``A_log`` ``[H]`` and the optional ``dt_bias`` ``[H * K]`` (or ``[H, K]``) its activation's
    parameters.
    """
    pooled = ssm_state_indices is not None
    h0 = initial_state
    # A decode step is called with the same signature every time: validate it once.
    sig = (q.shape, k.shape, v.shape, g.shape, beta.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
           q.device, k.device, v.device, g.device, beta.device,
           None if h0 is None else (h0.shape, h0.dtype, h0.device, h0.is_contiguous()),
           (ssm_state_indices.shape, ssm_state_indices.dtype, ssm_state_indices.device) if pooled else None,
           bool(output_final_state), bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel),
           bool(use_gate_in_kernel), _gate_sig(A_log), _gate_sig(dt_bias))
    plan = _plans.get(sig)
    if plan is None:
        plan = _plan(q, k, v, g, beta, initial_state, output_final_state, ssm_state_indices,
                     use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, use_gate_in_kernel, A_log, dt_bias)
        if len(_plans) > 256:
            _plans.clear()
        _plans[sig] = plan
    N, T, H, K, V, grid, constexprs, key = plan
    scale = K**-0.5 if scale is None else float(scale)
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.is_contiguous()
            and beta.is_contiguous()):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = alloc(N, T, H, V, dtype=v.dtype, device=v.device)
    if pooled:
        ht = h0
    else:
        h0 = h0.contiguous() if h0 is not None else None
        ht = alloc(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    if use_gate_in_kernel and not (A_log.is_contiguous() and (dt_bias is None or dt_bias.is_contiguous())):
        A_log, dt_bias = A_log.contiguous(), None if dt_bias is None else dt_bias.contiguous()
    _launch(grid, key, (q, k, v, g, beta, o, h0, ht, ssm_state_indices, A_log, dt_bias, scale, T), constexprs)
    return o, ht


_plans: dict = {}
#: the slot pool's dtypes: fp32, or bf16 (half the state bytes per step, rounded once per step)
POOL_DTYPES = (torch.float32, torch.bfloat16)


def _gate_sig(t: torch.Tensor | None):
    """The in-kernel gate's parameter as a call signature sees it."""
    return None if t is None else (t.shape, t.dtype, t.device)


def _decode_tile(V: int, rows: int, device: torch.device, state_dtype: torch.dtype = torch.float32) -> int:
    """The V tile for a launch over ``rows`` (sequence, head) pairs: the widest up to 64 (32 for a bf16
    state) that still gives every SM a dozen programs, narrower down to 16 for a small batch, which
    needs the programs to fill the GPU; 32 in the interpreter.  The launch takes one warp per 4096
    state elements of a program's tile.  On an H200 at H=32, K=V=128 this picks, for an fp32 state,
    BV=16 at batch 1, 32 at 16, and 64 at 64 and 256; for a bf16 state 16 at batch 1 and 32 above.
    Each is the fastest of the launch sweep without cache hints (``bench/decode_sweep.py``,
    bench/RESULTS.md 2026-12-02)."""
    tile = min(block_size(V, 1), 64 if state_dtype == torch.float32 else 32)
    if interpreting() or device.type != "cuda":
        return min(tile, 32)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    while tile > 16 and rows * triton.cdiv(V, tile) < 12 * sms:
        tile //= 2
    return tile


def _plan(q, k, v, g, beta, initial_state, output_final_state, ssm_state_indices, l2norm, beta_sigmoid,
          gate_in_kernel=False, a_log=None, dt_bias=None):
    """Validate a call signature and prepare its launch: (N, T, H, K, V, grid, constexprs, key)."""
    pooled = ssm_state_indices is not None
    if pooled:
        if initial_state is None:
            raise ValueError("ssm_state_indices needs initial_state: the state-slot pool [num_slots, H, K, V]")
        if initial_state.dtype not in POOL_DTYPES or not initial_state.is_contiguous():
            raise ValueError("initial_state (the slot pool) must be a contiguous float32 or bfloat16 tensor, "
                             f"got {'a non-contiguous ' if not initial_state.is_contiguous() else ''}"
                             f"{initial_state.dtype} one")
    N, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state, state_batch=-1 if pooled else None)
    if pooled:
        if ssm_state_indices.shape != (N,) or ssm_state_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ssm_state_indices must be an integer tensor of shape [{N}], "
                             f"got {ssm_state_indices.dtype} {tuple(ssm_state_indices.shape)}")
        if ssm_state_indices.device != q.device:
            raise ValueError(f"ssm_state_indices is on {ssm_state_indices.device} but q is on {q.device}")
    if gate_in_kernel:
        _check_gate(a_log, dt_bias, H, K, q.device)
    elif a_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are the in-kernel gate's parameters: pass use_gate_in_kernel=True "
                         "(g is then the raw gate input), or leave them out (g is the log decay)")
    BK = block_size(K, 1)
    BV = _decode_tile(V, N * H, q.device, initial_state.dtype if pooled else torch.float32)
    flags = dict(USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=pooled or bool(output_final_state),
                 USE_SLOTS=pooled, L2NORM_QK=bool(l2norm), BETA_SIGMOID=bool(beta_sigmoid),
                 GATE_IN_KERNEL=bool(gate_in_kernel), HAS_DT_BIAS=bool(gate_in_kernel) and dt_bias is not None)
    key = (N, T, H, K, V, q.dtype, g.dtype, beta.dtype, q.device, pooled and ssm_state_indices.dtype,
           pooled and initial_state.dtype, *flags.values(), gate_in_kernel and a_log.dtype,
           gate_in_kernel and dt_bias is not None and dt_bias.dtype)
    constexprs = dict(H=H, K=K, V=V, BK=BK, BV=BV, **flags, num_warps=max(1, BK * BV // 4096))
    return N, T, H, K, V, (triton.cdiv(V, BV), H, N), constexprs, key


def _check_gate(a_log, dt_bias, H: int, K: int, device) -> None:
    """The in-kernel gate's parameters: ``A_log`` [H], ``dt_bias`` None or [H * K] / [H, K], floating, on q's device."""
    for name, t, shapes in (("A_log", a_log, ((H,),)), ("dt_bias", dt_bias, ((H * K,), (H, K)))):
        if t is None:
            if name == "A_log":
                raise ValueError("use_gate_in_kernel needs A_log [H]: the gate is -exp(A_log) * softplus(g + dt_bias)")
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) not in shapes:
            raise ValueError(f"{name} must have shape {' or '.join(str(list(x)) for x in shapes)}, "
                             f"got {list(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
