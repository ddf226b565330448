"""The risk gate on real upstream commits it has never seen: recall per category, and what it holds
that a reviewer would call clean.

    python bench/gate_upstream.py [--corpus bench/gate_upstream.yaml] [--mirrors /work/.mirror] [--json F]

The corpus lists commits of public inference stacks (flash-linear-attention, SGLang, vLLM, ...) by
repository and SHA, each with the categories a person gave it after reading the diff, blind to the
classifier (``categories: []`` is clean).  Nothing of theirs is stored here: the diffs are read from a
local clone at run time (``--mirrors``: one folder per repository, ``owner+name``, holding a git dir
or a clone; the fetch tool's layout), an entry whose repository is absent is listed as unreachable.

Each commit is judged as the agent's patches are: ``infra_agent.gate.assess_text`` over the commit's
diff against a scratch tree holding the parent's version of every file it touches (so the diff must
apply and the AST checks run), with a manifest that adds no rules and protects nothing (a repository
without one, as ``infra-agent gate`` judges it).  An entry is

* HELD RIGHT when every category it was given is among the gate's;
* PARTLY HELD when the gate holds it but misses one of its categories;
* MISSED when it has categories and the gate calls it clean (the failure that matters: a risky patch
  merged without a person);
* CLEAN / OVER-HELD for entries labelled clean.

Prints one line per commit and the totals; writes everything as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import pathlib
import subprocess
import sys
import tempfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def git_dir(mirrors: pathlib.Path, repo: str) -> pathlib.Path | None:
    """The git dir of ``owner/name`` under ``mirrors``: ``owner+name`` itself, its ``repo`` or ``.git``."""
    base = mirrors / repo.replace("/", "+")
    for cand in (base / "repo", base / ".git", base):
        if (cand / "HEAD").is_file() and (cand / "objects").is_dir():
            return cand
    return None


def git(gdir: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={gdir}", *args], capture_output=True, text=True, check=True,
                          errors="replace").stdout


def judge_commit(gdir: pathlib.Path, sha: str) -> dict:
    """The gate's assessment of one commit against its parent's files."""
    from feedback.manifest import Manifest
    from infra_agent.gate import assess_text

    diff = git(gdir, "show", "--format=", "--no-color", "--no-ext-diff", "--no-renames", sha)
    touched = [p for p in git(gdir, "show", "--format=", "--name-only", "--no-renames", sha).splitlines() if p]
    with tempfile.TemporaryDirectory(prefix="gate-upstream-") as tmp:
        for rel in touched:
            try:
                blob = subprocess.run(["git", f"--git-dir={gdir}", "show", f"{sha}^:{rel}"], capture_output=True,
                                      check=True).stdout
            except subprocess.CalledProcessError:
                continue  # a file the commit adds
            dst = pathlib.Path(tmp) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(blob)
        result = assess_text(diff, Manifest(name="upstream", probes=[]), tree=tmp)
    return dict(decision=result.decision, categories=[c for c in result.categories if c != "error"],
                error=result.error, refused=result.refused, files=len(touched),
                lines=sum(1 for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")),
                findings=[f.render() for f in result.findings][:12])


def outcome(expected: list[str], got: dict) -> str:
    if got["decision"] in ("error", "refused"):
        return "held (error)" if got["decision"] == "error" else "refused"
    held = got["decision"] == "held"
    if not expected:
        return "over-held" if held else "clean"
    if not held:
        return "MISSED"
    return "held right" if set(expected) <= set(got["categories"]) else "partly held"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(ROOT / "bench" / "gate_upstream.yaml"))
    ap.add_argument("--mirrors", default="/work/.mirror", help="one folder per repository, named owner+name")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "gate_upstream.json"))
    args = ap.parse_args()
    corpus = yaml.safe_load(pathlib.Path(args.corpus).read_text()) or []
    rows, unreachable = [], []
    for e in corpus:
        gdir = git_dir(pathlib.Path(args.mirrors), e["repo"])
        if gdir is None:
            unreachable.append(e["repo"])
            continue
        try:
            got = judge_commit(gdir, e["sha"])
        except subprocess.CalledProcessError as exc:
            print(f"  {e['repo']} {e['sha'][:10]}: git failed: {exc.stderr.strip()[:120]}", flush=True)
            unreachable.append(f"{e['repo']}@{e['sha'][:10]}")
            continue
        row = dict(repo=e["repo"], sha=e["sha"], expected=sorted(e.get("categories") or []), hard=bool(e.get("hard")),
                   why=e.get("why", ""), outcome=outcome(e.get("categories") or [], got), **got)
        rows.append(row)
        print(f"  {row['outcome']:>12}  {e['repo'].split('/')[-1][:14]:<14} {e['sha'][:10]}  expected "
              f"{','.join(row['expected']) or 'clean':<24} gate {row['decision']}"
              f"{': ' + ','.join(row['categories']) if row['categories'] else ''}", flush=True)
    risky = [r for r in rows if r["expected"]]
    clean = [r for r in rows if not r["expected"]]
    totals = {
        "risky": len(risky), "held": sum(r["decision"] != "clean" for r in risky),
        "held_right": sum(r["outcome"] == "held right" for r in risky),
        "missed": [f"{r['repo']}@{r['sha'][:10]}" for r in risky if r["outcome"] == "MISSED"],
        "hard": sum(r["hard"] for r in risky), "hard_held": sum(r["hard"] and r["decision"] != "clean" for r in risky),
        "clean": len(clean), "clean_passed": sum(r["decision"] == "clean" for r in clean),
        "per_category": {c: {"expected": sum(c in r["expected"] for r in risky),
                             "found": sum(c in r["expected"] and c in r["categories"] for r in risky)}
                         for c in ("numerics", "concurrency", "production")},
        "unreachable": unreachable,
    }
    print(f"\nrisky commits held: {totals['held']} of {totals['risky']} ({totals['held_right']} with every category; "
          f"hard ones {totals['hard_held']} of {totals['hard']}); clean commits passed: {totals['clean_passed']} of "
          f"{totals['clean']}")
    for c, v in totals["per_category"].items():
        print(f"  {c:<12} found in {v['found']} of {v['expected']}")
    if totals["missed"]:
        print("  missed: " + ", ".join(totals["missed"]))
    if unreachable:
        print(f"  unreachable (no clone under {args.mirrors}): {', '.join(sorted(set(unreachable)))}")
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), corpus=args.corpus,
                                   totals=totals, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
