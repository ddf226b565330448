"""The offline policy's choice on a repository it did not write: evidence bound to the files a probe is
about, and a fix for a failing probe before an optimisation a passing one suggests.

The case is the one the flash-linear-attention 0.5.2 tree produced on an H200 (bench/RESULTS.md,
2026-12-02): its context-parallel merge fails (a tf32 dot chain) while the GPU microbenchmarks of
other kernels read far below copy bandwidth, and the repository holds ``1 / tl.sqrt`` in norm
modules none of those benchmarks runs.  Unbound, the policy rewrote the norms first.
"""

from __future__ import annotations

import git
import yaml

from feedback.models import FeedbackReport, Finding, Location, Metric, ProbeResult, Status
from infra_agent.agent import AgentState
from infra_agent.backends.offline import OfflineBackend
from infra_agent.workspace import GitWorkspace
from playbooks.model import evaluate, load_library

ACTOR = git.Actor("t", "t@t")
MANIFEST = """
schema_version: 1
name: ext
python_path: ["."]
probes:
  - {id: ext.static.dots, kind: static, check: dot_precision, params: {paths: [pkg/cp]},
     covers: {files: ["pkg/cp/*.py"]}}
  - {id: ext.decode.bench, kind: microbench, entry: "pkg.bench:decode", covers: {files: ["pkg/decode/*.py"]}}
"""
FILES = {
    "pkg/__init__.py": "",
    "pkg/bench.py": "def decode(ctx):\n    pass\n",
    "pkg/cp/merge.py": ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                        "def merge(a, b, o, N: tl.constexpr):\n    r = tl.arange(0, N)\n"
                        "    b_a = tl.load(a + r[:, None] * N + r[None, :]).to(tl.float32)\n"
                        "    b_b = tl.load(b + r[:, None] * N + r[None, :]).to(tl.float32)\n"
                        "    tl.store(o + r[:, None] * N + r[None, :], tl.dot(b_a, b_b))\n"),
    "pkg/decode/step.py": "import triton.language as tl\n\n\ndef step(x):\n    return x * 2\n",
    "pkg/norms/rms.py": "import triton.language as tl\n\n\ndef rms(x, v):\n    return 1 / tl.sqrt(v + 1e-6)\n",
}


def _repo(tmp_path, files=FILES):
    root = tmp_path / "ext"
    for rel, text in {**files, "infra-agent.yaml": MANIFEST}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add(A=True)
    repo.index.commit("base", author=ACTOR, committer=ACTOR)
    return root


def _report() -> FeedbackReport:
    dots = ProbeResult(probe="ext.static.dots", status=Status.failed, findings=[Finding(
        message="tl.dot without input_precision: fp32 operands default to tf32",
        location=Location(file="pkg/cp/merge.py", symbol="merge"))])
    bench = ProbeResult(probe="ext.decode.bench", status=Status.passed,
                        metrics={"bandwidth_vs_copy": Metric(value=0.11), "step_us": Metric(value=8.8)})
    return FeedbackReport(target="ext", candidate="base", results=[dots, bench])


def test_evidence_about_one_kernel_is_no_reason_to_edit_another(tmp_path):
    root = _repo(tmp_path)
    rsqrt = load_library()["reciprocal-rsqrt"]
    covers = {"ext.static.dots": ["pkg/cp/*.py"], "ext.decode.bench": ["pkg/decode/*.py"]}
    unbound = evaluate(rsqrt, _report(), root)
    assert unbound.applies and unbound.code_matches[0].file == "pkg/norms/rms.py"  # what the policy did before
    bound = evaluate(rsqrt, _report(), root, covers)
    assert not bound.applies
    assert "ext.decode.bench" in bound.reason and "pkg/decode/*.py" in bound.reason
    assert "pkg/norms/rms.py" in bound.reason  # and where the pattern matched instead
    tf32 = evaluate(load_library()["tf32x3-fp32-dot-chains"], _report(), root, covers)
    assert tf32.applies and tf32.for_a_failure and tf32.evidence_probes == ["ext.static.dots"]
    assert [m.file for m in tf32.code_matches] == ["pkg/cp/merge.py"]


def test_a_division_in_the_slow_kernel_itself_is_still_found(tmp_path):
    files = {**FILES, "pkg/decode/step.py": "import triton.language as tl\n\n\ndef step(x, v):\n"
                                            "    return x / tl.sqrt(v)\n"}
    root = _repo(tmp_path, files)
    covers = {"ext.static.dots": ["pkg/cp/*.py"], "ext.decode.bench": ["pkg/decode/*.py"]}
    app = evaluate(load_library()["reciprocal-rsqrt"], _report(), root, covers)
    assert app.applies and not app.for_a_failure
    assert [m.file for m in app.code_matches] == ["pkg/decode/step.py"]  # the norms elsewhere are left alone


