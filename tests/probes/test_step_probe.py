"""The decode step's launch count through the real harness: the same tree counts the same launches on fresh
prompts (unchanged), a patch that keeps the logits right but adds conversions is judged worse by the name of
the function that issues them, and a host read in the graph-captured step fails at its function."""

from __future__ import annotations

from feedback.harness import judge
from feedback.targets import materialize_bundled
from tests.support.trees import mutant as make_mutant

PROBE = "engine.decode_step.launches"
RUNNER = "target_stack/engine/runner.py"
LAYERS = "target_stack/model/layers.py"
# the attention layers' output projection computed in float64 and rounded back: the same logits within fp32,
# two conversions more per attention layer
ROUND_TRIP = ("mix = F.linear(o.reshape(o.shape[0], -1), block.mixer.w_o)[:, None]",
              "mix = F.linear(o.reshape(o.shape[0], -1).double(), block.mixer.w_o.double()).float()[:, None]")
# the static MoE reads its routing on the host (a count of the tokens each expert takes, say, for a log line)
HOST_READ = ("        w, idx = self.route(x2)\n        if kernel_on(x, self.small_batch)",
             "        w, idx = self.route(x2)\n        self.last_top = int(idx.max())\n"
             "        if kernel_on(x, self.small_batch)")



def test_same_tree_same_launches_and_a_round_trip_is_worse_by_function(tmp_path):
    clean = materialize_bundled(tmp_path / "clean")
    again = judge(clean, baseline_tree=clean, probe_ids=[PROBE], use_cache=False, jobs=2)
    (res,) = again.results
    assert res.status.value == "pass", (res.reason, [f.message for f in res.findings])
    assert again.verdict.name == "unchanged", again.verdict.reason
    counted = {d.name: d for c in again.comparisons for d in c.deltas if d.note.startswith("counted")}
    assert counted["launches"].candidate > 20 and counted["host_syncs"].candidate == 0
    # the judged totals unchanged, every function's launches (a part) the same
    assert all(d.verdict == "unchanged" or d.note.startswith("counted: the same") for d in counted.values())
    assert sum(d.note.startswith("counted: the same") for d in counted.values()) > 5
    assert res.metrics["max_rel_err"].value < 1e-4

    mutant = make_mutant(clean, tmp_path / "round-trip", RUNNER, ROUND_TRIP)
    report = judge(mutant, baseline_tree=clean, changed=[RUNNER], probe_ids=[PROBE], use_cache=False, jobs=2)
    (res,) = report.results
    assert res.status.value == "pass", (res.reason, [f.message for f in res.findings])  # the logits are right
    assert report.verdict.name == "worse", report.verdict.reason
    grew = {r.split(" ")[0] for r in report.verdict.regressed}
    site = "target_stack/engine/runner.py:ModelRunner.decode_step"
    assert {f"{PROBE}.conversions", f"{PROBE}.launches", f"{PROBE}.aten_ops"} == grew, grew
    # the function whose own launches grew localises it; nothing else launches more
    lines = [line for c in report.comparisons for line in c.localisation]
    assert len(lines) == 1 and f"{site}.launches" in lines[0] and RUNNER in lines[0], lines
    assert any(f.location.file == RUNNER and f.location.symbol == "ModelRunner.decode_step"
               and "conversion" in f.message for f in res.findings)


def test_a_host_read_in_the_static_step_fails_at_its_function(tmp_path):
    clean = materialize_bundled(tmp_path / "clean")
    mutant = make_mutant(clean, tmp_path / "host-read", LAYERS, HOST_READ)
    report = judge(mutant, baseline_tree=clean, changed=[LAYERS], probe_ids=[PROBE], use_cache=False, jobs=2)
    (res,) = report.results
    assert res.status.value == "fail"
    failed = [f for f in res.findings if "host" in f.message]
    assert failed and all(f.location.file == LAYERS and f.location.symbol == "MoE.forward_static" for f in failed)
    assert res.metrics["host_syncs"].value > 0
    assert report.verdict.name == "incorrect", report.verdict.reason
    assert "reads a tensor on the host" in report.verdict.reason
