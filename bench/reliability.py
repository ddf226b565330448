"""How well the harness holds against candidates and models written to fool it: one table, one JSON.

    python bench/reliability.py [--hostile-examples 60] [--kills 12] [--out bench/out]

Runs every corpus the tests keep, through the real components, and counts what each case ended as:

* reaching the judges (tests/infra_agent/test_tamper.py): patches of the bundled target that import
  references or the harness, patch timers, introspect, write the probes' environment, add
  conftest.py / sitecustomize.py / .pth files: each must be *refused* by the gate;
* the gate corpus (tests/infra_agent/test_gate_corpus.py): real diffs of the bundled target with the
  decision each must get (held for synchronisation, exposure and numerics changes, clean otherwise);
* cheating kernels (tests/feedback/test_adversarial.py): decode kernels that cache, skip work, alias
  an input, lower precision or do less: each must be judged *incorrect* by the harness;
* hostile model output (tests/infra_agent/test_hostile_model.py): the hypothesis test with more
  examples than CI runs; it counts as crashed if the loop raised or wrote outside its worktrees;
* timing cheats (tests/feedback/test_timing.py): ops that cache on a shape, skip work once warm, finish
  on a thread the timer does not wait for, replace the clock, slow the harness's own clock, or return
  a lazy tensor: each must *fail* its microbenchmark with the reason that names it;
* kill -9 of the harness (tests/feedback/test_lifeline.py): no probe process may survive;
* kill -9 mid-work (tests/infra_agent/test_resume.py, test_review.py): a session killed mid-probe
  resumes from its trajectory, an approval killed mid-validation leaves the item pending and the
  branch unmoved;
* kill -9 of a session at random moments (bench/kill_points.py): nothing left running, the branch
  unmoved, nothing half-written, and ``run --resume`` ends it with the fix.

"caught" means the expected outcome; "missed" a case that ended otherwise; "crashed" a case whose
check itself raised.  The tests stay in CI; this runs them wider and writes the figures down.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _tally(cases: dict, run) -> dict:
    """``run(name, case, tmp)`` -> (expected outcome, what happened) for every case, each in a scratch
    folder of its own; a case whose check raised is counted as crashed, never fatal."""
    rows = {"caught": 0, "missed": [], "crashed": []}
    for name, case in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                ok, what = run(name, case, pathlib.Path(tmp))
            except Exception as exc:  # noqa: BLE001
                rows["crashed"].append(f"{name}: {exc}")
                continue
        if ok:
            rows["caught"] += 1
        else:
            rows["missed"].append(f"{name}: {what}")
    return dict(cases=len(cases), **rows)


def _tamper() -> dict:
    from feedback.manifest import load_manifest
    from infra_agent.gate import assess_text
    from tests.infra_agent.test_tamper import HOSTILE
    from tests.support.bundled import bundled_diff

    def run(name, case, tmp):
        edits, reason = case
        diff, root = bundled_diff(tmp, edits)
        res = assess_text(diff, load_manifest(root), tree=root)
        return res.decision == "refused" and reason in (res.refused or ""), res.decision

    return _tally(HOSTILE, run)


def _gate() -> dict:
    from feedback.manifest import load_manifest
    from infra_agent.gate import assess_text
    from tests.infra_agent.test_gate_corpus import CORPUS
    from tests.support.bundled import bundled_diff, replacing

    def run(name, case, tmp):
        rel, old, new, decision, category = case
        diff, root = bundled_diff(tmp, {rel: replacing(old, new)})
        res = assess_text(diff, load_manifest(root), tree=root)
        ok = res.decision == decision and (category is None or category in res.categories)
        return ok, f"{res.decision} {res.categories}"

    return _tally(CORPUS, run)


def _cheats() -> dict:
    from feedback.harness import judge
    from feedback.targets import materialize_bundled
    from tests.feedback.test_adversarial import CHEATS, apply_cheat

    with tempfile.TemporaryDirectory() as shared:
        shared = pathlib.Path(shared)
        base = materialize_bundled(shared / "base")  # one base, its results cached for every cheat

        def run(name, case, tmp):
            cand = materialize_bundled(tmp / "cand")
            apply_cheat(cand, name)
            rep = judge(cand, baseline_tree=base, probe_ids=["kda.recurrent.correctness", "kda.decode.work"],
                        run_all=True, cache_dir=shared / "cache", same_judges=True)
            name_ = rep.verdict.name if rep.verdict else "no verdict"
            return name_ == "incorrect", name_

        return _tally(CHEATS, run)


def _timing() -> dict:
    from tests.feedback.test_timing import CHEATS, _run, _target

    def run(name, case, tmp):
        op, expected = case
        r = _run(_target(tmp / "t", op))
        messages = " | ".join(f.message for f in r.findings)
        return r.status.value == "fail" and expected in messages, f"{r.status.value}: {messages[:160]}"

    return _tally(CHEATS, run)


def _crashes() -> dict:
    nodes = ["tests/infra_agent/test_resume.py::test_a_session_killed_mid_probe_resumes_from_its_trajectory",
             "tests/infra_agent/test_review.py::"
             "test_an_approval_killed_mid_validation_leaves_the_item_pending_and_the_branch_unmoved",
             "tests/infra_agent/test_review.py::test_a_process_killed_while_writing_the_queue_corrupts_and_loses_nothing"]
    missed = []
    for node in nodes:
        ok, tail = _pytest(node)
        if not ok:
            missed.append(f"{node.rsplit('::', 1)[1]}: {tail}")
    return dict(cases=len(nodes), caught=len(nodes) - len(missed), missed=missed, crashed=[])


def _pytest(node: str, env: dict | None = None, log: pathlib.Path | None = None) -> tuple[bool, str]:
    """Run one test node; with ``log``, its whole output is kept there (a failure's falsifying example)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", node],
                          cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout + proc.stderr)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip().splitlines()[-1:]