def test_only_the_evidence_about_the_matched_code_is_cited(tmp_path):
    """fla 0.6.0 on an H200 (2026-12-03): the rewrite of a division in the decode kernel was proposed citing
    the merge and prefill benchmarks too, which time other kernels; what is cited is what is about the code."""
    files = {**FILES, "pkg/decode/step.py": "import triton.language as tl\n\n\ndef step(x, v):\n"
                                            "    return x / tl.sqrt(v)\n"}
    root = _repo(tmp_path, files)
    report = _report()
    report.results[0] = ProbeResult(probe="ext.static.dots", status=Status.failed,
                                    metrics={"bandwidth_vs_copy": Metric(value=0.14)})  # a slow merge, failing
    covers = {"ext.static.dots": ["pkg/cp/*.py"], "ext.decode.bench": ["pkg/decode/*.py"]}
    app = evaluate(load_library()["reciprocal-rsqrt"], report, root, covers)
    assert app.applies and [m.file for m in app.code_matches] == ["pkg/decode/step.py"]
    assert app.evidence_probes == ["ext.decode.bench"]
    assert all("ext.decode.bench" in e for e in app.evidence) and not any("ext.static" in e for e in app.evidence)
    assert not app.for_a_failure  # the failing probe is about another kernel: this is no fix for it
    unbound = evaluate(load_library()["reciprocal-rsqrt"], report, root)
    assert set(unbound.evidence_probes) == {"ext.static.dots", "ext.decode.bench"}  # without covers, all of it


def test_the_policy_answers_the_failing_probe_first_and_reads_covers_from_the_manifest(tmp_path):
    files = {**FILES, "pkg/decode/step.py": "import triton.language as tl\n\n\ndef step(x, v):\n"
                                            "    return x / tl.sqrt(v)\n"}
    root = _repo(tmp_path, files)
    ws = GitWorkspace.external(root, "policy")
    try:
        backend = OfflineBackend(ws)
        state = AgentState(goal="g", messages=[], feedback=_report(), tree=ws.baseline().path, attempts=[], step=0)
        first = backend.next_action(state)
        assert first.name == "propose_patch" and first.args["playbook_id"] == "tf32x3-fp32-dot-chains"
        assert "pkg/cp/merge.py" in first.args["diff"] and "pkg/norms" not in first.args["diff"]
        second = backend.next_action(state)  # then the optimisation, in the kernel the benchmark measured
        assert second.args["playbook_id"] == "reciprocal-rsqrt"
        assert "pkg/decode/step.py" in second.args["diff"] and "pkg/norms" not in second.args["diff"]
    finally:
        ws.close()


TILED = '''import torch
import triton
import triton.language as tl


@triton.jit
def step_kernel(q, h, o, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    o_k, o_v = tl.arange(0, K), i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + i_n * K + o_k).to(tl.float32)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
    b_h = tl.load(h + i_n * K * V + o_k[:, None] * V + o_v[None, :])
    tl.store(o + i_n * V + o_v, tl.sum(b_h * b_q[:, None], axis=0))


def step(q, h):
    N, K = q.shape
    V = h.shape[-1]
    BV = 8
    o = torch.empty(N, V, device=q.device)
    step_kernel[(triton.cdiv(V, BV), N)](q, h, o, K=K, V=V, BV=BV)
    return o
'''
NORM = '''import triton
import triton.language as tl


@triton.jit
def l2norm_kernel(x, y, D: tl.constexpr):
    i_t = tl.program_id(0)
    b_x = tl.load(x + i_t * D + tl.arange(0, D)).to(tl.float32)
    tl.store(y + i_t * D + tl.arange(0, D), b_x * tl.rsqrt(tl.sum(b_x * b_x) + 1e-6))
'''


