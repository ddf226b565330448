"""The KDA probes' shape sweep: a case's own dtype, tolerance, metric and devices.

The real chunk kernel (Triton's interpreter on a CPU) behind a wrapper that plants a defect only on
16-bit inputs, as a GPU's 16-bit tiles can be wrong while its fp32 path is right: the 16-bit case fails at
its own condition and metric, the fp32 cases still pass, and a case for other devices is not run.
"""

from __future__ import annotations

import torch

from feedback.probe import ProbeContext
from target_stack.ops.kda import chunk_kda
from target_stack.ops.kda.testing import DEVICE
from target_stack.probes import kda

CASES = [
    {"B": 1, "T": 40, "H": 1, "K": 16, "V": 16, "h0": True},
    {"B": 1, "T": 70, "H": 2, "K": 64, "V": 32, "h0": True, "dtype": "bfloat16", "tolerance": 2e-2,
     "metric": "max_rel_err_16bit"},
    {"seqlens": [5, 64, 1], "H": 1, "K": 32, "V": 16, "h0": False, "dtype": "float16", "tolerance": 2e-2,
     "metric": "max_rel_err_16bit"},
    # 16-bit at the fp32 bound: it would fail wherever it ran
    {"B": 1, "T": 10, "H": 1, "K": 16, "V": 16, "h0": False, "dtype": "bfloat16", "devices": ["no-such-device"]},
]


def _run(fn, tmp_path) -> ProbeContext:
    ctx = ProbeContext("kda.chunk.correctness", {"tolerance": 1e-5, "cases": CASES}, str(tmp_path))
    ctx._device = DEVICE  # the interpreter here; on a GPU the compiled kernels and real 16-bit tiles
    kda._sweep(ctx, fn, "target_stack/ops/kda/chunk.py", "chunk_kda")
    return ctx


def test_16bit_cases_are_held_to_their_own_bound_and_metric(tmp_path):
    ctx = _run(chunk_kda, tmp_path)
    assert not ctx.failed, [f.message for f in ctx.findings]  # the case for another device did not run
    assert ctx.metrics["max_rel_err"].value < 1e-5
    # the output's own 16-bit rounding, not an fp32 path's error: the inputs really were 16-bit
    assert 1e-4 < ctx.metrics["max_rel_err_16bit"].value < 2e-2


def test_a_defect_of_the_16bit_path_fails_there_only(tmp_path):
    def wrong_on_16bit(q, k, v, g, beta, **kw):
        o, s = chunk_kda(q, k, v, g, beta, **kw)
        if q.element_size() == 2:  # half the value channels come out of the wrong tile
            o = torch.cat([o[..., o.shape[-1] // 2:], o[..., : o.shape[-1] // 2]], -1)
        return o, s

    ctx = _run(wrong_on_16bit, tmp_path)
    assert ctx.failed
    failed = [f.location.condition for f in ctx.findings]
    assert len(failed) == 2 and all("dtype=" in c for c in failed), failed
    assert all("tolerance" not in c and "metric" not in c for c in failed)  # how a case is judged is no condition
    assert ctx.metrics["max_rel_err"].value < 1e-5 and ctx.metrics["max_rel_err_16bit"].value > 0.5
