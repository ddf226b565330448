"""feedback.workcount on a real Triton kernel under the interpreter (tests/support/workcount.py)."""

from __future__ import annotations

import pytest

from tests.support.workcount import KERNEL, count


def test_counts_loads_per_tensor_operations_and_the_grid_of_a_real_kernel(tmp_path):
    k = tmp_path / "kern.py"
    k.write_text(KERNEL)
    got = count(tmp_path, k)
    assert got["err"] < 1e-5
    assert got["kernels"] == ["rownorm_scale"] and got["grids"] == [[8, 3, 1]]
    # 8 programs per row: each loads the whole row of x (8x its size) and its own tile of w (once)
    assert got["reads_x"] == pytest.approx(8.0) and got["reads_w"] == pytest.approx(1.0)
    # per program: one sqrt of the row's sum; per element: one division and one exp
    assert got["ops"]["sqrt"] == 24 and got["ops"]["fdiv"] == 3 * 32 and got["ops"]["exp"] == 3 * 32
    assert got["out_bytes"] == 0  # the output is not one of the named tensors
    # per kernel, every byte at any address: x 8 times and w once (fp32), the unnamed output once
    assert got["kernel_loaded"] == {"rownorm_scale": (8 * 3 * 32 + 3 * 32) * 4}
    assert got["kernel_stored"] == {"rownorm_scale": 3 * 32 * 4}
    assert got["kernel_ops"] == {"rownorm_scale.sqrt": 24, "rownorm_scale.fdiv": 96, "rownorm_scale.exp": 96}


DOTS = """
import json, sys
import torch, triton, triton.language as tl
from feedback.probe import ProbeContext
from feedback.workcount import WorkCount, report


@triton.jit
def twice(a, b, out, REPEAT: tl.constexpr):
    i = tl.program_id(0)
    r, c = tl.arange(0, 16), tl.arange(0, 32)
    b_a = tl.load(a + i * 16 * 32 + r[:, None] * 32 + c[None, :])
    b_b = tl.load(b + c[:, None] * 16 + r[None, :])
    acc = tl.dot(b_a, b_b, input_precision="ieee")
    if REPEAT:  # the same product again: twice the work for the same result
        acc = (acc + tl.dot(b_a, b_b, input_precision="ieee")) * 0.5
    tl.store(out + i * 16 * 16 + r[:, None] * 16 + r[None, :], acc)


g = torch.Generator().manual_seed(int(sys.argv[2]))
a, b = torch.randn(2, 16, 32, generator=g), torch.randn(32, 16, generator=g)
out = torch.empty(2, 16, 16)
with WorkCount(a=a, b=b) as wc:
    twice[(2,)](a, b, out, REPEAT=sys.argv[1] == "1")
err = ((out.double() - a.double() @ b.double()).abs().max() / (a.double() @ b.double()).abs().max()).item()
ctx = ProbeContext("p", {}, ".")
report(ctx, wc, per=32, unit="row", kernel_location=lambda k: dict(file="kern.py"))
print(json.dumps(dict(err=err, macs=wc.ops["dot_macs"],
                      metrics={n: [m.value, m.unit, m.counted, m.better] for n, m in ctx.metrics.items()},
                      findings=[(f.message, f.location.file, f.location.kernel) for f in ctx.findings])))
"""


def _dots(tmp_path, repeat: bool) -> dict:
    import json
    import os
    import subprocess
    import sys

    from tests.support.workcount import ROOT

    script = tmp_path / "dots.py"
    script.write_text(DOTS)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    proc = subprocess.run([sys.executable, str(script), "1" if repeat else "0",
                           str(int.from_bytes(os.urandom(4), "little"))], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_dot_products_are_counted_and_reported_as_counted_metrics_per_kernel(tmp_path):
    once, again = _dots(tmp_path, False), _dots(tmp_path, True)
    assert once["err"] < 1e-5 and again["err"] < 1e-5  # the same result either way
    assert once["macs"] == 2 * 16 * 32 * 16 and again["macs"] == 2 * once["macs"]
    m = once["metrics"]
    # per row of the report's unit: 2 programs x ([16, 32] of a, [32, 16] of b) loaded, [16, 16] stored, fp32
    # the kernel's own counts are parts (shown, not judged: None); the totals over every kernel are judged
    assert m["twice.loaded_bytes"] == [2 * (16 * 32 + 32 * 16) * 4 / 32, "B/row", True, None]
    assert m["twice.stored_bytes"] == [2 * 16 * 16 * 4 / 32, "B/row", True, None]
    assert m["twice.dot_macs"] == [once["macs"] / 32, "/row", True, None]
    for part in ("loaded_bytes", "stored_bytes", "dot_macs"):
        assert m[part] == m[f"twice.{part}"][:3] + ["lower"], part
    assert m["twice.launches"][0] == 1 and m["launches"][0] == 1 and m["launches"][2] is True
    assert again["metrics"]["dot_macs"][0] == 2 * m["dot_macs"][0]
    (message, file, kernel), = once["findings"]
    assert file == "kern.py" and kernel == "twice" and "512 dot_macs" in message and "grid (2, 1, 1)" in message


def test_refuses_to_count_outside_the_interpreter(monkeypatch):
    import torch

    from feedback.workcount import WorkCount, WorkCountError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(WorkCountError, match="TRITON_INTERPRET=1"), WorkCount(x=torch.ones(4)):
        pass