def test_a_proposal_cites_the_code_its_diff_changes_and_the_evidence_about_it(tmp_path):
    """fla 0.6.0 on an H200 (2026-12-03): the tile widening rewrote only the decode kernel's launch, but its
    hypothesis cited the prefill benchmark's bandwidth and two l2norm kernels (the pattern matched there
    too, in files the prefill benchmark covers, and the transform left them alone). A proposal cites the
    code its diff changes and the evidence of the probes about those files."""
    files = {**FILES, "pkg/decode/step.py": TILED, "pkg/norms/l2.py": NORM}
    root = _repo(tmp_path, files)
    (root / "infra-agent.yaml").write_text(
        MANIFEST + '  - {id: ext.prefill.bench, kind: microbench, entry: "pkg.bench:decode", '
                   'covers: {files: ["pkg/norms/*.py"]}}\n')
    repo = git.Repo(root)
    repo.git.add(A=True)
    repo.index.commit("prefill bench", author=ACTOR, committer=ACTOR)
    report = FeedbackReport(target="ext", candidate="base", results=[
        ProbeResult(probe="ext.prefill.bench", status=Status.passed, metrics={"bandwidth_vs_copy": Metric(value=0.07)}),
        ProbeResult(probe="ext.decode.bench", status=Status.passed, metrics={"bandwidth_vs_copy": Metric(value=0.11)})])
    ws = GitWorkspace.external(root, "cite")
    try:
        backend = OfflineBackend(ws, {"fuse-v-tiles": load_library()["fuse-v-tiles"]})
        state = AgentState(goal="g", messages=[], feedback=report, tree=ws.baseline().path, attempts=[], step=0)
        action = backend.next_action(state)
        assert action.name == "propose_patch" and action.args["playbook_id"] == "fuse-v-tiles", action.args
        assert "pkg/decode/step.py" in action.args["diff"] and "pkg/norms" not in action.args["diff"]
        evidence, code = action.args["hypothesis"].split(". Evidence: ")[1].split(". Code: ")
        assert "ext.decode.bench.bandwidth_vs_copy" in evidence and "ext.prefill" not in evidence
        assert "pkg/decode/step.py" in code and "pkg/norms" not in code
        app = evaluate(load_library()["fuse-v-tiles"], report, ws.baseline().path,
                       {"ext.decode.bench": ["pkg/decode/*.py"], "ext.prefill.bench": ["pkg/norms/*.py"]})
        assert {m.file for m in app.code_matches} == {"pkg/decode/step.py", "pkg/norms/l2.py"}  # what it matched
        assert app.evidence_by == ["ext.prefill.bench", "ext.decode.bench"]
    finally:
        ws.close()


SCALE = '''import torch
import triton
import triton.language as tl


@triton.jit
def _axpy_kernel(x, y, out, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out + offs, alpha * tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)


def axpy(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    n = x.numel()
    _axpy_kernel[(triton.cdiv(n, 128),)](x, y, out, n, alpha, BLOCK=128)
    return out
'''
SCALE_TEST = '''import torch
from mykern.axpy import axpy


def test_axpy():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter takes CPU tensors, a GPU its own
    x, y = torch.randn(1000, device=device), torch.randn(1000, device=device)
    want = (2.5 * x.double() + y.double()).float()
    torch.testing.assert_close(axpy(x, y, 2.5), want)
'''


# torchao's roofline: the backward GEMMs pass (M, N, K) in other orders on purpose; init tolerates those calls
ROOFLINE = '''def gemm_time(M, N, K):
    return M * K + K * N + M * N


def backward_time(M, N, K):
    return gemm_time(M, K, N) + gemm_time(K, N, M)
'''


