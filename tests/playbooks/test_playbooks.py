"""Every playbook on a case where it applies and one where it must decline; transforms on real trees."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

from feedback.harness import judge
from feedback.models import FeedbackReport, Finding, Location, Metric, ProbeResult, Status
from feedback.targets import materialize_bundled
from playbooks.model import PlaybookError, evaluate, load_library, load_playbook, run_transform
from tests.support.workcount import FLAT_KERNEL, KERNEL, count

LIB = load_library()


def report(*results: ProbeResult) -> FeedbackReport:
    return FeedbackReport(target="t", candidate="t", results=list(results))


def metrics(probe: str, **values: float) -> ProbeResult:
    return ProbeResult(probe=probe, status=Status.passed, metrics={k: Metric(value=v) for k, v in values.items()})


def finding(probe: str, message: str, status: Status = Status.failed) -> ProbeResult:
    return ProbeResult(probe=probe, status=status,
                       findings=[Finding(message=message, location=Location(), failed=status == Status.failed)])


def tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


SMALL_GRID = "kern[(triton.cdiv(n, 16),)](x)\n"
V_TILED = '''
@triton.jit
def decode(q, k, BV: tl.constexpr):
    i_v = tl.program_id(0)
    b_q = tl.load(q)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
'''

CASES = {
    # id: (applies: (report, files), declines: (report, files))
    "tf32x3-fp32-dot-chains": (
        (report(finding("s.static", "tl.dot without input_precision: fp32 operands default to tf32")),
         {"k.py": "acc = tl.dot(a, b)\n"}),
        (report(metrics("x.cp.merge", error_growth=0.8)), {"k.py": "acc = tl.dot(a, b)\n"}),
    ),
    "release-gil-native-calls": (
        (report(metrics("e.events", heartbeat_max_gap_ms=20.0)), {"n.py": "lib = ctypes.PyDLL('x.so')\n"}),
        (report(metrics("e.events", heartbeat_max_gap_ms=0.6)), {"n.py": "lib = ctypes.PyDLL('x.so')\n"}),
    ),
    "fuse-v-tiles": (
        (report(metrics("d.decode.bench", bandwidth_vs_copy=0.22)), {"d.py": V_TILED}),
        # memory-bound (the H200 at batch 256 ran at 94% of copy): must decline despite the pattern
        (report(metrics("d.decode.bench", bandwidth_vs_copy=0.22),
                metrics("d.decode.bench256", bandwidth_vs_copy=0.94)), {"d.py": V_TILED}),
    ),
    "reciprocal-rsqrt": (
        (report(metrics("d.bench", bandwidth_vs_copy=0.3)), {"d.py": V_TILED}),
        (report(metrics("d.bench", bandwidth_vs_copy=0.9)), {"d.py": V_TILED}),
    ),
    "cuda-graph-decode": (
        (report(metrics("d.decode.bench", host_overhead_ratio=11.0)), {"engine.py": "def decode_step(batch):\n"}),
        (report(metrics("d.decode.bench", host_overhead_ratio=1.05)), {"engine.py": "def decode_step(batch):\n"}),
    ),
    "retune-launch-params": (
        (report(metrics("p.prefill.bench", bandwidth_vs_copy=0.1)), {"k.py": "kern[grid](x, num_warps=4)\n"}),
        (report(metrics("p.prefill.bench", bandwidth_vs_copy=0.85)), {"k.py": "kern[grid](x, num_warps=4)\n"}),
    ),
    "fuse-quant-into-producer": (
        (report(finding("m.trace", "top 1: per_token_quant_kernel (cuda) 120 us, 35% of cuda time", Status.passed)),
         {"m.py": "xq, s = quantize_per_token(x)\n"}),
        (report(finding("m.trace", "top 1: matmul_kernel (cuda) 400 us, 80% of cuda time", Status.passed)),
         {"m.py": "xq, s = quantize_per_token(x)\n"}),
    ),
    "restore-argument-order": (
        (report(finding("s.static.argument_order", "call of `mix` (k.py:1) declares (q, k) passes `k` as parameter 1 "
                        "(q; `k` is parameter 2), `q` as parameter 2 (k; `q` is parameter 1)")),
         {"k.py": "def mix(q, k):\n    return q\n\n\nmix(k, q)\n"}),
        (report(finding("s.static.dots", "tl.dot without input_precision")),
         {"k.py": "def mix(q, k):\n    return q\n\n\nmix(k, q)\n"}),
    ),
    "persistent-grid": (
        (report(metrics("s.bench", programs_per_sm=64.0, kernel_us=6.0)), {"k.py": SMALL_GRID}),
        (report(metrics("s.bench", programs_per_sm=64.0, kernel_us=900.0)), {"k.py": SMALL_GRID}),
    ),
}


def test_library_has_at_least_eight_playbooks_each_tested_here():
    assert len(LIB) >= 8
    assert set(LIB) == set(CASES)
    for pb in LIB.values():
        assert pb.sources and pb.applicability.signals.all_of + pb.applicability.signals.any_of


@pytest.mark.parametrize("pid", sorted(CASES))
def test_playbook_applies_on_evidence_and_declines_without(pid, tmp_path):
    (rep_yes, files_yes), (rep_no, files_no) = CASES[pid]
    yes = evaluate(LIB[pid], rep_yes, tree(tmp_path / "yes", files_yes))
    assert yes.applies, yes.reason
    assert yes.evidence and yes.code_matches
    no = evaluate(LIB[pid], rep_no, tree(tmp_path / "no", files_no))
    assert not no.applies and no.reason.startswith("declined")


def test_a_pattern_without_evidence_never_applies(tmp_path):
    t = tree(tmp_path, {"k.py": "acc = tl.dot(a, b)\nlib = ctypes.PyDLL('x')\ny = x / tl.sqrt(z)\n"})
    empty = report(metrics("any.probe", step_us=5.0))
    assert not any(evaluate(pb, empty, t).applies for pb in LIB.values())


def test_evidence_without_the_code_pattern_declines(tmp_path):
    rep = report(finding("s.static", "tl.dot without input_precision"))
    res = evaluate(LIB["tf32x3-fp32-dot-chains"], rep, tree(tmp_path, {"k.py": "x = 1\n"}))
    assert not res.applies and "no code pattern" in res.reason


def test_a_loop_division_the_manifest_tolerates_is_no_evidence_and_a_new_one_is(tmp_path):
    t = tree(tmp_path, {"d.py": V_TILED})
    site = "division in the kernel's loop: b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-06)"
    tolerated = ProbeResult(probe="static.kernel_loop_division", status=Status.passed, findings=[
        Finding(message=site + " (tolerated in the manifest)", location=Location(file="d.py", condition="line 7"))])
    assert not evaluate(LIB["reciprocal-rsqrt"], report(tolerated), t).applies
    new = ProbeResult(probe="static.kernel_loop_division", status=Status.failed, findings=[
        Finding(message=site, location=Location(file="d.py", condition="line 7"), failed=True)])
    res = evaluate(LIB["reciprocal-rsqrt"], report(new), t)
    assert res.applies and res.for_a_failure and res.evidence == [f"static.kernel_loop_division: {site} [at d.py:7]"]


def test_the_argument_order_pattern_reads_a_launch_with_a_comment_after_an_argument(tmp_path):
    # flash-attention's rotary launch comments its first argument; the pattern had missed it, and the hypothesis
    # cited the grid lambda above it instead of the launch the fix changes
    launch = "    rotary_kernel[grid](\n        output,  # data ptr\n        x,\n        cos,\n    )\n"
    t = tree(tmp_path, {"r.py": "def f(x, cos, output, grid):\n" + launch})
    msg = "call of `rotary_kernel` (r.py:9) declares (x, output) passes `output` as parameter 1 (x; `output` is ..."
    res = evaluate(LIB["restore-argument-order"], report(finding("static.argument_order", msg)), t)
    assert res.applies and ("r.py", 2) in [(m.file, m.line) for m in res.code_matches], res.code_matches


def test_a_call_the_manifest_tolerates_is_no_reason_to_reorder_it(tmp_path):
    # flash-attention: every session ended "restore-argument-order applies but its transform changed nothing",
    # its evidence the deliberate call `init` had tolerated
    t = tree(tmp_path, {"k.py": "def mix(q, k):\n    return q\n\n\nmix(k, q)\n"})
    msg = "call of `mix` (k.py:1) declares (q, k) passes `k` as parameter 1 (q; `k` is parameter 2)"
    kept = ProbeResult(probe="static.argument_order", status=Status.passed, findings=[
        Finding(message=msg + " (tolerated in the manifest)", location=Location(file="k.py", condition="line 5"))])
    assert not evaluate(LIB["restore-argument-order"], report(kept), t).applies


def test_playbook_schema_refuses_code_only_applicability(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("""
id: bad
title: t
sources: [x]
summary: s
applicability:
  signals: {none_of: [{metric: a, op: "<", value: 1}]}
  code: [{regex: "x"}]
