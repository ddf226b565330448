"""A toy target for the harness: probes that pass, fail, crash, hang, and a manifest naming them."""

from __future__ import annotations

TOY_PROBES = '''
import os, subprocess, sys, time
from feedback.probe import probe

@probe
def ok(ctx):
    ctx.metric("err", 1e-7, better="lower")
    ctx.metric("marker", float(open(os.path.join(ctx.tree, "toy", "value.txt")).read()))

@probe
def bad_metric(ctx):
    ctx.metric("err", 0.5, better="lower")

@probe
def raises(ctx):
    def inner():
        raise ZeroDivisionError("deliberate")
    inner()

@probe
def hangs(ctx):
    # a child in the same process group must die with it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.path.join(ctx.tree, "child.pid"), "w").write(str(child.pid))
    time.sleep(600)

@probe
def segfault(ctx):
    import ctypes
    ctypes.string_at(0)

@probe
def eats_memory(ctx):
    blocks = []
    while True:
        blocks.append(bytearray(64 * 2**20))

@probe
def skips(ctx):
    ctx.skip("needs a widget")

@probe
def fails_with_location(ctx):
    ctx.fail("error grows 41x from P=2 to P=64", file="toy/merge.py", kernel="merge_kernel",
             param="merge_precision='tf32'", condition="T=256")
'''


TOY_MANIFEST = '''
schema_version: 1
name: toy
probes:
  - {id: toy.static, kind: static, entry: "toy.probes:ok", covers: {files: ["toy/value.txt"]}, budget_s: 30}
  - id: toy.ok
    kind: correctness
    entry: "toy.probes:ok"
    covers: {files: ["toy/value.txt", "toy/core.py"], symbols: [core]}
    budget_s: 30
    thresholds: {err: {max: 1.0e-5}}
  - id: toy.bad
    kind: correctness
    entry: "toy.probes:bad_metric"
    covers: {files: ["toy/core.py"]}
    params: {block: 64}
    thresholds: {err: {max: 1.0e-5}}
  - {id: toy.raises, kind: correctness, entry: "toy.probes:raises", covers: {files: ["toy/other.py"]}}
  - {id: toy.hangs, kind: correctness, entry: "toy.probes:hangs", budget_s: 2, covers: {files: ["toy/other.py"]}}
  - {id: toy.segfault, kind: correctness, entry: "toy.probes:segfault", covers: {files: ["toy/other.py"]}}
  - id: toy.memory
    kind: correctness
    entry: "toy.probes:eats_memory"
    memory_mb: 2000  # an address-space limit: room for numpy and its BLAS threads on a 16-core host
    budget_s: 60
    covers: {files: ["toy/other.py"]}
  - {id: toy.skips, kind: microbench, entry: "toy.probes:skips", covers: {files: ["toy/core.py"]}}
  - {id: toy.located, kind: correctness, entry: "toy.probes:fails_with_location", covers: {files: ["toy/merge.py"]}}
  - {id: toy.garbage, kind: e2e, command: "echo this is not json", covers: {files: ["toy/serve.py"]}}
  - {id: toy.cmd, kind: e2e, command: "echo '{\\"metrics\\": {\\"ttft_ms\\": 12.5}}'",
     covers: {files: ["toy/serve.py"]}}
acceptance:
  - {name: precise, expr: "toy.ok.err <= 1e-6"}
  - {name: bad, expr: "toy.bad.err <= 1e-6"}
protected: [toy/probes.py]
'''


def by_id(report):
    return {r.probe: r for r in report.results}
