"""The counted-work probes through the real harness: the same tree counts the same work on fresh random
inputs (the verdict unchanged), and a change that keeps every result right but makes a kernel move more
bytes is judged worse, by name of the kernel, with no timing at all (the interpreter, any machine)."""

from __future__ import annotations

from feedback.harness import judge
from feedback.targets import materialize_bundled
from tests.support.trees import mutant as make_mutant

CHUNK = "target_stack/ops/kda/chunk.py"
# the prefill's value tile halved: every value tile's program of the state kernel reloads the chunk's keys and gates
NARROW = ("BV = min(block_size(V), 32 if BK > 64 else 64)", "BV = min(block_size(V), 32 if BK > 64 else 64) // 2")



def test_narrower_prefill_tiles_are_more_counted_work_and_the_same_tree_is_unchanged(tmp_path):
    clean = materialize_bundled(tmp_path / "clean")
    again = judge(clean, baseline_tree=clean, probe_ids=["kda.chunk.work"], use_cache=False, jobs=2)
    (res,) = again.results
    assert res.status.value == "pass", (res.reason, [f.message for f in res.findings])
    assert again.verdict.name == "unchanged", again.verdict.reason
    counted = [d for c in again.comparisons for d in c.deltas if d.note.startswith("counted")]
    assert len(counted) > 10 and all(d.verdict == "unchanged" or d.note.startswith("counted: the same")
                                     for d in counted)

    mutant = make_mutant(clean, tmp_path / "mutant", CHUNK, NARROW)
    report = judge(mutant, baseline_tree=clean, changed=[CHUNK], probe_ids=["kda.chunk.work"], use_cache=False,
                   jobs=2)
    (res,) = report.results
    assert res.status.value == "pass"  # the results are still right: only the work grew
    assert report.verdict.name == "worse", report.verdict.reason
    grew = {r.split(" ")[0] for r in report.verdict.regressed}
    assert "kda.chunk.work.loaded_bytes" in grew  # the total over the five kernels
    # the kernel whose own bytes grew localises it, by its finding's file
    lines = [line for c in report.comparisons for line in c.localisation]
    assert any("_kda_state_kernel.loaded_bytes" in line and CHUNK in line for line in lines), lines
    # bound to the kernel in its file: the probe's finding for it
    assert any(f.location.kernel == "_kda_state_kernel" and f.location.file == CHUNK for f in res.findings)


NORM = "target_stack/ops/norm.py"
# the norm divides every element by the root where it multiplied by the reciprocal root: the same result,
# a division per element more
DIVIDE = ("out = xv * tl.rsqrt(tl.sum(xv * xv, axis=0) / N + eps) * wv",
          "out = xv / tl.sqrt(tl.sum(xv * xv, axis=0) / N + eps) * wv")


def test_a_division_per_element_in_the_norm_is_judged_worse_by_name(tmp_path):
    clean = materialize_bundled(tmp_path / "clean")
    mutant = make_mutant(clean, tmp_path / "mutant", NORM, DIVIDE)
    report = judge(mutant, baseline_tree=clean, changed=[NORM], use_cache=False, jobs=2,
                   probe_ids=["model.decode_ops.work"])
    (res,) = report.results
    assert res.status.value == "pass", (res.reason, [f.message for f in res.findings if "per token" not in f.message])
    assert report.verdict.name == "worse", report.verdict.reason
    grew = {r.split(" ")[0] for r in report.verdict.regressed}
    # the norm's own counts on both its paths (gated, and the add-and-norm), and nothing else: every other op
    # did the same work
    assert grew == {"model.decode_ops.work.rms_norm.fdiv", "model.decode_ops.work.rms_norm.residual.fdiv"}, grew
    lines = [line for c in report.comparisons for line in c.localisation]
    # (the root's sqrt, new beside the reciprocal root's rsqrt, is the same kernel's)
    assert lines and all("_rms_norm_kernel." in line and NORM in line for line in lines), lines
    assert any("_rms_norm_kernel.fdiv" in line for line in lines), lines
    assert any(f.location.kernel == "_rms_norm_kernel" and f.location.file == NORM for f in res.findings)
