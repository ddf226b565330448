"""The CPU emulation of tensor-core dot precision, down to the bits and up to the CP merge."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from feedback import emulation
from feedback.emulation import dot_precision, emulated_matmul, split_tf32, to_tf32
from target_stack.ops.kda import chunk_kda, chunk_kda_cp, fused_recurrent_kda, naive_recurrent_kda
from target_stack.ops.kda.testing import make_inputs, rel_err

# The emulation patches Triton's interpreter; on a GPU the kernels compile instead, so these run
# there in an interpreted process (`.ci/gpu emulation` sets TRITON_INTERPRET=1).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the emulation models Triton's interpreter; this process compiles for a GPU")


def test_to_tf32_truncates_the_13_low_mantissa_bits():
    x = np.array([1.0 + 2.0**-10 + 2.0**-11 + 2.0**-20, -3.0000002, 1e-30], dtype=np.float32)
    t = to_tf32(x)
    assert t[0] == np.float32(1.0 + 2.0**-10)  # bits below 2^-10 dropped, no rounding up
    assert np.all(t.view(np.uint32) & 0x1FFF == 0)
    assert np.all(np.abs(t) <= np.abs(x))  # truncation shrinks magnitudes: a biased error
    r = to_tf32(np.array([1.0 + 2.0**-11 + 2.0**-12], dtype=np.float32), rounding="nearest")
    assert r[0] == np.float32(1.0 + 2.0**-10)


def test_split_tf32_recovers_fp32_and_products_have_the_expected_error():
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    big, small = split_tf32(a)
    assert np.abs((big.astype(np.float64) + small) - a).max() <= np.abs(a).max() * 2.0**-21
    exact = a.astype(np.float64) @ b.astype(np.float64)
    err = {p: np.linalg.norm(emulated_matmul(a, b, p) - exact) / np.linalg.norm(exact)
           for p in ("tf32", "tf32x3", "ieee")}
    assert 1e-4 < err["tf32"] < 2e-3
    assert err["tf32x3"] < 2e-6 and err["ieee"] < 1e-6
    with pytest.raises(ValueError, match="precision"):
        emulated_matmul(a, b, "fp8")


@triton.jit
def _chain_kernel(M, h, out, P, BK: tl.constexpr, PRECISION: tl.constexpr, DEFAULT: tl.constexpr):
    o = tl.arange(0, BK)
    b_h = tl.load(h + o[:, None] * BK + o[None, :])
    for p in range(0, P):
        b_M = tl.load(M + p * BK * BK + o[:, None] * BK + o[None, :])
        if DEFAULT:  # noqa: SIM108 - the call without the keyword is the point: Triton's default, tf32
            b_h = tl.dot(b_M, b_h)
        else:
            b_h = tl.dot(b_M, b_h, input_precision=PRECISION)
    tl.store(out + o[:, None] * BK + o[None, :], b_h)


def _chain_error(P: int, precision: str, default: bool = False) -> float:
    n = 32
    M = torch.linalg.qr(torch.randn(P, n, n, dtype=torch.float64))[0].float().contiguous()  # norm-preserving
    h = torch.randn(n, n)
    out = torch.full_like(h, float("nan"))
    _chain_kernel[(1,)](M, h, out, P, BK=n, PRECISION=precision, DEFAULT=default)
    ref = h.double()
    for p in range(P):
        ref = M[p].double() @ ref
    return rel_err(out, ref)


@interpreted
def test_interpreter_dots_are_exact_without_emulation():
    assert emulation.active() is None
    assert _chain_error(8, "tf32") < 1e-5  # the interpreter ignores input_precision: the blind spot


@interpreted
def test_emulation_honours_input_precision_and_treats_the_default_as_tf32():
    with dot_precision():
        assert emulation.active() == "truncate"
        tf32, default = _chain_error(8, "tf32"), _chain_error(8, "tf32", default=True)
        tf32x3, ieee = _chain_error(8, "tf32x3"), _chain_error(8, "ieee")
    assert emulation.active() is None
    assert tf32 > 1e-4 and default > 1e-4
    assert tf32x3 < 5e-6 and ieee < 1e-6


@interpreted
def test_truncation_error_grows_faster_than_round_to_nearest():
    """The reason truncation is the model (DESIGN.md): its bias accumulates along a chain."""
    with dot_precision("truncate"):
        trunc = _chain_error(64, "tf32")
    with dot_precision("nearest"):
        nearest = _chain_error(64, "tf32")
    assert trunc > 3 * nearest


def test_environment_switch_installs_the_emulation_in_a_subprocess():
    code = textwrap.dedent(
        """
        import target_stack.ops
        from feedback.emulation import install_from_env, active
        print(install_from_env(), active())
        """
    )
    env = dict(os.environ, INFRA_AGENT_EMULATE_DOT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["truncate", "truncate"]
    env[emulation.ENV_VAR] = "sometimes"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and emulation.ENV_VAR in bad.stderr


# --- the KDA paths under the emulation ---------------------------------------------------------

CP_SHAPE = dict(B=1, T=256, H=2, K=32, V=16)


def _cp_errors(x, ref_o, precision, P):
    o, _ = chunk_kda_cp(*x, P, merge_precision=precision)
    return rel_err(o, ref_o)


@interpreted
def test_whole_kda_path_stays_within_1e5_under_emulation(gen):
    x = make_inputs(2, 100, 2, 32, 16, decay_shift=3.0, generator=gen)
    ref_o, ref_s = naive_recurrent_kda(*(t.double() for t in x), output_final_state=True)
    with dot_precision():
        o, s = chunk_kda(*x, output_final_state=True)
        ro, rs = fused_recurrent_kda(*x, output_final_state=True)
        co, cs = chunk_kda_cp(*x, 8, output_final_state=True, merge_precision="tf32x3")
    for out, ref in ((o, ref_o), (s, ref_s), (ro, ref_o), (rs, ref_s), (co, ref_o), (cs, ref_s)):
        assert rel_err(out, ref) < 1e-5


@interpreted
@pytest.mark.slow
def test_cp_merge_error_grows_with_partitions_at_tf32_only(gen):
    x = make_inputs(**CP_SHAPE, decay_shift=3.0, generator=gen)
    ref_o, _ = naive_recurrent_kda(*(t.double() for t in x), output_final_state=True)
    with dot_precision():
        errs = {(p, P): _cp_errors(x, ref_o, p, P) for p in ("tf32", "tf32x3") for P in (2, 64)}
    tf32_growth = errs["tf32", 64] / errs["tf32", 2]
    assert tf32_growth >= 5, errs
    assert max(errs["tf32x3", 2], errs["tf32x3", 64]) < 1e-5, errs
    lo, hi = sorted((errs["tf32x3", 2], errs["tf32x3", 64]))
    assert hi / lo <= 3, errs
    # and without the emulation the tf32 bug is invisible: the reason the emulation exists
    assert _cp_errors(x, ref_o, "tf32", 64) < 1e-5


NESTED = '''
import json, sys
import torch, triton, triton.language as tl
from triton.runtime import interpreter

calls = [0]
original = interpreter._patch_lang


def counting(fn):
    calls[0] += 1
    return original(fn)


interpreter._patch_lang = counting
if sys.argv[1] == "1":
    from feedback.emulation import mend_interpreter
    mend_interpreter()


@triton.jit
def _softplus(x):
    return tl.log(1 + tl.exp(x))


@triton.jit
def _row(x, o, N: tl.constexpr):
    return _softplus(tl.load(x + o)) * 2


@triton.jit
def kern(x, out, N: tl.constexpr):
    o = tl.program_id(0) * N + tl.arange(0, N)
    acc = tl.zeros([N], dtype=tl.float32)
    for _ in range(3):
        acc += _row(x, o, N)
    tl.store(out + o, acc)


g = torch.Generator().manual_seed(int(sys.argv[2]))
x = torch.randn(8, 16, generator=g)
outs, per_launch = [], []
for _ in range(2):
    out = torch.full_like(x, float("nan"))
    kern[(8,)](x, out, N=16)
    outs.append(out)
    per_launch.append(calls[0] - sum(per_launch))
want = 6 * torch.log1p(torch.exp(x.double()))
print(json.dumps({"outs": [o.flatten().tolist() for o in outs], "calls": per_launch,
                  "err": float(((outs[1].double() - want).abs() / want.abs()).max()),
                  "load_builtin_after": bool(tl.core.is_builtin(tl.load))}))
'''


def test_helpers_are_not_repatched_within_a_launch_and_compute_the_same_bits(tmp_path):
    """mend_interpreter's skip of the language re-patch a @triton.jit helper does on every call: once per
    launch instead of per helper call per program, and the same output to the bit, on every launch."""
    seed = str(int.from_bytes(os.urandom(4), "little"))
    env = dict(os.environ, TRITON_INTERPRET="1")
    runs = {}
    for mended in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", NESTED, mended, seed], env=env, capture_output=True, text=True,
                             timeout=300, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr[-3000:]
        runs[mended] = json.loads(out.stdout.strip().splitlines()[-1])
    plain, mended = runs["0"], runs["1"]
    # per launch: the launch's own patch, then in each of the 8 programs one per helper call (3 iterations x 2
    # helpers, and tl.zeros: Triton's standard library is jit helpers too)
    first, second = plain["calls"]
    assert first == second and first >= 1 + 8 * 3 * 2 and (first - 1) % 8 == 0
    # mended: the launch's own, and the first helper from a module whose language modules it had not patched
    # (tl.zeros sees triton.language.core, the kernel triton.language): per launch, not per program
    assert mended["calls"][0] == mended["calls"][1] <= 3
    assert mended["outs"] == plain["outs"] and mended["outs"][0] == mended["outs"][1]
    assert mended["err"] < 1e-5
    assert mended["load_builtin_after"] == plain["load_builtin_after"]  # what a launch restores, restored
