"""Experiment records (atomic, complete) and their replay: pass, a real regression, stale."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from feedback.targets import bundled_package_dir
from infra_agent.experiments import RecordError, junit_xml, load_record, replay
from infra_agent.scenarios import load_scenarios

REPO = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = sorted((REPO / "experiments").glob("*.yaml"))


def _record_of(scenario: str) -> pathlib.Path:
    return next(p for p in COMMITTED if load_record(p).scenario == scenario)


def test_the_committed_records_are_valid_and_real():
    """A full offline run of the scenarios: each scenario's attempts judged better (accepted, or held
    for the risk the scenario carries, at least one held), by the probes its acceptance reads, with
    the judges' hashes recorded; the trajectory path portable."""
    scenarios = load_scenarios()
    recs = [load_record(p) for p in COMMITTED]
    assert {r.scenario for r in recs} == set(scenarios), "the records of a run of every scenario are committed"
    for name, sc in scenarios.items():
        mine = [r for r in recs if r.scenario == name]
        held = [r for r in mine if r.decision.status == "held"]
        assert held and all(any(r.startswith(sc.risk) for r in rec.risk) for rec in held), [r.risk for r in held]
        acceptance_probes = {c.parts()[0].rsplit(".", 1)[0] for c in sc.criteria()}
        assert {p.id for rec in mine for p in rec.probes} >= acceptance_probes
        for rec in mine:
            assert rec.backend == "offline" and rec.base.kind == "bundled" and rec.base.scenario == sc.name
            assert rec.playbook and rec.verdict == "better" and rec.decision.status in ("held", "accepted")
            assert rec.trajectory and not rec.trajectory.startswith("/")
            assert "infra-agent.yaml" in rec.judges and any(p.startswith("target_stack/probes/") for p in rec.judges)


def _modified_bundle(tmp_path: pathlib.Path, old: str, new: str, file: str = "ops/kda/cp.py") -> pathlib.Path:
    """A copy of the target_stack package with one edit, importable ahead of the installed one."""
    root = tmp_path / "bundle"
    shutil.copytree(bundled_package_dir(), root / "target_stack",
                    ignore=shutil.ignore_patterns("__pycache__", ".infra-agent"))
    path = root / "target_stack" / file
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return root


def _replay_with(bundle: pathlib.Path | None, record: pathlib.Path, junit: pathlib.Path):
    env = dict(os.environ)
    if bundle is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(bundle), str(REPO)])
    return subprocess.run([sys.executable, "-m", "infra_agent.cli", "replay", str(record), "--junit", str(junit)],
                          capture_output=True, text=True, env=env, cwd=bundle or REPO)


def test_replay_passes_on_this_tree(tmp_path):
    result = replay(_record_of("cp-tf32"))
    assert result.status == "pass", result.reason


def test_replay_catches_the_fix_reverted_in_the_tree(tmp_path):
    # the host side of the fix: merge precision resolved by policy; reverted here to a hard-coded tf32
    bundle = _modified_bundle(tmp_path,
                              'precision = resolve_dot_precision(merge_precision, q.device, "merge_precision")',
                              'precision = "tf32"')
    out = _replay_with(bundle, _record_of("cp-tf32"), tmp_path / "j.xml")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "regressed" in out.stdout and "kda.cp.merge was pass, now fail" in out.stdout
    xml = (tmp_path / "j.xml").read_text()
    assert 'failures="1"' in xml and "<failure" in xml


def test_replay_reports_a_record_that_no_longer_applies_as_stale(tmp_path):
    bundle = _modified_bundle(tmp_path, "b_hl = tl.load(h_local", "b_local = tl.load(h_local")
    out = _replay_with(bundle, _record_of("cp-tf32"), tmp_path / "j.xml")
    assert out.returncode == 0, out.stdout + out.stderr  # stale is not a regression ...
    assert "stale" in out.stdout and "no longer applies" in out.stdout and "pass exp-" not in out.stdout
    assert "<error" in (tmp_path / "j.xml").read_text()  # ... but never reported as passed


def test_garbage_records_are_stale_with_a_reason(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("id: [unclosed\n")
    with pytest.raises(RecordError, match="not a valid experiment record"):
        load_record(bad)
    r = replay(bad)
    assert r.status == "stale" and "not a valid experiment record" in r.reason
    assert "<error" in junit_xml([r])


WRITER = textwrap.dedent("""
    import sys, yaml
    from infra_agent.experiments import load_record, write_record
    rec = load_record(sys.argv[1])
    i = 0
    while True:
        rec = rec.model_copy(update={"id": f"exp-k-{i % 3}", "hypothesis": "h" * 300_000 + str(i)})
        write_record(sys.argv[2], rec)
        print(i, flush=True)
        i += 1
""")


def test_a_process_killed_while_writing_records_leaves_only_complete_ones(tmp_path):
    out_dir = tmp_path / "exp"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(_record_of("cp-tf32")), str(out_dir)],
                            stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    while int(proc.stdout.readline() or -1) < 12 and time.time() - t0 < 60:
        pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    records = sorted(out_dir.glob("*.yaml"))
    assert len(records) == 3
    for path in records:
        rec = load_record(path)  # complete and valid, never half written
        assert len(rec.hypothesis) > 300_000


