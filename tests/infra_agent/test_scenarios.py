"""Scenarios: each bundled one is a patch that applies to the clean target and breaks what its
acceptance criteria measure there; the list command; malformed scenario files named clearly."""

from __future__ import annotations

import json
import subprocess
import sys

import git
import pytest

from feedback.harness import judge
from feedback.manifest import load_manifest
from feedback.targets import materialize_bundled
from infra_agent.scenarios import ScenarioError, load_scenarios, resolve, scenarios_dir
from tests.support.toy_agent import env_without_keys


def test_every_bundled_scenario_is_complete_and_its_patch_applies_to_the_clean_target(tmp_path):
    known = load_scenarios()
    assert {"cp-tf32", "gil-kv-transfer"} <= set(known)
    tree = materialize_bundled(tmp_path / "ts")
    repo = git.Repo.init(tree)
    manifest = load_manifest(tree)
    probe_ids = {p.id for p in manifest.probes}
    for sc in known.values():
        repo.git.apply("--check", "--recount", str(sc.patch))
        touched = {line[6:] for line in sc.patch.read_text().splitlines() if line.startswith("+++ b/")}
        assert touched <= set(sc.files), (sc.name, touched, sc.files)
        for c in sc.criteria():
            metric, _, _ = c.parts()
            assert manifest.split_metric(metric) and manifest.split_metric(metric)[0] in probe_ids, (sc.name, c.expr)


@pytest.mark.parametrize("name", ["gil-kv-transfer", "cp-tf32", "kda-decode-tiles"])
def test_a_scenario_breaks_its_acceptance_and_the_clean_target_meets_it(tmp_path, name):
    """What the agent is asked to restore really is broken by the starting change: the criteria fail
    on the defective tree and hold on the clean one, judged by the real harness."""
    (sc,) = resolve(name)
    results = {}
    for label in ("clean", "defective"):
        tree = materialize_bundled(tmp_path / label)
        if label == "defective":
            subprocess.run(["git", "apply", "--recount", str(sc.patch)], cwd=tree, check=True)
        manifest = load_manifest(tree)
        probes = sorted({manifest.split_metric(c.parts()[0])[0] for c in sc.criteria()})
        results[label] = sc.check(manifest, judge(tree, probe_ids=probes, run_all=True, use_cache=False, jobs=2))
    assert all(c.holds for c in results["clean"]), results["clean"]
    assert not all(c.holds for c in results["defective"]), results["defective"]


def test_unknown_and_malformed_scenarios_are_clear_errors(tmp_path):
    with pytest.raises(ScenarioError, match=r"unknown scenario 'nope'; known: .*cp-tf32.*\(or 'all'\)"):
        resolve("nope")
    assert [s.name for s in resolve("all")] == sorted(load_scenarios())
    (tmp_path / "bad.yaml").write_text("name: bad\ndefect: x\nfiles: [a.py]\ngoal: g\nacceptance: [nonsense]\n"
                                       "risk: numerics\n")
    (tmp_path / "bad.patch").write_text("")
    with pytest.raises(ScenarioError, match=r"bad.yaml: not a valid scenario: .*<probe>.<metric> <op> <number>"):
        load_scenarios(tmp_path)
    (tmp_path / "bad.yaml").write_text("name: other\ndefect: x\nfiles: [a.py]\ngoal: g\nacceptance: [p.m <= 1]\n"
                                       "risk: numerics\n")
    with pytest.raises(ScenarioError, match="its name is 'other'"):
        load_scenarios(tmp_path)
    (tmp_path / "bad.yaml").write_text("name: bad\ndefect: x\nfiles: [a.py]\ngoal: g\nacceptance: [p.m <= 1]\n"
                                       "risk: numerics\n")
    (tmp_path / "bad.patch").unlink()
    with pytest.raises(ScenarioError, match="no bad.patch beside it"):
        load_scenarios(tmp_path)
    assert scenarios_dir().name == "scenarios"


def test_the_scenarios_command_lists_defects_files_acceptance_and_risk():
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "scenarios", "--json"], capture_output=True,
                         text=True, timeout=120, env=env_without_keys())
    assert out.returncode == 0, out.stderr
    listed = {s["name"]: s for s in json.loads(out.stdout)}
    assert listed["gil-kv-transfer"]["risk"] == "concurrency" and listed["cp-tf32"]["risk"] == "numerics"
    assert all(s["defect"] and s["files"] and s["acceptance"] and s["goal"] for s in listed.values())
    table = subprocess.run([sys.executable, "-m", "infra_agent.cli", "scenarios"], capture_output=True, text=True,
                           timeout=120, env={**env_without_keys(), "COLUMNS": "100"})
    assert table.returncode == 0 and "gil-kv-transfer" in table.stdout and "--scenario all" in table.stdout
    bad = subprocess.run([sys.executable, "-m", "infra_agent.cli", "run", "--scenario", "nope"], capture_output=True,
                         text=True, timeout=120, env=env_without_keys())
    assert bad.returncode == 2 and "unknown scenario 'nope'" in bad.stderr


def test_a_scenario_met_by_two_held_fixes_together_is_held_for_review_naming_both():
    """A fix held for review is not the next attempt's base: two held fixes may each meet part of the acceptance.
    The outcome names both items; one criterion met by neither is still not solved."""
    from types import SimpleNamespace

    from feedback.manifest import parse_manifest
    from feedback.models import FeedbackReport, Metric, ProbeResult, Status
    from infra_agent.scenarios import Scenario
    from infra_agent.session import scenario_outcome

    manifest = parse_manifest("schema_version: 1\nname: t\nprobes:\n  - {id: w, kind: trace, entry: 'm:f'}\n")
    sc = Scenario(name="two", defect="d", files=["f.py"], goal="g", risk="numerics",
                  acceptance=["w.reads <= 4", "w.divisions <= 0"])

    def rep(reads: float, divisions: float) -> FeedbackReport:
        metrics = {"reads": Metric(value=reads), "divisions": Metric(value=divisions)}
        return FeedbackReport(target="t", candidate="c",
                              results=[ProbeResult(probe="w", status=Status.passed, metrics=metrics)])

    def agent(*held: tuple[int, FeedbackReport]):
        attempts = [SimpleNamespace(decision="held", report=r, review_id=i) for i, r in held]
        return SimpleNamespace(ws=SimpleNamespace(manifest=lambda: manifest), feedback=rep(32, 192), attempts=attempts)

    together = scenario_outcome(agent((3, rep(2, 192)), (4, rep(32, 0))), sc)
    assert together["solved"] == "held for review (items 3, 4 together, each fixing part)", together
    assert [c["held"] for c in together["acceptance"]] == [2, 0] and together["approve"] == [3, 4]
    one = scenario_outcome(agent((3, rep(2, 0))), sc)
    assert one["solved"] == "held for review (item 3)" and one["approve"] == [3]
    part = scenario_outcome(agent((3, rep(2, 192))), sc)
    assert part["solved"] == "no"
