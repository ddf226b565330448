"""The ``infra-agent`` console script (and ``python -m infra_agent``).

An unchanged re-run of ``infra-agent feedback ... --json`` is answered here from its memo
(:mod:`feedback.memo`) before the command line is built: typer, pydantic, the harness and the
manifest never load, and the answer costs an interpreter start, a walk of the tree's file times and
git's list of changed files.  Everything else, and anything this parser does not know exactly as the
``feedback`` command defines it, goes to :mod:`infra_agent.cli` unchanged (which serves the same memo,
and writes it).
"""

from __future__ import annotations

import sys

#: the ``feedback`` options that decide a report, as the command defines them; ``--jobs`` only sets how
#: many probes run at once.  Any other option (``--no-cache``, ``--trace-dir``, ``--executor ray``,
#: ``--fail-on``, whose exit code needs the verdict, ``--help``, a typo) leaves the memo alone here: the full
#: command line judges it.
_VALUE = {"--target": "target", "--probe": "probe", "--changed-from": "changed_from", "--diff": "diff",
          "--baseline": "baseline", "--manifest": "manifest", "--jobs": "jobs", "-j": "jobs", "--executor": "executor"}
_FLAG = {"--all": "run_all", "--json": "as_json"}


def parse_feedback(argv: list[str]) -> dict | None:
    """The options of ``feedback`` in ``argv`` (after the program name), or None where the full command line
    must judge them (another command, an option not listed above, a value typer would refuse)."""
    if not argv or argv[0] != "feedback":
        return None
    opts: dict = {"probe": []}
    args = iter(argv[1:])
    for arg in args:
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in _FLAG and not eq:
            opts[_FLAG[name]] = True
        elif name in _VALUE:
            if not eq:
                value = next(args, None)
                if value is None:
                    return None
            key = _VALUE[name]
            if key == "probe":
                opts["probe"].append(value)
            elif key in opts:  # typer keeps the last of a repeated option: rarely meant, leave it to typer
                return None
            else:
                opts[key] = value
        else:
            return None
    if opts.get("executor", "local") != "local":
        return None
    if "jobs" in opts and not (opts["jobs"].isdigit() and int(opts["jobs"]) >= 1):
        return None
    if opts.get("changed_from") and opts.get("diff"):
        return None
    return opts


def serve_memo(argv: list[str]) -> int | None:
    """Print the memo's report for ``feedback ... --json`` and return its exit code; None when no memo
    answers (nothing printed)."""
    opts = parse_feedback(argv)
    if opts is None or not opts.get("as_json") or not opts.get("target"):
        return None
    import pathlib

    from feedback import memo
    from feedback.state import StateDir

    try:
        if not pathlib.Path(opts["target"]).is_dir():
            return None
        diff = pathlib.Path(opts["diff"]).read_text(errors="replace") if opts.get("diff") else None
        manifest = pathlib.Path(opts["manifest"]).read_text() if opts.get("manifest") else None
        request = memo.Request(opts["target"], probes=opts["probe"], changed_from=opts.get("changed_from"),
                               diff_text=diff, run_all=opts.get("run_all", False), baseline=opts.get("baseline"),
                               manifest_file=opts.get("manifest"), manifest_text=manifest)
        state = StateDir.for_target(opts["target"])
        hit = memo.lookup(state.memos, request, state.cache)
    except Exception:  # noqa: BLE001 - whatever goes wrong here, the full command line judges (and says why)
        return None
    if hit is None:
        return None
    sys.stdout.write(hit.report + "\n")
    sys.stdout.flush()
    print(memo.note(hit), file=sys.stderr)
    return hit.code


def main() -> None:  # pragma: no cover - the console script; tests run it as ``python -m infra_agent``
    code = serve_memo(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from infra_agent.cli import app

    app()
