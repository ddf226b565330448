"""Experiment records: one YAML file per attempt, written atomically; and their replay.

A record says how to rebuild the base tree, what was changed (the diff), which probes judged it
with what result, and what was decided.  ``infra-agent replay`` rebuilds the base, applies the
diff, re-runs the recorded probes and compares: correctness verdicts must match, performance
verdicts must agree within noise, acceptance criteria must still hold.  A record ends ``pass``,
``regressed`` or ``stale`` (the base cannot be rebuilt, or the diff no longer applies), each with
its reason.
"""

from __future__ import annotations

import datetime as _dt
import os
import pathlib
import subprocess
import tempfile
from typing import TYPE_CHECKING, Literal
from xml.sax.saxutils import escape

import yaml
from pydantic import BaseModel, Field, ValidationError

from feedback.manifest import load_yaml
from feedback.models import CriterionResult, ProbeResult
from feedback.verdict import evaluate_acceptance, judged_by_performance, replay_regressions

if TYPE_CHECKING:
    from infra_agent import Workspace
    from infra_agent.agent import Attempt

SCHEMA_VERSION = 1


class Base(BaseModel):
    """How to rebuild the base tree."""

    kind: Literal["bundled", "git"]
    # bundled: the bundled target_stack as installed today, with base_patch applied (a scenario)
    base_patch: str = ""
    scenario: str | None = None
    # git: an exported commit of a repository (``repo``: where it was when recorded; a clone elsewhere, such as
    # CI's, is found by the replay)
    repo: str | None = None
    commit: str | None = None


class Decision(BaseModel):
    status: Literal["accepted", "held", "approved", "rejected", "discarded", "refused", "failed"]
    by: str | None = None
    reason: str = ""
    review_item: int | None = None
    commit: str | None = None
    branch: str | None = None


class ProbeRecord(BaseModel):
    id: str
    kind: str
    result: ProbeResult
    baseline: ProbeResult | None = None  # the same probe on the attempt's baseline, for the report's plots


class ExperimentRecord(BaseModel):
    schema_version: int = SCHEMA_VERSION
    id: str
    time: str
    target: str
    scenario: str | None = None
    base: Base
    hypothesis: str
    playbook: str | None = None
    diff: str
    risk: list[str] = Field(default_factory=list)
    probes: list[ProbeRecord] = Field(default_factory=list)
    acceptance: list[dict] = Field(default_factory=list)
    judges: dict[str, str] = Field(default_factory=dict)  # what judged it: sha256 of the manifest, probes, references
    verdict: str
    decision: Decision
    backend: str
    model: str | None = None
    # the session's trajectory, relative to the state folder (.infra-agent/) of the machine that ran it
    trajectory: str | None = None
    # the manifest that judged it, when it was kept outside the target (replay judges by it again)
    manifest: str | None = None


class RecordError(Exception):
    pass


def _str_presenter(dumper, data):
    if "\n" in data:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(str, _str_presenter)


