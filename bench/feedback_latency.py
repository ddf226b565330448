"""How fast does the harness reach a verdict?  (table + JSON; not a timed test)

    python bench/feedback_latency.py [--reps 5] [--json bench/out/feedback_latency.json]

Every figure twice, interleaved in one run: probes forked by the warm server (``feedback/forkserver.py``)
and cold (``INFRA_AGENT_FORKSERVER=0``: a fresh interpreter per probe, paying its imports).

On a scratch git copy of the bundled target:
1. after a one-line change to the CP merge kernel (committed), ``infra-agent feedback
   --changed-from HEAD~1``: wall time to the verdict, median of ``reps`` (each rep a different
   one-line change, so the candidate is never served from the cache; the baseline is, judged once by a
   first run outside the medians, as a session judges it before its first patch), with each selected
   probe's own time on the candidate (where a slow verdict's time goes);
2. the same command again with nothing changed, median of ``reps``: answered from the memo of the last
   run (``feedback/memo.py``), and with the memos removed first (every probe result from the cache, the
   whole harness imported);
3. the change-impact selection against running every probe on the same change, both cold
   (``--skip-all`` leaves it out: on a lent GPU machine every probe twice costs minutes).

On a machine with a GPU the CP probes run natively there: the figures are the GPU probe's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MERGE_LINE = "        b_h = tl.dot(b_M, b_h, input_precision=MERGE_PRECISION) + b_hl"


def git(tree: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout


MODES = {"warm": {}, "cold": {"INFRA_AGENT_FORKSERVER": "0"}}


def feedback(tree: pathlib.Path, *args: str, mode: str = "warm") -> tuple[float, int, dict]:
    """One ``infra-agent feedback --json`` through the console script's module: (seconds, exit code, report);
    the report's ``"memo"`` key (added here) says whether a memo answered."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "infra_agent", "feedback", "--target", str(tree), "--json", *args],
                         capture_output=True, text=True, env={**os.environ, **MODES[mode]})
    secs = time.perf_counter() - t0
    if out.returncode not in (0, 1):
        raise RuntimeError(out.stderr)
    report = json.loads(out.stdout)
    report["memo"] = "unchanged since" in out.stderr
    return secs, out.returncode, report


