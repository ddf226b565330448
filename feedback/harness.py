"""Judge a tree: select probes, run the cascade on the candidate (and its baseline), report."""

from __future__ import annotations

import concurrent.futures as cf
import pathlib
import tempfile
import threading
import time
from collections.abc import Callable

from feedback.manifest import MANIFEST_NAME, Manifest, ProbeSpec, load_manifest
from feedback.models import FeedbackReport, ProbeResult, Status
from feedback.report import content_hashes, localise
from feedback.runner import Runner
from feedback.select import FAILING, order, rechecked, select, stages
from feedback.sites import mark_known
from feedback.state import StateDir
from feedback.verdict import compare, evaluate_acceptance, judged_by_performance, repeats_for, verdict


class UnknownProbe(ValueError):
    pass


def resolve_probes(manifest: Manifest, ids: list[str]) -> list[ProbeSpec]:
    known = [p.id for p in manifest.probes]
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise UnknownProbe(f"unknown probe id {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    return [manifest.probe(i) for i in ids]


def judge(
    tree: str | pathlib.Path,
    *,
    manifest: Manifest | None = None,
    probe_ids: list[str] | None = None,
    changed: list[str] | None = None,
    run_all: bool = False,
    baseline_tree: str | pathlib.Path | None = None,
    baseline_label: str | None = None,
    label: str | None = None,
    jobs: int = 2,
    use_cache: bool = True,
    cache_dir: str | pathlib.Path | None = None,
    extra_env: dict[str, str] | None = None,
    on_start: Callable[[list[ProbeSpec]], None] | None = None,
    on_result: Callable[[str, ProbeResult], None] | None = None,
    same_judges: bool = False,
    baseline_manifest: Manifest | None = None,
    executor=None,
    failing: list[ProbeResult] | None = None,
) -> FeedbackReport:
    """Run the probe cascade on ``tree`` (and on ``baseline_tree`` for comparison).

    Probes are the named ones, or those whose covers match ``changed`` (and those of ``failing``, the
    baseline's results, that failed and imported a changed file: :func:`feedback.select.rechecked`),
    or all of them.  Stages run cheapest first (static, correctness, microbench, trace, events, e2e);
    the cascade stops after the first stage in which a candidate probe fails, unless ``run_all`` (with a
    baseline: fails where the baseline's did not; a failure both sides share says nothing of the change,
    and stopping there would leave the candidate's tests unrun on every tree that had one).  A static
    stage does not hold back the stage after it: that one starts beside it, is reported once the static
    stage has passed, and is stopped (killed, dropped) if it fails (:func:`_static_beside`).

    The judges (the manifest, the protected files, the probes' modules) are hashed before and after
    the run: a candidate whose code changed them while its probes ran is judged ``incorrect``, and
    with ``same_judges`` (a candidate patch, which may not touch them) so is one whose judges differ
    from the baseline's.  ``baseline_manifest``: the baseline's judges when they are not the baseline
    tree's own (a manifest kept outside the target, ``--manifest``).

    With a baseline, the performance probes (microbench, e2e) run one at a time, each probe's two
    sides interleaved (:func:`_paired`); the other kinds run ``jobs`` at a time, side after side.
    """
    t0 = time.perf_counter()
    tree = pathlib.Path(tree).resolve()
    manifest = manifest or load_manifest(tree)
    cache_dir = pathlib.Path(cache_dir) if cache_dir else StateDir.of(tree).cache
    runner = Runner(tree, manifest, jobs=jobs, use_cache=use_cache, cache_dir=str(cache_dir), extra_env=extra_env,
                    executor=executor)
    base_runner = None
    if baseline_tree is not None:
        base_manifest = baseline_manifest or _baseline_manifest(pathlib.Path(baseline_tree), manifest)
        base_runner = Runner(baseline_tree, base_manifest, jobs=jobs, use_cache=use_cache, cache_dir=str(cache_dir),
                             extra_env=extra_env, executor=executor)
    if changed is not None and failing is None and base_runner is not None and not probe_ids:
        failing = cached_failures(base_runner, manifest, changed)
    if probe_ids:
        specs, selection = order(resolve_probes(manifest, probe_ids)), "probes " + ", ".join(probe_ids)
    elif changed is not None:
        specs = select(manifest, changed, failing)
        selection = f"{len(specs)} of {len(manifest.probes)} probes cover the {len(changed)} changed file(s)"
        if again := rechecked(manifest, changed, failing):
            selection += (f", {len(again)} of them ({', '.join(sorted(again))}) because they failed on the "
                          f"baseline and import a changed file")
    else:
        specs, selection = order(list(manifest.probes)), "all probes"
    judges_before = content_hashes(tree, manifest, specs)
    if on_start:
        on_start(specs)

    results: list[ProbeResult] = []
    base_results: list[ProbeResult] = []
    stopped = None
    known: set[str] = set()  # probes that fail on the baseline: failing them too is no reason to stop
    cascade = stages(specs)
    i = 0
    while i < len(cascade):
        stage, group = cascade[i]
        ahead = cascade[i + 1] if _beside(cascade, i, runner, base_runner) else None
        done = [(stage, group)] + ([ahead] if ahead else [])
        if base_runner is not None and judged_by_performance(stage):
            cand, base = _paired(runner, base_runner, group, on_result)
            results += cand
            base_results += base
        else:
            cand_done = (lambda r: on_result("candidate", r)) if on_result else None
            base_done = (lambda r: on_result("baseline", r)) if on_result else None
            base_first = None
            if ahead and base_runner is not None:
                # the baseline's static checks first (a second or so): only a failure the baseline does not
                # have stops the stage beside the candidate's
                base_first = base_runner.run(_on(base_runner, group), on_done=base_done)
                known |= {r.probe for r in base_first if r.status in FAILING}
            if ahead:
                first, later = _static_beside(runner, group, ahead[1], cand_done, stop=not run_all, known=known)
                results += first + (later or [])
                if later is None:  # the static stage failed: the stage beside it was stopped, dropped
                    done = done[:1]
            else:
                results += runner.run(group, on_done=cand_done)
            if base_first is not None:
                base_results += base_first
                if len(done) == 2:
                    base_results += base_runner.run(_on(base_runner, done[1][1]), on_done=base_done)
            elif base_runner is not None:
                base_results += base_runner.run(_on(base_runner, group), on_done=base_done)
        known |= {r.probe for r in base_results if r.status in FAILING}
        # a stage stops the cascade when a candidate probe fails that held on the baseline (or has none)
        failing = [st for st, g in done if any(r.status in FAILING and r.probe not in known
                                               for r in results if r.probe in {s.id for s in g})]
        if failing and not run_all:  # a static stage that failed beside the next is first here: it stopped that
            stopped = failing[0] if failing[0] != cascade[-1][0] else None
            break
        i += len(done)

    if base_runner is not None:  # a static check's sites the baseline had too are not what the candidate broke
        results = mark_known(manifest, tree, results, base_runner.tree, base_results)
    judges_changed = [f"{path} changed while the candidate's probes ran"
                      for path in _differing(judges_before, content_hashes(tree, manifest, specs))]
    if same_judges and baseline_tree is not None:
        base_judges = content_hashes(pathlib.Path(baseline_tree).resolve(), base_runner.manifest, specs)
        judges_changed += [f"{path} differs from the baseline's" for path in _differing(base_judges, judges_before)]
    report = FeedbackReport(
        target=manifest.name, candidate=label or str(tree), baseline=baseline_label, selection=selection,
        results=results, baseline_results=base_results,
        comparisons=compare(manifest, results, base_results, localise),
        acceptance=evaluate_acceptance(manifest, results),
        baseline_acceptance=evaluate_acceptance(manifest, base_results) if base_runner is not None else [],
        hashes=judges_before, judges_changed=judges_changed, stopped_at=stopped,
        unexercised=unexercised(manifest, changed, results) if changed is not None and not probe_ids
        and stopped is None else {},
        duration_s=time.perf_counter() - t0,
    )
    if base_runner is not None:
        report.verdict = verdict(report)
    return report


def unexercised(manifest: Manifest, changed: list[str], results: list[ProbeResult]) -> dict[str, str]:
    """The changed Python files (not tests) whose code no probe ran on this machine: only static checks cover
    them, or every probe that would run them skipped (no GPU, a package missing).  A verdict of PASS says
    nothing about them, and the report says so (FlagAttention: a causal-mask change in a kernel every test of
    which needs CUDA read "PASS, 1 of 6 probes skipped")."""
    from feedback.junit import is_test_file

    status = {r.probe: r.status for r in results}
    out: dict[str, str] = {}
    for path in changed:
        if not path.endswith(".py") or is_test_file(path):
            continue
        runners = [p for p in manifest.probes if p.kind != "static" and p.covers.matches(path)]
        if not [p for p in manifest.probes if p.covers.matches(path)]:
            continue  # no probe claims it at all: the selection line says 0 probes
        if not runners:
            out[path] = "only static checks cover it: no probe runs its code"
        elif all(status.get(p.id) == Status.skipped for p in runners):
            out[path] = f"every probe that runs it skipped here ({', '.join(p.id for p in runners[:3])})"
    return out


def _beside(cascade: list[tuple[str, list[ProbeSpec]]], i: int, runner: Runner, base_runner: Runner | None) -> bool:
    """Whether stage ``i`` runs with the next one beside it: a static stage (checks that read source: a second
    or so, no device) need not hold back a correctness stage after it, whose verdicts no load on the machine
    changes.  Not a stage that times anything (microbench, trace, events, e2e: a quiet machine), nor probes
    run elsewhere (an executor: :meth:`Runner.stop` reaches local processes only)."""
    return (cascade[i][0] == "static" and i + 1 < len(cascade) and cascade[i + 1][0] == "correctness"
            and all(r is None or r.executor is None for r in (runner, base_runner)))


def _static_beside(runner: Runner, static: list[ProbeSpec], ahead: list[ProbeSpec],
                   on_done: Callable[[ProbeResult], None] | None,
                   stop: bool, known: set[str] | frozenset[str] = frozenset()
                   ) -> tuple[list[ProbeResult], list[ProbeResult] | None]:
    """Run the static stage and, beside it, the stage after it (:func:`_beside`); the static probes take no
    slot of the other's ``jobs``.  (static results, the other stage's results.)  The other's results are
    reported (``on_done``) once the static stage has passed.  With ``stop``, a failing static stage stops the
    other (its probes killed or never started, nothing of them cached) and its results are dropped, None: the
    cascade ends at the static stage as if it had run alone, only sooner.  A probe in ``known`` (failing on
    the baseline too) failing again stops nothing."""
    held: list[ProbeResult] = []
    lock = threading.Lock()
    released = False

    def ahead_done(result: ProbeResult) -> None:
        with lock:
            if not released:
                held.append(result)
                return
        if on_done:
            on_done(result)

    with cf.ThreadPoolExecutor(max_workers=1) as side:
        later = side.submit(runner.run, ahead, ahead_done)
        try:
            first = runner.run(static, on_done=on_done)
        except BaseException:  # Ctrl-C: the other stage's probes die too
            runner.stop()
            raise
        if stop and any(r.status in FAILING and r.probe not in known for r in first):
            runner.stop()
            try:
                later.result()
            finally:
                runner.resume()
            return first, None
        with lock:
            released = True
        for result in held:
            if on_done:
                on_done(result)
        return first, later.result()


def _differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))