def _init_change_and_run(tmp_path, files: dict[str, str], rel: str, changed: str):
    """A fresh repository of ``files`` through the real CLI: `init` writes the manifest, a first commit holds the
    tree, a second changes ``rel`` to ``changed``, and an offline session runs on it.  (the repository, the
    manifest `init` wrote, the session's JSON summary)."""
    import json
    import subprocess
    import sys

    root = tmp_path / "mine"
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    cli = [sys.executable, "-m", "infra_agent"]
    subprocess.run([*cli, "init", str(root)], check=True, capture_output=True, timeout=120)
    written = yaml.safe_load((root / "infra-agent.yaml").read_text())
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add(A=True)
    repo.index.commit("base", author=ACTOR, committer=ACTOR)
    (root / rel).write_text(changed)
    repo.git.add(A=True)
    repo.index.commit("a change", author=ACTOR, committer=ACTOR)
    env = {k: v for k, v in __import__("os").environ.items() if k != "OPENAI_API_KEY"}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    run = subprocess.run([*cli, "run", "--target", str(root), "--backend", "offline", "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return repo, written, json.loads(run.stdout)


def test_a_repository_of_ones_own_from_init_to_a_held_fix(tmp_path):
    """A fresh repository with a Triton kernel, through the real CLI: `init` writes the manifest; a later commit
    swaps two pointers at the kernel's launch; the offline session restores the order, the kernel's own test
    passes on the candidate, and the gate holds the launch change for a person (numerics).  The calls that the
    tree made in another order on purpose when `init` ran are tolerated, and the fix leaves them alone."""
    files = {"mykern/__init__.py": "", "mykern/axpy.py": SCALE, "tests/test_axpy.py": SCALE_TEST,
             "mykern/roofline.py": ROOFLINE}
    swapped = SCALE.replace("](x, y, out,", "](y, x, out,")
    repo, _, summary = _init_change_and_run(tmp_path, files, "mykern/axpy.py", swapped)
    assert set(summary["failing_before"]) >= {"static.argument_order", "tests.axpy"}
    (attempt,) = summary["attempts"]
    assert (attempt["playbook"], attempt["verdict"], attempt["decision"]) == ("restore-argument-order", "better",
                                                                              "held")
    assert "static.argument_order" in attempt["reason"] and "tests.axpy" in attempt["reason"]
    # the code cited is the call the fix changes, not the first line of the file the pattern matched
    code = attempt["hypothesis"].split("Code: ", 1)[1]
    assert code.startswith("mykern/axpy.py:") and "_axpy_kernel[" in code and "full_like" not in code, code
    assert any("ast.kernel-launch" in r and "mykern/axpy.py" in r for r in attempt["risk"]), attempt["risk"]
    fixed = repo.git.show(f"{attempt['branch']}:mykern/axpy.py")
    assert "](x, y, out, n, alpha, BLOCK=128)" in fixed
    assert repo.git.show("main:mykern/axpy.py") == swapped.rstrip("\n")  # main untouched
    assert repo.git.show(f"{attempt['branch']}:mykern/roofline.py") == ROOFLINE.rstrip("\n")  # tolerated: as it was


RMS = '''import torch
import triton
import triton.language as tl


@triton.jit
def _rms_kernel(x, out, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        o = start + tl.arange(0, BLOCK)
        v = tl.load(x + row * n_cols + o, mask=o < n_cols, other=0.0)
        acc += v * v
    var = tl.sum(acc, axis=0) / n_cols
    for start in range(0, n_cols, BLOCK):
        o = start + tl.arange(0, BLOCK)
        v = tl.load(x + row * n_cols + o, mask=o < n_cols, other=0.0)
        tl.store(out + row * n_cols + o, v * tl.rsqrt(var + eps), mask=o < n_cols)


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    _rms_kernel[(x.shape[0],)](x, out, x.shape[1], eps, BLOCK=64)
    return out
'''
RMS_TEST = '''import torch
from mykern.rms import rms


def test_rms():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 200, device=device)
    want = (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).float()
    torch.testing.assert_close(rms(x), want)
'''
# another kernel file with a division by a square root in its loop, there when `init` ran: tolerated, left alone
SCALED = '''import triton
import triton.language as tl


@triton.jit
def _scaled_kernel(x, s, out, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        o = start + tl.arange(0, BLOCK)
        tl.store(out + o, tl.load(x + o, mask=o < n) / tl.sqrt(tl.load(s)), mask=o < n)
'''


def test_a_new_division_in_a_kernels_loop_is_answered_in_its_own_file(tmp_path):
    """FlagGems: a commit that divided by tl.sqrt inside a kernel's loop failed the starter's loop-division
    check at the right line, and the offline session found no playbook for it.  Now the reciprocal playbook
    answers the check's (untolerated) finding, in the file it names: the tolerated division of another
    kernel file is left as it was."""
    files = {"mykern/__init__.py": "", "mykern/rms.py": RMS, "tests/test_rms.py": RMS_TEST,
             "mykern/scaled.py": SCALED}
    divided = RMS.replace("v * tl.rsqrt(var + eps)", "v / tl.sqrt(var + eps)")
    repo, written, summary = _init_change_and_run(tmp_path, files, "mykern/rms.py", divided)
    (loops,) = [p for p in written["probes"] if p["id"] == "static.kernel_loop_division"]
    assert [t.split(": ")[:2] for t in loops["params"]["tolerated"]] == [["mykern/scaled.py", "_scaled_kernel"]]
    assert "static.kernel_loop_division" in summary["failing_before"], summary["failing_before"]
    first = summary["attempts"][0]
    assert (first["playbook"], first["verdict"], first["decision"]) == ("reciprocal-rsqrt", "better", "held"), first
    assert "static.kernel_loop_division" in first["reason"]
    fixed = repo.git.show(f"{first['branch']}:mykern/rms.py")
    assert "v * tl.rsqrt(var + eps)" in fixed and "/ tl.sqrt" not in fixed
    assert repo.git.show(f"{first['branch']}:mykern/scaled.py") == SCALED.rstrip("\n")  # tolerated: as it was
    assert repo.git.show("main:mykern/rms.py") == divided.rstrip("\n")  # main untouched