def _device() -> str:
    """Where the probes run: the GPU's name, or the CPU (the Triton interpreter)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (Triton interpreter)"


def one_line_change(tree: pathlib.Path, i: int) -> None:
    cp = tree / "target_stack" / "ops" / "kda" / "cp.py"
    text = cp.read_text()
    assert MERGE_LINE in text
    cp.write_text(text.replace(MERGE_LINE, MERGE_LINE + f"  # chain step {i}", 1))
    git(tree, "commit", "-qam", f"one-line change {i}")


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from feedback.targets import materialize_bundled

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-all", action="store_true", help="leave out step 3 (every probe, no cache)")
    ap.add_argument("--json", type=pathlib.Path, default=ROOT / "bench" / "out" / "feedback_latency.json")
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="infra-agent-latency-"))
    try:
        tree = materialize_bundled(work / "target")
        git(tree, "init", "-q")
        git(tree, "-c", "user.name=bench", "-c", "user.email=b@b", "add", "-A")
        git(tree, "-c", "user.name=bench", "-c", "user.email=b@b", "commit", "-qm", "base")
        git(tree, "config", "user.name", "bench")
        git(tree, "config", "user.email", "b@b")
        base = git(tree, "rev-parse", "HEAD").strip()

        # a session judges its baseline before the first patch: once here, outside the medians (else the first
        # warm run alone pays the baseline's probes and the cold one finds them cached)
        one_line_change(tree, -1)
        first_s, _, _ = feedback(tree, "--changed-from", "HEAD~1")
        verdicts, probes = {m: [] for m in MODES}, None
        by_probe: dict = {m: {} for m in MODES}  # each selected probe's own seconds on the candidate, per run
        for i in range(args.reps):
            for j, mode in enumerate(MODES):  # interleaved: the machine's drift falls on both alike
                git(tree, "reset", "-q", "--hard", base)
                one_line_change(tree, 2 * i + j)
                secs, rc, rep = feedback(tree, "--changed-from", "HEAD~1", mode=mode)
                verdicts[mode].append(secs)
                probes = [r["probe"] for r in rep["results"]]
                for r in rep["results"]:
                    by_probe[mode].setdefault(r["probe"], []).append(r["duration_s"])
        from feedback.state import StateDir

        memos = StateDir.for_target(tree).memos
        all_cached, from_memo = {}, {}
        reruns = {m: {"memo": [], "cache": []} for m in MODES}
        for _ in range(args.reps):
            for mode in MODES:
                for how in ("memo", "cache"):  # interleaved; removing the memos makes the full path run
                    if how == "cache":
                        shutil.rmtree(memos, ignore_errors=True)
                    secs, _, rep_cached = feedback(tree, "--changed-from", "HEAD~1", mode=mode)
                    reruns[mode][how].append(secs)
                    key = f"{mode}/{how}"
                    all_cached[key] = all_cached.get(key, True) and all(r["cached"] for r in rep_cached["results"])
                    from_memo[key] = from_memo.get(key, True) and rep_cached["memo"]
        cached = {m: {how: statistics.median(v) for how, v in r.items()} for m, r in reruns.items()}

        t_sel, t_all, n_sel, n_all = {}, {}, 0, 0
        if not args.skip_all:
            git(tree, "reset", "-q", "--hard", base)
            one_line_change(tree, 99)
            for mode in MODES:  # no cache: --no-cache judges baseline and candidate afresh
                t_sel[mode], _, rep_sel = feedback(tree, "--changed-from", "HEAD~1", "--baseline", "HEAD",
                                                   "--no-cache", mode=mode)
                t_all[mode], _, rep_all = feedback(tree, "--all", "--baseline", "HEAD", "--no-cache", mode=mode)
                n_sel, n_all = len(rep_sel["results"]), len(rep_all["results"])
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
            "device": _device(),
            "verdict_after_change_s": verdicts,
            "verdict_median_s": {m: statistics.median(v) for m, v in verdicts.items()},
            "first_verdict_with_baseline_s": first_s,
            "probes_selected": probes,
            "probe_median_s": {m: {p: statistics.median(v) for p, v in d.items()} for m, d in by_probe.items()},
            "unchanged_rerun_s": cached, "unchanged_rerun_runs_s": reruns,
            "unchanged_rerun_all_cached": all_cached, "unchanged_rerun_from_memo": from_memo,
            "selected_cold_s": t_sel, "all_probes_cold_s": t_all,
            "selected_over_all": {m: t_sel[m] / t_all[m] for m in t_all}, "n_selected": n_sel, "n_all": n_all,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    console = Console()
    table = Table("measure", "warm (fork server)", "cold (a fresh interpreter per probe)", "goal")
    med = result["verdict_median_s"]
    table.add_row(f"verdict after a one-line CP merge change (median of {args.reps})",
                  *(f"{med[m]:.1f} s" for m in MODES), "<= 5 s")
    table.add_row("  runs", *(", ".join(f"{v:.1f}" for v in verdicts[m]) for m in MODES), "")
    table.add_row("  before them: the first, baseline judged too", f"{first_s:.1f} s", "", "")
    table.add_row("  each probe's own time (median)", *("\n".join(f"{p} {t:.1f} s" for p, t in sorted(
        result["probe_median_s"][m].items(), key=lambda kv: -kv[1])) for m in MODES), "")
    table.add_row(f"repeated run, nothing changed (median of {args.reps})",
                  *(f"{cached[m]['memo']:.3f} s (memo: {from_memo[m + '/memo']})" for m in MODES), "<= 0.3 s")
    table.add_row("  the same, memos removed: the full path, results from the cache",
                  *(f"{cached[m]['cache']:.3f} s (all cached: {all_cached[m + '/cache']})" for m in MODES), "")
    if t_all:
        table.add_row(f"selected probes, no cache ({n_sel} probes, with the baseline)",
                      *(f"{t_sel[m]:.1f} s" for m in MODES), "")
        table.add_row(f"every probe, no cache ({n_all} probes, with the baseline)",
                      *(f"{t_all[m]:.1f} s" for m in MODES), "")
        table.add_row("selection / all", *(f"{result['selected_over_all'][m]:.0%}" for m in MODES), "<= 30%")
    console.print(f"probes selected: {', '.join(probes or [])} ({result['device']}, {result['machine']})")
    console.print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
