"""The agent loop: a backend proposes actions, the harness judges patches, everything is recorded.

Control flow is a handful of exceptions: :class:`Submitted` (the backend finished),
:class:`LimitsExceeded` (steps, wall time, tokens/cost, or too many malformed actions),
:class:`FormatError` (a malformed action: the model is told and may retry) and
:class:`Interrupted` (Ctrl-C).  The trajectory is written as JSONL after every step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import time
from collections.abc import Callable
from typing import Any, Protocol

from feedback.harness import judge
from feedback.models import FeedbackReport, Status
from feedback.verdict import evidence, verdict
from infra_agent import gate
from infra_agent.patch import Patch, PatchError
from infra_agent.workspace import GitWorkspace

# --- control flow -----------------------------------------------------------------------------


class AgentException(Exception):
    pass


class Submitted(AgentException):
    pass


class LimitsExceeded(AgentException):
    pass


class FormatError(AgentException):
    """A malformed action; the message goes back to the model."""


class Interrupted(AgentException):
    pass


# --- actions ------------------------------------------------------------------------------------

TOOLS: list[dict] = [
    {"name": "read_file", "description": "Read lines of a file of the target (1-based, inclusive).",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"},
                                                     "end": {"type": "integer"}}, "required": ["path"]}},
    {"name": "grep", "description": "Search the target's files for a regex; glob limits the files.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "glob": {"type": "string"}},
                    "required": ["pattern"]}},
    {"name": "list_files", "description": "List the files under a directory of the target.",
     "parameters": {"type": "object", "properties": {"dir": {"type": "string"}}}},
    {"name": "run_probes", "description": "Run probes of the manifest on the current baseline; returns the report.",
     "parameters": {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "string"}}},
                    "required": ["ids"]}},
    {"name": "propose_patch",
     "description": "Propose a change as a unified diff (paths relative to the target root). It is applied in a "
                    "fresh worktree and judged by the probes covering the changed files, against the baseline.",
     "parameters": {"type": "object", "properties": {
         "hypothesis": {"type": "string", "description": "what is wrong and why this change fixes or speeds it"},
         "diff": {"type": "string"}, "playbook_id": {"type": "string"}}, "required": ["hypothesis", "diff"]}},
    {"name": "list_playbooks", "description": "List the optimisation playbooks.",
     "parameters": {"type": "object", "properties": {}}},
    {"name": "show_playbook", "description": "Show one playbook: applicability, transformation, validation.",
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}},
    {"name": "finish", "description": "End the session with a summary of what was found and done.",
     "parameters": {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}},
]
TOOL_NAMES = {t["name"] for t in TOOLS}


def openai_tools() -> list[dict]:
    return [{"type": "function", "function": t} for t in TOOLS]


@dataclasses.dataclass
class Action:
    name: str
    args: dict[str, Any]
    message: dict | None = None  # the assistant message that carried it (OpenAI format)
    call_id: str | None = None

    def validate(self) -> None:
        if self.name not in TOOL_NAMES:
            raise FormatError(f"unknown tool {self.name!r}; the tools are: {', '.join(sorted(TOOL_NAMES))}")
        spec = next(t for t in TOOLS if t["name"] == self.name)["parameters"]
        missing = [k for k in spec.get("required", []) if k not in self.args]
        if missing:
            raise FormatError(f"{self.name} needs {', '.join(missing)}")
        for k, v in self.args.items():
            want = spec["properties"].get(k, {}).get("type")
            ok = {"string": str, "integer": int, "array": list, None: object}.get(want, object)
            if not isinstance(v, ok) or (want == "integer" and isinstance(v, bool)):
                raise FormatError(f"{self.name}: argument {k} must be a {want}")


# --- protocols ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Attempt:
    step: int
    hypothesis: str
    playbook: str | None
    verdict: str  # better / worse / incorrect / inconclusive / unchanged (feedback.verdict), invalid / refused
    decision: str  # accepted / held / discarded / refused
    reason: str
    commit: str | None = None
    branch: str | None = None
    report: FeedbackReport | None = None
    risk: list[str] = dataclasses.field(default_factory=list)
    diff: str = ""
    review_id: int | None = None
    record: pathlib.Path | None = None


@dataclasses.dataclass
class AgentState:
    goal: str
    messages: list[dict]
    feedback: FeedbackReport  # the latest report on the baseline
    tree: pathlib.Path  # the baseline worktree
    attempts: list[Attempt]
    step: int
    rejected_playbooks: list[str] = dataclasses.field(default_factory=list)  # by reviewers, earlier sessions


class Backend(Protocol):
    name: str
    model: str | None

    def next_action(self, state: AgentState) -> Action: ...


class Workspace(Protocol):
    def baseline(self): ...
    def new_candidate(self): ...
    def apply(self, cand, diff: str) -> None: ...
    def accept(self, cand, message: str) -> str: ...
    def keep_for_review(self, cand, message: str) -> str: ...
    def discard(self, cand) -> None: ...
    def head(self) -> str: ...


@dataclasses.dataclass
class Limits:
    max_steps: int = 20
    time_limit_s: float = 1800.0
    max_cost_usd: float = 5.0
    max_tokens: int = 2_000_000
    max_format_errors: int = 3


# --- observations -----------------------------------------------------------------------------------


def render_report(report: FeedbackReport, limit: int = 40) -> str:
    """Dense: one line per probe with its key metrics, then every localisation line."""
    lines = []
    for r in report.results:
        ms = ", ".join(f"{k}={m.value:.3g}{m.unit and ' ' + m.unit}" for k, m in list(r.metrics.items())[:4])
        extra = f" ({r.reason})" if r.reason and r.status != Status.passed else ""
        lines.append(f"- {r.probe}: {r.status.value}{extra}" + (f"; {ms}" if ms else ""))
    lines += [f"x {ln}" for ln in report.localisations()]
    lines += [f"acceptance {a.name}: {a.expression} -> {'ok' if a.holds else 'FAILED' if a.holds is False else 'n/a'}"
              for a in report.acceptance]
    if report.stopped_at:
        lines.append(f"(cascade stopped after stage {report.stopped_at})")
    return "\n".join(lines[:limit])


_SECRET = re.compile(r"(sk-[A-Za-z0-9_\-]{12,}|(?i:bearer)\s+[A-Za-z0-9._\-]{12,})")


def redact(text: str) -> str:
    for var in ("ZAI_API_KEY", "OPENAI_API_KEY"):
        val = os.environ.get(var)
        if val and len(val) >= 8:
            text = text.replace(val, "[redacted]")
    return _SECRET.sub("[redacted]", text)


class Trajectory:
    def __init__(self, path: pathlib.Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        line = redact(json.dumps(record, default=str))
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


SYSTEM_PROMPT = """You are a performance and correctness engineer working on an LLM inference stack.
A harness judges every change you propose with local probes (correctness against float64
references, microbenchmarks, traces, runtime events, serving metrics) and tells you exactly which
kernel, file, parameter or input condition a problem is bound to. Work from that evidence:
state a hypothesis, propose the smallest patch that tests it (a unified diff against the
target root), read the verdict, and iterate. Probes, references, tests and the manifest are
protected: a patch touching them is refused. Patches touching numerics, concurrency or production
behaviour are held for a human reviewer. Call finish when nothing the feedback flags is left."""


# --- the loop -------------------------------------------------------------------------------------------


class Agent:
    def __init__(self, backend: Backend, workspace: GitWorkspace, goal: str, limits: Limits | None = None,
                 trajectory: pathlib.Path | None = None, jobs: int = 2,
                 on_event: Callable[[str, dict], None] | None = None):
        self.backend = backend
        self.ws = workspace
        self.goal = goal
        self.limits = limits or Limits()
        self.trajectory = Trajectory(trajectory or workspace.state_dir / "trajectory.jsonl")
        self.jobs = jobs
        # content-keyed, so shared by the baseline, the candidates and the other sessions of the target
        self.cache_dir = workspace.state_dir.parent / "cache"
        from infra_agent.review import ReviewQueue

        self.queue = ReviewQueue(workspace.state_dir.parent.parent / "review.db")
        self.experiments_dir = workspace.state_dir.parent.parent / "experiments"
        self.emit = on_event or (lambda kind, data: None)
        self.attempts: list[Attempt] = []
        self.messages: list[dict] = []
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
        self.started = time.monotonic()
        self.format_errors = 0
        self.step = 0
        self.feedback: FeedbackReport | None = None
        self.initial: FeedbackReport | None = None
        self.outcome = "running"
        self.rejected_playbooks: list[str] = []
        self.summary_text = ""

    # -- running --

    def judge_baseline(self) -> FeedbackReport:
        base = self.ws.baseline()
        self.emit("judging", {"what": "baseline", "tree": str(base.path)})
        report = judge(base.path, jobs=self.jobs, run_all=True, label=f"baseline {base.base[:10]}",
                       cache_dir=self.cache_dir)
        self.emit("feedback", {"report": report})
        return report

    def run(self) -> str:
        try:
            self.feedback = self.initial = self.judge_baseline()
            rejected = self.queue.rejections(self.ws.target_label)
            self.rejected_playbooks = sorted({i.playbook for i in rejected if i.playbook})
            notes = "".join(f"\n- {i.playbook or 'patch'} ({i.hypothesis[:80]}): rejected by {i.settled_by}: {i.reason}"
                            for i in rejected[-10:])
            self.messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Goal: {self.goal}\n\nTarget: {self.ws.target_label}\n"
                                            + (f"Reviewers rejected earlier patches on this target:{notes}\n"
                                               if notes else "")
                                            + f"Feedback on the baseline:\n{render_report(self.feedback)}"},
            ]
            for m in self.messages:
                self.trajectory.write({"step": 0, **m})
            while True:
                self._check_limits()
                self.step += 1
                self._one_step()
        except Submitted as s:
            self.outcome, self.summary_text = "finished", str(s)
        except LimitsExceeded as e:
            self.outcome, self.summary_text = "limits", str(e)
        except (Interrupted, KeyboardInterrupt):
            self.outcome, self.summary_text = "interrupted", "stopped by the user"
        except RuntimeError as exc:  # the backend cannot go on (endpoint down after retries, say)
            self.outcome, self.summary_text = "error", str(exc)
        self.trajectory.write({"step": self.step, "role": "session", "outcome": self.outcome,
                               "summary": self.summary_text})
        return self.outcome

    def _check_limits(self) -> None:
        lim = self.limits
        if self.step >= lim.max_steps:
            raise LimitsExceeded(f"step limit {lim.max_steps} reached")
        if time.monotonic() - self.started > lim.time_limit_s:
            raise LimitsExceeded(f"time limit {lim.time_limit_s:g}s reached")
        if self.usage["cost_usd"] > lim.max_cost_usd:
            raise LimitsExceeded(f"cost limit ${lim.max_cost_usd:g} reached")
        if self.usage["prompt_tokens"] + self.usage["completion_tokens"] > lim.max_tokens:
            raise LimitsExceeded(f"token limit {lim.max_tokens} reached")

    def state(self) -> AgentState:
        return AgentState(goal=self.goal, messages=self.messages, feedback=self.feedback,
                          tree=self.ws.baseline().path, attempts=self.attempts, step=self.step,
                          rejected_playbooks=self.rejected_playbooks)

    def _one_step(self) -> None:
        try:
            action = self.backend.next_action(self.state())
            action.validate()
        except FormatError as exc:
            self.format_errors += 1
            note = f"format error: {exc}"
            self.messages.append({"role": "user", "content": note})
            self.trajectory.write({"step": self.step, "role": "user", "content": note, "format_error": True})
            self.emit("format_error", {"message": str(exc)})
            if self.format_errors >= self.limits.max_format_errors:
                raise LimitsExceeded(f"{self.format_errors} malformed actions in a row") from exc
            return
        self.format_errors = 0
        for k in ("prompt_tokens", "completion_tokens", "cost_usd"):
            self.usage[k] = getattr(self.backend, "usage", {}).get(k, self.usage[k])
        message = action.message or {"role": "assistant", "content": None, "tool_calls": [
            {"id": action.call_id or f"call_{self.step}", "type": "function",
             "function": {"name": action.name, "arguments": json.dumps(action.args)}}]}
        self.messages.append(message)
        self.trajectory.write({"step": self.step, **message})
        lim = self.limits
        budget = (f"step {self.step}/{lim.max_steps}, {time.monotonic() - self.started:.0f}/{lim.time_limit_s:.0f}s, "
                  f"{self.usage['prompt_tokens'] + self.usage['completion_tokens']} tokens, "
                  f"${self.usage['cost_usd']:.2f}")
        self.emit("action", {"step": self.step, "name": action.name, "args": action.args, "budget": budget})
        observation = self.execute(action)
        self.messages.append({"role": "tool", "tool_call_id": action.call_id or f"call_{self.step}",
                              "content": observation})
        self.trajectory.write({"step": self.step, "role": "tool", "content": observation})
        self.emit("observation", {"step": self.step, "name": action.name, "text": observation})

    # -- actions --

    def execute(self, action: Action) -> str:
        a = action.args
        tree = self.ws.baseline().path
        if action.name == "finish":
            raise Submitted(a.get("summary", ""))
        if action.name == "read_file":
            return _read_file(tree, a["path"], a.get("start", 1), a.get("end"))
        if action.name == "grep":
            return _grep(tree, a["pattern"], a.get("glob", "**/*"))
        if action.name == "list_files":
            return _list_files(tree, a.get("dir", "."))
        if action.name == "run_probes":
            try:
                report = judge(tree, probe_ids=a["ids"], jobs=self.jobs, run_all=True, cache_dir=self.cache_dir)
            except ValueError as exc:
                return f"error: {exc}"
            return render_report(report)
        if action.name == "list_playbooks":
            from playbooks.model import load_library

            return "\n".join(f"{p.id}: {p.title} [{', '.join(p.risk) or 'no risk category'}]"
                             for p in load_library().values())
        if action.name == "show_playbook":
            import yaml

            from playbooks.model import load_library

            lib = load_library()
            if a["id"] not in lib:
                return f"error: unknown playbook {a['id']!r}; known: {', '.join(lib)}"
            return yaml.safe_dump(lib[a["id"]].model_dump(mode="json", exclude_none=True), sort_keys=False)
        if action.name == "propose_patch":
            return self.propose_patch(a["hypothesis"], a["diff"], a.get("playbook_id"))
        raise FormatError(f"unknown tool {action.name!r}")  # pragma: no cover - validate() catches it

    def propose_patch(self, hypothesis: str, diff: str, playbook: str | None) -> str:
        base_commit = self.ws.head()
        try:
            return self._propose(hypothesis, diff, playbook)
        finally:
            self._record(self.attempts[-1], base_commit)

    def _record(self, a: Attempt, base_commit: str) -> None:
        """One experiment record per attempt, failures included; written atomically."""
        from infra_agent.experiments import Base, Decision, ExperimentRecord, ProbeRecord, new_id, now, write_record

        try:
            manifest = self.ws.manifest()
            kinds = {p.id: p.kind for p in manifest.probes}
            rec = ExperimentRecord(
                id=new_id(self.ws.session, a.step), time=now(), target=self.ws.target_label,
                scenario=getattr(self.ws, "scenario", None), base=Base(**self.ws.base_spec(base_commit)),
                hypothesis=a.hypothesis, playbook=a.playbook, diff=a.diff, risk=a.risk,
                probes=[ProbeRecord(id=r.probe, kind=kinds.get(r.probe, "?"),
                                    result=r.model_copy(update={"stdout": "", "stderr": r.stderr[-1000:]}))
                        for r in (a.report.results if a.report else [])],
                acceptance=[c.model_dump() for c in (a.report.acceptance if a.report else [])],
                verdict=a.verdict,
                decision=Decision(status={"accepted": "accepted", "held": "held", "discarded": "discarded"}.get(
                    a.decision, "refused" if a.verdict == "refused" else "failed"), reason=a.reason,
                    review_item=a.review_id, commit=a.commit, branch=a.branch),
                backend=self.backend.name, model=getattr(self.backend, "model", None),
                trajectory=str(self.trajectory.path))
            a.record = write_record(self.experiments_dir, rec)
        except Exception as exc:  # noqa: BLE001 - a record that cannot be written is reported, not fatal
            self.emit("warning", {"message": f"experiment record not written: {exc}"})

    def _propose(self, hypothesis: str, diff: str, playbook: str | None) -> str:
        manifest = self.ws.manifest()
        record = Attempt(step=self.step, hypothesis=hypothesis, playbook=playbook, verdict="invalid",
                         decision="refused", reason="", diff=diff)
        self.attempts.append(record)
        try:
            patch = Patch.parse(diff, manifest)
            record.diff = patch.diff
        except PatchError as exc:
            record.reason = str(exc)
            record.verdict = "refused" if str(exc).startswith("refused") else "invalid"
            self.emit("attempt", {"attempt": record})
            return f"patch {record.verdict}: {exc}"
        assessment = gate.assess(patch, manifest, self.ws.baseline().path)
        record.risk = [f.render() for f in assessment.findings] + ([assessment.error] if assessment.error else [])
        cand = self.ws.new_candidate()
        try:
            self.ws.apply(cand, patch.diff)
        except ValueError as exc:
            self.ws.discard(cand)
            record.reason = str(exc)
            self.emit("attempt", {"attempt": record})
            return f"patch invalid: {exc}"
        self.emit("judging", {"what": cand.name, "files": patch.paths})
        base = self.ws.baseline()
        report = judge(cand.path, changed=patch.paths, baseline_tree=base.path, baseline_label=base.base[:10],
                       label=cand.name, jobs=self.jobs, cache_dir=self.cache_dir)
        record.report = report
        judgement = report.verdict or verdict(report)
        record.verdict, record.reason = judgement.name, judgement.reason
        lines = [f"verdict: {record.verdict} ({judgement.reason})", render_report(report)]
        if judgement.broken_probes:
            lines.append("note: these probes are broken on the baseline too (not your patch): "
                         + "; ".join(judgement.broken_probes[:4]))
        if record.verdict != "better":
            record.decision = "discarded"
            self.ws.discard(cand)
            lines.append("decision: discarded; the baseline is unchanged")
        elif assessment.held:
            record.decision = "held"
            record.branch = self.ws.keep_for_review(cand, f"{hypothesis}\n\nplaybook: {playbook or '-'}")
            self.ws.discard(cand)
            from infra_agent.experiments import new_id

            record.review_id = self.queue.add(
                target=self.ws.target_label, repo=str(self.ws.root), session=self.ws.session,
                session_branch=self.ws.branch, candidate_branch=record.branch, hypothesis=hypothesis,
                playbook=playbook, diff=patch.diff, findings=[f.model_dump() for f in assessment.findings],
                evidence=evidence(report), validation=[r.probe for r in report.results],
                experiment=str(self.experiments_dir / f"{new_id(self.ws.session, record.step)}.yaml"))
            lines.append(f"decision: held for human review ({', '.join(assessment.categories)}); "
                         f"review item {record.review_id}, candidate branch {record.branch}")
            lines += [f"  gate: {r}" for r in record.risk[:8]]
        else:
            record.decision = "accepted"
            record.commit = self.ws.accept(cand, f"{hypothesis}\n\nplaybook: {playbook or '-'}")
            self.ws.discard(cand)
            self.feedback = self.judge_baseline()
            lines.append(f"decision: accepted as {record.commit[:10]}; it is the new baseline")
        self.emit("attempt", {"attempt": record})
        return "\n".join(lines)


# --- file actions ---------------------------------------------------------------------------------------


def _inside(tree: pathlib.Path, rel: str) -> pathlib.Path:
    p = (tree / rel).resolve()
    if tree.resolve() not in (p, *p.parents):
        raise FormatError(f"path {rel!r} is outside the target")
    return p


def _read_file(tree: pathlib.Path, rel: str, start: int = 1, end: int | None = None) -> str:
    p = _inside(tree, rel)
    if not p.is_file():
        return f"error: no file {rel}"
    lines = p.read_text(errors="replace").splitlines()
    start = max(1, start)
    end = min(len(lines), end if end else start + 199)
    body = "\n".join(f"{i:5d}  {lines[i - 1]}" for i in range(start, end + 1))
    more = f"\n... ({len(lines) - end} more lines)" if end < len(lines) else ""
    return f"{rel} lines {start}-{end} of {len(lines)}\n{body}{more}"


def _grep(tree: pathlib.Path, pattern: str, glob: str = "**/*", cap: int = 80) -> str:
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise FormatError(f"grep: invalid regex {pattern!r}: {exc}") from exc
    hits = []
    for p in sorted(tree.glob(glob)):
        if not p.is_file() or {".git", ".infra-agent", "__pycache__"} & set(p.relative_to(tree).parts):
            continue
        try:
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{p.relative_to(tree)}:{i}: {line.strip()[:160]}")
        except (UnicodeDecodeError, OSError):
            continue
    more = f"\n... {len(hits) - cap} more matches" if len(hits) > cap else ""
    return ("\n".join(hits[:cap]) + more) if hits else "no matches"


def _list_files(tree: pathlib.Path, rel: str = ".", cap: int = 300) -> str:
    d = _inside(tree, rel)
    if not d.is_dir():
        return f"error: no directory {rel}"
    files = [str(p.relative_to(tree)) for p in sorted(d.rglob("*")) if p.is_file()
             and not {".git", ".infra-agent", "__pycache__"} & set(p.relative_to(tree).parts)]
    more = f"\n... {len(files) - cap} more" if len(files) > cap else ""
    return "\n".join(files[:cap]) + more