def test_a_replayed_slowdown_counts_only_when_a_second_side_by_side_run_confirms_it():
    from feedback.models import MetricDelta, ProbeComparison
    from infra_agent.experiments import _confirm

    def comp(verdict: str) -> ProbeComparison:
        return ProbeComparison(probe="p.e2e", kind="e2e", baseline="pass", candidate="pass",
                               deltas=[MetricDelta(name="ttft_ms", baseline=10.0, candidate=13.0, verdict=verdict)])

    asked = []
    judged, notes = _confirm([comp("regressed")], lambda ids: asked.append(ids) or [comp("unchanged")])
    assert asked == [["p.e2e"]] and judged[0].deltas[0].verdict == "unchanged" and "not counted" in notes[0]
    judged, notes = _confirm([comp("regressed")], lambda ids: [comp("regressed")])
    assert judged[0].deltas[0].verdict == "regressed" and "counted" in notes[0]
    untouched, notes = _confirm([comp("improved")], lambda ids: pytest.fail("no second run without a slowdown"))
    assert notes == [] and untouched[0].deltas[0].verdict == "improved"
    lost, notes = _confirm([comp("regressed")], lambda ids: [])
    assert lost[0].deltas[0].verdict == "unchanged" and "not counted" in notes[0]


def test_a_replayed_slowdown_counts_only_where_both_runs_agree_on_the_metric():
    from feedback.models import MetricDelta, ProbeComparison, ProbeResult, Status
    from feedback.verdict import replay_regressions
    from infra_agent.experiments import _confirm

    def comp(**verdicts: str) -> ProbeComparison:
        return ProbeComparison(probe="p.e2e", kind="e2e", baseline="pass", candidate="pass", deltas=[
            MetricDelta(name=n, baseline=10.0, candidate=13.0, change=1.3, ci=(1.1, 1.5), noise=0.05, verdict=v)
            for n, v in verdicts.items()])

    # seven noisy serving metrics: the first run trips on TTFT, the second on TPOT: no metric is worse twice
    judged, notes = _confirm([comp(ttft_ms="regressed", tpot_ms="unchanged")],
                             lambda ids: [comp(ttft_ms="unchanged", tpot_ms="regressed")])
    assert [d.verdict for d in judged[0].deltas] == ["unchanged", "unchanged"]
    assert "second side-by-side run only" in judged[0].deltas[1].note and "not counted" in notes[0]
    then = [("e2e", ProbeResult(probe="p.e2e", status=Status.passed))]
    now = [ProbeResult(probe="p.e2e", status=Status.passed)]
    assert replay_regressions(then, now, [], against_base=judged)[0] == []
    # the same metric worse twice: counted, and named
    judged, notes = _confirm([comp(ttft_ms="regressed", tpot_ms="regressed")],
                             lambda ids: [comp(ttft_ms="unchanged", tpot_ms="regressed")])
    assert [d.verdict for d in judged[0].deltas] == ["unchanged", "regressed"]
    assert "tpot_ms worse again in a second: counted" in notes[0]
    assert replay_regressions(then, now, [], against_base=judged)[0]


def test_a_record_kept_in_the_targets_repository_replays_from_a_clone_elsewhere(tmp_path, monkeypatch):
    """CI replays a user's records from its own clone: the recorded repository path is gone there. The base is
    found in the repository the record is kept in (or the current one); a shallow clone without the base
    commit is stale, and says so."""
    import git

    from tests.support.toy_agent import ACTOR, FIX, make_toy, proposed_session

    mono = make_toy(tmp_path / "engine")
    repo = git.Repo(mono)
    ws, _ = proposed_session(mono, "rec", "fix", FIX, monkeypatch)
    (record,) = sorted(ws.state.experiments.glob("*.yaml"))
    rec = load_record(record)
    assert (rec.base.kind, rec.base.commit) == ("git", repo.head.commit.hexsha)
    (mono / "experiments").mkdir()
    shutil.copy(record, mono / "experiments" / record.name)
    repo.git.add(A=True)
    repo.index.commit("the record, kept", author=ACTOR, committer=ACTOR)
    clone = tmp_path / "ci" / "checkout"
    git.Repo.clone_from(mono, clone)
    shutil.rmtree(mono)  # the recorded repository is not on the machine that replays
    monkeypatch.chdir(tmp_path)  # the clone is found through the record's own folder
    r = replay(clone / "experiments" / record.name)
    assert r.status == "pass", r
    assert any(d.startswith(f"base {rec.base.commit[:12]} found in {clone.resolve()}") for d in r.details), r.details
    # a session judged by a manifest not yet committed records its path in the working tree; the same path in
    # the clone judges the replay
    from infra_agent.experiments import _manifest_here

    uncommitted = rec.model_copy(update={"manifest": str(mono / "infra-agent.yaml")})
    assert _manifest_here(uncommitted, clone.resolve()) == str(clone.resolve() / "infra-agent.yaml")
    shallow = tmp_path / "ci" / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", clone.resolve().as_uri(), str(shallow)], check=True)
    monkeypatch.chdir(shallow)
    r = replay(shallow / "experiments" / record.name)
    assert r.status == "stale" and "a shallow clone: fetch its history" in r.reason, r
    assert f"{mono} (gone)" in r.reason
