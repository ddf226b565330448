"""How fast does the harness reach a verdict?  (table + JSON; not a timed test)

    python bench/feedback_latency.py [--reps 5] [--json bench/out/feedback_latency.json]

On a scratch git copy of the bundled target:
1. after a one-line change to the CP merge kernel (committed), ``infra-agent feedback
   --changed-from HEAD~1``: wall time to the verdict, median of ``reps`` (each rep a different
   one-line change, so the candidate is never served from the cache; the baseline is);
2. the same command again with nothing changed (everything cached);
3. the change-impact selection against running every probe on the same change, both cold.
"""

from __future__ import annotations

import argparse
import json
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


def feedback(tree: pathlib.Path, *args: str) -> tuple[float, int, dict]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "infra_agent.cli", "feedback", "--target", str(tree), "--json", *args],
                         capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if out.returncode not in (0, 1):
        raise RuntimeError(out.stderr)
    return secs, out.returncode, json.loads(out.stdout)


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

        verdicts, probes = [], None
        for i in range(args.reps):
            git(tree, "reset", "-q", "--hard", base)
            one_line_change(tree, i)
            secs, rc, rep = feedback(tree, "--changed-from", "HEAD~1")
            verdicts.append(secs)
            probes = [r["probe"] for r in rep["results"]]
        cached, rc_cached, rep_cached = feedback(tree, "--changed-from", "HEAD~1")
        all_cached = all(r["cached"] for r in rep_cached["results"])

        git(tree, "reset", "-q", "--hard", base)
        one_line_change(tree, 99)
        shutil.rmtree(tree / ".infra-agent", ignore_errors=True)
        t_sel, _, rep_sel = feedback(tree, "--changed-from", "HEAD~1", "--baseline", "HEAD")  # baseline = candidate
        shutil.rmtree(tree / ".infra-agent", ignore_errors=True)
        t_all, _, rep_all = feedback(tree, "--all", "--baseline", "HEAD")
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
            "verdict_after_change_s": verdicts, "verdict_median_s": statistics.median(verdicts),
            "probes_selected": probes, "unchanged_rerun_s": cached, "unchanged_rerun_all_cached": all_cached,
            "selected_cold_s": t_sel, "all_probes_cold_s": t_all, "selected_over_all": t_sel / t_all,
            "n_selected": len(rep_sel["results"]), "n_all": len(rep_all["results"]),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    console = Console()
    table = Table("measure", "value", "target")
    table.add_row("verdict after a one-line CP merge change (median of "
                  f"{args.reps})", f"{result['verdict_median_s']:.1f} s", "<= 20 s")
    table.add_row("  runs", ", ".join(f"{v:.1f}" for v in verdicts), "")
    table.add_row("  probes selected", ", ".join(probes or []), "")
    table.add_row("repeated run, nothing changed", f"{cached:.2f} s (all cached: {all_cached})", "<= 1 s")
    table.add_row("selected probes, cold (incl. baseline)", f"{t_sel:.1f} s ({result['n_selected']} probes)", "")
    table.add_row("every probe, cold (incl. baseline)", f"{t_all:.1f} s ({result['n_all']} probes)", "")
    table.add_row("selection / all", f"{result['selected_over_all']:.0%}", "<= 30%")
    console.print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
