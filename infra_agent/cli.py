"""The ``infra-agent`` command line."""

from __future__ import annotations

import contextlib
import platform

import typer

from infra_agent import __version__

app = typer.Typer(
    name="infra-agent",
    help="Dense, local feedback for agent-assisted work on LLM inference stacks.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
)


class _Console:
    """A rich Console made on first use: ``feedback --json`` on a cached tree prints JSON and never loads rich."""

    def __init__(self, **options):
        self._options, self._console = options, None

    def get(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return self._console

    def __getattr__(self, name: str):
        return getattr(self.get(), name)


console = _Console()
err_console = _Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """Every CLI error is one clear line and a non-zero exit code."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print the versions of infra-agent and the numerical stack it runs on."""
    import torch
    import triton

    console.print(f"infra-agent {__version__}")
    console.print(f"python {platform.python_version()}  torch {torch.__version__}  triton {triton.__version__}")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (Triton interpreter)"
    console.print(f"device {device}")


manifest_app = typer.Typer(help="The target manifest (infra-agent.yaml): schema and validation.",
                            no_args_is_help=True)
app.add_typer(manifest_app, name="manifest")


@manifest_app.command("schema")
def manifest_schema() -> None:
    """Print the manifest's JSON Schema."""
    import json

    from feedback.manifest import schema

    print(json.dumps(schema(), indent=2))


@manifest_app.command("check")
def manifest_check(
    directory: str = typer.Argument(None, help="target root (default: the bundled target_stack)"),
    manifest: str = typer.Option(None, "--manifest", help="a manifest kept outside the target tree"),
) -> None:
    """Validate a target's manifest without running anything, and name what it points at that is missing."""
    import pathlib

    from feedback.manifest import ManifestError, dangling, load_manifest, parse_manifest

    root = _target_root(directory)
    path = pathlib.Path(manifest) if manifest else root / "infra-agent.yaml"
    try:
        m = parse_manifest(path.read_text(), str(path)) if manifest else load_manifest(root)
    except ManifestError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    problems = dangling(m, root)
    for line in problems:
        err_console.print(f"[yellow]warning:[/] {line}", highlight=False, soft_wrap=True)
    console.print(f"[green]ok[/] {path}: {m.name}, {len(m.probes)} probes, "
                  f"{len(m.acceptance)} acceptance criteria, {len(m.risk)} risk rules, "
                  f"{len(m.protected)} protected paths" + (f"; {len(problems)} warning(s)" if problems else ""),
                  highlight=False)


@app.command()
def init(
    directory: str = typer.Argument(".", help="the repository to inspect"),
    manifest: str = typer.Option(None, "--manifest", help="where to write the manifest (default: "
                                 "DIR/infra-agent.yaml; outside the tree keeps the judges out of the agent's reach)"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing manifest"),
    max_tests: int = typer.Option(12, "--max-tests", min=0, help="pytest probes to write at most"),
) -> None:
    """Inspect a repository (packages, Triton kernels, pytest tests, benchmarks) and write a starter manifest."""
    import pathlib

    from feedback.manifest import parse_manifest
    from infra_agent.starter import inspect, starter_manifest

    root = pathlib.Path(directory)
    if not root.is_dir():
        fail(f"{directory} is not a directory")
    out = pathlib.Path(manifest) if manifest else root / "infra-agent.yaml"
    if out.exists() and not force:
        fail(f"{out} exists; --force overwrites it")
    inv = inspect(root)
    text = starter_manifest(inv, max_tests=max_tests)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    written = parse_manifest(text).probes
    console.print(f"[green]wrote[/] {out}: {len(written)} probes; found {len(inv.packages)} package(s) "
                  f"({', '.join(inv.packages) or '-'}), {sum(len(k) for k in inv.kernels.values())} Triton kernel(s) "
                  f"in {len(inv.kernel_files)} file(s), {len(inv.test_files)} test file(s) ({len(inv.kernel_tests)} "
                  f"reach kernels; {sum(p.pytest is not None for p in written)} written as pytest probes), "
                  f"{len(inv.bench_files)} benchmark script(s) listed", highlight=False)
    for conftest, needs in sorted(inv.conftest_needs.items()):
        console.print(f"[yellow]note:[/] {conftest} needs {', '.join(needs)} (its imports, or theirs), not installed "
                      f"here: no test under it can run on this machine without (`pip install {' '.join(needs)}`; "
                      f"until then their probes are skipped, not failed)", highlight=False)
    if (ignored := _ignored_by_git(out)) is not None:
        console.print(f"[yellow]note:[/] git ignores {out} here ({ignored}): a session judges by this copy as it "
                      f"is, but it is not committed with the tree; `git add -f {out}` keeps it", highlight=False)
    check = f"infra-agent manifest check {root}" + (f" --manifest {out}" if manifest else "")
    console.print(f"next: [bold]{check}[/], then [bold]infra-agent feedback --target {root}"
                  + (f" --manifest {out}" if manifest else "") + "[/]", highlight=False)


def _ignored_by_git(path) -> str | None:
    """The ignore rule (``.gitignore:33: *.yaml``) by which git ignores ``path``, or None where it does not."""
    import pathlib

    from feedback.changes import git

    try:
        out = git(path.parent.resolve(), "check-ignore", "-v", path.name)
    except OSError:  # no git here
        return None
    text = out.stdout.decode(errors="replace")
    if out.returncode != 0 or not text.strip():
        return None
    source, line, pattern = text.split("\t")[0].split(":", 2)
    return f"{pathlib.Path(source).name}:{line}: {pattern}"


def _target_root(directory: str | None):
    import pathlib

    if directory is None:
        from feedback.targets import bundled_tree

        return bundled_tree()
    root = pathlib.Path(directory)
    if not root.is_dir():
        fail(f"target {directory} is not a directory")
    return root.resolve()


@app.command()
def feedback(
    target: str = typer.Option(None, "--target", help="target root with an infra-agent.yaml (default: bundled stack)"),
    probe: list[str] = typer.Option(None, "--probe", help="run these probes (repeatable)"),
    changed_from: str = typer.Option(None, "--changed-from", help="select probes covering files changed since REV"),
    diff: str = typer.Option(None, "--diff", help="select probes covering the files a unified diff touches"),
    run_all: bool = typer.Option(False, "--all", help="run every stage even after a failing one"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    trace_dir: str = typer.Option(None, "--trace-dir", help="where trace probes write Chrome/Perfetto traces"),
    baseline: str = typer.Option(None, "--baseline", help="compare against this revision (default: --changed-from)"),
    jobs: int = typer.Option(2, "--jobs", "-j", min=1, help="probes run in parallel"),
    no_cache: bool = typer.Option(False, "--no-cache", help="ignore cached probe results"),
    manifest_file: str = typer.Option(None, "--manifest", help="a manifest kept outside the target tree (the judges "
                                                               "then live where no change to the tree reaches them)"),
    executor: str = typer.Option("local", "--executor", help="local (subprocesses here) or ray"),
    address: str = typer.Option(None, "--address", help="with --executor ray: an existing cluster (default: a "
                                                        "local Ray instance for this run)"),
    fail_on: str = typer.Option("any", "--fail-on", help="any: exit 1 when a probe fails; new: beside a baseline "
                                                         "(--changed-from, --baseline), only when the change breaks "
                                                         "or slows what held there (verdict incorrect or worse)"),
) -> None:
    """Judge a target tree with its probes: correctness, microbenchmarks, traces, events, serving metrics.

    Exit code 0: every probe passed (with ``--fail-on new``: the change broke nothing that held on the
    baseline); 1: a probe or an acceptance criterion failed; 2: usage or manifest error.
    """
    import pathlib

    from feedback import memo
    from feedback.changes import DiffError, changed_files
    from feedback.harness import UnknownProbe, export_baseline, judge
    from feedback.manifest import ManifestError, load_manifest, parse_manifest
    from feedback.models import FeedbackReport

    if changed_from and diff:
        fail("--changed-from and --diff are alternatives: give one")
    if fail_on not in ("any", "new"):
        fail(f"--fail-on {fail_on}: give 'any' or 'new'")
    if fail_on == "new" and not (changed_from or baseline):
        fail("--fail-on new judges a change beside its baseline: give --changed-from REV or --baseline REV")
    if diff and not pathlib.Path(diff).is_file():
        fail(f"--diff {diff}: no such file")
    root = _target_root(target)
    if manifest_file and not pathlib.Path(manifest_file).is_file():
        fail(f"--manifest {manifest_file}: no such file")
    state = _state(target)
    diff_text = pathlib.Path(diff).read_text(errors="replace") if diff else None
    manifest_text = pathlib.Path(manifest_file).read_text() if manifest_file else None
    # an unchanged re-run: the last fully cached run's report (feedback/memo.py)
    request = (memo.Request(root, probes=probe, changed_from=changed_from, diff_text=diff_text, run_all=run_all,
                            baseline=baseline, manifest_file=manifest_file, manifest_text=manifest_text)
               if not no_cache and executor == "local" and not trace_dir else None)
    if request is not None and (hit := memo.lookup(state.memos, request, state.cache)) is not None:
        _print_report(hit.report, as_json)
        err_console.print(memo.note(hit), style="dim", highlight=False)
        raise typer.Exit(hit.code if fail_on == "any" else _exit_code(FeedbackReport.model_validate_json(hit.report),
                                                                      fail_on))
    recorder = memo.Recorder(state.memos, request, state.cache) if request is not None else None
    try:
        manifest = parse_manifest(manifest_text, manifest_file) if manifest_file else load_manifest(root)
        if recorder is not None:
            recorder.extend(manifest.probe_roots())
        # the files changed since --changed-from: the memo's observation asked git already
        seen = recorder.before["git"] if recorder is not None and recorder.before is not None else {}
        changed = seen["changed"] if "changed" in seen else changed_files(root, since=changed_from, diff=diff_text)
        base_rev = baseline or changed_from
        keep = None
        base_tree = None
        if base_rev:  # kept by commit in the state folder: a repeated comparison exports nothing
            base_tree, keep = export_baseline(root, base_rev, store=state.baselines)
        extra_env = {"INFRA_AGENT_TRACE_DIR": str(pathlib.Path(trace_dir).resolve())} if trace_dir else None
        options = dict(manifest=manifest, probe_ids=probe or None, changed=changed, run_all=run_all,
                       baseline_tree=base_tree, baseline_label=base_rev, jobs=jobs, use_cache=not no_cache,
                       extra_env=extra_env, cache_dir=state.cache,
                       baseline_manifest=manifest if manifest_file else None)
        with _executor(executor, address, jobs) as ex:
            report = _run_with_progress(judge, root, quiet=as_json, executor=ex, **options)
        if recorder is not None:
            try:
                _remember(recorder, report, lambda: judge(root, executor=memo.CacheOnly(), **options))
            except Exception as exc:  # noqa: BLE001 - a memo saves time; its failure never costs the report
                err_console.print(f"no memo written: {exc}", style="dim", highlight=False)
        if keep is not None:
            keep.cleanup()
    except (ManifestError, UnknownProbe, DiffError, ValueError) as exc:
        fail(str(exc))
    _print_report(report, as_json)
    raise typer.Exit(_exit_code(report, fail_on))


def _exit_code(report, fail_on: str) -> int:
    """``feedback``'s exit code: 1 where a probe failed, or with ``fail_on='new'`` where the change is judged
    incorrect or worse than its baseline (a check failing on the baseline too is the repository's, not the
    change's: a CI job on a tree with a known failure still tells a new problem from the old one)."""
    if fail_on == "new":
        from feedback.verdict import verdict

        return 1 if (report.verdict or verdict(report)).name in ("incorrect", "worse") else 0
    return 0 if report.passed else 1


def _print_report(report, as_json: bool) -> None:
    """A report (a FeedbackReport, or a memo's JSON text of one) as JSON, or rendered for the terminal."""
    if isinstance(report, str) and as_json:
        print(report)
        return
    from feedback.models import FeedbackReport
    from feedback.report import render

    if isinstance(report, str):
        report = FeedbackReport.model_validate_json(report)
    if as_json:
        print(report.model_dump_json(indent=2))
    else:
        render(report, console.get())


def _remember(recorder, report, judge_cached) -> None:
    """Store the report an unchanged re-run would print as its memo: this one when every result came from
    the cache, else the cache's own answer judged once more (``judge_cached``: nothing runs; a probe
    the cache lacks leaves no memo)."""
    def whole(r) -> bool:
        # a result that lacked a package is asked again on each run (the memo cannot see an installation)
        return all(x.cached and not x.absent for x in [*r.results, *r.baseline_results]) and not r.judges_changed

    if recorder.before is None:  # not memoisable (feedback/memo.py says why): no second judgement
        return
    if not whole(report):
        recorder = recorder.renew()
        report = judge_cached()
        if not whole(report):
            return
    recorder.keep(report.model_dump_json(indent=2), 0 if report.passed else 1)


def _events(as_json: bool):
    """A session's event printer: one plain line per event under ``--json``, else rich on the terminal."""
    from infra_agent.session import print_event, print_progress

    return print_progress() if as_json else print_event(console.get())


def _run_with_progress(judge_fn, root, quiet: bool, **kwargs):
    """Run the harness with a live progress display on a terminal; elsewhere (a log, a CI job, ``--json``)
    one plain line on stderr per probe as it ends, so a run cut short still says how far it got."""
    if quiet or not err_console.is_terminal:
        import sys
        import time

        t0 = time.perf_counter()

        def on_start(specs):
            sides = " (candidate and baseline)" if kwargs.get("baseline_tree") else ""
            print(f"running {len(specs)} probes{sides}: {', '.join(s.id for s in specs)}", file=sys.stderr, flush=True)

        def on_result(side, result):
            cached = ", cached" if result.cached else ""
            print(f"[{time.perf_counter() - t0:6.1f}s] {side} {result.probe}: {result.status.value} "
                  f"({result.duration_s:.1f} s{cached})", file=sys.stderr, flush=True)

        return judge_fn(root, on_start=on_start, on_result=on_result, **kwargs)
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=err_console.get(), transient=True) as progress:
        task = progress.add_task("probes", total=0)

        def on_start(specs):
            progress.update(task, total=len(specs) * (2 if kwargs.get("baseline_tree") else 1),
                            description=f"running {len(specs)} probes")

        def on_result(side, result):
            progress.advance(task)
            progress.update(task, description=f"{side} {result.probe}: {result.status.value}")

        return judge_fn(root, on_start=on_start, on_result=on_result, **kwargs)


playbooks_app = typer.Typer(help="Optimisation playbooks: when they apply, what they change, how to validate.",
                             no_args_is_help=True)
app.add_typer(playbooks_app, name="playbooks")


def _library():
    from playbooks.model import PlaybookError, load_library

    try:
        return load_library()
    except PlaybookError as exc:
        fail(str(exc))


@playbooks_app.command("list")
def playbooks_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """List the playbooks."""
    from rich.table import Table

    lib = _library()
    if as_json:
        import json

        print(json.dumps([{"id": p.id, "title": p.title, "sources": p.sources, "risk": p.risk,
                           "executable": p.transformation.transform is not None} for p in lib.values()], indent=2))
        return
    table = Table("id", "title", "from", "risk", "transform")
    for p in lib.values():
        table.add_row(p.id, p.title, ", ".join(p.sources), ", ".join(p.risk) or "-",
                      "executable" if p.transformation.transform else "text")
    console.print(table)


@playbooks_app.command("show")
def playbooks_show(playbook_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Show one playbook in full."""
    import yaml

    lib = _library()
    if playbook_id not in lib:
        fail(f"unknown playbook {playbook_id!r}; known: {', '.join(lib)}")
    console.print(yaml.safe_dump(lib[playbook_id].model_dump(mode="json", exclude_none=True), sort_keys=False,
                                 width=100), highlight=False, soft_wrap=True)


@app.command("gate")
def gate_cmd(
    diff_file: str = typer.Argument(..., metavar="DIFF_FILE", help="a unified diff"),
    target: str = typer.Option(None, "--target", help="target root: the tree the diff applies to (its manifest's risk "
                                                      "rules and protected paths; default: the bundled target)"),
    manifest_file: str = typer.Option(None, "--manifest", help="a manifest kept outside the target tree"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Classify a patch's risk: numerics, concurrency, production.

    A target without a manifest (and no --manifest) is judged on the built-in rules alone, with no
    protected paths; a note on stderr says so.  Exit code 0: clean; 1: held for review; 2: refused (a
    protected path) or error.
    """
    import pathlib

    from feedback.manifest import MANIFEST_NAME, Manifest, ManifestError, load_manifest
    from infra_agent.gate import assess_text

    path = pathlib.Path(diff_file)
    if not path.is_file():
        fail(f"no such diff file: {diff_file}")
    root = _target_root(target)
    try:
        if manifest_file is None and not (root / MANIFEST_NAME).is_file():
            err_console.print(f"[yellow]note:[/] {root} has no {MANIFEST_NAME}: the built-in rules only, "
                              "no protected paths (--manifest FILE names one kept elsewhere)", highlight=False,
                              soft_wrap=True)
            manifest = Manifest(name=root.name, probes=[])
        else:
            manifest = load_manifest(root, manifest_file)
    except ManifestError as exc:
        fail(str(exc))
    result = assess_text(path.read_text(errors="replace"), manifest, root)
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        style = {"clean": "green", "held": "yellow"}.get(result.decision, "red")
        from infra_agent.gate import by_line

        held = result.decision == "held"
        rest = [c for c in result.categories if c != "error"]
        also = (f" (the rest alone would be held: {', '.join(rest)})" if result.refused and rest else
                " (and the rest could not be classified)" if result.refused and result.error else "")
        console.print(f"[{style}]{result.decision}[/]" + (f": {', '.join(result.categories)}" if held else also))
        for line in by_line(result.findings):
            console.print(f"  {line}", highlight=False, soft_wrap=True)
        for why in (result.refused, result.error):  # a refusal and the error that stopped the rest: both said
            if why:
                console.print(f"  {why}", highlight=False, soft_wrap=True)
    raise typer.Exit({"clean": 0, "held": 1}.get(result.decision, 2))


review_app = typer.Typer(help="The review queue: patches held by the risk gate, for a person to settle.",
                          invoke_without_command=True)
app.add_typer(review_app, name="review")


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (``timeout``, a batch scheduler, ``kill``) stops a session as Ctrl-C does: the probe processes
    killed, the attempts so far recorded, the summary written and printed, exit code 130.  A second SIGTERM
    kills outright.  Installed only where a handler can be (the main thread)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _executor(kind: str, address: str | None, jobs: int):
    """Where probes run, as a context manager: nothing (local subprocesses) or a Ray executor."""
    if kind == "local":
        if address:
            fail("--address names a Ray cluster: give --executor ray too")
        return contextlib.nullcontext(None)
    if kind != "ray":
        fail(f"--executor must be local or ray, got {kind!r}")
    from feedback.ray_executor import RayExecutor

    try:
        return RayExecutor(address=address, num_cpus=max(jobs, 2) if not address else None)
    except (RuntimeError, ConnectionError, ValueError) as exc:
        fail(f"--executor ray: {str(exc).splitlines()[0]}")


def _state(target: str | None):
    """The state folder: the current directory's for the bundled target, the state home's for a repository."""
    from feedback.state import StateDir

    return StateDir.for_target(target) if target else StateDir.of()


def _here(target: str | None) -> str | None:
    """``--target``, else, where the current directory holds no session of the bundled target, the repository
    it lies in if that has state of its own (a session run there with ``--target .``), said on stderr; else
    None (the bundled target's state, here)."""
    import pathlib

    from feedback.changes import repo_root
    from feedback.state import StateDir

    if target is not None or any(StateDir.of().workspaces.glob("*/session.json")):
        return target
    top = repo_root(pathlib.Path.cwd())
    if top is None or not StateDir.for_target(top).root.exists():
        return None
    err_console.print(f"target {top} (the repository here; --target to choose another)", style="dim",
                      highlight=False, soft_wrap=True)  # a path broken across lines cannot be pasted back
    return str(top)


def _queue(target: str | None):
    from infra_agent.review import ReviewQueue

    return ReviewQueue(_state(target).review_db)


def _render_item(item, full: bool = True) -> None:
    from rich.syntax import Syntax
    from rich.table import Table

    from feedback.report import NARROW_COLUMNS

    style = {"numerics": "magenta", "concurrency": "red", "production": "yellow"}
    cats = " ".join(f"[{style.get(c, 'white')}]{c}[/]" for c in item.categories)
    console.print(f"[bold]item {item.id}[/] [{item.state}] {cats}  target {item.target}  session {item.session}")
    console.print(f"hypothesis: {item.hypothesis}", highlight=False, soft_wrap=True)
    if item.playbook:
        console.print(f"playbook: {item.playbook}")
    if item.settled_by:
        console.print(f"settled by {item.settled_by} at {item.settled_at}: "
                      f"{item.comment or item.reason or ''}", highlight=False)
    if item.note:
        console.print(f"note: {item.note}", highlight=False)
    if not full:
        return
    from infra_agent.gate import by_line

    for line in by_line(item.findings):
        console.print(f"  gate {line}", highlight=False, soft_wrap=True)
    console.print(Syntax(item.diff, "diff", theme="ansi_dark", word_wrap=True))
    ci = lambda c: f" [{c[0]:.3g}, {c[1]:.3g}]" if c else ""  # noqa: E731
    rows = [(e["probe"], e["metric"], "-" if e["before"] is None else f"{e['before']:.3g}{ci(e['before_ci'])}",
             f"{e['after']:.3g}{ci(e['after_ci'])}", f"{e['status_before'] or '-'} -> {e['status_after']}")
            for e in item.evidence]
    if console.width < NARROW_COLUMNS:  # one line per metric, its full name first
        console.print("[bold]evidence[/] (probe.metric: before -> after, status)")
        for probe, metric, before, after, status in rows:
            console.print(f"  {probe}.{metric}: {before} -> {after} ({status})", highlight=False, soft_wrap=True)
        return
    table = Table("probe", "metric", "before", "after", "status")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _settle(target, item_id: int, decision: str, reviewer: str | None, comment=None, reason=None,
            as_json=False, jobs: int = 2) -> None:
    from infra_agent.review import AlreadySettled, UnknownItem, settle

    if decision == "approved" and not as_json:
        console.print(f"approving item {item_id}: merging into its session branch and re-validating ...")
    try:
        item, warnings = settle(_queue(target), item_id, decision, reviewer, comment=comment, reason=reason,
                                jobs=jobs)
    except (AlreadySettled, UnknownItem, ValueError) as exc:
        fail(str(exc).strip("'\""))
    for w in warnings:
        err_console.print(f"[yellow]warning:[/] {w}", soft_wrap=True)
    if as_json:
        print(item.model_dump_json(indent=2))
    else:
        _render_item(item, full=False)
    if decision == "approved" and item.state != "applied":
        raise typer.Exit(1)


@review_app.callback()
def review_main(ctx: typer.Context, target: str = typer.Option(None, "--target"),
                reviewer: str = typer.Option(None, "--reviewer")) -> None:
    """Without a subcommand: the interactive queue (open an item, approve, reject with a reason, or skip)."""
    # `review --target DIR list` means the same as `review list --target DIR` (the group's options are the defaults)
    ctx.obj = {"target": target, "reviewer": reviewer}
    if ctx.invoked_subcommand is not None:
        return
    target = _here(target)
    from rich.prompt import Prompt

    q = _queue(target)
    while True:
        pending = q.list(state="pending")
        if not pending:
            console.print("[green]no pending items[/]")
            return
        for item in pending:
            _render_item(item, full=False)
        choice = Prompt.ask("open item (number) or q to quit", default="q")
        if choice.strip().lower() in ("q", "quit", ""):
            return
        if not choice.isdigit() or int(choice) not in {i.id for i in pending}:
            console.print(f"[red]no pending item {choice}[/]")
            continue
        item = q.get(int(choice))
        _render_item(item)
        page = _state(target).session(item.session) / "report.html"  # the session's pictures, if it drew them
        if page.is_file():
            console.print(f"report: {page}", highlight=False)
        # "\[": literal brackets; "[a]" alone is rich markup and vanished ("pprove, eject, kip")
        act = Prompt.ask(r"\[a]pprove, \[r]eject, \[s]kip" + (r", \[o]pen the report" if page.is_file() else ""),
                         choices=["a", "r", "s", *(["o"] if page.is_file() else [])], default="s")
        if act == "o":
            import webbrowser

            if not webbrowser.open(page.as_uri()):
                console.print(f"no browser here: open {page}", highlight=False)
            continue
        if act == "a":
            comment = Prompt.ask("comment (optional)", default="")
            try:
                _settle(target, item.id, "approved", reviewer, comment=comment or None)
            except typer.Exit:
                pass
        elif act == "r":
            reason = ""
            while not reason.strip():
                reason = Prompt.ask("reason (the agent's next session reads it)")
            _settle(target, item.id, "rejected", reviewer, reason=reason)


def _group(ctx: typer.Context, name: str, value):
    """A review subcommand's own option, else the one given to ``review`` itself."""
    return value if value is not None else (ctx.obj or {}).get(name)


@review_app.command("list")
def review_list(ctx: typer.Context, target: str = typer.Option(None, "--target"),
                state: str = typer.Option(None, "--state"), as_json: bool = typer.Option(False, "--json")) -> None:
    """List review items."""
    target = _here(_group(ctx, "target", target))
    items = _queue(target).list(state=state)
    if as_json:
        print("[" + ",".join(i.model_dump_json() for i in items) + "]")
        return
    from rich.table import Table

    table = Table("id", "state", "risk", "playbook", "hypothesis", "settled by")
    table.columns[3].overflow = "fold"  # playbook ids whole (folded), never cut into an ellipsis
    for i in items:
        table.add_row(str(i.id), i.state, ", ".join(i.categories), i.playbook or "-", i.hypothesis[:60],
                      i.settled_by or "-")
    console.print(table)


@review_app.command("show")
def review_show(ctx: typer.Context, item_id: int = typer.Argument(..., metavar="ID"),
                target: str = typer.Option(None, "--target"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Show one item: hypothesis, gate findings, the diff, the evidence."""
    from infra_agent.review import UnknownItem

    target = _here(_group(ctx, "target", target))
    try:
        item = _queue(target).get(item_id)
    except UnknownItem as exc:
        fail(str(exc).strip("'\""))
    if as_json:
        print(item.model_dump_json(indent=2))
    else:
        _render_item(item)
        page = _state(target).session(item.session) / "report.html"
        if page.is_file():
            console.print(f"report: {page}", highlight=False)


@app.command()
def report(
    session: str = typer.Argument(None, help="a session id (default: the latest of the target)"),
    target: str = typer.Option(None, "--target", help="the repository (default: the bundled target here)"),
    html_file: str = typer.Option(None, "--html", help="where to write the page (default: the session's report.html)"),
    experiments: str = typer.Option(None, "--experiments", help="a folder of experiment records instead of a session"),
) -> None:
    """One self-contained HTML page: the goal, the baseline's feedback, every attempt with its plots."""
    import pathlib

    from infra_agent.report import records_report, session_report
    from infra_agent.workspace import list_sessions

    if experiments:
        folder = pathlib.Path(experiments)
        if not folder.is_dir():
            fail(f"--experiments {experiments}: no such folder")
        text, default = records_report(folder), folder / "report.html"
    else:
        target = _here(target)
        sessions = list_sessions(pathlib.Path(target) if target else None)
        chosen = [s for s in sessions if s["session"] == session] if session else sessions[-1:]
        if not chosen:
            fail(f"no session {session!r}" if session else "no sessions yet (infra-agent run starts one)")
        state = _state(target)
        text = session_report(pathlib.Path(chosen[0]["dir"]), state.experiments)
        default = pathlib.Path(chosen[0]["dir"]) / "report.html"
    out = pathlib.Path(html_file) if html_file else default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    console.print(f"[green]wrote[/] {out}", highlight=False)


@review_app.command("approve")
def review_approve(ctx: typer.Context, item_id: int = typer.Argument(..., metavar="ID"),
                   comment: str = typer.Option(None, "--comment"),
                   target: str = typer.Option(None, "--target"), reviewer: str = typer.Option(None, "--reviewer"),
                   as_json: bool = typer.Option(False, "--json"), jobs: int = typer.Option(2, "--jobs", "-j")) -> None:
    """Approve: merge into the session branch, re-run the validation probes, mark applied."""
    target, reviewer = _here(_group(ctx, "target", target)), _group(ctx, "reviewer", reviewer)
    _settle(target, item_id, "approved", reviewer, comment=comment, as_json=as_json, jobs=jobs)


@review_app.command("reject")
def review_reject(ctx: typer.Context, item_id: int = typer.Argument(..., metavar="ID"),
                  reason: str = typer.Option(..., "--reason", help="why (the agent's next session reads it)"),
                  target: str = typer.Option(None, "--target"), reviewer: str = typer.Option(None, "--reviewer"),
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """Reject with a reason."""
    target, reviewer = _here(_group(ctx, "target", target)), _group(ctx, "reviewer", reviewer)
    _settle(target, item_id, "rejected", reviewer, reason=reason, as_json=as_json)


@app.command("replay")
def replay_cmd(
    paths: list[str] = typer.Argument(None, help="records or folders of records (default: experiments/)"),
    junit: str = typer.Option(None, "--junit", help="write JUnit XML here"),
    as_json: bool = typer.Option(False, "--json"),
    jobs: int = typer.Option(2, "--jobs", "-j", min=1),
) -> None:
    """Re-check experiment records: rebuild the base, apply the diff, re-run the recorded probes.

    Each record ends pass, regressed or stale, with its reason. Exit code 1 on any regression.
    """
    import json
    import pathlib

    from infra_agent.experiments import junit_xml, replay

    files: list[pathlib.Path] = []
    for p in paths or ["experiments"]:
        path = pathlib.Path(p)
        if path.is_dir():
            files += sorted(path.glob("*.yaml"))
        elif path.is_file():
            files.append(path)
        else:
            fail(f"no such record or folder: {p}")
    if not files:
        fail("no experiment records found")
    results = []
    for f in files:
        if not as_json:
            console.print(f"[dim]replaying {f} ...[/]")
        r = replay(f, jobs=jobs)
        results.append(r)
        if not as_json:
            style = {"pass": "green", "regressed": "red", "stale": "yellow"}[r.status]
            console.print(f"[{style}]{r.status}[/] {r.record}: {r.reason} [dim]({r.duration_s:.1f}s)[/]",
                          highlight=False, soft_wrap=True)
            for d in r.details:
                console.print(f"    {d}", highlight=False, soft_wrap=True)
    if junit:
        pathlib.Path(junit).write_text(junit_xml(results))
    if as_json:
        print(json.dumps([r.model_dump() for r in results], indent=2))
    else:
        counts = {s: sum(r.status == s for r in results) for s in ("pass", "regressed", "stale")}
        console.print(f"replay: {counts['pass']} pass, {counts['regressed']} regressed, {counts['stale']} stale")
    raise typer.Exit(1 if any(r.status == "regressed" for r in results) else 0)


DEFAULT_GOAL = ("Find and fix what the feedback flags (failing probes, acceptance criteria), then look for speed "
                "where the microbenchmarks show headroom.")


@app.command()
def run(
    target: str = typer.Option(None, "--target", help="a git repository with an infra-agent.yaml (default: bundled)"),
    goal: str = typer.Option(None, "--goal", help="the task given to the agent (default: the scenario's goal, "
                                                  "else: fix what the feedback flags)"),
    scenario: str = typer.Option(None, "--scenario", help="bundled target only: start from a scenario's defect "
                                                          "(`infra-agent scenarios` lists them), or 'all'"),
    backend: str = typer.Option(None, "--backend", help="offline | openai | replay (default: openai when an API key "
                                                        "is set, else offline)"),
    model: str = typer.Option(None, "--model", help="model name for the openai backend"),
    base_url: str = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint"),
    trajectory: str = typer.Option(None, "--trajectory", help="replay backend: the trajectory JSONL to replay"),
    max_steps: int = typer.Option(20, "--max-steps", min=1),
    time_limit: float = typer.Option(1800.0, "--time-limit", min=1.0, help="seconds"),
    jobs: int = typer.Option(2, "--jobs", "-j", min=1),
    as_json: bool = typer.Option(False, "--json", help="print the session summary as JSON"),
    manifest_file: str = typer.Option(None, "--manifest", help="with --target: judge by this manifest, kept outside "
                                                               "the target (the agent can then not even see it)"),
    executor: str = typer.Option("local", "--executor", help="local (subprocesses here) or ray"),
    address: str = typer.Option(None, "--address", help="with --executor ray: an existing cluster (default: a "
                                                        "local Ray instance for the session)"),
    parallel: int = typer.Option(1, "--parallel", min=1, help="judge up to N of the backend's next candidate "
                                                             "patches together, ahead (decisions stay sequential)"),
    resume: str = typer.Option(None, "--resume", metavar="SESSION",
                               help="go on with a session that was killed or stopped (`infra-agent sessions list`): "
                                    "its branch, attempts and conversation; --max-steps more steps"),
) -> None:
    """Run an agent session: feedback, hypotheses, patches judged by the harness, a summary.

    Exit code 0: the session finished with no failing probe left unaddressed (fixed, or held for
    review) and, for a scenario, its acceptance holding; 1: not so; 2: usage error; 130: interrupted
    by Ctrl-C or SIGTERM (everything so far is kept, the summary printed).
    """
    import json

    from infra_agent.scenarios import ScenarioError, resolve
    from infra_agent.session import BACKENDS, default_backend

    if resume:
        if scenario:
            fail("--resume goes on with a session as it was started; --scenario starts a new one")
        with _terminate_as_interrupt(), _executor(executor, address, jobs) as ex:
            return _resume(resume, target, goal, backend, model, base_url, trajectory, max_steps, time_limit, jobs,
                           as_json, ex)
    backend = backend or default_backend()
    if backend not in BACKENDS:
        fail(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if target and scenario:
        fail("--scenario applies to the bundled target; an external target carries its own history")
    if manifest_file and not target:
        fail("--manifest names the judges of an external target: give --target too")
    try:
        chosen = resolve(scenario) if scenario else [None]
    except ScenarioError as exc:
        fail(str(exc))
    summaries: list[dict] = []
    with _terminate_as_interrupt(), _executor(executor, address, jobs) as ex:
        _run_sessions(chosen, summaries, target, manifest_file, backend, model, base_url, trajectory, goal,
                      max_steps, time_limit, jobs, as_json, ex, parallel)
    outcome = summaries[-1]["outcome"] if summaries else "finished"
    if as_json:
        print(json.dumps(summaries[0] if len(chosen) == 1 else summaries, indent=2, default=str))
    elif len(chosen) > 1:
        _render_scenarios_run(summaries)
    codes = [s["exit_code"] if not s.get("scenario") or s["scenario"]["solved"] != "no" else 1 for s in summaries]
    raise typer.Exit(130 if outcome == "interrupted" else max(codes))


def _run_sessions(chosen, summaries, target, manifest_file, backend, model, base_url, trajectory, goal, max_steps,
                  time_limit, jobs, as_json, ex, parallel: int = 1) -> None:
    """One session per scenario (or one on the target), their summaries appended as they end."""
    import pathlib

    from feedback.manifest import ManifestError
    from infra_agent.agent import Limits
    from infra_agent.session import make_backend, render_summary, run_session
    from infra_agent.workspace import GitWorkspace, new_session_id

    for n, sc in enumerate(chosen, 1):
        session = new_session_id()
        try:
            ws = (GitWorkspace.external(pathlib.Path(target), session,
                                        pathlib.Path(manifest_file) if manifest_file else None) if target
                  else GitWorkspace.bundled(session, scenario=sc.name if sc else None))
            be = make_backend(backend, ws, model=model, base_url=base_url, trajectory=trajectory)
        except ValueError as exc:
            fail(str(exc))
        if not as_json:
            if len(chosen) > 1:
                console.rule(f"scenario {n}/{len(chosen)}: {sc.name}", style="bold")
            if sc:
                console.print(f"[bold]{sc.name}[/] ({sc.risk}): {sc.defect.strip()}", highlight=False)
            console.print(f"[bold]session {session}[/] on {ws.target_label}, backend {backend}"
                          + (f" ({be.model})" if getattr(be, "model", None) else "") + f", branch {ws.branch}")
            if ws.manifest_note:
                console.print(f"[yellow]{ws.manifest_note}[/]", highlight=False)
        task = goal or (sc.goal.strip() if sc else DEFAULT_GOAL)
        ws.update_meta(goal=task, backend=backend, model=getattr(be, "model", None), base_url=base_url,
                       trajectory=trajectory)
        limits = Limits(max_steps=max_steps, time_limit_s=time_limit, parallel=parallel)
        try:
            outcome, summary = run_session(ws, be, task, limits, jobs=jobs,
                                           on_event=_events(as_json), scenario=sc,
                                           executor=ex)
        except ManifestError as exc:  # the judges cannot be read: nothing was judged, nothing is lost
            fail(f"session {session}: {exc}")
        summaries.append(summary)
        if not as_json:
            render_summary(summary, console.get())
        if outcome == "interrupted":
            break


def _resume(session: str, target, goal, backend, model, base_url, trajectory, max_steps: int, time_limit: float,
            jobs: int, as_json: bool, executor=None) -> None:
    """``run --resume SESSION``: the session's workspace, backend and goal as it was started (options given
    now win), on from where its trajectory and records stop."""
    import json

    from infra_agent.agent import Limits
    from infra_agent.resume import ResumeError
    from infra_agent.scenarios import ScenarioError, resolve
    from infra_agent.session import make_backend, render_summary, run_session
    from infra_agent.workspace import GitWorkspace

    state = _state(target)
    try:
        ws = GitWorkspace.reopen(state, session)
        meta = ws.meta()
        sc = resolve(meta["scenario"])[0] if meta.get("scenario") else None
        be = make_backend(backend or meta.get("backend"), ws, model=model or meta.get("model"),
                          base_url=base_url or meta.get("base_url"), trajectory=trajectory or meta.get("trajectory"))
    except (ValueError, ScenarioError, json.JSONDecodeError) as exc:
        fail(str(exc))
    if not as_json:
        console.print(f"[bold]resuming session {session}[/] on {ws.target_label}, backend {be.name}, "
                      f"branch {ws.branch}", highlight=False)
    try:
        outcome, summary = run_session(ws, be, goal or meta.get("goal") or DEFAULT_GOAL,
                                       Limits(max_steps=max_steps, time_limit_s=time_limit), jobs=jobs,
                                       on_event=_events(as_json), scenario=sc,
                                       resume=True, executor=executor)
    except ResumeError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        render_summary(summary, console.get())
    solved = not summary.get("scenario") or summary["scenario"]["solved"] != "no"
    raise typer.Exit(130 if outcome == "interrupted" else summary["exit_code"] if solved else 1)


def _render_scenarios_run(summaries: list[dict]) -> None:
    from rich.table import Table

    table = Table("scenario", "risk", "solved", "attempts", title="scenarios", title_justify="left")
    for s in summaries:
        sc = s["scenario"]
        style = "green" if sc["solved"] == "on the branch" else "yellow" if sc["solved"] != "no" else "red"
        table.add_row(sc["name"], sc["risk"], f"[{style}]{sc['solved']}[/]", str(len(s["attempts"])))
    console.print(table)
    items = [i for s in summaries for i in s["scenario"]["review_items"]]
    if items:
        console.print(f"held for review: items {', '.join(map(str, items))}; "
                      "open the queue with: infra-agent review", highlight=False)


@app.command("scenarios")
def scenarios_cmd(as_json: bool = typer.Option(False, "--json")) -> None:
    """List the bundled target's scenarios: the defect, its files, the acceptance criteria, the risk."""
    from rich.table import Table

    from infra_agent.scenarios import ScenarioError, load_scenarios

    try:
        known = load_scenarios()
    except ScenarioError as exc:
        fail(str(exc))
    if as_json:
        import json

        print(json.dumps([sc.model_dump(mode="json", exclude={"patch"}) for sc in known.values()], indent=2))
        return
    table = Table("scenario", "defect", "files", "acceptance", "risk")
    for sc in known.values():
        table.add_row(sc.name, sc.defect.strip(), "\n".join(sc.files), "\n".join(sc.acceptance), sc.risk)
    console.print(table)
    console.print("run one with: infra-agent run --scenario NAME (or --scenario all)", highlight=False)


sessions_app = typer.Typer(help="Agent sessions: their branches, attempts and trajectories.", no_args_is_help=True)
app.add_typer(sessions_app, name="sessions")


@sessions_app.command("list")
def sessions_list(target: str = typer.Option(None, "--target"), as_json: bool = typer.Option(False, "--json")) -> None:
    """List sessions (of the bundled target in this directory, or of --target)."""
    import json
    import pathlib

    from rich.table import Table

    from infra_agent.workspace import list_sessions

    target = _here(target)
    sessions = list_sessions(pathlib.Path(target) if target else None)
    if as_json:
        print(json.dumps(sessions, indent=2, default=str))
        return
    table = Table("session", "target", "branch", "started", "outcome", "attempts")
    table.columns[0].no_wrap = True
    for s in sessions:
        summ = s.get("summary", {})
        table.add_row(s["session"], s["target"], s["branch"], s["started"], summ.get("outcome", "-"),
                      str(len(summ.get("attempts", []))) if summ else "-")
    console.print(table)


@sessions_app.command("show")
def sessions_show(session: str = typer.Argument(...), target: str = typer.Option(None, "--target")) -> None:
    """Show one session's summary."""
    import pathlib

    from infra_agent.session import render_summary
    from infra_agent.workspace import list_sessions

    target = _here(target)
    found = [s for s in list_sessions(pathlib.Path(target) if target else None) if s["session"] == session]
    if not found:
        fail(f"no session {session!r}")
    if "summary" not in found[0]:
        fail(f"session {session} has no summary (still running, or killed before the end)")
    render_summary(found[0]["summary"], console.get())


@sessions_app.command("clean")
def sessions_clean(target: str = typer.Option(None, "--target"),
                   keep_branches: bool = typer.Option(False, help="keep the session branches")) -> None:
    """Remove session folders and worktrees (and their branches unless --keep-branches)."""
    import pathlib

    from infra_agent.workspace import list_sessions, remove_session

    target = _here(target)
    sessions = list_sessions(pathlib.Path(target) if target else None)
    for s in sessions:
        remove_session(s, keep_branches=keep_branches)
    console.print(f"removed {len(sessions)} session(s)")


def main() -> None:  # pragma: no cover - console script entry point
    app()
if __name__ == "__main__":  # pragma: no cover
    main()
