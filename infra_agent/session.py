"""Session plumbing for ``infra-agent run``: backend choice, the live view, the summary."""

from __future__ import annotations

import dataclasses
import json
import os

from rich.console import Console
from rich.table import Table

from feedback.report import NARROW_COLUMNS
from infra_agent.agent import Agent, Limits
from infra_agent.scenarios import Scenario
from infra_agent.trajectory import KEY_VARS

BACKENDS = ("offline", "openai", "replay")


def default_backend() -> str:
    """openai when an API key is set, else the offline playbook policy (no key, no network)."""
    return "openai" if any(os.environ.get(v) for v in KEY_VARS) else "offline"


def make_backend(kind: str | None, workspace, *, model: str | None = None, base_url: str | None = None,
                 trajectory: str | None = None):
    """The backend named ``kind`` (None: :func:`default_backend`); ``ValueError`` for an unknown one or
    missing arguments.  Each backend is imported only when chosen (the openai SDK is not needed offline)."""
    kind = kind or default_backend()
    if kind == "offline":
        from infra_agent.backends.offline import OfflineBackend

        return OfflineBackend(workspace)
    if kind == "openai":
        from infra_agent.backends.openai_backend import OpenAIBackend

        return OpenAIBackend(model=model, base_url=base_url)
    if kind == "replay":
        from infra_agent.backends.replay import ReplayBackend

        if not trajectory:
            raise ValueError("--backend replay needs --trajectory FILE (a trajectory.jsonl of an earlier session)")
        return ReplayBackend(trajectory)
    raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {kind!r}")


def _probe_line(side: str, r) -> str:
    return f"{side} {r.probe}: {r.status.value} ({r.duration_s:.1f} s{', cached' if r.cached else ''})"


