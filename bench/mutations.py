"""Mutation testing of the target's probes: how many realistic defects does the harness catch and localise?

    python bench/mutations.py [--json bench/mutations.json] [--only ID[,ID]] [--area AREA] [--jobs N] [--list]

The corpus (``bench/mutations.yaml``, ``--corpus``) is a list of small source edits to the bundled
target_stack, each an ``old`` text that must occur exactly once in its file and its ``new``
replacement.  For every defect: materialise the clean target once, copy it, apply the edit to the
copy, and judge the copy exactly as the agent judges a candidate, ``judge(mutant,
changed=[file], baseline_tree=clean, cache_dir=shared)``: change-impact selection, the cascade
and the content-keyed cache work as they do for the agent (the clean baseline's results are
computed once and then served from the cache).  Each defect is then

* CAUGHT when a probe that passed (or was skipped) on the baseline fails, errors or times out on
  the mutant, or an acceptance criterion that held on the baseline fails on it;
* LOCALISED when it is caught and a catching probe names the mutated file: a finding's
  ``location.file`` equal to or containing the path, or an error's ``(at FILE:LINE ...)``.  The
  generic "covers ..." list of an error's localisation line does not count.

A performance defect (a corpus of them: ``bench/perf_defects.yaml``) leaves every result right; it is
CAUGHT when a counted metric (``Metric.counted``: work counted under the interpreter, exact) regressed
against the clean tree, and LOCALISED when the probe's finding for the kernel the metric names is bound
to the mutated file.

An entry whose ``old`` text is absent or ambiguous is refused as "not applicable" (the run goes on);
an entry with ``needs_gpu: true`` is skipped on a machine without a GPU and listed as unreachable.
The working tree is never modified: every edit is made in a scratch copy under a temporary folder.
Prints a progress line per defect, a table and totals; writes everything as JSON.  ``--list``
prints the corpus (and whether each entry applies) without judging anything.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

CORPUS = ROOT / "bench" / "mutations.yaml"
DEFAULT_JSON = ROOT / "bench" / "mutations.json"
AREAS = ("kernel", "model", "engine", "sampler", "native", "disagg")
_AT = re.compile(r"\(at ([^\s:()]+):\d+")


class CorpusError(ValueError):
    """A malformed corpus file (missing fields, unknown area, duplicate id)."""


class NotApplicable(ValueError):
    """A corpus entry that cannot be applied to this tree: its file or its ``old`` text is absent, or ambiguous."""


@dataclass(frozen=True)
class Mutation:
    id: str
    area: str
    file: str  # relative to the target tree's root
    old: str
    new: str
    description: str
    expect: str  # the file a probe should name to localise the defect
    needs_gpu: bool = False
    note: str = ""


def load_corpus(path: str | pathlib.Path = CORPUS) -> list[Mutation]:
    data = yaml.safe_load(pathlib.Path(path).read_text())
    if not isinstance(data, list):
        raise CorpusError(f"{path}: the corpus must be a YAML list of entries")
    out: list[Mutation] = []
    seen: set[str] = set()
    for i, e in enumerate(data):
        where = f"{path}: entry {i + 1}"
        if not isinstance(e, dict):
            raise CorpusError(f"{where} is not a mapping")
        missing = [k for k in ("id", "area", "file", "old", "new", "description") if k not in e]
        if missing:
            raise CorpusError(f"{where} ({e.get('id', '?')}) lacks {', '.join(missing)}")
        unknown = set(e) - {"id", "area", "file", "old", "new", "description", "expect", "needs_gpu", "note"}
        if unknown:
            raise CorpusError(f"{where} ({e['id']}) has unknown keys {', '.join(sorted(unknown))}")
        if e["area"] not in AREAS:
            raise CorpusError(f"{where} ({e['id']}): area {e['area']!r} is not one of {', '.join(AREAS)}")
        if e["id"] in seen:
            raise CorpusError(f"{where}: duplicate id {e['id']!r}")
        if not isinstance(e["old"], str) or not isinstance(e["new"], str) or not e["old"] or e["old"] == e["new"]:
            raise CorpusError(f"{where} ({e['id']}): old must be a non-empty text and new a different one")
        seen.add(e["id"])
        out.append(Mutation(id=str(e["id"]), area=e["area"], file=str(e["file"]), old=e["old"], new=e["new"],
                            description=str(e["description"]), expect=str(e.get("expect") or e["file"]),
                            needs_gpu=bool(e.get("needs_gpu", False)), note=str(e.get("note") or "")))
    return out


# -- applying -----------------------------------------------------------------------------------------
def locate(m: Mutation, tree: pathlib.Path) -> tuple[str, int]:
    """(the file's text, the offset of the one place ``old`` occurs); NotApplicable otherwise."""
    path = tree / m.file
    if not path.is_file():
        raise NotApplicable(f"{m.file} is not in the tree")
    text = path.read_text()
    hits, at = [], text.find(m.old)
    while at >= 0:
        hits.append(at)
        at = text.find(m.old, at + 1)
    if not hits:
        raise NotApplicable(f"the old text does not occur in {m.file}")
    if len(hits) > 1:
        lines = ", ".join(str(text.count("\n", 0, i) + 1) for i in hits[:6])
        raise NotApplicable(f"the old text is ambiguous: {len(hits)} places in {m.file} (lines {lines})")
    return text, hits[0]


def apply(m: Mutation, tree: pathlib.Path) -> int:
    """Apply ``m`` to the tree at ``tree`` (a scratch copy!); returns the line number of the edit."""
    text, at = locate(m, tree)
    (tree / m.file).write_text(text[:at] + m.new + text[at + len(m.old):])
    return text.count("\n", 0, at) + 1


def tree_digest(tree: pathlib.Path) -> str:
    h = hashlib.sha256()
    for p in sorted(tree.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(tree)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


# -- judging --------------------------------------------------------------------------------------------
def _named_files(result) -> list[str]:
    """The files a failing result names: its failed checks' (what it observed on the way is not a place), and
    its reason's."""
    try:
        from feedback.models import failures
    except ImportError:  # an older harness: every finding
        failures = list
    names = [f.location.file for f in failures(result.findings) if f.location.file]
    names += _AT.findall(result.reason or "")
    return names


def classify(report, m: Mutation, kinds: dict[str, str]) -> dict:
    """Caught / localised, and what did it, from a FeedbackReport of the mutant against the clean tree."""
    from feedback.models import Status

    bad = (Status.failed, Status.error, Status.timeout)
    base = {r.probe: r for r in report.baseline_results}
    failing = [r for r in report.results if r.status in bad]
    env = [r.probe for r in failing if getattr(r, "environment_failure", False)]
    counted = [r for r in failing if r.probe not in env]
    caught_by = [r for r in counted if r.probe in base and base[r.probe].status in (Status.passed, Status.skipped)]
    base_acc = getattr(report, "baseline_acceptance", None)
    if not base_acc and report.baseline_results:  # a harness that does not judge the baseline's acceptance
        base_acc = _acceptance(report.baseline_results)
    held = {c.name for c in base_acc if c.holds is True}
    broke = [c for c in report.acceptance if c.holds is False and c.name in held]
    localised_by = [r.probe for r in caught_by if any(m.expect in n for n in _named_files(r))]
    # more counted work than the clean tree (exact counts: no noise), bound to the kernel the metric names
    results = {r.probe: r for r in report.results}
    more_work = [(c.probe, d.name) for c in report.comparisons for d in c.deltas
                 if d.verdict == "regressed" and (d.note or "").startswith("counted")]
    # the parts (kernels, functions) whose own counts grew, shown beside a judged total
    parts = [(c.probe, d.name) for c in report.comparisons for d in c.deltas
             if (d.note or "").startswith("counted: more")]
    ids = {r.probe for r in caught_by}
    worked = sorted({probe for probe, _ in more_work} - ids)
    caught_by = caught_by + [results[p] for p in worked]
    localised_by += [p for p in worked
                     if _work_localised(results[p], [n for q, n in more_work + parts if q == p], m.expect)]
    ids.update(worked)
    lines = [line for c in report.comparisons if c.probe in ids for line in c.localisation]
    lines += [f"acceptance {c.name}: {c.expression} fails (value {c.value:.4g})" for c in broke]
    return {
        "caught": bool(caught_by or broke),
        "localised": bool(localised_by),
        "failing": [r.probe for r in failing],
        "caught_by": [r.probe for r in caught_by],
        "localised_by": localised_by,
        "acceptance_broken": [c.name for c in broke],
        "caught_kinds": sorted({kinds.get(r.probe, "?") for r in caught_by}),
        "baseline_failing": [p for p, r in base.items() if r.status in bad],
        "environment_failures": env,
        "named_files": sorted({n for r in caught_by for n in _named_files(r)}),
        "ran": [r.probe for r in report.results],
        "statuses": {r.probe: r.status.value for r in report.results},
        "stopped_at": report.stopped_at,
        "first_localisation": lines[0] if lines else None,
        "more_work": [f"{p}.{n}" for p, n in more_work],
    }


def _work_localised(result, grown: list[str], expect: str) -> bool:
    """Whether one of the kernels or functions whose counted metrics grew (``grown``: ``...<kernel>.<count>``,
    or ``<file>:<function>.<count>``) is bound, by the probe's finding for it, to the file ``expect``."""
    from feedback.verdict import part_names

    return any(expect in (f.location.file or "")
               and any(f".{n}." in f".{name}." for n in part_names(f.location) for name in grown)
               for f in result.findings)


_clean_manifest: list = []  # the clean tree's manifest, once loaded


def _acceptance(results) -> list:
    """The acceptance criteria over the baseline's results."""
    try:
        from feedback.verdict import evaluate_acceptance
    except ImportError:
        from feedback.report import evaluate_acceptance

    return evaluate_acceptance(_clean_manifest[0], results) if _clean_manifest else []


def judge_mutation(m: Mutation, clean: pathlib.Path, work: pathlib.Path, cache_dir: pathlib.Path,
                   probe_jobs: int, kinds: dict[str, str]) -> dict:
    """Copy the clean tree, apply ``m`` to the copy, judge it against the clean tree, classify."""
    from feedback.harness import judge

    rec: dict = {"status": "judged"}
    tree = work / f"mutant-{m.id}"
    t0 = time.perf_counter()
    try:
        shutil.copytree(clean, tree)
        rec["line"] = apply(m, tree)
        selected: list[str] = []
        report = judge(tree, changed=[m.file], baseline_tree=clean, baseline_label="clean", label=f"mutant {m.id}",
                       jobs=probe_jobs, cache_dir=cache_dir,
                       on_start=lambda specs: selected.extend(s.id for s in specs))
        rec["selected"] = selected
        rec.update(classify(report, m, kinds))
    except NotApplicable as exc:
        rec.update(status="not applicable", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - a harness failure on one defect is reported, the run goes on
        rec.update(status="harness error", reason=f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                   traceback=traceback.format_exc()[-2000:])
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


# -- output ---------------------------------------------------------------------------------------------
def _short(path: str) -> str:
    return path.removeprefix("target_stack/")


def progress_line(k: int, n: int, m: Mutation, rec: dict) -> str:
    if rec["status"] != "judged":
        what = f"{rec['status'].upper()}: {rec.get('reason', '')}"
    elif not rec["caught"]:
        what = "missed"
    else:
        by = ", ".join(rec["caught_by"] + [f"acceptance {a}" for a in rec["acceptance_broken"]])
        what = f"CAUGHT by {by} ({'localised' if rec['localised'] else 'not localised'})"
    return f"[{k:>{len(str(n))}}/{n}] {m.id}: {what} ({rec['seconds']:.1f}s)"


def totals(records: list[dict]) -> dict:
    judged = [r for r in records if r["status"] == "judged"]
    caught = [r for r in judged if r["caught"]]
    loc = [r for r in judged if r["localised"]]
    pct = lambda a, b: round(100.0 * a / b, 1) if b else None  # noqa: E731
    return {"entries": len(records), "judged": len(judged), "caught": len(caught), "localised": len(loc),
            "caught_pct": pct(len(caught), len(judged)), "localised_pct": pct(len(loc), len(judged)),
            "localised_of_caught_pct": pct(len(loc), len(caught)),
            "needs_gpu_skipped": sum(1 for r in records if r["status"] == "needs a GPU"),
            "not_applicable": sum(1 for r in records if r["status"] == "not applicable"),
            "harness_errors": sum(1 for r in records if r["status"] == "harness error")}


def print_table(records: list[dict], out=sys.stdout) -> None:
    from rich.console import Console
    from rich.table import Table

    width = max(shutil.get_terminal_size((200, 40)).columns, 200)
    console = Console(file=out, width=width, highlight=False)
    table = Table(title="mutation testing: per defect", title_justify="left")
    for col, kw in (("id", {}), ("area", {}), ("file", {}), ("caught", {}), ("localised", {}),
                    ("selected probes", {"overflow": "fold"}), ("failing probe", {"overflow": "fold"}),
                    ("s", {"justify": "right"})):
        table.add_column(col, **kw)
    for r in records:
        if r["status"] == "judged":
            caught = "yes" if r["caught"] else "[red]no[/]"
            loc = "yes" if r["localised"] else ("no" if r["caught"] else "-")
            failing = ", ".join(r["caught_by"] or r["acceptance_broken"]) or "-"
            selected = ", ".join(r.get("selected") or []) or "(none)"
        else:
            caught, loc, failing, selected = f"[yellow]{r['status']}[/]", "-", r.get("reason", "") or "-", "-"
        table.add_row(r["id"], r["area"], _short(r["file"]), caught, loc, selected, failing, f"{r['seconds']:.0f}")
    console.print(table)


def print_summary(records: list[dict], elapsed: float, out=sys.stdout) -> None:
    t = totals(records)
    p = lambda line: print(line, file=out)  # noqa: E731
    p(f"\ntotals: {t['judged']} defects judged in {elapsed / 60:.1f} min: caught {t['caught']} "
      f"({t['caught_pct']}%), localised {t['localised']} ({t['localised_pct']}%; "
      f"{t['localised_of_caught_pct']}% of those caught)")
    kinds: dict[str, int] = {}
    for r in records:
        if r["status"] == "judged" and r["caught"]:
            key = "+".join(r["caught_kinds"]) or "acceptance"
            kinds[key] = kinds.get(key, 0) + 1
    if kinds:
        p("  caught by probe kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    for area in AREAS:
        rs = [r for r in records if r["area"] == area and r["status"] == "judged"]
        if rs:
            c, loc = sum(r["caught"] for r in rs), sum(r["localised"] for r in rs)
            p(f"  {area:<8} {len(rs):>3} judged, {c:>3} caught, {loc:>3} localised")
    missed = [r for r in records if r["status"] == "judged" and not r["caught"]]
    if missed:
        p("missed (no probe failed):")
        for r in missed:
            p(f"  {r['id']} ({r['area']}, {_short(r['file'])}): {r['description']}")
    gpu = [r for r in records if r["status"] == "needs a GPU"]
    if gpu:
        p("not reachable by any probe on this CPU machine (needs_gpu, skipped):")
        for r in gpu:
            p(f"  {r['id']} ({_short(r['file'])}): {r.get('note') or r['description']}")
    for kind in ("not applicable", "harness error"):
        rs = [r for r in records if r["status"] == kind]
        if rs:
            p(f"{kind}:")
            for r in rs:
                p(f"  {r['id']}: {r.get('reason', '')}")
    base = sorted({b for r in records for b in r.get("baseline_failing") or []})
    if base:
        p(f"note: probes that failed on the clean baseline (not counted as catches): {', '.join(base)}")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# -- main -----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(CORPUS), help="the corpus YAML (default: %(default)s)")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the results (default: %(default)s)")
    ap.add_argument("--only", default=None, help="comma-separated defect ids")
    ap.add_argument("--area", default=None, choices=AREAS, help="only the defects of this area")
    ap.add_argument("--jobs", type=int, default=1, help="defects judged at once (default 1: timing probes are "
                    "sensitive to a busy machine)")
    ap.add_argument("--probe-jobs", type=int, default=2, help="probes run at once inside one judgement, as the "
                    "agent runs them (default 2)")
    ap.add_argument("--cache-dir", default=None, help="the probe-result cache shared by every judgement (default: "
                    "a fresh folder, so the run measures every probe)")
    ap.add_argument("--list", action="store_true",
                    help="print the corpus and whether each entry applies; judge nothing")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        corpus = load_corpus(args.corpus)
    except (OSError, CorpusError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chosen = corpus
    if args.only:
        ids = [i.strip() for i in args.only.split(",") if i.strip()]
        unknown = [i for i in ids if i not in {m.id for m in corpus}]
        if unknown:
            print(f"error: unknown defect id(s) {', '.join(unknown)}; see --list", file=sys.stderr)
            return 2
        chosen = [m for m in corpus if m.id in ids]
    if args.area:
        chosen = [m for m in chosen if m.area == args.area]
    if not chosen:
        print("error: no defect selected", file=sys.stderr)
        return 2

    from feedback.machine import gpu_present
    from feedback.manifest import load_manifest
    from feedback.targets import materialize_bundled

    with tempfile.TemporaryDirectory(prefix="infra-agent-mutations-") as tmp:
        work = pathlib.Path(tmp)
        clean = materialize_bundled(work / "clean")
        if args.list:
            for m in chosen:
                try:
                    locate(m, clean)
                    ok = "applies"
                except NotApplicable as exc:
                    ok = f"NOT APPLICABLE: {exc}"
                gpu = " [needs GPU]" if m.needs_gpu else ""
                print(f"{m.id:<42} {m.area:<8} {_short(m.file):<32} {ok}{gpu}\n    {m.description}")
            print(f"{len(chosen)} of {len(corpus)} entries")
            return 0

        manifest = load_manifest(clean)
        _clean_manifest[:] = [manifest]
        digest = tree_digest(clean)
        kinds = {p.id: p.kind for p in manifest.probes}
        cache_dir = pathlib.Path(args.cache_dir) if args.cache_dir else work / "cache"
        gpu = gpu_present()
        started = dt.datetime.now().astimezone()
        t0 = time.perf_counter()
        records: dict[str, dict] = {}
        todo: list[Mutation] = []
        for m in chosen:
            base = {k: v for k, v in asdict(m).items() if k not in ("old", "new")}
            try:
                locate(m, clean)
            except NotApplicable as exc:
                records[m.id] = {**base, "status": "not applicable", "reason": str(exc), "seconds": 0.0}
                continue
            if m.needs_gpu and not gpu:
                records[m.id] = {**base, "status": "needs a GPU", "reason": "needs_gpu; no GPU on this machine",
                                 "seconds": 0.0}
                continue
            records[m.id] = base
            todo.append(m)
        print(f"{len(chosen)} defects: {len(todo)} to judge, "
              f"{sum(r.get('status') == 'needs a GPU' for r in records.values())} need a GPU, "
              f"{sum(r.get('status') == 'not applicable' for r in records.values())} not applicable; "
              f"clean tree {digest}, {len(manifest.probes)} probes in its manifest", flush=True)
        for m in chosen:
            if records[m.id].get("status") == "not applicable":
                print(f"  not applicable: {m.id}: {records[m.id]['reason']}", flush=True)

        lock = threading.Lock()
        done = 0
        with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(judge_mutation, m, clean, work, cache_dir, args.probe_jobs, kinds): m
                       for m in todo}
            for fut in cf.as_completed(futures):
                m = futures[fut]
                records[m.id].update(fut.result())
                with lock:
                    done += 1
                    print(progress_line(done, len(todo), m, records[m.id]), flush=True)
        elapsed = time.perf_counter() - t0

    ordered = [records[m.id] for m in chosen]
    print()
    print_table(ordered)
    print_summary(ordered, elapsed)
    dirty = _git("status", "--porcelain", "--", "target_stack", "feedback")
    payload = {
        "schema": 1,
        "started": started.isoformat(timespec="seconds"),
        "duration_s": round(elapsed, 1),
        "git_head": _git("rev-parse", "HEAD"),
        "uncommitted": dirty.splitlines() if dirty else [],
        "clean_tree_digest": digest,
        "machine": {"cpus": os.cpu_count(), "gpu": gpu, "python": sys.version.split()[0]},
        "corpus": str(pathlib.Path(args.corpus).resolve().relative_to(ROOT)
                      if pathlib.Path(args.corpus).resolve().is_relative_to(ROOT) else args.corpus),
        "args": {"only": args.only, "area": args.area, "jobs": args.jobs, "probe_jobs": args.probe_jobs},
        "probes": sorted(kinds),
        "totals": totals(ordered),
        "by_area": {a: totals([r for r in ordered if r["area"] == a]) for a in AREAS
                    if any(r["area"] == a for r in ordered)},
        "results": ordered,
    }
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if payload["totals"]["harness_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