def _has(manifest: Manifest, pid: str) -> bool:
    return any(p.id == pid for p in manifest.probes)


def _on(base_runner: Runner, group: list[ProbeSpec]) -> list[ProbeSpec]:
    """The baseline's own specs of ``group``'s probes (those its manifest has)."""
    return [base_runner.manifest.probe(s.id) for s in group if _has(base_runner.manifest, s.id)]


def _paired(runner: Runner, base_runner: Runner, group: list, on_result) -> tuple[list, list]:
    """The performance probes of a comparison, measured side by side: one probe at a time (no other
    probe shares the machine with a timing), its candidate and baseline repeats interleaved in an ABBA
    order (candidate, baseline, baseline, candidate, ...: a machine that slows down or speeds up during
    the pair weighs on both sides alike, where back-to-back blocks of repeats would put the drift in
    one side), the side that goes first alternating from probe to probe.  A pair comes from the cache
    only whole: a fresh candidate is never held against a baseline timed in another run."""
    cand: list[ProbeResult] = []
    base: list[ProbeResult] = []
    for i, spec in enumerate(group):
        b_spec = base_runner.manifest.probe(spec.id) if _has(base_runner.manifest, spec.id) else None
        sides = [("candidate", runner, spec, cand), ("baseline", base_runner, b_spec, base)]
        if i % 2:
            sides.reverse()
        sides = [s for s in sides if s[2] is not None]
        hits = [r.cached(s) for _, r, s, _ in sides]
        if all(h is not None for h in hits):
            for (side, _, _, out), hit in zip(sides, hits):
                out.append(hit)
                if on_result:
                    on_result(side, hit)
            continue
        runs: list[list[ProbeResult]] = [[] for _ in sides]
        reported = [True] * len(sides)
        done = [False] * len(sides)
        for k in range(max(repeats_for(s.kind, s.repeats) for _, _, s, _ in sides)):
            turn = range(len(sides)) if k % 2 == 0 else reversed(range(len(sides)))
            for j in turn:
                _, r, s, _ = sides[j]
                if done[j] or k >= repeats_for(s.kind, s.repeats):
                    continue
                try:
                    res, ok = r.run_once(s)
                except Exception as exc:  # noqa: BLE001 - the harness never crashes on a probe
                    res, ok = ProbeResult(probe=s.id, status=Status.error, reason=f"harness: {exc}",
                                          environment_failure=True), False
                runs[j].append(res)
                reported[j] &= ok
                done[j] = res.status not in (Status.passed, Status.failed)  # repeating would say the same
        for (side, r, s, out), rs, ok in zip(sides, runs, reported):
            res = r.settle(s, rs, ok)
            out.append(res)
            if on_result:
                on_result(side, res)
    return cand, base