def print_progress(stream=None):
    """The session's progress as plain lines on stderr (``run --json``, whose stdout is the summary): what
    is judged, each probe as it ends, each step and verdict; a run cut short still says how far it got."""
    import sys
    import time

    t0 = time.perf_counter()
    judged = {"what": "candidate"}  # the tree being judged: its probes' results come back as the "candidate" side

    def line(text: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {text}", file=stream or sys.stderr, flush=True)

    def on_event(kind: str, data: dict) -> None:
        if kind == "judging":
            judged["what"] = data["what"]
            line(f"judging {data['what']}" + (f" ({', '.join(data['files'])})" if data.get("files") else ""))
        elif kind == "probe":
            side = judged["what"] if data["side"] == "candidate" else data["side"]
            line("  " + _probe_line(side, data["result"]))
        elif kind == "action":
            line(f"step {data['step']} {data['name']}"
                 + (f" {data['args']['playbook_id']}" if data["args"].get("playbook_id") else ""))
        elif kind == "attempt":
            a = data["attempt"]
            line(f"  verdict {a.verdict} -> {a.decision}: {_clip(a.reason, 200)}")
        elif kind in ("format_error", "warning"):
            line(f"  {kind.replace('_', ' ')}: {data['message']}")

    return on_event


def print_event(console: Console):
    """A live, line-per-event view of the session (each probe's end too where the console is a log)."""

    def on_event(kind: str, data: dict) -> None:
        if kind == "probe":
            if not console.is_terminal:
                console.print(f"[dim]  {_probe_line(data['side'], data['result'])}[/]", highlight=False)
        elif kind == "judging":
            what = data["what"]
            files = f" ({', '.join(data['files'])})" if data.get("files") else ""
            console.print(f"[dim]judging {what}{files} ...[/]")
        elif kind == "feedback":
            from feedback.report import render

            render(data["report"], console)  # the feedback table, localisation lines, acceptance
        elif kind == "action":
            args = data["args"]
            brief = args.get("hypothesis") or args.get("path") or args.get("pattern") or args.get("summary") or ""
            console.print(f"[bold]step {data['step']}[/] {data['name']}"
                          + (f" [cyan]{args.get('playbook_id')}[/]" if args.get("playbook_id") else "")
                          + (f": {_clip(brief, 240)}" if brief else "") + f" [dim]({data.get('budget', '')})[/]",
                          highlight=False)
        elif kind == "attempt":
            a = data["attempt"]
            style = {"accepted": "green", "held": "yellow"}.get(a.decision, "red")
            console.print(f"  verdict [bold]{a.verdict}[/] -> [{style}]{a.decision}[/]: {a.reason}",
                          highlight=False, soft_wrap=True)
            for r in a.risk[:4]:
                console.print(f"  [yellow]gate[/] {r}", highlight=False, soft_wrap=True)
        elif kind == "resumed":
            console.print(f"[bold]{data['text']}[/]", highlight=False)
        elif kind == "format_error":
            console.print(f"  [red]format error[/]: {data['message']}", highlight=False)

    return on_event


def run_session(ws, backend, goal: str, limits: Limits, jobs: int = 2, on_event=None,
                scenario: Scenario | None = None, resume: bool = False, executor=None) -> tuple[str, dict]:
    """One agent session to its end (the workspace's worktrees removed after); the summary is written
    to the session's folder and returned with the outcome.  ``resume``: the session goes on from its
    trajectory and records (:mod:`infra_agent.resume`), ``limits.max_steps`` more steps at most."""
    agent = Agent(backend, ws, goal, limits, jobs=jobs, on_event=on_event, executor=executor)
    try:
        if resume:
            from infra_agent.resume import restore

            where = restore(agent, ws.meta()["base"])
            agent.limits = dataclasses.replace(limits, max_steps=agent.step + limits.max_steps)
            if on_event:
                on_event("resumed", {"text": where})
        outcome = agent.run(restored=resume)
        summary = summarise(agent, scenario)  # the scenario's criteria read the manifest of the live baseline
    finally:
        ws.close()
    (ws.state_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    try:  # the page a reviewer opens (infra-agent review show ID names it)
        from infra_agent.report import session_report

        (ws.state_dir / "report.html").write_text(session_report(ws.state_dir, ws.state.experiments))
        summary["report"] = str(ws.state_dir / "report.html")
    except Exception as exc:  # noqa: BLE001 - a report that cannot be drawn never costs the session
        summary["report_error"] = str(exc)
    return outcome, summary


def scenario_outcome(agent: Agent, scenario: Scenario) -> dict:
    """Whether the scenario's acceptance holds on the session branch (fixes accepted there) or on a
    candidate held for review (fixes waiting for a person), criterion by criterion."""
    manifest = agent.ws.manifest()
    none = [None] * len(scenario.acceptance)
    branch = scenario.check(manifest, agent.feedback) if agent.feedback else none
    held = [(a, scenario.check(manifest, a.report)) for a in agent.attempts if a.decision == "held" and a.report]
    holds = lambda results: all(c is not None and c.holds for c in results)  # noqa: E731
    winner = next(((a, res) for a, res in held if holds(res)), None)
    shown = winner[1] if winner else held[-1][1] if held else none  # the candidate that holds, else the last
    solved = ("on the branch" if holds(branch) else
              f"held for review (item {winner[0].review_id})" if winner else "no")
    approve = [winner[0].review_id] if winner else [held[-1][0].review_id] if held else []
    if solved == "no" and held:
        # no one held candidate meets every criterion, but each criterion holds on the branch or on one of them
        # (a fix held for review is not the base of the next attempt, so two held fixes each do part): the
        # items together, each judged on its own and reviewed apart
        parts = [None if b is not None and b.holds else
                 next(((a, res[i]) for a, res in held if res[i] is not None and res[i].holds), False)
                 for i, b in enumerate(branch)]
        if all(part is not False for part in parts):
            items = sorted({part[0].review_id for part in parts if part})
            shown = [part[1] if part else last for part, last in zip(parts, shown, strict=True)]
            solved = f"held for review (items {', '.join(map(str, items))} together, each fixing part)"
            approve = items
    return {"name": scenario.name, "risk": scenario.risk, "solved": solved,
            "acceptance": [{"expr": expr, "branch": b.value if b else None, "branch_holds": b.holds if b else None,
                            "held": h.value if h else None, "held_holds": h.holds if h else None}
                           for expr, b, h in zip(scenario.acceptance, branch, shown, strict=True)],
            "review_items": [a.review_id for a, _ in held], "approve": approve}


def summarise(agent: Agent, scenario: Scenario | None = None) -> dict:
    initial, final = agent.initial, agent.feedback
    failing_before = [r.probe for r in initial.results if not r.ok] if initial else []
    failing_after = [r.probe for r in final.results if not r.ok] if final else []
    held_fixes = {c.probe for a in agent.attempts if a.decision == "held" and a.report
                  for c in a.report.comparisons if c.candidate.value == "pass"}
    unaddressed = [p for p in failing_after if p not in held_fixes]
    attempts = []
    for a in agent.attempts:
        deltas = []
        if a.report:
            deltas = [f"{c.probe}.{d.name}: {d.baseline:.3g} -> {d.candidate:.3g}"
                      for c in a.report.comparisons for d in c.deltas
                      if d.baseline is not None and d.candidate is not None
                      and (d.verdict in ("improved", "regressed") or c.baseline != c.candidate)]
        attempts.append({"step": a.step, "playbook": a.playbook, "hypothesis": a.hypothesis, "verdict": a.verdict,
                         "decision": a.decision, "reason": a.reason, "commit": a.commit, "branch": a.branch,
                         "risk": a.risk, "deltas": deltas})
    return {
        "session": agent.ws.session, "target": agent.ws.target_label, "branch": agent.ws.branch,
        "head": agent.ws.head(), "backend": agent.backend.name, "model": getattr(agent.backend, "model", None),
        "outcome": agent.outcome, "summary": agent.summary_text, "steps": agent.step,
        "usage": agent.usage, "failing_before": failing_before, "failing_after": failing_after,
        "unaddressed": unaddressed, "attempts": attempts,
        "accepted": sum(a["decision"] == "accepted" for a in attempts),
        "held": sum(a["decision"] == "held" for a in attempts),
        "rejected": sum(a["decision"] in ("discarded", "refused") for a in attempts),
        "trajectory": str(agent.trajectory.path),
        "exit_code": 0 if agent.outcome == "finished" and not unaddressed else 1,
        "api_key_env": [v for v in KEY_VARS if os.environ.get(v)],
        "scenario": scenario_outcome(agent, scenario) if scenario else None,
    }


def render_summary(s: dict, console: Console) -> None:
    title = f"session {s['session']}: {s['outcome']} after {s['steps']} step(s)"
    if console.width < NARROW_COLUMNS:  # one block per attempt, every metric name whole
        console.print(f"[bold]{title}[/]", highlight=False)
        for a in s["attempts"]:
            style = {"accepted": "green", "held": "yellow"}.get(a["decision"], "red")
            console.print(f"step {a['step']} {a['playbook'] or '-'}: {a['verdict']} -> [{style}]{a['decision']}[/]",
                          highlight=False)
            for line in [a["reason"], *a["deltas"][:3]]:
                console.print(f"  {line}", highlight=False, soft_wrap=True)
    else:
        table = Table(title=title, title_justify="left")
        for col in ("step", "playbook", "verdict", "decision", "evidence"):
            table.add_column(col, overflow="fold")
        for a in s["attempts"]:
            style = {"accepted": "green", "held": "yellow"}.get(a["decision"], "red")
            table.add_row(str(a["step"]), a["playbook"] or "-", a["verdict"], f"[{style}]{a['decision']}[/]",
                          "\n".join([a["reason"], *a["deltas"][:3]]))
        console.print(table)
    console.print(f"attempts {len(s['attempts'])}: accepted {s['accepted']}, held for review {s['held']}, "
                  f"rejected {s['rejected']}; branch {s['branch']} at {s['head'][:10]}")
    if s["failing_before"]:
        console.print(f"failing before: {', '.join(s['failing_before'])}")
    console.print(f"failing now on the branch: {', '.join(s['failing_after']) or 'none'}"
                  + (f" (fixes held for review: {', '.join(sorted(set(s['failing_after']) - set(s['unaddressed'])))})"
                     if set(s["failing_after"]) - set(s["unaddressed"]) else ""))
    if s["summary"]:
        console.print(f"agent: {s['summary']}", soft_wrap=True, highlight=False)
    if s.get("scenario"):
        sc = s["scenario"]
        console.print(f"scenario {sc['name']} ({sc['risk']}): solved {sc['solved']}", highlight=False)
        for c in sc["acceptance"]:
            fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
            console.print(f"  {c['expr']}: branch {fmt(c['branch'])}, held {fmt(c['held'])}", highlight=False)
        items = sc.get("approve") or sc["review_items"][-1:]  # (an older summary has no "approve")
        if items:
            console.print("  approve with: " + "; ".join(f"infra-agent review approve {i}" for i in items),
                          highlight=False)
    console.print(f"[dim]trajectory {s['trajectory']}[/]", highlight=False, soft_wrap=True)  # a path stays whole


def _clip(text: str, limit: int) -> str:
    """``text`` cut at the last whole word (a path or a metric is never cut in two) within ``limit``."""
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0].rstrip(" .,;:")
    return f"{cut} ..."