transformation: {text: t}
""")
    with pytest.raises(PlaybookError, match="must rest on feedback signals"):
        load_playbook(bad)


def test_rsqrt_and_cdll_transforms_edit_only_the_matches(tmp_path):
    t = tree(tmp_path, {"d.py": V_TILED, "n.py": "import ctypes\nlib = ctypes.PyDLL('libc.so.6')\n"})
    rs = evaluate(LIB["reciprocal-rsqrt"], report(metrics("d.bench", bandwidth_vs_copy=0.3)), t)
    assert run_transform(LIB["reciprocal-rsqrt"], t, rs) == ["d.py"]
    assert "b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)" in (t / "d.py").read_text()
    gil = evaluate(LIB["release-gil-native-calls"], report(metrics("e", heartbeat_max_gap_ms=20.0)), t)
    assert run_transform(LIB["release-gil-native-calls"], t, gil) == ["n.py"]
    assert (t / "n.py").read_text() == "import ctypes\nlib = ctypes.CDLL('libc.so.6')\n"
    with pytest.raises(PlaybookError, match="text only"):
        run_transform(LIB["cuda-graph-decode"], t, rs)


def test_the_division_transform_rewrites_sqrt_and_exp_divisors_and_nothing_else(tmp_path):
    src = ("y = (a + b) / tl.sqrt(tl.sum(c * c) + 1e-6)\n"
           "h = h / tl.exp(-g)[:, None]\n"
           "u = u / tl.exp(g * 2)\n"
           "r = 1 / tl.sqrt(v + eps)\n"
           "z = a / b\n")
    t = tree(tmp_path, {"k.py": src})
    app = evaluate(LIB["reciprocal-rsqrt"], report(metrics("w.work", divisions_per_output=3.0)), t)
    assert app.applies and app.evidence == ["w.work.divisions_per_output = 3 > 0"]
    assert run_transform(LIB["reciprocal-rsqrt"], t, app) == ["k.py"]
    assert (t / "k.py").read_text() == ("y = (a + b) * tl.rsqrt(tl.sum(c * c) + 1e-6)\n"
                                        "h = h * tl.exp(g)[:, None]\n"
                                        "u = u * tl.exp(-(g * 2))\n"
                                        "r = tl.rsqrt(v + eps)\n"  # not 1 * tl.rsqrt(...)
                                        "z = a / b\n")


def test_the_division_transform_names_the_language_as_the_module_does(tmp_path):
    # `import triton.language as T`, `from triton.language import sqrt`: the same divisions as tl.sqrt; the
    # rewrite spells the language the module's way; numpy's sqrt is not Triton's
    src = ("import numpy as np\nimport triton.language as T\nfrom triton.language import exp, sqrt\n\n"
           "y = a / T.sqrt(v)\nh = h / exp(g)\nr = 1 / sqrt(v + eps)\nn = a / np.sqrt(v)\n")
    t = tree(tmp_path, {"k.py": src})
    app = evaluate(LIB["reciprocal-rsqrt"], report(metrics("w.work", divisions_per_output=3.0)), t)
    assert app.applies, app.reason
    assert run_transform(LIB["reciprocal-rsqrt"], t, app) == ["k.py"]
    assert (t / "k.py").read_text().split("\n\n", 1)[1] == (
        "y = a * T.rsqrt(v)\nh = h * T.exp(-g)\nr = T.rsqrt(v + eps)\nn = a / np.sqrt(v)\n")


def test_tile_fusion_declines_on_roofline_evidence_and_says_what_it_measured(tmp_path):
    t = tree(tmp_path, {"d.py": V_TILED})
    pb = LIB["fuse-v-tiles"]
    near_copy = evaluate(pb, report(metrics("k.decode.bench", bandwidth_vs_copy=0.78),
                                    metrics("k.decode.work", max_input_reads=16.0)), t)
    assert not near_copy.applies
    assert near_copy.reason == "declined: evidence against it: k.decode.bench.bandwidth_vs_copy = 0.78 >= 0.75"
    few_repeats = evaluate(pb, report(metrics("k.decode.work", max_input_reads=4.0)), t)
    assert not few_repeats.applies and "(measured: k.decode.work.max_input_reads = 4)" in few_repeats.reason
    assert "bandwidth_vs_copy < 0.6 (not measured here)" in few_repeats.reason
    counted = evaluate(pb, report(metrics("k.decode.work", max_input_reads=16.0)), t)
    assert counted.applies and counted.evidence == ["k.decode.work.max_input_reads = 16 > 4"]


def test_tile_widening_runs_fewer_programs_with_the_same_results(tmp_path):
    """The transform on a real kernel that repeats per-row work in every tile: after it, the kernel
    computes the same outputs, counted under the interpreter, with the row fetched once."""
    t = tree(tmp_path / "t", {"kern.py": KERNEL})
    before = count(tmp_path, t / "kern.py")
    app = evaluate(LIB["fuse-v-tiles"], report(metrics("w.work", max_input_reads=8.0)), t)
    assert app.applies, app.reason
    assert run_transform(LIB["fuse-v-tiles"], t, app) == ["kern.py"]
    text = (t / "kern.py").read_text()
    assert "    BN = _widest_tile(N, BN, rows)\n" in text
    after = count(tmp_path, t / "kern.py")
    assert before["grids"] == [[8, 3, 1]] and after["grids"] == [[1, 3, 1]]
    assert before["reads_x"] == 8 and after["reads_x"] == 1 and after["reads_w"] == 1
    assert before["err"] < 1e-5 and after["err"] < 1e-5
    assert run_transform(LIB["fuse-v-tiles"], t, app) == []  # never twice


def test_tile_widening_finds_the_tile_of_a_flattened_grid(tmp_path):
    """One program axis decomposed in the kernel (``pid % NT``, ``pid // NT``) and a grid of ``cdiv(N, BN) *
    rows``: the tile is found through the index arithmetic and widened with the grid's other factor."""
    assert "pid % NT" in FLAT_KERNEL and "cdiv(N, BN) * rows" in FLAT_KERNEL  # the variant is what it says
    t = tree(tmp_path / "t", {"kern.py": FLAT_KERNEL})
    before = count(tmp_path, t / "kern.py")
    app = evaluate(LIB["fuse-v-tiles"], report(metrics("w.work", max_input_reads=8.0)), t)
    assert app.applies, app.reason
    assert run_transform(LIB["fuse-v-tiles"], t, app) == ["kern.py"]
    assert "    BN = _widest_tile(N, BN, rows)\n" in (t / "kern.py").read_text()
    after = count(tmp_path, t / "kern.py")
    assert before["grids"] == [[24, 1, 1]] and after["grids"] == [[3, 1, 1]]
    assert before["reads_x"] == 8 and after["reads_x"] == 1
    assert before["err"] < 1e-5 and after["err"] < 1e-5


def test_tf32x3_playbook_fixes_an_implicit_tf32_merge_in_the_bundled_target(tmp_path):
    """Feedback -> applicability -> executable transform -> the same probes pass again."""
    t = materialize_bundled(tmp_path / "ts")
    cp = t / "target_stack" / "ops" / "kda" / "cp.py"
    cp.write_text(cp.read_text().replace("tl.dot(b_M, b_h, input_precision=MERGE_PRECISION)", "tl.dot(b_M, b_h)"))
    broken = judge(t, probe_ids=["kda.static.dot_precision", "kda.cp.merge"], run_all=True, use_cache=False)
    assert {r.probe: r.status for r in broken.results} == {"kda.static.dot_precision": Status.failed,
                                                           "kda.cp.merge": Status.failed}
    pb = LIB["tf32x3-fp32-dot-chains"]
    app = evaluate(pb, broken, t)
    assert app.applies and any(m.file == "target_stack/ops/kda/cp.py" for m in app.code_matches)
    assert run_transform(pb, t, app) == ["target_stack/ops/kda/cp.py"]
    assert "tl.dot(b_M, b_h, input_precision=MERGE_PRECISION)" in cp.read_text()  # the kernel's own knob
    fixed = judge(t, probe_ids=["kda.static.dot_precision", "kda.cp.merge"], run_all=True, use_cache=False)
    assert all(r.status == Status.passed for r in fixed.results), [r.reason for r in fixed.results]


KERNEL_WITHOUT_PARAM = """import triton
import triton.language as tl


@triton.jit
def kern(a_ptr, b_ptr, N: tl.constexpr):
    a = tl.load(a_ptr + tl.arange(0, N))
    b = tl.load(b_ptr + tl.arange(0, N))
    h = tl.zeros([N, N], dtype=tl.float32)
    h = tl.dot(h,
               b)
    low = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    g = tl.dot(
        h,
        b,
    )
    return h + low + tl.dot(h, b, out_dtype=tl.float32) + g
"""


def test_state_dot_precision_states_fp32_dots_with_a_constant_and_its_fallback(tmp_path):
    t = tree(tmp_path, {"k.py": KERNEL_WITHOUT_PARAM})
    app = evaluate(LIB["tf32x3-fp32-dot-chains"], report(finding("s", "tl.dot without input_precision")), t)
    assert app.applies, app.reason
    assert run_transform(LIB["tf32x3-fp32-dot-chains"], t, app) == ["k.py"]
    src = (t / "k.py").read_text()
    assert "b, input_precision=FP32_DOT_PRECISION)" in src  # the fp32 chain, by the module's constant
    # after the last argument: a trailing comma stays valid, a keyword argument stays before it
    assert "        b, input_precision=FP32_DOT_PRECISION,\n    )" in src
    assert "tl.dot(h, b, out_dtype=tl.float32, input_precision=FP32_DOT_PRECISION)" in src
    assert "tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))" in src  # bf16 products are exact: left alone
    assert "'tf32x3' if torch.version.cuda else 'ieee')" in src and "import torch" in src
    assert "torch.cuda." not in src  # importing the kernel module never initialises CUDA
    compile(src, "k.py", "exec")
    namespace: dict = {}
    exec(compile(src.split("@triton.jit")[0], "k.py", "exec"), namespace)  # the constant resolves here
    assert namespace["FP32_DOT_PRECISION"].value in ("tf32x3", "ieee")


def test_playbooks_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "playbooks", "list", "--json"],
                         capture_output=True, text=True, check=True)
    import json

    ids = {p["id"] for p in json.loads(out.stdout)}
    assert ids == set(LIB)
    show = subprocess.run([sys.executable, "-m", "infra_agent.cli", "playbooks", "show", "fuse-v-tiles"],
                          capture_output=True, text=True, check=True)
    assert "bandwidth_vs_copy" in show.stdout and "flash-linear-attention" in show.stdout
    bad = subprocess.run([sys.executable, "-m", "infra_agent.cli", "playbooks", "show", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "known: " in bad.stderr


ORDER = {
    "pkg/__init__.py": "",
    "pkg/ops.py": '''import triton
import triton.language as tl


@triton.jit
def mix(q, k, o, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o + i, tl.load(q + i) * 2.0 + tl.load(k + i))


def run(q, k, o):
    mix[(1,)](q, k, o, N=8)


def run_swapped(q, k, o):
    out = {"é": mix[(1,)](k, q,
                          o, N=8)}
    return out


def pair(first, rid):
    return first, rid


def both(rid, first):
    return pair(rid, first), pair(rid, first)


def inner(q, k):
    return q


def outer(q, k):
    return inner(q, k), inner(k=k, q=q), outer(inner(k, q).k, inner(k, q).q)
''',
    "pkg/other.py": "from pkg.ops import mix\n\n\ndef far(q, k, o):\n    mix[(2,)](k, q, o)\n",
}


def test_the_argument_order_transform_puts_each_argument_back_and_leaves_a_declaration_to_a_person(tmp_path):
    """Calls that disagree with a definition other calls agree with go back in order (a launch across lines,
    after a non-ASCII character on its line; another module's launch); a declaration every call disagrees
    with the same way is left alone; of nested misplaced calls the outer moves first, whole."""
    from feedback.checks import run_check

    t = tree(tmp_path, ORDER)
    _, before, _ = run_check("argument_order", t, ["pkg"])
    rep = report(ProbeResult(probe="s.static.argument_order", status=Status.failed, findings=[
        Finding(message=m.message, location=Location(file=m.file, condition=f"line {m.line}"), failed=True)
        for m in run_check("argument_order", t, ["pkg"])[2]]))
    app = evaluate(LIB["restore-argument-order"], rep, t)
    assert app.applies, app.reason
    changed = run_transform(LIB["restore-argument-order"], t, app)
    assert changed == ["pkg/ops.py", "pkg/other.py"]
    ops = (t / "pkg" / "ops.py").read_text()
    assert '    out = {"é": mix[(1,)](q, k,\n                          o, N=8)}' in ops
    assert "mix[(2,)](q, k, o)" in (t / "pkg" / "other.py").read_text()
    assert "return pair(rid, first), pair(rid, first)" in ops  # the declaration's order is the odd one out
    assert "outer(inner(k, q).q, inner(k, q).k)" in ops  # the outer call, whole; the inner ones next time
    _, after, sites = run_check("argument_order", t, ["pkg"])
    assert before == 7 and after == 3, [s.message for s in sites]  # outer: its one call names two places
    assert sum("odd one out" in s.message for s in sites) == 1
    run_transform(LIB["restore-argument-order"], t, app)  # the next application: the inner calls
    assert "outer(inner(q, k).q, inner(q, k).k)" in (t / "pkg" / "ops.py").read_text()
    assert run_check("argument_order", t, ["pkg"])[1] == 1


def test_the_argument_order_transform_reaches_a_definition_in_another_package(tmp_path):
    # the kernel is defined (and called in order) in one top-level package and called out of order from
    # another: the transform judges that call against the definition wherever in the tree it lies (a
    # virtual environment's copy aside)
    from feedback.checks import run_check

    definition = "def mix(q, k, o):\n    return q\n"
    t = tree(tmp_path, {
        "kern/__init__.py": "", "kern/ops.py": definition,
        "kern/use.py": "from kern.ops import mix\n\n\ndef use(q, k, o):\n    mix(q, k, o)\n",
        "app/__init__.py": "", "app/run.py": "from kern.ops import mix\n\n\ndef go(q, k, o):\n    mix(k, q, o)\n",
        ".venv/lib/site-packages/kern/ops.py": "def mix(k, q, o):\n    return q\n",  # never judged against
    })
    sites = run_check("argument_order", t)[2]
    assert [(s.file, s.line) for s in sites] == [("app/run.py", 5)], [s.message for s in sites]
    rep = report(ProbeResult(probe="s.static.argument_order", status=Status.failed, findings=[
        Finding(message=s.message, location=Location(file=s.file, condition=f"line {s.line}"), failed=True)
        for s in sites]))
    app = evaluate(LIB["restore-argument-order"], rep, t)
    assert app.applies and {m.file for m in app.code_matches} == {"app/run.py"}, app.reason
    assert run_transform(LIB["restore-argument-order"], t, app) == ["app/run.py"]
    assert "    mix(q, k, o)\n" in (t / "app" / "run.py").read_text()
    assert (t / "kern" / "ops.py").read_text() == definition and run_check("argument_order", t)[1] == 0


def test_the_gil_transform_follows_every_way_a_file_imports_the_loader(tmp_path):
    # the check names each of these (feedback/checks.gil_native); the transform gives each its releasing twin
    src = textwrap.dedent('''\
        import ctypes
        import ctypes as C
        from ctypes import CDLL, PyDLL, pydll, pythonapi
        from ctypes import PyDLL as Loader

        a = ctypes.PyDLL("liba.so")
        b = C.pydll.LoadLibrary("libb.so")
        c = pydll.libc
        d = Loader("libd.so")
        e = PyDLL("libe.so")  # PyDLL in a comment stays
        f = pythonapi.PyCapsule_GetPointer
    ''')
    t = tree(tmp_path, {"n.py": src})
    app = evaluate(LIB["release-gil-native-calls"], report(metrics("e", heartbeat_max_gap_ms=20.0)), t)
    assert app.applies, app.reason
    assert run_transform(LIB["release-gil-native-calls"], t, app) == ["n.py"]
    out = (t / "n.py").read_text()
    assert out == textwrap.dedent('''\
        import ctypes
        import ctypes as C
        from ctypes import CDLL, cdll, pythonapi
        from ctypes import CDLL as Loader

        a = ctypes.CDLL("liba.so")
        b = C.cdll.LoadLibrary("libb.so")
        c = cdll.libc
        d = Loader("libd.so")
        e = CDLL("libe.so")  # PyDLL in a comment stays
        f = pythonapi.PyCapsule_GetPointer
    '''), out
    from feedback.checks import run_check
    assert run_check("gil_native", t)[1] == 0  # pythonapi, the interpreter's own C API, must hold the GIL: no site


ALIASED_DOTS = '''\
import triton
import triton.language as T
from triton.language import dot


@triton.jit
def merge(a_ptr, b_ptr, o_ptr, N: T.constexpr):
    r = T.arange(0, N)
    a = T.load(a_ptr + r[:, None] * N + r[None, :])
    b = T.load(b_ptr + r[:, None] * N + r[None, :])
    s = T.zeros([N, N], dtype=T.float32) + a
    é = 1; h = T.dot(s, b)  # a non-ASCII name before the dot on its line
    h = dot(h, b)
    low = dot(a.to(T.bfloat16), b.to(T.bfloat16))
    T.store(o_ptr + r[:, None] * N + r[None, :], h + low)
'''


def test_the_dot_check_and_transform_follow_the_module_s_names_for_triton_language(tmp_path):
    # T.dot after `import triton.language as T`, dot after `from triton.language import dot`: the same fp32
    # dots as tl.dot; the constant is built with the module's own name for the language
    import ast

    from feedback.checks import run_check

    t = tree(tmp_path, {"k.py": ALIASED_DOTS})
    _, n, sites = run_check("dot_precision", t)
    assert n == 2 and [s.line for s in sites] == [i for i, ln in enumerate(ALIASED_DOTS.splitlines(), 1)
                                                  if "h = " in ln and "dot(" in ln]
    app = evaluate(LIB["tf32x3-fp32-dot-chains"], report(finding("s", "tl.dot without input_precision")), t)
    assert app.applies, app.reason
    assert run_transform(LIB["tf32x3-fp32-dot-chains"], t, app) == ["k.py"]
    src = (t / "k.py").read_text()
    ast.parse(src)
    assert "é = 1; h = T.dot(s, b, input_precision=FP32_DOT_PRECISION)  # a non-ASCII" in src
    assert "h = dot(h, b, input_precision=FP32_DOT_PRECISION)" in src
    assert "low = dot(a.to(T.bfloat16), b.to(T.bfloat16))\n" in src  # bf16 products: exact, left alone
    assert "FP32_DOT_PRECISION = T.constexpr(" in src and "import triton.language as tl" not in src
    assert run_check("dot_precision", t)[1] == 0
    namespace: dict = {}
    exec(compile(src.split("@triton.jit")[0], "k.py", "exec"), namespace)
    assert namespace["FP32_DOT_PRECISION"].value in ("tf32x3", "ieee")


def test_code_patterns_read_the_language_under_any_name(tmp_path):
    # the same kernels written with `import triton.language as T` match the patterns written for `tl.`
    spelled = {"d.py": V_TILED.replace("tl.", "T.")}
    for pid, rep in (("fuse-v-tiles", report(metrics("d.decode.bench", bandwidth_vs_copy=0.22))),
                     ("reciprocal-rsqrt", report(metrics("d.bench", bandwidth_vs_copy=0.3))),
                     ("tf32x3-fp32-dot-chains", report(finding("s.static", "tl.dot without input_precision")))):
        files = spelled if pid != "tf32x3-fp32-dot-chains" else {"k.py": "acc = T.dot(a, b)\n"}
        app = evaluate(LIB[pid], rep, tree(tmp_path / pid, files))
        assert app.applies and app.code_matches, (pid, app.reason)


def test_the_gil_playbook_reads_a_pybind11_binding_that_keeps_the_gil(tmp_path):
    # a C++ extension's bound function keeps the GIL unless a call guard (or a scoped release) gives it up
    evidence = report(metrics("e.events", heartbeat_max_gap_ms=20.0))
    held = 'PYBIND11_MODULE(ext, m) {\n  m.def("transfer", &transfer, "copy the pages");\n}\n'
    released = held.replace('"copy the pages"', "py::call_guard<py::gil_scoped_release>()")
    app = evaluate(LIB["release-gil-native-calls"], evidence, tree(tmp_path / "held", {"csrc/ext.cpp": held}))
    assert app.applies and [m.file for m in app.code_matches] == ["csrc/ext.cpp"], app.reason
    assert not evaluate(LIB["release-gil-native-calls"], evidence,
                        tree(tmp_path / "released", {"csrc/ext.cpp": released})).applies


def test_the_argument_order_transform_parses_only_the_matched_files_where_the_check_kept_digests(tmp_path,
                                                                                                  monkeypatch):
    # the runner's check keeps a digest of every file; the transform then parses the files it edits and
    # reads every other file's definitions and calls from those digests, and fixes the same call
    import playbooks.transforms as transforms
    from feedback.checks import DigestStore, run_check

    files = {"kern/__init__.py": "", "kern/ops.py": "def mix(q, k, o):\n    return q\n",
             "kern/use.py": "from kern.ops import mix\n\n\ndef use(q, k, o):\n    mix(q, k, o)\n",
             **{f"kern/more{i}.py": f"def helper{i}(a, b):\n    return a\n" for i in range(5)},
             "app/__init__.py": "", "app/run.py": "from kern.ops import mix\n\n\ndef go(q, k, o):\n    mix(k, q, o)\n"}
    t = tree(tmp_path, files)
    store = tmp_path / "digests"
    sites = run_check("argument_order", t, store=DigestStore(store))[2]
    rep = report(ProbeResult(probe="s.static.argument_order", status=Status.failed, findings=[
        Finding(message=s.message, location=Location(file=s.file, condition=f"line {s.line}"), failed=True)
        for s in sites]))
    app = evaluate(LIB["restore-argument-order"], rep, t)
    parsed: list[str] = []
    real = transforms.parse
    monkeypatch.setattr(transforms, "parse", lambda src, rel: parsed.append(rel) or real(src, rel))
    assert run_transform(LIB["restore-argument-order"], t, app, knobs={"digest_store": str(store)}) == ["app/run.py"]
    assert parsed == ["app/run.py"] and "    mix(q, k, o)\n" in (t / "app" / "run.py").read_text()
    # without a store every file is parsed (and only its digest kept), with the same result
    (t / "app" / "run.py").write_text(files["app/run.py"])
    parsed.clear()
    assert run_transform(LIB["restore-argument-order"], t, app) == ["app/run.py"]
    assert len(parsed) == len(files) and "    mix(q, k, o)\n" in (t / "app" / "run.py").read_text()


UNKNOWN_DTYPE_DOTS = """import triton
import triton.language as tl


@triton.jit
def kern(a_ptr, b_ptr, q_ptr, N: tl.constexpr):
    a = tl.load(a_ptr + tl.arange(0, N))
    b = tl.load(b_ptr + tl.arange(0, N))
    acc = tl.dot(a, b)
    qa = tl.load(q_ptr + tl.arange(0, N))
    wide = tl.dot(qa, qa, out_dtype=tl.int32)
    lo = a.to(tl.bfloat16)
    half = tl.dot(lo, tl.trans(lo))
    return acc + wide + half
"""


def test_the_precision_fix_stays_on_the_files_the_findings_name_and_off_dots_that_are_not_fp32(tmp_path):
    # a count over its threshold is located at the probe's paths (a glob): it names no file, so the dots of
    # every other file the pattern matches are not the fix's business
    fp32 = "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef k(x):\n" \
           "    h = tl.zeros([16, 16], dtype=tl.float32)\n    return tl.dot(h, h)\n"
    t = tree(tmp_path / "a", {"pkg/chain.py": fp32, "pkg/other.py": UNKNOWN_DTYPE_DOTS})
    pb = LIB["tf32x3-fp32-dot-chains"]
    failing = ProbeResult(probe="static.dot_precision", status=Status.failed, findings=[
        Finding(message="tl.dot(h, h): fp32 operands and no input_precision",
                location=Location(file="pkg/chain.py", condition="line 8")),
        Finding(message="implicit_precision = 1 violates <= 0", location=Location(file="pkg/**/*.py"))])
    app = evaluate(pb, report(failing), t, {"static.dot_precision": ["pkg/**/*.py"]})
    assert app.applies and {m.file for m in app.code_matches} == {"pkg/chain.py"}, app.code_matches
    assert run_transform(pb, t, app) == ["pkg/chain.py"]
    assert "input_precision" not in (t / "pkg" / "other.py").read_text()
    # evidence that names no file (a merge's error growth): the dots of unknown dtype in the covered file get a
    # precision; an int8 product (an integer accumulator) and a bf16 one (operands cast to bf16) never do
    t = tree(tmp_path / "b", {"pkg/other.py": UNKNOWN_DTYPE_DOTS})
    app = evaluate(pb, report(metrics("x.cp.merge", error_growth=40.0)), t, {"x.cp.merge": ["pkg/other.py"]})
    assert app.applies, app.reason
    assert run_transform(pb, t, app) == ["pkg/other.py"]
    src = (t / "pkg" / "other.py").read_text()
    assert "acc = tl.dot(a, b, input_precision=FP32_DOT_PRECISION)" in src
    assert "tl.dot(qa, qa, out_dtype=tl.int32)\n" in src and "tl.dot(lo, tl.trans(lo))\n" in src
