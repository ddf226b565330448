"""feedback.launchcount on a real stack (a package written to disk, a real Triton kernel under the interpreter,
in a subprocess: TRITON_INTERPRET=1 must be set before triton is imported): every aten op that launches, by
kind and by the function that issued it; launch helpers attributed to their callers; host reads counted
whether or not they dispatch; everything patched put back."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

LAUNCH = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _scale(x, out, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out + o, tl.load(x + o) * 3.0)


def scale(x):
    out = torch.empty_like(x)  # an allocation: no launch
    _scale[(1,)](x, out, N=x.numel())
    return out
'''

MODEL = '''
import torch
from mystack import launch


def helper(y):
    return y * 2 + 1


def step(x, w):
    y = (x @ w).view(-1)  # a matmul; the view launches nothing
    z = helper(y)
    h = z.to(torch.bfloat16).float()  # two conversions
    return launch.scale(h)  # a Triton launch through the plumbing: this function's


def syncs(x, mask):
    total = x.sum().item()
    rows = x.tolist()
    picked = x[mask]
    where = x.nonzero()
    host = x.cpu()
    arr = x.numpy()
    wide = x.to(torch.float64)  # a conversion, not a host read
    return total, rows, picked, where, host, arr, wide
'''

RUN = '''
import json, sys, threading
import torch, triton
sys.path.insert(0, sys.argv[1])
from feedback.launchcount import LaunchCount, report
from feedback.probe import ProbeContext
from mystack import model

before = (torch.Tensor.tolist, torch.Tensor.cpu, triton.runtime.jit.JITFunction.run)
x, w = torch.randn(4, 8), torch.randn(8, 8)
with LaunchCount(sys.argv[1], within=["mystack/"], plumbing=["mystack/launch.py"]) as lc:
    out = model.step(x, w)
    model.syncs(x, x > 0)
    # another thread's work meanwhile (a server's transfer thread): not the code under count
    other = threading.Thread(target=lambda: (model.syncs(x, x > 0), model.step(x, w)))
    other.start()
    other.join()
after_ops = lc.total
x @ w  # outside: not counted
want = ((x.double() @ w.double()).view(-1) * 2 + 1).to(torch.bfloat16).double() * 3
ctx = ProbeContext("p", {}, sys.argv[1])
report(ctx, lc, per=2, unit="step", top=2)
print(json.dumps({
    "err": float((out.double() - want).abs().max()),
    "total": lc.total, "unchanged_after": lc.total == after_ops, "kinds": lc.kind_totals(),
    "sites": {str(s): c for s, c in lc.by_site().items()},
    "syncs": sorted([name, str(site), n] for name, site, n in lc.syncs()),
    "restored": [a is b for a, b in zip(before, (torch.Tensor.tolist, torch.Tensor.cpu,
                                                  triton.runtime.jit.JITFunction.run))],
    "metrics": {k: [m.value, m.counted, m.better] for k, m in ctx.metrics.items()},
    "findings": [[f.message, f.location.file, f.location.symbol] for f in ctx.findings],
}))
'''


def _run(tmp_path: pathlib.Path, files: dict[str, str] | None = None, script: str = RUN) -> dict:
    """Write the package ``mystack`` (``files``: name -> source), run ``script`` over it in a subprocess under
    the interpreter, and return the JSON of its last line."""
    pkg = tmp_path / "mystack"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, source in (files or {"launch.py": LAUNCH, "model.py": MODEL}).items():
        (pkg / name).write_text(source)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_launches_by_kind_and_function_host_reads_and_the_report(tmp_path):
    got = _run(tmp_path)
    assert got["err"] < 1e-2  # the kernel really ran (bf16 rounding of the round trip)
    sites = got["sites"]
    # the matmul, both conversions and the Triton launch are step's (the launch helper is plumbing)
    assert sites["mystack/model.py:step"] == {"matmul": 1, "conversion": 2, "triton": 1}
    assert sites["mystack/model.py:helper"] == {"other": 2}  # mul, add
    # every way of reading a value on the host, dispatched or not; the widening is a conversion
    assert [s[0] for s in got["syncs"]] == sorted(["_local_scalar_dense", "tolist", "index", "nonzero", "cpu",
                                                   "numpy"])
    assert all(s[1] == "mystack/model.py:syncs" and s[2] == 1 for s in got["syncs"])
    assert sites["mystack/model.py:syncs"] == {"other": 1, "host_sync": 6, "conversion": 1}  # sum; to(float64)
    assert sites["?:?"] == {"other": 1}  # the mask, made outside the stack: counted, at no function of it
    # the interpreter's own tensor work inside the launch counted nothing; nothing outside the block either
    assert got["kinds"] == {"matmul": 1, "conversion": 3, "host_sync": 6, "other": 4, "triton": 1}
    assert got["total"] == 15 and got["unchanged_after"]
    assert got["restored"] == [True, True, True]


def test_report_gives_counted_metrics_per_step_and_findings_bound_to_each_function(tmp_path):
    got = _run(tmp_path)
    m = got["metrics"]
    assert m["launches"] == [7.5, True, "lower"] and m["host_syncs"] == [3.0, True, "lower"]
    assert m["conversions"][0] == 1.5 and m["triton_launches"][0] == 0.5 and m["matmuls"][0] == 0.5
    assert m["aten_ops"][0] == 7.0
    # top=2: the two sites with most launches (syncs 8, step 4), not helper (2)
    assert m["mystack/model.py:syncs.launches"] == [4.0, True, None]  # a part: shown, not judged
    assert m["mystack/model.py:step.launches"][0] == 2.0 and "mystack/model.py:helper.launches" not in m
    assert [f[1:] for f in got["findings"]] == [["mystack/model.py", "syncs"], ["mystack/model.py", "step"]]
    assert "1 conversion" in got["findings"][1][0] and "0.5 triton" in got["findings"][1][0]


OPS = '''
def double(y):
    return y * 2 + 1
'''

LAYER = '''
from mystack import ops


def _tail(y):
    return ops.double(y)  # reached from forward: the entry is the innermost caller in another file, _tail


def forward(x):
    a = ops.double(x)
    return _tail(a) + 0
'''

ENTRIES = '''
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from feedback.launchcount import LaunchCount, report
from feedback.probe import ProbeContext
from mystack import layer, ops

x = torch.randn(4)
with LaunchCount(sys.argv[1], within=["mystack/"]) as lc:
    layer.forward(x)
    ops.double(x)  # called by the code that counts (here, in no file of the stack): no entry
ctx = ProbeContext("p", {}, sys.argv[1])
report(ctx, lc, per=1, unit="step")
print(json.dumps({
    "sites": {str(s): c for s, c in lc.by_site().items()},
    "entries": {str(s): {str(e): n for e, n in es.items()} for s, es in lc.by_entry().items()},
    "lines": {f"{s}<{e}": sorted(v) for (s, e), v in lc.entry_lines.items()},
    "metrics": {k: m.value for k, m in ctx.metrics.items()},
    "findings": [[f.message, f.location.file, f.location.symbol, f.location.part] for f in ctx.findings],
}))
'''


def test_a_helper_s_launches_are_also_counted_at_the_function_of_another_file_that_called_it(tmp_path):
    """A function that newly reaches a helper which launches (a cache it now bypasses) shows at the caller:
    each site's launches per entry (the innermost caller in another file of the stack), with its call lines."""
    got = _run(tmp_path, {"ops.py": OPS, "layer.py": LAYER}, ENTRIES)
    assert got["sites"] == {"mystack/ops.py:double": {"other": 6}, "mystack/layer.py:forward": {"other": 1}}
    # 2 ops of each call through layer.py; the third call came from the counting code itself
    assert got["entries"] == {"mystack/ops.py:double": {"mystack/layer.py:_tail": 2, "mystack/layer.py:forward": 2}}
    assert got["lines"] == {"mystack/ops.py:double<mystack/layer.py:forward": [10],
                            "mystack/ops.py:double<mystack/layer.py:_tail": [6]}
    m = got["metrics"]
    assert m["mystack/ops.py:double.launches"] == 6 and m["mystack/layer.py:forward>double.launches"] == 2
    bound = {f[3]: f[:3] for f in got["findings"]}  # by the part each finding states
    message, file, symbol = bound["mystack/ops.py:double"]
    assert "entered from mystack/layer.py:_tail (line 6: 2), mystack/layer.py:forward (line 10: 2)" in message
    message, file, symbol = bound["mystack/layer.py:forward>double"]
    assert (file, symbol) == ("mystack/layer.py", "forward")
    assert message.startswith("mystack/layer.py:forward calls mystack/ops.py:double (line 10): 2 launches")