def write_record(directory: str | pathlib.Path, record: ExperimentRecord) -> pathlib.Path:
    """Write atomically: a killed process leaves the old file or the new one, never half of one."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{record.id}.yaml"
    text = yaml.dump(record.model_dump(mode="json"), Dumper=_Dumper, sort_keys=False, width=110,
                     allow_unicode=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{record.id}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def settle_record(path: str | pathlib.Path, status: str, by: str, reason: str, commit: str | None = None) -> None:
    """A reviewer's decision reaches the attempt's record: approved by / rejected because."""
    path = pathlib.Path(path)
    rec = load_record(path)
    decision = rec.decision.model_copy(update={"status": status, "by": by, "reason": reason,
                                               "commit": commit or rec.decision.commit})
    write_record(path.parent, rec.model_copy(update={"decision": decision}))


def load_record(path: str | pathlib.Path) -> ExperimentRecord:
    path = pathlib.Path(path)
    try:
        return ExperimentRecord.model_validate(load_yaml(path.read_text()))
    except (yaml.YAMLError, ValidationError, TypeError) as exc:
        raise RecordError(f"{path}: not a valid experiment record: {str(exc).splitlines()[0]}") from exc


_DECISIONS = {"accepted": "accepted", "held": "held", "discarded": "discarded"}


def attempt_record(attempt: Attempt, ws: Workspace, base_commit: str, backend: str, model: str | None,
                   trajectory: pathlib.Path) -> ExperimentRecord:
    """The record of one attempt of a session, failures included: what the workspace can rebuild as
    its base, the patch, what judged it and what was decided."""
    kinds = {p.id: p.kind for p in ws.manifest().probes}
    report = attempt.report
    status = _DECISIONS.get(attempt.decision, "refused" if attempt.verdict == "refused" else "failed")
    return ExperimentRecord(
        id=new_id(ws.session, attempt.step), time=now(), target=ws.target_label, scenario=ws.scenario,
        base=Base(**ws.base_spec(base_commit)), hypothesis=attempt.hypothesis, playbook=attempt.playbook,
        diff=attempt.diff, risk=attempt.risk,
        probes=[ProbeRecord(id=r.probe, kind=kinds.get(r.probe, "?"), result=_lean(r),
                            baseline=_lean(base.get(r.probe)))
                for base in [{b.probe: b for b in (report.baseline_results if report else [])}]
                for r in (report.results if report else [])],
        acceptance=[c.model_dump() for c in (report.acceptance if report else [])],
        judges=dict(report.hashes) if report else {},
        verdict=attempt.verdict,
        decision=Decision(status=status, reason=attempt.reason, review_item=attempt.review_id,
                          commit=attempt.commit, branch=attempt.branch),
        backend=backend, model=model, trajectory=ws.state.relative(trajectory),
        manifest=str(ws.manifest_file) if getattr(ws, "manifest_file", None) else None)


def _lean(r: ProbeResult | None) -> ProbeResult | None:
    """A result as a record keeps it: no stdout, the last 1000 characters of stderr."""
    return r.model_copy(update={"stdout": "", "stderr": r.stderr[-1000:]}) if r is not None else None


def new_id(session: str, step: int) -> str:
    return f"exp-{session}-{step:03d}"


def now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


# --- replay ---------------------------------------------------------------------------------------


class ReplayResult(BaseModel):
    record: str
    path: str
    status: Literal["pass", "regressed", "stale"]
    reason: str
    duration_s: float = 0.0
    details: list[str] = Field(default_factory=list)


def _git_apply(tree: pathlib.Path, diff: str, what: str) -> None:
    if not diff.strip():
        return
    proc = subprocess.run(["git", "apply", "--recount", "--unidiff-zero", "--whitespace=nowarn", "-"], cwd=tree,
                          input=diff, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RecordError(f"the {what} no longer applies: " + (proc.stderr.strip().splitlines() or ["?"])[0])


def _holding(base: Base, near: list[pathlib.Path]) -> tuple[pathlib.Path, str | None]:
    """(repository root, a note) of the first repository that holds the base commit: the one recorded, else
    the repository of each folder in ``near`` (the record's own, the current one), with a note saying so: a
    record kept in the target's repository is replayed from any clone of it, wherever it is checked out (a
    session's target is the root of its repository)."""
    from feedback.changes import commit_of, repo_root

    tried: list[str] = []
    seen: set[pathlib.Path] = set()
    recorded = pathlib.Path(base.repo) if base.repo else None
    if recorded is not None and recorded.is_dir() and (root := repo_root(recorded)) is not None:
        if commit_of(root, base.commit or "HEAD"):
            return root, None
        seen.add(root)
        tried.append(f"{recorded} (has no commit {(base.commit or 'HEAD')[:12]})")
    else:
        tried.append(f"{base.repo} (gone)")
    for folder in near:
        root = repo_root(folder) if folder.is_dir() else None
        if root is None or root in seen:
            continue
        seen.add(root)
        if base.commit and commit_of(root, base.commit):
            return root, f"base {base.commit[:12]} found in {root} ({base.repo} is not here)"
        shallow = (root / ".git" / "shallow").is_file()
        tried.append(f"{root} (has no commit {(base.commit or 'HEAD')[:12]}"
                     + ("; a shallow clone: fetch its history" if shallow else "") + ")")
    raise RecordError(f"the base commit {(base.commit or 'HEAD')[:12]} is in none of: {'; '.join(tried)}")


def rebuild_base(base: Base, dest: pathlib.Path, repo: pathlib.Path | None = None) -> pathlib.Path:
    """The base tree written into ``dest``: the bundled target with its scenario's patch, or a commit of the
    target's repository (``repo``: where that repository is here, :func:`_holding`; default: as recorded)."""
    if base.kind == "bundled":
        from feedback.targets import materialize_bundled

        tree = materialize_bundled(dest)
        _git_apply(tree, base.base_patch, "base patch")
        return tree
    from feedback.targets import export_revision

    root = repo if repo is not None else _holding(base, [])[0]
    try:
        return export_revision(root, base.commit or "HEAD", dest)
    except Exception as exc:
        raise RecordError(f"cannot rebuild the base {root}@{base.commit}: {exc}") from exc


def _manifest_here(rec: ExperimentRecord, repo: pathlib.Path | None) -> str | None:
    """The manifest a record was judged by, where it is on this machine: its recorded path, else (a manifest
    in the target's working tree, not yet committed when the session ran) the same path in ``repo``, the
    repository the base was found in."""
    if rec.manifest is None or pathlib.Path(rec.manifest).is_file() or repo is None or not rec.base.repo:
        return rec.manifest
    try:
        here = repo / pathlib.Path(rec.manifest).relative_to(rec.base.repo)
    except ValueError:
        return rec.manifest
    return str(here) if here.is_file() else rec.manifest


def replay(path: str | pathlib.Path, jobs: int = 2) -> ReplayResult:
    import time

    from feedback.harness import judge
    from feedback.manifest import load_manifest

    t0 = time.perf_counter()
    path = pathlib.Path(path)
    try:
        rec = load_record(path)
    except RecordError as exc:
        return ReplayResult(record=path.stem, path=str(path), status="stale", reason=str(exc))
    repo, moved = None, None
    with tempfile.TemporaryDirectory(prefix="infra-agent-replay-") as tmp:
        try:
            if rec.base.kind == "git":  # the base's repository here, looked up once for every tree below
                repo, moved = _holding(rec.base, [path.resolve().parent, pathlib.Path.cwd()])
            tree = rebuild_base(rec.base, pathlib.Path(tmp) / "tree", repo)
            _git_apply(tree, rec.diff, "diff")
            manifest = load_manifest(tree, _manifest_here(rec, repo))
        except Exception as exc:  # noqa: BLE001 - RecordError, ManifestError, OSError: the record is stale
            return ReplayResult(record=rec.id, path=str(path), status="stale", reason=str(exc),
                                duration_s=time.perf_counter() - t0)
        known = {p.id for p in manifest.probes}
        missing = [p.id for p in rec.probes if p.id not in known]
        if missing:
            return ReplayResult(record=rec.id, path=str(path), status="stale",
                                reason=f"the manifest no longer has probe(s) {', '.join(missing)}",
                                duration_s=time.perf_counter() - t0)
        # status probes against their recorded statuses; performance against the base rebuilt beside
        # the candidate, in the same run (the recorded numbers are from another day and machine load)
        perf = [p.id for p in rec.probes if judged_by_performance(p.kind)]
        by_status = [p.id for p in rec.probes if p.id not in perf]
        results, side_by_side, judges, confirmations = [], None, {}, []
        if by_status:
            report = judge(tree, manifest=manifest, probe_ids=by_status, run_all=True, jobs=jobs, use_cache=False)
            results, judges = report.results, {**report.hashes}
        if perf:
            base = rebuild_base(rec.base, pathlib.Path(tmp) / "base", repo)
            report = judge(tree, manifest=manifest, probe_ids=perf, run_all=True, jobs=jobs, use_cache=False,
                           baseline_tree=base, baseline_label="the record's base",
                           baseline_manifest=manifest if rec.manifest else None)
            results, side_by_side, judges = results + report.results, report.comparisons, {**judges, **report.hashes}
            side_by_side, confirmations = _confirm(report.comparisons, lambda ids: judge(
                tree, manifest=manifest, probe_ids=ids, run_all=True, jobs=jobs, use_cache=False, baseline_tree=base,
                baseline_label="the record's base (second run)",
                baseline_manifest=manifest if rec.manifest else None).comparisons)
    regressed, details = replay_regressions([(p.kind, p.result) for p in rec.probes], results,
                                            evaluate_acceptance(manifest, results) if results else [],
                                            against_base=side_by_side,
                                            recorded_acceptance=[CriterionResult.model_validate(a)
                                                                 for a in rec.acceptance] or None)
    details += confirmations
    if moved:
        details.append(moved)
    other = sorted(p for p in rec.judges if p in judges and judges[p] != rec.judges[p])
    if other:  # the verdicts above are today's judges' word on the recorded patch, not the recorded ones'
        details.append(f"judged by other judges than recorded: {len(other)} file(s) changed since "
                       f"({', '.join(other[:4])})")
    reason = "; ".join(regressed) if regressed else f"{len(rec.probes)} probe verdict(s) and acceptance hold"
    return ReplayResult(record=rec.id, path=str(path), status="regressed" if regressed else "pass", reason=reason,
                        details=details, duration_s=time.perf_counter() - t0)


def _confirm(comparisons: list, rerun) -> tuple[list, list[str]]:
    """A performance probe worse than its base in one side-by-side run is run side by side once more,
    and a metric counts as regressed only if that same metric is worse again (a 3-repeat A/A floor on
    a busy 2-core machine is itself noisy, and a serving probe has seven metrics: two runs agreeing on
    one metric are evidence, two runs each tripping on a different one are not).
    (comparisons to judge by, notes)"""
    first = {c.probe: {d.name for d in c.deltas if d.verdict == "regressed"} for c in comparisons}
    worse = [pid for pid, names in first.items() if names]
    if not worse:
        return comparisons, []
    again = {c.probe: c for c in rerun(worse)}
    notes, judged = [], {}
    for pid in worse:
        second = again.get(pid)
        if second is None:  # the second run lost the probe: nothing confirms the first
            notes.append(f"{pid}: worse than its base in a first side-by-side run; no second run: not counted")
            continue
        deltas = []
        for d in second.deltas:
            if d.verdict == "regressed" and d.name not in first[pid]:
                d = d.model_copy(update={"verdict": "unchanged", "note": "worse in the second side-by-side run only"})
            deltas.append(d)
        judged[pid] = second.model_copy(update={"deltas": deltas})
        both = sorted(d.name for d in deltas if d.verdict == "regressed")
        names = ", ".join(sorted(first[pid]))
        notes.append(f"{pid}: {names} worse than its base in a first side-by-side run; "
                     + (f"{', '.join(both)} worse again in a second: counted" if both
                        else "not in a second: not counted"))
    out = []
    for c in comparisons:
        if c.probe in judged:
            out.append(judged[c.probe])
        elif c.probe in worse:  # unconfirmed: shown as measured, not counted
            out.append(c.model_copy(update={"deltas": [
                d.model_copy(update={"verdict": "unchanged", "note": "no second side-by-side run"})
                if d.verdict == "regressed" else d for d in c.deltas]}))
        else:
            out.append(c)
    return out, notes


def junit_xml(results: list[ReplayResult]) -> str:
    fails = sum(r.status == "regressed" for r in results)
    stale = sum(r.status == "stale" for r in results)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuite name="infra-agent-replay" tests="{len(results)}" failures="{fails}" errors="{stale}" '
           f'time="{sum(r.duration_s for r in results):.2f}">']
    for r in results:
        out.append(f'  <testcase classname="experiments" name="{escape(r.record)}" time="{r.duration_s:.2f}">')
        if r.status == "regressed":
            out.append(f'    <failure message="{escape(r.reason, {chr(34): "&quot;"})}">'
                       f'{escape(chr(10).join(r.details))}</failure>')
        elif r.status == "stale":
            out.append(f'    <error message="{escape(r.reason, {chr(34): "&quot;"})}"/>')
        out.append("  </testcase>")
    out.append("</testsuite>")
    return "\n".join(out) + "\n"