def _hostile(examples: int, out: pathlib.Path | None = None) -> dict:
    ok, tail = _pytest("tests/infra_agent/test_hostile_model.py", {"INFRA_AGENT_HOSTILE_EXAMPLES": str(examples)},
                       log=out / "hostile.log" if out else None)
    return dict(cases=examples, caught=examples if ok else 0, missed=[], crashed=[] if ok else tail)


def _lifeline() -> dict:
    ok, tail = _pytest("tests/feedback/test_lifeline.py")
    return dict(cases=4, caught=4 if ok else 0, missed=[] if ok else tail, crashed=[])


def _random_kills(kills: int) -> dict:
    from bench.kill_points import run

    trials = run(kills)["trials"]
    missed = [f"kill at {t['kill_after_s']} s: {'; '.join(t['problems'])}" for t in trials if t["problems"]]
    return dict(cases=kills, caught=kills - len(missed), missed=missed, crashed=[])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hostile-examples", type=int, default=60, help="hypothesis examples of hostile model output")
    ap.add_argument("--kills", type=int, default=12, help="kill -9 of a session at random moments")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"), help="folder for reliability.json")
    args = ap.parse_args()
    areas = [("reaching the judges (refused)", _tamper), ("gate corpus (expected decision)", _gate),
             ("cheating kernels (incorrect)", _cheats),
             ("hostile model output (no crash, no write)",
              lambda: _hostile(args.hostile_examples, pathlib.Path(args.out))),
             ("timing cheats (failed, reason named)", _timing),
             ("kill -9 of the harness (processes reaped)", _lifeline),
             ("kill -9 mid-session, mid-approval, mid-write", _crashes),
             ("kill -9 of a session at random moments", lambda: _random_kills(args.kills))]
    rows = []
    for name, fn in areas:
        t0 = time.perf_counter()
        print(f"  {name} ...", flush=True)
        row = dict(area=name, **fn(), seconds=round(time.perf_counter() - t0, 1))
        rows.append(row)
    print(f"\n{'area':<44} {'cases':>5} {'caught':>6} {'missed':>6} {'crashed':>7} {'time':>7}")
    for r in rows:
        print(f"{r['area']:<44} {r['cases']:>5} {r['caught']:>6} {len(r['missed']):>6} {len(r['crashed']):>7} "
              f"{r['seconds']:>6.0f}s")
        for line in r["missed"] + r["crashed"]:
            print(f"    ! {line}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability.json").write_text(json.dumps(dict(
        date=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), rows=rows), indent=1))
    print(f"\nwritten: {out / 'reliability.json'}")
    return 0 if all(not r["missed"] and not r["crashed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