def _baseline_manifest(tree: pathlib.Path, fallback: Manifest) -> Manifest:
    path = tree / MANIFEST_NAME
    try:
        if fallback._text is not None and path.is_file() and path.read_text() == fallback._text:
            same = fallback.model_copy()  # the same text validates to the same manifest: not parsed twice
            same._source = str(path.resolve())
            return same
        return load_manifest(tree)
    except Exception:  # noqa: BLE001 - an old revision without (or with a broken) manifest: judge it by today's
        return fallback


def cached_failures(base_runner: Runner, manifest: Manifest, changed: list[str]) -> list[ProbeResult]:
    """The baseline's failing results that its cache already holds, of the probes whose covers miss every
    changed file (the others are selected anyway): what :func:`feedback.select.rechecked` asks again when
    no caller judged the whole baseline first (``feedback --changed-from``).  Nothing runs here; a probe
    the cache does not hold for the baseline is not known to fail, and stays unselected."""
    if not base_runner.use_cache:
        return []
    out = []
    for spec in manifest.probes:
        if any(spec.covers.matches(f) for f in changed) or not _has(base_runner.manifest, spec.id):
            continue
        hit = base_runner.cached(base_runner.manifest.probe(spec.id))
        if hit is not None and hit.status in FAILING:
            out.append(hit)
    return out


def export_baseline(repo_tree: str | pathlib.Path, rev: str, store: str | pathlib.Path | None = None
                    ) -> tuple[pathlib.Path, tempfile.TemporaryDirectory | None]:
    """``rev`` of the target's repository as a tree (for use as a baseline): exported to a temporary
    folder, or with ``store`` kept there by commit and reused (then no temporary folder is returned)."""
    from feedback.targets import export_revision, stored_revision

    if store is not None:
        return stored_revision(repo_tree, rev, store), None
    tmp = tempfile.TemporaryDirectory(prefix="infra-agent-baseline-")
    return export_revision(repo_tree, rev, tmp.name), tmp
